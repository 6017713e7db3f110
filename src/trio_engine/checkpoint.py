"""Checkpoint I/O: safetensors for tensors, JSON for metadata, never pickle.

Training state (resume training)::

    <folder>/adapter.safetensors      "<module>.lora_A" (r, in), "<module>.lora_B" (out, r)
    <folder>/optimizer.safetensors    "exp_avg.<key>", "exp_avg_sq.<key>"  (optional)
    <folder>/trio_state.json          LoRA config, optimizer step, base model, format

Sampler weights are a standard PEFT LoRA folder (adapter_config.json +
adapter_model.safetensors) that peft, vLLM and others load as is.

Checkpoints are device-independent: ``save_*`` writes CPU copies, ``load_*`` returns CPU
tensors, and the host copies them onto its own device.

Writes are atomic per folder (``write_folder``): the files go into a hidden sibling
``.<name>.tmp-<pid>-<thread>``, are fsynced, and the folder is renamed into place. A
folder cannot be renamed over a non-empty one, so replacing a checkpoint moves the old
folder aside (``.<name>.old-<pid>-<thread>``), renames the new one in, then removes the
old. A failed write (disk full, read-only, permission) removes the temporary folder,
leaves the old checkpoint where it was, and raises ``CheckpointWriteError``. The one
crash window is between the two renames: the name is briefly missing and the old folder
sits under its ``.old-`` name; ``recover_folders`` (run at service start-up) renames it
back and removes the temporary debris of interrupted writes.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .device import fetched
from .errors import CheckpointWriteError, InvalidInputError
from .lora import LoraConfig, LoRAExperts
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
    """Write a training state folder atomically (see the module docstring).

    Raises:
        CheckpointWriteError: the folder could not be written; an old one is unchanged.
    """
    tensors = _detached(params)
    moments: dict[str, torch.Tensor] | None = None
    if optim is not None:
        moments = _detached({f"exp_avg.{k}": v for k, v in optim.exp_avg.items()}
                            | {f"exp_avg_sq.{k}": v for k, v in optim.exp_avg_sq.items()})
    meta = {
        "format": FORMAT,
        "base_model": base_model,
        "lora_config": asdict(config),
        "optimizer_step": optim.step if optim is not None else None,
    }

    def fill(tmp: Path) -> None:
        save_file(tensors, tmp / "adapter.safetensors")
        if moments is not None:
            save_file(moments, tmp / "optimizer.safetensors")
        (tmp / "trio_state.json").write_text(json.dumps(meta, indent=2))

    write_folder(folder, fill)


def load_training_state(folder: str | Path, with_optimizer: bool) -> TrainingState:
    """A training state folder as CPU tensors and its config.

    Raises:
        FileNotFoundError: the folder holds no training state.
        InvalidInputError: it is of another format, damaged, or (``with_optimizer``) has no
            optimizer state.
    """
    folder = Path(folder)
    meta_path = folder / "trio_state.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"no training state at {folder}")
    with _readable(folder):
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT:
            raise InvalidInputError(f"path: unsupported checkpoint format {meta.get('format')!r}")
        config = LoraConfig(**meta["lora_config"])
        weights = load_file(folder / "adapter.safetensors", device="cpu")
        optim = None
        if with_optimizer:
            step = meta["optimizer_step"]
            if step is None:
                raise InvalidInputError(f"path: checkpoint at {folder} was saved without optimizer state")
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise InvalidInputError(f"path: the checkpoint's optimizer step is {step!r}, not a count")
            moments = load_file(folder / "optimizer.safetensors", device="cpu")
            optim = AdamState(
                step=step,
                exp_avg={k[len("exp_avg.") :]: v for k, v in moments.items() if k.startswith("exp_avg.")},
                exp_avg_sq={
                    k[len("exp_avg_sq.") :]: v for k, v in moments.items() if k.startswith("exp_avg_sq.")
                },
            )
        return TrainingState(config, weights, optim, meta["base_model"])


@contextmanager
def _readable(folder: Path) -> Iterator[None]:
    """Turn what a damaged or foreign checkpoint raises while it is read (a missing key, a
    wrong type, bad JSON, a broken safetensors file) into InvalidInputError on ``path``."""
    try:
        yield
    except InvalidInputError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IsADirectoryError,
            SafetensorError) as exc:
        raise InvalidInputError(f"path: the checkpoint at {folder.name!r} cannot be read "
                                f"({type(exc).__name__}: {exc})", field="path") from exc


def save_peft_adapter(
    folder: str | Path, params: dict[str, torch.Tensor], config: LoraConfig, base_model: str
) -> None:
    """Write a PEFT adapter folder atomically (see the module docstring).

    Raises:
        CheckpointWriteError: the folder could not be written; an old one is unchanged.
    """
    tensors = dict(_peft_tensor(name, tensor) for name, tensor in _detached(params).items())
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
        "target_modules": sorted({key.rsplit(".", 2)[-2] for key, t in params.items() if t.dim() == 2}),
        # and the experts' ("experts.gate_up_proj": ``LoRAExperts``), which peft adapts as parameters
        "target_parameters": sorted({".".join(key.rsplit(".", 3)[-3:-1]) for key, t in params.items() if t.dim() == 3}),
    }

    def fill(tmp: Path) -> None:
        save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))

    write_folder(folder, fill)


# peft adapts experts (3-D tensors) as parameters: one ``lora.ParamWrapper`` per tensor,
# nested in the order the module registers them (the first innermost, under the others'
# ``base_layer``), A as (E·r, in) and B as (out, r·E) with the expert the fastest index of
# B's columns (peft's ``ParamWrapper.get_delta_weight``). Ours: A (E, r, in), B (E, out, r).


def _peft_tensor(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Our adapter tensor as peft's key and layout."""
    if tensor.dim() == 2:
        return f"{PEFT_PREFIX}{name}.weight", tensor  # "<module>.lora_A" -> "base_model.model.<module>.lora_A.weight"
    experts_path, part, matrix = name.rsplit(".", 2)
    nesting = ".base_layer" * (len(LoRAExperts.PARTS) - 1 - LoRAExperts.PARTS.index(part))
    experts, rows, cols = tensor.shape
    if matrix == "lora_A":  # (E, r, in) -> (E·r, in)
        peft = tensor.reshape(experts * rows, cols)
    else:  # (E, out, r) -> (out, r·E)
        peft = tensor.permute(1, 2, 0).reshape(rows, cols * experts)
    return f"{PEFT_PREFIX}{experts_path}{nesting}.{matrix}.weight", peft.contiguous()


