"""Access control over HTTP: API keys (list, revoke), path traversal, streamed body
limits, per-user quotas. Servers bind port 0; nothing waits on a clock."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from trio_server.app import create_app
from trio_server.core import ServiceCore

from ..sdk.conftest import ServerThread


def trio_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trio_server.cli", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("access")
    core = ServiceCore(data_dir, dtype="float32")
    srv = ServerThread(create_app(core, auth=True, max_body_bytes=100_000))
    srv.core, srv.data_dir = core, data_dir
    yield srv
    srv.stop()
    core.close()


def get_runs(server, key: str) -> httpx.Response:
    return httpx.get(server.url + "/api/v1/runs", headers={"Authorization": f"Bearer {key}"})


# -- API keys ---------------------------------------------------------------------------

def test_keys_list_shows_ids_never_keys_and_revoke_refuses_at_once(server):
    made = trio_cli("keys", "create", "--name", "to-revoke", "--data-dir", str(server.data_dir))
    key = made.stdout.strip()
    assert made.returncode == 0 and key.startswith("trio-") and len(made.stdout.splitlines()) == 1
    assert get_runs(server, key).status_code == 200  # and the server has now seen the key
    assert httpx.get(server.url + "/tinker/api/v1/training_runs", headers={"X-API-Key": f"tml-{key}"}).status_code == 200
    listed = trio_cli("keys", "list", "--data-dir", str(server.data_dir)).stdout
    line = next(ln for ln in listed.splitlines() if "to-revoke" in ln)
    assert key not in listed and key[5:17] not in listed
    key_id = line.split()[0]
    assert line.split()[-1] == "-"  # not revoked yet

    revoked = trio_cli("keys", "revoke", key_id, "--data-dir", str(server.data_dir))
    assert revoked.returncode == 0, revoked.stderr
    r = get_runs(server, key)
    assert r.status_code == 401 and r.json()["error"]["category"] == "authentication"
    tinker = httpx.get(server.url + "/tinker/api/v1/training_runs", headers={"X-API-Key": f"tml-{key}"})
    openai = httpx.get(server.url + "/openai/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert tinker.status_code == 401 and openai.status_code == 401  # every door asks the same store
    listed = trio_cli("keys", "list", "--data-dir", str(server.data_dir)).stdout
    assert next(ln for ln in listed.splitlines() if key_id in ln).split()[-1] != "-"


def test_a_revoked_keys_queued_requests_do_not_run(server, monkeypatch):
    """Revoking a stolen key refused its new requests, but the ones it had queued (up to
    max_pending_per_user: optim_steps at any learning rate, say) still ran on the owner's
    runs. They now end unrun when their turn comes, and count no usage."""
    import threading

    import pytrio as trio
    from trio_server import store as tables

    from ..polling import wait_until

    key = server.core.store.create_api_key("stolen")
    tc = trio.ServiceClient(base_url=server.url, api_key=key).create_lora_training_client(
        base_model="trio/tiny-llama", rank=2)
    toks = [1, 17, 300, 42, 9, 77]
    data = [trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:]})]
    host = server.core.workers["trio/tiny-llama"].engine.host
    running, release, real = threading.Event(), threading.Event(), host.forward_backward

    def held(jobs):
        running.set()
        release.wait(60)
        return real(jobs)

    monkeypatch.setattr(host, "forward_backward", held)
    tc.forward_backward(data)  # runs: held in the engine while the key is revoked
    assert running.wait(60)
    tc.forward_backward(data)
    tc.optim_step(trio.AdamParams(learning_rate=1e3))
    wait_until(lambda: len(server.core.store.select(tables.requests, run_id=tc.model_id)) == 3, "3 calls queued")
    user = server.core.store.user_for_key(key)
    server.core.store.revoke_api_key("stolen")
    release.set()

    def outcomes():
        rows = server.core.store.select(tables.requests, run_id=tc.model_id)
        return [(r["op"], r["status"], r["error_category"]) for r in rows if r["op"] != "create_model"]

    wait_until(lambda: all(status != "pending" for _, status, _ in outcomes()), "the queue to end")
    assert sorted(outcomes()) == [("forward_backward", "done", None), ("forward_backward", "failed", "authentication"),
                                  ("optim_step", "failed", "authentication")]
    assert server.core.store.get(tables.runs, run_id=tc.model_id)["step"] == 0
    assert server.core.store.usage_total(user) == 5  # the one call that ran: 5 tokens trained


def test_a_rotated_key_keeps_its_users_runs_usage_and_budget(server):
    """A leaked key could only be revoked and a new one made: a new user, without the old
    one's runs, checkpoints or usage (the budget started again at 0 used)."""
    import pytrio as trio

    old = trio_cli("keys", "create", "--name", "to-rotate", "--budget-tokens", "100000",
                   "--data-dir", str(server.data_dir)).stdout.strip()
    tc = trio.ServiceClient(base_url=server.url, api_key=old).create_lora_training_client(
        base_model="trio/tiny-llama", rank=2)
    datum = trio.Datum(model_input=trio.ModelInput.from_ints([1, 17, 300, 42]),
                       loss_fn_inputs={"target_tokens": [17, 300, 42, 9]})
    tc.forward_backward([datum]).result()
    used = server.core.store.usage_total(server.core.store.user_for_key(old))
    rotated = trio_cli("keys", "rotate", "to-rotate", "--data-dir", str(server.data_dir))
    assert rotated.returncode == 0 and "revoked" in rotated.stderr, rotated.stderr
    new = rotated.stdout.strip()
    assert new.startswith("trio-") and new != old
    assert get_runs(server, old).status_code == 401
    assert [r["run_id"] for r in get_runs(server, new).json()] == [tc.model_id]
    user = server.core.store.user_for_key(new)
    assert server.core.store.usage_total(user) == used > 0 and server.core.store.budget_of(user) == 100000
    assert not server.core.store.revoked(user)  # its user's queued work runs (the same user's)
    assert trio_cli("keys", "budget", "to-rotate", "200000", "--data-dir", str(server.data_dir)).returncode == 0
    assert server.core.store.budget_of(user) == 200000  # the name names the key in use
    rows = [ln for ln in trio_cli("keys", "list", "--data-dir", str(server.data_dir)).stdout.splitlines()
            if "to-rotate" in ln]
    assert len(rows) == 2 and sorted(row.split()[-1] == "-" for row in rows) == [False, True]
    old_id = next(row.split()[0] for row in rows if row.split()[-1] != "-")
    again = trio_cli("keys", "rotate", old_id, "--data-dir", str(server.data_dir))  # the revoked one: a 2nd live key
    assert again.returncode == 1 and "its user has another key in use" in again.stderr
    after_revoke = trio_cli("keys", "revoke", "to-rotate", "--data-dir", str(server.data_dir))
    assert after_revoke.returncode == 0 and server.core.store.revoked(user)
    assert trio_cli("keys", "rotate", old_id, "--data-dir", str(server.data_dir)).returncode == 0  # all revoked: ok
    assert not server.core.store.revoked(user)


