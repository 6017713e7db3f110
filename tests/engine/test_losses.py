"""Each built-in loss against its formula written out by hand, value and gradient.

The data are built from chosen importance ratios r = exp(logp - q), so that every branch
of the clipped losses is taken by some weighted token: for PPO, a positive advantage
above the upper bound (clipped: constant loss, zero gradient), a negative advantage
below the lower bound (clipped), and the unclipped cases outside the bounds (positive
advantage below, negative above) and inside them.
"""

import math
import random

import pytest
import torch

from trio_engine import Example, ForwardJob, InvalidInputError, losses

N = 12
#                    0     1     2     3     4     5     6     7     8     9     10    11
R = torch.tensor([0.5, 0.6, 0.92, 1.1, 1.4, 1.7, 0.55, 0.95, 1.5, 2.0, 0.7, 1.3], dtype=torch.float64)
A = torch.tensor([0.8, -1.2, 0.5, -0.3, 1.1, -0.9, -0.6, 0.4, 0.7, -1.5, 1.3, 0.2], dtype=torch.float64)
W = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 0.5], dtype=torch.float64)
LOGP = -(torch.rand(N, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3 + 0.1)
Q = LOGP - torch.log(R)  # so that exp(LOGP - Q) == R
# GSPO's sequence ratio averages over the tokens this marks (not the first two, a "prompt")
M = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], dtype=torch.float64)
INPUTS = {"logprobs": Q, "advantages": A, "weights": W, "sequence_ratio_mask": M}
# GSPO's sequence ratio, written out: exp(mean of log r over the marked tokens 2..11) = 1.1314;
# inside the default bounds (0.8, 1.2), above (0.9, 1.05)
GSPO_S = math.exp(sum(math.log(r) for r in [0.92, 1.1, 1.4, 1.7, 0.55, 0.95, 1.5, 2.0, 0.7, 1.3]) / 10)
CFGS = [{}, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05, "beta": 0.3}]

# Which tokens PPO clips, written out (not computed): with the default bounds (0.8, 1.2)
# and with (0.9, 1.05) the same tokens are clipped. Tokens 8 and 9 have weight 0.
PPO_CLIP_HIGH = [0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1]  # A > 0 and r > high: 4, 8, 11
PPO_CLIP_LOW = [0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0]  # A < 0 and r < low: 1, 6


def bounds(cfg):
    return cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)


def by_hand(name, lp, cfg):
    out = []
    lo, hi = bounds(cfg)
    for t in range(N):
        q, a = float(Q[t]), float(A[t])
        r = math.exp(lp[t] - q)
        if name == "cross_entropy":
            v = -lp[t]
        elif name == "importance_sampling":
            v = -r * a
        elif name == "ppo":
            v = -min(r * a, min(max(r, lo), hi) * a)
        elif name == "cispo":
            v = -min(max(r, lo), hi) * a * lp[t]
        elif name == "gspo":
            marked = [u for u in range(N) if M[u]]
            sr = math.exp(sum(lp[u] - float(Q[u]) for u in marked) / len(marked))
            v = -min(sr * a, min(max(sr, lo), hi) * a)
        elif name == "dro":
            v = -(a * lp[t] - 0.5 * cfg.get("beta", 0.05) * (lp[t] - q) ** 2)
        out.append(float(W[t]) * v)
    return out


def ppo_gradient_by_hand(cfg):
    """dL_t/dlogp_t = -w·r·A where the unclipped term is the minimum, and 0 where clipped."""
    lo, hi = bounds(cfg)
    grad = []
    for t in range(N):
        r, a, w = float(R[t]), float(A[t]), float(W[t])
        clipped = (a > 0 and r > hi) or (a < 0 and r < lo)
        grad.append(0.0 if clipped else -w * r * a)
    return torch.tensor(grad, dtype=torch.float64)


