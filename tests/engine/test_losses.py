"""Each built-in loss against its formula written out by hand, value and gradient."""

import math

import pytest
import torch

from trio_engine import losses

torch.manual_seed(0)
N = 9
LOGP = -torch.rand(N, dtype=torch.float64) * 3
Q = LOGP + torch.randn(N, dtype=torch.float64) * 0.4
A = torch.randn(N, dtype=torch.float64)
W = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.float64)
INPUTS = {"logprobs": Q, "advantages": A, "weights": W}


def by_hand(name, lp, cfg):
    out = []
    for t in range(N):
        r = math.exp(lp[t] - Q[t])
        lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
        if name == "cross_entropy":
            v = -lp[t]
        elif name == "importance_sampling":
            v = -r * A[t]
        elif name == "ppo":
            v = -min(r * A[t], min(max(r, lo), hi) * A[t])
        elif name == "cispo":
            v = -min(max(r, lo), hi) * A[t] * lp[t]
        elif name == "dro":
            v = -(A[t] * lp[t] - 0.5 * cfg.get("beta", 0.05) * (lp[t] - Q[t]) ** 2)
        out.append(W[t] * v)
    return out


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
@pytest.mark.parametrize("cfg", [{}, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}])
def test_loss_value(name, cfg):
    cfg = {k: v for k, v in cfg.items() if k in losses.LOSSES[name].config_keys}
    loss, _ = losses.LOSSES[name].fn(LOGP, INPUTS, cfg)
    expected = torch.tensor([float(v) for v in by_hand(name, LOGP.tolist(), cfg)], dtype=torch.float64)
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "dro"])
def test_loss_gradient_matches_finite_differences(name):
    lp = LOGP.clone().requires_grad_(True)
    loss, _ = losses.LOSSES[name].fn(lp, INPUTS, {})
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    eps = 1e-6
    for t in range(N):
        plus, minus = LOGP.tolist(), LOGP.tolist()
        plus[t] += eps
        minus[t] -= eps
        fd = (sum(by_hand(name, plus, {})) - sum(by_hand(name, minus, {}))) / (2 * eps)
        assert abs(float(grad[t]) - float(fd)) < 1e-5


def test_cispo_gradient_is_detached_clipped_weight():
    """d/dlogp of CISPO is -w·clip(r)·A: the IS weight carries no gradient."""
    lp = LOGP.clone().requires_grad_(True)
    loss, _ = losses.cispo(lp, INPUTS, {})
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    expected = -W * torch.exp(LOGP - Q).clamp(0.8, 1.2) * A
    torch.testing.assert_close(grad, expected)


def test_ppo_clip_fractions():
    _, metrics = losses.ppo(LOGP, INPUTS, {})
    r = torch.exp(LOGP - Q)
    assert metrics["clip_high_fraction"].tolist() == ((r > 1.2) & (A > 0)).double().tolist()
    assert metrics["clip_low_fraction"].tolist() == ((r < 0.8) & (A < 0)).double().tolist()
