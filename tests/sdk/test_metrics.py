"""Step metrics through the public SDK, over each transport: what the service records for
each step (checked against a hand computation from the returned logprobs and weights),
``log_metrics`` merged in, ``RestClient.get_run_metrics``, and bad input named."""

from __future__ import annotations

import asyncio
import math
import threading

import numpy as np
import pytest

import pytrio as trio
from pytrio.transport.local import LocalTransport

from ..polling import wait_until

MODEL = "trio/tiny-llama"


@pytest.fixture(params=["local", "http"])
def svc(request):
    """(ServiceClient, the ServiceCore behind it) over each transport."""
    if request.param == "local":
        core = request.getfixturevalue("local_core")
        return trio.ServiceClient(transport=LocalTransport(core)), core
    server = request.getfixturevalue("http_server")
    return trio.ServiceClient(base_url=server.url, api_key=server.core.store.create_api_key("m")), server.core


def datum(tokens: list[int], weights: list[float] | None = None, **extra) -> trio.Datum:
    inputs = {"target_tokens": tokens[1:], **extra}
    if weights is not None:
        inputs["weights"] = weights
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


A = datum([1, 17, 300, 42, 9, 77], [0.0, 1.0, 1.0, 2.5, 0.5])  # 5 tokens, weights sum 5
B = datum([3, 8, 200, 11])  # 3 tokens, no weights: 1 each, as the losses take it
C = datum([5, 1024, 31, 8, 60], [1.0, 1.0, 0.0, 0.0])  # 4 tokens, weights sum 2


def logprobs(out: trio.ForwardBackwardOutput) -> list[np.ndarray]:
    return [np.array(o["logprobs"].data, dtype=np.float64) for o in out.loss_fn_outputs]


def weights(d: trio.Datum) -> np.ndarray:
    w = d.loss_fn_inputs.get("weights")
    return np.ones(d.model_input.length) if w is None else np.array(w.data, dtype=np.float64)


def test_each_step_records_loss_per_weighted_token_tokens_grad_norm_and_learning_rate(svc):
    service, _ = svc
    tc = service.create_lora_training_client(base_model=MODEL, rank=2, seed=1)
    # step 1: two forward_backward calls (and a forward, which is no part of it)
    fb1 = tc.forward_backward([A, B])
    tc.forward([A, C])
    fb2 = tc.forward_backward([C])
    op1 = tc.optim_step(trio.AdamParams(learning_rate=0.01))
    # step 2: one call
    fb3 = tc.forward_backward([A])
    op2 = tc.optim_step(trio.AdamParams(learning_rate=0.02))
    # no gradients: optim_step makes no step, so nothing is recorded
    tc.optim_step(trio.AdamParams(learning_rate=0.5)).result()

    def nll(out, data):  # cross_entropy: L = sum over tokens of -w * logprob
        return sum(float(-(weights(d) * lp).sum()) for d, lp in zip(data, logprobs(out)))

    out1, out2, out3 = fb1.result(), fb2.result(), fb3.result()
    loss1 = (nll(out1, [A, B]) + nll(out2, [C])) / (5 + 3 + 2)
    loss2 = nll(out3, [A]) / 5
    steps = service.create_rest_client().get_run_metrics(tc.model_id)
    assert [s.step for s in steps] == [1, 2]
    want = [
        {"loss": loss1, "tokens": 5 + 3 + 4, "grad_norm": op1.result().metrics["grad_norm"], "learning_rate": 0.01},
        {"loss": loss2, "tokens": 5, "grad_norm": op2.result().metrics["grad_norm"], "learning_rate": 0.02},
    ]
    for got, expected in zip(steps, want):
        assert got.metrics == pytest.approx(expected, rel=1e-5)


