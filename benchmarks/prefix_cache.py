"""Prefix cache: prefill of an 8-turn conversation where each turn extends the last.

Each turn's prompt is the previous prompt + the tokens sampled for it + a new user
message (~40 tokens); each turn samples 24 tokens. The conversation is played twice per
repeat on the same host: with the prefix cache (``ours``: each turn prefills only what
the last turn did not compute) and without it (``baseline``: a DecodeBatch with no
cache prefills the whole prompt). Only the prefill (``ModelHost.admit``) is timed, summed
over the 8 turns; both plays sample the same tokens (seeded). ``--context N`` opens the
conversation with N tokens more (an agent's long instructions: the copies of reused KV
then show).

    RESULT prefix_cache_prefill ours=<prompt tokens/s> baseline=<prompt tokens/s> ratio=...

Run: .venv/bin/python benchmarks/prefix_cache.py [--model trio/tiny-llama] [--repeats 5] [--threads 1] [--context 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import result

from trio_engine import DEFAULT_MODEL, DecodeBatch, ModelHost, SampleRequest, SamplingConfig
from trio_engine.sampler import PrefixCache

TURNS = 8
USER = "User: here is one more question about the same topic, please answer it briefly and clearly.\nAssistant:"


def play(host: ModelHost, cache: PrefixCache | None, user: list[int], opening: list[int]) -> tuple[float, int, int]:
    """(seconds spent prefilling, prompt tokens, prompt tokens reused) over one conversation."""
    prompt = list(opening)
    spent, tokens, reused = 0.0, 0, 0
    for turn in range(TURNS):
        prompt = prompt + user
        req = SampleRequest(None, prompt, 1, SamplingConfig(max_tokens=24, seed=turn, ignore_eos=True))
        batch = DecodeBatch(host, cache)
        start = time.perf_counter()
        with torch.no_grad():
            host.admit(batch, [req], ["turn"])
            spent += time.perf_counter() - start
            done = {}
            while len(batch):
                done.update(host.decode_step(batch))
        out = done["turn"]
        tokens += len(prompt)
        reused += out.cached_prompt_tokens
        prompt = prompt + out.sequences[0].tokens
    return spent, tokens, reused


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--context", type=int, default=0, help="tokens before the first turn")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    host = ModelHost(args.model, dtype=args.dtype)
    user = host.tokenizer.encode(USER)
    opening = (user * (args.context // len(user) + 1))[:args.context]
    play(host, None, user, opening)  # warm-up
    ours, base = [], []
    for _ in range(args.repeats):
        spent, tokens, reused = play(host, PrefixCache(), user, opening)  # a fresh cache: nothing from the last repeat
        ours.append(tokens / spent)
        spent, tokens, _ = play(host, None, user, opening)
        base.append(tokens / spent)
    print(f"# {args.model} {args.dtype}: {TURNS} turns, {tokens} prompt tokens in all, {reused} reused from the cache")
    name = f"prefix_cache_prefill_context{args.context}" if args.context else "prefix_cache_prefill"
    ratios = [o / b for o, b in zip(ours, base, strict=True)]
    result(name, statistics.median(ours), statistics.median(base), " (prompt tokens/s)", (min(ratios), max(ratios)))


if __name__ == "__main__":
    main()
