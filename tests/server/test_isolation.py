"""Per-user isolation on every route that names a run, sampler, checkpoint or request.

Alice owns a trained run, a sampler, a ``weights`` and a ``sampler_weights`` checkpoint
and finished requests. Bob, with his own key, sends each route Alice's ids: every one
answers 404 ``not_found``, byte for byte what it answers for an id that never existed
(so not even the existence of Alice's things leaks), and nothing of Alice's changes.
Submits with a foreign id are refused at submit time (``core._route`` raises before
anything is queued), so no future is ever created for them.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

import pytrio as trio
from pytrio import types as t
from trio_server.app import create_app
from trio_server.core import ServiceCore

from ..polling import wait_until
from ..sdk.conftest import ServerThread

MODEL = "trio/tiny-llama"
ID_FIELDS = {"model_id", "sampler_id", "path", "model_path"}  # request fields that name something owned


def datum(n: int = 6) -> trio.Datum:
    toks = list(range(1, n + 2))
    return trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]),
                      loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * n})


DATA = [datum().model_dump(mode="json")]
PROMPT = trio.ModelInput.from_ints([1, 2, 3, 4]).model_dump(mode="json")


class Api:
    """Raw HTTP as one user: exactly what goes on the wire, no SDK mapping in between."""

    def __init__(self, url: str, key: str):
        self.client = httpx.Client(base_url=url + "/api/v1", headers={"Authorization": f"Bearer {key}"},
                                   timeout=60)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self.client.request(method, path, **kwargs)

    def submit(self, op: str, body: dict, key: str | None = None) -> str:
        headers = {"Idempotency-Key": key} if key else {}
        r = self.client.post(f"/{op}", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()["request_id"]

    def retrieve(self, request_id: str, timeout: float = 30.0) -> httpx.Response:
        return self.client.post("/retrieve_future", json={"request_id": request_id, "timeout": timeout})

    def wait(self, request_id: str, deadline_s: float = 120.0) -> dict:
        """Long-poll until the request is no longer pending (no sleeping: the server waits)."""
        deadline = time.monotonic() + deadline_s
        while True:
            r = self.retrieve(request_id)
            assert r.status_code == 200, r.text
            if r.json()["status"] != "pending":
                return r.json()
            assert time.monotonic() < deadline, f"{request_id} still pending"

    def call(self, op: str, body: dict) -> dict:
        out = self.wait(self.submit(op, body))
        assert out["status"] == "done", out
        return out["result"]


@dataclass
class World:
    core: ServiceCore
    url: str
    alice: Api
    bob: Api
    alice_user: str
    ids: dict[str, str]  # what Alice owns: run, sampler, weights, sampler_weights, request, old_request
    bob_run: str
    baseline: dict[str, Any]


def fresh_ids(ids: dict[str, str]) -> dict[str, str]:
    """Ids of the same shapes as Alice's that name nothing at all."""
    run = "run-" + secrets.token_hex(6)
    return {
        "run": "run-" + secrets.token_hex(6),
        "sampler": "sampler-" + secrets.token_hex(8),
        "weights": f"trio://{run}/weights/{ids['weights'].rsplit('/', 1)[1]}",
        "sampler_weights": f"trio://{run}/sampler_weights/{ids['sampler_weights'].rsplit('/', 1)[1]}",
        "request": "req-" + secrets.token_hex(8),
        "old_request": "req-" + secrets.token_hex(8),
    }


