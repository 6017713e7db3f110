"""tinker-cookbook recipes, unmodified, against ``trio serve`` on the bundled SmolLM2-135M.

- RL: the ``math_rl`` CLI on the synthetic arithmetic environment, ``importance_sampling``.
- SL: ``supervised.train`` on the cookbook's packaged example conversations, with
  evaluation (through ``compute_logprobs``) and periodic saves; the held-out loss falls.

Each runs in a subprocess, as a user would run it, offline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker_cookbook")

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
pytestmark = pytest.mark.slow


def _run(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=os.environ | env | {"TINKER_TELEMETRY": "0"}, cwd=cwd,
                          capture_output=True, text=True, timeout=900)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _checkpoint_ids(run_id: str) -> set[str]:
    import tinker

    return {c.checkpoint_id for c in tinker.RestClient().list_checkpoints(run_id).result().checkpoints}


def test_math_rl_recipe_cli(tinker_env, tmp_path):
    log_path = tmp_path / "rl"
    done = _run(["-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={MODEL}",
                 "renderer_name=role_colon", "loss_fn=importance_sampling", "lora_rank=8", "group_size=4",
                 "groups_per_batch=2", "max_tokens=5", "max_steps=2", "eval_every=0", "save_every=0",
                 f"base_url={tinker_env['TINKER_BASE_URL']}", f"log_path={log_path}",
                 "behavior_if_log_dir_exists=delete"], tinker_env, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]

    steps = [m for m in _jsonl(log_path / "metrics.jsonl") if "progress/batch" in m]
    # the cookbook's own count, as ints (a float step from the server's answer replaced it)
    assert [m["step"] for m in steps] == [0, 1] and all(type(m["step"]) is int for m in steps)
    for m in steps:
        assert m["env/all/total_episodes"] == 8  # groups_per_batch x group_size samples
        # the sampler's logprobs and the trainer's agree: importance ratios start at 1
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3
    final = [c for c in _jsonl(log_path / "checkpoints.jsonl") if c["name"] == "final"]
    assert len(final) == 1
    run_id = final[0]["state_path"].split("/")[2]
    assert final[0]["state_path"] == f"tinker://{run_id}/weights/final"
    assert final[0]["sampler_path"] == f"tinker://{run_id}/sampler_weights/final"
    assert {"weights/final", "sampler_weights/final"} <= _checkpoint_ids(run_id)


def test_math_rl_with_its_default_loss_fails_at_its_first_sample(tinker_env, tmp_path):
    """The recipe's default loss, stable_reinforce, is one TRIO lacks: the run stops at its
    first sample, naming it, instead of after sampling a whole batch."""
    done = _run(["-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={MODEL}",
                 "renderer_name=role_colon", "lora_rank=8", "group_size=2", "groups_per_batch=1", "max_tokens=5",
                 "max_steps=1", "eval_every=0", "save_every=0", f"base_url={tinker_env['TINKER_BASE_URL']}",
                 f"log_path={tmp_path / 'rl'}", "behavior_if_log_dir_exists=delete"], tinker_env, tmp_path)
    assert done.returncode != 0
    assert "record_stability_info" in done.stderr and "importance_sampling" in done.stderr, done.stderr[-4000:]


def test_supervised_recipe(tinker_env, tmp_path):
    log_path = tmp_path / "sl"
    done = _run([str(Path(__file__).with_name("sl_run.py")), str(log_path), tinker_env["TINKER_BASE_URL"]],
                tinker_env, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]

    metrics = _jsonl(log_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4, 5] and all(type(m["step"]) is int for m in metrics)
    evals = [m["test/nll"] for m in metrics if "test/nll" in m]
    assert len(evals) == 2 and evals[1] < evals[0]  # held-out loss, before and after 3 steps
    train = [m["train_mean_nll"] for m in metrics]
    assert min(train[-2:]) < train[0]
    saved = _jsonl(log_path / "checkpoints.jsonl")
    assert [c["name"] for c in saved] == ["000003", "final"]
    run_id = saved[-1]["state_path"].split("/")[2]
    assert {"weights/000003", "sampler_weights/000003", "weights/final", "sampler_weights/final"} <= _checkpoint_ids(run_id)
