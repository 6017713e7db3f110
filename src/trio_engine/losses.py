"""Built-in losses: pure functions of the target tokens' logprobs.

Each loss takes ``logp`` (N,) — the model's logprob of each target token, with grad —
the datum's ``loss_fn_inputs`` as fp32 tensors (N,), and the ``loss_fn_config`` dict,
and returns ``(per_token_loss (N,), token_metrics)``. The total loss of a batch is the
*sum* of per-token losses (Tinker's convention: normalise with ``weights`` yourself).
``token_metrics`` are per-token values that the host averages over the tokens with a
non-zero weight and reports as ``"<name>:mean"``.

Every loss multiplies by ``weights`` when given (default 1), so RL data can mask its
prompt tokens exactly as SFT data does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor
LossResult = tuple[Tensor, dict[str, Tensor]]


def cross_entropy(logp: Tensor, inputs: dict[str, Tensor], config: dict) -> LossResult:
    """Supervised NLL: ``L_t = -w_t · logp_t``."""
    return -logp * inputs["weights"], {}


def importance_sampling(logp: Tensor, inputs: dict[str, Tensor], config: dict) -> LossResult:
    """REINFORCE with an importance weight for off-policy samples.

    ``L_t = -w_t · exp(logp_t - q_t) · A_t`` where q = sampler ``logprobs``, A = ``advantages``.
    """
    ratio = torch.exp(logp - inputs["logprobs"])
    return -inputs["weights"] * ratio * inputs["advantages"], {"ratio": ratio.detach()}


def ppo(logp: Tensor, inputs: dict[str, Tensor], config: dict) -> LossResult:
    """Clipped surrogate objective (Schulman et al., 2017, "Proximal Policy Optimization").

    ``r_t = exp(logp_t - q_t)``, ``L_t = -w_t · min(r_t·A_t, clip(r_t, low, high)·A_t)``
    with ``low = clip_low_threshold`` (0.8) and ``high = clip_high_threshold`` (1.2).
    Metrics: the fraction of tokens clipped below and above.
    """
    return _clipped_surrogate(torch.exp(logp - inputs["logprobs"]), inputs, config)


def clip_bounds(config: dict) -> tuple[float, float]:
    """The importance ratio's clip range of ppo, cispo and gspo (0.8, 1.2 by default)."""
    return float(config.get("clip_low_threshold", 0.8)), float(config.get("clip_high_threshold", 1.2))


def _clip_range_error(config: dict) -> str | None:
    low, high = clip_bounds(config)
    if 0 <= low <= 1 <= high:
        return None
    return (f"clip_low_threshold ({low:g}) and clip_high_threshold ({high:g}) must hold 0 <= low <= 1 <= high: "
            "the range must take the ratio of on-policy data (1), or even that data is clipped")


def _beta_error(config: dict) -> str | None:
    beta = float(config.get("beta", 0.05))
    return None if beta >= 0 else f"beta ({beta:g}) must be >= 0: a negative one rewards leaving the sampler's policy"


def _clipped_surrogate(ratio: Tensor, inputs: dict[str, Tensor], config: dict) -> LossResult:
    """PPO's ``-w·min(r·A, clip(r, low, high)·A)`` for importance ratios ``ratio`` (with
    their gradient), and its clip fractions."""
    low, high = clip_bounds(config)
    adv = inputs["advantages"]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
    metrics = {
        "clip_low_fraction": ((ratio < low) & (adv < 0)).float(),
        "clip_high_fraction": ((ratio > high) & (adv > 0)).float(),
        "ratio": ratio.detach(),
    }
    return -inputs["weights"] * surrogate, metrics


