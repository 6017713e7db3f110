"""export.py: PEFT folders and merged models, checked against a hand computation.

The reference is W0 + (alpha / r) · B @ A written out here on the stored tensors; the
merged folders are read back both as raw safetensors and with ``from_pretrained``.
The CLI tests (tests/test_cli_user.py) check the same exports end to end against
TRIO's own sampler.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from trio_engine import ModelNotAvailableError
from trio_engine.catalog import Catalog
from trio_engine.export import ExportError, export_merged, export_peft, read_adapter
from trio_engine.lora import LoraConfig

from .helpers import plain_model, random_adapter_folder, tiny_tied_folder

TIED = "test/tiny-tied"
TIED_BF16 = "test/tiny-tied-bf16"


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    """The built-in catalog plus a tied tiny Llama, in fp32 (with a generation config) and bf16."""
    root = tmp_path_factory.mktemp("tied-models")
    cat = Catalog()
    cat.add_folder(TIED, tiny_tied_folder(root / "fp32", generation={"max_length": 321, "eos_token_id": 2}))
    cat.add_folder(TIED_BF16, tiny_tied_folder(root / "bf16", dtype=torch.bfloat16))
    return cat


def base_of(catalog, name):
    from transformers import AutoModelForCausalLM

    source = catalog.resolve(name)
    return AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)


def delta(weights, module, scale):
    return scale * (weights[f"{module}.lora_B"] @ weights[f"{module}.lora_A"])


def test_merged_weights_are_w0_plus_scaled_b_a(tmp_path):
    """tiny Llama (untied): every adapted linear gets exactly W0 + (α/r)·B·A; the rest is
    the base, bit for bit; progress says each step."""
    base = plain_model("trio/tiny-llama")
    config = LoraConfig(rank=4, train_mlp=False)
    weights = random_adapter_folder(tmp_path / "ckpt", base, "trio/tiny-llama", config)
    lines: list[str] = []
    export_merged(tmp_path / "ckpt", tmp_path / "merged", progress=lines.append)

    merged = load_file(tmp_path / "merged" / "model.safetensors")
    state = base.state_dict()
    scale = 32.0 / 4
    q = "model.layers.0.self_attn.q_proj"
    torch.testing.assert_close(merged[q + ".weight"], state[q + ".weight"] + delta(weights, q, scale),
                               atol=1e-6, rtol=0)
    assert not torch.allclose(merged[q + ".weight"], state[q + ".weight"], atol=1e-3)  # the delta is not tiny
    for key, value in state.items():
        module = key.removesuffix(".weight")
        expected = value + delta(weights, module, scale) if f"{module}.lora_A" in weights else value
        torch.testing.assert_close(merged[key], expected, atol=1e-6, rtol=0, msg=key)
        if "mlp" in key or "norm" in key or "embed" in key:
            assert torch.equal(merged[key], value), key  # untouched layers are copied exactly
    assert set(merged) == set(state)
    assert [line.split()[1] for line in lines[:4]] == ["1/4", "2/4", "3/4", "4/4"]
    cfg = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["dtype"] == "float32"
    assert not (tmp_path / "merged" / "generation_config.json").exists()  # the tiny base has none
    assert (tmp_path / "merged" / "tokenizer.json").exists()
    assert "chat_template" in json.loads((tmp_path / "merged" / "tokenizer_config.json").read_text()) or (
        tmp_path / "merged" / "chat_template.jinja").exists()


@pytest.mark.parametrize("train_unembed", [True, False])
def test_tied_embeddings(catalog, tmp_path, train_unembed):
    """Adapting lm_head unties it: the input embeddings stay the base's, lm_head gets the
    delta, and from_pretrained keeps them apart. Without it the tie (one tensor) stays."""
    from transformers import AutoModelForCausalLM

    base = base_of(catalog, TIED)
    embed = base.model.embed_tokens.weight.detach().clone()
    config = LoraConfig(rank=2, train_unembed=train_unembed)
    weights = random_adapter_folder(tmp_path / "ckpt", base, TIED, config, scale=0.2)
    export_merged(tmp_path / "ckpt", tmp_path / "merged", catalog=catalog, progress=lambda _: None)

    merged = load_file(tmp_path / "merged" / "model.safetensors")
    cfg = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert torch.equal(merged["model.embed_tokens.weight"], embed)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    if train_unembed:
        assert cfg["tie_word_embeddings"] is False
        want = embed + delta(weights, "lm_head", 16.0)
        torch.testing.assert_close(merged["lm_head.weight"], want, atol=1e-6, rtol=0)
        assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
        torch.testing.assert_close(loaded.lm_head.weight, want, atol=1e-6, rtol=0)
        assert torch.equal(loaded.model.embed_tokens.weight, embed)
    else:
        assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in merged
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    # the base's own generation config comes along
    generation = json.loads((tmp_path / "merged" / "generation_config.json").read_text())
    assert generation["max_length"] == 321


def test_a_bf16_base_is_merged_in_fp32_then_cast_back(catalog, tmp_path):
    from transformers import AutoModelForCausalLM

    base16 = AutoModelForCausalLM.from_pretrained(catalog.resolve(TIED_BF16).path, dtype=torch.bfloat16)
    weights = random_adapter_folder(tmp_path / "ckpt", base16, TIED_BF16, LoraConfig(rank=2), scale=0.2)
    export_merged(tmp_path / "ckpt", tmp_path / "merged", catalog=catalog, progress=lambda _: None)
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == "bfloat16"
    for module in ("model.layers.1.mlp.down_proj", "lm_head"):
        w0 = base16.get_submodule(module).weight.detach()
        want = (w0.float() + delta(weights, module, 16.0)).to(torch.bfloat16)
        assert merged[module + ".weight"].dtype == torch.bfloat16
        assert torch.equal(merged[module + ".weight"], want), module
    assert torch.equal(merged["model.embed_tokens.weight"], base16.model.embed_tokens.weight)


def test_training_state_and_sampler_weights_export_the_same_peft_folder(tiny_host, new_id, tmp_path):
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=3, seed=4, train_attn=False))
    tiny_host.save_state(aid, str(tmp_path / "state"))
    tiny_host.save_sampler_weights(aid, str(tmp_path / "sampler"))
    export_peft(tmp_path / "state", tmp_path / "from-state")
    export_peft(tmp_path / "sampler", tmp_path / "from-sampler")
    for folder in ("from-state", "from-sampler"):
        assert sorted(p.name for p in (tmp_path / folder).iterdir()) == [
            "adapter_config.json", "adapter_model.safetensors"]
    a, b = (load_file(tmp_path / f / "adapter_model.safetensors") for f in ("from-state", "from-sampler"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (json.loads((tmp_path / "from-state" / "adapter_config.json").read_text())
            == json.loads((tmp_path / "sampler" / "adapter_config.json").read_text()))
    assert read_adapter(tmp_path / "state").base_model == "trio/tiny-llama"


def test_errors_name_what_is_wrong(catalog, tmp_path):
    with pytest.raises(ExportError, match="neither trio_state.json"):
        export_peft(tmp_path, tmp_path / "out")
    base = base_of(catalog, TIED)
    random_adapter_folder(tmp_path / "ckpt", base, TIED, LoraConfig(rank=2))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(ExportError, match="full: exists and is not an empty folder"):
        export_merged(tmp_path / "ckpt", tmp_path / "full", catalog=catalog)
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["x"]

    # peft's copy of the base head (save_embedding_layers): the base's merges, another is refused
    tensors = load_file(tmp_path / "ckpt" / "adapter_model.safetensors")
    head = base.lm_head.weight.detach().clone()
    for copy, out in ((head, "same-head"), (head * 1.05, "other-head")):
        save_file({**tensors, "base_model.model.lm_head.base_layer.weight": copy},
                  tmp_path / "ckpt" / "adapter_model.safetensors")
        if out == "same-head":
            export_merged(tmp_path / "ckpt", tmp_path / out, catalog=catalog, progress=lambda _: None)
        else:
            with pytest.raises(ExportError, match="holds base_model.model.lm_head.base_layer.weight, a head"):
                export_merged(tmp_path / "ckpt", tmp_path / out, catalog=catalog, progress=lambda _: None)
            assert not (tmp_path / out).exists()

    # an adapter for another model: its base is not here
    config = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    (tmp_path / "ckpt" / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/absent"}))
    with pytest.raises(ModelNotAvailableError, match="org/absent"):
        export_merged(tmp_path / "ckpt", tmp_path / "out", catalog=Catalog({}))

    # an adapter that does not fit the base: a module it lacks, then a wrong shape
    random_adapter_folder(tmp_path / "wide", plain_model("trio/tiny-llama"), TIED, LoraConfig(rank=2))
    weights = load_file(tmp_path / "wide" / "adapter_model.safetensors")

    moved = {k.replace("layers.1.", "layers.7."): v for k, v in weights.items()}
    save_file(moved, tmp_path / "wide" / "adapter_model.safetensors")
    with pytest.raises(ExportError, match=r"'model.layers.7.mlp.down_proj' is not in base model 'test/tiny-tied'"):
        export_merged(tmp_path / "wide", tmp_path / "out", catalog=catalog, progress=lambda _: None)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp*"))  # nothing half-written
    bad = dict(weights)
    bad["base_model.model.lm_head.lora_B.weight"] = torch.zeros(5, 2)
    save_file(bad, tmp_path / "wide" / "adapter_model.safetensors")
    with pytest.raises(ExportError, match=r"'lm_head': A \(2, 64\), B \(5, 2\) do not fit a weight of shape"):
        export_merged(tmp_path / "wide", tmp_path / "out", catalog=catalog, progress=lambda _: None)