# adapter_config.json settings that make an adapter other than plain LoRA on linear layers
# (which a TRIO adapter cannot hold, or which peft applies another way): each must be
# absent, empty, or as given
PEFT_PLAIN_LORA: dict[str, object] = {
    "peft_type": "LORA", "bias": "none", "fan_in_fan_out": False, "use_dora": False, "lora_bias": False,
    "use_qalora": False, "use_bdlora": False, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": [],
    "trainable_token_indices": [], "layer_replication": [],
    "alora_invocation_tokens": [], "arrow_config": {}, "kasa_config": {}, "monteclora_config": {},
    "velora_config": {},
}
# initialisations that move the base weights (the adapter expects them moved unless saved
# converted, when peft writes plain LoRA)
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# the copy of the base head peft saves beside an adapted one (its save_embedding_layers)
PEFT_HEAD_COPIES = tuple(f"{head}.base_layer.weight" for head in UNEMBED)


def load_peft_adapter(folder: str | Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """A PEFT LoRA folder as a config and ``"<module>.lora_A"``/``"<module>.lora_B"`` fp32
    tensors. The kinds of layers (``train_attn`` ...) are read off the tensors, whatever
    form ``target_modules`` takes (names, full paths as peft writes for "all-linear", a
    regex). rsLoRA's scale (alpha / sqrt(r)) is kept by loading its alpha as alpha·sqrt(r).
    A copy of the base head that peft saves beside an adapted one (``lm_head.base_layer.weight``,
    its ``save_embedding_layers``) is not among them: ``head_copy_fault`` checks it against
    the model's own.

    Raises:
        InvalidInputError: the adapter is not plain LoRA on linear layers and experts'
            ``gate_up_proj``/``down_proj`` (DoRA, biases, per-layer ranks, saved modules,
            other parameters, ...: ``PEFT_PLAIN_LORA``), was
            initialised by moving the base weights, or the folder cannot be read.
    """
    folder = Path(folder)
    with _readable(folder):
        cfg = json.loads((folder / "adapter_config.json").read_text())
        _refuse_other_than_plain_lora(cfg)
        weights = {}
        for key, tensor in load_file(folder / "adapter_model.safetensors", device="cpu").items():
            if key.startswith(PEFT_PREFIX) and key.endswith(PEFT_HEAD_COPIES):
                continue
            if not (key.startswith(PEFT_PREFIX) and key.endswith((".lora_A.weight", ".lora_B.weight"))):
                raise InvalidInputError(f"path: adapter_model.safetensors holds {key!r}, not a LoRA A or B "
                                        f"matrix ({PEFT_PREFIX}<module>.lora_A.weight)", field="path")
            name, tensor = _from_peft(key[len(PEFT_PREFIX) : -len(".weight")], tensor.float(), cfg)
            weights[name] = tensor
        rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
        config = LoraConfig(rank=rank, alpha=alpha * math.sqrt(rank) if cfg.get("use_rslora") else alpha,
                            **_kinds_of({key.rsplit(".", 2)[-2] for key in weights}))
        return config, weights


def _kinds_of(layers: set[str]) -> dict[str, bool]:
    """``LoraConfig``'s kinds of layers (``train_attn`` ...) that a set of layer names holds."""
    return {"train_attn": bool(layers & set(ALL_ATTN)), "train_mlp": bool(layers & set(ALL_MLP)),
            "train_unembed": bool(layers & set(UNEMBED))}


def saved_lora_config(folder: str | Path) -> LoraConfig:
    """The LoRA config a checkpoint folder holds, read without its tensors: a training
    state's own, or a PEFT folder's rank and the kinds of layers its ``target_modules``
    name (as TRIO writes them: module names)."""
    folder = Path(folder)
    with _readable(folder):
        if (folder / "trio_state.json").exists():
            return LoraConfig(**json.loads((folder / "trio_state.json").read_text())["lora_config"])
        cfg = json.loads((folder / "adapter_config.json").read_text())
        targets = cfg.get("target_modules") or ()
        layers = {targets} if isinstance(targets, str) else {name.rsplit(".", 1)[-1] for name in targets}
        return LoraConfig(rank=int(cfg["r"]), **_kinds_of(layers))


# A PEFT head copy in bf16 of an fp32 head (or the other way) is off by bf16's rounding,
# under 2^-8 of each weight: twice that still tells a trained or another head apart
HEAD_COPY_RTOL = 2**-7


def head_copy_fault(folder: str | Path, head: torch.Tensor) -> str | None:
    """What is wrong with the copy of the base head a PEFT folder may hold beside an
    adapted head (``lm_head.base_layer.weight``, peft's ``save_embedding_layers``), or None
    (no copy, or a copy of ``head`` within bf16's rounding). peft loads such a copy over the
    model's own head; TRIO's base is shared, so an adapter expecting another head must not
    run on this one."""
    folder = Path(folder)
    with _readable(folder), safe_open(folder / "adapter_model.safetensors", framework="pt") as file:
        # the header names the tensors: only a head copy, if any, is read from the disk
        copies = {key: file.get_tensor(key) for key in file.keys()
                  if key.startswith(PEFT_PREFIX) and key.endswith(PEFT_HEAD_COPIES)}
    if not copies:  # the usual case: no fp32 copy of the head (2 GB on a 128k-vocabulary 8B model)
        return None
    ours = head.detach().float()
    for key, copy in copies.items():
        if copy.shape != ours.shape:
            return (f"adapter_model.safetensors holds {key} of shape {tuple(copy.shape)}, where this model's head "
                    f"is {tuple(ours.shape)} (a resized vocabulary?)")
        theirs = copy.to(ours.device).float()
        floor = HEAD_COPY_RTOL * 1e-3 * float(ours.abs().max())  # for weights near 0
        if not torch.allclose(theirs, ours, rtol=HEAD_COPY_RTOL, atol=floor):
            return (f"adapter_model.safetensors holds {key}, a head {float((ours - theirs).abs().max()):.3g} off "
                    "this model's at most: the adapter expects another base head, which peft would load over "
                    "the model's and TRIO's shared base cannot")
    return None


def _from_peft(name: str, tensor: torch.Tensor, cfg: dict[str, Any]) -> tuple[str, torch.Tensor]:
    """A peft tensor (its key less prefix and ``.weight``) as our name and layout (the
    inverse of ``_peft_tensor``; which experts' part a nested key is, from the config's
    ``target_parameters``)."""
    module, matrix = name.rsplit(".", 1)
    depth = 0
    while module.endswith(".base_layer"):
        module, depth = module[: -len(".base_layer")], depth + 1
    targets = cfg.get("target_parameters") or []
    # a target names a parameter (peft matches it as a suffix of the parameter's path), so a
    # linear layer's key, whose module is named as a linear (q_proj, a shared expert's
    # down_proj), is never an experts' part, whatever a bare name would match
    linear = module.rpartition(".")[2] in (*ALL_ATTN, *ALL_MLP, *UNEMBED)
    parts = [] if linear else [part for part in LoRAExperts.PARTS
                               if any(f"{module}.{part}" == t or f"{module}.{part}".endswith("." + t) for t in targets)]
    if not parts:
        if depth:
            raise InvalidInputError(f"path: adapter_model.safetensors holds {name!r}, under a base_layer of a module "
                                    "no target_parameters entry names", field="path")
        return name, tensor
    rank = int(cfg["r"])
    if depth >= len(parts) or tensor.dim() != 2 or tensor.shape[matrix == "lora_B"] % rank:
        raise InvalidInputError(f"path: adapter_model.safetensors holds {name!r}, which fits none of the "
                                f"{parts} that target_parameters names on {module!r}", field="path")
    part = parts[len(parts) - 1 - depth]
    if matrix == "lora_A":  # (E·r, in) -> (E, r, in)
        ours = tensor.reshape(-1, rank, tensor.shape[1])
    else:  # (out, r·E) -> (E, out, r)
        ours = tensor.reshape(tensor.shape[0], rank, -1).permute(2, 0, 1)
    return f"{module}.{part}.{matrix}", ours.contiguous()


def _refuse_other_than_plain_lora(cfg: dict[str, Any]) -> None:
    others = [t for t in cfg.get("target_parameters") or [] if str(t).rpartition(".")[2] not in LoRAExperts.PARTS]
    if others:
        raise InvalidInputError(f"path: adapter_config.json has target_parameters={others!r}; TRIO adapts the "
                                f"parameters {list(LoRAExperts.PARTS)} of mixture-of-experts blocks only", field="path")
    for key, plain in PEFT_PLAIN_LORA.items():
        value = cfg.get(key)
        if not (value is None or value == plain or (not value and not plain)):
            raise InvalidInputError(f"path: adapter_config.json has {key}={value!r}; TRIO loads plain LoRA "
                                    f"on linear layers only ({key}={plain!r})", field="path")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        raise InvalidInputError(f"path: adapter_config.json has init_lora_weights={init!r}, an adapter that "
                                "expects base weights its initialisation moved; save it converted to plain LoRA "
                                "(peft's path_initial_model_for_weight_conversion)", field="path")


def _detached(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies, whatever device the tensors live on (one transfer per storage),
    each its own (safetensors refuses tensors that share memory)."""
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in fetched(tensors).items()}


# -- atomic folder writes ----------------------------------------------------------------

TMP_TAG, OLD_TAG = ".tmp-", ".old-"


def write_folder(folder: str | Path, fill: Callable[[Path], None]) -> None:
    """``fill(tmp)`` writes the files into an empty temporary folder; then it becomes
    ``folder``, replacing any folder of that name (see the module docstring).

    Raises:
        CheckpointWriteError: an OSError while writing or renaming; ``folder`` (if it
            existed) is unchanged and the temporary folder is gone.
    """
    folder = Path(folder)
    tag = f"{os.getpid()}-{threading.get_ident()}"
    tmp = folder.with_name(f".{folder.name}{TMP_TAG}{tag}")
    old = folder.with_name(f".{folder.name}{OLD_TAG}{tag}")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        fill(tmp)
        for path in tmp.iterdir():
            fsync_path(path)
        fsync_path(tmp)
        _swap_in(tmp, folder, old)
        fsync_path(folder.parent)
    except OSError as exc:
        raise CheckpointWriteError(str(folder), exc) from exc
    except SafetensorError as exc:  # safetensors' own type for an OS error while it writes
        if (cause := _os_error_in(exc)) is None:
            raise
        raise CheckpointWriteError(str(folder), cause) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _os_error_in(exc: SafetensorError) -> OSError | None:
    """The OSError a safetensors error reports in its text ("I/O error: No space left on
    device (os error 28)"), or None for one of another kind."""
    found = re.search(r"\(os error (\d+)\)", str(exc))
    return None if found is None else OSError(int(found[1]), os.strerror(int(found[1])))


def _swap_in(new: Path, folder: Path, old: Path) -> None:
    """Rename ``new`` to ``folder``; an existing ``folder`` goes aside to ``old`` first and
    comes back if the second rename fails. ``old`` is removed only once ``new`` is in place."""
    if not folder.exists():
        new.rename(folder)
        return
    folder.rename(old)
    try:
        new.rename(folder)
    except OSError:
        old.rename(folder)
        raise
    shutil.rmtree(old, ignore_errors=True)


def recover_folders(parent: str | Path) -> None:
    """After a crash: in the checkpoint folders under ``parent`` (any depth), a ``.old-``
    folder whose checkpoint is missing is renamed back (the crash fell between the two
    renames); other ``.old-`` and all ``.tmp-`` folders are debris and are removed."""
    for path in sorted(Path(parent).rglob(".*"), key=lambda p: len(p.parts)):
        if not path.is_dir() or not path.exists():
            continue
        name = path.name[1:]
        if OLD_TAG in name:
            target = path.with_name(name.rsplit(OLD_TAG, 1)[0])
            if target.exists():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.rename(target)
        elif TMP_TAG in name:
            shutil.rmtree(path, ignore_errors=True)


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's (its entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
