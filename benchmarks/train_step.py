"""One LoRA training step (forward_backward + AdamW) vs transformers + peft.

Same model (the bundled SmolLM2-135M), same data, same dtype, rank 32 on every linear
layer of the blocks, AdamW. The baseline is what a user writes by hand: pad the batch
to its longest sequence, ``model(input_ids, attention_mask, labels)``, backward, step.

    RESULT train_<dtype>_<ragged|dense> ours=<tokens/s> baseline=<tokens/s> ratio=...
    FLOPS  train_<dtype>_<...> fraction_of_peak=... baseline_fraction=...
    RESULT train_<dtype>_first_step ours=<1/first step s> baseline=<1/warm step s> ratio=...

The peak of the FLOPS line is measured like the step, interleaved with it: every
linear layer's matmul of the model once, on as many rows as the batch has tokens
(``common.model_matmuls``), so it moves with the machine's speed as the step does. The
step's FLOPs count the forward (2 per weight per token) and the backward to the
activations (2 more; the base is frozen, so no weight gradients), as the peak's do.

The first step is ``create_adapter`` then one step on a new adapter, on a warm host: a
user's first call after ``create_lora_training_client`` (target: ratio >= 1/1.5).

Run: .venv/bin/python benchmarks/train_step.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from common import bundled_folder, model_matmuls, result, timed_interleaved

from trio_engine import DEFAULT_MODEL, AdamConfig, Example, ForwardJob, LoraConfig, ModelHost

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def batches(vocab: int) -> dict[str, list[list[int]]]:
    rng = random.Random(0)
    ragged = [[rng.randrange(vocab) for _ in range(n + 1)] for n in [rng.randint(32, 256) for _ in range(16)]]
    dense = [[rng.randrange(vocab) for _ in range(129)] for _ in range(8)]
    return {"ragged": ragged, "dense": dense}


def ours_step(host: ModelHost, seqs: list[list[int]], adapter: str = "bench"):
    examples = [Example(s[:-1], {"target_tokens": s[1:]}) for s in seqs]

    def step():
        host.forward_backward([ForwardJob(adapter, examples)])
        host.optim_step(adapter, AdamConfig(learning_rate=1e-4))

    return step


def peft_step(dtype: torch.dtype, seqs: list[list[int]]):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bundled_folder(), dtype=dtype)
    model = get_peft_model(model, PeftLoraConfig(r=32, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    width = max(len(s) for s in seqs) - 1
    ids = torch.tensor([s[:-1] + [0] * (width - len(s) + 1) for s in seqs])
    mask = torch.tensor([[1] * (len(s) - 1) + [0] * (width - len(s) + 1) for s in seqs])
    labels = torch.tensor([s[1:] + [-100] * (width - len(s) + 1) for s in seqs])

    def step():
        # labels are already the next tokens, so the loss is computed here, unshifted
        out = model(input_ids=ids, attention_mask=mask)
        logits = out.logits.float()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def matmul_params(host: ModelHost) -> int:
    """Weights that take part in matmuls per token (everything but the embedding lookup)."""
    embed = host.model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in host.model.parameters())
    return total - embed + host.unembed.weight.numel()


def first_step_seconds(host: ModelHost, seqs: list[list[int]], repeats: int) -> float:
    """Median time of create_adapter + the first step on it (a new adapter each time)."""
    times = []
    for k in range(repeats):
        start = time.perf_counter()
        host.create_adapter(f"first-{k}", LoraConfig(rank=32, train_unembed=False))
        ours_step(host, seqs, f"first-{k}")()
        times.append(time.perf_counter() - start)
        host.delete_adapter(f"first-{k}")
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    torch.manual_seed(0)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        host = ModelHost(DEFAULT_MODEL, dtype=dtype)
        host.create_adapter("bench", LoraConfig(rank=32, train_unembed=False))
        for shape, seqs in batches(host.vocab_size).items():
            tokens = sum(len(s) - 1 for s in seqs)
            peak_fn, peak_flops = model_matmuls(host.model, tokens, dtype)
            medians = timed_interleaved({"ours": ours_step(host, seqs), "baseline": peft_step(dtype, seqs),
                                         "peak": peak_fn}, args.repeats)
            name = f"train_{dtype_name}_{shape}"
            result(name, tokens / medians["ours"], tokens / medians["baseline"], unit=" (tokens/s)")
            flops = 4 * matmul_params(host) * tokens / medians["ours"]
            peak = peak_flops / medians["peak"]
            # the baseline's useful FLOP/s (its padding not counted): how far from the peak
            # a step of the same numerics already was, hence what ratio the peak leaves room for
            baseline_flops = 4 * matmul_params(host) * tokens / medians["baseline"]
            print(f"FLOPS {name} ours={flops / 1e9:.1f}GFLOP/s peak={peak / 1e9:.1f}GFLOP/s "
                  f"fraction_of_peak={flops / peak:.3f} baseline_fraction={baseline_flops / peak:.3f}", flush=True)
            if shape == "dense":
                first = first_step_seconds(host, seqs, args.repeats)
                result(f"train_{dtype_name}_first_step", 1 / first, 1 / medians["ours"], unit=" (1/s)")
        del host


if __name__ == "__main__":
    main()
