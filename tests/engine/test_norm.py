"""Fused RMSNorm (``trio_engine.norm``) against each family's own transformers module."""

import copy

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from trio_engine import norm
from trio_engine.norm import FusedRMSNorm

from .helpers import FAMILY_SOURCES, plain_model

RMSNORM_FAMILIES = [f for f in FAMILY_SOURCES if f != "cohere"]  # Cohere normalises with a LayerNorm


def _norms(family: str) -> list[nn.Module]:
    model = plain_model(FAMILY_SOURCES[family].name)  # plain transformers modules, a fresh copy
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", RMSNORM_FAMILIES)
def test_the_fused_norm_gives_the_modules_output_and_gradient(family, dtype):
    """Same output bit for bit, with and without autograd; an input gradient as close to
    fp64 autograd through the module as the module's own autograd is; the input left
    untouched."""
    norms = _norms(family)
    assert norms
    gen = torch.Generator().manual_seed(1)
    for module in norms:
        with torch.no_grad():  # random-init norms are all ones (or zeros): make the scale count
            module.weight.add_(torch.randn(module.weight.shape, generator=gen) * 0.5)
        module.to(dtype)
        twin = norm._fused_twin(module)
        assert twin is not None, type(module).__name__
        x = (torch.randn(3, 5, module.weight.shape[0], generator=gen) * 2).to(dtype)
        grad_out = torch.randn(x.shape, generator=gen).to(dtype)
        x64 = x.double().requires_grad_()
        copy.deepcopy(module).double()(x64).backward(grad_out.double())

        ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = twin(ours)
        out.backward(grad_out)
        expected = module(theirs)
        expected.backward(grad_out)
        assert torch.equal(out, expected)
        assert torch.equal(ours.detach(), x)
        with torch.no_grad():  # inference takes the ops without autograd.Function
            assert torch.equal(twin(x), expected.detach())
        our_error = (ours.grad.double() - x64.grad).abs().max().item()
        their_error = (theirs.grad.double() - x64.grad).abs().max().item()
        assert our_error <= 1.5 * their_error + 1e-6, (type(module).__name__, our_error, their_error)


def test_host_models_run_fused_norms_and_the_tests_reference_does_not(tiny_host, qwen_host):
    assert sum(isinstance(m, FusedRMSNorm) for m in tiny_host.model.modules()) == 5  # 2 layers x 2 + final
    assert sum(isinstance(m, FusedRMSNorm) for m in qwen_host.model.modules()) == 9  # + q_norm, k_norm
    assert not any(isinstance(m, FusedRMSNorm) for m in plain_model("trio/tiny-llama").modules())


class _EpsOutsideRoot(nn.Module):
    """An RMSNorm of a form neither known form computes."""

    def __init__(self, size: int):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), 1e-5

    def forward(self, x):
        return self.weight * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)


def test_install_swaps_only_frozen_norms_a_known_form_reproduces():
    model = nn.Sequential(LlamaRMSNorm(8), _EpsOutsideRoot(8), LlamaRMSNorm(8)).requires_grad_(False)
    model[2].weight.requires_grad_(True)
    assert norm.install(model) == 1
    assert isinstance(model[0], FusedRMSNorm) and "form=scale_after_cast" in repr(model[0])
    assert isinstance(model[1], _EpsOutsideRoot) and isinstance(model[2], LlamaRMSNorm)


def test_install_counts_every_norm_it_swaps():
    model = plain_model(FAMILY_SOURCES["llama"].name).requires_grad_(False)
    layers = model.config.num_hidden_layers
    assert norm.install(model) == 2 * layers + 1  # two per decoder layer and the final one
    assert sum(isinstance(m, FusedRMSNorm) for m in model.modules()) == 2 * layers + 1


def test_an_unknown_form_is_refused_by_name():
    with pytest.raises(ValueError, match="form: 'after'"):
        FusedRMSNorm(nn.Parameter(torch.ones(4)), 1e-6, "after")


def test_a_fused_norm_refuses_a_trainable_weight():
    fused = FusedRMSNorm(nn.Parameter(torch.ones(4)), 1e-6, "one_plus_w")
    with pytest.raises(RuntimeError, match="frozen"):
        fused(torch.ones(2, 4))


@pytest.mark.parametrize("form", norm.FORMS)
def test_in_bf16_a_fused_norm_keeps_its_bf16_input_for_the_backward_not_an_fp32_copy(form):
    """What it saves is what it holds from the forward to the backward, per norm per layer:
    the bf16 input (2 bytes a value) and one fp32 scale per row, not fp32 normalised values."""
    weight = nn.Parameter(torch.randn(64, dtype=torch.bfloat16), requires_grad=False)
    x = torch.randn(8, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = FusedRMSNorm(weight, 1e-6, form)(x)
    assert sum(t.nbytes for t in saved) == x.nbytes + 8 * 16 * 4 + weight.nbytes
    out.sum().backward()  # and the backward still runs from them
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
