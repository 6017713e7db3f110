"""Batched sampling with a KV cache, many requests and adapters per decode batch.

    prefill:  every request's prompt once, left-padded into one batch  -> cache (P, ...)
    expand:   the cache rows repeat for each request's num_samples     -> cache (R, ...)
    decode:   one token for every live row per step; finished rows leave the batch

``DecodeBatch`` runs these steps one at a time, so requests can join a running batch
between steps (continuous batching: prefill them apart, merge their cache in) and a
finished request leaves at once; ``generate`` admits everything and steps to the end.

Sampling is a pure chain over fp32 logits (temperature -> top-k -> top-p -> draw) with
one seeded ``torch.Generator`` per request, so a seed gives the same output whatever
else shares the batch (on one kind of device: CPU and CUDA generators draw different
streams, and so may two GPU models, whose kernels lay out a stream by their count of
multiprocessors; in fp32, but for about one draw in 100,000 that the logits' last bits decide:
see ``_draw``; and ``DecodeBatch``'s "Seeds" for bf16). The logprob returned for a
token is log p(token) under the model (temperature 1), from the same unembedding + fp32
log-softmax as the trainer's ``ModelHost.token_logprobs``, so importance ratios start at 1.

The sampler needs only a few things of a host, named by the ``SamplingHost`` protocol
(``ModelHost`` satisfies it), so this module does not import the host. Every tensor is
made on ``host.device``; results are Python lists.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import secrets
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from transformers import DynamicCache

from . import lora
from .errors import InvalidInputError
from .kv_cache import GrowingCache


class SamplingHost(Protocol):
    """What the sampler uses of a model host."""

    @property
    def model(self) -> Any: ...  # the causal LM; its ``generation_config`` names EOS tokens

    @property
    def trunk(self) -> Any: ...  # the decoder: input ids -> hidden states (B, T, H), KV cache

    @property
    def unembed(self) -> Any: ...  # hidden (N, H) -> fp32 logits (N, V): LoRA lm_head + family transform (model.Head)

    @property
    def routing(self) -> lora.Routing: ...  # which rows use which adapter

    @property
    def tokenizer(self) -> Any: ...  # pad/eos ids and decode

    @property
    def device(self) -> torch.device: ...  # where every tensor is made

    def compute_logprobs(self, adapter_id: str | None, tokens: list[int]) -> list[float | None]:
        """Trainer logprobs of a prompt (for ``prompt_logprobs``)."""
        ...

    def weights_key(self, adapter_id: str | None) -> Hashable:
        """Names the adapter's weights as they are now (changes whenever they change)."""
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
    # Who may reuse this request's KV from the prefix cache (the service: its user). Other
    # scopes never share an entry, even on the base model: a hit, counted in the answer
    # and faster, would tell one user the prompts and samples of another.
    cache_scope: Hashable = None


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
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


MAX_NUM_SAMPLES = 1024  # a request's samples
MERGE_MIN_STEPS = 32  # a one-adapter batch with this many steps to go decodes on merged weights
SEED_MIN, SEED_END = -(2**63), 2**64  # what torch.Generator.manual_seed takes


