"""A multimodal model (Gemma 3's ConditionalGeneration form) serves text: its vision tower,
which a text forward never runs, is neither adapted nor loaded from a checkpoint."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from trio_engine import ForwardJob, InvalidInputError, LoraConfig, ModelHost
from trio_engine.catalog import Catalog, load_tokenizer
from trio_engine.lora import LoRALinear

from .helpers import random_example, randomize_adapter, reference_logprobs

VISION = "model.vision_tower."
WINDOW = 4  # the text layers' sliding window (in text_config, as on the real checkpoints)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = load_tokenizer(Catalog().resolve("trio/tiny-llama"))
    config = AutoConfig.for_model(
        "gemma3", mm_tokens_per_image=4,
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=WINDOW,
                         layer_types=["sliding_attention", "full_attention"], initializer_range=0.15),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    path = tmp_path_factory.mktemp("gemma3-multimodal")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def host(folder):
    catalog = Catalog()
    catalog.add_folder("test/gemma3-multimodal", folder)
    return ModelHost("test/gemma3-multimodal", dtype="float32", catalog=catalog)


def _plain(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _logprobs(model, example) -> torch.Tensor:
    return reference_logprobs(model, example.tokens, list(example.inputs["target_tokens"]))


def test_only_the_language_model_and_head_are_adapted(host, folder):
    """The vision tower's q/k/v keep their plain linears; the adapter holds the text
    layers' and the head's tensors only, and computes a hand-merged plain model's logprobs."""
    host.create_adapter("text", LoraConfig(rank=4, seed=1))
    randomize_adapter(host, "text", seed=2, scale=0.1)
    names = {name.rsplit(".", 1)[0] for name in host.adapter_params("text")}
    assert names and not any(name.startswith(VISION) for name in names)
    assert any(".language_model." in name for name in names) and "lm_head" in names
    vision_q = host.model.get_submodule(VISION + "encoder.layers.0.self_attn.q_proj")
    assert type(vision_q) is torch.nn.Linear

    example = random_example(host.vocab_size, 9, random.Random(0))
    ours = torch.tensor(host.forward([ForwardJob("text", [example])])[0].logprobs[0])
    reference = _plain(folder)
    assert reference.lm_head.weight is reference.get_input_embeddings().weight  # tied, as Gemma's are
    reference.lm_head.weight = torch.nn.Parameter(reference.lm_head.weight.clone())  # TRIO adapts the head alone
    with torch.no_grad():
        for name in names:
            a, b = (host.adapter_params("text")[f"{name}.lora_{m}"].detach() for m in "AB")
            reference.get_submodule(name).weight += (LoraConfig(rank=4).alpha / 4) * (b @ a)
    torch.testing.assert_close(ours, _logprobs(reference, example), atol=1e-5, rtol=1e-5)
    host.delete_adapter("text")


def test_a_peft_adapter_with_vision_layers_loads_its_text_part(host, folder, tmp_path):
    """peft, given target names, adapts the vision tower's q/k/v too: such a folder loads,
    and TRIO's logprobs are peft's own (a text forward never runs the vision tower)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_plain(folder), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    assert any("vision_tower" in name and "lora_A" in name for name, _ in model.named_parameters())
    model.save_pretrained(tmp_path)

    host.load_sampler_weights("peft", str(tmp_path))
    assert not any(name.startswith(VISION) for name in host.adapter_params("peft"))
    example = random_example(host.vocab_size, 9, random.Random(1))
    ours = torch.tensor(host.forward([ForwardJob("peft", [example])])[0].logprobs[0])
    torch.testing.assert_close(ours, _logprobs(model.eval(), example), atol=1e-5, rtol=1e-5)
    host.delete_adapter("peft")


def test_an_adapter_of_other_names_or_of_the_tower_alone_is_refused(host, tmp_path):
    """Only this model's layers outside the text forward are dropped: names of no layer here
    (the text-only Gemma 3's ``model.layers``) are refused as before, and so is an adapter
    left with nothing once its tower tensors are dropped."""
    from trio_engine.checkpoint import save_peft_adapter

    def folder_of(name: str, rank: int = 4):
        path = tmp_path / name.replace(".", "-")
        save_peft_adapter(path, {f"{name}.lora_A": torch.ones(rank, 32), f"{name}.lora_B": torch.ones(32, rank)},
                          LoraConfig(rank=rank), "test/gemma3-multimodal")
        return str(path)

    with pytest.raises(InvalidInputError, match="is no tensor of this model's adapter"):
        host.load_sampler_weights("other", folder_of("model.layers.0.self_attn.q_proj"))
    with pytest.raises(InvalidInputError, match="adapts none of this model's text layers"):
        host.load_sampler_weights("tower", folder_of(VISION + "encoder.layers.0.self_attn.q_proj"))
    assert not host.has_adapter("other") and not host.has_adapter("tower")


def test_a_training_state_with_vision_tensors_loads_its_text_part(host, tmp_path):
    """A training state holding vision-tower tensors (as TRIO saved one before it left the
    tower out) loads: weights and moments of the text layers, the rest dropped."""
    host.create_adapter("saved", LoraConfig(rank=4, seed=3))
    randomize_adapter(host, "saved", seed=4)
    host.save_state("saved", str(tmp_path), with_optimizer=True)
    extra = VISION + "encoder.layers.0.self_attn.q_proj.lora_A"
    for file, prefixes in (("adapter.safetensors", [""]), ("optimizer.safetensors", ["exp_avg.", "exp_avg_sq."])):
        tensors = load_file(tmp_path / file)
        save_file(tensors | {p + extra: torch.ones(4, 32) for p in prefixes}, tmp_path / file)

    host.load_state("back", str(tmp_path), with_optimizer=True)
    saved, back = host.adapter_params("saved"), host.adapter_params("back")
    assert back.keys() == saved.keys()
    assert all(torch.equal(back[k], saved[k]) for k in saved)
    for aid in ("saved", "back"):
        host.delete_adapter(aid)


def test_the_text_part_is_what_gets_wrapped():
    """``lora.install``'s ``within`` leaves the paths it refuses as they were."""
    from torch import nn

    from trio_engine import lora

    model = nn.Module()
    model.text, model.vision = nn.Module(), nn.Module()
    model.text.q_proj, model.vision.q_proj = nn.Linear(4, 4), nn.Linear(4, 4)
    lora.install(model, ["q_proj"], within=lambda path: not path.startswith("vision"))
    assert isinstance(model.text.q_proj, LoRALinear) and type(model.vision.q_proj) is nn.Linear


def test_the_text_configs_window_and_context_hold(host, folder):
    """Gemma 3's window and context are in ``text_config``: read off the top-level config,
    a ragged batch longer than the window ran packed, its sliding layers attending to
    everything (0.6-1 nats off), and the context was capped at 4096."""
    from transformers import AutoConfig

    assert host.max_seq_len == AutoConfig.from_pretrained(folder).text_config.max_position_embeddings > 4096
    rng = random.Random(3)
    examples = [random_example(host.vocab_size, n, rng) for n in (12, 5, 9)]
    [result] = host.forward([ForwardJob(None, examples)])
    reference = _plain(folder)
    for example, ours in zip(examples, result.logprobs):
        torch.testing.assert_close(torch.tensor(ours), _logprobs(reference, example), atol=1e-5, rtol=1e-5)
