"""The tinker wire protocol at the HTTP level: keys, retries, futures, isolation.

What the SDK cannot be made to do on purpose (resend a seq under a new idempotency key,
poll a future that is still pending, use another user's ids) is sent here by hand, with
the SDK's own protobuf encoder, to an in-process server on the tiny Llama.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

pytest.importorskip("tinker")
from tinker.proto import tinker_public_pb2 as public_pb  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.types.forward_backward_input import ForwardBackwardInput  # noqa: E402
from tinker.types.forward_backward_request import ForwardBackwardRequest  # noqa: E402

from tests.sdk.conftest import ServerThread  # noqa: E402
from tinker import types as tt  # noqa: E402

TINY = "trio/tiny-llama"
TOKENS = [1, 17, 23, 99, 5, 8, 40]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from trio_server.app import create_app
    from trio_server.core import Limits, ServiceCore

    core = ServiceCore(tmp_path_factory.mktemp("tinker-core"), dtype="float32", limits=Limits(seq_gap_seconds=3600))  # a stalled seq hangs, not hides
    server = ServerThread(create_app(core, auth=True))
    server.core = core
    yield server
    server.stop()
    core.close()


class Client:
    """Raw tinker calls: every POST under a fresh idempotency key, as the SDK's outer retry does."""

    def __init__(self, url: str, key: str):
        self.url, self.key = url + "/tinker/api/v1/", key

    def post(self, path: str, body: dict | None = None, content: bytes | None = None) -> httpx.Response:
        headers = {"X-API-Key": self.key, "X-Idempotency-Key": f"stainless-python-retry-{uuid.uuid4()}"}
        if content is not None:
            headers["Content-Type"] = "application/x-protobuf"
        return httpx.post(self.url + path, json=body if content is None else None, content=content,
                          headers=headers, timeout=60)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers={"X-API-Key": self.key}, timeout=60)

    def step(self, model_id: str) -> int:
        """The run's optimizer step count, which tinker's optim_step answer leaves out: read
        through TRIO's own API (the REST route maps the tinker model id to the run)."""
        run_id = self.get(f"training_runs/{model_id}").json()["training_run_id"]
        run = httpx.get(self.url.removesuffix("tinker/api/v1/") + f"api/v1/runs/{run_id}",
                        headers={"X-API-Key": self.key.removeprefix("tml-")}, timeout=60)
        return run.json()["step"]

    def result(self, request_id: str) -> httpx.Response:
        """Poll like the SDK: re-poll at once on 408."""
        while True:
            reply = self.post("retrieve_future", {"request_id": request_id, "allow_metadata_only": True})
            if reply.status_code != 408:
                return reply

    def new_model(self) -> tuple[str, str]:
        session = self.post("create_session", {"tags": [], "sdk_version": "0.38.0", "type": "create_session"}).json()["session_id"]
        submitted = self.post("create_model", {"session_id": session, "model_seq_id": 0, "base_model": TINY,
                                               "lora_config": {"rank": 4}, "type": "create_model"}).json()
        assert self.result(submitted["request_id"]).json() == {"model_id": submitted["model_id"], "type": "create_model"}
        return session, submitted["model_id"]

    def new_sampling_session(self, session: str) -> str:
        opened = self.post("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                       "base_model": TINY, "type": "create_sampling_session"})
        return opened.json()["sampling_session_id"]

    def asample(self, ssid: str, num_samples: int, **sampling_params) -> httpx.Response:
        return self.post("asample", {"sampling_session_id": ssid, "seq_id": 0, "num_samples": num_samples,
                                     "prompt": {"chunks": [{"tokens": TOKENS}]}, "sampling_params": sampling_params})

    def forward_backward(self, model_id: str, seq_id: int, loss_fn: str = "cross_entropy",
                         tokens: list[int] = TOKENS) -> httpx.Response:
        datum = tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                         loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        request = ForwardBackwardRequest(forward_backward_input=ForwardBackwardInput(data=[datum], loss_fn=loss_fn),
                                         model_id=model_id, seq_id=seq_id)
        return self.post("forward_backward", content=forward_backward_request_to_proto(request).SerializeToString())

    def optim_step(self, model_id: str, seq_id: int) -> httpx.Response:
        return self.post("optim_step", {"model_id": model_id, "seq_id": seq_id, "type": "optim_step",
                                        "adam_params": {"learning_rate": 1e-3}})


@pytest.fixture(scope="module")
def alice(server):
    client = Client(server.url, "tml-" + server.core.store.create_api_key("alice"))
    client.core = server.core
    return client


@pytest.fixture(scope="module")
def bob(server):
    return Client(server.url, "tml-" + server.core.store.create_api_key("bob"))


def test_keys_need_the_tml_prefix(server):
    key = server.core.store.create_api_key("carol")
    assert Client(server.url, "tml-" + key).post("client/config", {"sdk_version": "0.38.0"}).status_code == 200
    assert Client(server.url, key).post("client/config", {}).status_code == 401  # a bare TRIO key
    assert Client(server.url, "tml-nope").post("client/config", {}).status_code == 401


def test_no_auth_accepts_any_tml_key(tmp_path):
    from trio_server.app import create_app
    from trio_server.core import ServiceCore

    core = ServiceCore(tmp_path, dtype="float32")
    server = ServerThread(create_app(core, auth=False))
    try:
        assert Client(server.url, "tml-anything").post("client/config", {}).status_code == 200
        assert Client(server.url, "anything").post("client/config", {}).status_code == 401
    finally:
        server.stop()
        core.close()


def test_session_routes(alice):
    session = alice.post("create_session", {"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    assert alice.post("session_heartbeat", {"session_id": session, "type": "session_heartbeat"}).status_code == 200
    assert alice.post("telemetry", {"events": [], "session_id": session}).json() == {"status": "accepted"}
    assert alice.post("client/dynamic_config", {"sdk_version": "0.38.0"}).status_code == 200
    assert alice.get("healthz").json() == {"status": "ok"}
    assert alice.post(f"sessions/{session}/finish", {"reason": {"type": "success"}}).status_code == 200


def test_a_session_lists_its_runs_and_samplers(alice, bob):
    session, model_id = alice.new_model()
    ssid = alice.new_sampling_session(session)
    assert alice.result(alice.forward_backward(model_id, 1).json()["request_id"]).status_code == 200
    described = alice.get(f"sessions/{session}").json()
    run_id = alice.get("training_runs").json()["training_runs"][-1]["training_run_id"]
    assert described["training_run_ids"] == [run_id] and len(described["sampler_ids"]) == 1
    assert alice.get(f"samplers/{ssid}").status_code == 200
    assert session in alice.get("sessions?limit=1000").json()["sessions"]
    assert session not in bob.get("sessions").json()["sessions"]
    assert bob.get(f"sessions/{session}").status_code == 404


def test_a_checkpoint_ttl_must_be_whole_seconds_or_null(alice):
    _, model_id = alice.new_model()
    saved = alice.result(alice.post("save_weights", {"model_id": model_id, "path": "ttl", "seq_id": 1}).json()["request_id"])
    route = "training_runs/{}/checkpoints/{}/ttl".format(*saved.json()["path"].removeprefix("tinker://").split("/", 1))
    put = lambda body: httpx.put(alice.url + route, json=body, headers={"X-API-Key": alice.key})  # noqa: E731
    for bad in ({"ttl_seconds": "3600"}, {"ttl_seconds": 1.5}, {"ttl_seconds": True}, {}, {"ttl_seconds": 0},
                {"ttl_seconds": 3650 * 86400 + 1}):
        reply = put(bad)
        assert reply.status_code == 422 and "ttl_seconds" in reply.text, (bad, reply.text)
    assert put({"ttl_seconds": 3600}).json()["expires_at"] is not None
    assert put({"ttl_seconds": None}).json()["expires_at"] is None


def test_publishing_a_checkpoint_is_refused_with_a_reason(alice):
    _, model_id = alice.new_model()
    saved = alice.result(alice.post("save_weights", {"model_id": model_id, "path": "pub", "seq_id": 1}).json()["request_id"])
    run_id, checkpoint = saved.json()["path"].removeprefix("tinker://").split("/", 1)
    reply = alice.post(f"training_runs/{run_id}/checkpoints/{checkpoint}/publish")
    assert reply.status_code == 400 and "not supported by TRIO" in reply.text
    # a route's own error names the path as the tinker client wrote it
    missing = httpx.delete(alice.url + f"training_runs/{run_id}/checkpoints/weights/nope",
                           headers={"X-API-Key": alice.key}, timeout=60)
    assert missing.status_code == 404 and f"'tinker://{run_id}/weights/nope'" in missing.text


def test_external_weights_are_refused_with_where_to_go_in_their_place(alice):
    """save_weights_external (the cookbook's ``weights.download``) fails its future naming
    what to use instead, and keeps its seq: the next call runs at once."""
    _, model_id = alice.new_model()
    body = {"model_id": model_id, "path": "ext", "seq_id": 1, "type": "save_weights_external"}
    external = alice.post("save_weights_external", body).json()
    assert alice.post("save_weights_external", body).json()["request_id"] == external["request_id"]  # a resend
    step = alice.optim_step(model_id, 2).json()
    failed = alice.result(external["request_id"]).json()
    assert failed["category"] == "user" and "download_checkpoint_archive" in failed["error"]
    assert alice.result(step["request_id"]).status_code == 200
    urls = alice.get(f"training_runs/{model_id}/checkpoints/external_weights/ext/external_weights_urls")
    assert urls.status_code == 400 and "save_weights_external" in urls.text


def test_zero_samples_are_refused_not_taken_as_one(alice):
    session, _ = alice.new_model()
    submitted = alice.asample(alice.new_sampling_session(session), 0, max_tokens=1)
    failed = alice.result(submitted.json()["request_id"]).json()
    assert failed["category"] == "user" and "num_samples" in failed["error"]


def test_stability_records_are_refused_at_the_first_sample(alice):
    """The cookbook asks for StableReinforce's records when training with stable_reinforce,
    a loss TRIO lacks: its first sample says so, rather than a training step after a batch."""
    session, _ = alice.new_model()
    body = {"sampling_session_id": alice.new_sampling_session(session), "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"tokens": TOKENS, "type": "encoded_text"}]}, "record_stability_info": True,
            "sampling_params": {"max_tokens": 1}, "type": "sample"}
    failed = alice.result(alice.post("asample", body).json()["request_id"]).json()
    assert failed["category"] == "user" and "stable_reinforce" in failed["error"]


def test_a_resent_seq_runs_once(alice):
    """The SDK's outer retry resends a seq under a new idempotency key: same request, run once."""
    _, model_id = alice.new_model()
    first = alice.forward_backward(model_id, 1).json()
    again = alice.forward_backward(model_id, 1).json()
    assert first["request_id"] == again["request_id"]
    step = alice.optim_step(model_id, 2).json()
    assert alice.optim_step(model_id, 2).json()["request_id"] == step["request_id"]
    metrics = alice.result(step["request_id"]).json()["metrics"]
    assert "grad_norm" in metrics and "step" not in metrics  # the cookbook logs its own step
    assert alice.step(model_id) == 1  # one step, not two

    output = alice.result(first["request_id"])
    assert output.headers["content-type"] == "application/x-protobuf"
    proto = public_pb.ForwardBackwardOutput()
    proto.ParseFromString(output.content)
    assert "loss:sum" in proto.metrics and proto.loss_fn_outputs[0].num_datums == 1


def test_pending_is_408_try_again_and_failed_is_200_error(alice, monkeypatch):
    from trio_server import tinker_api

    monkeypatch.setattr(tinker_api, "POLL_SECONDS", 0.2)
    _, model_id = alice.new_model()
    waiting = alice.forward_backward(model_id, 2).json()  # seq 1 has not arrived: it must wait
    pending = alice.post("retrieve_future", {"request_id": waiting["request_id"]})
    assert pending.status_code == 408
    assert pending.json() == {"type": "try_again", "request_id": waiting["request_id"], "queue_state": "active"}

    bad = alice.forward_backward(model_id, 1, loss_fn="stable_reinforce").json()
    failed = alice.result(bad["request_id"])
    assert failed.status_code == 200
    body = failed.json()
    assert body["category"] == "user" and "stable_reinforce" in body["error"] and "cross_entropy" in body["error"]
    assert alice.result(waiting["request_id"]).status_code == 200  # seq 1 resolved, so seq 2 ran


def test_refusals_are_failed_futures_not_retryable_statuses(alice):
    _, model_id = alice.new_model()
    seq_zero = alice.optim_step(model_id, 0)  # tinker numbers from 1
    assert seq_zero.status_code == 200
    body = alice.result(seq_zero.json()["request_id"]).json()
    assert body["category"] == "user" and "seq_id" in body["error"]
    # malformed bodies: a 4xx the SDK does not retry, never a 5xx it would
    assert alice.post("create_model", {"type": "create_model"}).status_code == 400
    assert alice.post("forward_backward", content=b"\xff not a protobuf").status_code == 400
    assert alice.post("session_heartbeat", {}).status_code == 422
    unknown = alice.optim_step("sess-000000000000:train:9", 1)
    assert unknown.status_code == 200 and "not found" in alice.result(unknown.json()["request_id"]).json()["error"]


def test_a_refused_call_keeps_its_message_not_its_request(alice, bob, monkeypatch):
    """A refusal's future kept the exception with the frames it was raised through, the
    route's, holding the request's body (38 MiB a call with a 20 MB field, for 10 minutes,
    and as many as a client sent). It keeps the message, and at most LOCAL_FUTURES_PER_USER
    done futures of a user are held (another user's are not pushed out)."""
    import gc

    from trio_server import tinker_api

    [door] = [o for o in gc.get_objects() if isinstance(o, tinker_api.TinkerDoor) and o.core is alice.core]
    monkeypatch.setattr(tinker_api, "LOCAL_FUTURES_PER_USER", 3)

    def refused_sample(client, k: int) -> str:  # an unknown sampling session, with a large field ignored
        reply = client.post("asample", {"sampling_session_id": f"sess-000000000000:sample:{k}", "seq_id": 0,
                                        "num_samples": 1, "prompt": {"chunks": [{"tokens": TOKENS}]},
                                        "sampling_params": {}, "junk": "x" * 1_000_000})
        refused = client.result(reply.json()["request_id"]).json()
        assert refused["category"] == "user" and "not found" in refused["error"]
        return reply.json()["request_id"]

    bobs = refused_sample(bob, 99)
    for k in range(6):
        refused_sample(alice, k)
    assert sum(f.user_id != door.local[bobs].user_id for f in door.local.values()) <= 4  # 3 done, the newest
    assert "not found" in bob.result(bobs).json()["error"]  # not pushed out by Alice's
    for future in door.local.values():
        error = future.task.exception()
        assert error.__traceback__ is None and error.__context__ is None and error.__cause__ is None


def test_a_refused_call_keeps_its_place_in_its_run(alice):
    """Refused by the door (no adam_params) or by the core (no such checkpoint), a call
    still uses its seq_id: the next one runs without waiting for a gap to time out."""
    _, model_id = alice.new_model()
    no_adam = alice.post("optim_step", {"model_id": model_id, "seq_id": 1, "type": "optim_step"}).json()
    missing = alice.post("load_weights", {"model_id": model_id, "seq_id": 2, "type": "load_weights",
                                          "path": "tinker://run-0/weights/nope", "optimizer": False}).json()
    step = alice.optim_step(model_id, 3).json()
    assert "AdamW" in alice.result(no_adam["request_id"]).json()["error"]
    assert "'tinker://run-0/weights/nope' not found" in alice.result(missing["request_id"]).json()["error"]  # as written
    assert alice.result(step["request_id"]).status_code == 200
    assert alice.step(model_id) == 0  # no gradients yet


def test_limits_fail_the_future_naming_the_limit(alice, server):
    session, model_id = alice.new_model()
    too_long = alice.forward_backward(model_id, 1, tokens=[5] * (server.core.limits.max_seq_len + 2)).json()
    assert "max_seq_len" in alice.result(too_long["request_id"]).json()["error"]
    assert alice.result(alice.optim_step(model_id, 2).json()["request_id"]).status_code == 200  # seq 1 was not lost
    many = alice.asample(alice.new_sampling_session(session), 10**9, max_tokens=1)
    assert many.json()["sample_sequence_ids"] == []  # not a billion ids built for a refusal
    failed = alice.result(many.json()["request_id"]).json()
    assert failed["category"] == "user" and "num_samples: must be in [1, 1024], got 1000000000" in failed["error"]


def test_the_sdks_chunks_of_a_large_batch_fit_the_request_token_limit(alice, server):
    """The SDK cuts a forward_backward into chunks by datums and by estimated bytes; the
    bytes bound the client config gives keeps each chunk within max_tokens_per_request
    (the SDK's default, 5 MB, let 144,000 tokens through as one chunk)."""
    from types import SimpleNamespace

    from tinker.lib.public_interfaces.training_client import TrainingClient

    config = tt.ClientConfigResponse(**alice.post("client/config", {}).json())
    tokens = [5] * 481
    data = [tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                     loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 480})] * 300
    client = SimpleNamespace(holder=SimpleNamespace(_client_config=config))
    chunks = list(TrainingClient._chunked_requests_generator(client, data))
    assert sum(len(c.data) for c in chunks) == 300
    assert max(len(c.data) for c in chunks) * 480 <= server.core.limits.max_tokens_per_request


def test_a_sample_without_max_tokens_runs_to_the_models_own_context(alice):
    """The SDK's default max_tokens (None): what the model's context (512 for the tiny
    Llama, below the server's max_seq_len) leaves after the prompt."""
    session, _ = alice.new_model()
    submitted = alice.asample(alice.new_sampling_session(session), 1, temperature=1.0, seed=3).json()
    reply = alice.result(submitted["request_id"])
    assert reply.status_code == 200 and not reply.headers["content-type"].startswith("application/json"), reply.text
    proto = public_pb.SampleResponse()
    proto.ParseFromString(reply.content)
    assert 0 < len(proto.sequences[0].tokens) // 4 <= 512 - len(TOKENS)  # int32 tokens


def test_users_are_isolated(alice, bob):
    _, model_id = alice.new_model()
    submitted = alice.forward_backward(model_id, 1).json()
    assert bob.post("get_info", {"model_id": model_id, "type": "get_info"}).status_code == 404
    assert bob.post("retrieve_future", {"request_id": submitted["request_id"]}).status_code == 404
    refused = bob.forward_backward(model_id, 2).json()
    assert "not found" in bob.result(refused["request_id"]).json()["error"]
    run_id = alice.get("training_runs").json()["training_runs"][-1]["training_run_id"]
    assert bob.get(f"training_runs/{run_id}").status_code == 404
    assert run_id not in {r["training_run_id"] for r in bob.get("training_runs").json()["training_runs"]}


def test_sampling_resend_and_sampler_lookup(alice):
    session, model_id = alice.new_model()
    ssid = alice.new_sampling_session(session)
    assert alice.get(f"samplers/{ssid}").json()["base_model"] == TINY
    body = {"sampling_session_id": ssid, "seq_id": 0, "num_samples": 3, "type": "sample",
            "prompt": {"chunks": [{"tokens": TOKENS, "type": "encoded_text"}]},
            "sampling_params": {"max_tokens": 3, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "stop": [], "seed": 1}}
    first, again = alice.post("asample", body).json(), alice.post("asample", body).json()
    assert first["request_id"] == again["request_id"] and len(first["sample_sequence_ids"]) == 3
    reply = alice.result(first["request_id"])
    proto = public_pb.SampleResponse()
    proto.ParseFromString(reply.content)
    assert len(proto.sequences) == 3 and all(len(s.logprobs) == len(s.tokens) == 4 * 3 for s in proto.sequences)  # int32, float32


def test_tinker_ids_survive_a_restart(tmp_path):
    """After SIGKILL and a restart on the same data dir, a tinker client's ids still work:
    its model continues at its next seq, finished futures are still answered, its
    sampling session still samples."""
    from tests.sdk.conftest import ServeProcess

    server = ServeProcess(tmp_path, "--dtype", "float32")
    client = Client("", "tml-" + server.create_key())
    server.start()
    try:
        client.url = server.url + "/tinker/api/v1/"
        session, model_id = client.new_model()
        first = client.forward_backward(model_id, 1).json()["request_id"]
        assert client.result(client.optim_step(model_id, 2).json()["request_id"]).status_code == 200
        ssid = client.new_sampling_session(session)
        server.kill()
        server.start()

        assert client.post("get_info", {"model_id": model_id}).json()["model_data"]["model_name"] == TINY
        assert client.result(first).headers["content-type"] == "application/x-protobuf"
        assert client.result(client.forward_backward(model_id, 3).json()["request_id"]).status_code == 200
        assert client.result(client.optim_step(model_id, 4).json()["request_id"]).status_code == 200
        assert client.step(model_id) == 2
        body = {"sampling_session_id": ssid, "seq_id": 0, "num_samples": 1,
                "prompt": {"chunks": [{"tokens": TOKENS, "type": "encoded_text"}]},
                "sampling_params": {"max_tokens": 2}}
        assert client.result(client.post("asample", body).json()["request_id"]).status_code == 200
    finally:
        server.stop()


def test_tinker_and_pytrio_users_share_one_forward_backward_pass(server, alice):
    """Cross-tenant co-batching is the core's: a tinker call and a pytrio call queued
    together on one base model run in one engine pass."""
    import pytrio as trio
    from tests.polling import wait_until

    _, model_id = alice.new_model()
    pytrio_user = trio.ServiceClient(base_url=server.url, api_key=server.core.store.create_api_key("dave"))
    other = pytrio_user.create_lora_training_client(base_model=TINY, rank=2)
    worker = server.core.workers[TINY]
    engine, calls = worker.engine, []
    real = engine.forward_backward
    engine.forward_backward = lambda jobs: calls.append(len(jobs)) or real(jobs)
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={"target_tokens": TOKENS[1:]})
    try:
        with engine.host.lock:  # keep the worker busy so both queue up behind this
            blocker = other.forward([datum])
            wait_until(lambda: bool(worker.running), "the blocker to run")
            pytrio_future = other.forward_backward([datum])
            tinker_request = alice.forward_backward(model_id, 1).json()["request_id"]
            wait_until(lambda: len(worker.snapshot()) == 2, "both to queue")
        blocker.result()
        assert pytrio_future.result().metrics["loss:sum"] > 0
        assert alice.result(tinker_request).status_code == 200
    finally:
        engine.forward_backward = real
    assert calls == [2], calls


