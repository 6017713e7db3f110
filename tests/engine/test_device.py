"""Devices: spec resolution, everything of a host on its device, device-free checkpoints.

The CUDA tests run only where CUDA is; the device-independence test of checkpoints
runs everywhere (CPU -> CPU proves the file holds CPU tensors and loads back exactly).
"""

import mmap
import os
import random
import sys

import pytest
import torch
from safetensors import safe_open

from trio_engine import (
    TINY_LLAMA,
    AdamConfig,
    Example,
    ForwardJob,
    LoraConfig,
    ModelHost,
    SampleRequest,
    SamplingConfig,
    device,
    resolve_device,
    resolve_dtype,
    snapshot,
)

from .helpers import needs_cuda, random_example, randomize_adapter

CFG = AdamConfig(learning_rate=1e-2, weight_decay=0.01)


def _data(host, seed=0, fields=()):
    rng = random.Random(seed)
    return [random_example(host.vocab_size, n, rng, fields=fields) for n in (6, 11)]


def _train_step(host, aid, data, loss_fn="cross_entropy"):
    out = host.forward_backward([ForwardJob(aid, data, loss_fn)])[0]
    metrics = host.optim_step(aid, CFG)
    return out, metrics


def assert_on_device(host, aid):
    """The adapter's weights, grads and AdamW moments all live on the host's device."""
    for name, p in host.adapter_params(aid).items():
        assert p.device == host.device, name
        assert p.grad is None or p.grad.device == host.device, name
    optim = host.adapters[aid].optim
    for name, m in [*optim.exp_avg.items(), *optim.exp_avg_sq.items()]:
        assert m.device == host.device, name


def assert_plain_lists(result):
    """What leaves the host is device-free."""
    assert all(type(x) is float for row in result.logprobs for x in row)
    assert all(type(x) is float for row in result.elementwise_loss for x in row)


# --------------------------------------------------------------------------- resolve_device


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("TRIO_DEVICE", raising=False)
    monkeypatch.delenv("TRIO_DTYPE", raising=False)
    return monkeypatch


def test_auto_picks_cuda_only_when_available(no_env):
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device(None).type == expected  # None -> $TRIO_DEVICE (unset) -> auto


def test_default_dtype_asks_the_hosts_own_gpu(monkeypatch):
    """bf16 by default where the host's GPU computes it natively, whichever GPU is current."""
    capability = {0: (9, 0), 1: (7, 5)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: capability[torch.device(d).index or 0])
    assert device.default_dtype(torch.device("cuda:0")) == torch.bfloat16
    assert device.default_dtype(torch.device("cuda:1")) == torch.float32
    assert device.default_dtype(torch.device("cpu")) == torch.float32


def test_auto_is_cpu_without_cuda(no_env):
    no_env.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(None) == torch.device("cpu")


def test_explicit_cpu_and_env(no_env):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    no_env.setenv("TRIO_DEVICE", "cpu")
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")  # the argument wins over the env


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_a_clear_error(no_env, spec):
    no_env.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="cuda") as err:
        resolve_device(spec)
    assert repr(spec) in str(err.value) and "not available" in str(err.value)


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cuda:-1", "mps:0", "", "cpu:0 "])
def test_unknown_device_is_an_error(no_env, spec):
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device(spec)


def test_bad_env_device_names_the_variable(no_env):
    no_env.setenv("TRIO_DEVICE", "tpu")
    with pytest.raises(ValueError, match=r"TRIO_DEVICE.*'tpu'"):
        resolve_device(None)


def test_host_rejects_a_missing_device_before_loading(no_env):
    no_env.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="cuda:1"):
        ModelHost(TINY_LLAMA, device="cuda:1")


def test_dtype_defaults_and_overrides(no_env):
    cpu = torch.device("cpu")
    assert resolve_dtype(None, cpu) == torch.float32  # today's CPU default, unchanged
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype(torch.float16, cpu) == torch.float16
    no_env.setenv("TRIO_DTYPE", "bfloat16")
    assert resolve_dtype(None, cpu) == torch.bfloat16
    assert resolve_dtype("float32", cpu) == torch.float32  # the argument wins over the env
    with pytest.raises(ValueError, match="'fp8'"):
        resolve_dtype("fp8", cpu)


