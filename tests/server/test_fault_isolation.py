"""Faults stay with the request that caused them: the worker thread survives a bug, an engine
error is a server error (500) while bad input stays a validation error (400), and one run's
failing job in a co-batch leaves the other runs' results exactly as if they ran alone."""

from __future__ import annotations

import math

import pytest

import pytrio as trio
from pytrio.transport.local import LocalTransport
from trio_server import worker as worker_module
from trio_server.core import ServiceCore

MODEL = "trio/tiny-llama"


def datum(n: int = 6, **inputs: list[float]) -> trio.Datum:
    toks = list(range(1, n + 2))
    return trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]),
                      loss_fn_inputs={"target_tokens": toks[1:], **inputs})


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    core = ServiceCore(tmp_path_factory.mktemp("faults"), dtype="float32")
    yield core
    core.close()


def client(core) -> trio.ServiceClient:
    return trio.ServiceClient(transport=LocalTransport(core))


def test_an_exception_escaping_execute_fails_the_batch_not_the_worker(core, monkeypatch):
    tc = client(core).create_lora_training_client(base_model=MODEL, rank=2)
    real = worker_module.execute
    broken = {"left": 1}

    def execute_once_broken(ctx, batch):
        if broken["left"]:
            broken["left"] -= 1
            raise RuntimeError("a bug in a handler")
        return real(ctx, batch)

    monkeypatch.setattr(worker_module, "execute", execute_once_broken)
    with pytest.raises(trio.ServerError, match="a bug in a handler"):
        tc.forward([datum()]).result(timeout=120)
    assert core.workers[MODEL].thread.is_alive()
    assert tc.forward([datum()]).result(timeout=120).metrics["loss:sum"] > 0  # the next request runs


def test_an_engine_error_is_a_server_error_with_its_request_id_logged(core, monkeypatch, caplog):
    tc = client(core).create_lora_training_client(base_model=MODEL, rank=2)
    host = core.workers[MODEL].engine.host

    def broken(jobs):
        raise ValueError("a shape mismatch deep in the engine")  # a ValueError, yet not the caller's fault

    monkeypatch.setattr(host, "forward", broken)
    with caplog.at_level("ERROR", logger="trio"), pytest.raises(trio.ServerError) as info:
        tc.forward([datum()]).result(timeout=120)
    assert info.value.status_code == 500 and info.value.category == "server"
    assert "shape mismatch" in info.value.message
    assert info.value.request_id and any(
        info.value.request_id in r.getMessage() and "server error" in r.getMessage() for r in caplog.records)


def test_bad_input_stays_a_validation_error_naming_field_index_and_value(core):
    tc = client(core).create_lora_training_client(base_model=MODEL, rank=2)
    bad = trio.Datum(model_input=trio.ModelInput.from_ints([1, 2, 3]),
                     loss_fn_inputs={"target_tokens": [2, 3, 10**6]})
    with pytest.raises(trio.ValidationError) as info:
        tc.forward([datum(), bad]).result(timeout=120)
    assert info.value.status_code == 400
    assert "data[1]" in info.value.message and "target_tokens" in info.value.message
    assert "1000000" in info.value.message


# -- one failing job in a co-batch ---------------------------------------------------


def rl_datum(n: int = 6, logprob: float = -1.0, advantage: float = 1.0) -> trio.Datum:
    return datum(n, logprobs=[logprob] * n, advantages=[advantage] * n)


# exp(logp - (-1e38)) overflows to inf, and inf * advantage 0 is NaN: a finite input, a NaN loss
NAN_DATUM = rl_datum(logprob=-1e38, advantage=0.0)


def co_batch(core, calls):
    """Each call (training client, data) submitted while the worker is held, so they all run
    as one forward_backward pass (as in test_core's co-batch test: no timing involved)."""
    from ..polling import wait_until

    worker = core.workers[MODEL]
    seen: list[int] = []
    real = worker.engine.forward_backward
    worker.engine.forward_backward = lambda jobs: (seen.append(len(jobs)), real(jobs))[1]
    try:
        with worker.engine.host.lock:
            blocker = calls[0][0].forward([datum()])
            wait_until(lambda: bool(worker.running), "the blocker to run")
            futures = [tc.forward_backward(data, "importance_sampling") for tc, data in calls]
            wait_until(lambda: len(worker.snapshot()) == len(calls), "all to queue")
        blocker.result()
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result(timeout=120))
            except trio.TrioError as exc:
                outcomes.append(exc)
    finally:
        worker.engine.forward_backward = real
    assert seen == [len(calls)], seen
    return outcomes