def cispo(logp: Tensor, inputs: dict[str, Tensor], config: dict) -> LossResult:
    """Clipped IS-weight policy optimisation (MiniMax-M1 report, arXiv:2506.13585).

    The importance weight is clipped and *detached*, so every token keeps a gradient:
    ``L_t = -w_t · sg(clip(r_t, low, high)) · A_t · logp_t`` with r = exp(logp - q),
    bounds ``clip_low_threshold`` (0.8) and ``clip_high_threshold`` (1.2).
    """
    low, high = clip_bounds(config)
    ratio = torch.exp(logp - inputs["logprobs"]).detach()
    clipped = ratio.clamp(low, high)
    metrics = {"clip_fraction": ((ratio < low) | (ratio > high)).float(), "ratio": ratio}
    return -inputs["weights"] * clipped * inputs["advantages"] * logp, metrics


def gspo(logp: Tensor, inputs: dict[str, Tensor], config: dict) -> LossResult:
    """Group sequence policy optimisation, token form (Zheng et al., 2025, "GSPO",
    arXiv:2507.18071, section 4.3; tinker's ``gspo``).

    PPO's clipped objective with one importance ratio per sequence: the geometric mean
    s = exp(mean_{t in M}(logp_t - q_t)) over the tokens M that ``sequence_ratio_mask``
    marks (non-zero), each token carrying s's value and its own logprob's gradient,
    ``s_t = sg(s) · exp(logp_t - sg(logp_t))``, and
    ``L_t = -w_t · min(s_t·A_t, clip(s_t, low, high)·A_t)`` with PPO's bounds
    ``clip_low_threshold`` (0.8) and ``clip_high_threshold`` (1.2). Clipping so keeps or
    drops whole sequences; per-token advantages still work. Metrics as PPO's (the ratio
    is s on every token).
    """
    in_ratio = inputs["sequence_ratio_mask"] != 0  # at least one token: validated by the host
    log_ratio = (logp.detach() - inputs["logprobs"])[in_ratio].mean()
    return _clipped_surrogate(torch.exp(log_ratio + logp - logp.detach()), inputs, config)


def dro(logp: Tensor, inputs: dict[str, Tensor], config: dict) -> LossResult:
    """Direct reward optimisation with a quadratic penalty (Richemond et al., 2024,
    "Offline Regularised Reinforcement Learning for LLM Alignment", arXiv:2405.19107).

    ``L_t = -w_t · (A_t · logp_t - (beta / 2) · (logp_t - q_t)^2)``, ``beta`` from the
    config (default 0.05): the policy gradient on A plus a penalty that keeps the policy
    near the sampler.
    """
    beta = float(config.get("beta", 0.05))
    log_ratio = logp - inputs["logprobs"]
    objective = inputs["advantages"] * logp - 0.5 * beta * log_ratio**2
    return -inputs["weights"] * objective, {"log_ratio": log_ratio.detach()}


@dataclass(frozen=True)
class LossSpec:
    fn: Callable[[Tensor, dict[str, Tensor], dict], LossResult]
    required: tuple[str, ...]  # loss_fn_inputs the loss needs besides target_tokens
    config_keys: tuple[str, ...] = ()
    marking: tuple[str, ...] = ()  # inputs that must mark (be non-zero at) one token at least
    config_error: Callable[[dict], str | None] = lambda config: None  # why a config makes no sense


CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ()),
    "importance_sampling": LossSpec(importance_sampling, ("logprobs", "advantages")),
    "ppo": LossSpec(ppo, ("logprobs", "advantages"), CLIP_KEYS, config_error=_clip_range_error),
    "cispo": LossSpec(cispo, ("logprobs", "advantages"), CLIP_KEYS, config_error=_clip_range_error),
    "gspo": LossSpec(gspo, ("logprobs", "advantages", "sequence_ratio_mask"), CLIP_KEYS,
                     marking=("sequence_ratio_mask",), config_error=_clip_range_error),
    "dro": LossSpec(dro, ("logprobs", "advantages"), ("beta",), config_error=_beta_error),
}

# Inputs every loss accepts; anything else in loss_fn_inputs is an error (a typo).
OPTIONAL_INPUTS = ("weights",)
