"""Checkpoints: resume equals straight training; peft loads our sampler weights."""

import random

import pytest
import torch

from trio_engine import AdamConfig, ForwardJob, LoraConfig, ModelHost

from .helpers import plain_model, random_example, randomize_adapter, saved_random_adapter

CFG = AdamConfig(learning_rate=1e-2, weight_decay=0.01)


def _train(host, aid, data, steps):
    for _ in range(steps):
        host.forward_backward([ForwardJob(aid, data)])
        host.optim_step(aid, CFG)


def test_resume_equals_straight_training(tiny_host, new_id, tmp_path):
    data = [random_example(tiny_host.vocab_size, n, random.Random(n)) for n in (5, 9)]
    straight, resumed = new_id(), new_id()
    for aid in (straight, resumed):
        tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=9))
    _train(tiny_host, straight, data, 5)
    _train(tiny_host, resumed, data, 3)
    tiny_host.save_state(resumed, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "adapter.safetensors", "optimizer.safetensors", "trio_state.json"]

    fresh = ModelHost("trio/tiny-llama", dtype="float32")  # a fresh engine
    fresh.load_state("restored", str(tmp_path / "ckpt"), with_optimizer=True)
    _train(fresh, "restored", data, 2)
    for k, p in tiny_host.adapter_params(straight).items():
        torch.testing.assert_close(fresh.adapter_params("restored")[k], p, atol=1e-6, rtol=1e-5)


def test_load_without_optimizer_resets_moments(tiny_host, new_id, tmp_path):
    """Weights only: no step, no moments, and the next step is torch's first AdamW step."""
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=2))
    data = [random_example(tiny_host.vocab_size, 4, random.Random(0))]
    _train(tiny_host, aid, data, 2)
    moments = tiny_host.adapters[aid].optim
    assert moments.step == 2 and any(v.abs().sum() > 0 for v in moments.exp_avg.values())
    tiny_host.save_state(aid, tmp_path)
    saved = {k: p.detach().clone() for k, p in tiny_host.adapter_params(aid).items()}
    _train(tiny_host, aid, data, 1)  # the run moves past the checkpoint

    # into a new adapter, and into the trained one (its moments must not survive)
    for target in (aid + "-w", aid):
        tiny_host.load_state(target, str(tmp_path), with_optimizer=False)
        optim = tiny_host.adapters[target].optim
        assert optim.step == 0
        assert all(not v.any() for v in (*optim.exp_avg.values(), *optim.exp_avg_sq.values()))
        params = tiny_host.adapter_params(target)
        assert params.keys() == saved.keys()
        assert all(torch.equal(params[k], saved[k]) for k in saved)

        ref = {k: v.clone().requires_grad_(True) for k, v in saved.items()}
        torch_adamw = torch.optim.AdamW(list(ref.values()), lr=CFG.learning_rate, betas=(CFG.beta1, CFG.beta2),
                                        eps=CFG.eps, weight_decay=CFG.weight_decay)
        tiny_host.forward_backward([ForwardJob(target, data)])
        for k, p in params.items():
            ref[k].grad = None if p.grad is None else p.grad.clone()
        assert any(g.grad is not None and g.grad.abs().sum() > 0 for g in ref.values())
        metrics = tiny_host.optim_step(target, CFG)
        torch_adamw.step()
        assert metrics["step"] == 1.0
        for k, p in tiny_host.adapter_params(target).items():
            torch.testing.assert_close(p, ref[k].detach(), atol=1e-6, rtol=1e-5)


def test_peft_loads_our_sampler_weights(family_host, new_id, tmp_path):
    """Every family: peft, given our sampler weights, computes our logprobs; and our
    loader reads the folder back to the same tensors (Phi-3's fused names included)."""
    peft = pytest.importorskip("peft")
    host = family_host
    aid = saved_random_adapter(host, new_id, tmp_path, seed=2, b_seed=8)
    ex = random_example(host.vocab_size, 12, random.Random(4))
    ours = host.forward([ForwardJob(aid, [ex])])[0].logprobs[0]

    model = peft.PeftModel.from_pretrained(plain_model(host.model_name), str(tmp_path))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ex.tokens])).logits[0].float()
        base = plain_model(host.model_name)(input_ids=torch.tensor([ex.tokens])).logits[0]
    theirs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ex.inputs["target_tokens"])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(ours), theirs, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits, base, atol=1e-3)  # the adapter really was applied
    lora_layers = {name for name, _ in model.named_modules() if name.endswith(".lora_A")}
    assert len(lora_layers) == len(host.adapter_params(aid)) // 2  # peft adapted every layer we did

    host.load_sampler_weights(aid + "-back", str(tmp_path))
    back = host.adapter_params(aid + "-back")
    assert back.keys() == host.adapter_params(aid).keys()
    assert all(torch.equal(back[k], p) for k, p in host.adapter_params(aid).items())
    for a in (aid, aid + "-back"):
        host.delete_adapter(a)


