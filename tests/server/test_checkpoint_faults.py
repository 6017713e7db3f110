"""A checkpoint write that fails (disk full, read-only disk) is a clear server error, and the
previous checkpoint of that name stays intact: its folder, its record, and what loads from it.

The faults are injected, not produced: the tests run as root, whom a read-only folder
(chmod) does not stop, and filling a real disk is not something a test should do. The OS
errors are raised where a real disk would raise them: ENOSPC part-way through writing the
files (after one was written), EROFS at the first file.
"""

from __future__ import annotations

import errno
import os

import pytest

import pytrio as trio
from pytrio.transport.local import LOCAL_USER, LocalTransport
from trio_engine import checkpoint as engine_checkpoint
from trio_server.core import ServiceCore

MODEL = "trio/tiny-llama"
TOKENS = [1, 5, 9, 200, 31, 7, 7, 300]


def datum() -> trio.Datum:
    return trio.Datum(model_input=trio.ModelInput.from_ints(TOKENS[:-1]),
                      loss_fn_inputs={"target_tokens": TOKENS[1:]})


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    core = ServiceCore(tmp_path_factory.mktemp("ckpt-faults"), dtype="float32")
    yield core
    core.close()


@pytest.fixture
def svc(core):
    return trio.ServiceClient(transport=LocalTransport(core))


def train_step(tc) -> None:
    tc.forward_backward([datum()], "cross_entropy").result(timeout=120)
    tc.optim_step(trio.AdamParams(learning_rate=5e-2)).result(timeout=120)


def logprobs(tc) -> list[float]:
    return tc.forward([datum()]).result(timeout=120).loss_fn_outputs[0]["logprobs"].tolist()


def failing_save_file(monkeypatch, code: int, after: int) -> None:
    """``save_file`` in the checkpoint module writes ``after`` files, then fails with ``code``
    as safetensors does: its own error type (not an OSError), the OS error in its text."""
    from safetensors import SafetensorError

    real, calls = engine_checkpoint.save_file, {"n": 0}

    def save_file(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > after:
            raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_checkpoint, "save_file", save_file)


def folder_files(core, path: str) -> dict[str, bytes]:
    run, kind, name = path[len("trio://"):].split("/")
    folder = core.checkpoint_dir(run, kind, name)
    assert sorted(p.name for p in folder.parent.iterdir()) == [name]  # no temporary debris beside it
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_disk_full_while_overwriting_a_training_state_keeps_the_old_one(core, svc, monkeypatch):
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2, seed=1)
    train_step(tc)
    path = tc.save_state("ckpt").result(timeout=120).path
    saved = logprobs(tc)
    files, record = folder_files(core, path), core.checkpoint_row(LOCAL_USER, path)
    train_step(tc)
    assert logprobs(tc) != saved  # the overwrite would change what the name holds

    failing_save_file(monkeypatch, errno.ENOSPC, after=1)  # adapter written, optimizer state not
    with pytest.raises(trio.ServerError) as info:
        tc.save_state("ckpt", overwrite=True).result(timeout=120)
    monkeypatch.undo()
    assert info.value.status_code == 500 and info.value.category == "server"
    assert path in info.value.message and "No space left on device (ENOSPC)" in info.value.message
    assert "unchanged" in info.value.message

    assert folder_files(core, path) == files and core.checkpoint_row(LOCAL_USER, path) == record
    resumed = svc.create_training_client_from_state_with_optimizer(path)
    assert logprobs(resumed) == saved
    train_step(tc)  # the run itself carries on
    assert tc.save_state("ckpt", overwrite=True).result(timeout=120).path == path


def test_read_only_disk_while_overwriting_sampler_weights_keeps_the_old_ones(core, svc, monkeypatch):
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2, seed=2)
    train_step(tc)
    path = tc.save_weights_for_sampler("s").result(timeout=120).path
    prompt = trio.ModelInput.from_ints(TOKENS)
    saved = svc.create_sampling_client(model_path=path).compute_logprobs(prompt).result(timeout=120)
    files = folder_files(core, path)
    train_step(tc)

    failing_save_file(monkeypatch, errno.EROFS, after=0)
    with pytest.raises(trio.ServerError, match=r"Read-only file system \(EROFS\)") as info:
        tc.save_weights_for_sampler("s", overwrite=True).result(timeout=120)
    monkeypatch.undo()
    assert path in info.value.message

    assert folder_files(core, path) == files
    assert svc.create_sampling_client(model_path=path).compute_logprobs(prompt).result(timeout=120) == saved
