"""Sampling throughput vs transformers ``generate``, both on the same rank-32 LoRA.

(a) single:  one request, 8 samples x 64 new tokens vs generate(num_return_sequences=8)
(b) rollout: 10 prompts x 4 samples x 32 tokens submitted together vs a loop of
             generate per prompt (how an RL loop calls transformers)

Throughput is generated tokens per second (EOS is suppressed on both sides so every
sequence runs its full length). The baseline is peft loading the adapter we saved.

    RESULT sample_<dtype>_single  ours=<tokens/s> baseline=<tokens/s> ratio=...
    RESULT sample_<dtype>_rollout ours=...

Run: .venv/bin/python benchmarks/sample.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from common import bundled_folder, result, timed_pair

from trio_engine import DEFAULT_MODEL, LoraConfig, ModelHost, SampleRequest, SamplingConfig

QUESTIONS = ["What is 2 + 3?", "What is 7 - 4?", "What is 6 * 8?", "What is 12 / 3?", "Solve for x: x + 5 = 9",
             "Solve for x: 2x = 10", "What is 3 squared?", "What is the square root of 81?", "What is 15 + 27?",
             "What is 100 - 58?"]


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(f"Question: {q}\nReturn only the final numeric answer.\nAnswer:") for q in QUESTIONS]


def ours(host: ModelHost, requests: list[tuple[list[int], int, int]]):
    """All requests submitted together, each run to max_tokens; returns (call, tokens)."""
    reqs = [SampleRequest("bench", p, n, SamplingConfig(max_tokens=m, temperature=1.0, seed=k, ignore_eos=True))
            for k, (p, n, m) in enumerate(requests)]
    return lambda: host.sample(reqs), sum(n * m for _, n, m in requests)


def baseline(model, tokenizer, requests: list[tuple[list[int], int, int]]):
    """A loop of generate calls, one per prompt; returns (call, tokens)."""
    def run():
        for p, n, m in requests:
            ids = torch.tensor([p])
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                           top_k=0, max_new_tokens=m, min_new_tokens=m, num_return_sequences=n,
                           pad_token_id=tokenizer.pad_token_id)

    return run, sum(n * m for _, n, m in requests)


def compare(name: str, host: ModelHost, model, tokenizer, requests, repeats: int) -> None:
    (ours_fn, tokens), (base_fn, _) = ours(host, requests), baseline(model, tokenizer, requests)
    ours_s, base_s = timed_pair(ours_fn, base_fn, repeats)
    result(name, tokens / ours_s, tokens / base_s, unit=" (tokens/s)")


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
            peft_model = PeftModel.from_pretrained(base, folder).eval()
            tokenizer = host.tokenizer
            ps = prompts(tokenizer)
            with torch.no_grad():
                compare(f"sample_{dtype_name}_single", host, peft_model, tokenizer, [(ps[0], 8, 64)], args.repeats)
                compare(f"sample_{dtype_name}_rollout", host, peft_model, tokenizer, [(p, 4, 32) for p in ps],
                        args.repeats)
        del host


if __name__ == "__main__":
    main()
