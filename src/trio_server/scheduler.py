"""What the engine worker runs next: a pure function over the pending work, no I/O.

Order within a run. A run's requests execute strictly in sequence order, so only the
request whose ``seq`` equals its run's ``next_seq`` is ready. Requests without a run
(sampling, creating models) are always ready.

Fairness between users: start-time fair queueing by tokens. Each user has a tag, the
virtual time at which its next request is due: ``max(vtime, finish[user])``, where a
served request advances its user's ``finish`` by its cost (its tokens plus
``BASE_COST``) and ``vtime`` is the tag of the batch last started. The ready request of
the user with the smallest tag heads the next batch (ties: the older request). So a user
is served in proportion to tokens, not requests: a tenant flooding large
``forward_backward`` batches runs far ahead of its tag, and a light tenant's next small
request, due at ``vtime``, goes first as soon as the batch running now ends. A user who
was idle comes back at ``vtime``, with neither credit nor debt (the usual SFQ rule:
idling earns nothing to spend later). The state (``Fairness``) is kept by the worker and
advanced by ``charge``; both functions are pure.

Co-batching. The head's operation decides the batch. For a batchable one (forward,
forward_backward, sample), other ready requests of that operation join, in tag order,
while the batch stays within ``max_batch`` requests and ``max_tokens`` tokens (a single
request over the budget still runs, alone). A request of another user joins only if
that user is due before the head would finish (``tag <= head tag + head cost``): a light
tenant's small step is never co-batched with a flooding tenant's large one, which would
make it wait for the whole large pass, while equally loaded users still share passes,
and one user's runs share passes freely (each run contributes at most its head, which
is before its next ``optim_step``). The token budget bounds how long any batch runs,
hence how long a newly due request waits for the one ahead of it.

Time-slicing. A started pass runs to its end, so a newly due request waits for the pass
running when it arrives. While users share the host the worker keeps that pass short
(``HostWorker.pass_tokens``): a forward or forward_backward request over
``max_pass_tokens`` reaches this function one part at a time (``splitting.py``), each
part an ordinary item of the request's run and ``seq``, and the budget of a
forward(_backward) batch is at most ``max_pass_tokens`` too. So the
choice between users is made again after every pass, and a light tenant beside a flood
waits about one short pass, not one whole flood request (``benchmarks/fairness.py``
measures it).

Sampling is continuous (``next_work``): the worker keeps one running decode batch, and
sample requests are admitted into it, up to ``max_decoding`` at once, in fair order (the
user with the smallest tag first, each admission charged like a batch of one), and past
that one request of each user with none in the batch (``NEWCOMER_SLOTS``). Between
two decode steps at most one other batch (training, checkpoints, ...) runs, so training
waits at most one decode step, and sampling waits at most one pass.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

BATCHABLE = {"forward", "forward_backward", "sample"}
PASS_SLICED = {"forward", "forward_backward"}  # split into passes of max_pass_tokens (splitting.py)
BASE_COST = 32  # tokens' worth charged per request on top of its tokens (optim_step, saves, ...)


@dataclass
class WorkItem:
    request_id: str
    op: str
    request: Any  # the validated pydantic request
    user_id: str
    run_id: str | None = None
    seq: int | None = None
    arrival: int = 0
    context: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Fairness:
    """Fair-queueing state between batches: the virtual time and each user's finish tag
    (users whose tag fell behind ``vtime`` are dropped: they are due at ``vtime`` anyway)."""

    vtime: float = 0.0
    finish: dict[str, float] = field(default_factory=dict)

    def tag(self, user_id: str) -> float:
        """When this user's next request is due."""
        return max(self.vtime, self.finish.get(user_id, self.vtime))


def tokens(item: WorkItem) -> int:
    """The tokens a request makes the engine process (0 for requests that carry none)."""
    req = item.request
    data = getattr(req, "data", None)
    if data is not None:  # forward, forward_backward
        return sum(d.model_input.length for d in data)
    prompt = getattr(req, "prompt", None)
    if prompt is None:
        return 0
    params = getattr(req, "sampling_params", None)
    if params is None:  # compute_logprobs: one pass over the prompt
        return int(prompt.length)
    return int(prompt.length + req.num_samples * params.max_tokens)  # both required by SampleRequest


def cost(item: WorkItem) -> int:
    return BASE_COST + tokens(item)


def is_ready(item: WorkItem, next_seq: dict[str, int]) -> bool:
    return item.run_id is None or item.seq is None or next_seq.get(item.run_id, 0) == item.seq


