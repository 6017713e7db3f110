"""TRIO's compute engine: Hugging Face causal LMs, multi-adapter LoRA, losses, AdamW,
a batched KV-cache sampler and checkpoint I/O. Imports torch; the SDK never imports it."""

from .catalog import DEFAULT_MODEL, TINY_LLAMA, TINY_QWEN3, Catalog, ModelNotAvailableError
from .device import resolve_device, resolve_dtype
from .errors import AdapterNotFoundError, CheckpointWriteError, InvalidInputError
from .host import Example, ForwardJob, ForwardResult, ModelHost, merge_results
from .lora import LORA_ALPHA, LoraConfig
from .optim import AdamConfig
from .sampler import DecodeBatch, SampleRequest, SampleResult, SamplingConfig

__all__ = [
    "DEFAULT_MODEL", "TINY_LLAMA", "TINY_QWEN3", "Catalog", "ModelNotAvailableError",
    "resolve_device", "resolve_dtype",
    "AdapterNotFoundError", "CheckpointWriteError", "Example", "ForwardJob", "ForwardResult", "InvalidInputError",
    "ModelHost", "merge_results", "LORA_ALPHA", "LoraConfig", "AdamConfig", "DecodeBatch", "SampleRequest", "SampleResult",
    "SamplingConfig",
]
