"""Multi-adapter LoRA over one shared, frozen base model.

Each target ``nn.Linear`` is wrapped once in a ``LoRALinear`` that holds, per adapter,
``A`` (r, in) and ``B`` (out, r); the output for a row routed to adapter ``a`` is

    y = x W0^T + (alpha / r) * (x A_a^T) B_a^T

Rows are routed by a ``Routing`` object shared by all wrappers of a model and set by
the host before each forward: a list of (adapter_id, run of consecutive rows). Rows that
no run names run the plain base model. One batch can therefore hold rows of several
users' adapters (one forward pass for many ``forward_backward`` calls); each row's
result equals a run of its adapter alone. Callers put an adapter's rows next to each
other (the host does), so a batch of k adapters is k slices of the activations: their
gradients go back through one split, not through a scatter into full-size zeros per
adapter, which made a 4-adapter pass 30% slower than a 1-adapter pass of the same size.

A mixture-of-experts block's experts (3-D tensors, not linear layers) are wrapped once
in a ``LoRAExperts``, which holds a pair per expert and routes tokens the same way.

Inference in fp32 may instead take each layer's weights merged with one adapter,
W0 + (alpha / r) B_a A_a (``Routing.merging``, ``LoRALinear.merged_weight``): the sampler
asks for it while every row of a long decode batch uses one adapter. A decode step of a
few rows is mostly fixed costs, and the low-rank products were two of the three products
per layer: merged, 8 x 64 sampling of the bundled model ran 115 instead of 95 tokens/s
(one process, interleaved). The merged weights are a copy of the adapted layers' (540 MB
for the bundled model in fp32; kept packed where the host packs, ``PackedWeights``),
kept for the next pass and remade when the adapter changes or another is merged (a
stale copy stays until then, or until its adapter is deleted), so a host holds at most one such copy, and only on the CPU within
the host's budget (``mergeable``). bf16 never merges: W0 + s·B·A rounded to bf16 loses
the part of the update under half a unit in the last place of W0, most of a young
adapter's.

The LoRA parameters are kept in fp32 (they are the optimizer's master weights) and cast
to the activations' dtype in forward. They live on the base layer's device; their
initial values are drawn on the CPU, so a seed gives the same adapter on every device.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from .device import packed
from .errors import InvalidInputError

log = logging.getLogger("trio.engine")

# α is fixed rather than tied to rank, as in "LoRA Without Regret" (Schulman et al.,
# 2025): with scale α/r, the optimal learning rate is nearly rank-independent.
LORA_ALPHA = 32.0
MAX_RANK = 256


@dataclass(frozen=True)
class LoraConfig:
    """Shape of one adapter. ``alpha`` is fixed at 32 (see module docstring)."""

    rank: int = 32
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    alpha: float = LORA_ALPHA

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or not 1 <= self.rank <= MAX_RANK:
            raise InvalidInputError(f"rank: must be an integer in [1, {MAX_RANK}], got {self.rank!r}")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise InvalidInputError(
                "train_attn, train_mlp, train_unembed: at least one must be true, got all false"
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class Routing:
    """Which batch rows use which adapter for the next forward. Shared by all wrappers."""

    def __init__(self) -> None:
        self.segments: list[tuple[str, slice | None]] = []
        self.over_tokens = False
        self.rows: int | None = None
        self.few_row_forms: dict[int, bool] = {}  # band of rows -> W xᵀ taken (``decide_few_row_forms``)
        self.merged: str | None = None  # the adapter whose merged weights passes take (``merging``)
        self.packed = PackedWeights(enabled=False)  # the host turns it on where oneDNN packs (``PackedWeights.works``)
        self.may_merge = False  # set by the host: its layers' weights merge, within its budget (``mergeable``)

    @contextmanager
    def use(self, segments: list[tuple[str, slice | None]], over_tokens: bool = False,
            rows: int | None = None) -> Iterator[None]:
        """Route rows: ``[(adapter_id, slice of rows, or None for all rows)]``, the slices
        in row order and disjoint (as ``segments`` makes them). ``over_tokens``: the
        slices count tokens (the rows of an input's leading dimensions flattened), as a
        packed pass needs, whose one row holds sequences of several adapters. ``rows``:
        the batch's rows, which a layer that sees the tokens flattened (``LoRAExperts``)
        needs to place row slices."""
        previous = self.segments, self.over_tokens, self.rows
        self.segments, self.over_tokens, self.rows = segments, over_tokens, rows
        try:
            yield
        finally:
            self.segments, self.over_tokens, self.rows = previous

    @contextmanager
    def merging(self, adapter_id: str | None) -> Iterator[None]:
        """Within the block, a pass without gradients whose every row uses ``adapter_id``
        takes each adapted layer's weights merged with it (``LoRALinear.merged_weight``;
        only where ``may_merge``); None: none does."""
        previous = self.merged
        self.merged = adapter_id if self.may_merge else None
        try:
            yield
        finally:
            self.merged = previous

    def route(self, adapters: Sequence[str | None], over_tokens: bool = False) -> AbstractContextManager[None]:
        """``use`` for the adapter (or None: the base model) of each row, or of each token
        with ``over_tokens``; the batch's rows are the list's length."""
        return self.use(segments(adapters), over_tokens, rows=None if over_tokens else len(adapters))

    def token_runs(self, tokens: int) -> list[tuple[str, int, int]]:
        """The runs as (adapter_id, first token, end) over an input of ``tokens`` rows
        flattened from the batch's (rows, tokens per row)."""
        runs = []
        for adapter_id, run in self.segments:
            if run is None:
                runs.append((adapter_id, 0, tokens))
            elif self.over_tokens:
                runs.append((adapter_id, run.start, run.stop))
            else:
                if not self.rows or tokens % self.rows:
                    raise RuntimeError(f"routing: row slices reach a layer that sees {tokens} tokens flattened, "
                                       f"not a multiple of the batch's rows ({self.rows})")
                per_row = tokens // self.rows
                runs.append((adapter_id, run.start * per_row, run.stop * per_row))
        return runs

    def flattened(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s rows are the batch's tokens flattened rather than its rows: a
        packed pass, or a 2-D input of other rows than the batch's (a mixture-of-experts
        block flattens (B, T, H) before its shared expert's linears)."""
        return self.over_tokens or (x.dim() == 2 and self.rows is not None and x.shape[0] != self.rows)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus any number of named low-rank adapters."""

    def __init__(self, base: nn.Linear, routing: Routing):
        super().__init__()
        self.base = base
        self.routing = routing
        self.lora_A: dict[str, torch.Tensor] = {}  # id -> (r, in), fp32
        self.lora_B: dict[str, torch.Tensor] = {}  # id -> (out, r), fp32
        self.scales: dict[str, float] = {}
        self.group: SiblingGroup | None = None  # set by ``install`` when it fuses siblings
        # inference-time casts of A/B to the activation dtype, keyed by the tensor and its
        # version counter, which every in-place optimizer update bumps
        self._casts: dict[tuple[int, torch.dtype], tuple[int, torch.Tensor]] = {}
        # (A, B, their versions) and W0 + s·B·A made of them (``merged_weight``)
        self._merged: tuple[tuple[torch.Tensor, torch.Tensor, int, int], torch.Tensor] | None = None

    @property
    def weight(self) -> torch.Tensor:  # models that tie or inspect weights still work
        return self.base.weight

    def named_shapes(self, rank: int) -> dict[str, torch.Size]:
        """The shapes of an adapter's A and B here, by their names' suffixes."""
        out_f, in_f = self.base.weight.shape
        return {"lora_A": torch.Size((rank, in_f)), "lora_B": torch.Size((out_f, rank))}

    def tensors(self, adapter_id: str) -> dict[str, torch.Tensor]:
        return {"lora_A": self.lora_A[adapter_id], "lora_B": self.lora_B[adapter_id]}

    def add(self, adapter_id: str, rank: int, scale: float, gen: torch.Generator,
            storage: Sequence[torch.Tensor] | None = None) -> None:
        """Add an adapter. ``storage``: zeroed fp32 tensors of ``named_shapes(rank)`` on
        the layer's device to hold A and B (``add_adapter`` packs a whole adapter in one
        buffer); None: new ones."""
        a, b = storage or packed(list(self.named_shapes(rank).values()), self.base.weight.device)
        _draw_a(a, gen)
        self.lora_A[adapter_id] = a.requires_grad_(True)
        self.lora_B[adapter_id] = b.requires_grad_(True)
        self.scales[adapter_id] = scale

    def _as(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return _cast(self._casts, p, dtype)

    def remove(self, adapter_id: str) -> None:
        if self.group is not None:
            self.group.forget(adapter_id)
        if self._merged is not None and self._merged[0][0] is self.lora_A.get(adapter_id):
            self._merged = None  # it would keep the adapter's buffer alive
        _uncache(self._casts, [self.lora_A.pop(adapter_id, None), self.lora_B.pop(adapter_id, None)])
        self.scales.pop(adapter_id, None)

    def merged_weight(self, adapter_id: str) -> torch.Tensor:
        """W0 + s·B·A of adapter ``adapter_id`` (see the module docstring), made once and
        kept while the adapter's A and B are the same tensors at the same versions (every
        optimizer step bumps them); remade otherwise. Kept only in oneDNN's layout where
        the host packs weights (``PackedWeights``): a plain copy beside it would double
        the memory."""
        a, b = self.lora_A[adapter_id], self.lora_B[adapter_id]
        made = self._merged
        if made is not None and made[0][0] is a and made[0][1] is b and made[0][2:] == (a._version, b._version):
            return made[1]
        made = self._merged = None  # the old copy goes before the new one is made
        weight = self.base.weight
        with torch.no_grad():  # A and B are fp32: cast to an fp64 model's dtype
            merged = torch.addmm(weight, b.to(weight.dtype), a.to(weight.dtype), alpha=self.scales[adapter_id])
        if self.routing.packed.enabled:
            merged = pack(merged)
        self._merged = ((a, b, a._version, b._version), merged)
        return merged

    def _merged_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The merged weights this pass takes (``Routing.merging``): when every row uses
        the adapter being merged, and no gradient is wanted; else None."""
        adapter_id = self.routing.merged
        if (adapter_id is None or adapter_id not in self.lora_A or torch.is_grad_enabled()
                or self.routing.segments != [(adapter_id, None)]):
            return None
        return self.merged_weight(adapter_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, in) or (N, in)
        merged = self._merged_for(x)
        if merged is not None:
            # contiguous, as the low-rank addmm leaves it: W xᵀ's transposed view (of an
            # unpacked merged weight) made the ops after it slower than the copy costs
            # (8 x 64: 94 against 115 tokens/s)
            return linear_product(merged, self.base.bias, x, self.routing.few_row_forms).contiguous()
        if self.group is not None and self.group.applies(x):
            return self.group.output(self, x)
        out = linear_product(self.base.weight, self.base.bias, x, self.routing.few_row_forms, self.routing.packed)
        return with_adapters(out, x, self.routing, self.lora_A, self._adapted)

    def _adapted(self, out: torch.Tensor, x: torch.Tensor, adapter_id: str) -> torch.Tensor:
        """``out`` + this layer's low-rank update of adapter ``adapter_id`` on ``x``."""
        a = self._as(self.lora_A[adapter_id], x.dtype)
        b = self._as(self.lora_B[adapter_id], x.dtype)
        return _add_low_rank(out, x, a, b, self.scales[adapter_id])


