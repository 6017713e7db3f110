"""Each run's per-step metrics, recorded where results are produced (handlers.py).

Step k of a run is its optim_step k together with the forward_backward calls since step
k-1. While a step forms, ``StepTotals`` sums what its forward_backward calls report;
optim_step turns the sums into the step's metrics, which the store keeps:

    loss          the calls' ``loss:sum`` summed, over the sum of their datums' weights:
                  the loss per weighted token. A datum without ``weights`` weighs 1 per
                  token, as the losses take it (``trio_engine.host._loss_inputs``).
                  Left out when the weights sum to <= 0 (no meaningful mean).
    tokens        the step's model_input tokens, all datums of all its calls
    <name>:mean   the loss's own token metrics (``ratio:mean``, ...) over all the step's
                  tokens of non-zero weight; each call reports its mean over its own
                  such tokens, so the calls' means are weighted by those counts
    grad_norm, learning_rate   from optim_step

The sums live in memory, as the gradients they describe do: a restart loses a step's
pending gradients (snapshots keep completed steps only), and its partial sums with them.
``forward`` computes no gradients and belongs to no step. Non-finite values are not
stored (they cannot be drawn, nor sent as JSON).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pytrio import types as t

OPTIM_METRICS = ("grad_norm", "learning_rate")


@dataclass
class StepTotals:
    """The sums of one forming step's forward_backward results."""

    loss_sum: float = 0.0
    weight_sum: float = 0.0
    tokens: int = 0
    active: int = 0  # tokens of non-zero weight
    mean_sums: dict[str, float] = field(default_factory=dict)  # "<name>:mean" -> mean * active

    def add(self, data: list[t.Datum], metrics: dict[str, float]) -> None:
        """Add one forward_backward call: its request's ``data`` and its result's metrics."""
        active = 0
        for datum in data:
            weights = datum.loss_fn_inputs.get("weights")
            values = weights.data if weights is not None else [1.0] * datum.model_input.length
            self.weight_sum += float(sum(values))
            active += sum(1 for w in values if w != 0)
            self.tokens += datum.model_input.length
        self.active += active
        self.loss_sum += metrics.get("loss:sum", 0.0)
        for name, value in metrics.items():
            if name.endswith(":mean"):
                self.mean_sums[name] = self.mean_sums.get(name, 0.0) + value * active

    def finish(self, optim_metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics, once optim_step has reported its own."""
        out = {"tokens": float(self.tokens)}
        if self.weight_sum > 0:
            out["loss"] = self.loss_sum / self.weight_sum
        if self.active:
            out.update({name: total / self.active for name, total in self.mean_sums.items()})
        out.update({k: float(optim_metrics[k]) for k in OPTIM_METRICS if k in optim_metrics})
        return {k: v for k, v in out.items() if math.isfinite(v)}