def alice_state(w: World) -> dict[str, Any]:
    """Everything of Alice's that Bob's attempts must leave as it was."""
    run = w.alice.request("GET", f"/runs/{w.ids['run']}").json()
    archives = {}
    for kind in ("weights", "sampler_weights"):
        r = w.alice.request("GET", "/checkpoints/archive", params={"path": w.ids[kind]})
        assert r.status_code == 200, r.text
        archives[kind] = hashlib.sha256(r.content).hexdigest()
    forward = w.alice.call("forward", {"model_id": w.ids["run"], "seq": w.core.next_seq.get(w.ids["run"], 0),
                                       "data": DATA})
    return {
        "step": run["step"],
        "metrics": w.alice.request("GET", f"/runs/{w.ids['run']}/metrics").json(),
        "run_checkpoints": run["checkpoints"],
        "checkpoints": w.alice.request("GET", "/checkpoints").json(),
        "archives": archives,
        "request": w.alice.retrieve(w.ids["request"], 5).content,
        "old_request": w.alice.retrieve(w.ids["old_request"], 5).content,
        "logprobs": forward["loss_fn_outputs"][0]["logprobs"]["data"],
        "sampler_logprobs": w.alice.call("compute_logprobs", {"sampler_id": w.ids["sampler"], "prompt": PROMPT}),
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    core = ServiceCore(tmp_path_factory.mktemp("isolation"), dtype="float32")
    srv = ServerThread(create_app(core, auth=True))
    alice_key, bob_key = core.store.create_api_key("alice"), core.store.create_api_key("bob")
    alice, bob = Api(srv.url, alice_key), Api(srv.url, bob_key)

    run = alice.call("create_model", {"base_model": MODEL, "lora_config": {"rank": 2, "seed": 1}})["model_id"]
    alice.call("forward_backward", {"model_id": run, "seq": 0, "data": DATA})
    alice.call("optim_step", {"model_id": run, "seq": 1, "adam_params": {"learning_rate": 0.05}})
    logged = alice.request("POST", f"/runs/{run}/metrics", json={"step": None, "metrics": {"reward": 0.5}})
    assert logged.status_code == 200, logged.text
    weights = alice.call("save_weights", {"model_id": run, "seq": 2, "name": "w", "kind": "weights"})["path"]
    sampler_weights = alice.call("save_weights", {"model_id": run, "seq": 3, "name": "s",
                                                  "kind": "sampler_weights"})["path"]
    sampler = alice.call("create_sampler", {"model_path": sampler_weights})["sampler_id"]
    request = alice.submit("sample", {"sampler_id": sampler, "prompt": PROMPT,
                                      "sampling_params": {"max_tokens": 4, "temperature": 0.0}})
    assert alice.wait(request)["status"] == "done"
    old_request = alice.submit("get_info", {"model_id": run})
    assert alice.wait(old_request)["status"] == "done"
    with core.lock:  # as if it had left memory (core._forget_old): only the store can answer
        core.futures.pop(old_request)
        core.owners.pop(old_request)
    bob_run = bob.call("create_model", {"base_model": MODEL, "lora_config": {"rank": 2}})["model_id"]

    ids = {"run": run, "sampler": sampler, "weights": weights, "sampler_weights": sampler_weights,
           "request": request, "old_request": old_request}
    w = World(core, srv.url, alice, bob, core.store.user_for_key(alice_key) or "", ids, bob_run, {})
    w.baseline = alice_state(w)
    assert w.baseline["step"] == 1 and len(w.baseline["checkpoints"]) == 2
    ((step,),) = [w.baseline["metrics"]]
    assert step["step"] == 1 and step["metrics"]["reward"] == 0.5 and "loss" in step["metrics"]
    assert all(b'"status":"done"' in w.baseline[k] for k in ("request", "old_request"))
    yield w
    srv.stop()
    core.close()


def _seq(w: World, run_id: str) -> int:
    """The number that would run next: the strongest attempt. A refused call still uses
    its number (it is queued to fail in its place), so wait until the run's queue is empty."""
    wait_until(lambda: not any(i.run_id == run_id for wk in w.core.workers.values() for i in wk.snapshot())
               and not any(wk.running for wk in w.core.workers.values()), "the run's queue to drain")
    return w.core.next_seq.get(run_id, 0)


# (name, op or None for REST, request builder: (ids, world) -> (method, path, kwargs))
CASES: list[tuple[str, str | None, Any]] = [
    ("create_model_from_state/weights", "create_model_from_state",
     lambda i, w: ("POST", "/create_model_from_state", {"json": {"path": i["weights"], "with_optimizer": True}})),
    ("create_model_from_state/sampler_weights", "create_model_from_state",
     lambda i, w: ("POST", "/create_model_from_state", {"json": {"path": i["sampler_weights"]}})),
    ("forward", "forward",
     lambda i, w: ("POST", "/forward", {"json": {"model_id": i["run"], "seq": _seq(w, i["run"]), "data": DATA}})),
    ("forward_backward", "forward_backward",
     lambda i, w: ("POST", "/forward_backward",
                   {"json": {"model_id": i["run"], "seq": _seq(w, i["run"]), "data": DATA}})),
    ("optim_step", "optim_step",
     lambda i, w: ("POST", "/optim_step", {"json": {"model_id": i["run"], "seq": _seq(w, i["run"]),
                                                    "adam_params": {"learning_rate": 1.0}}})),
    ("save_weights/weights", "save_weights",  # same name as Alice's: would replace her checkpoint
     lambda i, w: ("POST", "/save_weights", {"json": {"model_id": i["run"], "seq": _seq(w, i["run"]),
                                                      "name": "w", "kind": "weights"}})),
    ("save_weights/sampler_weights", "save_weights",
     lambda i, w: ("POST", "/save_weights", {"json": {"model_id": i["run"], "seq": _seq(w, i["run"]),
                                                      "name": "s", "kind": "sampler_weights"}})),
    ("load_weights/her-run", "load_weights",
     lambda i, w: ("POST", "/load_weights", {"json": {"model_id": i["run"], "seq": _seq(w, i["run"]),
                                                      "path": i["weights"], "with_optimizer": True}})),
    ("load_weights/into-bobs-run", "load_weights",
     lambda i, w: ("POST", "/load_weights", {"json": {"model_id": w.bob_run, "seq": _seq(w, w.bob_run),
                                                      "path": i["weights"], "with_optimizer": True}})),
    ("get_info", "get_info", lambda i, w: ("POST", "/get_info", {"json": {"model_id": i["run"]}})),
    ("create_sampler/sampler_weights", "create_sampler",
     lambda i, w: ("POST", "/create_sampler", {"json": {"model_path": i["sampler_weights"]}})),
    ("create_sampler/weights", "create_sampler",
     lambda i, w: ("POST", "/create_sampler", {"json": {"model_path": i["weights"]}})),
    ("sample", "sample",
     lambda i, w: ("POST", "/sample", {"json": {"sampler_id": i["sampler"], "prompt": PROMPT,
                                                "sampling_params": {"max_tokens": 4, "temperature": 0.0}}})),
    ("compute_logprobs", "compute_logprobs",
     lambda i, w: ("POST", "/compute_logprobs", {"json": {"sampler_id": i["sampler"], "prompt": PROMPT}})),
    ("retrieve_future/in-memory", None,
     lambda i, w: ("POST", "/retrieve_future", {"json": {"request_id": i["request"], "timeout": 0}})),
    ("retrieve_future/stored", None,
     lambda i, w: ("POST", "/retrieve_future", {"json": {"request_id": i["old_request"], "timeout": 0}})),
    ("GET runs/{id}", None, lambda i, w: ("GET", f"/runs/{i['run']}", {})),
    ("GET runs/{id}/metrics", None, lambda i, w: ("GET", f"/runs/{i['run']}/metrics", {})),
    ("GET runs/{id}/usage", None, lambda i, w: ("GET", f"/runs/{i['run']}/usage", {})),
    ("POST runs/{id}/metrics", None,  # would replace her step 1's reward and hide its loss
     lambda i, w: ("POST", f"/runs/{i['run']}/metrics", {"json": {"step": 1, "metrics": {"reward": 9.0,
                                                                                           "loss": 0.0}}})),
    ("POST runs/{id}/metrics/current-step", None,
     lambda i, w: ("POST", f"/runs/{i['run']}/metrics", {"json": {"step": None, "metrics": {"reward": 9.0}}})),
    ("GET checkpoints?run_id", None, lambda i, w: ("GET", "/checkpoints", {"params": {"run_id": i["run"]}})),
    ("DELETE checkpoints/weights", None,
     lambda i, w: ("DELETE", "/checkpoints", {"params": {"path": i["weights"]}})),
    ("DELETE checkpoints/sampler_weights", None,
     lambda i, w: ("DELETE", "/checkpoints", {"params": {"path": i["sampler_weights"]}})),
    ("GET archive/weights", None,
     lambda i, w: ("GET", "/checkpoints/archive", {"params": {"path": i["weights"]}})),
    ("GET archive/sampler_weights", None,
     lambda i, w: ("GET", "/checkpoints/archive", {"params": {"path": i["sampler_weights"]}})),
]


def test_the_table_covers_every_operation_that_names_something_owned():
    owned = {op for op, (model, _) in t.OPERATIONS.items() if ID_FIELDS & set(model.model_fields)}
    assert owned == {op for _, op, _ in CASES if op is not None}


@pytest.mark.parametrize("build", [c[2] for c in CASES], ids=[c[0] for c in CASES])
def test_bob_gets_404_for_alices_ids_and_alice_keeps_everything(world, build):
    w = world
    method, path, kwargs = build(w.ids, w)
    r = w.bob.request(method, path, **kwargs)
    assert r.status_code == 404, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and body["error"]["category"] == "not_found"

    # Indistinguishable from an id that never existed: same status, same body but for the id.
    fake = fresh_ids(w.ids)
    method, path, kwargs = build(fake, w)
    r_fake = w.bob.request(method, path, **kwargs)
    text = r_fake.text
    for key, value in fake.items():
        text = text.replace(value, w.ids[key])
    assert (r_fake.status_code, text) == (r.status_code, r.text)

    # Nothing of Alice's leaks into the answer: no user, no result, no queue state...
    assert w.alice_user not in r.text
    assert '"result"' not in r.text and '"status"' not in r.text and '"queue_state"' not in r.text
    # ...and nothing of hers changed: step, checkpoints, their bytes, results, weights.
    assert alice_state(w) == w.baseline


def test_bob_lists_nothing_of_alices(world):
    w = world
    assert [r["run_id"] for r in w.bob.request("GET", "/runs").json()] == [w.bob_run]
    assert w.bob.request("GET", "/checkpoints").json() == []
    # Bob only created a run: no tokens, and none of Alice's runs or counts
    assert w.bob.request("GET", "/usage").json() == {"trained": 0, "prefilled": 0, "sampled": 0,
                                                     "budget_tokens": None, "runs": []}
    alice_usage = w.alice.request("GET", "/usage").json()
    assert [r["run_id"] for r in alice_usage["runs"]] == [w.ids["run"]] and alice_usage["trained"] > 0
    assert [r["run_id"] for r in w.alice.request("GET", "/runs").json()] == [w.ids["run"]]


def test_bob_cannot_retrieve_alices_request_while_it_is_pending(world):
    """The in-memory future, before it resolves: Bob gets 404, not "pending" or a queue state."""
    w = world
    host = w.core.workers[MODEL].engine.host
    with host.lock:  # the worker blocks inside the engine: Alice's request stays unresolved
        rid = w.alice.submit("compute_logprobs", {"sampler_id": w.ids["sampler"], "prompt": PROMPT})
        r = w.bob.retrieve(rid, timeout=0)
        assert r.status_code == 404 and r.json()["error"]["category"] == "not_found", r.text
        assert w.alice.retrieve(rid, timeout=0).json()["status"] == "pending"
    out = w.alice.wait(rid)
    assert out["status"] == "done" and out["result"] == w.baseline["sampler_logprobs"]
    assert w.bob.retrieve(rid, timeout=0).status_code == 404  # and after it resolved


def test_one_idempotency_key_used_by_two_users_gives_two_requests_that_both_run(world):
    w = world
    body = {"base_model": MODEL, "lora_config": {"rank": 2, "seed": 4}}
    key = "shared-" + secrets.token_hex(4)
    a = w.alice.submit("create_model", body, key=key)
    b = w.bob.submit("create_model", body, key=key)
    assert a != b
    a_out, b_out = w.alice.wait(a), w.bob.wait(b)
    assert a_out["status"] == b_out["status"] == "done", (a_out, b_out)
    a_run, b_run = a_out["result"]["model_id"], b_out["result"]["model_id"]
    assert a_run != b_run
    assert w.alice.request("GET", f"/runs/{a_run}").status_code == 200
    assert w.bob.request("GET", f"/runs/{b_run}").status_code == 200
    assert w.bob.request("GET", f"/runs/{a_run}").status_code == 404
    # The key still deduplicates within each user, and each user's retry finds their own request.
    assert w.alice.submit("create_model", body, key=key) == a
    assert w.bob.submit("create_model", body, key=key) == b
    assert w.bob.retrieve(a, timeout=0).status_code == 404
    assert w.alice.retrieve(b, timeout=0).status_code == 404


@pytest.mark.parametrize("key", [
    "request",
    "old_request",  # answered from the store: fine
])
def test_a_finished_request_polled_with_timeout_0_answers_done(world, key):
    """A zero-timeout poll (allowed by RetrieveFutureRequest) of a finished request gets its result."""
    w = world
    r = w.alice.retrieve(w.ids[key], timeout=0)
    assert r.status_code == 200 and r.json()["status"] == "done", (key, r.text)
    assert r.content == w.baseline[key]