def trainers(core, n: int, seed: int = 3):
    svc = client(core)
    return [svc.create_lora_training_client(base_model=MODEL, rank=2, seed=seed) for _ in range(n)]


def after_step(tc) -> list[float]:
    tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result(timeout=120)
    return tc.forward([datum()]).result(timeout=120).loss_fn_outputs[0]["logprobs"].tolist()


def test_a_nan_loss_fails_only_its_own_request_in_a_co_batch(core):
    good = [rl_datum(), rl_datum(4, advantage=-0.5)]
    ref = trainers(core, 1)[0]  # the good run's request alone
    alone = ref.forward_backward(good, "importance_sampling").result(timeout=120)
    alone_after = after_step(ref)

    healthy, poisoned, other = trainers(core, 3)
    outcomes = co_batch(core, [(healthy, good), (poisoned, [rl_datum(), NAN_DATUM]), (other, good)])
    assert isinstance(outcomes[1], trio.ValidationError), outcomes[1]
    assert "data[1]" in outcomes[1].message and "non-finite loss" in outcomes[1].message
    assert "-1e+38" in outcomes[1].message  # the value that caused it
    for out in (outcomes[0], outcomes[2]):
        assert out.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-5)
        for a, b in zip(out.loss_fn_outputs, alone.loss_fn_outputs):
            assert a["logprobs"].tolist() == pytest.approx(b["logprobs"].tolist(), abs=1e-5)
    for tc in (healthy, other):  # their grads: those of the request alone, not NaN
        assert after_step(tc) == pytest.approx(alone_after, abs=1e-5)
    # the failed request added nothing: its run trains on as if it never came
    before = poisoned.forward([datum()]).result(timeout=120).loss_fn_outputs[0]["logprobs"].tolist()
    assert after_step(poisoned) == pytest.approx(before, abs=1e-6)  # Adam on zero grads: no change


def test_an_exception_for_one_datum_fails_only_its_own_job(core, monkeypatch):
    import torch

    from trio_engine import Example, ForwardJob, losses
    from trio_server.engine import Failure

    def explode(logp, inputs, config):  # raises for a datum weighted 7: a bug hit by one run's data
        if bool((inputs["weights"] == 7).any()):
            raise RuntimeError("the loss blew up on this datum")
        return losses.cross_entropy(logp, inputs, config)

    monkeypatch.setitem(losses.LOSSES, "explode", losses.LossSpec(explode, ()))
    ref, good, bad, other = (tc.model_id for tc in trainers(core, 4, seed=5))
    engine = core.workers[MODEL].engine
    host = engine.host
    ex = Example([1, 2, 3, 4], {"target_tokens": [2, 3, 4, 5]})
    boom = Example([1, 2, 3], {"target_tokens": [2, 3, 4], "weights": [7.0, 7.0, 7.0]})

    [alone] = engine.forward_backward([ForwardJob(ref, [ex, ex], "explode")])
    outs = engine.forward_backward([ForwardJob(good, [ex, ex], "explode"), ForwardJob(bad, [ex, boom], "explode"),
                                    ForwardJob(other, [ex, ex], "explode")])
    assert isinstance(outs[1], Failure) and outs[1].category == "server" and "blew up" in outs[1].message
    for out in (outs[0], outs[2]):
        assert sum(out.logprobs, []) == pytest.approx(sum(alone.logprobs, []), abs=1e-6)
        assert out.metrics == pytest.approx(alone.metrics)
    expected = host.adapter_params(ref)
    for run in (good, other):
        for name, p in host.adapter_params(run).items():
            assert expected[name].grad is not None and p.grad is not None
            assert torch.allclose(p.grad, expected[name].grad, atol=1e-6), name
    assert all(p.grad is None or not p.grad.any() for p in host.adapter_params(bad).values())


