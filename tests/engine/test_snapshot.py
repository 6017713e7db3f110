"""Run snapshots: a complete, atomic copy of an adapter's training state."""

from __future__ import annotations

import errno
import json
import os
import random
import struct

import pytest
import torch

from trio_engine import AdamConfig, ForwardJob, LoraConfig, snapshot

from .helpers import random_example

CFG = AdamConfig(learning_rate=1e-2, weight_decay=0.01)


def data(host, seed=0):
    rng = random.Random(seed)
    return [random_example(host.vocab_size, n, rng) for n in (5, 9)]


def trained(host, aid, steps=2, pending=True):
    host.create_adapter(aid, LoraConfig(rank=4, seed=11))
    for k in range(steps):
        host.forward_backward([ForwardJob(aid, data(host, k))])
        host.optim_step(aid, CFG)
    if pending:
        host.forward_backward([ForwardJob(aid, data(host, 9))])


def state(host, aid):
    params = host.adapter_params(aid)
    optim = host.adapters[aid].optim
    return ({k: p.detach().clone() for k, p in params.items()},
            {k: None if p.grad is None else p.grad.clone() for k, p in params.items()},
            optim.step, {k: v.clone() for k, v in optim.exp_avg.items()},
            {k: v.clone() for k, v in optim.exp_avg_sq.items()})


def assert_same_state(a, b):
    for x, y in zip(a, b):
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                assert (x[k] is None) == (y[k] is None), k
                if x[k] is not None:
                    assert torch.equal(x[k], y[k]), k
        else:
            assert x == y


def test_restore_gives_back_exactly_the_captured_state_and_training_continues_alike(tiny_host, new_id, tmp_path):
    original, copy = new_id(), new_id()
    trained(tiny_host, original)
    path = tmp_path / "run.safetensors"
    snapshot.write(path, snapshot.capture(tiny_host, original, with_grads=True))
    snapshot.restore(tiny_host, copy, snapshot.read(path))
    assert tiny_host.adapters[copy].optim.step == 2
    assert_same_state(state(tiny_host, original), state(tiny_host, copy))
    restored = tiny_host.adapters[copy].optim  # each moment one buffer again, as when trained
    assert all(len({t.untyped_storage().data_ptr() for t in m.values()}) == 1 for m in (restored.exp_avg, restored.exp_avg_sq))
    for aid in (original, copy):  # the pending grads and moments are used identically
        tiny_host.optim_step(aid, CFG)
    assert_same_state(state(tiny_host, original), state(tiny_host, copy))


def test_without_grads_the_restored_run_has_none_pending(tiny_host, new_id, tmp_path):
    original, copy = new_id(), new_id()
    trained(tiny_host, original)
    path = tmp_path / "run.safetensors"
    snapshot.write(path, snapshot.capture(tiny_host, original))
    snapshot.restore(tiny_host, copy, snapshot.read(path))
    assert all(p.grad is None for p in tiny_host.adapter_params(copy).values())
    weights = state(tiny_host, original)[0]
    assert all(torch.equal(weights[k], p) for k, p in tiny_host.adapter_params(copy).items())


def test_a_failed_write_leaves_the_previous_snapshot_whole(tiny_host, new_id, tmp_path, monkeypatch):
    aid = new_id()
    trained(tiny_host, aid, steps=1, pending=False)
    path = tmp_path / "run.safetensors"
    snapshot.write(path, snapshot.capture(tiny_host, aid))
    tiny_host.forward_backward([ForwardJob(aid, data(tiny_host, 5))])
    tiny_host.optim_step(aid, CFG)

    def disk_full(fd, data):
        os.write(fd, bytes(data[:4096]))  # half a file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snapshot, "write_all", disk_full)
    with pytest.raises(OSError, match="No space"):
        snapshot.write(path, snapshot.capture(tiny_host, aid))
    assert snapshot.read(path).step == 1  # the old one, readable
    assert [p.name for p in tmp_path.iterdir()] == ["run.safetensors"]  # no temporary left


def test_a_write_is_on_disk_rename_included_before_it_returns(tiny_host, new_id, tmp_path, monkeypatch):
    """The file is fsynced, then renamed into place, then its folder fsynced: without the
    last, a power loss after the step's answer could undo the rename (the step lost)."""
    aid = new_id()
    trained(tiny_host, aid, steps=1, pending=False)
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    path = tmp_path / "run.safetensors"
    snapshot.write(path, snapshot.capture(tiny_host, aid))
    assert synced[-1] == str(tmp_path) and synced[-2].endswith(".tmp")  # the file, then after the rename its folder
    assert snapshot.read(path).step == 1


