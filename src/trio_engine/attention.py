"""Attention for bf16 passes on the CPU: a faster kernel where SDPA's is slow.

transformers runs attention through ``torch.nn.functional.scaled_dot_product_attention``
(``"sdpa"``). On the CPU, in bf16, the causal pass it picks (flash attention for the CPU)
is slow at the lengths training uses: 8 sequences x 128 tokens of the bundled model
(9 query heads, 3 key/value heads) took 12.6 ms a layer, forward and backward, where the
same kernel in fp32 took 7.9 ms and plain matmuls in bf16 4.2 ms; a quarter of a bf16
training step went to it. ``install`` registers ``attend`` under its own name, with
SDPA's masks, and points the model at it; ``attend`` hands every call to SDPA except a
square causal bf16 pass on the CPU with no mask and at most ``GROUPED_MAX_SCORES`` scores,
and a bf16 decode step (one query row, with or without a padding mask), which it computes
with matmuls (``grouped``), grouping the query heads that share a key/value head instead
of repeating keys and values. SDPA's bf16 decode was slower still: 4-14x the matmuls'
time for 8-40 rows.

Numerics: the scores come out of a bf16 matmul (fp32 accumulation, scaled and rounded to
bf16, as transformers' eager attention rounds them), then softmax in fp32, its weights
rounded to bf16 as eager attention does; the flash kernel keeps the scores in fp32. The
bf16 sampler-vs-trainer bound in the sampler tests covers the difference.
An unpadded prefill of whole prompts takes the same path as the trainer's pass; prefills
after a cached prefix and padded prefills keep SDPA. In fp32 SDPA is as fast or faster,
and every fp32 call stays with it.

Every masked pass of several queries on the CPU (the sampler's padded prefills and its
prefills after a cached prefix, in any dtype) goes to SDPA itself, with the grouped
key/value heads as they are (``_sdpa_takes_groups``), rather than through transformers,
which repeats them under a mask.

A packed training pass (``packed``: several sequences of different lengths laid end to
end in one row, so that the linear layers run on real tokens only, with no padding and
in one pass) attends within each sequence: ``attend`` splits the row at the sequences'
ends and takes each as the unpadded causal pass it is (sequences of one length side by
side as one batch), and the mask transformers would build for the whole row (its
packed-sequence mask, N x N) is not made.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from . import kv_cache

NAME = "trio_sdpa"

# Scores (batch x query heads x length^2) above which SDPA runs instead: its flash kernel
# keeps no score matrix, while this path keeps 6 bytes a score per layer for the backward
# (the fp32 softmax and its bf16 copy): 24 MiB a layer at this bound; 8 x 128 tokens of a
# 9-head model are 1.2M scores, 7 MiB a layer, 210 MiB over 30 layers.
GROUPED_MAX_SCORES = 1 << 22

# The lengths of the sequences laid end to end in the row of a packed pass (``packed``).
_packed_lengths: ContextVar[tuple[int, ...] | None] = ContextVar("packed_lengths", default=None)


def install(model: Any) -> None:
    """Point ``model`` (an sdpa model) at ``attend``; other implementations are left as they are."""
    if model.config._attn_implementation != "sdpa":
        return
    AttentionInterface.register(NAME, attend)
    AttentionMaskInterface.register(NAME, _mask)
    model.set_attn_implementation(NAME)


def pack_limit(model: Any, window: int | None) -> float:
    """The longest sequences that can run packed through ``model``'s attention: any when it
    attends through ``attend`` without a sliding ``window``, up to the window with one
    (within it, a sliding layer is a plain causal one), none when it attends otherwise.
    Whether anything else mixes tokens is the caller's to ask (``model.state_layers``)."""
    if model.config._attn_implementation != NAME:
        return 0
    return math.inf if window is None else window


@contextmanager
def packed(lengths: Sequence[int]) -> Iterator[None]:
    """Passes run inside are packed rows: one row of ``sum(lengths)`` tokens made of
    sequences of these lengths, in order (``packs`` says which models take them)."""
    token = _packed_lengths.set(tuple(lengths))
    try:
        yield
    finally:
        _packed_lengths.reset(token)


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """SDPA's mask, but none for a packed pass (``attend`` keeps each sequence to itself)."""
    return None if _packed_lengths.get() is not None else sdpa_mask(*args, **kwargs)


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
    lengths = _packed_lengths.get()
    if lengths is not None and query.shape[0] == 1 and query.shape[2] == sum(lengths):
        return _attend_packed(module, query, key, value, lengths, dropout, scaling, kwargs), None
    return _attend_one(module, query, key, value, attention_mask, dropout, scaling, kwargs), None


