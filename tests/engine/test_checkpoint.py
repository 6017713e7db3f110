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


# -- a checkpoint that cannot load changes nothing ---------------------------------------------

def _edited(folder, file, edit):
    """Rewrite the safetensors ``file`` in ``folder`` as ``edit`` returns its tensors."""
    from safetensors.torch import load_file, save_file

    save_file(edit(load_file(folder / file)), folder / file)


def _another_layer(tensors):
    key = next(k for k in tensors if "layers.0." in k)
    return {**tensors, key.replace("layers.0.", "layers.99."): tensors[key].clone()}


def _one_wider(tensors):
    key = next(k for k in tensors if "layers.1." in k and "lora_B" in k)
    return {**tensors, key: torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])}


def _one_nan(tensors):
    key = sorted(tensors)[-1]
    poisoned = tensors[key].clone()
    poisoned.view(-1)[0] = float("nan")
    return {**tensors, key: poisoned}


def _one_missing(tensors):
    return dict(sorted(tensors.items())[1:])


BAD_WEIGHTS = {  # edit -> what the error says, in parts
    "another layer": (_another_layer, ("layers.99.", "in the checkpoint's weights is no tensor of this model's")),
    "another shape": (_one_wider, ("layers.1.", "has shape (65, 4), where this model's adapter has (64, 4)")),
    "not finite": (_one_nan, ("in the checkpoint's weights holds non-finite values",)),
}


def _damaged(folder, file, edit):
    """``edit`` applied to a checkpoint file: a JSON file's dict, a safetensors file's
    tensors, or (``edit`` None) the file cut short."""
    import json

    path = folder / file
    if edit is None:
        path.write_bytes(path.read_bytes()[:40])
    elif file.endswith(".json"):
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    else:
        _edited(folder, file, edit)


def _moments_edited(edit_one):
    """An edit of optimizer.safetensors applying ``edit_one(tensor)`` to its first second
    moment (None: drop it)."""
    def edit(moments):
        first = min(k for k in moments if k.startswith("exp_avg_sq."))
        edited = {k: v for k, v in moments.items() if k != first}
        if edit_one(moments[first]) is not None:
            edited[first] = edit_one(moments[first])
        return edited
    return edit


def _set(key, value):
    return lambda meta: {**meta, key: value}


DAMAGED_STATES = {  # case -> (file, edit, what the error says, in parts)
    **{case: ("adapter.safetensors", edit, says) for case, (edit, says) in BAD_WEIGHTS.items()},
    "one missing": ("adapter.safetensors", _one_missing, ("the checkpoint's weights lack 1 of the adapter's",)),
    "moments of another shape": ("optimizer.safetensors", _moments_edited(lambda v: torch.zeros(3, 3)),
                                 ("in the checkpoint's optimizer state has shape (3, 3)",)),
    "one moment without the other": ("optimizer.safetensors", _moments_edited(lambda v: None),
                                     ("optimizer state has one moment of", "but not the other")),
    "negative second moments": ("optimizer.safetensors", _moments_edited(lambda v: -1 - v),
                                ("negative second moments",)),
    "a step of -1": ("trio_state.json", _set("optimizer_step", -1), ("optimizer step is -1, not a count",)),
    "a step of true": ("trio_state.json", _set("optimizer_step", True), ("optimizer step is True, not a count",)),
    "a list for a state": ("trio_state.json", lambda meta: [meta], ("cannot be read (AttributeError",)),
    "no step": ("trio_state.json", lambda meta: {k: v for k, v in meta.items() if k != "optimizer_step"},
                ("cannot be read (KeyError",)),
    "an unknown config key": ("trio_state.json", lambda meta: {**meta, "lora_config": {
        **meta["lora_config"], "dropout": 0.1}}, ("cannot be read (TypeError",)),
    "a broken file": ("adapter.safetensors", None, ("cannot be read (SafetensorError",)),
}


@pytest.mark.parametrize("case", DAMAGED_STATES)
def test_a_training_state_that_does_not_fit_is_refused_before_the_adapter_changes(tiny_host, new_id, tmp_path, case):
    """Loading over an adapter replaces it; a checkpoint of another model, rank or targets,
    or a damaged one, used to fail part way (a KeyError or a size mismatch after the old
    adapter was deleted, a 500), or later (moments that fail the next step). Now it is
    refused first, by name, and the adapter stays as it was."""
    from trio_engine import InvalidInputError

    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=3))
    data = [random_example(tiny_host.vocab_size, 6, random.Random(1))]
    _train(tiny_host, aid, data, 1)
    tiny_host.save_state(aid, tmp_path)
    file, edit, says = DAMAGED_STATES[case]
    _damaged(tmp_path, file, edit)
    _train(tiny_host, aid, data, 1)  # the adapter moves on past its checkpoint
    before = {k: p.detach().clone() for k, p in tiny_host.adapter_params(aid).items()}
    step = tiny_host.adapters[aid].optim.step
    with pytest.raises(InvalidInputError, match="path: ") as err:
        tiny_host.load_state(aid, str(tmp_path), with_optimizer=True)
    assert all(part in str(err.value) for part in says), str(err.value)
    after = tiny_host.adapter_params(aid)
    assert all(torch.equal(after[k], v) for k, v in before.items()) and tiny_host.adapters[aid].optim.step == step