def test_the_loss_functions_mean_metrics_average_over_the_steps_weighted_tokens(svc):
    """importance_sampling reports ratio:mean = exp(logprob - q) over the tokens of non-zero
    weight; a step of two calls averages over all of its such tokens (3 + 2), not the
    two calls' means."""
    service, _ = svc
    tc = service.create_lora_training_client(base_model=MODEL, rank=2, seed=2)
    q = ([-9.0, -8.0, -7.5, -10.0, -9.5], [-8.0, -9.0, -1.0, -1.0])  # the sampler's logprobs
    adv = ([1.0, 0.5, -1.0, 2.0, 1.0], [0.25, -0.5, 3.0, 3.0])
    outs = []
    for d, qd, ad in zip((A, C), q, adv):
        rl = trio.Datum(model_input=d.model_input,
                        loss_fn_inputs={**d.loss_fn_inputs, "logprobs": qd, "advantages": ad})
        outs.append(tc.forward_backward([rl], "importance_sampling").result())
    tc.optim_step().result()

    ratios, losses, total_w = [], 0.0, 0.0
    for d, qd, ad, out in zip((A, C), q, adv, outs):
        (lp,) = logprobs(out)
        w, ratio = weights(d), np.exp(lp - np.array(qd))
        ratios += [r for r, wi in zip(ratio, w) if wi != 0]
        losses += float((-w * ratio * np.array(ad)).sum())
        total_w += float(w.sum())
    ((step, got),) = [(s.step, s.metrics) for s in service.create_rest_client().get_run_metrics(tc.model_id)]
    assert step == 1 and set(got) == {"loss", "tokens", "ratio:mean", "grad_norm", "learning_rate"}
    assert got["ratio:mean"] == pytest.approx(float(np.mean(ratios)), rel=1e-5)
    assert got["loss"] == pytest.approx(losses / total_w, rel=1e-5)
    assert got["tokens"] == 5 + 4


def test_a_mean_metric_averages_over_the_calls_that_report_it(svc):
    """A cross_entropy call beside an importance_sampling one reports no ratio: its tokens
    must not count as ratios of zero (they halved ratio:mean here)."""
    service, _ = svc
    tc = service.create_lora_training_client(base_model=MODEL, rank=2, seed=4)
    (lp,) = logprobs(tc.forward([A]).result())
    on_policy = trio.Datum(model_input=A.model_input,
                           loss_fn_inputs={**A.loss_fn_inputs, "logprobs": lp.tolist(), "advantages": [1.0] * 5})
    tc.forward_backward([on_policy], "importance_sampling")
    tc.forward_backward([A, C])
    tc.optim_step().result()
    ((step, got),) = [(s.step, s.metrics) for s in service.create_rest_client().get_run_metrics(tc.model_id)]
    assert got["ratio:mean"] == pytest.approx(1.0, abs=1e-5)


def test_a_custom_loss_records_the_users_loss_and_metrics_not_its_surrogates(svc):
    """forward_backward_custom trains through a cross_entropy pass weighted by -dloss/dlogprobs;
    the step records the loss the user's loss_fn returned (alone: as ``loss`` too) and its
    metrics, not that pass's loss over weights that sum to about nothing."""
    service, _ = svc
    tc = service.create_lora_training_client(base_model=MODEL, rank=2, seed=5)
    signs = (1.0, -1.0, 0.02)

    def loss_fn(data, lps):
        loss = sum(-a * lp.mean() for a, lp in zip(signs, lps))
        return loss, {"kl": 0.25, "nan_metric": float("nan"), "tokens": 1.0, "grad_norm": 2.0}  # the last two: ours

    first = tc.forward_backward_custom([A, B, C], loss_fn).result()
    second = tc.forward_backward_custom([A, B, C], loss_fn).result()
    tc.optim_step().result()
    ((step, got),) = [(s.step, s.metrics) for s in service.create_rest_client().get_run_metrics(tc.model_id)]
    custom = first.metrics["loss:sum"] + second.metrics["loss:sum"]
    assert got == pytest.approx({"loss": custom, "custom_loss": custom, "kl": 0.25, "tokens": 2 * (5 + 3 + 4),
                                 "grad_norm": got["grad_norm"], "learning_rate": got["learning_rate"]}, rel=1e-6)
    # beside a built-in call, ``loss`` is the built-in calls' per weighted token
    out = tc.forward_backward([A]).result()
    tc.forward_backward_custom([A, B, C], loss_fn).result()
    tc.optim_step().result()
    got = service.create_rest_client().get_run_metrics(tc.model_id)[-1].metrics
    assert got["loss"] == pytest.approx(float(-(weights(A) * logprobs(out)[0]).sum()) / 5, rel=1e-5)
    assert got["custom_loss"] != got["loss"] and got["tokens"] == 5 + 5 + 3 + 4


