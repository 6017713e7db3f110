"""Large forward(_backward) requests run as several passes (splitting.py): other users go
between the passes, the merged result and grads are the unsplit request's, and a part
that fails leaves the run's grads exactly as before the request."""

from __future__ import annotations

import pytest
import torch

import pytrio as trio
from pytrio.transport.local import LocalTransport
from trio_server.core import Limits, ServiceCore
from trio_server.splitting import Split, cut, in_whole_request, maybe_split, split_of

from ..polling import wait_until
from .test_fault_isolation import NAN_DATUM, after_step, datum, rl_datum

MODEL = "trio/tiny-llama"
PASS_TOKENS = 12  # two 6-token datums per pass


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    limits = Limits(max_pass_tokens=PASS_TOKENS, slice_alone=True)  # most tests here have one user
    core = ServiceCore(tmp_path_factory.mktemp("split"), dtype="float32", limits=limits)
    yield core
    core.close()


def trainer(core, user: str = "u", seed: int = 3) -> trio.TrainingClient:
    svc = trio.ServiceClient(transport=LocalTransport(core, user))
    return svc.create_lora_training_client(base_model=MODEL, rank=2, seed=seed)


def passes(core, op: str = "forward_backward") -> list[list[tuple[str | None, int]]]:
    """Record each engine call of ``op`` as [(run, datums) per job] (undo: del the engine's attribute)."""
    engine = core.workers[MODEL].engine
    seen: list[list[tuple[str | None, int]]] = []
    real = getattr(engine, op)

    def recording(jobs):
        seen.append([(job.adapter_id, len(job.examples)) for job in jobs])
        return real(jobs)

    setattr(engine, op, recording)
    return seen


def grads(core, run_id: str) -> dict[str, torch.Tensor | None]:
    host = core.workers[MODEL].engine.host
    return {n: None if p.grad is None else p.grad.clone() for n, p in host.adapter_params(run_id).items()}


def test_cut_keeps_datum_order_and_puts_a_longer_datum_alone():
    assert cut([6, 6, 6, 6, 6], 12) == [0, 2, 4]
    assert cut([5, 20, 3, 3, 9], 12) == [0, 1, 2, 4]  # 20 > 12: alone
    assert cut([4, 4], 12) == [0]


def test_a_part_error_names_the_datum_in_the_whole_request():
    d = datum()
    item = maybe_split(_work_item([d] * 5), 12)
    split = item.context["split"]
    assert isinstance(split, Split) and split.starts == [0, 2, 4] and len(item.request.data) == 2
    split.index = 1
    assert in_whole_request("data[1]: loss_fn gave a non-finite loss", split) == "data[3]: loss_fn gave a non-finite loss"
    assert in_whole_request("loss_fn: unknown", split) == "loss_fn: unknown"
    assert maybe_split(_work_item([d] * 2), 12).context == {}  # within a pass: as is
    assert maybe_split(_work_item([datum(30)]), 12).context == {}  # one datum: cannot be cut


def _work_item(data):
    from pytrio import types as t
    from trio_server.scheduler import WorkItem

    return WorkItem("r1", "forward_backward", t.ForwardRequest(model_id="run", seq=0, data=data), "u", "run", 0)