def _attend_packed(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   lengths: Sequence[int], dropout: float, scaling: float | None,
                   kwargs: dict[str, Any]) -> torch.Tensor:
    """``attend`` of a packed row: each run of consecutive sequences of one length as one
    batch of them (a view, no copy), so that many short sequences cost a call per
    distinct length rather than one each."""
    runs = [(n, len(list(same))) for n, same in itertools.groupby(lengths)]
    sizes = [n * count for n, count in runs]
    parts = zip(runs, query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2), strict=True)
    outs = []
    for (n, count), q, k, v in parts:
        q, k, v = (t[0].unflatten(1, (count, n)).transpose(0, 1) for t in (q, k, v))  # (count, heads, n, dim)
        outs.append(_attend_one(module, q, k, v, None, dropout, scaling, kwargs).flatten(0, 1))  # (count x n, heads, dim)
    return torch.cat(outs)[None]


def _attend_one(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
                kwargs: dict[str, Any]) -> torch.Tensor:
    """``attend`` of one batch of sequences: (batch, length, heads, dim)."""
    takes, hidden = _matmul_path(module, query, key, attention_mask, dropout, kwargs)
    if not takes:
        if _sdpa_takes_groups(query, key, attention_mask, kwargs):
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
            return out.transpose(1, 2).contiguous()
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)[0]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.shape[2] == 1:
        key, value, hidden = _over_buffers(key, value, hidden)
    return grouped(query, key, value, scale, hidden).transpose(1, 2).contiguous()


def _over_buffers(key: torch.Tensor, value: torch.Tensor,
                  hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A decode step's keys and values as ``grouped`` should read them, with what it hides.

    The sampler's KV cache (``kv_cache.GrowingCache``) gives out the filled part of
    buffers with room, where one row's keys do not follow the last's; bf16 batched
    matmuls over such views ran 4-8x slower than over contiguous keys (8 rows, 9 query
    and 3 key/value heads: 3.9 against 0.6 ms for the scores at 2048 cached tokens), and
    a copy per step is what the cache exists to avoid. So the step reads the whole
    buffers (contiguous; at most half again as long) and hides their room, which is
    zeros (finite, so hidden scores weigh exactly 0). Other tensors pass unchanged."""
    keys_buffer, values_buffer = kv_cache.buffer_of(key), kv_cache.buffer_of(value)
    if keys_buffer is None or values_buffer is None or (hidden is not None and hidden.shape[-1] != key.shape[2]):
        return key, value, hidden
    length, capacity = key.shape[2], keys_buffer.shape[2]
    if hidden is None:  # nothing hidden among the keys: one row that every batch row shares
        hidden = torch.zeros(1, 1, 1, 1, length, dtype=torch.bool, device=key.device)
    room = torch.ones(capacity - length, dtype=torch.bool, device=key.device).expand(*hidden.shape[:-1], -1)
    return keys_buffer, values_buffer, torch.cat([hidden, room], dim=-1)


_SDPA: tuple[bool, None] = (False, None)


def grouped_decodes(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether decode steps of a model in ``dtype`` on ``device`` take ``grouped`` (given
    this module installed, no dropout, no softcap or position bias): bf16 on the CPU."""
    return device.type == "cpu" and dtype == torch.bfloat16


def _matmul_path(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float,
                 kwargs: dict[str, Any]) -> tuple[bool, torch.Tensor | None]:
    """Whether this call takes ``grouped``, and what that hides from each query."""
    if not (grouped_decodes(query.dtype, query.device) and not dropout
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None):
        return _SDPA
    batch, heads, length, _ = query.shape
    if length == 1:  # a decode step: its one query sees every key its mask lets through
        if attention_mask is None:
            return True, None
        if attention_mask.dtype == torch.bool and attention_mask.shape[1:3] == (1, 1):
            return True, ~attention_mask[:, :, None]  # (B, 1, 1, 1, S) over (B, Hkv, group, 1, S)
        return _SDPA
    if batch * heads * length * key.shape[2] > GROUPED_MAX_SCORES:
        return _SDPA
    if (attention_mask is None and kwargs.get("is_causal", getattr(module, "is_causal", True))
            and key.shape[2] == length):
        return True, torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)  # the future
    if attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1:
        # several prompts prefilled in one padded pass, as a lone one is (else the sampler's
        # logprobs of an RL group sent at once drew 0.35 nats from the trainer's); a query
        # with no key to see (left padding) sees them all instead, finite and never read
        hidden = ~attention_mask[:, :, None]  # (B, 1, 1, T, S)
        return True, hidden & ~hidden.all(-1, keepdim=True)
    return _SDPA