def test_data_take_every_ppo_branch():
    """Guard: the data above really exercise each case on tokens with non-zero weight."""
    for cfg in CFGS:
        lo, hi = bounds(cfg)
        w = W != 0
        cases = {
            "A>0, r>high (clipped)": (A > 0) & (R > hi),
            "A<0, r<low (clipped)": (A < 0) & (R < lo),
            "A>0, r<low (unclipped)": (A > 0) & (R < lo),
            "A<0, r>high (unclipped)": (A < 0) & (R > hi),
            "low<r<high": (R > lo) & (R < hi),
        }
        for case, mask in cases.items():
            assert bool((mask & w).any()), (cfg, case)
        # no ratio sits on a bound, where the gradient is ambiguous
        assert float((R - lo).abs().min()) > 0.01 and float((R - hi).abs().min()) > 0.01


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
@pytest.mark.parametrize("cfg", CFGS)
def test_loss_value(name, cfg):
    cfg = {k: v for k, v in cfg.items() if k in losses.LOSSES[name].config_keys}
    loss, _ = losses.LOSSES[name].fn(LOGP, INPUTS, cfg)
    expected = torch.tensor(by_hand(name, LOGP.tolist(), cfg), dtype=torch.float64)
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "dro"])
@pytest.mark.parametrize("cfg", CFGS)
def test_loss_gradient_matches_finite_differences(name, cfg):
    cfg = {k: v for k, v in cfg.items() if k in losses.LOSSES[name].config_keys}
    lp = LOGP.clone().requires_grad_(True)
    loss, _ = losses.LOSSES[name].fn(lp, INPUTS, cfg)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    eps = 1e-6
    for t in range(N):
        plus, minus = LOGP.tolist(), LOGP.tolist()
        plus[t] += eps
        minus[t] -= eps
        fd = (sum(by_hand(name, plus, cfg)) - sum(by_hand(name, minus, cfg))) / (2 * eps)
        assert abs(float(grad[t]) - fd) < 1e-5, (t, float(grad[t]), fd)


@pytest.mark.parametrize("cfg", CFGS)
def test_ppo_gradient_is_zero_exactly_where_clipped(cfg):
    lp = LOGP.clone().requires_grad_(True)
    loss, _ = losses.ppo(lp, INPUTS, cfg)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    torch.testing.assert_close(grad, ppo_gradient_by_hand(cfg), atol=1e-12, rtol=1e-10)
    clipped = torch.tensor(PPO_CLIP_HIGH) + torch.tensor(PPO_CLIP_LOW) > 0
    assert bool((grad[clipped] == 0).all())
    assert bool((grad[~clipped & (W != 0)] != 0).all())


@pytest.mark.parametrize("cfg", CFGS)
def test_gspo_gradient_is_each_tokens_own_times_the_sequence_ratio(cfg):
    """GSPO-token: token t's gradient is -w·s·A through its own logprob alone (s is
    detached), and 0 where s is clipped: with (0.9, 1.05), s = 1.13 clips the tokens of
    positive advantage."""
    lo, hi = bounds(cfg)
    lp = LOGP.clone().requires_grad_(True)
    loss, metrics = losses.gspo(lp, INPUTS, cfg)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    clipped = [(a > 0 and GSPO_S > hi) or (a < 0 and GSPO_S < lo) for a in A.tolist()]
    expected = torch.tensor([0.0 if c else -w * GSPO_S * a for c, w, a in zip(clipped, W.tolist(), A.tolist())],
                            dtype=torch.float64)
    assert any(clipped) == (cfg != {})
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(metrics["ratio"], torch.full((N,), GSPO_S, dtype=torch.float64))
    assert metrics["clip_high_fraction"].tolist() == [float(c and a > 0) for c, a in zip(clipped, A.tolist())]
    assert metrics["clip_low_fraction"].tolist() == [0.0] * N  # s is above both lower bounds


def test_cispo_gradient_is_detached_clipped_weight():
    """d/dlogp of CISPO is -w·clip(r)·A: the IS weight carries no gradient."""
    lp = LOGP.clone().requires_grad_(True)
    loss, metrics = losses.cispo(lp, INPUTS, {})
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    clipped_r = torch.tensor([0.8, 0.8, 0.92, 1.1, 1.2, 1.2, 0.8, 0.95, 1.2, 1.2, 0.8, 1.2], dtype=torch.float64)
    torch.testing.assert_close(grad, -W * clipped_r * A)
    assert metrics["clip_fraction"].tolist() == [1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1]


def test_each_loss_reports_its_metrics_by_name():
    """The per-token metrics (the host reports them as "<name>:mean"), written out."""
    log_r = torch.log(R)
    expected = {
        "cross_entropy": {},
        "importance_sampling": {"ratio": R},
        "ppo": {"clip_low_fraction": torch.tensor(PPO_CLIP_LOW, dtype=torch.float32),
                "clip_high_fraction": torch.tensor(PPO_CLIP_HIGH, dtype=torch.float32), "ratio": R},
        "cispo": {"clip_fraction": (R < 0.8) | (R > 1.2), "ratio": R},
        "gspo": {"clip_low_fraction": torch.zeros(N), "clip_high_fraction": torch.zeros(N),
                 "ratio": torch.full((N,), GSPO_S)},
        "dro": {"log_ratio": log_r},
    }
    assert sorted(expected) == sorted(losses.LOSSES)
    for name, want in expected.items():
        _, metrics = losses.LOSSES[name].fn(LOGP, INPUTS, {})
        assert sorted(metrics) == sorted(want), name
        for key, value in want.items():
            torch.testing.assert_close(metrics[key].double(), value.double(), msg=f"{name} {key}")


