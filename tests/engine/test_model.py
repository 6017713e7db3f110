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


def _tiny_from_config(model_type: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    config = AutoConfig.for_model(model_type, **{**sizes, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


FALCON_H1_MAMBA = dict(mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1)
MOE = {  # transformers 5 keeps each block's experts as 3-D tensors, not linear layers
    # its shared expert is a plain gate_proj / up_proj / down_proj: matching those names
    # alone once made an adapter of one expert in dozens
    "qwen2_moe": dict(moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_experts_not_wrapped_for_lora_are_refused_and_the_other_kinds_kept(model_type):
    """Experts that ``lora.install`` did not wrap in ``LoRAExperts`` (here: not installed at
    all; in a host, those of another layout, test_experts.py) are refused by name."""
    model = _tiny_from_config(model_type, **MOE[model_type])
    spec = family_of(model.config)
    with pytest.raises(InvalidInputError, match=r"train_mlp: true, .* \['gate_up_proj', 'down_proj'\] \(e.g. "
                                                r"model.layers.0.mlp.experts.gate_up_proj\) as tensors outside "
                                                r"linear layers .*set train_mlp=false") as err:
        select_targets(model, spec, LoraConfig())
    assert err.value.field == "train_mlp"
    assert select_targets(model, spec, LoraConfig(train_mlp=False)) == ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                        "lm_head")


def test_linear_layers_beside_the_targets_that_no_name_covers_are_refused():
    """DeepSeek-V3's latent attention: q_proj and o_proj are names the specs know, its
    kv_a_proj_with_mqa and kv_b_proj are not; adapting the first two alone would be a
    partial adapter."""
    model = _tiny_from_config("deepseek_v3", moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                              first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    with pytest.raises(InvalidInputError, match=r"train_attn: true, but next to its layers \['o_proj', 'q_proj'\] "
                                                r".* \['kv_a_proj_with_mqa', 'kv_b_proj'\] \(e.g. "
                                                r"model.layers.0.self_attn.kv_a_proj_with_mqa\)") as err:
        select_targets(model, GENERIC, LoraConfig(train_mlp=False))
    assert err.value.field == "train_attn"
    with pytest.raises(InvalidInputError, match=r"train_mlp: true, .*\(e.g. model.layers.1.mlp.experts.gate_up_proj\)"):
        select_targets(model, GENERIC, LoraConfig(train_attn=False))
    assert select_targets(model, GENERIC, LoraConfig(train_attn=False, train_mlp=False)) == ("lm_head",)


def test_a_hybrid_whose_other_layers_hold_no_attention_target_is_refused():
    """Qwen3-Next runs linear attention (``linear_attn.in_proj_qkvz``...) in three layers of
    four: LoRA on q/k/v/o would adapt one layer in four. Falcon-H1 runs attention and a
    Mamba mixer side by side in every layer: each layer has its attention targets."""
    model = _tiny_from_config("qwen3_next", num_hidden_layers=4, moe_intermediate_size=16, num_experts=4,
                              num_experts_per_tok=2, linear_num_value_heads=2, linear_num_key_heads=2,
                              linear_key_head_dim=8, linear_value_head_dim=8)
    with pytest.raises(InvalidInputError, match=r"train_attn: true, but 3 of this model's 4 layers \(model.layers.0, "
                                                r"model.layers.1, model.layers.2\) have none of \['q_proj', ") as err:
        select_targets(model, GENERIC, LoraConfig(train_mlp=False))
    assert err.value.field == "train_attn"
    assert select_targets(model, GENERIC, LoraConfig(train_attn=False, train_mlp=False)) == ("lm_head",)
    parallel = _tiny_from_config("falcon_h1", **FALCON_H1_MAMBA)
    assert select_targets(parallel, GENERIC, LoraConfig(train_mlp=False)) == ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                              "lm_head")


def test_a_vision_tower_that_a_text_forward_never_runs_is_not_checked():
    """Multimodal Gemma 3 loads as Gemma3ForConditionalGeneration: its vision tower has
    ``out_proj`` next to ``q_proj``, but only the language model and the head run here, so
    the adapter is whole where it matters and is made."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gemma3", mm_tokens_per_image=4,
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14))
    model = AutoModelForCausalLM.from_config(config)
    assert any(name.endswith("vision_tower.encoder.layers.0.self_attn.out_proj")
               for name, _ in model.named_modules())
    assert select_targets(model, family_of(config), LoraConfig()) == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def test_a_model_nested_in_the_decoder_is_not_checked():
    """Phi-4-multimodal keeps its image and audio encoders inside its decoder's embedding
    (``model.embed_tokens_extend``); such an encoder is a model of its own, which a text
    forward does not run. (A tiny Phi-4-multimodal has full-size encoders: here a tiny
    Siglip encoder, whose attention has ``out_proj`` next to ``q_proj``, sits in a tiny
    Llama's decoder the same way.)"""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    model = _tiny_from_config("llama")
    model.model.embed_tokens_extend = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14))
    assert select_targets(model, family_of(model.config), LoraConfig()) == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


@pytest.mark.parametrize("multiplier", [8.0, 1.0])
def test_an_unknown_family_whose_forward_transforms_its_logits_is_refused(multiplier):
    """Falcon-H1 multiplies its logits by ``lm_head_multiplier``, a name ``check_head``
    does not know: the forward-vs-plain-head probe refuses it unless the factor is 1."""
    model = _tiny_from_config("falcon_h1", num_hidden_layers=1, **FALCON_H1_MAMBA, lm_head_multiplier=multiplier).eval()
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