# --------------------------------------------------------------------------- device independence (CPU)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(a, 16) for a in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_cpu_weights_move_to_one_huge_page_buffer_keeping_values_and_ties():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 24), torch.nn.Linear(24, 7), torch.nn.Linear(24, 50))
    model[2].weight = model[0].weight  # tied, as an unembedding often is
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    device.gather_on_huge_pages(list(model.parameters()))
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.data_ptr() % 64 == 0, name  # each starts on a cache line
    assert model[2].weight is model[0].weight
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1
    start = min(p.data_ptr() for p in model.parameters())
    assert start % device.HUGE_PAGE == 0
    if os.path.exists("/proc/self/smaps") and hasattr(mmap, "MADV_HUGEPAGE"):
        assert "hg" in _vm_flags(start)  # advised for huge pages before anything touched it


def test_matrices_lie_side_by_side_so_biased_projections_stack_in_place():
    """Biases go after every matrix: q/k/v with biases (Qwen2) stay adjacent, and the
    fused product (``lora.fuse``) then views them where they lie, copying nothing."""
    layer = torch.nn.ModuleDict({n: torch.nn.Linear(16, o) for n, o in (("q", 16), ("k", 8), ("v", 8))})
    device.gather_on_huge_pages(list(layer.parameters()))
    q, k, v = (layer[n].weight for n in ("q", "k", "v"))
    assert k.data_ptr() == q.data_ptr() + q.nbytes and v.data_ptr() == k.data_ptr() + k.nbytes
    assert min(m.bias.data_ptr() for m in layer.values()) > v.data_ptr()


def test_a_cpu_host_holds_its_base_weights_in_its_own_memory(bundled_host):
    """Not in the safetensors file's page cache mapping (slower to read: see device.py)."""
    storages = {p.untyped_storage().data_ptr() for p in bundled_host.model.parameters()}
    assert len(storages) == 1
    model = bundled_host.model
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


needs_mallinfo2 = pytest.mark.skipif(device.malloc_info() is None, reason="needs glibc >= 2.33")


@needs_mallinfo2
def test_a_cpu_host_keeps_freed_memory_in_the_heap(tiny_host):
    """A 256 MiB block (8x glibc's largest dynamic mmap threshold) comes from the heap, so
    freeing it does not hand its pages back to be faulted in again by the next step."""
    assert device.keep_freed_memory()  # the host applied it already; applying again is harmless
    before = device.malloc_info()
    block = torch.empty(64 << 20)  # fp32: 256 MiB, untouched
    size, held = block.nbytes, device.malloc_info()
    assert held.hblkhd - before.hblkhd < size  # not a mapping of its own (hblkhd: bytes in those)
    del block
    assert device.malloc_info().arena >= held.arena - size // 2  # and the heap did not shrink it away


@needs_mallinfo2
def test_freed_memory_over_the_bound_goes_back_to_the_kernel(tiny_host):
    """The pages of a freed 256 MiB block stay resident under a bound above it, and are
    given back under one below it (RSS falls by most of the block)."""
    block = torch.ones(64 << 20)  # touched: resident
    size = block.nbytes
    del block
    trimmer = device.FreedMemoryTrimmer(bound=1 << 40)
    rss = _rss()
    assert trimmer.check() == 0 and _rss() > rss - size // 2
    trimmer.bound = size // 4
    assert trimmer.check() >= size and trimmer.trims == 1
    assert _rss() < rss - size // 2


@pytest.mark.parametrize("setting, expected", [
    (None, None), ("1", None), (" 0 ", 0), ("100K", 100 << 10), ("512M", 512 << 20), ("2G", 2 << 30),
    ("1.5GiB", 3 << 29), ("64 mb", 64 << 20)])
def test_the_bound_on_freed_memory_reads_sizes(setting, expected):
    assert device.kept_freed_bytes(setting) == expected