def _sdpa_takes_groups(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                       kwargs: dict[str, Any]) -> bool:
    """Whether SDPA should take grouped key/value heads as they are (``enable_gqa``) where
    transformers would repeat them: a masked pass of several queries on the CPU.

    transformers repeats keys and values whenever a mask is given, since CUDA's kernels
    fall back to plain math for grouped heads under a mask. The CPU's kernel takes the
    groups itself, with the same results to the bit (forward; fp32 gradients too), and the
    copies were half the attention's time where the sampler passes a mask: 24 queries over
    324 keys of the bundled model (a turn after a cached prefix), 572 µs a layer with the
    copies against 272 µs without; a whole 24-token turn, 3% faster after 300 cached
    tokens and 13% after 1,500 (interleaved medians). One query (a decode step) is left
    to transformers, which folds the groups into the query instead."""
    return (query.device.type == "cpu" and attention_mask is not None and query.shape[2] > 1
            and query.shape[1] != key.shape[1]
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None)


def grouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
            hidden: torch.Tensor | None) -> torch.Tensor:
    """Attention by matmuls: query (B, Hq, T, D), key/value (B, Hkv, S, D) with Hq a
    multiple of Hkv -> (B, Hq, T, D); ``hidden`` (True where a query must not see a key)
    broadcasts over (B, Hkv, Hq / Hkv, T, S), or is None for nothing hidden.

    Query head h reads key/value head h // (Hq / Hkv) (transformers' ``repeat_kv`` order),
    so the heads of one group are consecutive and stack into one (group x T, D) matrix per
    key/value head: one matmul per group, and keys and values are never repeated.

    ``baddbmm`` scales the product and adds the mask (0 or -inf) in its accumulator, then
    softmax reads the bf16 scores and writes fp32 weights, rounded to bf16 for the
    weighted sum. Casting the scores to fp32, scaling and masking them as separate steps
    took 3.2 instead of 2.5 ms a layer, forward and backward, for 8 x 128 tokens of the
    bundled model, with the same gradient error against fp64. A softmax writing bf16
    itself was faster still (2.0 ms) but rounds a row's weights differently with the
    number of hidden keys around it (the CPU kernel's vector tails), so the sampler's
    left-padded decode rows and the trainer's causal rows drew apart: 0.25 nats at most
    on the bundled model in bf16, against 0 with an fp32 softmax.
    """
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    stacked = query.reshape(batch * kv_heads, group * length, dim)
    keys_t = key.reshape(batch * kv_heads, keys, dim).transpose(1, 2)
    scores = torch.baddbmm(_mask_bias(hidden, query.dtype, batch, kv_heads, group, length, keys),
                           stacked, keys_t, alpha=scale)  # (B x Hkv, group x T, S)
    weights = scores.softmax(-1, dtype=torch.float32).to(value.dtype)
    return torch.bmm(weights, value.reshape(batch * kv_heads, keys, dim)).view(batch, heads, length, dim)


def _mask_bias(hidden: torch.Tensor | None, dtype: torch.dtype, batch: int, kv_heads: int, group: int,
               length: int, keys: int) -> torch.Tensor:
    """``hidden`` as an additive mask (-inf where hidden) that broadcasts over the
    (B x Hkv, group x T, S) scores; a mask shared by every batch row and key/value head
    (the causal one) stays one (group x T, S) matrix."""
    if hidden is None:
        return torch.zeros((), dtype=dtype)
    bias = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))
    if all(n == 1 for n in bias.shape[:-3]):  # no batch row or key/value head of its own
        return bias.reshape(bias.shape[-3:]).expand(group, length, keys).reshape(group * length, keys)
    return bias.expand(batch, kv_heads, group, length, keys).reshape(batch * kv_heads, group * length, keys)
