"""AdamW (Loshchilov & Hutter, 2019) over one adapter's parameters.

Same update as ``torch.optim.AdamW`` (decoupled weight decay, bias-corrected moments):

    p <- p · (1 - lr·wd)
    m <- b1·m + (1-b1)·g ;  v <- b2·v + (1-b2)·g²
    p <- p - lr/(1-b1^t) · m / (sqrt(v/(1-b2^t)) + eps)

State is per adapter, so weight decay and moments never touch another user's weights.
The moments live on their parameters' device, each moment one buffer (``device.packed``).
Hyper-parameters arrive with every step (schedules live in the user's loop).
Optional global-norm gradient clipping as ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .device import packed
from .errors import InvalidInputError


@dataclass(frozen=True)
class AdamConfig:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping

    def __post_init__(self) -> None:
        checks = {
            "learning_rate": self.learning_rate >= 0,
            "beta1": 0 <= self.beta1 < 1,
            "beta2": 0 <= self.beta2 < 1,
            # 0 (or what fp32 rounds to 0) divides a zero gradient by zero: NaN weights
            "eps": self.eps >= torch.finfo(torch.float32).tiny,
            "weight_decay": self.weight_decay >= 0,
            "grad_clip_norm": self.grad_clip_norm >= 0,
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if not ok or not math.isfinite(value):
                raise InvalidInputError(f"adam_params.{name}: invalid value {value!r}")


@dataclass
class AdamState:
    """Moments keyed like the adapter's tensors, plus the step count."""

    step: int = 0
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    # what the step that made ``step`` answered: kept in snapshots, so a step that landed
    # before a crash, but whose answer did not go out, is answered after it
    step_metrics: dict[str, float] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> AdamState:
        """The same state with its moments on ``device`` (checkpoints load on the CPU), in
        fp32 as the adapters' parameters are, whatever a checkpoint stored."""
        return AdamState(self.step, _moved(self.exp_avg, device), _moved(self.exp_avg_sq, device), dict(self.step_metrics))


def _moved(moments: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """An fp32 copy of ``moments`` on ``device``, in one buffer."""
    values = list(moments.values())
    if not values:
        return {}
    views = packed([m.shape for m in values], device, torch.float32)
    for view, m in zip(views, values):
        view.copy_(m)
    return dict(zip(moments, views))


def adamw_step(params: dict[str, torch.Tensor], state: AdamState, cfg: AdamConfig) -> dict:
    """Apply one step using ``p.grad``, zero the grads, and return metrics."""
    names = [n for n, p in params.items() if p.grad is not None]
    if not names:  # nothing accumulated: like torch's AdamW, change nothing, not even the step
        return {"grad_norm": 0.0, "learning_rate": cfg.learning_rate, "step": float(state.step)}
    ps = [params[n] for n in names]
    grads = [p.grad for p in ps if p.grad is not None]  # all of them, by construction of names
    grad_norm = _global_norm(grads)
    if cfg.grad_clip_norm > 0 and grad_norm > cfg.grad_clip_norm:
        torch._foreach_mul_(grads, cfg.grad_clip_norm / (grad_norm + 1e-6))
    missing = [n for n in names if n not in state.exp_avg]
    shapes = [params[n].shape for n in missing]
    for moments in (state.exp_avg, state.exp_avg_sq):
        moments.update(zip(missing, packed(shapes, ps[0].device, ps[0].dtype)))
    m = [state.exp_avg[n] for n in names]
    v = [state.exp_avg_sq[n] for n in names]
    state.step += 1
    bias1 = 1 - cfg.beta1**state.step
    bias2 = 1 - cfg.beta2**state.step
    with torch.no_grad():
        if cfg.weight_decay:
            torch._foreach_mul_(ps, 1 - cfg.learning_rate * cfg.weight_decay)
        torch._foreach_lerp_(m, grads, 1 - cfg.beta1)
        torch._foreach_mul_(v, cfg.beta2)
        torch._foreach_addcmul_(v, grads, grads, 1 - cfg.beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(bias2))
        torch._foreach_add_(denom, cfg.eps)
        torch._foreach_addcdiv_(ps, m, denom, -cfg.learning_rate / bias1)
    for p in ps:
        p.grad = None
    state.step_metrics = {"grad_norm": grad_norm, "learning_rate": cfg.learning_rate, "step": float(state.step)}
    return dict(state.step_metrics)


def _global_norm(grads: list[torch.Tensor]) -> float:
    """sqrt of the summed squares of every element (``grads`` is never empty here)."""
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