def test_a_ratio_on_a_bound_or_a_zero_advantage_is_not_counted_as_clipped():
    """clamp leaves a ratio equal to a bound unchanged, and with A = 0 clipping changes
    nothing: neither counts. Ratios 1, 1, 0.5, 2 against bounds (1, 1)."""
    q = torch.zeros(4, dtype=torch.float64)
    logp = torch.tensor([0.0, 0.0, math.log(0.5), math.log(2.0)], dtype=torch.float64)
    inputs = {"logprobs": q, "advantages": torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=torch.float64),
              "weights": torch.ones(4, dtype=torch.float64)}
    cfg = {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0}
    _, ppo_metrics = losses.ppo(logp, inputs, cfg)
    assert ppo_metrics["clip_low_fraction"].tolist() == [0, 0, 0, 0]
    assert ppo_metrics["clip_high_fraction"].tolist() == [0, 0, 0, 0]
    _, cispo_metrics = losses.cispo(logp, inputs, cfg)
    assert cispo_metrics["clip_fraction"].tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("cfg", CFGS)
def test_ppo_clip_fractions(cfg):
    _, metrics = losses.ppo(LOGP, INPUTS, cfg)
    assert metrics["clip_high_fraction"].tolist() == PPO_CLIP_HIGH
    assert metrics["clip_low_fraction"].tolist() == PPO_CLIP_LOW
    torch.testing.assert_close(metrics["ratio"], R)


def test_ppo_through_the_host_averages_clip_metrics_over_weighted_tokens(tiny_host):
    """The host's PPO: per-token loss by the formula, clip fractions averaged over w != 0."""
    rng = random.Random(3)
    tokens = [rng.randrange(tiny_host.vocab_size) for _ in range(N + 1)]
    plain = Example(tokens[:-1], {"target_tokens": tokens[1:]})
    logp = torch.tensor(tiny_host.forward([ForwardJob(None, [plain])])[0].logprobs[0], dtype=torch.float64)
    q = logp - torch.log(R)  # the sampler logprobs that give the ratios R
    inputs = {"target_tokens": tokens[1:], "logprobs": q.tolist(), "advantages": A.tolist(), "weights": W.tolist()}
    out = tiny_host.forward([ForwardJob(None, [Example(tokens[:-1], inputs)], "ppo")])[0]

    expected = -W * torch.minimum(R * A, R.clamp(0.8, 1.2) * A)
    torch.testing.assert_close(torch.tensor(out.elementwise_loss[0], dtype=torch.float64), expected,
                               atol=1e-5, rtol=1e-5)
    active = W != 0  # 10 tokens; clipped high among them: 4 and 11; clipped low: 1 and 6
    assert out.metrics["clip_high_fraction:mean"] == pytest.approx(2 / 10)
    assert out.metrics["clip_low_fraction:mean"] == pytest.approx(2 / 10)
    assert out.metrics["ratio:mean"] == pytest.approx(float(R[active].mean()), rel=1e-5)


def test_gspo_through_the_host_and_its_mask_checked(tiny_host):
    """The host's GSPO: the sequence ratio over the marked tokens, per token as written
    out; a datum without the mask, or whose mask marks nothing, is refused by name."""
    rng = random.Random(4)
    tokens = [rng.randrange(tiny_host.vocab_size) for _ in range(N + 1)]
    plain = Example(tokens[:-1], {"target_tokens": tokens[1:]})
    logp = torch.tensor(tiny_host.forward([ForwardJob(None, [plain])])[0].logprobs[0], dtype=torch.float64)
    inputs = {"target_tokens": tokens[1:], "logprobs": (logp - torch.log(R)).tolist(), "advantages": A.tolist(),
              "weights": W.tolist(), "sequence_ratio_mask": M.tolist()}
    out = tiny_host.forward([ForwardJob(None, [Example(tokens[:-1], inputs)], "gspo")])[0]
    expected = -W * torch.minimum(GSPO_S * A, min(max(GSPO_S, 0.8), 1.2) * A)
    torch.testing.assert_close(torch.tensor(out.elementwise_loss[0], dtype=torch.float64), expected,
                               atol=1e-5, rtol=1e-5)

    for mask, message in ((None, r"data\[1\]\.loss_fn_inputs: missing 'sequence_ratio_mask'"),
                          ([0.0] * N, r"data\[1\]\.loss_fn_inputs\['sequence_ratio_mask'\]: marks no token")):
        bad = {k: v for k, v in inputs.items() if k != "sequence_ratio_mask"}
        if mask is not None:
            bad["sequence_ratio_mask"] = mask
        with pytest.raises(InvalidInputError, match=message) as err:
            tiny_host.forward([ForwardJob(None, [Example(tokens[:-1], inputs), Example(tokens[:-1], bad)], "gspo")])
        assert err.value.field == "sequence_ratio_mask"
