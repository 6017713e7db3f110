"""Batched sampling with a KV cache, many requests and adapters per decode batch.

    prefill:  every request's prompt once, left-padded into one batch  -> cache (P, ...)
    expand:   the cache rows repeat for each request's num_samples     -> cache (R, ...)
    decode:   one token for every live row per step; finished rows leave the batch

Sampling is a pure chain over fp32 logits (temperature -> top-k -> top-p -> draw) with
one seeded ``torch.Generator`` per request, so a seed gives the same output whatever
else shares the batch (on one kind of device: CPU and CUDA generators draw different
streams). The logprob returned for a token is log p(token) under the model
(temperature 1), from the same unembedding + fp32 log-softmax as the trainer's
``ModelHost.token_logprobs``, so importance ratios start at 1.

The sampler needs only a few things of a host, named by the ``SamplingHost`` protocol
(``ModelHost`` satisfies it), so this module does not import the host. Every tensor is
made on ``host.device``; results are Python lists.
"""

from __future__ import annotations

import inspect
import math
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from . import lora
from .errors import InvalidInputError


class SamplingHost(Protocol):
    """What the sampler uses of a model host."""

    @property
    def model(self) -> Any: ...  # the causal LM; its ``generation_config`` names EOS tokens

    @property
    def trunk(self) -> Any: ...  # the decoder: input ids -> hidden states (B, T, H), KV cache

    @property
    def unembed(self) -> Any: ...  # hidden (N, H) -> fp32 logits (N, V): LoRA lm_head + family transform

    @property
    def routing(self) -> lora.Routing: ...  # which rows use which adapter

    @property
    def tokenizer(self) -> Any: ...  # pad/eos ids and decode

    @property
    def device(self) -> torch.device: ...  # where every tensor is made

    def compute_logprobs(self, adapter_id: str | None, tokens: list[int]) -> list[float | None]:
        """Trainer logprobs of a prompt (for ``prompt_logprobs``)."""
        ...


@dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 or 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # run to max_tokens (benchmarks, fixed-length rollouts)


@dataclass
class SampleRequest:
    adapter_id: str | None
    prompt: list[int]
    num_samples: int = 1
    config: SamplingConfig = field(default_factory=SamplingConfig)
    prompt_logprobs: bool = False


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    text: str
    stop_reason: str  # "stop" | "length"


@dataclass
class SampleResult:
    sequences: list[Sequence]
    prompt_logprobs: list[float | None] | None = None


