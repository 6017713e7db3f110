"""ModelHost: one base model in memory, many LoRA adapters, their optimizer state.

The service's worker calls a host from one thread. Every public method validates its
whole input before touching any state, so a bad request never leaves half an update.

Training batches (``forward_backward`` over several jobs, possibly of several adapters)
are sorted by length and cut into micro-batches under a token budget. A micro-batch of
sequences of different lengths runs packed: laid end to end in one row of real tokens,
each attending only within itself (``attention.packed``), so the linear layers see no
padding and the whole budget goes through in one pass. A training step of a ragged
batch of the bundled model (16 sequences of 32-256 tokens) took 9.10 s instead of 9.66 s
that way in fp32, against five right-padded micro-batches (7% padding), and 3.76 s
instead of 5.12 s in bf16 (one process, interleaved medians). Sequences of one length,
and models whose sliding window is shorter than a sequence (``attention.packs``), run
as a right-padded batch instead: with right padding a causal model never lets a real
token see a pad, so no attention mask is needed. Either way a datum's result does not
depend on its neighbours. The unembedding and the log-softmax run only on real tokens.

A host lives on one device (``device.resolve_device``): every tensor it makes is made
there, and everything it returns is device-free (Python lists, CPU checkpoints).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.utils.checkpoint import checkpoint as recompute_in_backward

from . import attention, checkpoint, lora, sampler
from .catalog import DEFAULT_MODEL, Catalog, load_model_and_tokenizer
from .device import DTYPES, resolve_device, resolve_dtype
from .errors import AdapterNotFoundError, InvalidInputError, NonFiniteLossError
from .losses import LOSSES, OPTIONAL_INPUTS
from .model import (
    Head,
    check_head,
    check_plain_head,
    context_of,
    family_of,
    select_targets,
    state_layers,
    text_config,
    text_forward_filter,
)
from .optim import AdamConfig, AdamState, adamw_step

log = logging.getLogger("trio.engine")

__all__ = [
    "DTYPES", "AdapterNotFoundError", "Adapter", "Example", "ForwardJob", "ForwardResult",
    "InvalidInputError", "ModelHost", "merge_results", "split_by_budget", "split_by_length",
]


@dataclass
class Example:
    """One datum: input ``tokens`` and per-token ``inputs`` (target_tokens, weights, ...)."""

    tokens: list[int]
    inputs: dict[str, Sequence[float]]


@dataclass
class ForwardJob:
    """One client's forward(_backward) call: its adapter, data and loss."""

    adapter_id: str | None
    examples: list[Example]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] = field(default_factory=dict)


@dataclass
class ForwardResult:
    logprobs: list[list[float]]  # per datum, per target token
    elementwise_loss: list[list[float]]
    metrics: dict[str, float]  # "loss:sum", and each loss metric's "<name>:mean" over ``active_tokens``
    active_tokens: float = 0.0  # tokens of non-zero weight: what the ":mean" metrics average over


DEFAULT_MERGE_BYTES = 2 << 30  # the bundled model's fp32 copy is 540 MB


def _merge_budget(merge_bytes: int | None) -> int:
    """``ModelHost``'s ``merge_bytes``, else ``$TRIO_MERGE_BYTES``, else the default."""
    if merge_bytes is not None:
        return merge_bytes
    text = os.environ.get("TRIO_MERGE_BYTES") or None
    if text is None:
        return DEFAULT_MERGE_BYTES
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"TRIO_MERGE_BYTES: {text!r} is not a whole number of bytes") from None


def _packs_weights() -> bool:
    """Whether inference products may read packed weights (``lora.PackedWeights``):
    ``$TRIO_PACK_WEIGHTS`` ``0`` turns it off, ``1`` (the default) on where it works."""
    text = os.environ.get("TRIO_PACK_WEIGHTS") or "1"
    if text not in ("0", "1"):
        raise ValueError(f"TRIO_PACK_WEIGHTS: {text!r} is not 0 or 1")
    return text == "1"


def merge_results(parts: list[ForwardResult]) -> ForwardResult:
    """One job's result from the results of its data's consecutive parts, run separately.

    Exact, as the metrics are made in ``ModelHost._collect``: per-datum outputs are
    concatenated in order, ``:sum`` metrics add, and each ``:mean`` is re-weighted by its
    part's ``active_tokens`` (a part without active tokens reports 0 and weighs nothing).
    """
    active = sum(p.active_tokens for p in parts)
    metrics: dict[str, float] = {}
    for part in parts:
        for name, value in part.metrics.items():
            weight = part.active_tokens if name.endswith(":mean") else 1.0
            metrics[name] = metrics.get(name, 0.0) + value * weight
    metrics = {k: v / max(active, 1.0) if k.endswith(":mean") else v for k, v in metrics.items()}
    return ForwardResult(
        logprobs=[lp for p in parts for lp in p.logprobs],
        elementwise_loss=[loss for p in parts for loss in p.elementwise_loss],
        metrics=metrics,
        active_tokens=active,
    )


@dataclass
class Adapter:
    config: lora.LoraConfig
    optim: AdamState = field(default_factory=AdamState)


