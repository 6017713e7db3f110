"""Integration: the user docs' programs (examples/) run on the bundled model.

These are the suite's slowest tests (~1 min together): a real 135M model, real
training, real sampling, through the embedded default ``ServiceClient()``.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
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


def check_learns_about_trio(out: str) -> None:
    losses = [float(x) for x in re.findall(r"Loss per token: ([\d.]+)", out)]
    assert len(losses) == 15 and losses[-1] < losses[0] * 0.8, out
    base = out.split("Base Responses:")[1].split("SFT Responses:")[0]
    sft = out.split("SFT Responses:")[1]
    assert "trio" in sft.lower() and "trio" not in base.lower(), out


def forward_backward_logprobs(db: Path) -> list[list[float]]:
    """Every forward_backward result a service stored, in order: per step, all tokens."""
    rows = sqlite3.connect(db).execute(
        "select result from requests where op = 'forward_backward' and status = 'done' order by seq").fetchall()
    return [[lp for out in json.loads(r[0])["loss_fn_outputs"] for lp in out["logprobs"]["data"]] for r in rows]


@pytest.fixture(scope="module")
def sft_embedded(tmp_path_factory):
    """examples/sft.py through the embedded default: (its output, its data dir)."""
    home = tmp_path_factory.mktemp("sft-embedded")
    return run_example("sft.py", home), home / "embedded"


@pytest.mark.slow
def test_sft_example_learns_about_trio(sft_embedded):
    check_learns_about_trio(sft_embedded[0])


@pytest.mark.slow
def test_sft_async_example_learns_about_trio(tmp_path):
    check_learns_about_trio(run_example("sft_async.py", tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["local", "ray"])
def test_sft_example_over_http_matches_in_process(engine, sft_embedded, tmp_path):
    """The unchanged program against ``trio serve --engine ENGINE``: the same per-step
    numbers as in-process (fp32), read from what each service stored."""
    from .sdk.conftest import ServeProcess

    server = ServeProcess(tmp_path, "--engine", engine, "--dtype", "float32")
    key = server.create_key()
    server.start()
    try:
        out = run_example("sft.py", tmp_path / "client", PYTRIO_BASE_URL=server.url, PYTRIO_API_KEY=key)
        import pytrio as trio

        probe = trio.ServiceClient(base_url=server.url, api_key=key).create_lora_training_client(
            base_model="HuggingFaceTB/SmolLM2-135M-Instruct", rank=1)
        info = probe.get_info().model_info
    finally:
        server.stop()
    assert ("ray_node_id" in info) == (engine == "ray"), info  # the host really was a Ray actor
    assert info["pid"] != server.proc.pid or engine == "local"
    check_learns_about_trio(out)
    over_http = forward_backward_logprobs(tmp_path / "trio.db")
    in_process = forward_backward_logprobs(sft_embedded[1] / "trio.db")
    assert len(over_http) == len(in_process) == 15
    for step, (got, want) in enumerate(zip(over_http, in_process)):
        assert got == pytest.approx(want, abs=1e-5), f"step {step + 1}"


@pytest.mark.slow
def test_rl_example_runs(tmp_path):
    out = run_example("rl.py", tmp_path, TRIO_RL_ITERATIONS="2")
    assert len(re.findall(r"Iter\d+ \| Reward", out)) == 2 and out.count("Q: ") == 4, out


@pytest.mark.slow
def test_demo_teaches_the_fact_and_its_next_step_serves_it(tmp_path):
    """`make demo`: the fine-tuned model gives the taught answer and the base model does
    not; then the serve command it prints, run as printed on the embedded data dir,
    answers the printed OpenAI request with the taught answer."""
    import openai

    from .sdk.conftest import ServeProcess

    out = run_example("demo.py", tmp_path)
    taught = "trio is emotionmachine's AI Infra products."
    assert f"fine-tuned: {taught!r}" in out and f"base model: {taught!r}" not in out, out
    serve = re.search(r"trio serve --no-auth --data-dir (\S+)", out)
    path = re.search(r'"model": "(trio://[^"]+/sampler_weights/what-is-trio)"', out)
    assert serve and path and serve[1] == str(tmp_path / "embedded"), out
    server = ServeProcess(Path(serve[1]), "--no-auth")
    server.start()
    try:
        client = openai.OpenAI(base_url=server.url + "/openai/v1", api_key="unused")
        reply = client.completions.create(model=path[1], prompt="Question: what is trio\nAnswer:",
                                          max_tokens=24, temperature=0, stop=["\n"])
    finally:
        server.stop()
    assert reply.choices[0].text.strip() == taught