def test_moments_saved_in_another_dtype_load_as_fp32(tiny_host, new_id, tmp_path):
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=3))
    data = [random_example(tiny_host.vocab_size, 6, random.Random(1))]
    _train(tiny_host, aid, data, 1)
    tiny_host.save_state(aid, tmp_path)
    _edited(tmp_path, "optimizer.safetensors", lambda moments: {k: v.double() for k, v in moments.items()})
    tiny_host.load_state(aid + "-64", str(tmp_path), with_optimizer=True)
    moments = tiny_host.adapters[aid + "-64"].optim
    assert {v.dtype for v in (*moments.exp_avg.values(), *moments.exp_avg_sq.values())} == {torch.float32}
    _train(tiny_host, aid + "-64", data, 1)  # and the next step runs
    for a in (aid, aid + "-64"):
        tiny_host.delete_adapter(a)


@pytest.mark.parametrize("case", BAD_WEIGHTS)
def test_sampler_weights_that_do_not_fit_are_refused_before_the_adapter_changes(tiny_host, new_id, tmp_path, case):
    from trio_engine import InvalidInputError

    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=3))
    randomize_adapter(tiny_host, aid, seed=2)
    tiny_host.save_sampler_weights(aid, tmp_path)
    edit, says = BAD_WEIGHTS[case]
    _edited(tmp_path, "adapter_model.safetensors", lambda tensors: {
        "base_model.model." + k + ".weight": v for k, v in edit(
            {k.removeprefix("base_model.model.").removesuffix(".weight"): v for k, v in tensors.items()}).items()})
    before = {k: p.detach().clone() for k, p in tiny_host.adapter_params(aid).items()}
    with pytest.raises(InvalidInputError, match="path: ") as err:
        tiny_host.load_sampler_weights(aid, str(tmp_path))
    assert all(part in str(err.value) for part in says), str(err.value)
    assert all(torch.equal(tiny_host.adapter_params(aid)[k], v) for k, v in before.items())
    n_adapters = len(tiny_host.adapters)
    with pytest.raises(InvalidInputError):
        tiny_host.load_sampler_weights(aid + "-new", str(tmp_path))  # nor is a new one left half made
    assert len(tiny_host.adapters) == n_adapters and not tiny_host.has_adapter(aid + "-new")


