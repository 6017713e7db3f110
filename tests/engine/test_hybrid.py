"""Models that mix tokens outside attention (short convolutions, linear attention, Mamba)
carry a state along the sequence: they train on padded rows, never packed ones (one
sequence's state would run on into the next), and the sampler, whose cache keeps
attention's keys and values alone, refuses them by name."""

from __future__ import annotations

import random

import pytest
import torch

from trio_engine import ForwardJob, InvalidInputError, ModelHost
from trio_engine.sampler import SampleRequest, SamplingConfig

from .helpers import HYBRIDS, TEST_CATALOG, plain_model, random_example, reference_logprobs


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def host(request):
    return ModelHost(HYBRIDS[request.param].name, dtype="float32", catalog=TEST_CATALOG)


def test_a_ragged_batch_gives_each_sequence_its_own_logprobs(host):
    """Three sequences of different lengths in one call: each equals a plain transformers
    forward of it alone (packed, the second and third started from the state the one
    before left: 0.5-2 nats off)."""
    rng = random.Random(3)
    examples = [random_example(host.vocab_size, n, rng) for n in (12, 5, 9)]
    [result] = host.forward([ForwardJob(None, examples)])
    reference = plain_model(host.model_name)
    for ex, ours in zip(examples, result.logprobs):
        expected = reference_logprobs(reference, ex.tokens, list(ex.inputs["target_tokens"]))
        torch.testing.assert_close(torch.tensor(ours), expected, atol=1e-5, rtol=1e-5)


def test_sampling_is_refused_naming_the_layers_the_sampler_cannot_keep(host):
    """It failed inside transformers' cache (IndexError) at the first sample."""
    request = SampleRequest(None, [5, 6, 7], config=SamplingConfig(max_tokens=2))
    with pytest.raises(InvalidInputError, match=r"requests\[0\]: .* cannot be sampled by TRIO: its .* layers"):
        host.sample([request])
