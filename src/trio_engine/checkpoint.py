"""Checkpoint I/O: safetensors for tensors, JSON for metadata, never pickle.

Training state (resume training)::

    <folder>/adapter.safetensors      "<module>.lora_A" (r, in), "<module>.lora_B" (out, r)
    <folder>/optimizer.safetensors    "exp_avg.<key>", "exp_avg_sq.<key>"  (optional)
    <folder>/trio_state.json          LoRA config, optimizer step, base model, format

Sampler weights are a standard PEFT LoRA folder (adapter_config.json +
adapter_model.safetensors) that peft, vLLM and others load as is.

Checkpoints are device-independent: ``save_*`` writes CPU copies, ``load_*`` returns CPU
tensors, and the host copies them onto its own device.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .errors import InvalidInputError
from .lora import LoraConfig
from .model import ALL_ATTN, ALL_MLP, UNEMBED
from .optim import AdamState

FORMAT = "trio-training-state/1"
PEFT_PREFIX = "base_model.model."


@dataclass
class TrainingState:
    config: LoraConfig
    weights: dict[str, torch.Tensor]
    optim: AdamState | None
    base_model: str


def save_training_state(
    folder: str | Path,
    params: dict[str, torch.Tensor],
    config: LoraConfig,
    optim: AdamState | None,
    base_model: str,
) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(_detached(params), folder / "adapter.safetensors")
    if optim is not None:
        moments = {f"exp_avg.{k}": v for k, v in optim.exp_avg.items()}
        moments.update({f"exp_avg_sq.{k}": v for k, v in optim.exp_avg_sq.items()})
        save_file(_detached(moments), folder / "optimizer.safetensors")
    meta = {
        "format": FORMAT,
        "base_model": base_model,
        "lora_config": asdict(config),
        "optimizer_step": optim.step if optim is not None else None,
    }
    (folder / "trio_state.json").write_text(json.dumps(meta, indent=2))


def load_training_state(folder: str | Path, with_optimizer: bool) -> TrainingState:
    folder = Path(folder)
    meta_path = folder / "trio_state.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"no training state at {folder}")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise InvalidInputError(f"path: unsupported checkpoint format {meta.get('format')!r}")
    config = LoraConfig(**meta["lora_config"])
    weights = load_file(folder / "adapter.safetensors", device="cpu")
    optim = None
    if with_optimizer:
        if meta["optimizer_step"] is None:
            raise InvalidInputError(f"path: checkpoint at {folder} was saved without optimizer state")
        moments = load_file(folder / "optimizer.safetensors", device="cpu")
        optim = AdamState(
            step=int(meta["optimizer_step"]),
            exp_avg={k[len("exp_avg.") :]: v for k, v in moments.items() if k.startswith("exp_avg.")},
            exp_avg_sq={
                k[len("exp_avg_sq.") :]: v for k, v in moments.items() if k.startswith("exp_avg_sq.")
            },
        )
    return TrainingState(config, weights, optim, meta["base_model"])


def save_peft_adapter(
    folder: str | Path, params: dict[str, torch.Tensor], config: LoraConfig, base_model: str
) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # "<module>.lora_A" -> "base_model.model.<module>.lora_A.weight", PEFT's key layout
    tensors = {f"{PEFT_PREFIX}{k}.weight": v for k, v in _detached(params).items()}
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        # the layers the adapter really has (a family's own names, e.g. Phi-3's qkv_proj)
        "target_modules": sorted({key.rsplit(".", 2)[-2] for key in params}),
    }
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))


def load_peft_adapter(folder: str | Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    folder = Path(folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    targets = set(cfg["target_modules"])
    config = LoraConfig(
        rank=int(cfg["r"]),
        train_attn=bool(targets & set(ALL_ATTN)),
        train_mlp=bool(targets & set(ALL_MLP)),
        train_unembed=bool(targets & set(UNEMBED)),
        alpha=float(cfg["lora_alpha"]),
    )
    raw = load_file(folder / "adapter_model.safetensors", device="cpu")
    weights = {
        k[len(PEFT_PREFIX) : -len(".weight")]: v.float() for k, v in raw.items()
    }
    return config, weights


def _detached(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies, whatever device the tensors live on."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
