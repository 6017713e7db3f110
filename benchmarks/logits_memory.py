"""Peak memory of one training step's unembedding: chunked log-softmax vs the whole (N, V).

The host computes target logprobs over chunks of rows (``host.LOGIT_CHUNK_ELEMENTS`` fp32
logits each, checkpointed so the backward recomputes them chunk by chunk) instead of
materialising the (tokens x vocab) fp32 logits of a micro-batch at once. This runs the
same forward_backward step (16 x 2048 tokens, a rank-8 LoRA on every layer including
lm_head, the default 4096-token micro-batches) in two fresh processes, one after the
other: ours (chunked), and the baseline with the chunk size set above N (one chunk of a
micro-batch's whole logits: the former code path). Each child resets the kernel's
resident-memory high-water mark after loading (Linux /proc/self/clear_refs) and a small
warm-up step, and reports the step's peak RSS above its RSS before the step.

``--model tiny`` (the default) is a random Llama (hidden 64, 2 layers) with SmolLM2's 49k
vocabulary and a 4k context: the logits are nearly all of its step's memory, as for long
sequences on large models, and the step runs in minutes. ``--model bundled`` is SmolLM2-135M
itself, whose 30 layers' activations weigh against the logits (``make bench`` runs it on 4
rows: the peak is one 4096-token micro-batch's, whatever the number of rows).

    RESULT chunked_logits_peak[_bundled] ours=<MB> baseline=<MB> ratio=<ours/baseline, lower is better>

Run: .venv/bin/python benchmarks/logits_memory.py [--rows 16 --seq 2048 --model tiny]
"""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import sys
import time
from pathlib import Path

from common import result

from trio_engine import DEFAULT_MODEL, Example, ForwardJob, LoraConfig, ModelHost
from trio_engine import host as host_module
from trio_engine.catalog import BUILTIN_SOURCES, Catalog, _tiny

BENCH_MODEL = "bench/tiny-llama-4k"


def status_kb(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert match, field
    return int(match.group(1))


def child(mode: str, rows: int, seq: int, model: str) -> None:
    if model == "bundled":
        host = ModelHost(DEFAULT_MODEL, dtype="float32", device="cpu")
    else:
        source = _tiny(BENCH_MODEL, "llama", tokenizer="smollm2", max_position_embeddings=2 * seq)
        host = ModelHost(BENCH_MODEL, dtype="float32", device="cpu",
                         catalog=Catalog({**BUILTIN_SOURCES, BENCH_MODEL: source}))
    if mode == "naive":
        host_module.LOGIT_CHUNK_ELEMENTS = 10**15  # one chunk: the whole (N, V) logits
    host.create_adapter("bench", LoraConfig(rank=8))
    rng = random.Random(0)
    data = []
    for _ in range(rows):
        tokens = [rng.randrange(host.vocab_size) for _ in range(seq + 1)]
        data.append(Example(tokens[:-1], {"target_tokens": tokens[1:]}))
    # warm-up: the first backward's one-off allocations (thread pools, autograd) are no logits
    host.forward_backward([ForwardJob("bench", [Example(data[0].tokens[:8], {"target_tokens": data[0].inputs["target_tokens"][:8]})])])
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = status_kb("VmRSS")
    start = time.perf_counter()
    host.forward_backward([ForwardJob("bench", data)])
    seconds = time.perf_counter() - start
    peak = status_kb("VmHWM") - before
    print(f"PEAK_MB {peak / 1024:.1f} SECONDS {seconds:.1f} CHUNK_ROWS {host.logit_chunk_rows()} "
          f"VOCAB {host.vocab_size}", flush=True)


def run_children(rows: int, seq: int, model: str) -> dict[str, tuple[float, str]]:
    """The two children one after the other (the bundled model's naive step needs ~8 GB);
    stderr passes through."""
    lines = {}
    for mode in ("chunked", "naive"):
        proc = subprocess.run([sys.executable, __file__, "--child", mode, "--rows", str(rows), "--seq", str(seq),
                               "--model", model], stdout=subprocess.PIPE, text=True)
        if proc.returncode:
            raise SystemExit(f"the {mode} child failed (exit {proc.returncode})")
        line = next(line for line in proc.stdout.splitlines() if line.startswith("PEAK_MB"))
        lines[mode] = (float(line.split()[1]), line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--model", choices=["tiny", "bundled"], default="tiny")
    parser.add_argument("--child", choices=["chunked", "naive"])
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rows, args.seq, args.model)
        return
    runs = run_children(args.rows, args.seq, args.model)
    (ours, ours_line), (base, base_line) = runs["chunked"], runs["naive"]
    print(f"{args.model} model, {args.rows}x{args.seq} step, chunked: {ours_line}; naive: {base_line}")
    name = "chunked_logits_peak" + ("_bundled" if args.model == "bundled" else "")
    result(name, ours, base, unit=" (MB above pre-step RSS; lower is better)")


if __name__ == "__main__":
    main()
