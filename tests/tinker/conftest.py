"""The tinker SDK against ``trio serve``: a server subprocess, keys, an offline tokenizer cache.

Everything is offline: the client loads tokenizers from a hub cache written by
``trio tokenizers install`` with HF_HUB_OFFLINE=1. The tinker SDK and tinker-cookbook are
test-only dependencies; without them these tests are skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.sdk.conftest import ServeProcess

pytest.importorskip("tinker")


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf-hub")
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "trio_server.cli", "tokenizers", "install", "--cache-dir", str(cache)],
                   check=True, env=env, capture_output=True, text=True)
    return cache


@pytest.fixture(scope="session")
def tinker_server(tmp_path_factory, hub_cache):
    """``trio serve`` with API keys; ``.tinker_url``, ``.key`` (a TRIO key) and ``.tinker_key``."""
    server = ServeProcess(tmp_path_factory.mktemp("tinker-serve"), "--dtype", "float32")
    server.key = server.create_key()
    server.start()
    server.tinker_url = server.url + "/tinker"
    server.tinker_key = "tml-" + server.key
    server.log_text = lambda: open(server.log.name).read()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tinker_env(tinker_server, hub_cache):
    """The environment a tinker client needs: base URL, key, the offline tokenizer cache."""
    env = {
        "TINKER_BASE_URL": tinker_server.tinker_url, "TINKER_API_KEY": tinker_server.tinker_key,
        "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache), "TOKENIZERS_PARALLELISM": "false",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # huggingface_hub read the environment when first imported (maybe by an earlier test):
    # the SDK in this process must see the same cache and offline flag as subprocesses.
    from huggingface_hub import constants

    old_constants = constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE
    constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = str(hub_cache), True
    yield env
    constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = old_constants
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
