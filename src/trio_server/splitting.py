"""Time-slicing: a large forward or forward_backward request runs as several passes.

The engine cannot interrupt a pass, so while one runs, everyone else's next request
waits for it to end. A request over the worker's pass budget (``max_pass_tokens``
while users share the host, see ``HostWorker.pass_tokens``) is therefore cut into
consecutive parts of its data, each at most that many tokens (a single longer datum
is a part of its own), and the worker queues one part at a time: the fair scheduler
picks between users after every pass, and the run's next request waits until the
last part is done (it keeps the request's ``seq``; the run's order is unchanged).
What remains is cut again before each part (``Split.advance``), by the budget then.

The parts' results merge into exactly the unsplit request's (``merge_results``):
per-datum outputs in datum order, ``:sum`` metrics added, ``:mean`` metrics
re-weighted by each part's active tokens. Losses are sums over datums, so the parts'
gradients add up to the unsplit request's. All or nothing: before the first part of a
``forward_backward`` the engine keeps a copy of the run's grads (``hold_grads``, keyed
by request id, inside the engine: nothing big crosses the seam); if any part fails,
the grads go back to that copy and the request fails with that part's error, its datum
index counted in the whole request. ``forward_backward_custom`` is not split as one
unit: its two phases reach the service as two ordinary requests (a forward, then a
cross_entropy forward_backward), and each is split, exactly, on its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from trio_engine import ForwardResult

from .scheduler import PASS_SLICED, WorkItem, tokens


def cut(lengths: list[int], max_pass_tokens: int) -> list[int]:
    """Start indices of consecutive parts of data with these lengths, each part at most
    ``max_pass_tokens`` tokens (a longer datum alone). ``[0]``: no need to split."""
    starts, used = [0], 0
    for i, n in enumerate(lengths):
        if used and used + n > max_pass_tokens:
            starts.append(i)
            used = 0
        used += n
    return starts


@dataclass
class Split:
    """A request being run part by part; the worker advances it after each part."""

    whole: WorkItem  # the client's request: resolved once, when the split ends
    starts: list[int]  # index of each part's first datum
    index: int = 0  # the part running now
    results: list[ForwardResult] = field(default_factory=list)  # of the parts done
    elapsed_ms: float = 0.0  # engine time of the parts done

    @property
    def last(self) -> bool:
        return self.index == len(self.starts) - 1

    @property
    def holds_grads(self) -> bool:
        return self.whole.op == "forward_backward"

    def advance(self, max_pass_tokens: int | None) -> None:
        """Move on to the next part, cutting what remains of the request afresh: the pass
        budget changes when users start or stop sharing the host (``worker.py``)."""
        self.index += 1
        first = self.starts[self.index]
        rest = [d.model_input.length for d in self.whole.request.data[first:]]
        parts = cut(rest, max_pass_tokens) if max_pass_tokens is not None else [0]
        self.starts = self.starts[:self.index] + [first + start for start in parts]

    def part(self) -> WorkItem:
        """The work item of the current part: the request with that part's data alone."""
        w = self.whole
        end = self.starts[self.index + 1] if not self.last else len(w.request.data)
        request = w.request.model_copy(update={"data": w.request.data[self.starts[self.index]:end]})
        return WorkItem(w.request_id, w.op, request, w.user_id, w.run_id, w.seq, w.arrival,
                        {**w.context, "split": self})


def split_of(item: WorkItem) -> Split | None:
    return item.context.get("split")


def maybe_split(item: WorkItem, max_pass_tokens: int | None) -> WorkItem:
    """``item`` itself, or the first part of it if it is to run as several passes."""
    if max_pass_tokens is None or item.op not in PASS_SLICED or tokens(item) <= max_pass_tokens:
        return item
    starts = cut([d.model_input.length for d in item.request.data], max_pass_tokens)
    if len(starts) == 1:  # one datum
        return item
    return Split(item, starts).part()


def in_whole_request(message: str, split: Split) -> str:
    """A part's error message with its leading ``data[i]`` counted in the whole request."""
    offset = split.starts[split.index]

    def shift(match: re.Match[str]) -> str:
        return f"data[{int(match.group(1)) + offset}]"

    return re.sub(r"^data\[(\d+)\]", shift, message)


def merge_elapsed(result: Any, split: Split) -> None:
    """Count a finished part's engine time (ForwardBackwardOutput.elapsed_time, ms)."""
    split.elapsed_ms += float(getattr(result, "elapsed_time", None) or 0.0)