def test_log_metrics_merges_client_metrics_into_the_steps(svc):
    service, _ = svc
    tc = service.create_lora_training_client(base_model=MODEL, rank=2, seed=3)
    assert tc.log_metrics({"reward": 0.125}).result().step == 0  # before any optim_step: step 0
    tc.forward_backward([A])
    tc.optim_step()
    # step=None: the step once the calls before it ran (no waiting for them here)
    logged = tc.log_metrics({"reward": np.float32(0.75), "kl": 3})
    assert logged.result().step == 1
    # a later step, and a client "loss" that shows instead of the service's
    tc.log_metrics({"loss": 42.0}, step=1).result()
    assert tc.log_metrics({"reward": -1.5}, step=7).result().step == 7

    async def again():  # the async twin, awaited for its future
        return await (await tc.log_metrics_async({"eval": 0.5}, step=1))
    assert asyncio.run(again()).step == 1

    rest = service.create_rest_client()
    steps = {s.step: s.metrics for s in rest.get_run_metrics(tc.model_id)}
    assert list(steps) == [0, 1, 7]
    assert steps[0] == {"reward": 0.125}
    assert steps[1]["reward"] == 0.75 and steps[1]["kl"] == 3.0 and steps[1]["eval"] == 0.5
    assert steps[1]["loss"] == 42.0 and {"tokens", "grad_norm", "learning_rate"} <= set(steps[1])
    assert steps[7] == {"reward": -1.5}
    assert asyncio.run(rest.get_run_metrics_async(tc.model_id)) == rest.get_run_metrics(tc.model_id)


def test_log_metrics_without_a_step_waits_for_the_calls_made_before_it(svc, monkeypatch):
    """With the engine held, the optim_step before it cannot run: log_metrics must not
    record until it has (the step would be 0), whenever its coroutine gets to run."""
    service, core = svc
    tc = service.create_lora_training_client(base_model=MODEL, rank=2, seed=4)
    session = tc._session
    waiting = threading.Event()
    real_settled = session.settled

    async def settled(request_id):
        waiting.set()
        await real_settled(request_id)

    monkeypatch.setattr(session, "settled", settled)
    host = core.workers[MODEL].engine.host
    with host.lock:  # the worker blocks inside forward_backward
        tc.forward_backward([A])
        tc.optim_step()
        logged = tc.log_metrics({"reward": 1.0})
        wait_until(lambda: waiting.is_set() or core.store.run_metrics(tc.model_id),
                   "log_metrics to wait for the optim_step, or to record")
        assert core.store.run_metrics(tc.model_id) == []
    assert logged.result().step == 1
    ((step, metrics),) = core.store.run_metrics(tc.model_id)
    assert step == 1 and metrics["reward"] == 1.0 and "loss" in metrics


@pytest.mark.parametrize("metrics, step, named", [
    ({"reward": float("nan")}, None, "metrics.reward: Input should be a finite number (got nan)"),
    ({"reward": math.inf}, 3, "metrics.reward: Input should be a finite number (got inf)"),
    ({"": 1.0}, None, "metrics.[key]: String should have at least 1 character (got '')"),
    ({"x" * 129: 1.0}, None, "at most 128 characters (got 'xxxx"),
    ({"ok": True}, None, "metrics.ok: Input should be a valid number (got True)"),
    ({"ok": "0.5"}, None, "metrics.ok: Input should be a valid number (got '0.5')"),
    ({"ok": np.array([1.0, 2.0])}, None, "metrics.ok: Input should be a valid number"),
    ({}, None, "metrics: Dictionary should have at least 1 item"),
    ([("ok", 1.0)], None, "metrics: Input should be a valid dictionary"),
    ({"ok": 1.0}, -1, "step: Input should be greater than or equal to 0 (got -1)"),
    ({"ok": 1.0}, 1.5, "step: Input should be a valid integer (got 1.5)"),
])
def test_bad_metrics_are_named_at_call_time_and_nothing_is_recorded(svc, metrics, step, named):
    service, core = svc
    tc = service.create_lora_training_client(base_model=MODEL, rank=2, seed=5)
    with pytest.raises(trio.ValidationError) as err:
        tc.log_metrics(metrics, step=step)
    assert named in str(err.value)
    assert core.store.run_metrics(tc.model_id) == []
    assert service.create_rest_client().get_run_metrics(tc.model_id) == []


def test_unknown_runs_are_not_found(svc):
    service, _ = svc
    with pytest.raises(trio.NotFoundError, match="run-000000000000"):
        service.create_rest_client().get_run_metrics("run-000000000000")
    with pytest.raises(trio.NotFoundError, match="run-000000000000"):
        trio.TrainingClient(service._session, "run-000000000000", MODEL).log_metrics({"r": 1.0}, step=0).result()