def test_a_client_from_a_state_refuses_another_optimizer_or_base_model(alice):
    """create_training_client_from_state(path, optimizer=..., base_model=...): both were
    ignored (a Dimuon run trained with AdamW), as create_model refuses them."""
    session, model_id = alice.new_model()
    saved = alice.result(alice.post("save_weights", {"model_id": model_id, "path": "from", "seq_id": 1}).json()["request_id"])
    path = saved.json()["path"]

    def from_state(seq: int, **extra) -> httpx.Response:
        body = {"session_id": session, "model_seq_id": seq, "path": path, "optimizer": False, "type": "load_weights"}
        return alice.result(alice.post("load_weights", body | extra).json()["request_id"])

    dimuon = {"optimizer_config": {"type": "dimuon"}}
    assert "'adamw' only, got 'dimuon'" in alice.result(
        alice.post("create_model", {"session_id": session, "model_seq_id": 1, "base_model": TINY,
                                    "type": "create_model", **dimuon}).json()["request_id"]).json()["error"]
    assert "'adamw' only, got 'dimuon'" in from_state(2, **dimuon).json()["error"]
    other = from_state(3, base_model="Qwen/Qwen3-8B").json()["error"]
    assert f"base_model: {path} was trained on {TINY!r}, not 'Qwen/Qwen3-8B'" in other
    assert from_state(4, base_model=TINY, optimizer_config={"type": "adamw"}).status_code == 200


