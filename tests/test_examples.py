"""Integration: the user docs' programs (examples/) run on the bundled model.

These are the suite's slowest tests (~1 min together): a real 135M model, real
training, real sampling, through the embedded default ``ServiceClient()``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, tmp_path, **env) -> str:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTRIO_")}
    # a fresh embedded data dir, but keep the converted model cache
    tmp_path.mkdir(exist_ok=True)
    full_env.update(TRIO_HOME=str(tmp_path), **env)
    models = Path(os.environ.get("TRIO_HOME") or Path.home() / ".cache" / "trio") / "models"
    if models.exists():
        (tmp_path / "models").symlink_to(models)
    out = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True,
                         env=full_env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft.py", "sft_async.py"])
def test_sft_example_learns_about_trio(name, tmp_path):
    out = run_example(name, tmp_path)
    losses = [float(x) for x in re.findall(r"Loss per token: ([\d.]+)", out)]
    assert len(losses) == 15 and losses[-1] < losses[0] * 0.8, out
    base = out.split("Base Responses:")[1].split("SFT Responses:")[0]
    sft = out.split("SFT Responses:")[1]
    assert "trio" in sft.lower() and "trio" not in base.lower(), out


@pytest.mark.slow
def test_sft_example_runs_unchanged_against_trio_serve(tmp_path):
    from .sdk.conftest import ServeProcess, free_port

    server = ServeProcess(tmp_path, free_port())
    key = server.create_key()
    server.start()
    try:
        out = run_example("sft.py", tmp_path / "client", PYTRIO_BASE_URL=server.url, PYTRIO_API_KEY=key)
    finally:
        server.proc.terminate()
        server.proc.wait(30)
    assert "trio" in out.split("SFT Responses:")[1].lower(), out


@pytest.mark.slow
def test_rl_example_runs(tmp_path):
    out = run_example("rl.py", tmp_path, TRIO_RL_ITERATIONS="2")
    assert len(re.findall(r"Iter\d+ \| Reward", out)) == 2 and out.count("Q: ") == 4, out
