"""Tokenizer files travel from the service as bytes, and the client's cache follows them."""

from __future__ import annotations

import json

import pytest

import pytrio as trio
from pytrio.session import _load_tokenizer
from pytrio.transport.local import LocalTransport

MODEL = "trio/tiny-llama"
BLOB = bytes(range(256)) * 4  # not UTF-8: a sentencepiece tokenizer.model looks like this


@pytest.mark.parametrize("transport", ["local", "http"])
def test_a_binary_tokenizer_file_arrives_intact(request, transport):
    if transport == "local":
        core = request.getfixturevalue("local_core")
        service = trio.ServiceClient(transport=LocalTransport(core))
    else:
        server = request.getfixturevalue("http_server")
        core = server.core
        service = trio.ServiceClient(base_url=server.url, api_key=core.store.create_api_key("tok"))
    core.tokenizer_files(MODEL)  # the service's cache of the model's files now exists
    (core.data_dir / "tokenizers" / MODEL.replace("/", "--") / "tokenizer.model").write_bytes(BLOB)
    files = trio.futures.run_sync(service._session.transport.tokenizer_files(MODEL)).contents()
    assert files["tokenizer.model"] == BLOB and b'"model"' in files["tokenizer.json"]
    tok = trio.TrainingClient(service._session, "run-x", MODEL).get_tokenizer()
    assert tok.decode(tok.encode("what is trio", add_special_tokens=False)) == "what is trio"


def test_the_client_cache_follows_every_file(request, tmp_path, monkeypatch):
    """A changed tokenizer_config.json (same tokenizer.json) gives the changed tokenizer."""
    monkeypatch.setenv("TRIO_HOME", str(tmp_path))
    files = request.getfixturevalue("local_core").tokenizer_files(MODEL).contents()
    before = _load_tokenizer(files)
    config = json.loads(files["tokenizer_config.json"])
    config["model_max_length"] = 77
    changed = _load_tokenizer({**files, "tokenizer_config.json": json.dumps(config).encode()})
    assert changed.model_max_length == 77 and before.model_max_length != 77
