"""What the engine worker runs next: a pure function over the pending work, no I/O.

A run's requests execute strictly in sequence order, so only the request whose ``seq``
equals its run's ``next_seq`` is ready. Requests without a run (sampling, creating
models) are always ready. The oldest ready request picks the operation; every other
ready request of a batchable operation joins it, so ``forward_backward`` calls of
different runs share one pass (each run contributes at most its head, which is before
its next ``optim_step``).

Sampling is continuous (``next_work``): the worker keeps one running decode batch;
every sample request that has arrived joins it at the next decode step, and between
two steps at most one other batch (training, checkpoints, ...) runs. So training is
never starved by a long decode (it waits at most one step), and sampling is not stuck
behind a long queue of training (at most one batch per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BATCHABLE = {"forward", "forward_backward", "sample"}


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


def next_batch(pending: list[WorkItem], next_seq: dict[str, int], max_batch: int = 64) -> list[WorkItem]:
    """The items to execute together next; empty when nothing is ready."""
    ready = sorted((i for i in pending if is_ready(i, next_seq)), key=lambda i: i.arrival)
    if not ready:
        return []
    head = ready[0]
    if head.op not in BATCHABLE:
        return [head]
    return [i for i in ready if i.op == head.op][:max_batch]


MAX_DECODING = 64  # requests in the running decode batch; later ones join as others leave


def next_work(pending: list[WorkItem], next_seq: dict[str, int], decoding: int,
              max_decoding: int = MAX_DECODING) -> tuple[list[WorkItem], list[WorkItem]]:
    """(sample requests to admit into the decode batch now, the next other batch to run).

    ``decoding`` is how many requests the decode batch holds; admissions fill it up to
    ``max_decoding``, oldest first.
    """
    samples = sorted((i for i in pending if i.op == "sample"), key=lambda i: i.arrival)
    others = [i for i in pending if i.op != "sample"]
    return samples[:max(0, max_decoding - decoding)], next_batch(others, next_seq)
