"""Reference implementations and data builders for engine tests (tests only)."""

from __future__ import annotations

import random

import torch

from trio_engine import Example
from trio_engine.catalog import Catalog, load_model_and_tokenizer


def plain_model(name: str):
    """The same base model, loaded separately and without any LoRA wrapper."""
    model, _ = load_model_and_tokenizer(Catalog().resolve(name), torch.float32)
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
