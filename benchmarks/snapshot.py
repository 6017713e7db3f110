"""What run snapshots cost a training step: with snapshots ÷ without, same process.

Two embedded services on the bundled SmolLM2-135M (fp32, rank 32, all block linears),
identical but for ``EngineSettings.snapshots``. Each measured step is
``forward_backward`` (8 x 128 tokens) + ``optim_step`` through the SDK, the step's result
awaited before the next, as a plain training loop does. The snapshot is on disk before
``optim_step`` is answered (no answered step can be lost), so with one user its write is
inside the step's time; with two users on one base model the worker runs one user's
work while the other's step is written (``worker.Answers``). The 1 x 64 steps are short
beside the write (as a GPU's steps are beside a large model's snapshot), which is where
holding up the worker would show. Steps run in blocks of ``--block`` per service (per
user), alternating (ABAB...); medians over ``--repeats`` blocks.

    RESULT snapshot_train_step_8x128 ours=<steps/s with> baseline=<steps/s without> ratio=...
    RESULT snapshot_two_users_8x128 ours=<steps/s with> baseline=<steps/s without> ratio=...
    RESULT snapshot_two_users_1x64 ours=<steps/s with> baseline=<steps/s without> ratio=...
    SNAPSHOT bytes=<file size> write_ms=<median time of one snapshot write, measured alone>

Target: ratio >= 0.95 for each.
Run: .venv/bin/python benchmarks/snapshot.py [--repeats 5] [--block 3] [--only NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from common import result, timed_pair

import pytrio as trio
from pytrio.transport.local import LocalTransport
from trio_engine import DEFAULT_MODEL, snapshot
from trio_server.core import ServiceCore
from trio_server.engine import snapshot_path


def dense_batch(rows: int, tokens: int, vocab: int = 49152) -> list[trio.Datum]:
    rng = random.Random(0)
    seqs = [[rng.randrange(vocab) for _ in range(tokens + 1)] for _ in range(rows)]
    return [trio.Datum(model_input=trio.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
            for s in seqs]


def service(folder: Path, snapshots: bool) -> tuple[ServiceCore, list[trio.TrainingClient]]:
    """A service and two users' runs on it."""
    core = ServiceCore(folder, dtype="float32")
    core.engine_settings = dataclasses.replace(core.engine_settings, snapshots=snapshots)
    svc = trio.ServiceClient(transport=LocalTransport(core))
    return core, [svc.create_lora_training_client(base_model=DEFAULT_MODEL, rank=32, seed=k) for k in range(2)]


def steps(tc: trio.TrainingClient, data: list[trio.Datum], n: int) -> None:
    for _ in range(n):
        fb = tc.forward_backward(data)
        tc.optim_step(trio.AdamParams(learning_rate=1e-5)).result()
        fb.result()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--only", help="measure only this RESULT name")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (with_core, with_tcs), (_, without_tcs) = (service(Path(tmp) / name, on) for name, on in
                                                    (("with", True), ("without", False)))
        engine = with_core.workers[DEFAULT_MODEL].engine

        def block(tcs, data, flush):
            def run():
                users = [threading.Thread(target=steps, args=(tc, data, args.block)) for tc in tcs]
                for user in users:
                    user.start()
                for user in users:
                    user.join()
                flush()
            return run

        for name, users, (rows, tokens) in (("snapshot_train_step_8x128", 1, (8, 128)),
                                            ("snapshot_two_users_8x128", 2, (8, 128)),
                                            ("snapshot_two_users_1x64", 2, (1, 64))):
            if args.only and name != args.only:
                continue
            data = dense_batch(rows, tokens)
            timings = timed_pair(block(with_tcs[:users], data, engine.flush),
                                 block(without_tcs[:users], data, lambda: None), repeats=args.repeats)
            made = users * args.block
            result(name, made / timings["ours"], made / timings["baseline"], " (steps/s)", timings.spread())

        with_tc = with_tcs[0]
        path = snapshot_path(with_core.engine_settings.snapshot_dir, with_tc.model_id)
        writes = []
        for _ in range(5):
            start = time.perf_counter()
            snapshot.write(path, snapshot.capture(engine.host, with_tc.model_id))
            writes.append(time.perf_counter() - start)
        print(f"SNAPSHOT bytes={path.stat().st_size} write_ms={statistics.median(writes) * 1000:.0f}", flush=True)


if __name__ == "__main__":
    main()