def test_routes_not_served_are_named_as_such(alice):
    """tinker's account features got a bare {'detail': 'Not Found'} (or a 405)."""
    for reply in (alice.post("copy_weights", {}), alice.post("sessions/search", {}),
                  alice.get("sessions/s-1/trace_export"), alice.get("no/such/route")):
        assert reply.status_code == 404 and "not served by TRIO" in reply.text, reply.text
    assert httpx.post(alice.url + "copy_weights", json={}).status_code == 401  # still a key first


def test_a_create_whose_user_metadata_is_not_text_is_refused_and_the_run_list_keeps_working(alice):
    """A lone surrogate ("\\ud800" in JSON), or a list, kept with a run broke the user's
    listing of runs."""
    session = alice.post("create_session", {"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    body = json.dumps({"session_id": session, "model_seq_id": 0, "base_model": TINY, "lora_config": {"rank": 4},
                       "type": "create_model", "user_metadata": {"note": "a\ud800"}})  # sent as "a\\ud800"
    reply = httpx.post(alice.url + "create_model", content=body, timeout=60,
                       headers={"X-API-Key": alice.key, "Content-Type": "application/json"})
    assert reply.status_code == 400 and "user_metadata.note: holds a lone UTF-16 surrogate" in reply.text, reply.text
    listed = alice.post("create_model", {"session_id": session, "model_seq_id": 1, "base_model": TINY,
                                         "lora_config": {"rank": 4}, "type": "create_model", "user_metadata": ["x"]})
    assert listed.status_code == 400 and "user_metadata: must be an object of strings, got list" in listed.text
    assert alice.get("training_runs").status_code == 200


def test_a_served_route_called_with_another_method_is_a_405_naming_the_methods_it_takes(alice):
    reply = alice.get("create_model")
    assert reply.status_code == 405 and reply.headers["allow"] == "POST", (reply.status_code, reply.text)
    assert "GET /api/v1/create_model: this route takes POST" in reply.text
