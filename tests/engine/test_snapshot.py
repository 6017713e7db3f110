"""Run snapshots: a complete, atomic copy of an adapter's training state."""

from __future__ import annotations

import errno
import random

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

    def disk_full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snapshot, "save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        snapshot.write(path, snapshot.capture(tiny_host, aid))
    assert snapshot.read(path).step == 1  # the old one, readable
    assert [p.name for p in tmp_path.iterdir()] == ["run.safetensors"]  # no temporary left


def test_a_snapshot_of_another_base_model_is_refused(tiny_host, qwen_host, new_id, tmp_path):
    aid = new_id()
    trained(tiny_host, aid, steps=1, pending=False)
    path = tmp_path / "run.safetensors"
    snapshot.write(path, snapshot.capture(tiny_host, aid))
    with pytest.raises(ValueError, match="base model"):
        snapshot.restore(qwen_host, aid, snapshot.read(path))