def test_peft_adapters_on_some_layers_load_and_others_are_refused(tiny_host, new_id, tmp_path):
    """A PEFT adapter on some of the family's layers loads (the rest keep B = 0, no change);
    rsLoRA keeps its scale; what TRIO cannot hold is refused by name."""
    import json

    from safetensors.torch import load_file, save_file

    from trio_engine import InvalidInputError
    from trio_engine.checkpoint import load_peft_adapter

    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=3, train_mlp=False, train_unembed=False))
    randomize_adapter(tiny_host, aid, seed=2)
    tiny_host.save_sampler_weights(aid, tmp_path)
    weights = load_file(tmp_path / "adapter_model.safetensors")
    kept = {k: v for k, v in weights.items() if ".q_proj." in k or ".v_proj." in k}  # peft's classic q/v
    save_file(kept, tmp_path / "adapter_model.safetensors")
    config_file = tmp_path / "adapter_config.json"
    config = json.loads(config_file.read_text())
    # peft's all-linear writes full paths, a regex is a string: the kinds come from the keys
    full_paths = sorted({k.removeprefix("base_model.model.").rsplit(".", 2)[0] for k in kept})
    for targets in ("model.*(q_proj|v_proj)", full_paths):
        config_file.write_text(json.dumps({**config, "target_modules": targets, "use_rslora": True}))
        tiny_host.load_sampler_weights(aid + "-qv", str(tmp_path))
        loaded = tiny_host.adapter_params(aid + "-qv")
        for name, tensor in loaded.items():
            peft_name = f"base_model.model.{name}.weight"
            if peft_name in kept:
                assert torch.equal(tensor, kept[peft_name])
            elif name.endswith("lora_B"):
                assert not tensor.any()  # k and o: no change to the output
    lora_config, _ = load_peft_adapter(tmp_path)
    assert lora_config.scale == pytest.approx(config["lora_alpha"] / 2.0)  # rsLoRA: alpha / sqrt(4)
    save_file({**kept, "base_model.model.lm_head.base_layer.weight": torch.ones(3)},  # peft's copy of the base
              tmp_path / "adapter_model.safetensors")
    assert load_peft_adapter(tmp_path)[1].keys() == {k.removeprefix("base_model.model.").removesuffix(".weight")
                                                     for k in kept}

    for key, value in [("use_dora", True), ("rank_pattern", {"q_proj": 8}), ("modules_to_save", ["lm_head"]),
                       ("bias", "lora_only"), ("target_parameters", ["mlp.router.weight"]),
                       ("alora_invocation_tokens", [5, 6]), ("init_lora_weights", "pissa_niter_4")]:
        config_file.write_text(json.dumps({**config, key: value}))
        with pytest.raises(InvalidInputError, match=f"adapter_config.json has {key}="):
            tiny_host.load_sampler_weights(aid + "-bad", str(tmp_path))
    config_file.write_text(json.dumps({**config, "modules_to_save": None, "rank_pattern": {}}))
    save_file({**kept, "base_model.model.lm_head.lora_magnitude_vector": torch.ones(3)},
              tmp_path / "adapter_model.safetensors")
    with pytest.raises(InvalidInputError, match="lora_magnitude_vector', not a LoRA A or B matrix"):
        tiny_host.load_sampler_weights(aid + "-bad", str(tmp_path))
    a_alone = next(k for k in kept if "lora_A" in k)
    save_file({k: v for k, v in kept.items() if k != a_alone.replace("lora_A", "lora_B")},
              tmp_path / "adapter_model.safetensors")
    with pytest.raises(InvalidInputError, match="comes without the other matrix of its layer"):
        tiny_host.load_sampler_weights(aid + "-bad", str(tmp_path))  # it would pair with a fresh B
    (tmp_path / "adapter_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "r"}))
    with pytest.raises(InvalidInputError, match="cannot be read \\(KeyError"):
        tiny_host.load_sampler_weights(aid + "-bad", str(tmp_path))
    assert not tiny_host.has_adapter(aid + "-bad")
    for a in (aid, aid + "-qv"):
        tiny_host.delete_adapter(a)


# -- atomic folder writes: a failed write leaves the previous checkpoint as it was ------------

def _tree(folder):
    """{relative path: bytes} of every file under ``folder``."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _saved_checkpoint(tmp_path):
    from trio_engine.checkpoint import write_folder

    folder = tmp_path / "run" / "weights" / "ckpt"
    write_folder(folder, lambda tmp: [(tmp / n).write_text(n * 3) for n in ("a.safetensors", "meta.json")])
    return folder, _tree(folder)


def test_a_peft_head_copy_loads_only_if_it_is_this_models_head(tiny_host, new_id, tmp_path):
    """peft saves the base head beside an adapted one (save_embedding_layers) and loads it
    over the model's own: the copy is taken when it is this model's head (as stored, or
    rounded to bf16), and refused, naming it, when it is another head or another shape."""
    from trio_engine import InvalidInputError

    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=3, train_unembed=True))
    randomize_adapter(tiny_host, aid, seed=2)
    tiny_host.save_sampler_weights(aid, tmp_path)
    head = tiny_host.unembed.lm_head.weight.detach().float().clone()
    key = "base_model.model.lm_head.base_layer.weight"
    for copy in (head, head.bfloat16()):
        _edited(tmp_path, "adapter_model.safetensors", lambda tensors, copy=copy: {**tensors, key: copy})
        tiny_host.load_sampler_weights(aid + "-copy", str(tmp_path))
        loaded = tiny_host.adapter_params(aid + "-copy")
        assert all(torch.equal(loaded[k], v) for k, v in tiny_host.adapter_params(aid).items())
    for copy, says in ((head * 1.05, "off this model's at most"), (head[:-1], "of shape")):
        _edited(tmp_path, "adapter_model.safetensors", lambda tensors, copy=copy: {**tensors, key: copy})
        with pytest.raises(InvalidInputError, match=f"path: adapter_model.safetensors holds {key}.*{says}"):
            tiny_host.load_sampler_weights(aid + "-bad", str(tmp_path))
    assert not tiny_host.has_adapter(aid + "-bad")
    for a in (aid, aid + "-copy"):
        tiny_host.delete_adapter(a)


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