def test_revoke_by_name_and_unknown_or_ambiguous_names(server):
    key = server.core.store.create_api_key("by-name")
    assert trio_cli("keys", "revoke", "by-name", "--data-dir", str(server.data_dir)).returncode == 0
    assert get_runs(server, key).status_code == 401
    missing = trio_cli("keys", "revoke", "no-such-key", "--data-dir", str(server.data_dir))
    assert missing.returncode != 0 and "'no-such-key'" in missing.stderr
    server.core.store.create_api_key("twin"), server.core.store.create_api_key("twin")
    twice = trio_cli("keys", "revoke", "twin", "--data-dir", str(server.data_dir))
    assert twice.returncode != 0 and "matches 2 keys" in twice.stderr


def test_keys_carry_a_token_budget_that_the_running_server_applies_at_once(server):
    import pytrio as trio

    def listed_line() -> list[str]:
        listed = trio_cli("keys", "list", "--data-dir", str(server.data_dir)).stdout
        assert listed.splitlines()[0].split() == ["ID", "NAME", "CREATED", "BUDGET", "USED", "REVOKED"]
        return next(ln for ln in listed.splitlines() if " capped " in ln).split()

    made = trio_cli("keys", "create", "--name", "capped", "--budget-tokens", "6", "--data-dir", str(server.data_dir))
    assert made.returncode == 0, made.stderr
    assert listed_line()[-3:] == ["6", "0", "-"]  # budget, used, not revoked
    tc = trio.ServiceClient(base_url=server.url, api_key=made.stdout.strip()).create_lora_training_client(
        base_model="trio/tiny-llama", rank=2)
    toks = list(range(1, 8))
    data = [trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:]})]
    tc.forward(data).result()
    assert listed_line()[-3:] == ["6", "6", "-"]
    with pytest.raises(trio.ValidationError, match="budget of 6"):
        tc.forward(data).result()

    lifted = trio_cli("keys", "budget", "capped", "none", "--data-dir", str(server.data_dir))
    assert lifted.returncode == 0 and "no limit" in lifted.stdout, lifted.stderr
    assert listed_line()[-3:] == ["-", "6", "-"]
    tc.forward(data).result()  # the server reads the budget at each submit: no restart
    bad = trio_cli("keys", "budget", "capped", "lots", "--data-dir", str(server.data_dir))
    assert bad.returncode != 0 and "'lots'" in bad.stderr
    missing = trio_cli("keys", "budget", "no-such-key", "9", "--data-dir", str(server.data_dir))
    assert missing.returncode != 0 and "'no-such-key'" in missing.stderr and "set the budget by id" not in missing.stderr