def test_a_snapshot_of_another_base_model_is_refused(tiny_host, qwen_host, new_id, tmp_path):
    aid = new_id()
    trained(tiny_host, aid, steps=1, pending=False)
    path = tmp_path / "run.safetensors"
    snapshot.write(path, snapshot.capture(tiny_host, aid))
    with pytest.raises(ValueError, match="base model"):
        snapshot.restore(qwen_host, aid, snapshot.read(path))


def odd_sized_state() -> snapshot.Snapshot:
    """Tensors of two dtypes and sizes that are no multiple of anything, names interleaved."""
    gen = torch.Generator().manual_seed(3)
    tensors = {"adapter.a": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
               "adapter.b": torch.randn(7, 3, generator=gen),
               "exp_avg.a": torch.randn(1, generator=gen).to(torch.bfloat16),
               "exp_avg.b": torch.randn(1000, 333, generator=gen).t()}  # not contiguous
    return snapshot.Snapshot(LoraConfig(rank=3), 7, "trio/tiny-llama", tensors)


def test_the_file_is_plain_safetensors_with_each_tensor_aligned_and_no_padding(tmp_path):
    """Read back by safetensors itself, not by our reader: every tensor bit for bit, the
    metadata, the data after an 8-byte aligned header, each tensor at a multiple of its
    element size, and the file exactly as long as its data (the direct write's last
    block trimmed)."""
    from safetensors import safe_open

    snap = odd_sized_state()
    path = tmp_path / "run.safetensors"
    snapshot.write(path, snap)
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(snap.tensors)
        for name, tensor in snap.tensors.items():
            assert torch.equal(f.get_tensor(name), tensor), name
        assert f.metadata()["step"] == "7" and f.metadata()["base_model"] == "trio/tiny-llama"
    raw = path.read_bytes()
    (header_length,) = struct.unpack("<Q", raw[:8])
    assert (8 + header_length) % 8 == 0
    header = json.loads(raw[8 : 8 + header_length])
    ends = [header[name]["data_offsets"] for name in snap.tensors]
    assert all(start % snap.tensors[name].element_size() == 0 for name, (start, _) in zip(snap.tensors, ends))
    assert len(raw) == 8 + header_length + max(end for _, end in ends)
    assert snapshot.read(path).step == 7


def test_a_file_system_without_direct_io_gets_the_same_file_through_the_page_cache(tmp_path, monkeypatch):
    tries = []
    real = snapshot._written

    def no_direct_io(path, image, direct):
        tries.append(bool(direct))
        if direct:
            raise OSError(errno.EINVAL, "Invalid argument")  # what tmpfs answers
        return real(path, image, direct)

    monkeypatch.setattr(snapshot, "_written", no_direct_io)
    snap = odd_sized_state()
    snapshot.write(tmp_path / "run.safetensors", snap)
    assert tries == ([True, False] if getattr(os, "O_DIRECT", 0) else [False])
    back = snapshot.read(tmp_path / "run.safetensors")
    assert all(torch.equal(back.tensors[k], v) for k, v in snap.tensors.items())


def test_a_capture_is_a_copy_the_next_step_does_not_change(tiny_host, new_id, tmp_path):
    """The captured tensors are views of the file's bytes, copied under the lock: a step
    taken after the capture is not in the file."""
    aid = new_id()
    trained(tiny_host, aid, steps=1)
    captured = snapshot.capture(tiny_host, aid)
    before = state(tiny_host, aid)
    tiny_host.optim_step(aid, CFG)
    snapshot.write(tmp_path / "run.safetensors", captured)
    back = snapshot.read(tmp_path / "run.safetensors")
    assert back.step == 1
    assert all(torch.equal(back.tensors[f"adapter.{k}"], v) for k, v in before[0].items())
    assert not all(torch.equal(back.tensors[f"adapter.{k}"], p) for k, p in tiny_host.adapter_params(aid).items())


def test_the_padding_written_with_the_last_block_holds_no_stale_memory(monkeypatch):
    """Direct I/O writes the last block whole before trimming it: its padding is zeros,
    not whatever the allocator's memory held (here: all ones)."""
    full = torch.full
    monkeypatch.setattr(snapshot.torch, "empty", lambda n, dtype: full((n,), 255, dtype=dtype))
    image = snapshot.laid_out(odd_sized_state()).image
    assert image is not None and image.size % snapshot.DIRECT_IO_BLOCK  # a padded last block
    assert not image.buffer[image.size :].any()