def _draw_a(a: torch.Tensor, gen: torch.Generator) -> None:
    """Fill A (..., r, in) as PEFT's default does (kaiming-uniform, a=sqrt(5)):
    U(-1/sqrt(in), 1/sqrt(in)); B stays 0. Drawn by the CPU generator ``gen`` then copied:
    the same seed, the same A on any device."""
    bound = 1.0 / math.sqrt(a.shape[-1])
    a.copy_((torch.rand(a.shape, generator=gen) * 2 - 1) * bound)


def _cast(cache: dict[tuple[int, torch.dtype], tuple[int, torch.Tensor]], p: torch.Tensor,
          dtype: torch.dtype) -> torch.Tensor:
    """``p`` in ``dtype``; outside autograd kept in ``cache`` (by the tensor and its version
    counter, which every in-place optimizer update bumps) so decode steps don't re-cast."""
    if p.dtype == dtype or torch.is_grad_enabled():
        return p.to(dtype)
    key = (id(p), dtype)
    hit = cache.get(key)
    if hit is None or hit[0] != p._version:
        hit = (p._version, p.detach().to(dtype))
        cache[key] = hit
    return hit[1]


def _uncache(cache: dict[tuple[int, torch.dtype], tuple[int, torch.Tensor]],
             tensors: Sequence[torch.Tensor | None]) -> None:
    """Drop ``_cast``'s copies of ``tensors`` (in every dtype) from ``cache``."""
    gone = {id(p) for p in tensors if p is not None}
    for key in [key for key in cache if key[0] in gone]:
        del cache[key]