def test_key_check_compares_digests_in_constant_time(server, monkeypatch):
    import hmac

    from trio_server import store as store_module

    calls, real = [], hmac.compare_digest
    monkeypatch.setattr(store_module.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    key = server.core.store.create_api_key("ct")
    assert server.core.store.user_for_key(key) is not None
    assert calls and calls[-1][0] == calls[-1][1] == store_module.hash_key(key)


# -- path traversal ---------------------------------------------------------------------

BAD_PATHS = [
    ("trio://run-abc/weights/..", "name"), ("trio://run-abc/weights/../../../outside", "parts"),
    ("trio://../weights/x", "run id"), ("trio://run-abc/../x", "kind"), ("trio:///etc/passwd", "run id: '' is empty"),
    ("trio://run-abc//x", "kind"), ("/etc/passwd", "not a checkpoint path"), ("../../outside", "not a checkpoint path"),
    ("trio://run-abc/weights/a\\..\\b", "name"), ("trio://run-abc/weights/a\x00b", "NUL"),
    ("trio://run-abc/weights/" + "a" * 300, "more than 128"), ("trio://run-abc/weights/", "empty"),
    ("trio://run-abc/weights/" + "a" * 600, "more than 512"),
    ("trio://run-abc/weights/.hidden", "name"), ("trio://run-abc/weights/x\n", "name"),
]


@pytest.fixture
def sentinels(server):
    """A file beside the data dir and one inside it; the test asserts neither changed and
    that no file appeared or vanished anywhere under their common parent."""
    outside = server.data_dir.parent / "outside"
    outside.write_text("secret outside the data dir")
    (server.data_dir / "checkpoints" / "run-abc").mkdir(parents=True, exist_ok=True)
    before = sorted(str(p) for p in server.data_dir.parent.rglob("*") if "archives" not in p.parts)
    yield outside
    assert outside.read_text() == "secret outside the data dir"
    assert (server.data_dir / "checkpoints" / "run-abc").is_dir()
    assert sorted(str(p) for p in server.data_dir.parent.rglob("*") if "archives" not in p.parts) == before


def auth(server) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.core.store.create_api_key('traversal')}"}


@pytest.mark.parametrize("path,why", BAD_PATHS)
def test_checkpoint_paths_outside_the_data_dir_are_refused(server, sentinels, path, why):
    headers = auth(server)
    for method, route in [("DELETE", "/api/v1/checkpoints"), ("GET", "/api/v1/checkpoints/archive")]:
        r = httpx.request(method, server.url + route, params={"path": path}, headers=headers)
        assert r.status_code == 400, (route, r.text)
        assert r.json()["error"]["message"].startswith("path") and why in r.json()["error"]["message"]
        assert "secret" not in r.text
    r = httpx.post(server.url + "/api/v1/create_sampler", json={"model_path": path}, headers=headers)
    assert r.status_code in (400, 422) and "secret" not in r.text


# URL-encoded spellings, sent as raw bytes (httpx would otherwise normalise some).
RAW_TARGETS = [
    "/api/v1/checkpoints?path=trio%3A%2F%2Frun-abc%2Fweights%2F%2E%2E",
    "/api/v1/checkpoints?path=trio://run-abc/weights/%2e%2e%2f%2e%2e%2foutside",
    "/api/v1/checkpoints?path=trio://run-abc/weights/a%00b",
    "/api/v1/checkpoints?path=trio://run-abc/weights/a%5C..%5Cb",
    "/api/v1/checkpoints?path=%2Fetc%2Fpasswd",
    "/api/v1/checkpoints/archive?path=trio://run-abc/weights/%2E%2E",
    "/tinker/api/v1/training_runs/run-abc/checkpoints/weights/%2E%2E",
    "/tinker/api/v1/training_runs/%2E%2E/checkpoints/weights/x",
    "/tinker/api/v1/training_runs/run-abc/checkpoints/%2E%2E/x",
]


