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
    listed = trio_cli("keys", "list", "--data-dir", str(server.data_dir)).stdout
    line = next(ln for ln in listed.splitlines() if "to-revoke" in ln)
    assert key not in listed and key[5:17] not in listed
    key_id = line.split()[0]
    assert line.split()[-1] == "-"  # not revoked yet

    revoked = trio_cli("keys", "revoke", key_id, "--data-dir", str(server.data_dir))
    assert revoked.returncode == 0, revoked.stderr
    r = get_runs(server, key)
    assert r.status_code == 401 and r.json()["error"]["category"] == "authentication"
    listed = trio_cli("keys", "list", "--data-dir", str(server.data_dir)).stdout
    assert next(ln for ln in listed.splitlines() if key_id in ln).split()[-1] != "-"


def test_revoke_by_name_and_unknown_or_ambiguous_names(server):
    key = server.core.store.create_api_key("by-name")
    assert trio_cli("keys", "revoke", "by-name", "--data-dir", str(server.data_dir)).returncode == 0
    assert get_runs(server, key).status_code == 401
    missing = trio_cli("keys", "revoke", "no-such-key", "--data-dir", str(server.data_dir))
    assert missing.returncode != 0 and "'no-such-key'" in missing.stderr
    server.core.store.create_api_key("twin"), server.core.store.create_api_key("twin")
    twice = trio_cli("keys", "revoke", "twin", "--data-dir", str(server.data_dir))
    assert twice.returncode != 0 and "matches 2 keys" in twice.stderr


def test_key_check_compares_digests_in_constant_time(server, monkeypatch):
    import hmac

    from trio_server import store as store_module

    calls, real = [], hmac.compare_digest
    monkeypatch.setattr(store_module.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    key = server.core.store.create_api_key("ct")
    assert server.core.store.user_for_key(key) is not None
    assert calls and calls[-1][0] == calls[-1][1] == store_module.hash_key(key)
