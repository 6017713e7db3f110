"""Each run's per-step metrics, recorded where results are produced (handlers.py).

Step k of a run is its optim_step k together with the forward_backward calls since step
k-1. While a step forms, ``StepTotals`` sums what its forward_backward calls report;
optim_step turns the sums into the step's metrics, which the store keeps:

    loss          the calls' ``loss:sum`` summed, over the sum of their datums' weights:
                  the loss per weighted token. A datum without ``weights`` weighs 1 per
                  token, as the losses take it (``trio_engine.host._loss_inputs``).
                  Left out when the weights sum to <= 0 (no meaningful mean).
    tokens        the step's model_input tokens, all datums of all its calls
    <name>:mean   the loss's own token metrics (``ratio:mean``, ...) over the step's
                  tokens of non-zero weight in the calls that report the metric; each
                  call reports its mean over its own such tokens, so the calls' means
                  are weighted by those counts (a cross_entropy call beside a ppo one
                  does not dilute the ppo call's ratio)
    custom_loss   ``forward_backward_custom``'s losses summed, as loss_fn returned them
                  (its pass is a cross_entropy on -dloss/dlogprobs, whose own loss and
                  weights mean nothing to the user: they count in neither ``loss`` nor
                  ``<name>:mean``); a step of such calls alone shows it as ``loss`` too.
                  Its loss_fn's metrics: each under its name, the mean over the calls
                  (but for the service's own names: ``log_metrics`` records those).
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
    calls: int = 0  # of built-in losses (not forward_backward_custom's)
    mean_sums: dict[str, float] = field(default_factory=dict)  # "<name>:mean" -> sum of mean * active
    mean_tokens: dict[str, int] = field(default_factory=dict)  # "<name>:mean" -> sum of active
    custom_losses: list[float] = field(default_factory=list)  # forward_backward_custom's, one a call
    custom_sums: dict[str, list[float]] = field(default_factory=dict)  # their loss_fn metrics

    def add(self, data: list[t.Datum], metrics: dict[str, float],
            custom: dict[str, float] | None = None) -> None:
        """Add one forward_backward call: its request's ``data`` and its result's metrics;
        ``custom``: the request's ``custom_metrics`` (forward_backward_custom's backward)."""
        self.tokens += sum(datum.model_input.length for datum in data)
        if custom is not None:
            self.custom_losses.append(custom.get("loss:sum", 0.0))
            for name, value in custom.items():
                if name != "loss:sum":
                    self.custom_sums.setdefault(name, []).append(value)
            return
        self.calls += 1
        active = 0
        for datum in data:
            weights = datum.loss_fn_inputs.get("weights")
            values = weights.data if weights is not None else [1.0] * datum.model_input.length
            self.weight_sum += float(sum(values))
            active += sum(1 for w in values if w != 0)
        self.loss_sum += metrics.get("loss:sum", 0.0)
        for name, value in metrics.items():
            if name.endswith(":mean"):
                self.mean_sums[name] = self.mean_sums.get(name, 0.0) + value * active
                self.mean_tokens[name] = self.mean_tokens.get(name, 0) + active

    def finish(self, optim_metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics, once optim_step has reported its own."""
        out = {"tokens": float(self.tokens)}
        if self.weight_sum > 0:
            out["loss"] = self.loss_sum / self.weight_sum
        out.update({name: total / self.mean_tokens[name] for name, total in self.mean_sums.items()
                    if self.mean_tokens[name]})
        if self.custom_losses:
            out["custom_loss"] = sum(self.custom_losses)
            if not self.calls:
                out["loss"] = out["custom_loss"]
            out.update({name: sum(values) / len(values) for name, values in self.custom_sums.items()
                        if name not in out and name not in OPTIM_METRICS})  # the service's own names stay its
        out.update({k: float(optim_metrics[k]) for k in OPTIM_METRICS if k in optim_metrics})
        return {k: v for k, v in out.items() if math.isfinite(v)}