def stalled_runs(pending: list[WorkItem], next_seq: dict[str, int], waited: dict[str, float], now: float,
                 gap_seconds: float) -> dict[str, int]:
    """Runs whose expected request never came: ``{run: lowest seq that did}``.

    A client whose submit failed for good (the service was down) has used a sequence
    number the service never saw; its later requests must not wait forever for it.
    ``waited`` maps request id -> when it was queued.

    This is the only gap pytrio leaves: it sends a run's calls in order, numbering each
    as it is sent, and holds later calls in the client while a call has a number
    reserved (``forward_backward_custom``'s backward), so a reserved number is never
    missing here (see ``pytrio/ordering.py``). A number whose submit was given up on
    cannot arrive afterwards, so skipping it after ``gap_seconds`` cannot reorder a run.
    """
    lowest: dict[str, WorkItem] = {}
    for item in pending:
        if item.run_id is None or item.seq is None:
            continue
        if item.run_id not in lowest or item.seq < lowest[item.run_id].seq:  # type: ignore[operator]
            lowest[item.run_id] = item
    return {
        run: item.seq  # type: ignore[misc]
        for run, item in lowest.items()
        if item.seq > next_seq.get(run, 0) and now - waited.get(item.request_id, now) > gap_seconds  # type: ignore[operator]
    }


def next_batch(pending: list[WorkItem], next_seq: dict[str, int], max_batch: int = 64,
               max_tokens: int | None = None, fair: Fairness | None = None,
               max_pass_tokens: int | None = None) -> list[WorkItem]:
    """The items to execute together next; empty when nothing is ready.

    Args:
        pending: queued requests, any order.
        next_seq: run -> the seq it may run next.
        max_batch: most requests in one batch.
        max_tokens: most tokens in one batch (None: no budget); the head always runs.
        fair: the fair-queueing state (``charge`` advances it once a batch is taken);
            None: every user equally due, so the oldest ready request heads the batch.
        max_pass_tokens: most tokens in a forward or forward_backward batch, when lower
            than ``max_tokens`` (their large requests come split to this size).
    """
    fair = fair or Fairness()
    ready = sorted((i for i in pending if is_ready(i, next_seq)), key=lambda i: (fair.tag(i.user_id), i.arrival))
    if not ready:
        return []
    head = ready[0]
    if head.op not in BATCHABLE:
        return [head]
    due_by = fair.tag(head.user_id) + cost(head)  # others due before the head would finish may join
    if head.op in PASS_SLICED:
        max_tokens = min((b for b in (max_tokens, max_pass_tokens) if b is not None), default=None)
    batch, used = [head], tokens(head)
    for item in ready[1:]:
        if len(batch) >= max_batch:
            break
        n = tokens(item)
        if (item.op == head.op and (max_tokens is None or used + n <= max_tokens)
                and (item.user_id == head.user_id or fair.tag(item.user_id) <= due_by)):
            batch.append(item)
            used += n
    return batch


def charge(fair: Fairness, batch: list[WorkItem]) -> Fairness:
    """The state after ``batch`` starts: virtual time moves to the head's tag and each
    request's cost is added to its user's finish tag."""
    if not batch:
        return fair
    vtime = fair.tag(batch[0].user_id)
    finish = {user: tag for user, tag in fair.finish.items() if tag > vtime}
    for item in batch:
        finish[item.user_id] = max(vtime, finish.get(item.user_id, vtime)) + cost(item)
    return Fairness(vtime, finish)


MAX_DECODING = 64  # requests in the running decode batch; later ones join as others leave
# Past MAX_DECODING, a user with no request in the decode batch still gets one in, up to this
# many more: one user's long samples filling every slot kept another's 4-token sample
# waiting for them (12.8 s where it takes 0.15 s), as no running request is preempted.
NEWCOMER_SLOTS = 16


@dataclass(frozen=True)
class Work:
    """What the worker does next: sample requests to admit into the decode batch, the next
    other batch to run, and the fairness state once both are charged."""

    admit: list[WorkItem]
    batch: list[WorkItem]
    fair: Fairness


def next_work(pending: list[WorkItem], next_seq: dict[str, int], decoding: int, fair: Fairness | None = None,
              max_decoding: int = MAX_DECODING, max_tokens: int | None = None,
              max_pass_tokens: int | None = None, decoding_users: Collection[str] = ()) -> Work:
    """The sample requests to admit now and the next other batch (``next_batch``).

    ``decoding`` is how many requests the decode batch holds, ``decoding_users`` whose they
    are; admissions fill it up to ``max_decoding``, one at a time to the user with the
    smallest tag (so one user's many samples do not keep another's out of a freed slot),
    each charged as it is admitted. Past that, a user with none in the batch gets one in,
    up to ``NEWCOMER_SLOTS`` more (a full batch of another's long samples is not a wait).
    """
    state = fair or Fairness()
    samples = sorted((i for i in pending if i.op == "sample"), key=lambda i: i.arrival)
    admit: list[WorkItem] = []
    present = set(decoding_users)
    while samples:
        if len(admit) < max_decoding - decoding:
            candidates = samples
        elif decoding + len(admit) < max_decoding + NEWCOMER_SLOTS:
            candidates = [i for i in samples if i.user_id not in present]
        else:
            break
        if not candidates:
            break
        item = min(candidates, key=lambda i: state.tag(i.user_id))  # ties: the older (min keeps the first)
        samples.remove(item)
        admit.append(item)
        present.add(item.user_id)
        state = charge(state, [item])
    others = [i for i in pending if i.op != "sample"]
    batch = next_batch(others, next_seq, max_tokens=max_tokens, fair=state, max_pass_tokens=max_pass_tokens)
    return Work(admit, batch, charge(state, batch))
