"""Our AdamW against torch.optim.AdamW, step for step; clipping against clip_grad_norm_."""

import random

import pytest
import torch

from trio_engine import AdamConfig, ForwardJob, LoraConfig
from trio_engine.optim import AdamState, adamw_step

from .helpers import random_example


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_matches_torch_adamw(clip):
    gen = torch.Generator().manual_seed(0)
    ours = {"w": torch.randn(5, 4, generator=gen), "b": torch.randn(3, generator=gen)}
    ref = {k: v.clone().requires_grad_(True) for k, v in ours.items()}
    state = AdamState()
    schedule = [AdamConfig(learning_rate=lr, beta1=0.85, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_clip_norm=clip)
                for lr in (1e-2, 2e-2, 5e-3, 1e-2, 1e-2, 3e-3)]
    torch_opt = torch.optim.AdamW(ref.values(), lr=1e-2, betas=(0.85, 0.99), eps=1e-8, weight_decay=0.1)
    for cfg in schedule:
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in ours.items()}
        for k in ours:
            ours[k].grad = grads[k].clone()
            ref[k].grad = grads[k].clone()
        metrics = adamw_step(ours, state, cfg)
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(ref.values(), clip)
            assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-6)
        for g in torch_opt.param_groups:
            g["lr"] = cfg.learning_rate
        torch_opt.step()
        for k in ours:
            torch.testing.assert_close(ours[k], ref[k].detach(), atol=1e-6, rtol=1e-5)
            assert ours[k].grad is None
    assert state.step == len(schedule)


def test_weight_decay_touches_only_that_adapter(tiny_host, new_id):
    a, b = new_id(), new_id()
    for aid in (a, b):
        tiny_host.create_adapter(aid, LoraConfig(rank=2))
    before_b = {k: v.clone() for k, v in tiny_host.adapter_params(b).items()}
    ex = random_example(tiny_host.vocab_size, 6, random.Random(0))
    tiny_host.forward_backward([ForwardJob(a, [ex])])
    metrics = tiny_host.optim_step(a, AdamConfig(learning_rate=0.1, weight_decay=0.5))
    assert metrics["grad_norm"] > 0 and metrics["learning_rate"] == 0.1
    assert all(torch.equal(before_b[k], v) for k, v in tiny_host.adapter_params(b).items())
    assert any(not torch.equal(before_b[k], v) for k, v in tiny_host.adapter_params(a).items())


BAD_ADAM = [("learning_rate", -1e-9), ("learning_rate", float("inf")), ("beta1", 1.0), ("beta1", -0.1),
            ("beta2", 1.0), ("beta2", 1.5), ("beta2", -0.1), ("eps", -1e-12), ("eps", 0.0), ("eps", 1e-40), ("eps", float("nan")),
            ("weight_decay", -0.1), ("grad_clip_norm", -1.0), ("grad_clip_norm", float("nan"))]


@pytest.mark.parametrize("field, value", BAD_ADAM)
def test_bad_adam_params(field, value):
    with pytest.raises(ValueError, match=f"adam_params.{field}: invalid value {value!r}"):
        AdamConfig(**{field: value})


@pytest.mark.parametrize("field", ["learning_rate", "beta1", "beta2", "weight_decay", "grad_clip_norm"])
def test_zero_is_a_valid_adam_param(field):
    """Every bound but eps's is inclusive at 0 (lr 0 = a no-op step, beta 0 = no averaging)."""
    assert getattr(AdamConfig(**{field: 0.0}), field) == 0.0


def test_the_smallest_eps_keeps_a_zero_gradient_finite():
    """eps 0 made 0 / 0 of an element whose gradient and moments are 0 (LoRA's A while B
    is 0, at the first step): NaN weights. The smallest eps taken keeps them finite."""
    tiny = torch.finfo(torch.float32).tiny
    params = {"w": torch.zeros(3, requires_grad=True)}
    params["w"].grad = torch.tensor([0.0, 1.0, 0.0])
    adamw_step(params, AdamState(), AdamConfig(learning_rate=1e-2, eps=tiny))
    assert torch.isfinite(params["w"]).all() and params["w"][1] != 0