def with_adapters(out: torch.Tensor, x: torch.Tensor, routing: Routing, adapters: Collection[str],
                  adapted: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]) -> torch.Tensor:
    """The base output ``out`` of input ``x`` with the routed rows' low-rank updates:
    ``adapted(out_rows, x_rows, adapter_id)`` for each run of rows whose adapter is one
    of ``adapters``; other rows keep ``out``."""
    runs = [(adapter_id, rows) for adapter_id, rows in routing.segments if adapter_id in adapters]
    if not runs:
        return out.contiguous()  # linear_product's may be a transposed view
    if runs[0][1] is None:  # one adapter, every row
        return adapted(out, x, runs[0][0])
    if routing.flattened(x):
        out_rows, x_rows = out.reshape(-1, out.shape[-1]), x.reshape(-1, x.shape[-1])
        runs = [(adapter_id, slice(first, end)) for adapter_id, first, end in routing.token_runs(x_rows.shape[0])
                if adapter_id in adapters]
    else:
        out_rows, x_rows = out, x
    cuts, owners = _cut_at_runs(cast(list[tuple[str, slice]], runs), x_rows.shape[0])  # only slices past one None
    parts = zip(out_rows.split(cuts), x_rows.split(cuts), owners)
    return torch.cat([o if a is None else adapted(o, xs, a) for o, xs, a in parts]).view(out.shape)