def test_a_split_request_gives_the_unsplit_result_metrics_and_grads(core):
    data = [rl_datum(6, advantage=0.5), rl_datum(5, logprob=-2.0), rl_datum(6, advantage=-1.0),
            datum(6, weights=[0.0] * 6, logprobs=[-1.0] * 6, advantages=[1.0] * 6), rl_datum(4)]
    whole_run, split_run = trainer(core, seed=5), trainer(core, seed=5)
    worker = core.workers[MODEL]
    worker.max_pass_tokens = None
    try:
        whole = whole_run.forward_backward(data, "importance_sampling").result(timeout=120)
    finally:
        worker.max_pass_tokens = PASS_TOKENS
    seen = passes(core)
    try:
        split = split_run.forward_backward(data, "importance_sampling").result(timeout=120)
    finally:
        del worker.engine.forward_backward
    assert seen == [[(split_run.model_id, 2)], [(split_run.model_id, 2)], [(split_run.model_id, 1)]]
    assert split.elapsed_time > 0  # the parts' engine time, summed
    assert split.metrics.keys() == whole.metrics.keys() == {"loss:sum", "ratio:mean"}
    for name, value in whole.metrics.items():
        assert split.metrics[name] == pytest.approx(value, rel=1e-5)
    assert len(split.loss_fn_outputs) == len(data)
    for a, b in zip(split.loss_fn_outputs, whole.loss_fn_outputs):
        for key in ("logprobs", "elementwise_loss"):
            assert a[key].tolist() == pytest.approx(b[key].tolist(), abs=1e-5)
    steps = worker.ctx.steps
    assert steps[split_run.model_id].loss_sum == pytest.approx(steps[whole_run.model_id].loss_sum, rel=1e-5)
    assert steps[split_run.model_id].mean_tokens == steps[whole_run.model_id].mean_tokens
    g_whole, g_split = grads(core, whole_run.model_id), grads(core, split_run.model_id)
    for name, g in g_whole.items():
        if g is not None:
            torch.testing.assert_close(g_split[name], g, rtol=1e-4, atol=1e-6)
    assert after_step(split_run) == pytest.approx(after_step(whole_run), abs=1e-5)
    assert not worker.engine.host.held_grads  # the held copy was freed


def test_a_later_part_failing_leaves_the_grads_exactly_as_before_and_the_run_goes_on(core):
    tc = trainer(core, seed=7)
    tc.forward_backward([rl_datum(), rl_datum(4)], "importance_sampling").result(timeout=120)  # grads pending
    before = grads(core, tc.model_id)
    worker = core.workers[MODEL]
    loss_before = worker.ctx.steps[tc.model_id].loss_sum
    seen = passes(core)
    try:
        with pytest.raises(trio.ValidationError) as info:
            tc.forward_backward([rl_datum()] * 3 + [NAN_DATUM, rl_datum()], "importance_sampling").result(timeout=120)
    finally:
        del worker.engine.forward_backward
    assert len(seen) == 2  # the first part ran and added grads; the second failed; the third never ran
    assert "data[3]" in info.value.message and "non-finite loss" in info.value.message
    after = grads(core, tc.model_id)
    assert after.keys() == before.keys()
    for name, g in before.items():
        assert g is not None and torch.equal(after[name], g), name
    assert worker.ctx.steps[tc.model_id].loss_sum == loss_before  # the failed request is not in the step
    assert not worker.engine.host.held_grads
    out = tc.forward_backward([rl_datum()] * 3, "importance_sampling").result(timeout=120)  # the run goes on
    assert out.metrics["loss:sum"] == pytest.approx(3 * sum(out.loss_fn_outputs[0]["elementwise_loss"].tolist()),
                                                    rel=1e-5)


def test_a_host_restart_between_the_parts_fails_the_request_and_the_next_step(core):
    """A host (a Ray actor) that restarts between two parts loses the first part's grads
    and the copy held to go back to: the request fails (it answered done with the later
    parts' grads alone), the run's partial grads are dropped, and the optim_step after it
    is refused for the lost calls instead of stepping on what is left."""
    tc = trainer(core, seed=9)
    tc.forward_backward([datum()], "cross_entropy").result(timeout=120)  # grads pending, then lost too
    engine = core.workers[MODEL].engine
    real = engine.forward_backward
    calls = []

    def restarting_after_the_first_part(jobs):
        calls.append(len(calls))
        if len(calls) == 2:  # as a restarted host: nothing in memory but what snapshots restore
            engine.host.held_grads.clear()
            engine.host.zero_grad(tc.model_id)
        return real(jobs)

    engine.forward_backward = restarting_after_the_first_part
    try:
        with pytest.raises(trio.ServerError, match="restarted while this request ran in parts"):
            tc.forward_backward([datum()] * 4, "cross_entropy").result(timeout=120)
    finally:
        del engine.forward_backward
    assert all(g is None or not g.any() for g in grads(core, tc.model_id).values())
    with pytest.raises(trio.ServerError, match="gradients of the 1 forward_backward call"):
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result(timeout=120)