def test_sampler_weights_round_trip(tiny_host, new_id, tmp_path):
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=3, train_mlp=False))
    randomize_adapter(tiny_host, aid, seed=1)
    tiny_host.save_sampler_weights(aid, tmp_path)
    tiny_host.load_sampler_weights(aid + "-s", str(tmp_path))
    for k, p in tiny_host.adapter_params(aid).items():
        assert torch.equal(tiny_host.adapter_params(aid + "-s")[k], p)


# -- atomic folder writes: a failed write leaves the previous checkpoint as it was ------------

def _tree(folder):
    """{relative path: bytes} of every file under ``folder``."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _saved_checkpoint(tmp_path):
    from trio_engine.checkpoint import write_folder

    folder = tmp_path / "run" / "weights" / "ckpt"
    write_folder(folder, lambda tmp: [(tmp / n).write_text(n * 3) for n in ("a.safetensors", "meta.json")])
    return folder, _tree(folder)


def test_a_disk_full_mid_write_keeps_the_old_folder_and_leaves_no_debris(tmp_path):
    import errno

    from trio_engine import CheckpointWriteError
    from trio_engine.checkpoint import write_folder

    folder, before = _saved_checkpoint(tmp_path)

    def fill_until_full(tmp):
        (tmp / "a.safetensors").write_text("new")  # half the files written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointWriteError, match=r"No space left on device \(ENOSPC\)") as info:
        write_folder(folder, fill_until_full)
    assert info.value.errno == errno.ENOSPC and "ckpt" in str(info.value)
    assert _tree(folder) == before
    assert sorted(p.name for p in folder.parent.iterdir()) == ["ckpt"]


def test_a_failed_rename_into_place_puts_the_old_folder_back(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    from trio_engine import CheckpointWriteError
    from trio_engine.checkpoint import write_folder

    folder, before = _saved_checkpoint(tmp_path)
    real_rename = Path.rename

    def rename(self, target):
        if ".tmp-" in self.name:  # the new folder cannot go in; the old one was already aside
            raise OSError(errno.EROFS, "Read-only file system")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(CheckpointWriteError, match="EROFS"):
        write_folder(folder, lambda tmp: (tmp / "a.safetensors").write_text("new"))
    assert _tree(folder) == before
    assert sorted(p.name for p in folder.parent.iterdir()) == ["ckpt"]


def test_an_overwrite_replaces_the_whole_folder(tmp_path):
    from trio_engine.checkpoint import write_folder

    folder, _ = _saved_checkpoint(tmp_path)
    write_folder(folder, lambda tmp: (tmp / "b.json").write_text("b"))
    assert _tree(folder) == {"b.json": b"b"}  # no file of the old one left behind
    assert sorted(p.name for p in folder.parent.iterdir()) == ["ckpt"]


def test_recover_folders_undoes_a_crash_between_the_two_renames(tmp_path):
    from trio_engine.checkpoint import recover_folders

    kind = tmp_path / "run-1" / "weights"
    (kind / ".lost.old-7-8").mkdir(parents=True)  # crashed after moving "lost" aside
    (kind / ".lost.old-7-8" / "a").write_text("old")
    (kind / "kept").mkdir()  # crashed after the new "kept" went in, before the old was removed
    (kind / "kept" / "a").write_text("new")
    (kind / ".kept.old-7-8").mkdir()
    (kind / ".half.tmp-7-8").mkdir()  # crashed while writing
    recover_folders(tmp_path)
    assert sorted(p.name for p in kind.iterdir()) == ["kept", "lost"]
    assert (kind / "lost" / "a").read_text() == "old" and (kind / "kept" / "a").read_text() == "new"