def validate_request(req: SampleRequest, k: int, vocab_size: int, max_seq_len: int) -> None:
    """Raise InvalidInputError naming request ``k``, the field and the value; pure."""
    c = req.config
    checks = [
        ("prompt", len(req.prompt) > 0, len(req.prompt), "must not be empty"),
        ("num_samples", 1 <= req.num_samples <= 1024, req.num_samples, "must be in [1, 1024]"),
        ("sampling_params.max_tokens", c.max_tokens > 0, c.max_tokens, "must be > 0"),
        ("sampling_params.temperature", 0 <= c.temperature < math.inf, c.temperature, "must be >= 0"),
        ("sampling_params.top_p", 0 < c.top_p <= 1, c.top_p, "must be in (0, 1]"),
        ("sampling_params.top_k", c.top_k >= -1, c.top_k, "must be -1 (off) or >= 0"),
        (
            "prompt",
            len(req.prompt) + c.max_tokens <= max_seq_len,
            len(req.prompt) + c.max_tokens,
            f"prompt length + max_tokens exceeds the context of {max_seq_len}",
        ),
    ]
    for name, ok, value, why in checks:
        if not ok:
            raise InvalidInputError(f"requests[{k}].{name}: {why}, got {value!r}", k, name)
    for name, ids in (("prompt", req.prompt), ("sampling_params.stop", c.stop_token_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidInputError(
                f"requests[{k}].{name}: token id {bad} outside the vocabulary [0, {vocab_size})",
                k,
                name,
            )


@dataclass
class _Row:
    request: int  # index into requests, and into the prefill batch (one prompt row each)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str = ""


def generate(host: SamplingHost, requests: list[SampleRequest]) -> list[SampleResult]:
    """Sample every request's ``num_samples`` sequences; requests must be validated."""
    dev = host.device
    cache = DynamicCache()
    hidden, mask = _prefill(host, requests, cache)  # (P, H) last prompt position, (P, L)
    prompt_lp = [host.compute_logprobs(r.adapter_id, r.prompt) if r.prompt_logprobs else None for r in requests]
    rows = [_Row(k) for k, r in enumerate(requests) for _ in range(r.num_samples)]
    index = torch.tensor([row.request for row in rows], device=dev)  # (R,)
    cache.batch_select_indices(index)  # share each prompt's prefill across its samples
    hidden, mask = hidden[index], mask[index]
    gens = [_generator(r.config.seed, dev) for r in requests]
    eos = _eos_ids(host)

    live = list(range(len(rows)))
    adapters = [requests[row.request].adapter_id for row in rows]  # of the live rows
    while live:
        logits = _logits(host, hidden, adapters)  # (R, V) fp32
        tokens = _draw(logits, [rows[i] for i in live], requests, gens)  # (R,)
        logp = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]  # (R,)
        # one device -> host copy per step, not one per row
        new_tokens, new_logp = tokens.tolist(), logp.tolist()
        keep = []
        for j, i in enumerate(live):
            row = rows[i]
            row.tokens.append(new_tokens[j])
            row.logprobs.append(new_logp[j])
            row.stop_reason = _stop_reason(host, row, requests[row.request].config, eos)
            if not row.stop_reason:
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(live):
            sel = torch.tensor(keep, device=dev)
            cache.batch_select_indices(sel)
            mask, tokens = mask[sel], tokens[sel]
            live = [live[j] for j in keep]
            adapters = [adapters[j] for j in keep]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
        hidden = _decode(host, tokens, mask, cache, adapters)

    results = [SampleResult([], lp) for lp in prompt_lp]
    for row in rows:
        text = host.tokenizer.decode(row.tokens, skip_special_tokens=True)
        results[row.request].sequences.append(Sequence(row.tokens, row.logprobs, text, row.stop_reason))
    return results


def _prefill(host: SamplingHost, requests: list[SampleRequest], cache: DynamicCache):
    """Left-padded prompts -> hidden state of each prompt's last token (P, H), mask (P, L)."""
    width = max(len(r.prompt) for r in requests)
    pad = host.tokenizer.pad_token_id or 0
    dev = host.device
    ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in requests], device=dev)
    mask = torch.tensor(
        [[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in requests], device=dev
    )  # (P, L)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with host.routing.use(lora.segments([r.adapter_id for r in requests], dev)):
        out = _trunk(host, ids, mask, positions, cache)
    return out.last_hidden_state[:, -1], mask


def _decode(host: SamplingHost, tokens: torch.Tensor, mask: torch.Tensor, cache: DynamicCache, adapters):
    """One step for every live row: (R,) new tokens -> (R, H) hidden states."""
    positions = (mask.sum(-1, keepdim=True) - 1)  # (R, 1)
    with host.routing.use(lora.segments(adapters, host.device)):
        out = _trunk(host, tokens[:, None], mask, positions, cache)
    return out.last_hidden_state[:, -1]


def _trunk(host: SamplingHost, ids, mask, positions, cache: DynamicCache):
    # transformers 5 renamed past_key_values to cache; accept both generations
    key = "cache" if "cache" in inspect.signature(host.trunk.forward).parameters else "past_key_values"
    kwargs = {key: cache}
    # No padded row (one prompt length): no mask, so attention takes its causal fast path.
    attention_mask = None if bool(mask.all()) else mask
    return host.trunk(
        input_ids=ids, attention_mask=attention_mask, position_ids=positions, use_cache=True, **kwargs
    )


def _logits(host: SamplingHost, hidden: torch.Tensor, adapters) -> torch.Tensor:
    with host.routing.use(lora.segments(adapters, hidden.device)):
        return host.unembed(hidden).float()  # (R, V)


def _draw(logits: torch.Tensor, rows: list[_Row], requests: list[SampleRequest], gens) -> torch.Tensor:
    """Sample one token per row, rows of a request drawing from that request's generator."""
    out = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    by_request: dict[int, list[int]] = {}
    for j, row in enumerate(rows):
        by_request.setdefault(row.request, []).append(j)
    for k, js in by_request.items():
        idx = torch.tensor(js, device=logits.device)
        out[idx] = sample_tokens(logits[idx], requests[k].config, gens[k])
    return out


def sample_tokens(logits: torch.Tensor, c: SamplingConfig, gen: torch.Generator) -> torch.Tensor:
    """(R, V) fp32 logits -> (R,) tokens: temperature, top-k, top-p, then one draw."""
    if c.temperature == 0:
        return logits.argmax(-1)
    logits = logits / c.temperature
    if c.top_k > 0 and c.top_k < logits.shape[-1]:
        kth = logits.topk(c.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if c.top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop = probs.cumsum(-1) - probs >= c.top_p
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
        logits = torch.full_like(logits, -math.inf).scatter(-1, order, sorted_logits)
    return _inverse_cdf(logits.softmax(-1), gen)


def _inverse_cdf(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One draw per row from (R, V) probabilities, using one uniform number per row.

    Cheaper than torch.multinomial, which draws V exponentials per row.
    """
    cdf = probs.cumsum(-1)  # (R, V)
    u = torch.rand(probs.shape[0], 1, generator=gen, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator on the sampling device (torch draws only from a same-device generator)."""
    return torch.Generator(device=device).manual_seed(secrets.randbits(63) if seed is None else seed)


def _eos_ids(host: SamplingHost) -> set[int]:
    eos = host.model.generation_config.eos_token_id if host.model.generation_config else None
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if host.tokenizer.eos_token_id is not None:
        ids.add(host.tokenizer.eos_token_id)
    return ids


def _stop_reason(host: SamplingHost, row: _Row, c: SamplingConfig, eos: set[int]) -> str:
    last = row.tokens[-1]
    if (last in eos and not c.ignore_eos) or last in c.stop_token_ids:
        return "stop"
    if c.stop_strings:
        # decode a tail long enough to hold any stop string (a token is >= 1 character)
        tail = row.tokens[-(max(map(len, c.stop_strings)) + 4) :]
        text = host.tokenizer.decode(tail)
        if any(s in text for s in c.stop_strings):
            return "stop"
    if len(row.tokens) >= c.max_tokens:
        return "length"
    return ""