def test_another_users_request_runs_between_the_parts(core):
    flood, light = trainer(core, "flood"), trainer(core, "light")
    worker = core.workers[MODEL]
    order: list[str] = []
    real_fb, real_fwd = worker.engine.forward_backward, worker.engine.forward
    worker.engine.forward_backward = lambda jobs: (order.append(f"fb x{len(jobs[0].examples)}"), real_fb(jobs))[1]
    worker.engine.forward = lambda jobs: (order.append("light forward"), real_fwd(jobs))[1]
    try:
        with worker.engine.host.lock:  # the worker is busy: both requests are queued before either runs
            blocker = light.forward_backward([datum()])
            wait_until(lambda: bool(worker.running), "the blocker to run")
            big = flood.forward_backward([datum()] * 6)  # three parts of two datums
            small = light.forward([datum()])
            wait_until(lambda: len(worker.snapshot()) == 2, f"both to queue {worker.snapshot()}")
        for future in (blocker, big, small):
            future.result(timeout=120)
    finally:
        del worker.engine.forward_backward, worker.engine.forward
    # the light request waits for one pass of the flood, not for the whole flood request
    assert order == ["fb x1", "fb x2", "light forward", "fb x2", "fb x2"], order


def test_a_pass_holds_no_more_than_max_pass_tokens_even_when_parts_could_share_it(core):
    a, b = trainer(core, "many", seed=1), trainer(core, "many", seed=2)  # one user: its runs may share passes
    worker = core.workers[MODEL]
    seen = passes(core)
    try:
        with worker.engine.host.lock:
            blocker = a.forward([datum()])
            wait_until(lambda: bool(worker.running), "the blocker to run")
            futures = [tc.forward_backward([datum()] * 4) for tc in (a, b)]  # two parts each
            wait_until(lambda: len(worker.snapshot()) == 2, "both to queue")
        for future in (blocker, *futures):
            future.result(timeout=120)
    finally:
        del worker.engine.forward_backward
    assert len(seen) == 4 and all(sum(n for _, n in jobs) * 6 <= PASS_TOKENS for jobs in seen), seen


def test_the_rest_of_a_split_request_is_cut_afresh_for_the_budget_of_the_moment():
    split = maybe_split(_work_item([datum()] * 6), 12).context["split"]  # parts [0, 2, 4]
    split.advance(None)  # the other users left: no more slicing
    assert split.starts == [0, 2] and split.last and len(split.part().request.data) == 4
    split = maybe_split(_work_item([datum()] * 6), 12).context["split"]
    split.advance(6)  # a smaller budget: one datum a pass from here on
    assert split.starts == [0, 2, 3, 4, 5] and split.part().request.data == [datum()]


@pytest.fixture
def sliced_when_shared(core, monkeypatch):
    """The core's worker slicing only while users share it, with no user seen before."""
    worker = core._worker(MODEL)
    monkeypatch.setattr(worker, "slice_alone", False)
    with worker.cond:
        worker.seen_at.clear()
    return worker


def test_a_user_alone_runs_a_large_request_in_one_pass(core, sliced_when_shared):
    tc = trainer(core, "alone", seed=11)
    seen = passes(core)
    try:
        tc.forward_backward([datum()] * 6).result(timeout=120)
    finally:
        del sliced_when_shared.engine.forward_backward
    assert seen == [[(tc.model_id, 6)]]


def test_a_user_is_noted_before_its_answer_and_never_after(core, monkeypatch):
    """The worker notes a user (``seen_at``: who shares the host) when their request is
    queued or done, before it is answered: noted after, a user whose caller already saw
    the answer would count as sharing the host with whoever comes next (a later request
    of another user alone was cut into passes when that happened)."""
    worker = core._worker(MODEL)
    tc = trainer(core, "noted", seed=14)
    events: list[tuple[str, str]] = []
    real_seen, real_resolve = worker._seen, worker.answers.resolve

    def seen(users):
        users = list(users)
        events.extend(("seen", user) for user in users)
        real_seen(users)

    def resolve(item, result):
        events.append(("answered", item.user_id))
        real_resolve(item, result)

    monkeypatch.setattr(worker, "_seen", seen)
    monkeypatch.setattr(worker.answers, "resolve", resolve)
    tc.forward_backward([datum()] * 4).result(timeout=120)
    trainer(core, "next", seed=15).forward([datum()]).result(timeout=120)  # the worker is past the first batch
    first_answer = events.index(("answered", "noted"))
    assert ("seen", "noted") in events[:first_answer]
    assert ("seen", "noted") not in events[first_answer:]


