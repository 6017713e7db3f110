"""Sampling throughput vs transformers ``generate``, both on the same rank-32 LoRA.

(a) single:  one request, 8 samples x 64 new tokens vs generate(num_return_sequences=8)
(b) rollout: 10 prompts x 4 samples x 32 tokens submitted together vs one generate call
             on the 10 prompts left-padded (num_return_sequences=4: TRL's GRPO trainer
             calls it so), and vs a loop of generate per prompt (``rollout_loop``)

Throughput is generated tokens per second (EOS is suppressed on both sides so every
sequence runs its full length). The baseline is peft loading the adapter we saved, its
weights copied into anonymous memory as ours are (transformers leaves them mapped from
the file, whose pages decode 15-20% slower: ``device.gather_on_huge_pages``). Our prefix
cache starts empty on every call: a prompt is prefilled once per request (shared by its
samples), never reused from the repeat before.

    RESULT sample_<dtype>_single  ours=<tokens/s> baseline=<tokens/s> ratio=...
    RESULT sample_<dtype>_rollout ours=...
    RESULT sample_<dtype>_rollout_loop ours=...

Run: .venv/bin/python benchmarks/sample.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from common import bundled_folder, result, timed_pair

from trio_engine import DEFAULT_MODEL, LoraConfig, ModelHost, SampleRequest, SamplingConfig
from trio_engine.sampler import PrefixCache

QUESTIONS = ["What is 2 + 3?", "What is 7 - 4?", "What is 6 * 8?", "What is 12 / 3?", "Solve for x: x + 5 = 9",
             "Solve for x: 2x = 10", "What is 3 squared?", "What is the square root of 81?", "What is 15 + 27?",
             "What is 100 - 58?"]


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(f"Question: {q}\nReturn only the final numeric answer.\nAnswer:") for q in QUESTIONS]


def ours(host: ModelHost, requests: list[tuple[list[int], int, int]]):
    """All requests submitted together, each run to max_tokens, the prefix cache empty."""
    reqs = [SampleRequest("bench", p, n, SamplingConfig(max_tokens=m, temperature=1.0, seed=k, ignore_eos=True))
            for k, (p, n, m) in enumerate(requests)]

    def run():
        host.prefix_cache = PrefixCache()
        host.sample(reqs)

    return run


def generate(model, tokenizer, prompts: list[list[int]], samples: int, tokens: int) -> None:
    """One generate call on ``prompts`` left-padded to one length, as transformers batches."""
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                   max_new_tokens=tokens, min_new_tokens=tokens, num_return_sequences=samples, pad_token_id=pad)


def baseline(model, tokenizer, requests: list[tuple[list[int], int, int]], batched: bool):
    """One generate call on every prompt (they share samples and tokens), or one per prompt."""
    _, samples, tokens = requests[0]
    assert all(n == samples and m == tokens for _, n, m in requests)
    if batched:
        return lambda: generate(model, tokenizer, [p for p, _, _ in requests], samples, tokens)
    return lambda: [generate(model, tokenizer, [p], samples, tokens) for p, _, _ in requests]


def compare(name: str, host: ModelHost, model, tokenizer, requests, repeats: int, batched: bool = True) -> None:
    timings = timed_pair(ours(host, requests), baseline(model, tokenizer, requests, batched), repeats)
    tokens = sum(n * m for _, n, m in requests)
    result(name, tokens / timings["ours"], tokens / timings["baseline"], " (tokens/s)", timings.spread())


def in_anonymous_memory(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its weights copied out of the file's mapping (tied ones stay tied:
    ``parameters`` yields a shared one once)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        host = ModelHost(DEFAULT_MODEL, dtype=dtype)
        host.create_adapter("bench", LoraConfig(rank=32, seed=0))
        with torch.no_grad():  # a non-trivial adapter, so both sides really apply it
            for name, p in host.adapter_params("bench").items():
                if name.endswith("lora_B"):
                    p.normal_(0, 1e-3)
        with tempfile.TemporaryDirectory() as folder:
            host.save_sampler_weights("bench", folder)
            base = AutoModelForCausalLM.from_pretrained(bundled_folder(), dtype=dtype)
            peft_model = in_anonymous_memory(PeftModel.from_pretrained(base, folder).eval())
            tokenizer = host.tokenizer
            ps = prompts(tokenizer)
            with torch.no_grad():
                compare(f"sample_{dtype_name}_single", host, peft_model, tokenizer, [(ps[0], 8, 64)], args.repeats)
                rollout = [(p, 4, 32) for p in ps]
                compare(f"sample_{dtype_name}_rollout", host, peft_model, tokenizer, rollout, args.repeats)
                compare(f"sample_{dtype_name}_rollout_loop", host, peft_model, tokenizer, rollout, args.repeats,
                        batched=False)
        del host


if __name__ == "__main__":
    main()