@pytest.mark.parametrize("setting", ["lots", "1.0", "100", "yes", "2T", "-1G"])
def test_a_bad_bound_on_freed_memory_names_the_variable_and_value(setting):
    with pytest.raises(ValueError, match=rf"TRIO_KEEP_FREED_MEMORY.*{setting!r}"):
        device.kept_freed_bytes(setting)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_bound_on_freed_memory_starts_one_trimmer(monkeypatch):
    monkeypatch.setattr(device, "_trimmer", None)
    monkeypatch.setenv("TRIO_KEEP_FREED_MEMORY", "256M")
    assert device.keep_freed_memory()
    trimmer = device._trimmer
    try:
        monkeypatch.setenv("TRIO_KEEP_FREED_MEMORY", "1G")
        assert device.keep_freed_memory()
        assert device._trimmer is trimmer and trimmer.is_alive() and trimmer.bound == 1 << 30
    finally:
        trimmer.stopped.set()
        trimmer.join(2 * device.TRIM_CHECK_SECONDS)


def test_keeping_freed_memory_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("TRIO_KEEP_FREED_MEMORY", "0")
    assert not device.keep_freed_memory()


def test_cpu_host_reports_its_device(tiny_host):
    assert tiny_host.info()["device"] == str(tiny_host.device)