def test_slicing_starts_and_stops_with_the_sharing(core, sliced_when_shared, monkeypatch):
    from trio_server import worker as worker_module

    monkeypatch.setattr(worker_module, "SHARING_SECONDS", 3600.0)  # until then_alone says otherwise
    flood, light = trainer(core, "flood", seed=12), trainer(core, "light", seed=13)
    light.forward([datum()]).result(timeout=120)  # seen just now: the host is shared
    seen = passes(core)
    recording = sliced_when_shared.engine.forward_backward

    def then_alone(jobs):
        monkeypatch.setattr(worker_module, "SHARING_SECONDS", -1.0)  # every user seen is long gone
        return recording(jobs)

    try:
        flood.forward_backward([datum()] * 6).result(timeout=120)
        sliced_when_shared.engine.forward_backward = then_alone
        flood.forward_backward([datum()] * 6).result(timeout=120)  # split, then alone after its first part
        flood.forward_backward([datum()] * 6).result(timeout=120)
    finally:
        del sliced_when_shared.engine.forward_backward
    parts = [[n for _, n in jobs] for jobs in seen]
    assert parts == [[2], [2], [2]] + [[2], [4]] + [[6]]


def test_a_request_queued_while_alone_is_sliced_once_another_user_comes(core, sliced_when_shared):
    flood, light = trainer(core, "flood", seed=14), trainer(core, "light", seed=15)
    worker = sliced_when_shared
    order: list[str] = []
    real_fb, real_fwd = worker.engine.forward_backward, worker.engine.forward
    worker.engine.forward_backward = lambda jobs: (order.append(f"fb x{len(jobs[0].examples)}"), real_fb(jobs))[1]
    worker.engine.forward = lambda jobs: (order.append(f"forward {jobs[0].adapter_id}"), real_fwd(jobs))[1]
    try:
        with worker.cond:
            worker.seen_at.clear()  # as if light had not come yet
        with worker.engine.host.lock:
            blocker = flood.forward([datum()])
            wait_until(lambda: bool(worker.running), "the blocker to run")
            big = flood.forward_backward([datum()] * 6)  # flood alone: queued whole
            wait_until(lambda: len(worker.snapshot()) == 1, "the big request to queue")
            assert split_of(worker.snapshot()[0]) is None
            small = light.forward([datum()])  # now the host is shared
            wait_until(lambda: len(worker.snapshot()) == 2, "both to queue")
        for future in (blocker, big, small):
            future.result(timeout=120)
    finally:
        del worker.engine.forward_backward, worker.engine.forward
    assert [entry for entry in order if entry.startswith("fb")] == ["fb x2"] * 3, order


def test_a_bug_merging_the_parts_fails_that_request_not_the_worker(core, monkeypatch):
    from trio_server import worker as worker_module

    def broken(ctx, split, error):
        raise RuntimeError("a bug merging")

    tc = trainer(core, seed=11)
    worker, outcomes = core.workers[MODEL], []
    real_resolve = worker.answers.resolve
    monkeypatch.setattr(worker.answers, "resolve", lambda item, result: (outcomes.append(result), real_resolve(item, result)))
    monkeypatch.setattr(worker_module, "finish_split", broken)
    with pytest.raises(trio.ServerError, match="internal error merging parts: RuntimeError: a bug merging"):
        tc.forward_backward([rl_datum()] * 3, "importance_sampling").result(timeout=120)
    [(out, err)] = outcomes
    assert (out, err.category, err.status) == (None, "server", 500)
    monkeypatch.undo()
    assert worker.thread.is_alive()
    assert trainer(core, seed=12).forward([datum()]).result(timeout=120).loss_fn_outputs  # the next one runs