def validate_request(req: SampleRequest, k: int, vocab_size: int, max_seq_len: int) -> None:
    """Raise InvalidInputError naming request ``k``, the field and the value; pure."""
    c = req.config
    checks = [
        ("prompt", len(req.prompt) > 0, len(req.prompt), "must not be empty"),
        ("num_samples", 1 <= req.num_samples <= MAX_NUM_SAMPLES, req.num_samples, f"must be in [1, {MAX_NUM_SAMPLES}]"),
        ("sampling_params.max_tokens", c.max_tokens > 0, c.max_tokens, "must be > 0"),
        ("sampling_params.temperature", 0 <= c.temperature < math.inf, c.temperature, "must be >= 0"),
        ("sampling_params.top_p", 0 < c.top_p <= 1, c.top_p, "must be in (0, 1]"),
        ("sampling_params.top_k", c.top_k >= -1, c.top_k, "must be -1 (off) or >= 0"),
        ("sampling_params.seed", c.seed is None or SEED_MIN <= c.seed < SEED_END, c.seed,
         f"must be in [{SEED_MIN}, {SEED_END}) (torch's generator seeds)"),
        ("sampling_params.stop", all(c.stop_strings), list(c.stop_strings),
         "a stop string must not be empty (it would end every sequence at its first token)"),
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


KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (heads, L, D)


class PrefixCache:
    """A bounded LRU of token sequences' KV states, per adapter weights.

    A prompt that extends a sequence seen recently (a longer prompt of a multi-turn
    rollout: the last prompt, the tokens sampled for it, the new turn) prefills only its
    new tokens. Entries are keyed by ``(weights key, tokens)``: the weights key names the
    adapter and the exact state of its weights (``ModelHost.weights_key``), so KV made
    with other weights (before an ``optim_step``, a load) is never reused, and the
    request's ``cache_scope`` (its user), so no one reuses another's. A hit leaves
    at least one prompt token to run: its hidden state gives the first draw. Bounded by
    ``max_bytes`` of KV, least recently used out first; ``max_bytes=0`` turns it off.
    A match that ends inside an entry (the prompt parts from it, or is shorter) counts only
    from ``min_shared`` tokens: a few shared tokens (a BOS, a chat template's opening) save
    next to nothing and cost a padded admission.
    """

    def __init__(self, max_bytes: int = 256 << 20, min_shared: int = 8):
        self.max_bytes = max_bytes
        self.min_shared = min_shared
        self.entries: OrderedDict[tuple[Hashable, tuple[int, ...]], KV] = OrderedDict()
        self.nbytes = 0

    def lookup(self, weights: Hashable, prompt: list[int]) -> tuple[int, KV | None]:
        """(tokens reused, their KV): the longest run of ``prompt``'s first tokens, short of
        its last, that an entry of the same weights begins with.

        The entry may be shorter than the prompt (an earlier turn), as long, or longer (the
        same prompt sampled before, its sampled tokens stored after it), or part from it
        (the same system prompt, another question): KV at a position depends only on the
        tokens up to it, so the common tokens' KV is the prompt's own.
        """
        limit = len(prompt) - 1  # the last prompt token must run: its hidden state gives the first draw
        wanted = tuple(prompt[:limit])
        best, best_n = None, 0
        for key in self.entries:
            w, tokens = key
            if w == weights and min(len(tokens), limit) > best_n:
                n = _common_prefix(tokens, wanted)
                if n > best_n and (n == len(tokens) or n >= self.min_shared):
                    best, best_n = key, n
        if best is None:
            return 0, None
        self.entries.move_to_end(best)
        kv = self.entries[best]
        if best_n < len(best[1]):
            kv = [(k[:, :best_n], v[:, :best_n]) for k, v in kv]
        return best_n, kv

    def store(self, weights: Hashable, tokens: list[int], kv: KV) -> None:
        key = (weights, tuple(tokens))
        size = _kv_bytes(kv)
        if key in self.entries or size > self.max_bytes:
            return
        self.entries[key] = kv
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= _kv_bytes(old)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many first tokens ``a`` and ``b`` share: tuple slices compare in C, so a binary
    search on them beats a Python loop over thousands of tokens."""
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    low, high = 0, limit  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


def _kv_bytes(kv: KV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


@dataclass
class _Admitted:
    """One request in a decode batch: its generator, rows, and rows still decoding."""

    ticket: Hashable
    request: SampleRequest
    gen: torch.Generator
    prompt_logprobs: list[float | None] | None
    weights: Hashable = None  # (weights key, cache scope) of its KV, for the prefix cache
    cached: int = 0  # prompt tokens reused from the prefix cache
    rows: list[_Row] = field(default_factory=list)
    decoding: int = 0


@dataclass
class _Row:
    owner: _Admitted
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str = ""
    pending: int | None = None  # a prompt token still to run (``DecodeBatch.admit``): nothing drawn yet


class DecodeBatch:
    """A running decode batch that requests join and leave between steps (continuous batching).

    ``admit`` prefills new prompts (each prompt once, its ``num_samples`` rows sharing that
    prefill) into a cache of their own, then merges it into the running one; ``step``
    draws one token for every live row (but those with a prompt token still to run) and
    returns the requests whose rows all finished, which leave the batch at once. Between
    steps the state is, for every live row: its KV cache up to and including its newest
    token, and the hidden state of that token; or, for a row admitted onto cached KV of its
    whole prompt but the last token, that KV and the token still to run (``_Row.pending``).

    Rows of different lengths share one cache by left padding: ``mask`` (R, L) marks the
    real positions, a row's position ids count its real tokens only, so padding changes
    no row's numbers (beyond float summation order). Merging a new cache of width L' into
    the running one of width L pads the narrower of the two on the left to max(L, L').
    When rows leave, columns that no live row uses any more are cut off the left.

    Seeds: each request draws from its own generator, the same numbers per live row of it
    per step, in its row order, so a seeded request gets the same tokens whatever else is
    in the batch and whenever it was admitted (but where the logits' last bits, which move
    with the batch, decide a draw: ``_draw``). In bf16/fp16 KV reused from the prefix cache
    rounds differently from a prefill of the whole prompt (enough to change sampled
    tokens), so there a request asking for reproducible tokens (seeded, or greedy) reuses
    none and gets the same tokens whatever was sampled before; in fp32 the two agree and
    every request reuses it. In bf16 the
    draws stay the same but the logits can round differently with the prompts prefilled in
    one pass with the request's: bf16 matrix products round a row differently with the
    number of rows in the product (one element of an MLP projection, 60 rows against 26).
    A padded prefill attends by ``attention.grouped`` as a lone prompt does; when it took
    SDPA's kernel, the sampled tokens' logprobs of six prompts sent at once were mean 0.051,
    max 0.35 nats from ``compute_logprobs`` on the bundled model (a trained adapter), and
    0.0085 / 0.19 since. Rows joining its running batch later left its numbers bit for bit
    (1-41 rows). Bit-for-bit reproducible seeds need fp32.

    Requests must be validated (``validate_request``) before ``admit``; callers hold the
    host's lock and ``torch.no_grad`` (``ModelHost.admit`` / ``ModelHost.decode_step``).
    """

    def __init__(self, host: SamplingHost, prefix_cache: PrefixCache | None = None):
        self.host = host
        # the KV cache of the batch and of each prefill (benchmarks/long_decode.py sets
        # transformers' own here to compare)
        self.cache_class: type[DynamicCache] = GrowingCache
        self.prefix = prefix_cache if prefix_cache is not None and prefix_cache.max_bytes > 0 else None
        self.exact_reuse = host.model.dtype in (torch.float32, torch.float64)  # see "Seeds" above
        self.eos = _eos_ids(host)
        self._merging: str | None = None  # the adapter this batch's steps merge (``_merged_adapter``)
        self._reset()

    def _reset(self) -> None:
        self.cache = self.cache_class()
        self.rows: list[_Row] = []  # live rows, in cache order
        self.mask: torch.Tensor | None = None  # (R, L) 1 = real token
        self.hidden: torch.Tensor | None = None  # (R, H) hidden state of each row's newest token
        self._merging = None  # an emptied batch decides afresh (the adapter may have changed since)

    def __len__(self) -> int:
        """The number of live rows."""
        return len(self.rows)

    @property
    def tickets(self) -> list[Hashable]:
        """The requests still decoding, in the order of their rows: admission order, except
        that the requests of one admission that take cached KV without a prefill come after
        those prefilled (``admit``)."""
        return list(dict.fromkeys(row.owner.ticket for row in self.rows))

    @property
    def adapters(self) -> set[str | None]:
        """The adapters the live rows use (they must stay loaded until those rows finish)."""
        return {row.owner.request.adapter_id for row in self.rows}

    @property
    def width(self) -> int:
        """The cache's sequence length (padding included)."""
        return 0 if self.mask is None else int(self.mask.shape[1])

    def admit(self, requests: list[SampleRequest], tickets: list[Hashable] | None = None) -> None:
        """Prefill ``requests`` and add their rows to the batch; they decode from the next step.

        A request whose every prompt token but the last has cached KV (``PrefixCache``)
        joining a running batch needs no prefill: its rows take that KV, and its last
        prompt token runs in the next step's decode pass with the other rows' tokens
        (``_Row.pending``); its first token is drawn at the step after. A rollout that
        resends a prompt, or a turn that extends the last one by a token, then costs the
        batch no pass of its own.

        ``tickets`` name the requests in what ``step`` returns (default: their index here).
        If the prefill raises, the running batch is unchanged.
        """
        if not requests:
            return
        tickets = list(range(len(requests))) if tickets is None else tickets
        dev = self.host.device
        weights = [(self.host.weights_key(r.adapter_id), r.cache_scope) if self.prefix else None for r in requests]
        hits = [self.prefix.lookup(w, r.prompt) if self.prefix and self._may_reuse(r) else (0, None)
                for w, r in zip(weights, requests)]
        folded = [bool(self.rows) and 0 < n == len(r.prompt) - 1 for r, (n, _) in zip(requests, hits)]
        prefilled = [k for k, f in enumerate(folded) if not f]
        reused = [k for k, f in enumerate(folded) if f]
        for k, hit in zip(prefilled, _without_gaps([requests[k] for k in prefilled], [hits[k] for k in prefilled])):
            hits[k] = hit
        parts = []  # (requests' indices, cache, hidden states, mask): all made before any joins
        if prefilled:
            parts.append((prefilled, *self._prefilled([requests[k] for k in prefilled],
                                                      [weights[k] for k in prefilled], [hits[k] for k in prefilled])))
        if reused:
            parts.append((reused, *self._reused([hits[k] for k in reused])))
        admitted = [
            _Admitted(ticket, r, _generator(r.config.seed, dev),
                      self.host.compute_logprobs(r.adapter_id, r.prompt) if r.prompt_logprobs else None,
                      w, n)
            for ticket, r, w, (n, _) in zip(tickets, requests, weights, hits)
        ]
        for ks, cache, hidden, mask in parts:
            for k in ks:
                a = admitted[k]
                a.rows = [_Row(a, pending=a.request.prompt[-1] if folded[k] else None)
                          for _ in range(a.request.num_samples)]
                a.decoding = len(a.rows)
            if any(requests[k].num_samples > 1 for k in ks):  # share each prompt's prefill across its samples
                index = torch.tensor([i for i, k in enumerate(ks) for _ in range(requests[k].num_samples)], device=dev)
                cache.batch_select_indices(index)  # a copy of the KV: not made when nothing repeats
                hidden, mask = hidden[index], mask[index]
            self._join(cache, hidden, mask, [row for k in ks for row in admitted[k].rows])

    def _prefilled(self, requests: list[SampleRequest], weights: list[Hashable],
                   hits: list[tuple[int, KV | None]]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """The prompts prefilled into a cache of their own (stored in the prefix cache):
        (cache, hidden state of each prompt's last token, mask)."""
        cache = self.cache_class()
        hidden, mask = _prefill(self.host, requests, cache, hits)  # (P, H), (P, L')
        if self.prefix:
            for k, (w, r) in enumerate(zip(weights, requests)):
                self.prefix.store(w, r.prompt, _row_kv(cache, mask, k))
        return cache, hidden, mask

    def _reused(self, hits: list[tuple[int, KV | None]]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """The reused KV of folded prompts in a cache of their own: (cache, placeholder
        hidden states, mask); their last tokens are still to run."""
        assert self.hidden is not None
        cache = self.cache_class()
        mask = _fill_reused(cache, hits, self.host.device)
        return cache, self.hidden.new_zeros(len(hits), self.hidden.shape[1]), mask

    def _join(self, cache: DynamicCache, hidden: torch.Tensor, mask: torch.Tensor, rows: list[_Row]) -> None:
        """Add rows, with their cache, hidden states and mask, to the batch."""
        if not self.rows:
            self.cache, self.mask, self.hidden = cache, mask, hidden
        else:
            assert self.mask is not None and self.hidden is not None
            self.mask = _merge_caches(self.cache, self.mask, cache, mask)
            self.hidden = torch.cat([self.hidden, hidden])
        self.rows.extend(rows)

    def _may_reuse(self, request: SampleRequest) -> bool:
        """Whether ``request`` may take KV from a prefix cache (see "Seeds" above): in bf16,
        not one that asked for reproducible tokens (seeded, or greedy)."""
        c = request.config
        return self.exact_reuse or (c.seed is None and c.temperature > 0 and c.top_k != 1)

    def step(self) -> list[tuple[Hashable, SampleResult]]:
        """One token for every live row; returns the requests that finished, which leave.

        A row admitted with a pending prompt token draws nothing yet: the token runs in this
        step's decode pass (``admit``). If a step raises, the batch is left part-way:
        discard it (the service's engine starts a new one)."""
        if not self.rows:
            return []
        assert self.mask is not None and self.hidden is not None
        with self.host.routing.merging(self._merged_adapter()):
            return self._step()

    def _merged_adapter(self) -> str | None:
        """The adapter whose merged weights this step takes (``lora.Routing.merging``): the
        one adapter of every live row, when a row has ``MERGE_MIN_STEPS`` steps to go (a
        merge costs 0.1-0.25 s on the bundled model, what 7-17 steps save), or the
        weights are merged already (a merge made for the rows' first steps serves their
        last)."""
        adapters = self.adapters
        if len(adapters) != 1 or None in adapters or not self.host.routing.may_merge:
            return None
        adapter = adapters.pop()
        if adapter != self._merging:
            to_go = max(row.owner.request.config.max_tokens - len(row.tokens) for row in self.rows)
            self._merging = adapter if to_go >= MERGE_MIN_STEPS else None
        return self._merging

    def _step(self) -> list[tuple[Hashable, SampleResult]]:
        assert self.mask is not None and self.hidden is not None
        drawn = self._draw_ready([j for j, row in enumerate(self.rows) if row.pending is None])
        keep, feed, finished = [], [], []
        for j, row in enumerate(self.rows):
            if row.pending is not None:
                keep.append(j)
                feed.append(row.pending)
                row.pending = None
                continue
            token, logprob = drawn[j]
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.stop_reason = _stop_reason(self.host, row, row.owner.request.config, self.eos)
            if not row.stop_reason:
                keep.append(j)
                feed.append(token)
                continue
            row.owner.decoding -= 1
            if self.prefix and row.owner.request.num_samples == 1:  # the next turn may extend it
                self.prefix.store(row.owner.weights, row.owner.request.prompt + row.tokens[:-1],
                                  _row_kv(self.cache, self.mask, j))
            if row.owner.decoding == 0:
                finished.append((row.owner.ticket, self._result(row.owner)))
        if not keep:
            self._reset()
            return finished
        if len(keep) < len(self.rows):
            self.cache.batch_select_indices(torch.tensor(keep, device=self.host.device))
            self.mask = self.mask[keep]
            self.rows = [self.rows[j] for j in keep]
            self._trim_left()
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        self.hidden = _decode(self.host, torch.tensor(feed, device=self.host.device), self.mask, self.cache,
                              [row.owner.request.adapter_id for row in self.rows])
        return finished

    def _draw_ready(self, ready: list[int]) -> dict[int, tuple[int, float]]:
        """(token, its logprob) drawn for each of the rows ``ready`` (indices into ``rows``)."""
        if not ready:
            return {}
        assert self.hidden is not None
        rows = [self.rows[j] for j in ready]
        hidden = self.hidden[_rows_index(ready, self.host.device)]
        logits = _logits(self.host, hidden, [row.owner.request.adapter_id for row in rows])  # (R, V) fp32
        tokens = _draw(logits, rows)  # (R,)
        logp = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]  # (R,)
        # one device -> host copy per step, not one per row
        return dict(zip(ready, zip(tokens.tolist(), logp.tolist(), strict=True), strict=True))

    def _trim_left(self) -> None:
        """Drop the leading columns no live row uses (left by rows that left)."""
        assert self.mask is not None
        first = int(self.mask.any(0).int().argmax())
        if first > 0:
            self.mask = self.mask[:, first:]
            for layer in _kv_layers(self.cache):
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

    def _result(self, a: _Admitted) -> SampleResult:
        decode = self.host.tokenizer.decode
        return SampleResult(
            [Sequence(r.tokens, r.logprobs, decode(r.tokens, skip_special_tokens=True), r.stop_reason) for r in a.rows],
            a.prompt_logprobs,
            a.cached,
        )


def generate(host: SamplingHost, requests: list[SampleRequest],
             prefix_cache: PrefixCache | None = None) -> list[SampleResult]:
    """Sample every request's ``num_samples`` sequences; requests must be validated.

    All requests are admitted at once and decoded until the last one finishes (a finished
    request still leaves the batch at once, so later steps are cheaper). ``prefix_cache``:
    as ``DecodeBatch``'s (the host passes its own).
    """
    batch = DecodeBatch(host, prefix_cache)
    batch.admit(requests)
    results: dict[Hashable, SampleResult] = {}
    while len(batch):
        results.update(batch.step())
    return [results[k] for k in range(len(requests))]


def _merge_caches(cache: DynamicCache, mask: torch.Tensor, new: DynamicCache, new_mask: torch.Tensor) -> torch.Tensor:
    """Append ``new``'s rows to ``cache`` (in place), left-padding the narrower; returns the merged mask."""
    width = max(mask.shape[1], new_mask.shape[1])
    for layer, add in zip(_kv_layers(cache), _kv_layers(new), strict=True):
        layer.keys = torch.cat([_pad_left(layer.keys, width), _pad_left(add.keys, width)])
        layer.values = torch.cat([_pad_left(layer.values, width), _pad_left(add.values, width)])
    return torch.cat([_pad_left(mask, width, dim=1), _pad_left(new_mask, width, dim=1)])


def _kv_layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers, each with ``keys`` and ``values`` (B, heads, L, D).

    A ``DynamicCache()`` made without a model config has only such full-attention layers,
    whatever the model (a sliding-window model keeps every position, masked by the model).
    """
    return list(cache.layers)


def _pad_left(x: torch.Tensor, width: int, dim: int = -2) -> torch.Tensor:
    """Zeros in front of ``x`` along ``dim`` up to ``width`` (KV: (B, heads, L, D); mask: (B, L))."""
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _prefill(host: SamplingHost, requests: list[SampleRequest], cache: DynamicCache,
             hits: list[tuple[int, KV | None]]):
    """Left-padded prompts -> hidden state of each prompt's last token (P, H), mask (P, L).

    ``hits[k]`` = (n, KV of prompt k's first n tokens) from the prefix cache, or (0, None):
    those KV go into ``cache`` first (left-padded to the longest hit), and only the rest
    of each prompt runs. The hits must leave no row padding between its reused KV and its
    new tokens (``_without_gaps``).
    """
    suffixes = [r.prompt[n:] for r, (n, _) in zip(requests, hits)]
    width = max(len(s) for s in suffixes)
    pad = host.tokenizer.pad_token_id or 0
    dev = host.device
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in suffixes], device=dev)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in suffixes], device=dev)  # (P, L)
    if any(n for n, _ in hits):
        mask = torch.cat([_fill_reused(cache, hits, dev), mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -width:]
    decide_product_forms(host, ids.numel(), requests[0].adapter_id)
    with host.routing.route([r.adapter_id for r in requests]):
        out = _trunk(host, ids, mask, positions, cache)
    # a copy: the view would keep the whole (P, T, H) output alive in the batch, and a
    # strided input can round the first draw's logits differently from a compact one
    return out.last_hidden_state[:, -1].clone(), mask


def _without_gaps(requests: list[SampleRequest], hits: list[tuple[int, KV | None]]) -> list[tuple[int, KV | None]]:
    """The hits cut so that every row's new tokens fill the prefill's width: a row whose
    new part is shorter than the longest recomputes the end of its hit instead of taking
    padding there (no more work: those columns run either way). Padding between a row's
    reused KV and its new tokens would break two things: a sliding window is measured in
    cache columns, so the new tokens would lose sight of reused ones inside their window
    (0.2-0.4 nats on Mistral and Qwen2), and ``_row_kv`` stores a row's last positions as
    its real ones (rows are padded on the left only)."""
    if not hits:
        return hits
    width = max(len(r.prompt) - n for r, (n, _) in zip(requests, hits))
    cut: list[tuple[int, KV | None]] = []
    for r, (n, kv) in zip(requests, hits):
        keep = max(0, n - (width - (len(r.prompt) - n)))
        cut.append((keep, [(k[:, :keep], v[:, :keep]) for k, v in kv]) if keep and kv else (0, None))
    return cut


def _fill_reused(cache: DynamicCache, hits: list[tuple[int, KV | None]], device: torch.device) -> torch.Tensor:
    """Put each row's reused KV (``hits[k]`` = (n, KV of n tokens) or (0, None)) into an empty
    cache, left-padded to the longest; returns their mask (rows, longest)."""
    width = max(n for n, _ in hits)
    template = next(kv for _, kv in hits if kv is not None)
    for layer, (k0, v0) in enumerate(template):
        keys = _stack([_pad_left((kv[layer][0] if kv else k0[:, :0])[None], width) for _, kv in hits])
        values = _stack([_pad_left((kv[layer][1] if kv else v0[:, :0])[None], width) for _, kv in hits])
        cache.update(keys, values, layer)  # copies them in: the prefix cache's entry stays as it was
    return torch.tensor([[0] * (width - n) + [1] * n for n, _ in hits], device=device)


def _stack(rows: list[torch.Tensor]) -> torch.Tensor:
    """``rows`` (each (1, ...)) concatenated into one batch; a lone row as it is (the cache copies it anyway:
    at a few thousand cached tokens each copy of a conversation's KV costs milliseconds)."""
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def _row_kv(cache: DynamicCache, mask: torch.Tensor, row: int) -> KV:
    """Row ``row``'s KV at its real positions, copied out of the batch: per layer (heads, L, D).

    A row's real positions are its last ones (rows are only ever padded on the left), so
    they are a slice: copying it ran 5x as fast as gathering by the mask (a 2000-token
    prompt's KV, 92 MB in fp32: 6 vs 32 ms)."""
    start = mask.shape[1] - int(mask[row].sum())
    return [(layer.keys[row][:, start:].clone(), layer.values[row][:, start:].clone()) for layer in _kv_layers(cache)]


def _decode(host: SamplingHost, tokens: torch.Tensor, mask: torch.Tensor, cache: DynamicCache, adapters):
    """One step for every live row: (R,) new tokens -> (R, H) hidden states."""
    positions = (mask.sum(-1, keepdim=True) - 1)  # (R, 1)
    decide_product_forms(host, len(tokens), adapters[0])
    with host.routing.route(adapters):
        out = _trunk(host, tokens[:, None], mask, positions, cache)
    return out.last_hidden_state[:, -1]


def decide_product_forms(host: SamplingHost, rows: int, adapter: str | None) -> None:
    """Before an inference pass of ``rows`` rows: the form of its few-row products, decided
    once per band of rows by the model's own forward on that many one-token rows of
    ``adapter`` (``lora.decide_few_row_forms``), the head included, as a decode step runs
    them. Every inference pass calls it (prefill, decode, draw, the host's passes without
    gradients), so a call's numbers do not depend on which pass came first."""
    if host.routing.packed.enabled:  # its products read packed weights, whatever the form
        return

    def forward(band: int) -> None:
        ids = torch.zeros(band, 1, dtype=torch.long, device=host.device)
        with host.routing.route([adapter] * band):
            host.unembed(host.trunk(input_ids=ids, use_cache=False).last_hidden_state[:, -1])

    lora.decide_few_row_forms(host.routing.few_row_forms, host.trunk, rows, forward)


@functools.cache
def _cache_keyword(forward: Callable[..., Any]) -> str:
    """transformers 5 renamed ``past_key_values`` to ``cache``; accept both generations
    (looked up once per trunk class's ``forward``, not at every decode step)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _trunk(host: SamplingHost, ids, mask, positions, cache: DynamicCache):
    kwargs = {_cache_keyword(type(host.trunk).forward): cache}
    # No padded row (one prompt length): no mask, so attention takes its causal fast path.
    attention_mask = None if bool(mask.all()) else mask
    return host.trunk(
        input_ids=ids, attention_mask=attention_mask, position_ids=positions, use_cache=True, **kwargs
    )


def _logits(host: SamplingHost, hidden: torch.Tensor, adapters) -> torch.Tensor:
    decide_product_forms(host, hidden.shape[0], adapters[0])
    with host.routing.route(adapters):
        return host.unembed(hidden).float()  # (R, V)


def _draw(logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
    """Sample one token per row, rows of a request drawing from that request's generator.

    Rows whose requests filter alike (temperature, top-k, top-p, seeded or not) share one
    pass of the chain; only the random numbers are drawn per request, from its own
    generator, so the draws are those each request would make alone.

    A row's logits move in their last bits with the rows beside it (fp32 matrix products
    round a row differently with the number of rows), so a draw that such a change can
    flip must be rare where the request asked for reproducible tokens. An unseeded row
    draws by inverse CDF: one uniform number, but a flip whenever it lands among tokens
    whose probabilities are below the noise of the running sum (1 draw in ~700 on the
    bundled model). A seeded row takes the exponential race, argmax(p / E) with E ~ Exp(1)
    per token (an exact draw from p): a flip needs its two best ratios within the logits'
    noise (~1 draw in 100,000); run over blocks of the vocabulary, then within one, it takes
    a few hundred random numbers a row (``_exponential_race``).
    Greedy rows (temperature 0, or top-k 1: bf16 logits tie) take the argmax.
    """
    out = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    groups: dict[tuple[float, int, float, bool], list[int]] = {}
    for j, row in enumerate(rows):
        c = row.owner.request.config
        groups.setdefault((c.temperature, c.top_k, c.top_p, c.seed is not None), []).append(j)
    for (_, _, _, seeded), js in groups.items():
        idx = _rows_index(js, logits.device)
        config = rows[js[0]].owner.request.config
        if config.temperature == 0 or config.top_k == 1:
            out[idx] = logits[idx].argmax(-1)
            continue
        probs = filtered_probs(logits[idx], config)
        # random numbers per row, in row order, from the generator of the row's request
        runs = [list(run) for _, run in itertools.groupby(js, key=lambda j: id(rows[j].owner))]
        width = race_width(probs.shape[-1]) if seeded else 1
        u = torch.cat([_uniform(len(run), width, rows[run[0]].owner.gen, logits.device) for run in runs])
        out[idx] = _exponential_race(probs, u) if seeded else _inverse_cdf(probs, u)
    return out


def _rows_index(js: list[int], device: torch.device) -> slice | torch.Tensor:
    """Row indices as a slice when contiguous (a view, no copy), else a tensor."""
    if js == list(range(js[0], js[-1] + 1)):
        return slice(js[0], js[-1] + 1)
    return torch.tensor(js, device=device)


def filtered_probs(logits: torch.Tensor, c: SamplingConfig) -> torch.Tensor:
    """(R, V) fp32 logits -> (R, V) probabilities after temperature (> 0), top-k and top-p.

    The logits are shifted to a maximum of 0 before the temperature divides them, so a tiny
    temperature sends them to -inf, not the likeliest to +inf (and the softmax to NaN); one
    below fp32's smallest normal number divides as that number (not as 0, into 0 / 0)."""
    top_k = 0 < c.top_k < logits.shape[-1]
    top_p = c.top_p < 1
    if c.temperature == 1 and not (top_k or top_p):  # softmax shifts by the maximum itself: the same bits
        return logits.softmax(-1)
    shifted = logits - logits.amax(-1, keepdim=True)  # amax: max would find the indices too (2x the time)
    logits = shifted / max(c.temperature, torch.finfo(torch.float32).tiny)
    if top_k:
        kth = logits.topk(c.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop = probs.cumsum(-1) - probs >= c.top_p
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
        logits = torch.full_like(logits, -math.inf).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)


def _uniform(n: int, width: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """(n, width) uniform numbers in [0, 1): the only randomness of a draw."""
    return torch.rand(n, width, generator=gen, dtype=torch.float32, device=device)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from (R, V) probabilities, given one uniform number per row (R, 1).

    Cheaper than torch.multinomial, which draws V exponentials per row.
    """
    cdf = probs.cumsum(-1)  # (R, V)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


RACE_BLOCK = 256  # tokens per block of the exponential race (``_exponential_race``)


def race_width(vocab: int) -> int:
    """The uniform numbers a row's exponential race takes: one per block, one per token of a block."""
    return -(-vocab // RACE_BLOCK) + RACE_BLOCK


def _exponential_race(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from (R, V) probabilities, given (R, ``race_width(V)``) uniform
    numbers: the token whose p / E is largest over E ~ Exp(1) a token, in two rounds.

    The vocabulary is cut into blocks of ``RACE_BLOCK`` tokens; a race between the blocks'
    masses (the first numbers of a row) picks a block, a race within it (the last
    ``RACE_BLOCK``) the token: p(block) · p(token | block) = p(token), an exact draw, from
    448 random numbers a row where one race over the vocabulary took 49152 (the bundled
    model's: 3.2 against 0.1 ms for 8 rows, 4% of a decode step). A flip still needs two
    ratios of one race within the logits' noise (the test below reads 400 draws unchanged
    by noise of 1e-4). A row's numbers are consecutive in its generator's stream, so on
    the CPU a request's first sample draws alike whatever its num_samples. Seeded tokens
    differ from those before session 37, which raced every token at once."""
    rows, vocab = probs.shape
    if vocab % RACE_BLOCK:  # zeros fill the last block (pad copies even when it adds nothing)
        probs = nn.functional.pad(probs, (0, -vocab % RACE_BLOCK))
    blocks = probs.view(rows, -1, RACE_BLOCK)  # (R, blocks, block)
    block = _race(blocks.sum(-1), u[:, :blocks.shape[1]])  # (R,)
    inside = blocks[torch.arange(rows, device=probs.device), block]  # (R, block)
    return block * RACE_BLOCK + _race(inside, u[:, blocks.shape[1]:])


def _race(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest w / E, E = -log u ~ Exp(1): a draw in proportion to
    the (R, n) ``weights``, given (R, n) uniform ``u``. u = 0 (one draw in 2^24) counts as
    fp32's smallest normal number: E = inf would give the one block holding all the mass
    a ratio of 0, and argmax the first block, whose mass may be 0."""
    return (weights / -u.clamp_min(torch.finfo(u.dtype).tiny).log()).argmax(-1)


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
        # decode a tail long enough to hold any stop string: a token holds at least one byte
        # of UTF-8 (an emoji can take three tokens), and a few more for a string's first
        # character begun in an earlier token
        tail = row.tokens[-(max(len(s.encode()) for s in c.stop_strings) + 4) :]
        text = host.tokenizer.decode(tail)
        if any(s in text for s in c.stop_strings):
            return "stop"
    if len(row.tokens) >= c.max_tokens:
        return "length"
    return ""
