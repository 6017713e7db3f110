"""What run snapshots cost a training step: with snapshots ÷ without, same process.

Two embedded services on the bundled SmolLM2-135M (fp32, rank 32, all block linears),
identical but for ``EngineSettings.snapshots``. Each measured step is
``forward_backward`` (8 x 128 tokens) + ``optim_step`` through the SDK, the step's result
awaited before the next, as a plain training loop does. The snapshot is written before
``optim_step`` is answered (no answered step can be lost), so its write is inside the
step's time. Steps run in blocks of ``--block`` per service, alternating (ABAB...);
medians over ``--repeats`` blocks.

    RESULT snapshot_train_step_8x128 ours=<steps/s with> baseline=<steps/s without> ratio=...
    SNAPSHOT bytes=<file size> write_ms=<median time of one snapshot write, measured alone>

Target: ratio >= 0.95.
Run: .venv/bin/python benchmarks/snapshot.py [--repeats 5] [--block 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import result, timed_pair

import pytrio as trio
from pytrio.transport.local import LocalTransport
from trio_engine import DEFAULT_MODEL, snapshot
from trio_server.core import ServiceCore
from trio_server.engine import snapshot_path


def dense_batch(vocab: int = 49152) -> list[trio.Datum]:
    rng = random.Random(0)
    seqs = [[rng.randrange(vocab) for _ in range(129)] for _ in range(8)]
    return [trio.Datum(model_input=trio.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
            for s in seqs]


def service(folder: Path, snapshots: bool) -> tuple[ServiceCore, trio.TrainingClient]:
    core = ServiceCore(folder, dtype="float32")
    core.engine_settings = dataclasses.replace(core.engine_settings, snapshots=snapshots)
    tc = trio.ServiceClient(transport=LocalTransport(core)).create_lora_training_client(
        base_model=DEFAULT_MODEL, rank=32, seed=0)
    return core, tc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block", type=int, default=3)
    args = parser.parse_args()
    data = dense_batch()
    with tempfile.TemporaryDirectory() as tmp:
        (with_core, with_tc), (_, without_tc) = (service(Path(tmp) / name, on) for name, on in
                                                  (("with", True), ("without", False)))

        engine = with_core.workers[DEFAULT_MODEL].engine

        def block(tc, flush):
            def run():
                for _ in range(args.block):
                    fb = tc.forward_backward(data)
                    tc.optim_step(trio.AdamParams(learning_rate=1e-5)).result()
                    fb.result()
                flush()
            return run

        ours, base = timed_pair(block(with_tc, engine.flush), block(without_tc, lambda: None), repeats=args.repeats)
        result("snapshot_train_step_8x128", args.block / ours, args.block / base, unit=" (steps/s)")

        path = snapshot_path(with_core.engine_settings.snapshot_dir, with_tc.model_id)
        writes = []
        for _ in range(5):
            start = time.perf_counter()
            snapshot.write(path, snapshot.capture(engine.host, with_tc.model_id))
            writes.append(time.perf_counter() - start)
        print(f"SNAPSHOT bytes={path.stat().st_size} write_ms={statistics.median(writes) * 1000:.0f}", flush=True)


if __name__ == "__main__":
    main()
