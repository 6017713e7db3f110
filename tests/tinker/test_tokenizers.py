"""``trio tokenizers install``: clients load each catalog model's tokenizer by name, offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from trio_engine import Catalog
from trio_engine.catalog import load_tokenizer

TEXT = "User: what is 2+2?\n\nAssistant: 4<|im_end|>"
LOAD = """
import json, sys
from transformers import AutoTokenizer
text, names = sys.argv[1], sys.argv[2:]
out = {n: [AutoTokenizer.from_pretrained(n).encode(text), AutoTokenizer.from_pretrained(n).eos_token] for n in names}
print(json.dumps(out))
"""


def test_installed_tokenizers_load_by_name_offline(hub_cache):
    catalog = Catalog()
    names = catalog.available()
    assert names and all((hub_cache / f"models--{n.replace('/', '--')}" / "refs" / "main").exists() for n in names)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    done = subprocess.run([sys.executable, "-c", LOAD, TEXT, *names], env=env, capture_output=True, text=True, check=True)
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    for name in names:
        ours = load_tokenizer(catalog.resolve(name))
        assert loaded[name] == [ours.encode(TEXT), ours.eos_token], name


def test_keys_create_prints_the_tinker_form(tmp_path):
    done = subprocess.run([sys.executable, "-m", "trio_server.cli", "keys", "create", "--name", "k",
                           "--data-dir", str(tmp_path)], capture_output=True, text=True, check=True)
    key = done.stdout.strip()
    assert key.startswith("trio-") and f"TINKER_API_KEY=tml-{key}" in done.stderr
