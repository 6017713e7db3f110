"""Export a TRIO checkpoint for use outside TRIO: a PEFT adapter, or a merged model.

A checkpoint folder is one of checkpoint.py's two layouts, and both carry what an
export needs (the LoRA A/B, rank, alpha and the base model's name):

- training state: ``adapter.safetensors`` + ``trio_state.json`` (+ optimizer moments,
  which an export drops);
- sampler weights: already a PEFT folder (``adapter_config.json`` +
  ``adapter_model.safetensors``).

``export_peft`` rewrites either as a PEFT folder. ``export_merged`` writes a standalone
Hugging Face model: the base model from the local ``Catalog`` with, for every adapted
linear layer,

    W <- W + (alpha / r) · B @ A          # B (out, r), A (r, in): W (out, in)

computed in fp32 and cast back to the dtype the base is stored in. This is exactly the
function our LoRALinear computes (``x W0ᵀ + (alpha/r)(x Aᵀ)Bᵀ``), up to fp32 rounding.
Experts' tensors (``lora.LoRAExperts``) get the same per expert: W[e] += (alpha / r) B[e] @ A[e].

Tied embeddings: a model such as SmolLM2 shares one matrix between ``embed_tokens``
(input) and ``lm_head`` (unembedding). Our LoRA on ``lm_head`` changes only the
unembedding, so merging it must first give ``lm_head`` its own copy and write
``tie_word_embeddings: false``; otherwise the delta lands in the input embeddings too,
or ``from_pretrained`` re-ties the two and drops the merge. An adapter that leaves
``lm_head`` alone keeps the tie (and the smaller file).

No peft at run time: the PEFT layout is written by ``checkpoint.save_peft_adapter``.
Each output is written into a temporary sibling folder and renamed at the end, so an
interrupted export never leaves a folder that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .catalog import (
    Catalog,
    ModelSource,
    converted_gguf_folder,
    load_model_and_tokenizer,
    load_tokenizer,
    save_portable_tokenizer,
)
from .checkpoint import head_copy_fault, load_peft_adapter, load_training_state, save_peft_adapter
from .device import DTYPES
from .lora import LoraConfig, LoRAExperts

Progress = Callable[[str], None]


class ExportError(ValueError):
    """The checkpoint or the output folder cannot be exported as asked; the message says why."""


@dataclass
class Adapter:
    """A checkpoint's LoRA: ``weights`` maps ``"<module>.lora_A"`` (r, in) and
    ``"<module>.lora_B"`` (out, r) to fp32 tensors, module paths as in the plain model
    (experts: ``"<experts>.<part>.lora_A"`` (E, r, in) and ``.lora_B`` (E, out, r))."""

    base_model: str
    config: LoraConfig
    weights: dict[str, torch.Tensor]

    def modules(self) -> list[str]:
        return sorted({key.rsplit(".", 1)[0] for key in self.weights})


def read_adapter(folder: str | Path) -> Adapter:
    """The LoRA of a checkpoint folder of either layout.

    Raises:
        ExportError: the folder holds neither layout.
    """
    folder = Path(folder)
    if (folder / "trio_state.json").exists():
        state = load_training_state(folder, with_optimizer=False)
        return Adapter(state.base_model, state.config, {k: v.float() for k, v in state.weights.items()})
    if (folder / "adapter_config.json").exists():
        config, weights = load_peft_adapter(folder)
        base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise ExportError(f"{folder}/adapter_config.json names no base_model_name_or_path")
        return Adapter(str(base), config, weights)
    raise ExportError(f"{folder} is not a TRIO checkpoint: it has neither trio_state.json "
                      "(training state) nor adapter_config.json (sampler weights)")


def export_peft(folder: str | Path, out: str | Path) -> Path:
    """Write the checkpoint at ``folder`` as a PEFT LoRA folder ``out``
    (adapter_config.json + adapter_model.safetensors) for ``peft.PeftModel.from_pretrained``.

    Raises:
        ExportError: ``folder`` is no checkpoint, or ``out`` exists and is not empty.
    """
    adapter = read_adapter(folder)
    target = _StagedFolder(out)
    with target as tmp:
        save_peft_adapter(tmp, adapter.weights, adapter.config, adapter.base_model)
    return Path(out)


def export_merged(
    folder: str | Path, out: str | Path, catalog: Catalog | None = None, progress: Progress | None = None
) -> Path:
    """Write the checkpoint at ``folder`` merged into its base model, as a Hugging Face
    model folder ``out``: config.json, safetensors weights, the tokenizer's files (with its
    chat template) and the base's generation_config.json if it has one.

    Args:
        folder: a checkpoint folder (training state or sampler weights).
        out: the folder to create; it must not exist, or be empty.
        catalog: where the base model's weights come from (default ``Catalog()``).
        progress: called with one line per step (default: print to stderr).

    Raises:
        ExportError: no checkpoint at ``folder``, ``out`` not empty, or an adapter that
            does not fit the base model (a module it names is missing or of another shape,
            or a PEFT folder's copy of the head is not the base's: ``head_copy_fault``).
        ModelNotAvailableError: the base model is not available on this machine.

    Example:
        >>> export_merged("ckpt/step-100", "merged")  # then AutoModelForCausalLM.from_pretrained("merged")
    """
    say = progress or _stderr
    adapter = read_adapter(folder)
    target = _StagedFolder(out)  # a bad output folder fails before the slow part
    source = (catalog or Catalog()).resolve(adapter.base_model)
    dtype = stored_dtype(source)
    say(f"[trio] 1/4 loading base model {adapter.base_model} (fp32)")
    model, _ = load_model_and_tokenizer(source, torch.float32)
    fault = (head_copy_fault(folder, model.get_output_embeddings().weight)
             if (Path(folder) / "adapter_config.json").exists() else None)
    if fault:
        raise ExportError(f"{folder}: {fault}")
    say(f"[trio] 2/4 merging LoRA into {len(adapter.modules())} linear layers "
        f"(rank {adapter.config.rank}, scale {adapter.config.scale:g})")
    untied = merge_into(model, adapter)
    if untied:
        say("[trio]     lm_head is adapted: untying it from the input embeddings")
    with target as tmp:
        say(f"[trio] 3/4 writing {str(dtype).removeprefix('torch.')} safetensors weights")
        model.to(dtype)
        model.config.dtype = dtype
        model.save_pretrained(tmp, safe_serialization=True)
        add_legacy_rope_keys(tmp / "config.json")
        say("[trio] 4/4 writing tokenizer and generation config")
        save_portable_tokenizer(load_tokenizer(source), tmp)
        (tmp / "generation_config.json").unlink(missing_ok=True)  # derived by save_pretrained
        generation = _generation_config(source)
        if generation is not None:
            generation.save_pretrained(tmp)
    say(f"[trio] merged model written to {out}")
    return Path(out)


def merge_into(model: nn.Module, adapter: Adapter) -> bool:
    """Add ``scale · B @ A`` to the weight of every module the adapter names, in place.

    The model is a plain (no LoRA wrapper) Hugging Face model whose weights are fp32.
    Returns whether ``lm_head`` had to be untied from the input embeddings first.

    Raises:
        ExportError: a module is missing from the model, is not a linear layer, or has
            a shape the adapter does not fit.
    """
    untied = False
    with torch.no_grad():
        for name in adapter.modules():
            if adapter.weights[f"{name}.lora_A"].dim() == 3:
                _merge_experts(model, name, adapter)
                continue
            try:
                layer = model.get_submodule(name)
            except AttributeError:
                raise ExportError(f"adapter module {name!r} is not in base model {adapter.base_model!r}") from None
            if not isinstance(layer, nn.Linear):
                raise ExportError(f"adapter module {name!r} is a {type(layer).__name__}, not a linear layer")
            a = adapter.weights[f"{name}.lora_A"].float()  # (r, in)
            b = adapter.weights[f"{name}.lora_B"].float()  # (out, r)
            if b.shape[0] != layer.out_features or a.shape[1] != layer.in_features or a.shape[0] != b.shape[1]:
                raise ExportError(f"adapter module {name!r}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit "
                                  f"a weight of shape {tuple(layer.weight.shape)}")
            if _shares_input_embeddings(model, layer):
                untie_output_embeddings(model)
                untied = True
            layer.weight += adapter.config.scale * (b @ a)  # (out, in)
    return untied


def _merge_experts(model: nn.Module, name: str, adapter: Adapter) -> None:
    """Add ``scale · B[e] @ A[e]`` to each expert's weights of the experts' tensor ``name``
    (``"<experts>.<part>"``, (E, out, in): ``lora.LoRAExperts``)."""
    path, _, part = name.rpartition(".")
    try:
        experts = model.get_submodule(path)
    except AttributeError:
        raise ExportError(f"adapter tensor {name!r} is not in base model {adapter.base_model!r}") from None
    if not LoRAExperts.fits(experts):  # transposed (GPT-OSS): B @ A would land transposed
        raise ExportError(f"adapter tensor {name!r}: {type(experts).__name__} keeps its experts in a layout "
                          "TRIO does not merge (it merges gate_up_proj (E, 2I, H) and down_proj (E, H, I))")
    weight = getattr(experts, part)
    a = adapter.weights[f"{name}.lora_A"].float()  # (E, r, in)
    b = adapter.weights[f"{name}.lora_B"].float()  # (E, out, r)
    if not isinstance(weight, torch.Tensor) or weight.shape != (a.shape[0], b.shape[1], a.shape[2]) \
            or a.shape[1] != b.shape[2]:
        raise ExportError(f"adapter tensor {name!r}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit "
                          f"experts of shape {tuple(getattr(weight, 'shape', ()))}")
    weight += adapter.config.scale * torch.bmm(b, a)


def add_legacy_rope_keys(config_file: Path) -> None:
    """Also write the RoPE settings under their transformers 4 names (``rope_theta``,
    ``rope_scaling``) beside transformers 5's ``rope_parameters``: 4.x ignores the latter
    and would load the model with its default theta (10000 for Llama) without a warning,
    a changed model (SmolLM2's is 100000). 5.x reads either."""
    config = json.loads(config_file.read_text())
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope or "rope_theta" in config:
        return  # no single RoPE (per layer type, say), or already written
    config["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def untie_output_embeddings(model: Any) -> None:
    """Give the unembedding its own copy of the tied matrix, and record that in the config
    so that ``from_pretrained`` keeps the two apart."""
    head = model.get_output_embeddings()
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    text = model.config.get_text_config()
    if text is not model.config:  # multimodal configs keep the flag on the text part too
        text.tie_word_embeddings = False


def _shares_input_embeddings(model: Any, layer: nn.Linear) -> bool:
    embeddings = model.get_input_embeddings()
    return embeddings is not None and layer.weight.data_ptr() == embeddings.weight.data_ptr()


def stored_dtype(source: ModelSource) -> torch.dtype:
    """The dtype a base model's weights are stored in (its config's ``dtype``); the tiny
    random-init models are built in float32."""
    if source.kind == "tiny":
        return torch.float32
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(_name_or_path(source))
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return DTYPES.get(str(dtype or "float32").removeprefix("torch."), torch.float32)


def _generation_config(source: ModelSource) -> Any:
    """The base model's own generation config, or None if it ships none."""
    if source.kind == "tiny":
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(_name_or_path(source))
    except OSError:
        return None


def _name_or_path(source: ModelSource) -> str:
    if source.kind == "packaged_gguf":
        return str(converted_gguf_folder(source))
    return source.path if source.kind == "folder" else source.name


def check_output_folder(out: str | Path) -> None:
    """Raises ExportError unless ``out`` is absent or an empty folder."""
    _StagedFolder(out)


class _StagedFolder:
    """``with _StagedFolder(out) as tmp:`` write into ``tmp``; on success its files become
    ``out``'s, readable as the user's umask allows (safetensors writes weights 0600)."""

    def __init__(self, out: str | Path):
        self.out = Path(out).resolve()  # "." has no name to make a sibling from
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise ExportError(f"{out}: exists and is not an empty folder; choose a new output folder")
        _check_creatable(self.out, str(out))
        self.tmp = self.out.with_name(self.out.name + ".tmp-export")

    def __enter__(self) -> Path:
        shutil.rmtree(self.tmp, ignore_errors=True)
        try:
            self.tmp.mkdir(parents=True)
        except OSError as exc:
            raise ExportError(f"cannot create {self.tmp}: {exc.strerror or exc}") from None
        return self.tmp

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        mode = 0o666 & ~_umask()
        for file in self.tmp.rglob("*"):
            if file.is_file():
                file.chmod(mode)
        if self.out.exists():  # an empty folder (checked on entry), maybe the working directory: kept
            for child in self.tmp.iterdir():
                child.rename(self.out / child.name)
            self.tmp.rmdir()
        else:
            self.tmp.rename(self.out)


def _check_creatable(folder: Path, given: str) -> None:
    """Raises ExportError unless ``folder`` exists or can be made: its nearest existing
    ancestor must be a folder this process may write in."""
    ancestor = folder.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ExportError(f"{given}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ExportError(f"{given}: cannot write in {ancestor}")


def _umask() -> int:
    """This process's umask, read without changing it (Linux), else the usual 022."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
