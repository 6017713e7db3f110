"""The HTTP service: auth isolation, malformed input, idempotency, ordering, limits."""

from __future__ import annotations

import re
import threading

import httpx
import pytest

import pytrio as trio
from trio_server.app import create_app
from trio_server.core import Limits, ServiceCore

from ..sdk.conftest import ServerThread

MODEL = "trio/tiny-llama"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    core = ServiceCore(tmp_path_factory.mktemp("srv"), dtype="float32",
                       limits=Limits(max_batch_size=8, max_seq_len=256, max_tokens_per_request=600))
    srv = ServerThread(create_app(core, auth=True, max_body_bytes=200_000))
    srv.core = core
    yield srv
    srv.stop()
    core.close()


def client_for(server) -> trio.ServiceClient:
    return trio.ServiceClient(base_url=server.url, api_key=server.core.store.create_api_key("t"))


def datum(n=6):
    toks = list(range(1, n + 2))
    return trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]),
                      loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * n})


def test_health_needs_no_key_everything_else_does(server):
    assert httpx.get(server.url + "/api/v1/healthz").json() == {"status": "ok"}
    for method, path in [("GET", "/api/v1/runs"), ("POST", "/api/v1/create_model"), ("GET", "/api/v1/capabilities")]:
        r = httpx.request(method, server.url + path, json={})
        assert r.status_code == 401, path
        r = httpx.request(method, server.url + path, json={}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["category"] == "authentication"


def test_keys_are_stored_hashed(server):
    key = server.core.store.create_api_key("hashed")
    rows = server.core.store.engine.connect().exec_driver_sql("select key_hash from api_keys").fetchall()
    assert key not in {r[0] for r in rows}


def test_users_are_isolated(server):
    alice, bob = client_for(server), client_for(server)
    tc = alice.create_lora_training_client(base_model=MODEL, rank=2)
    state = tc.save_state("mine").result().path
    sampler_path = tc.save_weights_for_sampler("mine-s").result().path
    sampler = alice.create_sampling_client(model_path=sampler_path)

    bob_rest = bob.create_rest_client()
    assert bob_rest.list_training_runs() == [] and bob_rest.list_user_checkpoints() == []
    with pytest.raises(trio.NotFoundError):
        bob_rest.get_training_run(tc.model_id)
    with pytest.raises(trio.NotFoundError):
        bob.create_sampling_client(model_path=sampler_path)
    with pytest.raises(trio.NotFoundError):
        bob.create_training_client_from_state(state)
    with pytest.raises(trio.NotFoundError):
        bob_rest.delete_checkpoint(state)
    with pytest.raises(trio.NotFoundError):
        bob_rest.download_checkpoint_archive(state, progress=False)
    bob_sampler = trio.SamplingClient(bob._session, sampler.sampler_id, MODEL)  # a stolen id
    with pytest.raises(trio.NotFoundError):
        bob_sampler.sample(trio.ModelInput.from_ints([1, 2]), 1, trio.SamplingParams(max_tokens=2)).result()
    bob_trainer = trio.TrainingClient(bob._session, tc.model_id, MODEL)
    with pytest.raises(trio.NotFoundError):
        bob_trainer.forward([datum()]).result()
    assert len(alice.create_rest_client().list_user_checkpoints()) == 2


@pytest.mark.parametrize(
    "body, status",
    [
        (b"{not json", 400),
        (b'{"base_model": 5}', 422),
        (b'{"base_model": "trio/tiny-llama", "lora_config": {"rank": "big"}}', 422),
        (b"[]", 422),
        (b'{"base_model": "trio/tiny-llama", "extra": 1}', 422),
    ],
)
def test_malformed_and_mistyped_bodies_get_4xx_with_message(server, body, status):
    key = server.core.store.create_api_key("m")
    r = httpx.post(server.url + "/api/v1/create_model", content=body,
                   headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert r.status_code == status
    assert r.json()["error"]["message"]


def test_user_metadata_that_is_not_text_is_refused_and_the_users_listings_keep_working(server):
    """JSON's "\\ud800" parses to a lone surrogate: save_weights kept it, and from then on
    every listing of the user's checkpoints was a 500 (a reply cannot encode it)."""
    key = server.core.store.create_api_key("metadata")
    service = trio.ServiceClient(base_url=server.url, api_key=key)
    tc = service.create_lora_training_client(base_model=MODEL, rank=2)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    for metadata, where in (('{"k": "a\\ud800"}', "user_metadata.k"), ('{"\\udfff": "v"}', "user_metadata")):
        body = f'{{"model_id": "{tc.model_id}", "seq": 9, "kind": "sampler_weights", "user_metadata": {metadata}}}'
        r = httpx.post(server.url + "/api/v1/save_weights", content=body, headers=headers)
        assert r.status_code == 422 and where in r.json()["error"]["message"], r.text
        assert "not text" in r.json()["error"]["message"]
    assert service.create_rest_client().list_user_checkpoints() == []
    assert httpx.get(server.url + "/api/v1/checkpoints", headers=headers).status_code == 200


def test_wrong_types_in_forward_name_the_field(server):
    key = server.core.store.create_api_key("w")
    r = httpx.post(server.url + "/api/v1/forward", headers={"Authorization": f"Bearer {key}"},
                   json={"model_id": "run-0", "seq": 0, "data": [{"model_input": {"chunks": [{"tokens": ["a"]}]}}]})
    assert r.status_code == 422 and "data[0].model_input.chunks[0].tokens[0]" in r.json()["error"]["message"]


def test_idempotent_submit_runs_once(server):
    svc = client_for(server)
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    tc.forward_backward([datum()]).result()
    key = svc._session.transport.headers["Authorization"]
    body = {"model_id": tc.model_id, "seq": 1, "adam_params": {"learning_rate": 0.01}}
    ids = {httpx.post(server.url + "/api/v1/optim_step", json=body,
                      headers={"Authorization": key, "Idempotency-Key": "k-1"}).json()["request_id"] for _ in range(3)}
    assert len(ids) == 1
    tc._order._next_number = 2  # the raw submits above used seq 1
    tc.forward_backward([datum()])
    assert tc.optim_step().result().metrics["step"] == 2.0  # the keyed step ran once, not three times


def test_ordering_under_concurrency(server):
    """Two clients, many interleaved fb/optim requests from threads: each run stays in order."""
    svc = client_for(server)
    runs = [svc.create_lora_training_client(base_model=MODEL, rank=2, seed=s) for s in (1, 2)]
    steps: dict[str, list] = {r.model_id: [] for r in runs}

    def drive(tc):
        futures = []
        for _ in range(6):
            futures.append(tc.forward_backward([datum()]))
            futures.append(tc.optim_step(trio.AdamParams(learning_rate=1e-3)))
        steps[tc.model_id] = [f.result().metrics["step"] for f in futures[1::2]]

    threads = [threading.Thread(target=drive, args=(tc,)) for tc in runs]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert all(s == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] for s in steps.values()), steps


def test_limits_name_the_limit_and_keep_the_run_going(server):
    svc = client_for(server)
    assert svc.get_server_capabilities().max_batch_size == 8
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    with pytest.raises(trio.ValidationError, match="max_batch_size=8"):
        tc.forward_backward([datum()] * 9).result()
    with pytest.raises(trio.ValidationError, match="max_seq_len=256"):
        tc.forward([datum(300)]).result()
    with pytest.raises(trio.ValidationError, match="max_tokens_per_request=600"):
        tc.forward([datum(100)] * 7).result()
    assert tc.forward([datum()]).result().metrics["loss:sum"] > 0  # later calls don't wait forever


def test_usage_and_a_spent_budget_over_http(server):
    """GET /usage with the key, through the SDK's HTTP transport; a spent budget is a 403
    naming the budget and the usage, before anything is queued."""
    key = server.core.store.create_api_key("budgeted", budget_tokens=6)
    svc = trio.ServiceClient(base_url=server.url, api_key=key)
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    tc.forward_backward([datum(6)]).result()
    rest = svc.create_rest_client()
    usage = rest.get_usage()
    assert (usage.trained, usage.prefilled, usage.sampled, usage.total, usage.budget_tokens) == (6, 0, 0, 6, 6)
    assert [(r.run_id, r.trained) for r in usage.runs] == [(tc.model_id, 6)]
    assert rest.get_run_usage(tc.model_id) == usage.runs[0]

    r = httpx.post(server.url + "/api/v1/forward", headers={"Authorization": f"Bearer {key}"},
                   json={"model_id": tc.model_id, "seq": 1, "data": [datum().model_dump(mode="json")]})
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["category"] == "validation" and "used 6 tokens" in error["message"]
    assert "budget of 6" in error["message"]
    assert rest.get_usage() == usage


def test_oversized_body_refused_before_reading(server):
    key = server.core.store.create_api_key("big")
    r = httpx.post(server.url + "/api/v1/forward", content=b"x" * 300_000,
                   headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_a_call_refused_unread_leaves_its_place_in_the_order_to_the_next(server):
    """A body over the size limit is refused before the service reads it (so before it
    sees the call's seq): the SDK gives the seq back and the run's next call takes it.
    Else that call would wait seq_gap_seconds (30 s here) for a seq that never comes and
    be run only after the service skipped it (next_seq 2 instead of 1)."""
    tc = client_for(server).create_lora_training_client(base_model=MODEL, rank=2)
    heavy = trio.Datum(model_input=trio.ModelInput.from_ints(list(range(1, 201))),
                       loss_fn_inputs={"target_tokens": list(range(2, 202)), "weights": [0.123456789] * 200})
    with pytest.raises(trio.ValidationError, match="exceeds the limit") as refused:
        tc.forward_backward([heavy] * 60).result()
    assert refused.value.status_code == 413 and refused.value.seq_unused
    assert server.core.next_seq.get(tc.model_id, 0) == 0
    tc.forward_backward([datum()]).result()
    assert server.core.next_seq[tc.model_id] == 1


def test_openapi_schema(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    assert "/api/v1/forward_backward" in schema["paths"] and "/api/v1/retrieve_future" in schema["paths"]


def test_the_console_is_static_needs_no_key_and_loads_nothing_from_elsewhere(server):
    page = httpx.get(server.url + "/console")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name, kind in (("console.js", "javascript"), ("console.css", "text/css")):
        r = httpx.get(f"{server.url}/console/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"] and f"/console/{name}" in page.text
        # offline: no CDN, no external font; the only URL is the SVG namespace
        assert re.findall(r"https?://[^\s\"'`)]+", r.text) in ([], ["http://www.w3.org/2000/svg"])
    r = httpx.get(server.url + "/console/app.py")
    assert r.status_code == 404 and r.json()["error"]["category"] == "not_found"
    assert "/console" not in httpx.get(server.url + "/openapi.json").json()["paths"]


# -- overload: bounded queues, 429 with Retry-After, the SDK backs off and resends ------------


@pytest.fixture
def tight(tmp_path):
    """A server whose users may each have one request pending."""
    core = ServiceCore(tmp_path, dtype="float32", limits=Limits(max_pending_per_user=1, retry_after_seconds=0.2))
    srv = ServerThread(create_app(core, auth=True))
    srv.core = core
    yield srv
    srv.stop()
    core.close()


def held(server):
    """The worker's engine lock: while held, the request running stays pending."""
    return server.core.workers[MODEL].engine.host.lock


def test_over_a_queue_bound_the_sdk_backs_off_and_resends_and_nothing_accepted_is_dropped(tight):
    from ..polling import wait_until

    svc = client_for(tight)
    caps = svc.get_server_capabilities()
    assert caps.max_pending_per_user == 1 and caps.max_pending_total == 4096
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    auth = svc._session.transport.headers
    worker = tight.core.workers[MODEL]
    with held(tight):
        fb = tc.forward_backward([datum()])  # accepted; runs, and stays pending while held
        wait_until(lambda: bool(worker.running), "forward_backward to run")
        step = tc.optim_step(trio.AdamParams(learning_rate=1e-2))  # refused (429) until fb finishes
        body = {"model_id": tc.model_id, "seq": 5, "adam_params": {"learning_rate": 0.01}}
        r = httpx.post(tight.url + "/api/v1/optim_step", json=body, headers=auth)
        assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.headers["retry-after-ms"] == "200"
        assert r.json()["error"] == {"category": "capacity", "message": "capacity max_pending_per_user: 1 requests "
                                     "of this user pending, the limit is 1; retry in 0.2 s"}
        assert not step.done()
    assert fb.result().metrics["loss:sum"] > 0
    assert step.result().metrics["step"] == 1.0  # resent after fb finished, and ran once


def test_the_sdk_gives_up_with_capacity_error_at_its_deadline_and_the_held_request_still_runs(tight, monkeypatch):
    from pytrio import session as session_mod

    from ..polling import wait_until

    svc = client_for(tight)
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    worker = tight.core.workers[MODEL]
    monkeypatch.setattr(session_mod, "RECONNECT_SECONDS", 1.0)
    with held(tight):
        fb = tc.forward_backward([datum()])
        wait_until(lambda: bool(worker.running), "forward_backward to run")
        other = trio.ServiceClient(base_url=tight.url, api_key=svc._session.transport.headers["Authorization"][7:])
        with pytest.raises(trio.CapacityError, match=r"create_model: gave up after \d+ tries over \d+ s: "
                                                     r"capacity max_pending_per_user") as err:
            other.create_lora_training_client(base_model=MODEL, rank=2)
        assert err.value.status_code == 429
    assert fb.result().metrics["loss:sum"] > 0  # accepted before: not dropped


def test_the_tinker_and_openai_doors_answer_429_with_retry_after_in_their_shapes(tight):
    from ..polling import wait_until

    svc = client_for(tight)
    key = svc._session.transport.headers["Authorization"][7:]
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    worker = tight.core.workers[MODEL]
    with held(tight):
        fb = tc.forward_backward([datum()])
        wait_until(lambda: bool(worker.running), "forward_backward to run")
        r = httpx.post(tight.url + "/tinker/api/v1/optim_step", headers={"X-API-Key": "tml-" + key},
                       json={"model_id": tc.model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}})
        assert r.status_code == 429 and r.headers["retry-after-ms"] == "200"  # the tinker SDK waits, resends
        assert r.json()["error"]["category"] == "capacity"
        r = httpx.post(tight.url + "/openai/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert "max_pending_per_user" in r.json()["error"]["message"]
    fb.result()


def test_a_tinker_sample_past_a_queue_bound_is_429_not_a_failed_future(tight):
    """The cookbook's rollouts send hundreds of samples at once: past the bound the SDK must
    get the 429 it waits out and resends, as for training calls."""
    from ..polling import wait_until

    svc = client_for(tight)
    key = svc._session.transport.headers["Authorization"][7:]
    headers = {"X-API-Key": "tml-" + key}
    url = tight.url + "/tinker/api/v1/"
    session = httpx.post(url + "create_session", headers=headers, json={"tags": [], "sdk_version": "0.38.0"}).json()
    opened = httpx.post(url + "create_sampling_session", headers=headers, json={
        "session_id": session["session_id"], "sampling_session_seq_id": 0, "base_model": MODEL}).json()
    body = {"sampling_session_id": opened["sampling_session_id"], "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"tokens": [1, 2, 3]}]}, "sampling_params": {"max_tokens": 2}}
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    worker = tight.core.workers[MODEL]
    with held(tight):
        fb = tc.forward_backward([datum()])
        wait_until(lambda: bool(worker.running), "forward_backward to run")
        r = httpx.post(url + "asample", headers=headers, json=body)
        assert r.status_code == 429 and r.headers["retry-after-ms"] == "200", r.text
    fb.result()
    r = httpx.post(url + "asample", headers=headers, json=body)  # the resend, once there is room
    assert r.status_code == 200 and r.json()["request_id"].startswith("req-")


def test_openai_prompts_that_do_not_all_fit_the_queue_are_refused_whole(tight):
    """Each prompt of a completion is a core request: none is sent unless all fit (a 429
    the client may retry), and more than the bound can ever hold is a 400."""
    import dataclasses

    from ..polling import wait_until

    svc = client_for(tight)
    key = svc._session.transport.headers["Authorization"][7:]
    tight.core.limits = dataclasses.replace(tight.core.limits, max_pending_per_user=3)
    completions = tight.url + "/openai/v1/completions"
    headers = {"Authorization": f"Bearer {key}"}
    r = httpx.post(completions, headers=headers, json={"model": MODEL, "prompt": ["a", "b", "c", "d"], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    worker = tight.core.workers[MODEL]
    with held(tight):
        fbs = [tc.forward_backward([datum()]) for _ in range(2)]  # two of the three places taken
        wait_until(lambda: len(worker.running) + len(worker.pending) == 2, "both forward_backwards to arrive")
        submitted = len(tight.core.futures)
        r = httpx.post(completions, headers=headers, json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1})
        assert r.status_code == 429 and "this call needs 2 more" in r.json()["error"]["message"], r.text
        assert len(tight.core.futures) == submitted  # neither prompt was sent
    for fb in fbs:
        fb.result()
    r = httpx.post(completions, headers=headers, json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    tight.core.limits = dataclasses.replace(tight.core.limits, max_pending_per_user=None, max_pending_total=3)
    r = httpx.post(completions, headers=headers, json={"model": MODEL, "prompt": ["a", "b", "c", "d"], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text  # the total bound: never a 429
