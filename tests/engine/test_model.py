"""Model families: target selection refuses partial adapters; the head transforms' formulas.

Parity of every family against transformers and peft is in test_host / test_checkpoint /
test_sampler (the ``family_host`` fixture)."""

from types import SimpleNamespace

import pytest
import torch

from trio_engine import InvalidInputError, LoraConfig, ModelNotAvailableError
from trio_engine.lora import adapter_tensors
from trio_engine.model import (
    FAMILIES,
    GENERIC,
    PHI3,
    LogitTransform,
    check_head,
    check_plain_head,
    family_of,
    select_targets,
)


def test_a_partial_adapter_is_refused_before_any_state_change(tiny_host, new_id, monkeypatch):
    """Phi-3's fused names on a Llama-shaped model: the attention kind is incomplete, so
    creating the adapter fails naming the field and the missing layers, adding nothing."""
    monkeypatch.setattr(tiny_host, "family", PHI3)
    aid = new_id()
    before = dict(tiny_host.adapters)
    with pytest.raises(InvalidInputError, match=r"train_attn: true, .*\['qkv_proj'\]") as err:
        tiny_host.create_adapter(aid, LoraConfig(rank=2))
    assert err.value.field == "train_attn"
    assert tiny_host.adapters == before and adapter_tensors(tiny_host.model, aid) == {}
    tiny_host.create_adapter(aid, LoraConfig(rank=2, train_attn=False, train_mlp=False))  # lm_head only
    assert {k.rsplit(".", 2)[-2] for k in tiny_host.adapter_params(aid)} == {"lm_head"}
    tiny_host.delete_adapter(aid)


def test_the_generic_spec_takes_what_the_model_has_and_needs_every_asked_kind():
    model = torch.nn.ModuleDict({"qkv_proj": torch.nn.Linear(4, 12), "o_proj": torch.nn.Linear(4, 4),
                                 "lm_head": torch.nn.Linear(4, 9)})
    assert set(select_targets(model, GENERIC, LoraConfig(train_mlp=False))) == {"qkv_proj", "o_proj", "lm_head"}
    with pytest.raises(InvalidInputError, match="train_mlp: true, .*no linear layer named") as err:
        select_targets(model, GENERIC, LoraConfig())
    assert err.value.field == "train_mlp"


def test_families_are_looked_up_by_model_type():
    assert family_of(SimpleNamespace(model_type="phi3")) is PHI3
    assert family_of(SimpleNamespace(model_type="mystery")) is GENERIC
    assert family_of(SimpleNamespace(model_type="gemma2")).transform(
        SimpleNamespace(final_logit_softcapping=30.0)) == LogitTransform(softcap=30.0)
    assert FAMILIES["granite"].transform(SimpleNamespace(logits_scaling=8)) == LogitTransform(divide=8.0)
    assert FAMILIES["llama"].transform(SimpleNamespace(logit_scale=3.0)) == LogitTransform()


def test_an_unknown_family_with_a_logit_transform_is_refused():
    with pytest.raises(ModelNotAvailableError, match=r"'mystery' is not a known family .*'logit_scale': 0.5"):
        check_head(GENERIC, SimpleNamespace(model_type="mystery", logit_scale=0.5, logits_scaling=None))
    check_head(GENERIC, SimpleNamespace(model_type="mystery", logits_scaling=None))
    check_head(FAMILIES["cohere"], SimpleNamespace(model_type="cohere", logit_scale=0.5))


@pytest.mark.parametrize("multiplier", [8.0, 1.0])
def test_an_unknown_family_whose_forward_transforms_its_logits_is_refused(multiplier):
    """Falcon-H1 multiplies its logits by ``lm_head_multiplier``, a name ``check_head``
    does not know: the forward-vs-plain-head probe refuses it unless the factor is 1."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "falcon_h1", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, lm_head_multiplier=multiplier)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert family_of(model.config) is GENERIC
    if multiplier == 1.0:
        check_plain_head(GENERIC, model)
    else:
        with pytest.raises(ModelNotAvailableError, match="'falcon_h1' is not a known family .* after lm_head"):
            check_plain_head(GENERIC, model)
    check_plain_head(FAMILIES["llama"], model)  # a known family's head is its spec's business


def test_transform_formulas():
    x = torch.linspace(-50, 50, 101)
    torch.testing.assert_close(LogitTransform(softcap=30.0)(x), 30.0 * torch.tanh(x / 30.0))
    torch.testing.assert_close(LogitTransform(multiply=0.0625)(x), x * 0.0625)
    torch.testing.assert_close(LogitTransform(divide=4.0)(x), x / 4.0)
    assert torch.equal(LogitTransform()(x), x)
