"""A job's data run as separate parts gives, once merged, the job's own result and grads
(what the service relies on to time-slice large requests: trio_server/splitting.py)."""

from __future__ import annotations

import random

import pytest
import torch

from trio_engine import Example, ForwardJob, LoraConfig, merge_results


def examples() -> list[Example]:
    rng = random.Random(5)
    out = []
    for k, n in enumerate((7, 3, 11, 5, 4)):
        toks = [rng.randrange(1, 200) for _ in range(n + 1)]
        weights = [0.0] * n if k == 3 else [rng.choice((0.0, 0.5, 1.0, 2.0)) for _ in range(n)]  # datum 3: none active
        out.append(Example(toks[:-1], {"target_tokens": toks[1:], "weights": weights,
                                       "logprobs": [rng.uniform(-4, -1) for _ in range(n)],
                                       "advantages": [rng.uniform(-1, 1) for _ in range(n)]}))
    return out


def grads(host, adapter_id) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in host.adapter_params(adapter_id).items() if p.grad is not None}


def test_merged_parts_equal_the_whole_job_outputs_metrics_and_grads(tiny_host, new_id):
    whole, parted = new_id("whole"), new_id("parted")
    for a in (whole, parted):
        tiny_host.create_adapter(a, LoraConfig(rank=4, seed=11))
    data = examples()
    [ref] = tiny_host.forward_backward([ForwardJob(whole, data, "importance_sampling")])
    parts = [tiny_host.forward_backward([ForwardJob(parted, data[i:j], "importance_sampling")])[0]
             for i, j in ((0, 2), (2, 3), (3, 5))]
    merged = merge_results(parts)
    assert merged.active_tokens == ref.active_tokens == sum(
        sum(w != 0 for w in ex.inputs["weights"]) for ex in data)
    assert merged.metrics.keys() == ref.metrics.keys() == {"loss:sum", "ratio:mean"}
    for name in ref.metrics:
        assert merged.metrics[name] == pytest.approx(ref.metrics[name], rel=1e-5, abs=1e-6)
    # the unweighted average of the parts' means is not it: the re-weighting matters here
    assert sum(p.metrics["ratio:mean"] for p in parts) / 3 != pytest.approx(ref.metrics["ratio:mean"], rel=1e-3)
    for got, want in ((merged.logprobs, ref.logprobs), (merged.elementwise_loss, ref.elementwise_loss)):
        assert [len(x) for x in got] == [len(x) for x in want]
        for a, b in zip(got, want):
            assert a == pytest.approx(b, abs=1e-5)
    g_whole, g_parted = grads(tiny_host, whole), grads(tiny_host, parted)
    assert g_whole.keys() == g_parted.keys() and g_whole
    assert any(g.abs().max() > 0 for g in g_whole.values())
    for name, g in g_whole.items():
        torch.testing.assert_close(g_parted[name], g, rtol=1e-4, atol=1e-6)


def test_held_grads_come_back_exactly_and_are_freed(tiny_host, new_id):
    a = new_id()
    tiny_host.create_adapter(a, LoraConfig(rank=4, seed=2))
    data = examples()
    tiny_host.forward_backward([ForwardJob(a, data[:2], "importance_sampling")])
    before = grads(tiny_host, a)
    tiny_host.hold_grads("req-1", a)
    tiny_host.forward_backward([ForwardJob(a, data[2:], "importance_sampling")])
    assert any(not torch.equal(g, before[n]) for n, g in grads(tiny_host, a).items())
    tiny_host.release_grads("req-1", restore=True)
    after = grads(tiny_host, a)
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    assert "req-1" not in tiny_host.held_grads
    tiny_host.release_grads("req-1", restore=True)  # unknown by now: nothing to do
    tiny_host.hold_grads("req-2", a)
    tiny_host.release_grads("req-2", restore=False)  # kept grads stay, the copy goes
    assert "req-2" not in tiny_host.held_grads and all(torch.equal(grads(tiny_host, a)[n], before[n]) for n in before)