def buffers(tensors) -> int:
    """How many separate allocations hold ``tensors`` (a dict's values)."""
    return len({t.untyped_storage().data_ptr() for t in tensors.values()})


def test_adam_state_moves_its_moments_to_the_device():
    state = AdamState(3, {"w": torch.ones(2, 2), "b": torch.arange(3.0)}, {"w": torch.full((2, 2), 4.0), "b": torch.ones(3)})
    moved = state.to("meta")  # a device every build has
    assert moved.step == 3
    assert moved.exp_avg["w"].device.type == "meta" and moved.exp_avg_sq["w"].device.type == "meta"
    assert state.exp_avg["w"].device.type == "cpu"  # the original is left as it was
    copied = state.to("cpu")  # a checkpoint's moments, loaded tensor by tensor, become one buffer each
    for ours, theirs in ((copied.exp_avg, state.exp_avg), (copied.exp_avg_sq, state.exp_avg_sq)):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        assert buffers(ours) == 1
    copied.exp_avg["w"].add_(1)
    assert torch.equal(state.exp_avg["w"], torch.ones(2, 2))  # a copy
    double = AdamState(1, {"w": torch.ones(2, dtype=torch.float64)}, {"w": torch.ones(2, dtype=torch.float64)})
    assert double.to("cpu").exp_avg_sq["w"].dtype == torch.float32  # as the adapters' parameters, whatever was saved


def test_an_adapter_and_each_of_its_moments_are_one_buffer(tiny_host, new_id):
    """Hundreds of small long-lived tensors per adapter fragment the heap; one allocation
    each does not (benchmarks/memory.py measures the memory this saves)."""
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=2))
    tiny_host.forward_backward([ForwardJob(aid, [random_example(tiny_host.vocab_size, 6, random.Random(0))])])
    tiny_host.optim_step(aid, AdamConfig(learning_rate=0.1))
    params, state = tiny_host.adapter_params(aid), tiny_host.adapters[aid].optim
    assert len(params) > 2 and state.exp_avg.keys() == state.exp_avg_sq.keys() == params.keys()
    assert buffers(params) == buffers(state.exp_avg) == buffers(state.exp_avg_sq) == 1


def test_step_without_gradients_changes_nothing(tiny_host, new_id):
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=2))
    before = {k: v.clone() for k, v in tiny_host.adapter_params(aid).items()}
    metrics = tiny_host.optim_step(aid, AdamConfig(learning_rate=0.1, weight_decay=0.5))
    assert metrics == {"grad_norm": 0.0, "learning_rate": 0.1, "step": 0.0}
    assert all(torch.equal(before[k], v) for k, v in tiny_host.adapter_params(aid).items())


def test_clipping_tiny_gradients_matches_torch():
    """clip_grad_norm_ scales by max_norm / (norm + 1e-6): at norms near 1e-6 the epsilon
    dominates. A large Adam eps makes the step linear in the clipped gradient, so the
    weights show the scale (float64, so rounding does not hide it)."""
    gen = torch.Generator().manual_seed(1)
    ours = {"w": torch.randn(4, 3, generator=gen, dtype=torch.float64)}
    ref = {k: v.clone().requires_grad_(True) for k, v in ours.items()}
    grad = torch.randn(4, 3, generator=gen, dtype=torch.float64) * 1e-6
    ours["w"].grad, ref["w"].grad = grad.clone(), grad.clone()
    cfg = AdamConfig(learning_rate=1e-2, beta1=0.9, beta2=0.99, eps=1e-3, grad_clip_norm=1e-6)
    adamw_step(ours, AdamState(), cfg)
    torch.nn.utils.clip_grad_norm_(ref.values(), 1e-6)
    torch.optim.AdamW(ref.values(), lr=1e-2, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.0).step()
    torch.testing.assert_close(ours["w"], ref["w"].detach(), atol=1e-13, rtol=0)