def test_saved_state_is_device_free_and_loads_elsewhere(tiny_host, new_id, tmp_path):
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=3))
    data = _data(tiny_host)
    _train_step(tiny_host, aid, data)
    tiny_host.forward_backward([ForwardJob(aid, data)])  # pending grads, for offload below
    assert_on_device(tiny_host, aid)
    tiny_host.save_state(aid, tmp_path / "ckpt")
    snap = tmp_path / "run.safetensors"
    snapshot.write(snap, snapshot.capture(tiny_host, aid, with_grads=True))  # state + pending grads
    snapshot.restore(tiny_host, aid, snapshot.read(snap))
    assert_on_device(tiny_host, aid)

    files = [tmp_path / "ckpt" / "adapter.safetensors", tmp_path / "ckpt" / "optimizer.safetensors", snap]
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            assert list(f.keys())
            for key in f.keys():
                assert f.get_tensor(key).device == torch.device("cpu"), (path.name, key)

    other = ModelHost(TINY_LLAMA, dtype="float32", device="cpu")
    other.load_state("copy", str(tmp_path / "ckpt"), with_optimizer=True)
    assert_on_device(other, "copy")
    assert other.adapters["copy"].optim.step == 1
    ex = data[1]
    ours = tiny_host.forward([ForwardJob(aid, [ex])])[0]
    theirs = other.forward([ForwardJob("copy", [ex])])[0]
    assert_plain_lists(theirs)
    torch.testing.assert_close(torch.tensor(theirs.logprobs[0]), torch.tensor(ours.logprobs[0]),
                               atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------- CUDA


@pytest.fixture(scope="module")
def cuda_host():
    """The tiny model on CUDA in the device's default dtype (bfloat16 where supported)."""
    return ModelHost(TINY_LLAMA, device="cuda")


@pytest.fixture(scope="module")
def cuda_fp32_host():
    return ModelHost(TINY_LLAMA, dtype="float32", device="cuda")


@needs_cuda
def test_cuda_host_trains(cuda_host, new_id):
    assert cuda_host.device.type == "cuda"
    assert cuda_host.info()["device"] == str(cuda_host.device)
    assert next(cuda_host.model.parameters()).device == cuda_host.device
    aid = new_id()
    cuda_host.create_adapter(aid, LoraConfig(rank=8, seed=1))
    before = {k: p.detach().cpu().clone() for k, p in cuda_host.adapter_params(aid).items()}
    out, metrics = _train_step(cuda_host, aid, _data(cuda_host, fields=("logprobs", "advantages")), "ppo")
    out2, _ = _train_step(cuda_host, aid, _data(cuda_host))
    assert_plain_lists(out)
    assert all(torch.isfinite(torch.tensor(x)).all() for x in out.elementwise_loss + out2.elementwise_loss)
    assert torch.isfinite(torch.tensor(metrics["grad_norm"])) and metrics["grad_norm"] > 0
    assert_on_device(cuda_host, aid)
    after = cuda_host.adapter_params(aid)
    assert all(p.dtype == torch.float32 for p in after.values())  # LoRA stays fp32
    assert any(not torch.equal(before[k], p.detach().cpu()) for k, p in after.items())


@needs_cuda
def test_cuda_sampler_logprobs_equal_trainer_logprobs(cuda_fp32_host, new_id):
    host = cuda_fp32_host
    aid = new_id()
    host.create_adapter(aid, LoraConfig(rank=4, seed=1))
    randomize_adapter(host, aid, seed=5, scale=0.2)
    prompts = [[1, 5, 9, 200, 31], [7, 7]]
    cfg = SamplingConfig(max_tokens=8, temperature=1.0, seed=3)
    results = host.sample([SampleRequest(aid, p, 2, cfg, prompt_logprobs=True) for p in prompts])
    again = host.sample([SampleRequest(aid, p, 2, cfg) for p in prompts])
    for prompt, result, repeat in zip(prompts, results, again):
        assert [s.tokens for s in result.sequences] == [s.tokens for s in repeat.sequences]  # seeded
        for seq in result.sequences:
            assert all(type(t) is int for t in seq.tokens)
            full = prompt + seq.tokens
            ex = Example(full[:-1], {"target_tokens": full[1:]})
            trainer = host.forward([ForwardJob(aid, [ex])])[0].logprobs[0][len(prompt) - 1 :]
            assert max(abs(a - b) for a, b in zip(seq.logprobs, trainer)) < 1e-4


@needs_cuda
def test_state_saved_on_cuda_loads_on_cpu(cuda_fp32_host, new_id, tmp_path):
    aid = new_id()
    cuda_fp32_host.create_adapter(aid, LoraConfig(rank=8, seed=2))
    data = _data(cuda_fp32_host, seed=1)
    for _ in range(2):
        _train_step(cuda_fp32_host, aid, data)
    cuda_fp32_host.save_state(aid, tmp_path)
    cpu = ModelHost(TINY_LLAMA, dtype="float32", device="cpu")
    cpu.load_state("copy", str(tmp_path), with_optimizer=True)
    assert_on_device(cpu, "copy")
    on_gpu = cuda_fp32_host.forward([ForwardJob(aid, data)])[0].logprobs
    on_cpu = cpu.forward([ForwardJob("copy", data)])[0].logprobs
    for a, b in zip(on_gpu, on_cpu):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=1e-5, rtol=1e-5)
    # and back: the CPU host's state resumes on the GPU, moments on the device
    cpu.save_state("copy", tmp_path / "back")
    cuda_fp32_host.load_state(aid + "-back", str(tmp_path / "back"), with_optimizer=True)
    assert_on_device(cuda_fp32_host, aid + "-back")
    _train_step(cuda_fp32_host, aid + "-back", data)


def test_fetched_copies_each_storage_once_and_keeps_every_view_of_it():
    """A GPU host's packed adapter crosses to the CPU as one transfer: each storage is
    copied once (tried here on CPU tensors, ``copy_cpu``) and every tensor comes back as
    the same view of the copy, whatever its offset, stride and dtype."""
    whole = torch.arange(24, dtype=torch.float32)
    first, second = whole[:6].view(2, 3), whole[6:24].view(3, 6).t()  # a transposed view too
    alone = torch.arange(5, dtype=torch.bfloat16)[1:]  # an offset into a bf16 storage
    tensors = {"a": first, "b": second, "c": alone}
    copies = device.fetched(tensors, copy_cpu=True)
    for name, tensor in tensors.items():
        assert copies[name].dtype == tensor.dtype and torch.equal(copies[name], tensor)
        assert copies[name].untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    assert copies["a"].untyped_storage().data_ptr() == copies["b"].untyped_storage().data_ptr()
    whole.zero_()
    assert copies["b"].sum() == sum(range(6, 24))  # a copy: the source may change now
    kept = device.fetched(tensors)  # CPU tensors, by default: as they are
    assert all(kept[k].data_ptr() == t.data_ptr() for k, t in tensors.items())
