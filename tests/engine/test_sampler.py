"""Sampler: greedy vs a plain-transformers argmax loop, logprobs vs the trainer, stops, seeds."""

import pytest
import torch

from trio_engine import (
    Example,
    ForwardJob,
    InvalidInputError,
    LoraConfig,
    SampleRequest,
    SamplingConfig,
)

from .helpers import plain_model, randomize_adapter

PROMPTS = [[1, 5, 9, 200, 31], [7, 7], [300, 2, 48, 1000, 5, 6, 90, 12]]


def greedy_reference(model, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def adapted(tiny_host):
    aid = "sampler-adapter"
    tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=1))
    randomize_adapter(tiny_host, aid, seed=5, scale=0.2)
    return aid


def test_greedy_matches_plain_argmax_loop(tiny_host):
    greedy = SamplingConfig(max_tokens=6, temperature=0.0)
    results = tiny_host.sample([SampleRequest(None, p, 2, greedy) for p in PROMPTS])
    model = plain_model("trio/tiny-llama")
    for prompt, result in zip(PROMPTS, results):
        want = greedy_reference(model, prompt, 6)
        for seq in result.sequences:
            assert seq.tokens[: len(want)] == want[: len(seq.tokens)]


def test_sampler_logprobs_equal_trainer_logprobs(tiny_host, adapted):
    cfg = SamplingConfig(max_tokens=10, temperature=1.0, seed=3)
    results = tiny_host.sample([SampleRequest(adapted, p, 3, cfg) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        for seq in result.sequences:
            full = prompt + seq.tokens
            ex = Example(full[:-1], {"target_tokens": full[1:]})
            trainer = tiny_host.forward([ForwardJob(adapted, [ex])])[0].logprobs[0][len(prompt) - 1 :]
            assert max(abs(a - b) for a, b in zip(seq.logprobs, trainer)) < 1e-4


def test_mixed_adapters_and_requests_equal_solo(tiny_host, adapted):
    greedy = SamplingConfig(max_tokens=5, temperature=0.0)
    reqs = [SampleRequest(adapted, PROMPTS[0], 1, greedy), SampleRequest(None, PROMPTS[0], 1, greedy),
            SampleRequest(adapted, PROMPTS[2], 2, SamplingConfig(max_tokens=7, temperature=0.8, seed=4))]
    together = tiny_host.sample(reqs)
    for req, got in zip(reqs, together):
        alone = tiny_host.sample([req])[0]
        assert [s.tokens for s in got.sequences] == [s.tokens for s in alone.sequences]
    assert together[0].sequences[0].tokens != together[1].sequences[0].tokens  # the adapter matters


def test_seed_reproduces_and_varies(tiny_host):
    cfg = lambda s: SamplingConfig(max_tokens=12, temperature=1.0, seed=s)  # noqa: E731
    a, b, c = (tiny_host.sample([SampleRequest(None, PROMPTS[1], 4, cfg(s))])[0] for s in (11, 11, 12))
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert [s.tokens for s in a.sequences] != [s.tokens for s in c.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) > 1  # samples of one request differ


def test_top_k_1_and_tiny_top_p_are_greedy(tiny_host):
    greedy = tiny_host.sample([SampleRequest(None, PROMPTS[2], 1, SamplingConfig(max_tokens=8, temperature=0))])
    for cfg in (SamplingConfig(max_tokens=8, top_k=1, seed=1), SamplingConfig(max_tokens=8, top_p=1e-6, seed=1)):
        got = tiny_host.sample([SampleRequest(None, PROMPTS[2], 2, cfg)])[0]
        assert all(s.tokens == greedy[0].sequences[0].tokens for s in got.sequences)


def test_stops(tiny_host):
    greedy = SamplingConfig(max_tokens=8, temperature=0.0)
    free = tiny_host.sample([SampleRequest(None, PROMPTS[0], 1, greedy)])[0].sequences[0]
    assert free.stop_reason == "length" and len(free.tokens) == 8
    stop_tok = free.tokens[3]
    first = free.tokens.index(stop_tok)
    by_token = SamplingConfig(max_tokens=8, temperature=0.0, stop_token_ids=(stop_tok,))
    seq = tiny_host.sample([SampleRequest(None, PROMPTS[0], 1, by_token)])[0].sequences[0]
    assert seq.tokens == free.tokens[: first + 1] and seq.stop_reason == "stop"
    stop_text = tiny_host.tokenizer.decode([stop_tok])
    if stop_text.strip():
        by_str = SamplingConfig(max_tokens=8, temperature=0.0, stop_strings=(stop_text,))
        seq = tiny_host.sample([SampleRequest(None, PROMPTS[0], 1, by_str)])[0].sequences[0]
        assert stop_text in tiny_host.tokenizer.decode(seq.tokens) and seq.stop_reason == "stop"
        assert len(seq.tokens) <= first + 1
    assert seq.text == tiny_host.tokenizer.decode(seq.tokens, skip_special_tokens=True)


def test_compute_logprobs(tiny_host, adapted):
    lps = tiny_host.compute_logprobs(adapted, PROMPTS[2])
    assert lps[0] is None and len(lps) == len(PROMPTS[2])
    res = tiny_host.sample([SampleRequest(adapted, PROMPTS[2], 1, SamplingConfig(max_tokens=1), prompt_logprobs=True)])
    assert res[0].prompt_logprobs == lps


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(config=SamplingConfig(max_tokens=0)), "max_tokens"),
        (dict(config=SamplingConfig(top_p=0.0)), "top_p"),
        (dict(config=SamplingConfig(top_p=1.5)), "top_p"),
        (dict(config=SamplingConfig(temperature=-1)), "temperature"),
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[1, 10**7]), "prompt"),
        (dict(num_samples=0), "num_samples"),
        (dict(config=SamplingConfig(max_tokens=10_000)), "prompt"),
    ],
)
def test_bad_sampling_input(tiny_host, kwargs, field):
    req = SampleRequest(None, kwargs.pop("prompt", [1, 2]), **kwargs)
    with pytest.raises(InvalidInputError, match=field):
        tiny_host.sample([SampleRequest(None, [1, 2]), req])


@pytest.mark.parametrize("cfg, allowed", [
    (SamplingConfig(temperature=1.0), {0, 1, 2, 3, 4}),
    (SamplingConfig(temperature=1.0, top_k=2), {0, 1}),
    (SamplingConfig(temperature=1.0, top_p=0.7), {0, 1}),
])
def test_draws_follow_the_filtered_distribution(cfg, allowed):
    """Empirical frequencies of sample_tokens match softmax of the filtered logits."""
    from trio_engine.sampler import sample_tokens

    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]])).repeat(20_000, 1)
    draws = sample_tokens(logits, cfg, torch.Generator().manual_seed(0))
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    mask = torch.tensor([k in allowed for k in range(5)])
    expected = torch.where(mask, probs, 0) / probs[mask].sum()
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)