@pytest.mark.parametrize("target", RAW_TARGETS)
def test_url_encoded_traversal_is_refused(server, sentinels, target):
    headers = auth(server)
    if target.startswith("/tinker"):
        headers = {"X-API-Key": "tml-" + headers["Authorization"][7:]}
    method = "GET" if "/archive" in target else "DELETE"
    r = httpx.request(method, httpx.URL(server.url + target), headers=headers)
    assert 400 <= r.status_code < 500 and r.status_code != 401, (method, target, r.text)
    assert "secret" not in r.text


RUN_IDS = ["%2E%2E", "a%00b", "a%5Cb", "x" * 100]


@pytest.mark.parametrize("run_id", RUN_IDS)
def test_run_ids_are_single_safe_names(server, sentinels, run_id):
    headers = auth(server)
    for method, route in [("GET", f"/api/v1/runs/{run_id}"), ("GET", f"/api/v1/runs/{run_id}/metrics"),
                          ("GET", f"/api/v1/checkpoints?run_id={run_id}")]:
        r = httpx.request(method, httpx.URL(server.url + route), headers=headers)
        assert r.status_code in (400, 404), (route, r.text)
        if r.status_code == 400:
            assert r.json()["error"]["message"].startswith("run_id")
    body = {"model_id": "../../outside", "seq": 0, "kind": "weights", "name": "x"}
    r = httpx.post(server.url + "/api/v1/save_weights", json=body, headers=headers)
    assert r.status_code == 400 and "model_id: '../../outside'" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/tinker/api/v1/weights_info", json={"tinker_path": "tinker://../weights/x"},
                   headers={"X-API-Key": "tml-" + headers["Authorization"][7:]})
    assert 400 <= r.status_code < 500 and r.status_code != 401


@pytest.mark.parametrize("name", ["..", ".", ".hidden", "a..b", "a/b", "a\\b", "x\n", "a\x00", "", "n" * 129])
def test_checkpoint_names_are_single_safe_names(server, name):
    body = {"model_id": "run-abc", "seq": 0, "kind": "weights", "name": name}
    r = httpx.post(server.url + "/api/v1/save_weights", json=body, headers=auth(server))
    assert r.status_code == 422 and "name" in r.json()["error"]["message"], r.text


def test_folder_never_leaves_the_checkpoints_dir(tmp_path):
    from trio_server import checkpoints as ckpt
    from trio_server.errors import ServiceError

    (tmp_path / "checkpoints" / "run-abc").mkdir(parents=True)
    (tmp_path / "checkpoints" / "run-abc" / "weights").symlink_to(tmp_path.parent)
    with pytest.raises(ServiceError, match="outside the data dir"):
        ckpt.folder(tmp_path, "run-abc", "weights", "x")
    for parts in [("..", "weights", "x"), ("run-abc", "/etc", "x"), ("run-abc", "weights", "")]:
        with pytest.raises(ServiceError):
            ckpt.folder(tmp_path, *parts)


# -- body size --------------------------------------------------------------------------

def test_a_chunked_body_over_the_limit_is_refused_while_it_streams(server):
    """64 MB offered in 64 KB chunks without Content-Length, against a 100 kB limit: the
    413 arrives and the client stops long before the generator is exhausted."""
    sent = []

    def body():
        for _ in range(1024):
            sent.append(1)
            yield b"x" * 65536

    r = httpx.post(server.url + "/api/v1/create_model", content=body(), headers=auth(server), timeout=60)
    assert r.status_code == 413 and "limit of 100000 bytes" in r.json()["error"]["message"]
    assert len(sent) < 512, f"the client sent {len(sent)} of 1024 chunks: the server read on"


def test_a_chunked_body_under_the_limit_still_works(server):
    def body():
        yield b'{"base_model": '
        yield b'"no-such-model", "lora_config": {"rank": 2}}'

    r = httpx.post(server.url + "/api/v1/create_model", content=body(), headers=auth(server))
    assert r.status_code in (400, 422) and "base_model" in r.json()["error"]["message"], r.text


