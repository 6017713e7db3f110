"""Sampler weights saved without a name are ephemeral: never listed, and cleaned up when
the service restarts, or when the run has saved more than the service keeps."""

from __future__ import annotations

import dataclasses

import pytest

import pytrio as trio
from pytrio.transport.local import LocalTransport
from trio_server.core import Limits, ServiceCore

MODEL = "trio/tiny-llama"
PROMPT = trio.ModelInput.from_ints([1, 17, 300])
PARAMS = trio.SamplingParams(max_tokens=2, temperature=0.0)


def checkpoint_dirs(core: ServiceCore, run_id: str) -> set[str]:
    root = core.data_dir / "checkpoints" / run_id
    return {f"{p.parent.name}/{p.name}" for p in root.glob("*/*")}


def test_ephemeral_sampler_weights_are_gone_after_a_restart(tmp_path):
    core = ServiceCore(tmp_path, dtype="float32")
    tc = trio.ServiceClient(transport=LocalTransport(core)).create_lora_training_client(base_model=MODEL, rank=2)
    ephemeral = tc.save_weights_and_get_sampling_client()
    named = tc.save_weights_and_get_sampling_client(name="kept")
    ephemeral.sample(PROMPT, 1, PARAMS).result()
    assert len(checkpoint_dirs(core, tc.model_id)) == 2
    core.close()

    core = ServiceCore(tmp_path, dtype="float32")
    try:
        assert checkpoint_dirs(core, tc.model_id) == {"sampler_weights/kept"}
        service = trio.ServiceClient(transport=LocalTransport(core))
        with pytest.raises(trio.NotFoundError):
            service.create_sampling_client(model_path=ephemeral.model_path)
        assert service.create_sampling_client(model_path=named.model_path).sample(PROMPT, 1, PARAMS).result()
    finally:
        core.close()


def test_a_run_keeps_only_its_newest_ephemeral_sampler_weights(tmp_path):
    core = ServiceCore(tmp_path, dtype="float32", limits=dataclasses.replace(Limits(), ephemeral_samplers_per_run=2))
    try:
        tc = trio.ServiceClient(transport=LocalTransport(core)).create_lora_training_client(base_model=MODEL, rank=2)
        samplers = [tc.save_weights_and_get_sampling_client() for _ in range(3)]
        assert len(checkpoint_dirs(core, tc.model_id)) == 2
        with pytest.raises(trio.NotFoundError, match=r"no longer exists \(unnamed sampler weights.*name them"):
            samplers[0].sample(PROMPT, 1, PARAMS).result()
        for sampler in samplers[1:]:
            sampler.sample(PROMPT, 1, PARAMS).result()
    finally:
        core.close()