def test_a_forward_with_a_nan_loss_reports_it_over_http(tmp_path):
    # forward trains nothing, so a NaN loss is an answer, not a failure; it used to go out as
    # null and the client could not parse the result
    from ..sdk.conftest import core_server

    with core_server(tmp_path) as server:
        svc = trio.ServiceClient(base_url=server.url, api_key=server.core.store.create_api_key("t"))
        tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
        out = tc.forward([rl_datum(), NAN_DATUM], "importance_sampling").result(timeout=120)
    assert math.isnan(out.metrics["loss:sum"])
    assert all(math.isfinite(v) for v in out.loss_fn_outputs[0]["elementwise_loss"].tolist())


def test_an_outcome_the_store_cannot_take_is_still_delivered_and_the_worker_lives(core, monkeypatch, caplog):
    """The database down for longer than the store retries: the request ran, so its waiter
    gets its result (logged as not stored), and the next request is served."""
    import sqlalchemy as sa

    tc = client(core).create_lora_training_client(base_model=MODEL, rank=2)
    real = core.store.update_together

    def update_together(*updates):  # every update goes through it (the outcome with its run's row)
        if any(values.get("status") == "done" for _, _, _, values in updates):
            raise sa.exc.OperationalError("UPDATE requests", {}, Exception("the database is gone"))
        return real(*updates)

    monkeypatch.setattr(core.store, "update_together", update_together)
    with caplog.at_level("ERROR", logger="trio"):
        out = tc.forward([datum()]).result(timeout=120)
    assert out.metrics["loss:sum"] > 0
    assert any("could not be stored" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    assert core.workers[MODEL].thread.is_alive()
    assert tc.forward([datum()]).result(timeout=120).metrics["loss:sum"] > 0


def test_a_pass_short_of_memory_runs_again_once_idle_runs_are_offloaded(tmp_path, monkeypatch):
    """A GPU holds far fewer runs than the resident limit allows: a pass that runs out of
    memory offloads the least recently used half of the idle runs and runs once more, with
    the same result as without the failure; short again, the error stands."""
    import torch

    core = ServiceCore(tmp_path, dtype="float32")
    try:
        svc = client(core)
        old, recent, short = (svc.create_lora_training_client(base_model=MODEL, rank=2, seed=s) for s in (1, 2, 3))
        for tc in (old, recent):
            tc.forward_backward([datum()])
            tc.optim_step().result()
        reference = svc.create_lora_training_client(base_model=MODEL, rank=2, seed=3)  # as short, never short
        reference.forward_backward([datum()])
        expected = reference.optim_step().result().metrics["grad_norm"]
        engine = core.workers[MODEL].engine
        host, offloaded, fails = engine.host, [], {"left": 1}
        real_pass, real_offload = host.forward_backward, engine.offload

        def short_of_memory_once(jobs):
            if fails["left"]:
                fails["left"] -= 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return real_pass(jobs)

        def offload(run_id):
            offloaded.append(run_id)
            real_offload(run_id)

        monkeypatch.setattr(host, "forward_backward", short_of_memory_once)
        monkeypatch.setattr(engine, "offload", offload)
        short.forward_backward([datum()]).result()
        assert offloaded == [old.model_id, recent.model_id]  # the older half of the three idle runs
        assert short.optim_step().result().metrics["grad_norm"] == pytest.approx(expected, rel=1e-5)  # added once
        # short of memory again after the room made: the error stands (one more try, not a loop)
        fails["left"] = 2
        with pytest.raises(trio.ServerError, match="OutOfMemoryError: CUDA out of memory"):
            short.forward_backward([datum()]).result()
        assert offloaded[2:] == [reference.model_id] and fails["left"] == 0
    finally:
        core.close()


def test_only_the_engines_own_out_of_memory_error_makes_room():
    """Told by the server error failure_from names by its type, never by a message that
    says so (a validation error quoting a user's input would offload others' runs)."""
    from trio_server.errors import ServiceError

    assert worker_module.out_of_memory(ServiceError("server", "OutOfMemoryError: CUDA out of memory. Tried"))
    assert not worker_module.out_of_memory(ServiceError("validation", "data[0]: unknown key 'CUDA out of memory'"))
    assert not worker_module.out_of_memory(ServiceError("server", "ValueError: 'OutOfMemoryError: out of memory'"))
