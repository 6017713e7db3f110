"""Token usage and budgets: what each operation counts (usage.py), per run and per key, kept
across restarts; a spent budget refuses new token work before anything changes; the
REST route and the SDK's RestClient over both transports (HTTP in test_isolation.py)."""

from __future__ import annotations

import pytest

import pytrio as trio
from pytrio import types as t
from pytrio.transport.local import LocalTransport
from trio_server import worker as worker_module
from trio_server.core import ServiceCore
from trio_server.errors import ServiceError
from trio_server.queueing import OpDurations, QueueInfo, describe, estimate_start

MODEL = "trio/tiny-llama"


def datum(n: int) -> trio.Datum:
    toks = list(range(1, n + 2))
    return trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:]})


def usage_of(core: ServiceCore, user: str) -> dict:
    u = core.usage(user)
    return {"total": (u.trained, u.prefilled, u.sampled), "budget": u.budget_tokens,
            "runs": {r.run_id: (r.trained, r.prefilled, r.sampled) for r in u.runs}}


@pytest.fixture
def core(tmp_path):
    core = ServiceCore(tmp_path, dtype="float32")
    yield core
    core.close()


def test_each_operation_counts_its_tokens_per_run_and_a_restart_keeps_them(core, tmp_path):
    svc = trio.ServiceClient(transport=LocalTransport(core, user_id="u1"))
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    tc.forward_backward([datum(7), datum(5)]).result()  # trained 12
    tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result()  # nothing
    tc.forward([datum(4)]).result()  # prefilled 4: a pass without gradients
    sampler = tc.save_weights_and_get_sampling_client("s")
    prompt = trio.ModelInput.from_ints([1, 2, 3])
    out = sampler.sample(prompt, 3, trio.SamplingParams(max_tokens=4, temperature=1.0, seed=0)).result()
    sampled = sum(len(s.tokens) for s in out.sequences)
    assert len(out.sequences) == 3 and sampled > 0
    sampler.compute_logprobs(prompt).result()  # prefilled 3
    base = svc.create_sampling_client(base_model=MODEL)
    base_out = base.sample(trio.ModelInput.from_ints([5, 6]), 1, trio.SamplingParams(max_tokens=2)).result()

    run = tc.model_id
    # The prompt of a sample is prefilled once for all 3 samples: 3, not 9.
    expected = {"total": (12, 4 + 3 + 3 + 2, sampled + len(base_out.sequences[0].tokens)), "budget": None,
                "runs": {run: (12, 4 + 3 + 3, sampled), None: (0, 2, len(base_out.sequences[0].tokens))}}
    assert usage_of(core, "u1") == expected
    assert core.run_usage("u1", run) == t.RunUsage(run_id=run, trained=12, prefilled=10, sampled=sampled)
    assert svc.create_rest_client().get_usage() == core.usage("u1")  # the SDK, in-process
    assert usage_of(core, "someone-else") == {"total": (0, 0, 0), "budget": None, "runs": {}}
    with pytest.raises(ServiceError, match="not found"):
        core.run_usage("someone-else", run)

    core.close()
    again = ServiceCore(tmp_path, dtype="float32")
    try:
        assert usage_of(again, "u1") == expected
    finally:
        again.close()


def test_a_failed_request_costs_nothing(core, monkeypatch):
    tc = trio.ServiceClient(transport=LocalTransport(core)).create_lora_training_client(base_model=MODEL, rank=2)
    tc.forward_backward([datum(6)]).result()
    real = worker_module.execute
    monkeypatch.setattr(worker_module, "execute", lambda ctx, batch: [(None, _boom())] * len(batch))
    with pytest.raises(trio.ServerError):
        tc.forward_backward([datum(6)]).result()
    monkeypatch.setattr(worker_module, "execute", real)
    assert usage_of(core, "local")["total"] == (6, 0, 0)


def _boom():
    return ServiceError("server", "the engine fell over", 500)


def test_a_spent_budget_refuses_token_work_before_any_change_and_other_work_goes_on(core):
    key = core.store.create_api_key("capped", budget_tokens=10)
    user = core.store.user_for_key(key)
    svc = trio.ServiceClient(transport=LocalTransport(core, user_id=user))
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    tc.forward_backward([datum(12)]).result()  # accepted with 0 used: runs, ends over budget
    assert usage_of(core, user)["total"] == (12, 0, 0) and usage_of(core, user)["budget"] == 10

    with pytest.raises(trio.ValidationError, match="token budget spent") as err:
        tc.forward_backward([datum(3)]).result()
    assert err.value.status_code == 403
    assert "used 12 tokens" in err.value.message and "budget of 10" in err.value.message
    sampler = tc.save_weights_and_get_sampling_client("kept")  # saving is not token work: allowed
    with pytest.raises(trio.ValidationError, match="token budget spent"):
        sampler.sample(trio.ModelInput.from_ints([1, 2]), 1, trio.SamplingParams(max_tokens=2)).result()
    assert usage_of(core, user)["total"] == (12, 0, 0)  # nothing ran for the refused calls

    core.store.set_budget("capped", 100)  # the operator raises it: the next submit passes
    tc.forward_backward([datum(3)]).result()
    assert usage_of(core, user)["total"] == (15, 0, 0)


# -- queue estimates (pure) -------------------------------------------------------------


def test_op_durations_average_recent_batches_and_fall_back_to_all_ops():
    d = OpDurations(keep=2)
    assert d.expected("sample") is None
    for seconds in (9.0, 1.0, 3.0):  # keeps the last two
        d.record("forward_backward", seconds)
    d.record("optim_step", 0.5)
    assert d.expected("forward_backward") == 2.0
    assert d.expected("sample") == pytest.approx((1.0 + 3.0 + 0.5) / 3)  # never seen: all ops' mean


def test_estimate_start_adds_the_running_batchs_remainder_and_each_request_ahead():
    d = OpDurations()
    d.record("forward_backward", 4.0)
    d.record("optim_step", 1.0)
    assert estimate_start(d, [], None, 0.0) == 0.0
    assert estimate_start(d, ["optim_step", "forward_backward"], "forward_backward", 1.5) == 2.5 + 1.0 + 4.0
    assert estimate_start(d, ["optim_step"], "forward_backward", 10.0) == 1.0  # overdue: never negative
    assert estimate_start(OpDurations(), ["optim_step"], None, 0.0) is None  # no history: no estimate
    assert describe(QueueInfo(running=False, position=2, starts_in=1.0)) == "queued (position 2)"
    assert describe(QueueInfo(running=True, position=0, starts_in=0.0)) == "running"
