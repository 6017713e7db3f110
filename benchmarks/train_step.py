"""One LoRA training step (forward_backward + AdamW) vs transformers + peft.

Same model (the bundled SmolLM2-135M), same data, same dtype, rank 32 on every linear
layer of the blocks, AdamW. The baseline is what a user writes by hand: pad the batch
to its longest sequence, ``model(input_ids, attention_mask, labels)``, backward, step.

    RESULT train_<dtype>_<ragged|dense> ours=<tokens/s> baseline=<tokens/s> ratio=... spread=...
    RESULT train_bfloat16_<...>_vs_bf16_adapters ...   (peft with its adapters in bf16 too)
    FLOPS  train_<dtype>_<...> fraction_of_peak=... spread=... peak=... baseline_fraction=...
    RESULT train_<dtype>_first_step ours=<first step s> baseline=<warm step s> ratio=first/warm

peft keeps a bf16 model's adapters in fp32 by default (``autocast_adapter_dtype``): every
adapted layer's input is cast to fp32 and its low-rank products run in fp32, where ours
run in bf16 (from fp32 master weights). The ``_vs_bf16_adapters`` line is the baseline
with the same products as ours (its AdamW then updates bf16 weights, which is cheaper).
Both baselines' AdamW is torch's, without weight decay (as ours), over all tensors at once.

The peak of the FLOPS line is measured like the step, interleaved with it: every
linear layer's matmul of the model once, with the model's own weights, on as many rows
as the batch has tokens (``common.model_matmuls``), so it moves with the machine's speed
as the step does; ``spread`` is the lowest and highest fraction of the rounds, ``peak``
the peak's range. The step's FLOPs count the base weights' forward (2 per weight per
token) and backward to the activations (2 more; the base is frozen, so no weight
gradients), as the peak's do; the adapters' products (~11% more at rank 32) and the
attention's (~2.5% at 128 tokens) are work done but not counted.

The first step is a user's first call after ``create_lora_training_client`` on a new
server: a fresh process loads the model, creates an adapter, then times its first step
and 5 more; the median over 3 processes of first / the median warm step (target <= 1.5).

Run: .venv/bin/python benchmarks/train_step.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
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


def peft_step(dtype: torch.dtype, seqs: list[list[int]], fp32_adapters: bool = True):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bundled_folder(), dtype=dtype)
    model = get_peft_model(model, PeftLoraConfig(r=32, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS),
                           autocast_adapter_dtype=fp32_adapters)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0,
                            foreach=True)
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


def first_and_warm_steps(dtype_name: str, warm_steps: int = 5) -> None:
    """In this (fresh) process: load the model, create an adapter, time its first step and
    ``warm_steps`` more; print them as JSON for the parent."""
    host = ModelHost(DEFAULT_MODEL, dtype=getattr(torch, dtype_name))
    host.create_adapter("first", LoraConfig(rank=32, train_unembed=False))
    step = ours_step(host, batches(host.vocab_size)["dense"], "first")
    times = []
    for _ in range(1 + warm_steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(json.dumps({"first": times[0], "warm": statistics.median(times[1:])}))


def first_step(dtype_name: str, processes: int = 3) -> None:
    """The first step on a new server against its warm steps, over ``processes`` fresh ones."""
    runs = []
    for _ in range(processes):
        out = subprocess.run([sys.executable, __file__, "--first-step-child", dtype_name], check=True,
                             capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    ratios = [run["first"] / run["warm"] for run in runs]
    result(f"train_{dtype_name}_first_step", statistics.median(r["first"] for r in runs),
           statistics.median(r["warm"] for r in runs), " (seconds: first step / a warm step, lower is better)",
           (min(ratios), max(ratios)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--first-step-child", metavar="DTYPE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.first_step_child:
        first_and_warm_steps(args.first_step_child)
        return
    dtypes = args.dtypes.split(",")
    # before this process holds any model: the memory it keeps would slow the new ones'
    # page faults (a bf16 first step read 1.6 of a warm one after the comparisons, 1.2 before)
    for dtype_name in dtypes:
        first_step(dtype_name)
    for dtype_name in dtypes:
        host = ModelHost(DEFAULT_MODEL, dtype=getattr(torch, dtype_name))
        host.create_adapter("bench", LoraConfig(rank=32, train_unembed=False))
        for shape, seqs in batches(host.vocab_size).items():
            compare(host, dtype_name, shape, seqs, args.repeats)
        del host


def compare(host: ModelHost, dtype_name: str, shape: str, seqs: list[list[int]], repeats: int) -> None:
    """Ours, peft (and, in bf16, peft with bf16 adapters) and the matmul peak, interleaved."""
    dtype = getattr(torch, dtype_name)
    tokens = sum(len(s) - 1 for s in seqs)
    peak_fn, peak_flops = model_matmuls(host.model, tokens, dtype)
    sides = {"ours": ours_step(host, seqs), "baseline": peft_step(dtype, seqs)}
    if dtype == torch.bfloat16:
        sides["bf16_adapters"] = peft_step(dtype, seqs, fp32_adapters=False)
    timings = timed_interleaved({**sides, "peak": peak_fn}, repeats)
    name = f"train_{dtype_name}_{shape}"
    for side in [side for side in sides if side != "ours"]:
        suffix = "" if side == "baseline" else f"_vs_{side}"
        result(name + suffix, tokens / timings["ours"], tokens / timings[side], " (tokens/s)",
               timings.spread("ours", side))
    step_flops = 4 * matmul_params(host) * tokens
    peaks = [peak_flops / t for t in timings.rounds["peak"]]
    fractions = [step_flops / t / peak for t, peak in zip(timings.rounds["ours"], peaks, strict=True)]
    peak = peak_flops / timings["peak"]
    # the baseline's useful FLOP/s (its padding not counted): how far from the peak a step
    # of the same numerics already was, hence what ratio the peak leaves room for
    print(f"FLOPS {name} ours={step_flops / timings['ours'] / 1e9:.1f}GFLOP/s "
          f"fraction_of_peak={step_flops / timings['ours'] / peak:.3f} "
          f"spread={min(fractions):.3f}-{max(fractions):.3f} "
          f"peak={peak / 1e9:.1f}GFLOP/s ({min(peaks) / 1e9:.0f}-{max(peaks) / 1e9:.0f}) "
          f"baseline_fraction={step_flops / timings['baseline'] / peak:.3f}", flush=True)


if __name__ == "__main__":
    main()