class SiblingGroup:
    """Wrapped projections of one module that read the same input, computed as one.

    A bf16 decode step is a few rows, so each product's cost is mostly fixed (dispatch,
    oneDNN's set-up): an 8-row step of the bundled model made ~420 low-rank products of
    13-25 us each. Stacking q/k/v (and gate/up) makes one base product, one ``x Aᵀ`` over
    the stacked ``A``s and one ``addmm`` over the block-diagonal ``B``s (zeros off the
    diagonal: more FLOPs on rank-sized products, which cost nothing here) instead of three
    of each: bf16 sampling 1.12x faster for 8 x 64 tokens, 1.14x for one sequence.

    Memory: the stacks replace the members' cached bf16 casts of ``A`` and ``B``; the
    block-diagonal ``B``'s zeros make them ~1.7x those casts, ~23 instead of ~13 MB per
    sampled rank-32 adapter of the bundled model (its fp32 weights are ~45 MB). They go
    with the adapter (``forget``) and are rebuilt after any change to its weights.

    Only for inference in a reduced-precision dtype (``applies``). In fp32 the same gained
    2-4% (within noise) and its stacks would be a second copy of each sampled adapter
    (bf16 needs a cast copy anyway). In training, stacking was 1-4% slower (the wider
    matmul is no faster, and the block-diagonal ``B``'s gradient is three times the
    work), so a training pass runs each member alone, exactly as before.

    The first member called with an input computes every member's output and keeps the
    others' for them; a member called with that same tensor (same object, unchanged)
    takes its own. A member called with another input, or twice, gets a fresh group
    product, so a model that feeds its siblings different tensors stays right (if
    slower). An adapter on only some members, or with different scales, is applied
    member by member.
    """

    def __init__(self, members: Sequence[LoRALinear], weight: torch.Tensor, bias: torch.Tensor | None):
        self.members = list(members)
        self.weight = weight  # (sum of outs, in); the members' weights are views of it
        self.bias = bias
        self.sizes = [m.base.out_features for m in members]
        self.routing = members[0].routing
        self._pending: tuple[torch.Tensor, int, dict[int, torch.Tensor]] | None = None
        # (stacked A, block-diagonal B) per (adapter, dtype), valid while the members'
        # tensors keep the versions recorded with them (every optimizer step bumps them)
        self._stacks: dict[tuple[str, torch.dtype], tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def applies(x: torch.Tensor) -> bool:
        """Whether a product of ``x`` goes through the group (see the class docstring).
        Not for tensors made under ``torch.inference_mode``: they have no version counter,
        which ``output`` needs to know an input unchanged."""
        return not torch.is_grad_enabled() and x.dtype in (torch.bfloat16, torch.float16) and not x.is_inference()

    def output(self, member: LoRALinear, x: torch.Tensor) -> torch.Tensor:
        """``member``'s output for ``x``."""
        pending = self._pending
        if pending is not None and pending[0] is x and pending[1] == x._version and id(member) in pending[2]:
            out = pending[2].pop(id(member))
            if not pending[2]:
                self._pending = None
            return out
        outs = dict(zip((id(m) for m in self.members), self._compute(x), strict=True))
        mine = outs.pop(id(member))
        self._pending = (x, x._version, outs)
        return mine

    def forget(self, adapter_id: str) -> None:
        for key in [k for k in self._stacks if k[0] == adapter_id]:
            del self._stacks[key]

    def _compute(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = linear_product(self.weight, self.bias, x, self.routing.few_row_forms, self.routing.packed)
        adapters = set().union(*(m.lora_A for m in self.members))
        return list(with_adapters(out, x, self.routing, adapters, self._adapted).split(self.sizes, dim=-1))

    def _adapted(self, out: torch.Tensor, x: torch.Tensor, adapter_id: str) -> torch.Tensor:
        scales = {m.scales[adapter_id] for m in self.members if adapter_id in m.lora_A}
        if len(scales) != 1 or not all(adapter_id in m.lora_A for m in self.members):
            parts = out.split(self.sizes, dim=-1)
            return torch.cat([m._adapted(o, x, adapter_id) if adapter_id in m.lora_A else o
                              for m, o in zip(self.members, parts, strict=True)], dim=-1)
        a, b = self._stacked(adapter_id, x.dtype)
        return _add_low_rank(out, x, a, b, scales.pop())

    def _stacked(self, adapter_id: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(stacked A, block-diagonal B) of an adapter in ``dtype``, cached until any of
        them changes."""
        a_list = [m.lora_A[adapter_id].detach() for m in self.members]
        b_list = [m.lora_B[adapter_id].detach() for m in self.members]
        versions = tuple(p._version for p in a_list + b_list)
        hit = self._stacks.get((adapter_id, dtype))
        if hit is None or hit[0] != versions:
            hit = (versions, torch.cat(a_list).to(dtype), torch.block_diag(*b_list).to(dtype))
            self._stacks[(adapter_id, dtype)] = hit
        return hit[1], hit[2]



class LoRAExperts(nn.Module):
    """A mixture-of-experts block's experts plus any number of named low-rank adapters.

    The experts are transformers 5's 3-D tensors ``gate_up_proj`` (E, 2I, H) and
    ``down_proj`` (E, H, I) (Qwen2/3-MoE, Mixtral, OLMoE and others). An adapter holds a
    rank-r pair per expert for each: A (E, r, in) and B (E, out, r). For a token routed to
    expert e, under adapter a,

        h = gate(x W_gu[e]ᵀ + s (x A_gu[e]ᵀ) B_gu[e]ᵀ),   y = h W_d[e]ᵀ + s (h A_d[e]ᵀ) B_d[e]ᵀ

    which is what peft's LoRA on ``target_parameters`` does (a low-rank change of each
    expert's weights). Tokens are routed to adapters as by ``LoRALinear`` (the block sees
    them flattened, so ``Routing.token_runs``); a pass without adapters runs the module's
    own forward.

    The (token, expert) pairs are sorted by adapter, then by expert: each adapter's pairs
    are one block, and each of its products one grouped matmul over the experts
    (``grouped_linear``), so a pass costs a few calls per block whatever the number of
    experts, where a loop over 128 experts would launch a kernel per expert and product
    on a GPU. Only the layout above is wrapped (``fits``), and only where a probe gives the
    module's own output (``agrees``); other layouts (biases, transposed or interleaved
    weights) stay refused by ``model.select_targets``.
    """

    PARTS = ("gate_up_proj", "down_proj")

    def __init__(self, base: nn.Module, routing: Routing):
        super().__init__()
        self.base = base
        self.routing = routing
        self.lora_A: dict[str, dict[str, torch.Tensor]] = {}  # id -> part -> (E, r, in), fp32
        self.lora_B: dict[str, dict[str, torch.Tensor]] = {}  # id -> part -> (E, out, r), fp32
        self.scales: dict[str, float] = {}
        self._casts: dict[tuple[int, torch.dtype], tuple[int, torch.Tensor]] = {}

    def weight(self, part: str) -> torch.Tensor:
        """The base experts' weights of ``part`` (one of ``PARTS``): (E, out, in)."""
        return cast(torch.Tensor, getattr(self.base, part))

    @staticmethod
    def fits(module: nn.Module) -> bool:
        """Whether ``module`` holds experts in the one layout this class computes (the
        flags are those transformers' ``use_experts_implementation`` sets)."""
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)
                and gate_up.dim() == 3 and down.dim() == 3):
            return False
        experts, double_inner, hidden = gate_up.shape
        flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                 "has_post_expert_norm": False}
        # peft nests its wrappers of a module's tensors in their order (checkpoint._peft_tensor)
        registered = [name for name, _ in module.named_parameters(recurse=False) if name in LoRAExperts.PARTS]
        return (down.shape == (experts, hidden, double_inner // 2) and double_inner % 2 == 0
                and registered == list(LoRAExperts.PARTS)
                and all(getattr(module, flag, None) is value for flag, value in flags.items())
                and callable(getattr(module, "_apply_gate", None)))

    def agrees(self) -> bool:
        """Whether this class's computation gives the module's own output on a probe of a
        few random tokens (a family that computes its experts otherwise is not wrapped)."""
        weight = self.weight("gate_up_proj")
        experts, _, hidden = weight.shape
        gen = torch.Generator(device="cpu").manual_seed(0)
        tokens, top_k = 6, min(2, experts)
        x = torch.randn(tokens, hidden, generator=gen).to(weight.device, weight.dtype)
        index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(weight.device)
        weights = torch.rand(tokens, top_k, generator=gen).to(weight.device, weight.dtype)
        try:
            with torch.no_grad():
                own = self.base(x, index, weights).float()
                ours = self._computed(x, index, weights, []).float()
        except (RuntimeError, TypeError, ValueError, IndexError, AttributeError):
            return False  # a forward of another signature or workings: left as it is, and refused
        tolerance = 1e-4 if weight.dtype == torch.float32 else 3e-2
        return bool(torch.allclose(ours, own, rtol=tolerance, atol=tolerance * float(own.abs().max())))

    def named_shapes(self, rank: int) -> dict[str, torch.Size]:
        shapes = {}
        for part in self.PARTS:
            experts, out_f, in_f = self.weight(part).shape
            shapes[f"{part}.lora_A"] = torch.Size((experts, rank, in_f))
            shapes[f"{part}.lora_B"] = torch.Size((experts, out_f, rank))
        return shapes

    def tensors(self, adapter_id: str) -> dict[str, torch.Tensor]:
        tensors = {}
        for part in self.PARTS:
            tensors[f"{part}.lora_A"] = self.lora_A[adapter_id][part]
            tensors[f"{part}.lora_B"] = self.lora_B[adapter_id][part]
        return tensors

    def add(self, adapter_id: str, rank: int, scale: float, gen: torch.Generator,
            storage: Sequence[torch.Tensor] | None = None) -> None:
        """Add an adapter (``LoRALinear.add``; ``storage`` in ``named_shapes`` order)."""
        views = list(storage or packed(list(self.named_shapes(rank).values()), self.weight("down_proj").device))
        self.lora_A[adapter_id], self.lora_B[adapter_id] = {}, {}
        for part, a, b in zip(self.PARTS, views[::2], views[1::2], strict=True):
            _draw_a(a, gen)
            self.lora_A[adapter_id][part] = a.requires_grad_(True)
            self.lora_B[adapter_id][part] = b.requires_grad_(True)
        self.scales[adapter_id] = scale

    def remove(self, adapter_id: str) -> None:
        _uncache(self._casts, [*self.lora_A.pop(adapter_id, {}).values(), *self.lora_B.pop(adapter_id, {}).values()])
        self.scales.pop(adapter_id, None)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        runs = [run for run in self.routing.token_runs(hidden.shape[0]) if run[0] in self.lora_A]
        if not runs:
            return self.base(hidden, top_k_index, top_k_weights)
        return self._computed(hidden, top_k_index, top_k_weights, runs)

    def _computed(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  runs: list[tuple[str, int, int]]) -> torch.Tensor:
        """The experts' output for tokens ``hidden`` (N, H), each sent to ``top_k_index``'s
        experts (N, k) with ``top_k_weights``, the tokens of ``runs`` through their adapters.

        The (token, expert) pairs are sorted by adapter (the base model's last), then by
        expert, then by token: each adapter's pairs are one block whose experts' rows are
        consecutive, computed by grouped products (``grouped_linear``)."""
        tokens, top_k = top_k_index.shape
        experts = self.weight("down_proj").shape[0]
        adapters = list(dict.fromkeys(adapter_id for adapter_id, _, _ in runs))
        slot = torch.full((tokens,), len(adapters), dtype=torch.long, device=hidden.device)
        for adapter_id, first, end in runs:
            slot[first:end] = adapters.index(adapter_id)
        key = (slot.unsqueeze(1) * experts + top_k_index).reshape(-1)
        order = torch.argsort(key, stable=True)
        rows = torch.bincount(key, minlength=(len(adapters) + 1) * experts).view(-1, experts)  # (block, expert)
        blocks = list(zip([*adapters, None], rows.cumsum(dim=1), strict=True))  # each block's expert ends
        sizes = rows.sum(dim=1).tolist()
        apply_gate = cast(Callable[[torch.Tensor], torch.Tensor], self.base._apply_gate)
        # index_select and index_copy, not indexing: their backwards are an index_add and a
        # gather, where indexing's scatter (index_put) took 5% of a training step
        inner = apply_gate(self._by_blocks(hidden.index_select(0, order // top_k), "gate_up_proj", blocks, sizes))
        out = self._by_blocks(inner, "down_proj", blocks, sizes) * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        unsorted = torch.index_copy(torch.empty_like(out), 0, order, out)  # back to (token, k) order
        return unsorted.view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype)

    def _by_blocks(self, x: torch.Tensor, part: str, blocks: list[tuple[str | None, torch.Tensor]],
                   sizes: list[int]) -> torch.Tensor:
        """``part``'s products of sorted rows ``x``, block by block: ``blocks`` (adapter or
        None, where each expert's rows end in the block (E,)), their sizes ``sizes``."""
        weight = self.weight(part)
        outs = []
        for (adapter_id, ends), x_block in zip(blocks, x.split(sizes), strict=True):
            if not len(x_block):
                continue
            y = grouped_linear(x_block, weight, ends)
            if adapter_id is not None:
                a, b = (self._factors(t[adapter_id][part], x.dtype) for t in (self.lora_A, self.lora_B))
                y = y.add_(grouped_linear(grouped_linear(x_block, a, ends), b, ends), alpha=self.scales[adapter_id])
            outs.append(y)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _factors(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An adapter's A or B stack in ``dtype`` (outside autograd the cached cast)."""
        return p.to(dtype) if torch.is_grad_enabled() else _cast(self._casts, p, dtype)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` (N, in) sorted by expert, expert e's rows ending at ``ends[e]``, each
    times its expert's ``weight[e]``ᵀ ((E, out, in)): (N, out).

    One grouped product (``torch._grouped_mm``) where the kernel takes these tensors
    (``_groups_fit``), else a product per expert with rows: the same numbers (each
    expert's rows are one matmul either way), without a Python loop over the experts."""
    if _groups_fit(x, weight):
        return torch._grouped_mm(x, weight.mT, offs=ends.to(torch.int32))
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    outs = [nn.functional.linear(x_e, weight[e]) for e, x_e in enumerate(x.split(counts)) if len(x_e)]
    return torch.cat(outs) if len(outs) > 1 else outs[0]


GROUPED_MM_ALIGNMENT = 16  # bytes: torch._grouped_mm's stride (and, on a GPU, address) alignment


def _groups_fit(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes x (N, in) and ``weight.mT``: on the CPU in
    fp32, bf16 and fp16, on a GPU in bf16 (compute capability 8.0 on; torch runs one
    grouped kernel on 9.0 and 10.0, a product per group in C++ on the others), each
    operand row- or column-major with its other stride on ``GROUPED_MM_ALIGNMENT`` bytes
    (torch's own rule), and the output's rows too (its gradient's, in the backward): a
    rank-r adapter's products want r a multiple of 4 in fp32 and of 8 in bf16. Other ranks
    and dtypes take the loop."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype or torch.__version__ < "2.9":
        return False  # before 2.9 torch ran it on compute capability 9.0 alone, and not on the CPU
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    # the backward multiplies the output's gradient, (N, out) rows: they must fit too
    output_fits = (weight.shape[1] * x.element_size()) % GROUPED_MM_ALIGNMENT == 0
    return (output_fits and _aligned_layout(x) and _aligned_layout(weight.mT)
            and all(t.data_ptr() % GROUPED_MM_ALIGNMENT == 0 for t in (x, weight)))


def _aligned_layout(matrix: torch.Tensor) -> bool:
    """Whether the last two dimensions are column- or row-major (tested in that order, as
    torch does) with the other stride a multiple of ``GROUPED_MM_ALIGNMENT`` bytes."""
    (rows, cols), (row_stride, col_stride) = matrix.shape[-2:], matrix.stride()[-2:]
    if row_stride == 1 and col_stride >= max(1, rows):
        other = col_stride
    elif col_stride == 1 and row_stride >= max(1, cols):
        other = row_stride
    else:
        return False
    return (other * matrix.element_size()) % GROUPED_MM_ALIGNMENT == 0


# Decode-sized inference products (a few rows) in fp32 on the CPU: which of x Wᵀ (the
# usual form) and W xᵀ is faster depends on the CPU's BLAS kernels for skinny products,
# on the weight's shape, on the number of rows (benchmarks/decode_linear.py, the bundled
# model's shapes) and on the layout of the input, which the form of the product before
# makes (W xᵀ leaves a transposed view, and the elementwise ops after it keep that layout):
# - on an AVX2 machine (this project's, through session 17), BLAS multiplied one row by Wᵀ
#   on one thread and 2-16 rows at a third of its speed, while W xᵀ ran near memory speed:
#   a 1536x576 linear 2.0x / 3.9x / 1.8x faster for 1 / 2 / 8 rows, the 49152x576 head
#   2.7x / 6.2x for 1 / 2, still 1.1-1.4x at 64 rows;
# - on an AVX-512 + AMX machine (B, sessions 18-30) x Wᵀ was the faster form at 1-8 rows;
# - on an AVX-512 machine without AMX (C, from session 31), measured alone per shape, W xᵀ
#   won for some shapes and lost for others (the down projection at 0.64x at 8 rows), and
#   the measurement moved across the bar from one process to the next; in the model, W xᵀ
#   for every product ran 8 x 64 sampling at 103 tokens/s, x Wᵀ for every product at 81, and
#   the per-shape choice at 85-94 (one process, interleaved).
# So the form is decided for a whole model at once, per band of row counts: the model's own
# forward on that many one-token rows (``decide_few_row_forms``, called before any inference
# pass of that band: the sampler's prefill, decode and draw, the host's passes without
# gradients) is timed with every product in each form, interleaved, and W xᵀ is taken where
# it ran at least ``WEIGHT_MAJOR_MIN_GAIN`` as fast. The decisions are the model's own
# (``Routing.few_row_forms``): another model, of other shapes, runs its own trial. bf16 keeps
# x Wᵀ, its faster form for up to 16 rows on machines A and B, and in the model on C.
# All of this is the fallback for a host whose weights are not packed (``PackedWeights``:
# faster than either form where oneDNN works, so such a host runs no trial).
FEW_ROW_BANDS = (1, 2, 8, 16, 32, 64)  # a product of r rows takes the form decided at the first band >= r
WEIGHT_MAJOR_MAX_ROWS = FEW_ROW_BANDS[-1]
WEIGHT_MAJOR_MIN_GAIN = 1.05  # a trial's noise (the median of 5 rounds' ratios) stays within this
FEW_ROW_FORM_ENV = "TRIO_FEW_ROW_FORM"  # "weight_major" or "usual": decide without a trial
TRIAL_SECONDS = 2.0  # the timed rounds of one band's trial, at most (``_tried``)
_few_row_form_lock = threading.Lock()


class _Trial(threading.local):
    form: bool | None = None  # during a trial on this thread: the form every product takes


_trial = _Trial()


def weight_major(x: torch.Tensor, weight: torch.Tensor, forms: Mapping[int, bool] | None = None) -> bool:
    """Whether ``x``'s product with ``weight`` takes the W x^T form (see above): a few-row
    fp32 CPU product outside autograd, in the form ``forms`` (band of rows -> W x^T taken,
    the model's ``Routing.few_row_forms``) holds for its band."""
    rows = x.numel() // x.shape[-1]
    return (not torch.is_grad_enabled() and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and rows <= WEIGHT_MAJOR_MAX_ROWS and weight_major_pays(rows, forms))


def weight_major_pays(rows: int, forms: Mapping[int, bool] | None) -> bool:
    """Whether W x^T is the form at ``rows`` rows: the trial's, while one runs on this
    thread; else as ``forms`` decided; else as ``$TRIO_FEW_ROW_FORM`` says (x W^T unset)."""
    if _trial.form is not None:
        return _trial.form
    decided = forms.get(few_row_band(rows)) if forms else None
    return decided if decided is not None else _forced_form() == "weight_major"


def few_row_band(rows: int) -> int:
    """The first band of ``FEW_ROW_BANDS`` >= ``rows``."""
    return FEW_ROW_BANDS[bisect.bisect_left(FEW_ROW_BANDS, rows)]


def _forced_form() -> str | None:
    forced = os.environ.get(FEW_ROW_FORM_ENV) or None
    if forced not in (None, "weight_major", "usual"):
        raise ValueError(f"{FEW_ROW_FORM_ENV}: {forced!r} is not 'weight_major' or 'usual'")
    return forced


def decide_few_row_forms(forms: dict[int, bool], model: nn.Module, rows: int, forward: Callable[[int], object],
                         repeats: int = 5) -> None:
    """Decide into ``forms`` (``model``'s ``Routing.few_row_forms``) the form of its fp32 CPU
    products of ``rows`` rows, once per band of rows: ``forward(band)`` (the model on that
    many one-token rows) runs in each form, ``repeats`` interleaved rounds after one
    untimed, and W x^T is taken if it ran ``WEIGHT_MAJOR_MIN_GAIN`` as fast (the median
    round); 12 forwards, 0.5 to 2.5 s on the bundled model (1 to 64 rows), fewer on a model
    whose forwards take longer (``TRIAL_SECONDS``). ``$TRIO_FEW_ROW_FORM`` decides without
    timing; a model off fp32 or off the CPU has nothing to decide."""
    if rows > WEIGHT_MAJOR_MAX_ROWS or _trial.form is not None:  # no trial within a trial
        return
    band = few_row_band(rows)
    if band in forms:  # no lock on the decode path's every step
        return
    weight = next(model.parameters(), None)
    with _few_row_form_lock:
        if band in forms:
            return
        major = False
        if weight is not None and weight.dtype == torch.float32 and weight.device.type == "cpu":
            forced = _forced_form()
            gain = _tried(forward, band, repeats) if forced is None else None
            major = forced == "weight_major" or (gain is not None and gain >= WEIGHT_MAJOR_MIN_GAIN)
            log.info("fp32 products of up to %d rows take the %s form (%s)", band, "W x^T" if major else "x W^T",
                     f"${FEW_ROW_FORM_ENV}" if forced else f"the model ran {gain:.2f}x as fast in W x^T")
        forms[band] = major


def _tried(forward: Callable[[int], object], band: int, repeats: int) -> float:
    """The median over rounds of ``forward(band)``'s time in x W^T ÷ its time in W x^T (a
    ratio per round: a burst of other work on the machine slows one round's pair, not the
    decision). After the warm round, as many rounds as fit in ``TRIAL_SECONDS``, at least
    one and at most ``repeats``: a larger model's trial stays within a few of its steps."""
    ratios: list[float] = []
    rounds = repeats + 1
    round_ = 0
    while round_ < rounds:
        seconds = {}
        for form in (True, False) if round_ % 2 == 0 else (False, True):
            start = time.perf_counter()
            _in_form(forward, band, form)
            seconds[form] = time.perf_counter() - start
        if round_:
            ratios.append(seconds[False] / seconds[True])
        else:  # the first round warms both forms up, and sizes the trial
            rounds = 1 + max(1, min(repeats, int(TRIAL_SECONDS / (seconds[True] + seconds[False]))))
        round_ += 1
    return statistics.median(ratios)


def _in_form(forward: Callable[[int], object], band: int, form: bool) -> None:
    """Run ``forward(band)`` with every few-row fp32 product on this thread in W x^T
    (``form``) or x W^T."""
    _trial.form = form
    try:
        with torch.no_grad():
            forward(band)
    finally:
        _trial.form = None


def linear_product(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
                   forms: Mapping[int, bool] | None = None, packed: PackedWeights | None = None) -> torch.Tensor:
    """``x Wᵀ + bias``: from a packed weight (``weight`` itself, as a merged one is kept,
    or ``packed``'s copy of it where that applies), else as W x^T when that is the faster
    form: then a transposed view (copying it back to rows would cost as much as the head's
    product saves; the low-rank ``addmm`` that follows writes a fresh tensor anyway)."""
    if weight.is_mkldnn:
        return packed_product(weight, bias, x)
    if packed is not None and packed.applies(x, weight):
        return packed_product(packed.copy_of(weight), bias, x)
    if not weight_major(x, weight, forms):
        return nn.functional.linear(x, weight, bias)
    return weight_major_product(x, weight, bias)


class PackedWeights:
    """Copies of weights in oneDNN's blocked layout, which its CPU products read faster:
    every base product without gradients on the CPU takes one (and a merged weight is
    kept only so).

    A decode step's products are a few rows each, and on this project's machine C (Zen 4,
    AVX-512) oneDNN multiplied them from a packed weight 1.3-3x as fast as from the plain
    one (x Wᵀ, or W xᵀ in fp32): at 8 rows the bundled model's head 5.2 -> 2.0 ms in bf16,
    6.8 -> 4.3 ms in fp32 (W xᵀ), and still 1.1-1.2x at 1024-4096 rows (a prefill).
    bf16 products give the same bits as from the plain weight (oneDNN computes both);
    fp32 products round otherwise (MKL computes the plain ones), within fp32's error: the
    bundled model's sampled logprobs stayed within 3.8e-5 of the trainer's.

    A copy is made at a weight's first product and remade when the weight changes (its
    version counter: a merged weight remade after an optimizer step). Memory: one more
    copy of the base weights (540 MB for the bundled model in fp32, 270 in bf16). The
    trainer's products, which need gradients, read the plain weights."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._copies: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # id -> (weight, version, copy)

    @staticmethod
    def works(dtype: torch.dtype, device: torch.device) -> bool:
        """Whether oneDNN packs weights of ``dtype`` on ``device`` here and its products
        agree with ``nn.functional.linear`` on a probe (a torch built without oneDNN, a
        CPU it does not serve in that dtype, or a change in these private operators turns
        packing off rather than the host)."""
        if device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        gen = torch.Generator().manual_seed(0)
        weight, bias = torch.randn(40, 24, generator=gen).to(dtype), torch.randn(40, generator=gen).to(dtype)
        x = torch.randn(3, 5, 24, generator=gen).to(dtype)
        try:
            with torch.no_grad():
                got = packed_product(pack(weight), bias, x).float()
        except (RuntimeError, AttributeError, TypeError):
            return False
        want = nn.functional.linear(x, weight, bias).float()
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        return got.shape == want.shape and bool(torch.allclose(got, want, rtol=tolerance, atol=tolerance))

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return self.enabled and not torch.is_grad_enabled() and weight.device.type == "cpu" and x.dtype == weight.dtype

    def copy_of(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` packed: the kept copy while the weight is the same tensor, unchanged."""
        hit = self._copies.get(id(weight))
        if hit is None or hit[0] is not weight or hit[1] != weight._version:
            hit = (weight, weight._version, pack(weight))
            self._copies[id(weight)] = hit
        return hit[2]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """An (out, in) weight in oneDNN's blocked layout for ``packed_product`` (the layout
    chosen for 8-row products: it served 1 to 4096 rows as fast or faster than plain)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)


def packed_product(packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``x Wᵀ + bias`` from W packed by ``pack`` (no gradient: the operator has none)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def weight_major_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``nn.functional.linear(x, weight, bias)`` computed as W x^T."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows == 1:  # two rows take the two-thread kernel; one would take gemv's one thread
        flat = flat.repeat(2, 1)
    if bias is None:
        product = weight @ flat.t()  # (out, rows)
    else:
        product = torch.addmm(bias.unsqueeze(1), weight, flat.t())
    out = product.t()[:rows]
    return out.view(*x.shape[:-1], out.shape[-1])


def _add_low_rank(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """out + scale · (x Aᵀ) Bᵀ as one addmm over flattened tokens (fewer kernels per layer)."""
    flat = out.reshape(-1, out.shape[-1])  # (B·T, out)
    low = x.reshape(-1, x.shape[-1]) @ a.t()  # (B·T, r)
    return torch.addmm(flat, low, b.t(), alpha=scale).view(out.shape)


def _cut_at_runs(runs: list[tuple[str, slice]], rows: int) -> tuple[list[int], list[str | None]]:
    """The sizes of the parts that the runs' ends cut ``rows`` rows into, and each part's
    adapter (None between runs: those rows keep the base output)."""
    cuts: list[int] = []
    owners: list[str | None] = []
    position = 0
    for adapter_id, run in runs:
        if run.start > position:
            cuts.append(run.start - position)
            owners.append(None)
        cuts.append(run.stop - run.start)
        owners.append(adapter_id)
        position = run.stop
    if position < rows:
        cuts.append(rows - position)
        owners.append(None)
    return cuts, owners


def install(model: nn.Module, suffixes: Collection[str],
            sibling_names: Sequence[tuple[str, ...]] = (),
            within: Callable[[str], bool] = lambda path: True) -> Routing:
    """Wrap every linear layer of ``model`` named one of ``suffixes`` once (the model
    family's targets, ``model.FamilySpec.all_targets``), and every mixture-of-experts
    block's experts in ``LoRAExperts``' layout when ``suffixes`` name both its parts; fuse each module's children
    named as one of ``sibling_names`` (``FamilySpec.siblings``) into a ``SiblingGroup``
    where they fit (``fuse``); returns the shared Routing.

    ``within``: whether a module's path is one to wrap (the host passes
    ``model.text_forward_filter``: a multimodal model's vision tower, which a text forward
    never runs, keeps its plain ``q_proj``, so adapters and their files hold no weights
    for it)."""
    routing = Routing()
    wraps_experts = set(LoRAExperts.PARTS) <= set(suffixes)
    for path, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if not within(f"{path}.{child_name}" if path else child_name):
                continue
            if child_name in suffixes and isinstance(child, nn.Linear):
                setattr(module, child_name, LoRALinear(child, routing))
            elif wraps_experts and LoRAExperts.fits(child):
                experts = LoRAExperts(child, routing)
                if experts.agrees():
                    setattr(module, child_name, experts)
    for module in list(model.modules()):
        for names in sibling_names:
            members = [getattr(module, name, None) for name in names]
            if all(isinstance(m, LoRALinear) for m in members):
                fuse(cast(list[LoRALinear], members))
    return routing


def fuse(members: Sequence[LoRALinear]) -> SiblingGroup | None:
    """Give wrapped linears that read one input a ``SiblingGroup``, their weights (and
    biases) becoming views of the stacked ones. Weights already side by side in memory
    (as ``device.gather_on_huge_pages`` lays them out) are stacked in place; others are
    copied once into a new stack, whose views replace them.

    Returns None, changing nothing, when they do not fit one product: inputs of different
    sizes, another dtype or device, or biases on some only.
    """
    weights = [m.base.weight for m in members]
    biases = [m.base.bias for m in members]
    if (len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1
            or len({b is None for b in biases}) != 1):
        return None
    weight = _stacked_in_place(weights)
    if weight is None:
        weight = torch.cat([w.detach() for w in weights])
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
    start = 0
    for m in members:
        stop = start + m.base.out_features
        m.base.weight = nn.Parameter(weight[start:stop], requires_grad=False)
        if bias is not None:
            m.base.bias = nn.Parameter(bias[start:stop], requires_grad=False)
        start = stop
    group = SiblingGroup(members, weight, bias)
    for m in members:
        m.group = group
    return group


def _stacked_in_place(weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The weights as one (sum of rows, in) view when each starts where the last ends in
    one storage; else None."""
    first = weights[0]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for w in weights:
        if not w.is_contiguous() or w.data_ptr() != end or w.untyped_storage().data_ptr() != storage:
            return None
        end += w.numel() * w.element_size()
    rows = sum(w.shape[0] for w in weights)
    return first.detach().as_strided((rows, first.shape[1]), (first.shape[1], 1))


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear | LoRAExperts]]:
    """(module path as in the plain model, wrapper) for every wrapped layer."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear | LoRAExperts):
            yield name, module


def add_adapter(model: nn.Module, adapter_id: str, config: LoraConfig, targets: Collection[str]) -> None:
    """Create adapter weights in every targeted layer, deterministically from the seed.

    ``targets``: the layer names to adapt (the host passes its model family's, checked by
    ``model.select_targets``).
    The weights are views of one buffer (``device.packed``) on the model's device (a host
    lives on one); the generator stays on the CPU on purpose (device-independent
    initialisation).
    """
    gen = torch.Generator(device="cpu").manual_seed(config.seed)
    chosen = [module for _, module in _targeted(model, targets)]
    if not chosen:
        return
    per_module = [list(module.named_shapes(config.rank).values()) for module in chosen]
    device = next(chosen[0].base.parameters()).device
    views = iter(packed([shape for shapes in per_module for shape in shapes], device))  # one buffer
    for module, shapes in zip(chosen, per_module, strict=True):
        module.add(adapter_id, config.rank, config.scale, gen, [next(views) for _ in shapes])


def adapter_shapes(model: nn.Module, rank: int, targets: Collection[str]) -> dict[str, torch.Size]:
    """The names and shapes ``adapter_tensors`` gives an adapter of ``rank`` on ``targets``
    (``add_adapter``'s), without making one: what a saved adapter must match to load."""
    return {f"{name}.{suffix}": shape for name, module in _targeted(model, targets)
            for suffix, shape in module.named_shapes(rank).items()}


def _targeted(model: nn.Module, targets: Collection[str]) -> list[tuple[str, LoRALinear | LoRAExperts]]:
    """The wrapped layers an adapter on ``targets`` (layer names; experts by their parts'
    names) adapts, in model order."""
    return [(name, module) for name, module in lora_modules(model)
            if (set(LoRAExperts.PARTS) <= set(targets) if isinstance(module, LoRAExperts)
                else name.rsplit(".", 1)[-1] in targets)]


MERGEABLE_DTYPES = (torch.float32, torch.float64)  # bf16 would round the update away (module docstring)


def mergeable(model: nn.Module, budget: int) -> bool:
    """Whether ``model``'s adapted linear layers may keep weights merged with an adapter
    (``Routing.merging``): all in fp32 or fp64 on the CPU, their copy within ``budget``
    bytes. Not on a GPU: its gain there is unmeasured, and a copy that does not fit
    would fail a decode step rather than slow it."""
    weights = [module.base.weight for _, module in lora_modules(model) if isinstance(module, LoRALinear)]
    size = sum(w.numel() * w.element_size() for w in weights)
    return (bool(weights) and all(w.dtype in MERGEABLE_DTYPES and w.device.type == "cpu" for w in weights)
            and size <= budget)


def remove_adapter(model: nn.Module, adapter_id: str) -> None:
    for _, module in lora_modules(model):
        module.remove(adapter_id)


def adapter_tensors(model: nn.Module, adapter_id: str) -> dict[str, torch.Tensor]:
    """``{"<module>.lora_A": A, "<module>.lora_B": B}``: the adapter's parameters, live (for
    experts ``"<experts>.<part>.lora_A"``, one pair per part: ``LoRAExperts``)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, module in lora_modules(model):
        if adapter_id in module.lora_A:
            tensors.update({f"{name}.{suffix}": t for suffix, t in module.tensors(adapter_id).items()})
    return tensors


def segments(row_adapters: Sequence[str | None]) -> list[tuple[str, slice | None]]:
    """Runs of consecutive rows of one adapter, in row order: [(adapter_id, slice of rows)],
    or [(adapter_id, None)] when one adapter has every row. Rows of None run the base
    model. An adapter whose rows are not consecutive gets one run per stretch."""
    runs: list[tuple[str, slice | None]] = []
    start = 0
    for adapter_id, group in itertools.groupby(row_adapters):
        stop = start + len(list(group))
        if adapter_id is not None:
            runs.append((adapter_id, slice(start, stop)))
        start = stop
    if len(runs) == 1 and runs[0][1] == slice(0, len(row_adapters)):
        return [(runs[0][0], None)]
    return runs
