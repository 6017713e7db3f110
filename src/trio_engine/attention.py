"""Attention for bf16 passes on the CPU: a faster kernel where SDPA's is slow.

transformers runs attention through ``torch.nn.functional.scaled_dot_product_attention``
(``"sdpa"``). On the CPU, in bf16, the causal pass it picks (flash attention for the CPU)
is slow at the lengths training uses: 8 sequences x 128 tokens of the bundled model
(9 query heads, 3 key/value heads) took 12.6 ms a layer, forward and backward, where the
same kernel in fp32 took 7.9 ms and plain matmuls in bf16 4.2 ms; a quarter of a bf16
training step went to it. ``install`` registers ``attend`` under its own name, with
SDPA's masks, and points the model at it; ``attend`` hands every call to SDPA except a
square causal bf16 pass on the CPU with no mask and at most ``GROUPED_MAX_SCORES`` scores,
which it computes with matmuls (``grouped_causal``), grouping the query heads that share a
key/value head instead of repeating keys and values.

Numerics: the scores come out of a bf16 matmul (fp32 accumulation, rounded to bf16, as
transformers' eager attention does), then softmax in fp32; the flash kernel keeps them in
fp32. The bf16 sampler-vs-trainer bound in the sampler tests covers the difference.
An unpadded prefill of whole prompts takes the same path as the trainer's pass; decode
steps (one query row), prefills after a cached prefix and padded prefills keep SDPA.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "trio_sdpa"

# Scores (batch x query heads x length^2) above which SDPA runs instead: its flash kernel
# keeps no score matrix, while this path keeps 6 bytes a score per layer for the backward
# (the fp32 softmax and its bf16 copy): 24 MiB a layer at this bound; 8 x 128 tokens of a
# 9-head model are 1.2M scores, 7 MiB a layer, 210 MiB over 30 layers.
GROUPED_MAX_SCORES = 1 << 22


def install(model: Any) -> None:
    """Point ``model`` (an sdpa model) at ``attend``; other implementations are left as they are."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if model.config._attn_implementation != "sdpa":
        return
    AttentionInterface.register(NAME, attend)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)


def attend(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: (batch, heads, length, dim) in, (batch, length,
    heads, dim) out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _grouped_applies(module, query, key, attention_mask, dropout, kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return grouped_causal(query, key, value, scale).transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _grouped_applies(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float, kwargs: dict[str, Any]) -> bool:
    batch, heads, length, _ = query.shape
    return (
        query.device.type == "cpu"
        and query.dtype == torch.bfloat16
        and attention_mask is None
        and kwargs.get("is_causal", getattr(module, "is_causal", True))
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not dropout
        and key.shape[2] == length
        and batch * heads * length * length <= GROUPED_MAX_SCORES
    )


def grouped_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention by matmuls: query (B, Hq, T, D), key/value (B, Hkv, T, D) with
    Hq a multiple of Hkv -> (B, Hq, T, D).

    Query head h reads key/value head h // (Hq / Hkv) (transformers' ``repeat_kv`` order),
    so the heads of one group are consecutive and stack into one (group x T, D) matrix per
    key/value head: one matmul per group, and keys and values are never repeated.
    """
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    stacked = query.reshape(batch, kv_heads, group * length, dim)
    scores = torch.matmul(stacked, key.transpose(-1, -2)).view(batch, kv_heads, group, length, length)
    future = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)
    weights = (scores.float() * scale).masked_fill(future, float("-inf")).softmax(-1)
    out = torch.matmul(weights.to(value.dtype).view(batch, kv_heads, group * length, length), value)
    return out.view(batch, heads, length, dim)