def test_a_declared_length_over_the_limit_is_refused_before_the_body(server):
    r = httpx.post(server.url + "/api/v1/create_model", content=b"x" * 100_001, headers=auth(server))
    assert r.status_code == 413 and "100001 bytes" in r.json()["error"]["message"]


def test_the_default_body_bound_follows_the_largest_request_allowed(tmp_path):
    """128 bytes per token of max_tokens_per_request (twice a ppo batch's 60): 64 MiB, the
    bound before, let in 500 times the largest request, a body whose parse held every
    tenant's calls for 9 s."""
    from trio_server.app import BODY_BYTES_PER_TOKEN
    from trio_server.core import Limits

    core = ServiceCore(tmp_path, dtype="float32", limits=Limits(max_tokens_per_request=20_000))
    srv = ServerThread(create_app(core, auth=False))
    try:
        bound = BODY_BYTES_PER_TOKEN * 20_000
        over = httpx.post(srv.url + "/api/v1/create_model", content=b"x" * (bound + 1))
        assert over.status_code == 413 and f"{bound + 1} bytes" in over.json()["error"]["message"]
        assert httpx.post(srv.url + "/api/v1/create_model", content=b"x" * bound).status_code == 422  # read, parsed
    finally:
        srv.stop()
        core.close()
    assert BODY_BYTES_PER_TOKEN * Limits().max_tokens_per_request == 16 << 20


# -- quotas -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quota_server(tmp_path_factory):
    from trio_server.core import Limits

    data_dir = tmp_path_factory.mktemp("quota")
    core = ServiceCore(data_dir, dtype="float32", limits=Limits(max_runs_per_user=1, max_checkpoint_bytes_per_user=1))
    srv = ServerThread(create_app(core, auth=True))
    srv.core, srv.data_dir = core, data_dir
    yield srv
    srv.stop()
    core.close()


def quota_client(server):
    import pytrio as trio

    return trio.ServiceClient(base_url=server.url, api_key=server.core.store.create_api_key("quota"))


def test_quotas_are_reported_by_capabilities(quota_server):
    caps = quota_client(quota_server).get_server_capabilities()
    assert caps.max_runs_per_user == 1 and caps.max_checkpoint_bytes_per_user == 1
    r = httpx.get(quota_server.url + "/tinker/api/v1/get_server_capabilities",
                  headers={"X-API-Key": "tml-" + quota_server.core.store.create_api_key("tinker")})
    assert r.status_code == 200 and r.json()["supported_models"]


def test_run_and_checkpoint_quotas_refuse_before_any_change(quota_server):
    import pytrio as trio

    service = quota_client(quota_server)
    tc = service.create_lora_training_client(base_model="trio/tiny-llama", rank=2)
    with pytest.raises(trio.ValidationError, match=r"quota max_runs_per_user: this user has 1 runs, the limit is 1; "
                                                   r"runs are kept .*ask the operator"):
        service.create_lora_training_client(base_model="trio/tiny-llama", rank=2)
    assert len(service.create_rest_client().list_training_runs()) == 1
    quota_client(quota_server).create_lora_training_client(base_model="trio/tiny-llama", rank=2)  # another user

    first = tc.save_state("first").result().path  # 0 bytes used < 1: allowed, and overshoots
    with pytest.raises(trio.ValidationError, match=r"quota max_checkpoint_bytes_per_user: this user has \d+ "
                                                   r"checkpoint bytes, the limit is 1; delete checkpoints"):
        tc.save_state("second").result()
    assert [c.path for c in service.create_rest_client().list_user_checkpoints()] == [first]
    assert not (quota_server.data_dir / "checkpoints" / tc.model_id / "weights" / "second").exists()

    from trio_server.store import checkpoints
    quota_server.core.store.update(checkpoints, "path", first, expires_at="2000-01-01T00:00:00.000+00:00")
    second = tc.save_state("second").result().path  # an expired checkpoint takes no room
    assert [c.path for c in service.create_rest_client().list_user_checkpoints()] == [second]
    tc.save_weights_and_get_sampling_client()  # ephemeral sampler weights are not refused