class ModelHost:
    """A base model shared by many adapters.

    Args:
        model_name: a catalog name (``Catalog().available()`` lists them).
        dtype: compute dtype of the base weights; LoRA weights stay fp32. None:
            ``$TRIO_DTYPE``, else bfloat16 on CUDA and float32 on the CPU.
        catalog: where to look the name up.
        max_batch_tokens: token budget of one training micro-batch (its tokens, padding
            included where it is padded).
        device: ``"auto" | "cpu" | "cuda" | "cuda:N"`` or a torch.device. None:
            ``$TRIO_DEVICE``, else ``"auto"`` (CUDA when available).
        prefix_cache_bytes: the sampler's KV prefix cache's bound.
        merge_bytes: the most memory a copy of the adapted layers' weights merged with
            one adapter may take, which long fp32 decode batches of one adapter run on
            (``lora.Routing.merging``); 0 turns merging off. None: ``$TRIO_MERGE_BYTES``,
            else ``DEFAULT_MERGE_BYTES``.

    Raises:
        ValueError: an unknown or unavailable device, or an unknown dtype name.
        ModelNotAvailableError: the model cannot be loaded here.

    Example:
        >>> host = ModelHost("trio/tiny-llama", dtype="float32", device="cpu")
        >>> host.info()["device"]
        'cpu'
    """

    def __init__(
        self,
        model_name: str = DEFAULT_MODEL,
        dtype: torch.dtype | str | None = None,
        catalog: Catalog | None = None,
        max_batch_tokens: int = 4096,
        device: str | torch.device | None = None,
        prefix_cache_bytes: int = 256 << 20,
        merge_bytes: int | None = None,
    ):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model_name = model_name
        source = (catalog or Catalog()).resolve(model_name)
        self.model, self.tokenizer = load_model_and_tokenizer(source, self.dtype, device=self.device)
        self.family = family_of(self.model.config)  # LoRA targets and head, per model family
        check_head(self.family, self.model.config)
        check_plain_head(self.family, self.model)
        in_text = text_forward_filter(self.model)  # a vision tower is neither adapted nor loaded
        self.outside_text = frozenset(name for name, _ in self.model.named_modules() if not in_text(name))
        self.routing = lora.install(self.model, self.family.all_targets(), self.family.siblings, within=in_text)
        self.routing.may_merge = lora.mergeable(self.model, _merge_budget(merge_bytes))
        self.routing.packed.enabled = _packs_weights() and lora.PackedWeights.works(self.dtype, self.device)
        self.trunk = self.model.get_decoder()
        # the one place logits are made, trainer and sampler alike: lm_head + family transform
        self.unembed = Head(self.model.get_output_embeddings(), self.family.transform(self.model.config))
        self.vocab_size = int(self.unembed.weight.shape[0])
        self.max_seq_len = context_of(self.model.config)
        # Mamba, conv or linear-attention layers: their state would run from one packed
        # sequence into the next, and the sampler's cache does not keep it
        self.state_layers = state_layers(self.model)
        window = getattr(text_config(self.model.config), "sliding_window", None)  # a multimodal model's is its text's
        self.pack_limit = 0 if self.state_layers else attention.pack_limit(self.model, window)
        self.max_batch_tokens = max_batch_tokens
        self.adapters: dict[str, Adapter] = {}
        self.lock = threading.RLock()  # one engine call at a time per host
        self.prefix_cache = sampler.PrefixCache(prefix_cache_bytes)
        self._generation = itertools.count(1)
        self._adapter_generation: dict[str, int] = {}  # a re-created id never matches old cache keys
        # key -> an adapter's grads as they were (hold_grads), until release_grads
        self.held_grads: dict[str, tuple[str, dict[str, torch.Tensor | None]]] = {}

    # -- adapters ---------------------------------------------------------------------

    def create_adapter(self, adapter_id: str, config: lora.LoraConfig) -> None:
        """Add an adapter on the model family's target layers.

        Raises:
            InvalidInputError: the id exists, or a kind of layer the config asks for
                (train_attn / train_mlp / train_unembed) matches no layer of this model.
        """
        if adapter_id in self.adapters:
            raise InvalidInputError(f"adapter_id: {adapter_id!r} already exists")
        targets = select_targets(self.model, self.family, config)
        lora.add_adapter(self.model, adapter_id, config, targets)
        self.adapters[adapter_id] = Adapter(config)
        self._adapter_generation[adapter_id] = next(self._generation)

    def delete_adapter(self, adapter_id: str) -> None:
        lora.remove_adapter(self.model, adapter_id)
        self.adapters.pop(adapter_id, None)

    def adapter_params(self, adapter_id: str) -> dict[str, torch.Tensor]:
        self._adapter(adapter_id)
        return lora.adapter_tensors(self.model, adapter_id)

    def weights_key(self, adapter_id: str | None) -> Hashable:
        """Names an adapter's weights as they are now, for the sampler's prefix cache: its
        id, its creation, and the sum of its tensors' in-place version counters (which every
        optimizer step, load and hand edit raises), so it changes whenever the weights do."""
        if adapter_id is None:
            return None
        versions = sum(t._version for t in self.adapter_params(adapter_id).values())
        return adapter_id, self._adapter_generation.get(adapter_id, 0), versions

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self.adapters

    def adapter_config(self, adapter_id: str) -> tuple[lora.LoraConfig, int]:
        """An adapter's LoRA config and its optimizer step count."""
        adapter = self._adapter(adapter_id)
        return adapter.config, adapter.optim.step

    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer as its Hugging Face files: name -> bytes (some may be binary)."""
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as tmp:
            self.tokenizer.save_pretrained(tmp)
            return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}

    def _adapter(self, adapter_id: str) -> Adapter:
        try:
            return self.adapters[adapter_id]
        except KeyError:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} not found on this host") from None

    # -- validation -------------------------------------------------------------------

    def validate_job(self, job: ForwardJob) -> None:
        """Raise InvalidInputError naming datum, field and value; touches no state."""
        spec = LOSSES.get(job.loss_fn)
        if spec is None:
            raise InvalidInputError(
                f"loss_fn: unknown loss {job.loss_fn!r}; built-in losses: {sorted(LOSSES)}",
                field="loss_fn",
            )
        for key, value in job.loss_fn_config.items():
            if key not in spec.config_keys:
                raise InvalidInputError(
                    f"loss_fn_config[{key!r}]: not used by {job.loss_fn!r} "
                    f"(accepted: {list(spec.config_keys)})",
                    field="loss_fn_config",
                )
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise InvalidInputError(
                    f"loss_fn_config[{key!r}]: must be a finite number, got {value!r}",
                    field="loss_fn_config",
                )
        if why := spec.config_error(job.loss_fn_config):
            raise InvalidInputError(f"loss_fn_config: {why}", field="loss_fn_config")
        if job.adapter_id is not None:
            self._adapter(job.adapter_id)
        if not job.examples:
            raise InvalidInputError("data: empty batch, need at least one datum", field="data")
        allowed = {"target_tokens", *spec.required, *OPTIONAL_INPUTS}
        for i, ex in enumerate(job.examples):
            self._validate_example(i, ex, ("target_tokens", *spec.required), allowed)
            for name in spec.marking:
                if not any(ex.inputs[name]):
                    raise InvalidInputError(f"data[{i}].loss_fn_inputs[{name!r}]: marks no token (all zero); "
                                            f"{job.loss_fn!r} averages over the tokens it marks", i, name)

    def _validate_example(
        self, i: int, ex: Example, required: Sequence[str], allowed: set[str]
    ) -> None:
        n = len(ex.tokens)
        if n == 0:
            raise InvalidInputError(f"data[{i}].model_input: empty sequence", i, "model_input")
        if n > self.max_seq_len:
            raise InvalidInputError(
                f"data[{i}].model_input: length {n} exceeds the model's context of "
                f"{self.max_seq_len} tokens",
                i,
                "model_input",
            )
        self._check_token_ids(ex.tokens, f"data[{i}].model_input", i)
        for name in required:
            if name not in ex.inputs:
                raise InvalidInputError(
                    f"data[{i}].loss_fn_inputs: missing {name!r} (required: {list(required)})",
                    i,
                    name,
                )
        for name, values in ex.inputs.items():
            where = f"data[{i}].loss_fn_inputs[{name!r}]"
            if name not in allowed:
                raise InvalidInputError(
                    f"{where}: unknown input (accepted: {sorted(allowed)})", i, name
                )
            if len(values) != n:
                raise InvalidInputError(
                    f"{where}: length {len(values)} differs from model_input length {n}", i, name
                )
            if name == "target_tokens":
                self._check_token_ids(values, where, i)
            else:
                bad = next((v for v in values if not math.isfinite(v)), None)
                if bad is not None:
                    raise InvalidInputError(f"{where}: contains non-finite value {bad}", i, name)

    def _check_token_ids(self, ids: Sequence[float], where: str, i: int | None) -> None:
        bad = next((t for t in ids if not (0 <= t < self.vocab_size) or t != int(t)), None)
        if bad is not None:
            raise InvalidInputError(
                f"{where}: token id {bad} outside the vocabulary [0, {self.vocab_size})",
                i,
                where.rsplit(".", 1)[-1],
            )

    # -- forward / backward -----------------------------------------------------------

    def forward(self, jobs: list[ForwardJob]) -> list[ForwardResult | Exception]:
        """Logprobs and losses, no gradients. One outcome per job (see ``forward_backward``)."""
        return self._isolated(jobs, backward=False)

    def forward_backward(self, jobs: list[ForwardJob]) -> list[ForwardResult | Exception]:
        """Like ``forward``, and add d(sum of losses)/d(adapter) to each adapter's grads.

        Jobs of different runs share one pass. A job that fails (an exception, or a
        non-finite loss, which would poison its adapter's grads) gets its exception as its
        outcome and adds no gradient; the others' outcomes and grads are then exactly those
        of each job run alone: every grad goes back to where it was before the call and
        each job runs again on its own. Invalid jobs raise before anything runs. A shared
        pass that raises what no job alone raises is an engine bug: logged as an error
        (``_report_co_batch_bug``).
        """
        return self._isolated(jobs, backward=True)

    def _isolated(self, jobs: list[ForwardJob], backward: bool) -> list[ForwardResult | Exception]:
        for job in jobs:
            self.validate_job(job)
        with self.lock:
            saved = self._save_grads(_adapters_of(jobs)) if backward else {}
            shared_error: Exception | None = None
            try:
                results = self._run(jobs, backward)
                failed = backward and any(self._backward_error(job, r) for job, r in zip(jobs, results))
            except Exception as exc:
                if len(jobs) == 1:
                    self._restore_grads(saved)
                    raise
                failed, shared_error = True, exc
            if not failed:
                return list(results)
            self._restore_grads(saved)
            if len(jobs) == 1:  # that pass was the job alone: its error is known, no second run
                return [self._backward_error(jobs[0], results[0]) or results[0]]
            outcomes = [self._alone(job, backward) for job in jobs]
            if shared_error is not None and not _fails_alike(shared_error, outcomes):
                _report_co_batch_bug(shared_error, jobs)
            return outcomes

    def _alone(self, job: ForwardJob, backward: bool) -> ForwardResult | Exception:
        """One job on its own; on failure its grads are left as they were and it gets its error
        (never raises: the jobs before it in the batch have added their gradients, and a
        raise would report them failed too, to be run, and added, again)."""
        saved: dict = {}
        try:
            saved = self._save_grads(_adapters_of([job])) if backward else {}  # a copy may not fit either
            [result] = self._run([job], backward)
            error: Exception | None = self._backward_error(job, result) if backward else None
        except Exception as exc:
            error = exc
        if error is None:
            return result
        self._restore_grads(saved)
        return error

    def _backward_error(self, job: ForwardJob, result: ForwardResult) -> NonFiniteLossError | None:
        """Why a job's backward may not count: a non-finite loss, or finite losses whose
        gradient overflowed (advantages of 1e30, say). Either would poison the adapter: an
        inf in AdamW's second moment stops those weights for good, and the state no longer
        loads. Checked on the adapter's accumulated grads, so no later sum overflows either."""
        error = _non_finite(job, result)
        if error is not None or job.adapter_id is None:
            return error
        grads = [p.grad for p in self.adapter_params(job.adapter_id).values() if p.grad is not None]
        if not grads:
            return None
        norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
        return None if math.isfinite(norm) else _overflowed(job, norm)

    def _save_grads(self, adapter_ids: set[str]) -> dict[str, dict[str, torch.Tensor | None]]:
        """A copy of each adapter's grads (None where there are none), for ``_restore_grads``."""
        return {a: {n: None if p.grad is None else p.grad.clone() for n, p in self.adapter_params(a).items()}
                for a in adapter_ids}

    def _restore_grads(self, saved: dict[str, dict[str, torch.Tensor | None]]) -> None:
        for adapter_id, grads in saved.items():
            for name, p in self.adapter_params(adapter_id).items():
                p.grad = grads[name]

    def hold_grads(self, key: str, adapter_id: str) -> None:
        """Keep a copy of an adapter's grads under ``key``, to go back to them if what follows
        fails (a request run as several passes). Held until ``release_grads(key)``."""
        with self.lock:
            self.held_grads[key] = (adapter_id, self._save_grads({adapter_id})[adapter_id])

    def release_grads(self, key: str, restore: bool) -> bool:
        """Forget the grads held under ``key``, first putting them back if ``restore``.
        Returns whether any were held: an unknown key (never held, or lost with a restarted
        process) does nothing."""
        with self.lock:
            held = self.held_grads.pop(key, None)
            if restore and held is not None:
                self._restore_grads({held[0]: held[1]})
            return held is not None

    def _run(self, jobs: list[ForwardJob], backward: bool) -> list[ForwardResult]:
        rows = [(j, i) for j, job in enumerate(jobs) for i in range(len(job.examples))]
        outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, dict]] = {}
        with torch.set_grad_enabled(backward):
            for micro, packed in self._micro_batches(jobs, rows):
                outputs.update(self._run_micro_batch(jobs, micro, packed, backward))
        return [self._collect(j, job, outputs) for j, job in enumerate(jobs)]

    def _micro_batches(self, jobs: list[ForwardJob], rows: list[tuple[int, int]]):
        """(micro-batch, whether it runs packed) pairs: rows sorted by length and cut under
        the token budget; where they can run packed, at the budget, else where padding
        costs more than another pass. A micro-batch of one length runs as a batch, packed
        or not. Within a micro-batch an adapter's rows are consecutive (one slice per
        adapter for LoRA)."""
        ordered = sorted(rows, key=lambda r: -len(jobs[r[0]].examples[r[1]].tokens))
        lengths = [len(jobs[j].examples[i].tokens) for j, i in ordered]
        packs = bool(lengths) and lengths[0] <= self.pack_limit  # the longest decides
        ends = split_by_budget(lengths, self.max_batch_tokens) if packs else split_by_length(lengths, self.max_batch_tokens)
        start = 0
        for end in ends:
            # sorted by length: its lengths differ if its first and last do
            yield sorted(ordered[start:end], key=lambda r: jobs[r[0]].adapter_id or ""), (
                packs and lengths[start] != lengths[end - 1])
            start = end

    def _run_micro_batch(self, jobs: list[ForwardJob], micro: list[tuple[int, int]], packed: bool, backward: bool):
        examples = [jobs[j].examples[i] for j, i in micro]
        lengths = [len(ex.tokens) for ex in examples]
        row_adapters = [jobs[j].adapter_id for j, _ in micro]
        token_adapters = [a for a, n in zip(row_adapters, lengths) for _ in range(n)]
        if not backward:  # the trunk's rows, then the head's
            sampler.decide_product_forms(self, sum(lengths) if packed else len(lengths) * max(lengths), row_adapters[0])
            sampler.decide_product_forms(self, sum(lengths), row_adapters[0])
        if packed:
            hidden = self._packed_trunk(examples, lengths, token_adapters)
        else:
            hidden = self._padded_trunk(examples, lengths, row_adapters)
        targets = torch.tensor(
            [t for ex in examples for t in ex.inputs["target_tokens"]], dtype=torch.long, device=self.device
        )  # (N,)
        logp = self.token_logprobs(hidden, targets, token_adapters)  # (N,)

        losses, metrics = [], []
        total = logp.new_zeros(())
        offset = 0
        for (j, _), ex, n in zip(micro, examples, lengths):
            job = jobs[j]
            inputs = _loss_inputs(ex, n, self.device)
            loss, token_metrics = LOSSES[job.loss_fn].fn(
                logp[offset : offset + n], inputs, job.loss_fn_config
            )
            total = total + loss.sum()
            losses.append(loss.detach())
            metrics.append(token_metrics)
            offset += n
        if backward and total.requires_grad:
            total.backward()
        # Results leave the device here, in one copy per tensor kind (no-ops on the CPU).
        logp_cpu = logp.detach().cpu().split(lengths)
        loss_cpu = torch.cat(losses).cpu().split(lengths)
        return {
            key: (lp, loss, {k: v.detach().cpu() for k, v in m.items()})
            for key, lp, loss, m in zip(micro, logp_cpu, loss_cpu, metrics)
        }

    def _padded_trunk(self, examples: list[Example], lengths: list[int], row_adapters: list[str | None]):
        """The trunk's hidden states of the examples' real tokens, flattened (N, H), from
        one right-padded batch."""
        width = max(lengths)
        pad = self.tokenizer.pad_token_id or 0
        dev = self.device
        input_ids = torch.tensor(
            [ex.tokens + [pad] * (width - len(ex.tokens)) for ex in examples], device=dev
        )  # (B, T)
        with self.routing.route(row_adapters):
            hidden = self.trunk(input_ids=input_ids, use_cache=False).last_hidden_state  # (B, T, H)
        real = torch.arange(width, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None]
        return hidden[real]

    def _packed_trunk(self, examples: list[Example], lengths: list[int], token_adapters: list[str | None]):
        """The trunk's hidden states of the examples' tokens (N, H), from one packed row:
        the examples end to end, each with its own positions, attending within itself."""
        dev = self.device
        input_ids = torch.tensor([[t for ex in examples for t in ex.tokens]], device=dev)  # (1, N)
        positions = torch.cat([torch.arange(n, device=dev) for n in lengths])[None]  # (1, N)
        with self.routing.route(token_adapters, over_tokens=True), attention.packed(lengths):
            hidden = self.trunk(input_ids=input_ids, position_ids=positions, use_cache=False).last_hidden_state
        return hidden[0]

    def token_logprobs(
        self, hidden: torch.Tensor, targets: torch.Tensor, token_adapters: list[str | None]
    ) -> torch.Tensor:
        """log p(target) for each row of hidden (N, H): ``unembed`` (lm_head, then the
        family's logit transform in fp32; see ``Head``) + log-softmax.

        Shared by trainer and ``compute_logprobs`` (the sampler calls ``unembed`` itself)
        so all compute logprobs with the same numerics. Rows go through in chunks of
        ``logit_chunk_rows`` so the (N, V) fp32 logits never exist whole. With grads on,
        each chunk's gradient is taken at once when the unembedding has nothing to train
        (``_LogprobsThroughFrozenHead``); otherwise each chunk is checkpointed (its logits
        are dropped after the forward and recomputed, chunk by chunk, in the backward).
        Row-wise ops, so chunking changes no value.
        """
        rows = self.logit_chunk_rows()
        if hidden.shape[0] <= rows:
            return self._chunk_logprobs(hidden, targets, token_adapters)
        if torch.is_grad_enabled() and hidden.requires_grad and not self._head_trains(token_adapters):
            return _LogprobsThroughFrozenHead.apply(
                hidden, lambda h, start: self._chunk_logprobs(h, targets[start : start + rows],
                                                              token_adapters[start : start + rows]), rows)
        parts = []
        for start in range(0, hidden.shape[0], rows):
            chunk = (hidden[start : start + rows], targets[start : start + rows], token_adapters[start : start + rows])
            if torch.is_grad_enabled():
                parts.append(recompute_in_backward(self._chunk_logprobs, *chunk, use_reentrant=False))
            else:
                parts.append(self._chunk_logprobs(*chunk))
        return torch.cat(parts)  # (N,)

    def _head_trains(self, token_adapters: list[str | None]) -> bool:
        """Whether any of these tokens' adapters has LoRA weights on the unembedding."""
        head = self.unembed.lm_head
        return isinstance(head, lora.LoRALinear) and any(a in head.lora_A for a in set(token_adapters) if a)

    def logit_chunk_rows(self) -> int:
        """Rows per chunk of the unembedding: about LOGIT_CHUNK_ELEMENTS fp32 logits."""
        return max(1, LOGIT_CHUNK_ELEMENTS // self.vocab_size)

    def _chunk_logprobs(
        self, hidden: torch.Tensor, targets: torch.Tensor, token_adapters: list[str | None]
    ) -> torch.Tensor:
        # routing is set here, inside the checkpointed function, so the backward's
        # recomputation routes the chunk's rows to their adapters again
        with self.routing.route(token_adapters):
            logits = self.unembed(hidden)  # (n, V) fp32
        return -torch.nn.functional.cross_entropy(logits, targets, reduction="none")  # (n,)

    def _collect(self, j: int, job: ForwardJob, outputs: dict) -> ForwardResult:
        per_datum = [outputs[(j, i)] for i in range(len(job.examples))]
        metric_sums: dict[str, float] = {}
        active = 0.0
        for (_, _, token_metrics), ex in zip(per_datum, job.examples):
            mask = torch.tensor(ex.inputs.get("weights", [1.0] * len(ex.tokens))) != 0
            active += float(mask.sum())
            for name, values in token_metrics.items():
                metric_sums[name] = metric_sums.get(name, 0.0) + float(values[mask].sum())
        metrics = {"loss:sum": float(sum(float(loss.sum()) for _, loss, _ in per_datum))}
        metrics.update({f"{k}:mean": v / max(active, 1.0) for k, v in metric_sums.items()})
        return ForwardResult(
            logprobs=[lp.tolist() for lp, _, _ in per_datum],
            elementwise_loss=[loss.tolist() for _, loss, _ in per_datum],
            metrics=metrics,
            active_tokens=active,
        )

    # -- optimizer ----------------------------------------------------------------------

    def optim_step(self, adapter_id: str, cfg: AdamConfig) -> dict[str, float]:
        """One AdamW step on the accumulated grads of one adapter; grads are then cleared."""
        adapter = self._adapter(adapter_id)
        with self.lock:
            return adamw_step(self.adapter_params(adapter_id), adapter.optim, cfg)

    def zero_grad(self, adapter_id: str) -> None:
        for p in self.adapter_params(adapter_id).values():
            p.grad = None

    # -- sampling ---------------------------------------------------------------------

    def validate_sample(self, req: sampler.SampleRequest, k: int = 0) -> None:
        """Raise InvalidInputError naming the field (as ``requests[k].<field>``); touches no state."""
        if self.state_layers:
            raise InvalidInputError(
                f"requests[{k}]: {self.model_name} cannot be sampled by TRIO: its {', '.join(self.state_layers)} "
                "layers carry a state along the sequence, and the sampler's cache keeps attention's keys and "
                "values alone (training and compute_logprobs work)", k, "base_model")
        sampler.validate_request(req, k, self.vocab_size, self.max_seq_len)
        if req.adapter_id is not None:
            self._adapter(req.adapter_id)

    def sample(self, requests: list[sampler.SampleRequest]) -> list[sampler.SampleResult]:
        """Sample for several requests (any adapters) in shared decode batches."""
        for k, req in enumerate(requests):
            self.validate_sample(req, k)
        with self.lock, torch.no_grad():
            return sampler.generate(self, requests, self.prefix_cache)

    def decode_batch(self) -> sampler.DecodeBatch:
        """An empty running decode batch on this host (continuous batching; see ``admit``)."""
        return sampler.DecodeBatch(self, self.prefix_cache)

    def admit(self, batch: sampler.DecodeBatch, requests: list[sampler.SampleRequest],
              tickets: list[Hashable]) -> None:
        """Validate ``requests`` (all, before anything runs), then admit them into ``batch``
        (``DecodeBatch.admit``: prefilled, or onto cached KV)."""
        for k, req in enumerate(requests):
            self.validate_sample(req, k)
        with self.lock, torch.no_grad():
            batch.admit(requests, tickets)

    def decode_step(self, batch: sampler.DecodeBatch) -> list[tuple[Hashable, sampler.SampleResult]]:
        """One decode step of ``batch``: the (ticket, result) of each request that finished."""
        with self.lock, torch.no_grad():
            return batch.step()

    def compute_logprobs(self, adapter_id: str | None, tokens: list[int]) -> list[float | None]:
        """log p(token_t | tokens_<t) for each prompt token; None for the first."""
        if not tokens:
            raise InvalidInputError("prompt: empty sequence", field="prompt")
        self._check_token_ids(tokens, "prompt", None)
        if adapter_id is not None:
            self._adapter(adapter_id)
        job = ForwardJob(adapter_id, [Example(tokens[:-1], {"target_tokens": tokens[1:]})])
        if len(tokens) == 1:
            return [None]
        with self.lock:
            [result] = self._run([job], backward=False)  # one job: an error raises
        return [None, *result.logprobs[0]]

    # -- checkpoints --------------------------------------------------------------------

    def save_state(self, adapter_id: str, folder: str, with_optimizer: bool = True) -> None:
        adapter = self._adapter(adapter_id)
        with self.lock:
            checkpoint.save_training_state(
                folder,
                self.adapter_params(adapter_id),
                adapter.config,
                adapter.optim if with_optimizer else None,
                self.model_name,
            )

    def load_state(self, adapter_id: str, folder: str, with_optimizer: bool) -> None:
        """Create (or replace) ``adapter_id`` from a saved training state (saved on any device)."""
        state = checkpoint.load_training_state(folder, with_optimizer)
        if state.base_model != self.model_name:
            raise InvalidInputError(
                f"path: checkpoint is for base model {state.base_model!r}, "
                f"this host serves {self.model_name!r}",
                field="path",
            )
        # every check before the delete below: a checkpoint that cannot load changes nothing
        state.weights = self._text_only(state.weights)
        if state.optim is not None:
            state.optim.exp_avg, state.optim.exp_avg_sq = map(self._text_only, (state.optim.exp_avg,
                                                                               state.optim.exp_avg_sq))
        shapes = self._saved_shapes(state.config)
        _check_saved(state.weights, shapes, "weights", complete=True)
        if state.optim is not None:
            _check_moments(state.optim, shapes)
        with self.lock:
            self._replace(adapter_id, state.config, state.weights)
            if state.optim is not None:
                self.adapters[adapter_id].optim = state.optim.to(self.device)

    def save_sampler_weights(self, adapter_id: str, folder: str) -> None:
        """A PEFT adapter folder that peft/vLLM load on the same base model."""
        adapter = self._adapter(adapter_id)
        with self.lock:
            checkpoint.save_peft_adapter(
                folder, self.adapter_params(adapter_id), adapter.config, self.model_name
            )

    def load_sampler_weights(self, adapter_id: str, folder: str) -> None:
        """Load a PEFT adapter folder (ours or any rank-r LoRA on the same targets)."""
        config, weights = checkpoint.load_peft_adapter(folder)
        text = self._text_only(weights)
        if weights and not text:
            raise InvalidInputError(f"path: the adapter at {folder} adapts none of this model's text layers, only "
                                    f"layers a text forward never runs ({next(iter(weights))!r}, ...)", field="path")
        # a PEFT adapter on some of the layers loads: the others keep B = 0 (no change)
        _check_saved(text, self._saved_shapes(config), "weights", complete=False)
        fault = checkpoint.head_copy_fault(folder, cast(torch.Tensor, self.unembed.lm_head.weight))
        if fault:
            raise InvalidInputError(f"path: {fault}", field="path")
        with self.lock:
            self._replace(adapter_id, config, text)

    def _text_only(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` less those of this model's layers that a text forward never runs:
        peft, given a multimodal model and target names, adapts its vision tower's
        ``q_proj`` too (and TRIO's own checkpoints of such a model held them until it left
        the tower out); only text runs here, so those take no part. A name that is no
        layer of this model stays, for ``_check_saved`` to refuse."""
        return {name: t for name, t in tensors.items() if name.rsplit(".", 1)[0] not in self.outside_text}

    def _saved_shapes(self, config: lora.LoraConfig) -> dict[str, torch.Size]:
        """The tensors (names and shapes) of an adapter of ``config`` on this model."""
        return lora.adapter_shapes(self.model, config.rank, select_targets(self.model, self.family, config))

    def _replace(self, adapter_id: str, config: lora.LoraConfig, weights: dict[str, torch.Tensor]) -> None:
        """``adapter_id`` anew, of ``config``, holding ``weights`` (checked by ``_check_saved``)."""
        self.delete_adapter(adapter_id)
        self.create_adapter(adapter_id, config)
        params = self.adapter_params(adapter_id)
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)

    def info(self) -> dict[str, Any]:
        cfg = self.model.config
        return {
            "model_name": self.model_name,
            "architecture": cfg.model_type,
            "family": self.family.name,
            "vocab_size": self.vocab_size,
            "max_seq_len": self.max_seq_len,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "num_adapters": len(self.adapters),
        }


def _check_saved(tensors: dict[str, torch.Tensor], shapes: dict[str, torch.Size], what: str,
                 complete: bool) -> None:
    """Raise InvalidInputError (field ``path``) unless every saved tensor is one of the
    adapter's (``shapes``: name -> shape), of its shape, and finite, with its layer's other
    matrix (an A without its B, or a B without its A, would pair with a fresh one); and, if
    ``complete``, the adapter has no tensor the checkpoint lacks. A checkpoint of another
    model, another rank or targets, or a damaged one, is refused whole rather than loaded
    in part."""
    for name, tensor in tensors.items():
        shape = shapes.get(name)
        if shape is None:
            raise InvalidInputError(f"path: {name!r} in the checkpoint's {what} is no tensor of this model's "
                                    "adapter (saved on another model, or with other targets)", field="path")
        if tensor.shape != shape:
            raise InvalidInputError(f"path: {name!r} in the checkpoint's {what} has shape {tuple(tensor.shape)}, "
                                    f"where this model's adapter has {tuple(shape)}", field="path")
        if not torch.isfinite(tensor).all():
            raise InvalidInputError(f"path: {name!r} in the checkpoint's {what} holds non-finite values",
                                    field="path")
    missing = sorted(set(shapes) - set(tensors))
    if complete and missing:
        raise InvalidInputError(f"path: the checkpoint's {what} lack {len(missing)} of the adapter's "
                                f"{len(shapes)} tensors, {missing[0]!r} the first", field="path")
    partnerless = next((name for name in sorted(tensors) if name[:-1] + ("B" if name.endswith("_A") else "A")
                        in missing), None)
    if partnerless is not None:
        raise InvalidInputError(f"path: {partnerless!r} in the checkpoint's {what} comes without the other "
                                "matrix of its layer", field="path")


def _check_moments(optim: AdamState, shapes: dict[str, torch.Size]) -> None:
    """``_check_saved`` for AdamW's moments: both kept for the same tensors (a step reads
    the two together), and the second ones not negative (their square roots divide)."""
    unmatched = sorted(set(optim.exp_avg) ^ set(optim.exp_avg_sq))
    if unmatched:
        raise InvalidInputError(f"path: the checkpoint's optimizer state has one moment of {unmatched[0]!r} "
                                "but not the other", field="path")
    for moments in (optim.exp_avg, optim.exp_avg_sq):
        _check_saved(moments, shapes, "optimizer state", complete=False)
    negative = next((name for name, v in optim.exp_avg_sq.items() if (v < 0).any()), None)
    if negative is not None:
        raise InvalidInputError(f"path: the checkpoint's optimizer state has negative second moments in "
                                f"{negative!r}", field="path")


class _LogprobsThroughFrozenHead(torch.autograd.Function):
    """log p(target) of each row of hidden (N, H), chunk by chunk, through an unembedding
    that has nothing to train, with the backward done in the forward.

    Row i's logprob depends on row i of hidden only, so the gradient of the chunk's summed
    logprobs is every row's Jacobian at once (one (n, H) tensor); the backward then only
    scales each row by its incoming gradient. The (N, V) logits never exist whole, as
    with checkpointed chunks, but the unembedding runs once instead of again in the
    backward: about 10% of a 135M model's training FLOPs. Not for an unembedding with
    LoRA weights of these tokens' adapters: their gradient needs the incoming gradient.
    """

    @staticmethod
    def forward(ctx, hidden, chunk_logprobs, rows):  # type: ignore[override]
        logprobs, jacobians = [], []
        for start in range(0, hidden.shape[0], rows):
            chunk = hidden[start : start + rows].detach().requires_grad_(True)
            with torch.enable_grad():
                logp = chunk_logprobs(chunk, start)
                (jacobian,) = torch.autograd.grad(logp.sum(), chunk)
            logprobs.append(logp.detach())
            jacobians.append(jacobian)
        ctx.save_for_backward(torch.cat(jacobians))
        return torch.cat(logprobs)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (jacobian,) = ctx.saved_tensors
        return grad[:, None].to(jacobian.dtype) * jacobian, None, None


# fp32 logits of one unembedding chunk (64 MiB): e.g. 341 rows of a 49k vocabulary, 2^24
# being small next to a model yet big enough that the per-chunk overhead is nil.
LOGIT_CHUNK_ELEMENTS = 2**24

# A forward pass costs about this many padded tokens on top of its tokens (per-layer
# launches, weight reads), so tiny micro-batches are not free.
PASS_OVERHEAD_TOKENS = 64


def split_by_budget(lengths: list[int], budget: int) -> list[int]:
    """End indices of micro-batches over ``lengths`` that run packed (no padding): as many
    rows in each as fit in ``budget`` tokens (a single longer row gets its own)."""
    ends: list[int] = []
    total = 0
    for k, n in enumerate(lengths):
        if total and total + n > budget:
            ends.append(k)
            total = 0
        total += n
    return ends + [len(lengths)] if lengths else []


def split_by_length(lengths: list[int], budget: int) -> list[int]:
    """End indices of micro-batches over ``lengths`` (sorted descending).

    Dynamic programming over contiguous groups: minimise the padded tokens
    sum(len(group) * group_max) plus PASS_OVERHEAD_TOKENS per group, with each group's
    padded size within ``budget`` (a single longer row still gets its own group).
    """
    n = len(lengths)
    best = [0.0] + [math.inf] * n  # best[k]: cost of the first k rows
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for begin in range(end - 1, -1, -1):
            padded = (end - begin) * lengths[begin]  # lengths[begin] is the group's max
            if padded > budget and begin < end - 1:
                break
            cost = best[begin] + padded + PASS_OVERHEAD_TOKENS
            if cost < best[end]:
                best[end], cut[end] = cost, begin
    ends = []
    k = n
    while k > 0:
        ends.append(k)
        k = cut[k]
    return ends[::-1]


def _adapters_of(jobs: list[ForwardJob]) -> set[str]:
    return {job.adapter_id for job in jobs if job.adapter_id is not None}


CO_BATCH_BUG = "trio_co_batch_bug"  # set on the log record of ``_report_co_batch_bug``


def _fails_alike(error: Exception, outcomes: list[ForwardResult | Exception]) -> bool:
    """Whether a job run alone raised what the shared pass raised (the same exception type):
    then that job's own data or loss explains the shared pass's failure. A job failing
    otherwise (its own NaN, a ``NonFiniteLossError`` found after its pass) leaves the shared
    pass's error unexplained."""
    return any(type(outcome) is type(error) for outcome in outcomes)


def _report_co_batch_bug(error: Exception, jobs: list[ForwardJob]) -> None:
    """A shared pass raised what none of its jobs alone did: a bug of the engine's
    co-batching (packing, routing), not of anyone's data. The answers stay right (each came
    from its job alone), so only this error log shows it, with the pass's traceback; the
    tests fail on such a record (``tests/conftest.py``)."""
    runs = sorted({str(job.adapter_id) for job in jobs})
    log.error("a co-batched pass of %d jobs (runs %s) raised, but no job alone failed that way: an engine "
              "bug in co-batching; the answers came from the jobs run one at a time", len(jobs), ", ".join(runs),
              exc_info=error, extra={CO_BATCH_BUG: True})


def _non_finite(job: ForwardJob, result: ForwardResult) -> NonFiniteLossError | None:
    """The error for the first datum whose loss is NaN or infinite (naming its inputs there)."""
    for i, losses in enumerate(result.elementwise_loss):
        t = next((t for t, v in enumerate(losses) if not math.isfinite(v)), None)
        if t is not None:
            ex = job.examples[i]
            values = {name: ex.inputs[name][t] for name in sorted(ex.inputs)}
            return NonFiniteLossError(
                f"data[{i}]: loss_fn {job.loss_fn!r} gave a non-finite loss ({losses[t]}) at token {t}, "
                f"where loss_fn_inputs are {values}; nothing was added to the gradients",
                i, "loss_fn_inputs")
    return None


def _overflowed(job: ForwardJob, norm: float) -> NonFiniteLossError:
    """The error for finite losses whose gradient is not finite, naming the datum input of
    the largest magnitude (what usually overflows it)."""
    i, name, t, value = max(((i, name, t, v) for i, ex in enumerate(job.examples)
                             for name, values in ex.inputs.items() if name != "target_tokens"
                             for t, v in enumerate(values)), key=lambda entry: abs(entry[3]), default=(0, "", 0, 0.0))
    largest = f"; the largest input is data[{i}].loss_fn_inputs[{name!r}][{t}] = {value:g}" if name else ""
    return NonFiniteLossError(
        f"data[{i}]: loss_fn {job.loss_fn!r} gave finite losses but a gradient whose norm is not finite "
        f"({norm}){largest}; nothing was added to the gradients", i, "loss_fn_inputs")


def _loss_inputs(ex: Example, n: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A datum's loss_fn_inputs as fp32 tensors (N,) on ``device``; weights default to 1."""
    inputs = {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in ex.inputs.items()}
    inputs.setdefault("weights", torch.ones(n, device=device))
    return inputs
