"""Token usage: what a successful request counts, and the per-key budget it is held to.

What counts (``pytrio.types.TokenUsage`` says the same to users):

    trained    forward_backward: the ``model_input`` tokens of every datum
    prefilled  forward: the tokens of every datum (the same pass, without gradients);
               sample, compute_logprobs: the prompt's tokens, once per request, since the
               prompt is prefilled once and shared by all ``num_samples`` sequences
    sampled    sample: the tokens generated, summed over the returned sequences

Other operations (create, optim_step, save/load, get_info, create_sampler) count nothing.
The core records a request's tokens when it resolves *done*: a failed or refused request
costs nothing. Counts go to the store, keyed by (user, run): a key is its own user, and
sampling counts toward the run whose weights the sampler loaded (no run for a sampler on
the base model).

The budget (``api_keys.budget_tokens``) bounds trained + prefilled + sampled. It is
checked when work is submitted, against what has completed so far: requests accepted
before it ran out still run, so a key may end slightly over its budget, by at most what
it had in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pytrio import types as t

from . import checkpoints as ckpt
from .errors import ServiceError
from .scheduler import WorkItem

# The operations that process tokens: the ones a spent budget refuses. Everything else
# (saving, loading, creating samplers...) stays allowed, so a user whose budget is spent
# can still save and download their work.
COUNTED_OPS = frozenset({"forward", "forward_backward", "sample", "compute_logprobs"})


@dataclass(frozen=True)
class Tokens:
    trained: int = 0
    prefilled: int = 0
    sampled: int = 0


def tokens_of(item: WorkItem, result: Any) -> tuple[str | None, Tokens]:
    """The run a done request counts toward (None: no run), and its tokens."""
    req = item.request
    if item.op in ("forward", "forward_backward"):
        n = sum(d.model_input.length for d in req.data)
        return req.model_id, Tokens(trained=n) if item.op == "forward_backward" else Tokens(prefilled=n)
    if item.op in ("sample", "compute_logprobs"):
        run_id = _sampler_run(item.context.get("sampler") or {})
        sampled = sum(len(s.tokens) for s in result.sequences) if isinstance(result, t.SampleResponse) else 0
        return run_id, Tokens(prefilled=req.prompt.length, sampled=sampled)
    return None, Tokens()


def _sampler_run(sampler: dict) -> str | None:
    path = sampler.get("model_path")
    return None if path is None else ckpt.parse_path(path)[0]


def check_budget(budget: int | None, used: int) -> None:
    """Refuse new work once ``used`` tokens reached ``budget`` (None: no budget).

    403 with category ``validation``, as the other per-user quotas (``core._quota``):
    429 would say "retry later", and the SDKs retry it on their own, but waiting does not
    refill a budget; 402 is reserved in HTTP and no client (pytrio, tinker, openai) has an
    error for it. 403 says: understood, and refused for this key until an operator raises
    its budget (``trio keys budget``).
    """
    if budget is not None and used >= budget:
        raise ServiceError("validation", f"token budget spent: this API key has used {used} tokens "
                           f"(trained + prefilled + sampled) of its budget of {budget}; "
                           "ask the operator to raise it (trio keys budget)", 403)


def usage_response(rows: list[dict], budget: int | None) -> t.Usage:
    """The ``GET /usage`` answer from a user's stored rows (``Store.usage_by_run``)."""
    runs = [t.RunUsage(**row) for row in rows]
    totals = {k: sum(getattr(r, k) for r in runs) for k in ("trained", "prefilled", "sampled")}
    return t.Usage(**totals, budget_tokens=budget, runs=runs)