def test_saves_pipelined_past_the_checkpoint_quota_are_refused_when_they_run(quota_server):
    """Saves submitted back to back all passed the check at submit (the queued ones are not
    counted yet): 8 of 15 were kept, 3.3 times the quota. Each is checked again when it
    runs, so the quota is passed by one checkpoint (of each base model) at most, as documented."""
    import pytrio as trio

    tc = quota_client(quota_server).create_lora_training_client(base_model="trio/tiny-llama", rank=2)
    saves = [tc.save_state(f"pipelined-{k}") for k in range(4)]
    assert saves[0].result().path.endswith("pipelined-0")
    for later in saves[1:]:
        with pytest.raises(trio.ValidationError, match="quota max_checkpoint_bytes_per_user"):
            later.result()
    assert sorted(p.name for p in (quota_server.data_dir / "checkpoints" / tc.model_id / "weights").iterdir()) == [
        "pipelined-0"]


# -- TLS --------------------------------------------------------------------------------

def self_signed(folder):
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_serve_speaks_tls_and_says_https(tmp_path):
    import re
    import ssl
    import time

    cert, key = self_signed(tmp_path)
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trio_server.cli", "serve", "--port", "0", "--data-dir",
                                 str(tmp_path / "data"), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                                 "--max-runs-per-user", "3"], stdout=log, stderr=subprocess.STDOUT)
    try:
        listening = re.compile(rf"TRIO listening on https://127\.0\.0\.1:(\d+) \(pid {proc.pid}\)")
        deadline = time.monotonic() + 120
        while not (match := listening.search(log_path.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)  # polling the log, not waiting for a guessed time
        url = f"https://127.0.0.1:{match[1]}"
        trusted = ssl.create_default_context(cafile=str(cert))
        # The socket listens before the log line is written: a connection waits in its backlog.
        r = httpx.get(url + "/api/v1/healthz", verify=trusted, timeout=60)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert "TINKER_BASE_URL=https://" in log_path.read_text()
        with pytest.raises(httpx.ConnectError):  # an untrusted certificate is refused by the client
            httpx.get(url + "/api/v1/healthz")
        with pytest.raises(httpx.RemoteProtocolError):  # and plain HTTP gets no answer
            httpx.get(url.replace("https", "http") + "/api/v1/healthz")
        made = trio_cli("keys", "create", "--name", "tls", "--data-dir", str(tmp_path / "data"))
        caps = httpx.get(url + "/api/v1/capabilities", verify=trusted,
                         headers={"Authorization": f"Bearer {made.stdout.strip()}"}).json()
        assert caps["max_runs_per_user"] == 3 and caps["max_checkpoint_bytes_per_user"] is None
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_refuses_a_certificate_without_its_key(tmp_path):
    r = trio_cli("serve", "--port", "0", "--data-dir", str(tmp_path), "--ssl-certfile", str(tmp_path / "c.pem"))
    assert r.returncode != 0 and "--ssl-keyfile" in r.stderr


@pytest.mark.parametrize("name", ["..", ".", "org/..", "a\\b", "a\x00"])
def test_base_model_names_cannot_name_the_data_dir(server, monkeypatch, name):
    """Unknown names go to the hub; when it is reachable, '..' must still not become the
    tokenizer cache folder (<data-dir>/tokenizers/.. is the data dir, which gets replaced)."""
    from trio_engine import catalog
    from trio_server.errors import ServiceError

    monkeypatch.setattr(catalog, "_hub_reachable", lambda: True)
    with pytest.raises(ServiceError, match="base_model"):
        server.core._check_model(name)
    r = httpx.get(server.url + "/api/v1/tokenizer", params={"base_model": name}, headers=auth(server))
    assert r.status_code == 400 and "base_model" in r.json()["error"]["message"]


def test_a_database_from_before_revocation_gains_the_column(tmp_path):
    import sqlalchemy as sa

    from trio_server.store import Store, hash_key

    url = f"sqlite:///{tmp_path / 'old.db'}"
    with sa.create_engine(url).begin() as c:
        c.exec_driver_sql("CREATE TABLE api_keys (key_hash VARCHAR(64) PRIMARY KEY, user_id VARCHAR(64) NOT NULL, "
                          "name VARCHAR(128) NOT NULL, created_at VARCHAR(32) NOT NULL)")
        c.exec_driver_sql(f"INSERT INTO api_keys VALUES ('{hash_key('trio-old')}', 'user-old', 'old', 'then')")
    store = Store(url)
    assert store.user_for_key("trio-old") == "user-old"
    assert store.budget_of("user-old") is None  # budget_tokens added too: an old key has no limit
    store.set_budget("old", 7)
    assert store.budget_of("user-old") == 7
    store.revoke_api_key("old")
    assert store.user_for_key("trio-old") is None
