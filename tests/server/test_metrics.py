"""Step metrics over raw HTTP: bad bodies named with their field and value (the SDK's own
checks are not in the way here), and recording that fails never fails the request."""

from __future__ import annotations

import logging

import httpx
import pytest

import pytrio as trio
from trio_server import handlers

from ..sdk.conftest import core_server

MODEL = "trio/tiny-llama"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with core_server(tmp_path_factory.mktemp("metrics")) as server:
        yield server


def datum() -> trio.Datum:
    toks = [1, 17, 300, 42, 9, 77]
    return trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]),
                      loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 5})


@pytest.fixture
def run(server):
    """(raw HTTP client as a new user, a run of theirs trained one step)."""
    key = server.core.store.create_api_key("m")
    tc = trio.ServiceClient(base_url=server.url, api_key=key).create_lora_training_client(base_model=MODEL, rank=2)
    tc.forward_backward([datum()])
    tc.optim_step().result()
    api = httpx.Client(base_url=f"{server.url}/api/v1/runs/{tc.model_id}", timeout=60,
                       headers={"Authorization": f"Bearer {key}"})
    return api, tc


@pytest.mark.parametrize("body, status, named", [
    (b'{"metrics": {"reward": NaN}}', 422, "body.metrics.reward: Input should be a finite number (got nan)"),
    (b'{"metrics": {"reward": 1e999}}', 422, "body.metrics.reward: Input should be a finite number (got inf)"),
    (b'{"metrics": {"reward": "high"}}', 422, "body.metrics.reward: Input should be a valid number (got 'high')"),
    (b'{"metrics": {"reward": null}}', 422, "body.metrics.reward: Input should be a valid number (got None)"),
    (b'{"metrics": {"reward": false}}', 422, "body.metrics.reward: Input should be a valid number (got False)"),
    (b'{"metrics": {"": 1}}', 422, "body.metrics.[key]: String should have at least 1 character (got '')"),
    (b'{"metrics": {}}', 422, "body.metrics: Dictionary should have at least 1 item"),
    (b'{"step": "2", "metrics": {"r": 1}}', 422, "body.step: Input should be a valid integer (got '2')"),
    (b'{"step": -3, "metrics": {"r": 1}}', 422, "body.step: Input should be greater than or equal to 0 (got -3)"),
    (b'{"metrics": {"r": 1}, "tags": ["x"]}', 422, "body.tags: Extra inputs are not permitted"),
    (b'{"step": 1}', 422, "body.metrics: Field required"),
    (b'{"metrics": {"r": 1}', 400, "malformed JSON"),
])
def test_bad_bodies_are_named_and_record_nothing(run, body, status, named):
    api, _ = run
    before = api.get("/metrics").json()
    r = api.post("/metrics", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and r.json()["error"]["category"] == "validation"
    assert named in r.json()["error"]["message"]
    assert api.get("/metrics").json() == before


def test_a_good_body_is_recorded_at_the_current_step(run):
    api, tc = run
    r = api.post("/metrics", json={"step": None, "metrics": {"reward": 0.5, "count": 3}})
    assert r.status_code == 200 and r.json() == {"run_id": tc.model_id, "step": 1}
    (step,) = api.get("/metrics").json()
    assert step["step"] == 1 and step["metrics"]["reward"] == 0.5 and step["metrics"]["count"] == 3.0
    assert set(step["metrics"]) == {"loss", "tokens", "grad_norm", "learning_rate", "reward", "count"}


@pytest.mark.parametrize("broken", ["accumulate", "store"])
def test_recording_that_fails_never_fails_the_request(server, monkeypatch, caplog, broken):
    def boom(*args, **kwargs):
        raise RuntimeError("metrics store is down")

    if broken == "accumulate":
        monkeypatch.setattr(handlers.StepTotals, "add", boom)
    else:
        monkeypatch.setattr(server.core.store, "put_metrics", boom)
    svc = trio.ServiceClient(base_url=server.url, api_key=server.core.store.create_api_key("b"))
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    with caplog.at_level(logging.ERROR, logger="trio.server"):
        fb = tc.forward_backward([datum()])
        op = tc.optim_step(trio.AdamParams(learning_rate=0.01))
        # (a timeout: were the error to escape, the worker would stop and these never resolve)
        assert fb.result(timeout=120).metrics["loss:sum"] > 0 and op.result(timeout=120).metrics["step"] == 1.0
    assert "recording step metrics failed; the request goes on" in caplog.text
    assert svc.create_rest_client().get_run_metrics(tc.model_id) == []
    monkeypatch.undo()  # recording works again: the next step is recorded
    tc.forward_backward([datum()])
    tc.optim_step().result()
    assert [s.step for s in svc.create_rest_client().get_run_metrics(tc.model_id)] == [2]
