"""Sampler vs plain transformers: greedy loops, logprobs, draws vs softmax(logits / T); stops, seeds."""

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from trio_engine import (
    DecodeBatch,
    Example,
    ForwardJob,
    InvalidInputError,
    LoraConfig,
    ModelHost,
    SampleRequest,
    SamplingConfig,
    lora,
)
from trio_engine.kv_cache import MIN_ROOM, GrowingCache, GrowingLayer

from .helpers import (
    TEST_CATALOG,
    merged_model,
    randomize_adapter,
    reference_logprobs,
    reference_next_logits,
)

PROMPTS = [[1, 5, 9, 200, 31], [7, 7], [300, 2, 48, 1000, 5, 6, 90, 12]]


def greedy_reference(model, prompt, n):
    """n argmax steps of a plain transformers model, re-running the whole prefix each time."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def adapted(tiny_host):
    aid = "sampler-adapter"
    tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=1))
    randomize_adapter(tiny_host, aid, seed=5, scale=0.2)
    yield aid
    tiny_host.delete_adapter(aid)  # the host is shared: tests may run in any order


@pytest.fixture(scope="module")
def reference_models(tiny_host, adapted):
    """Plain transformers models: the base, and the base with ``adapted`` merged by hand."""
    return {None: merged_model(tiny_host, None), adapted: merged_model(tiny_host, adapted)}


def test_a_stop_string_spanning_one_character_tokens_stops_at_its_last(tiny_host, monkeypatch):
    """A 5-character stop string drawn as 5 one-character tokens: stopped at the fifth."""
    from trio_engine import sampler

    digits = [tiny_host.tokenizer.convert_tokens_to_ids(d) for d in "12345"]
    assert tiny_host.tokenizer.decode(digits) == "12345"  # one token per character
    drawn = iter(digits * 2)
    monkeypatch.setattr(sampler, "_draw", lambda logits, rows: torch.tensor([next(drawn)] * len(rows)))
    config = SamplingConfig(max_tokens=8, temperature=1.0, stop_strings=("12345",), ignore_eos=True)
    seq = tiny_host.sample([SampleRequest(None, PROMPTS[0], 1, config)])[0].sequences[0]
    assert (seq.tokens, seq.stop_reason) == (digits, "stop")


def test_a_stop_string_of_characters_taking_several_tokens_each_stops_at_its_last(tiny_host, monkeypatch):
    """Three emoji of three byte-level tokens each: a stop string of 3 characters that the
    last 3 + 4 tokens do not hold."""
    from trio_engine import sampler

    tokens = tiny_host.tokenizer.encode("ok 🎉🎉🎉", add_special_tokens=False)
    assert "🎉🎉🎉" not in tiny_host.tokenizer.decode(tokens[-7:])  # the premise
    drawn = iter(tokens)
    monkeypatch.setattr(sampler, "_draw", lambda logits, rows: torch.tensor([next(drawn)] * len(rows)))
    config = SamplingConfig(max_tokens=len(tokens) + 4, stop_strings=("🎉🎉🎉",), ignore_eos=True)
    seq = tiny_host.sample([SampleRequest(None, PROMPTS[0], 1, config)])[0].sequences[0]
    assert (seq.tokens, seq.stop_reason) == (tokens, "stop")


@pytest.mark.parametrize("temperature", [1e-30, 1e-40, 5e-324])
def test_a_tiny_temperature_samples_the_likeliest_token(temperature):
    """Logits over a tiny temperature overflow fp32; shifted to a maximum of 0 first, they
    give the argmax all the mass instead of NaNs."""
    from trio_engine.sampler import filtered_probs

    logits = torch.tensor([[1.0, 3.0, -2.0, 2.5], [0.5, -1.0, 0.25, 0.0]])
    for config in (SamplingConfig(temperature=temperature), SamplingConfig(temperature=temperature, top_p=0.5),
                   SamplingConfig(temperature=temperature, top_k=2)):
        assert torch.equal(filtered_probs(logits, config), torch.eye(4)[[1, 0]]), config


@pytest.mark.parametrize("generation_eos, tokenizer_eos, want", [
    (None, None, set()), (5, None, {5}), ([5, 7], None, {5, 7}), (None, 3, {3}), ([5, 7], 3, {3, 5, 7}),
    ("no config", 3, {3}),
])
def test_eos_ids_join_the_generation_config_and_the_tokenizer(generation_eos, tokenizer_eos, want):
    from types import SimpleNamespace

    from trio_engine.sampler import _eos_ids

    config = None if generation_eos == "no config" else SimpleNamespace(eos_token_id=generation_eos)
    host = SimpleNamespace(model=SimpleNamespace(generation_config=config),
                           tokenizer=SimpleNamespace(eos_token_id=tokenizer_eos))
    assert _eos_ids(host) == want


def test_sampling_passes_the_kv_cache_by_its_current_name(tiny_host):
    """No deprecated keyword (transformers 5 calls it ``cache``; ``past_key_values`` warns)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        tiny_host.sample([SampleRequest(None, PROMPTS[0], 2, SamplingConfig(max_tokens=3, seed=1))])


@pytest.mark.parametrize("with_adapter", [False, True])
def test_greedy_matches_plain_argmax_loop(tiny_host, adapted, reference_models, with_adapter):
    aid = adapted if with_adapter else None
    n = MIN_ROOM + 8  # past the room of the KV buffers the prefill made: decode steps outgrow them
    greedy = SamplingConfig(max_tokens=n, temperature=0.0)
    results = tiny_host.sample([SampleRequest(aid, p, 2, greedy) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        model = reference_models[aid]
        want = greedy_reference(model, prompt, n)
        assert len(result.sequences) == 2
        for seq in result.sequences:
            # whole sequences, of the full length: an empty or short output fails here
            assert seq.tokens == want and len(seq.tokens) == n
            assert seq.stop_reason == "length"
            ref_lp = reference_logprobs(model, prompt + want[:-1], prompt[1:] + want)[-n:]
            torch.testing.assert_close(torch.tensor(seq.logprobs), ref_lp, atol=1e-4, rtol=1e-4)


def test_an_fp32_batch_decodes_on_kv_buffers_that_grow_in_place(tiny_host):
    batch = DecodeBatch(tiny_host, None)
    with torch.no_grad():
        batch.admit([SampleRequest(None, PROMPTS[0], 2, SamplingConfig(max_tokens=4, seed=0))], ["r"])
        batch.step()
        where = [layer.keys.data_ptr() for layer in batch.cache.layers]
        batch.step()  # a step writes into the room the prefill left: nothing moves
        assert [layer.keys.data_ptr() for layer in batch.cache.layers] == where
    assert isinstance(batch.cache, GrowingCache)
    assert batch.cache.layers and all(isinstance(layer, GrowingLayer) for layer in batch.cache.layers)




def test_sampler_logprobs_equal_trainer_logprobs(tiny_host, adapted):
    cfg = SamplingConfig(max_tokens=10, temperature=1.0, seed=3)
    results = tiny_host.sample([SampleRequest(adapted, p, 3, cfg) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        for seq in result.sequences:
            full = prompt + seq.tokens
            ex = Example(full[:-1], {"target_tokens": full[1:]})
            trainer = tiny_host.forward([ForwardJob(adapted, [ex])])[0].logprobs[0][len(prompt) - 1 :]
            assert max(abs(a - b) for a, b in zip(seq.logprobs, trainer)) < 1e-4


def test_every_family_samples_with_trainer_logprobs(family_host, new_id):
    """Each family: sampled tokens' logprobs (KV-cache decode, left-padded prefill) equal
    the trainer's for the same sequence, and greedy decoding follows a plain transformers
    argmax loop of the base with the adapter merged by hand (the family's head included)."""
    host = family_host
    aid = new_id()
    host.create_adapter(aid, LoraConfig(rank=4, seed=1))
    randomize_adapter(host, aid, seed=5, scale=0.2)
    prompts = PROMPTS[:1] + PROMPTS[2:]
    cfg = SamplingConfig(max_tokens=6, temperature=1.0, seed=3)
    for prompt, result in zip(prompts, host.sample([SampleRequest(aid, p, 2, cfg) for p in prompts])):
        for seq in result.sequences:
            full = prompt + seq.tokens
            ex = Example(full[:-1], {"target_tokens": full[1:]})
            trainer = host.forward([ForwardJob(aid, [ex])])[0].logprobs[0][len(prompt) - 1 :]
            torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(trainer), atol=1e-4, rtol=1e-4)
    greedy = host.sample([SampleRequest(aid, PROMPTS[2], 1, SamplingConfig(max_tokens=4, temperature=0.0))])
    assert greedy[0].sequences[0].tokens == greedy_reference(merged_model(host, aid), PROMPTS[2], 4)
    host.delete_adapter(aid)


def test_mixed_adapters_and_requests_equal_solo(tiny_host, adapted):
    """Rows of one sampling config interleaved with another's (greedy rows 0 and 3, sampled
    rows 1, 2 and 4): each request draws what it draws alone."""
    greedy = SamplingConfig(max_tokens=5, temperature=0.0)
    sampled = lambda seed: SamplingConfig(max_tokens=7, temperature=0.8, seed=seed)  # noqa: E731
    reqs = [SampleRequest(adapted, PROMPTS[0], 1, greedy), SampleRequest(adapted, PROMPTS[2], 2, sampled(4)),
            SampleRequest(None, PROMPTS[0], 1, greedy), SampleRequest(None, PROMPTS[1], 1, sampled(5))]
    together = tiny_host.sample(reqs)
    for req, got in zip(reqs, together):
        alone = tiny_host.sample([req])[0]
        assert [s.tokens for s in got.sequences] == [s.tokens for s in alone.sequences]
    assert together[0].sequences[0].tokens != together[2].sequences[0].tokens  # the adapter matters


# -- merged weights: a long decode batch of one adapter runs on W0 + s·B·A ---------------------


def merged_layers(host) -> list[lora.LoRALinear]:
    """The host's layers that hold merged weights."""
    return [m for _, m in lora.lora_modules(host.model) if isinstance(m, lora.LoRALinear) and m._merged is not None]


def merged_to(host) -> set[int]:
    """The ids of the A tensors the host's layers hold merged weights of."""
    return {id(m._merged[0][0]) for m in merged_layers(host)}


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize("config", [LoraConfig(rank=4, seed=1), LoraConfig(rank=4, seed=1, train_attn=False)],
                         ids=["every-layer", "mlp-and-head"])
def test_a_long_one_adapter_batch_samples_as_the_model_merged_by_hand(tiny_host, new_id, monkeypatch, config, packed):
    """A batch whose every row uses one adapter and has ``MERGE_MIN_STEPS`` tokens to go
    decodes on merged weights (made here, not before): its greedy tokens and logprobs are a
    plain transformers model's with the adapter merged by hand; after the adapter's weights
    change in place (as an optimizer step changes them) they are remade, and they go with
    the adapter. A layer the adapter skips keeps its base weights."""
    from trio_engine import sampler

    monkeypatch.setattr(sampler, "MERGE_MIN_STEPS", 12)
    monkeypatch.setattr(tiny_host.routing.packed, "enabled", packed)  # kept packed, or plain
    aid = new_id("merged")
    tiny_host.create_adapter(aid, config)
    a_tensors = {id(t) for name, t in tiny_host.adapter_params(aid).items() if name.endswith("lora_A")}
    greedy = lambda n: SamplingConfig(max_tokens=n, temperature=0.0)  # noqa: E731
    try:
        for b_seed in (5, 6):
            randomize_adapter(tiny_host, aid, seed=b_seed, scale=0.2)
            if b_seed == 5:
                tiny_host.sample([SampleRequest(aid, PROMPTS[1], 2, greedy(11))])
                assert not merged_to(tiny_host) & a_tensors  # 11 steps to go: not worth a merge
            model = merged_model(tiny_host, aid)
            for prompt, result in zip(PROMPTS, tiny_host.sample([SampleRequest(aid, p, 2, greedy(12)) for p in PROMPTS])):
                want = greedy_reference(model, prompt, 12)
                for seq in result.sequences:
                    assert seq.tokens == want
                    ref_lp = reference_logprobs(model, prompt + want[:-1], prompt[1:] + want)[-12:]
                    torch.testing.assert_close(torch.tensor(seq.logprobs), ref_lp, atol=1e-4, rtol=1e-4)
            assert merged_to(tiny_host) == a_tensors  # every layer of the adapter, and only those
            assert all(m._merged[1].is_mkldnn == packed for m in merged_layers(tiny_host))  # packed, no plain copy beside it
        # the decode passes read the merged copy: made the base weights, it samples otherwise
        for layer in merged_layers(tiny_host):
            base = layer.base.weight.detach().clone()
            layer._merged = (layer._merged[0], lora.pack(base) if layer._merged[1].is_mkldnn else base)
        result = tiny_host.sample([SampleRequest(aid, PROMPTS[2], 1, greedy(12))])[0]
        assert result.sequences[0].tokens != greedy_reference(model, PROMPTS[2], 12)
    finally:
        tiny_host.delete_adapter(aid)
    assert not merged_to(tiny_host)  # the copy went with the adapter


def test_a_batch_merges_only_while_every_row_uses_one_adapter(tiny_host, new_id, monkeypatch):
    """Rows of the base model joining a merged batch stop the merging; once they leave, it
    resumes; an emptied batch decides afresh. The base rows' logprobs are the base model's."""
    from trio_engine import sampler

    monkeypatch.setattr(sampler, "MERGE_MIN_STEPS", 4)
    aid = new_id("merging")
    tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=1))
    randomize_adapter(tiny_host, aid, seed=5, scale=0.2)
    batch, done = tiny_host.decode_batch(), {}
    tiny_host.admit(batch, [SampleRequest(aid, PROMPTS[0], 1, SamplingConfig(max_tokens=10, seed=0))], ["adapted"])
    done.update(tiny_host.decode_step(batch))
    assert batch._merged_adapter() == aid
    base = SampleRequest(None, PROMPTS[1], 2, SamplingConfig(max_tokens=3, seed=1))
    tiny_host.admit(batch, [base], ["base"])
    merged_while_mixed = []
    while "base" not in done:
        merged_while_mixed.append(batch._merged_adapter())
        done.update(tiny_host.decode_step(batch))
    assert merged_while_mixed == [None] * 3
    assert batch._merged_adapter() == aid  # the adapter's rows alone again
    while len(batch):
        done.update(tiny_host.decode_step(batch))
    assert batch._merging is None
    for seq in done["base"].sequences:
        full = base.prompt + seq.tokens
        trainer = tiny_host.forward([ForwardJob(None, [Example(full[:-1], {"target_tokens": full[1:]})])])[0]
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(trainer.logprobs[0][len(base.prompt) - 1:]),
                                   atol=1e-4, rtol=1e-4)
    tiny_host.delete_adapter(aid)


def test_only_fp32_layers_within_the_budget_merge(tiny_host):
    from trio_engine import TINY_LLAMA, ModelHost

    weights = sum(m.base.weight.numel() * 4 for _, m in lora.lora_modules(tiny_host.model)
                  if isinstance(m, lora.LoRALinear))
    assert tiny_host.routing.may_merge  # the default budget
    assert lora.mergeable(tiny_host.model, weights) and not lora.mergeable(tiny_host.model, weights - 1)
    assert not ModelHost(TINY_LLAMA, dtype="bfloat16").routing.may_merge
    assert not ModelHost(TINY_LLAMA, dtype="float32", merge_bytes=0).routing.may_merge


def test_a_bad_merge_budget_in_the_environment_is_named(monkeypatch):
    from trio_engine import TINY_LLAMA, ModelHost

    monkeypatch.setenv("TRIO_MERGE_BYTES", "2GB")
    with pytest.raises(ValueError, match="TRIO_MERGE_BYTES: '2GB'"):
        ModelHost(TINY_LLAMA, dtype="float32")


def test_seed_reproduces_and_varies(tiny_host):
    cfg = lambda s: SamplingConfig(max_tokens=12, temperature=1.0, seed=s)  # noqa: E731
    a, b, c = (tiny_host.sample([SampleRequest(None, PROMPTS[1], 4, cfg(s))])[0] for s in (11, 11, 12))
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert [s.tokens for s in a.sequences] != [s.tokens for s in c.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) > 1  # samples of one request differ


def test_a_seeded_draw_keeps_its_token_when_the_logits_move_in_their_last_bits():
    """A row's fp32 logits move by ~1e-4 with the rows beside it (matrix products round a
    row differently with the number of rows). Seeded rows drew by inverse CDF, which flips
    whenever its number lands among tokens whose probabilities are below the running sum's
    noise: on the bundled model 5 of 32 seeded sequences changed with their batch. The
    exponential race flips only where its two best ratios are that close."""
    from trio_engine import sampler
    from trio_engine.sampler import _Admitted, _Row

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 49152, generator=generator) * 2.5  # a long tail, as an LM's
    moved = logits + torch.randn(logits.shape, generator=generator) * 1e-4
    draws = 400

    def drawn(logits: torch.Tensor, seed: int | None) -> list[int]:
        config = SamplingConfig(temperature=1.0, seed=seed)
        owner = _Admitted(0, SampleRequest(None, [1], draws, config), torch.Generator().manual_seed(7), None)
        return sampler._draw(logits.expand(draws, -1), [_Row(owner) for _ in range(draws)]).tolist()

    assert drawn(logits, seed=7) == drawn(moved, seed=7)
    flips = sum(a != b for a, b in zip(drawn(logits, None), drawn(moved, None)))  # what unseeded rows take
    assert flips > 2  # the test has the power to see the inverse CDF's flips


def test_a_draw_at_the_very_top_of_the_cdf_stays_in_the_vocabulary():
    """u = rand * cdf[-1] can round up to cdf[-1]; searchsorted then points one past the end."""
    from trio_engine import sampler

    probs = torch.tensor([[0.25, 0.25, 0.5], [1.0, 0.0, 0.0]])
    assert sampler._inverse_cdf(probs, torch.ones(2, 1)).tolist() == [2, 2]


def test_prompt_logprobs_come_only_when_asked(tiny_host):
    plain = tiny_host.sample([SampleRequest(None, PROMPTS[2], 1, SamplingConfig(max_tokens=1))])[0]
    assert plain.prompt_logprobs is None


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


def test_text_leaves_out_special_tokens(tiny_host, monkeypatch):
    """The text of a sequence that drew special tokens (EOS) is its words only."""
    from trio_engine import sampler

    eos = tiny_host.tokenizer.eos_token_id
    word = tiny_host.tokenizer.encode("hello", add_special_tokens=False)
    drawn = iter([word[0], eos, eos])
    monkeypatch.setattr(sampler, "_draw", lambda logits, rows: torch.tensor([next(drawn)] * len(rows)))
    config = SamplingConfig(max_tokens=3, temperature=1.0, ignore_eos=True)
    seq = tiny_host.sample([SampleRequest(None, PROMPTS[0], 1, config)])[0].sequences[0]
    assert seq.tokens == [word[0], eos, eos]
    assert seq.text == tiny_host.tokenizer.decode([word[0]]) != tiny_host.tokenizer.decode(seq.tokens)


@pytest.mark.parametrize("with_adapter", [False, True])
def test_compute_logprobs_match_plain_forward(tiny_host, adapted, reference_models, with_adapter):
    """compute_logprobs against a plain transformers forward (adapter merged by hand)."""
    aid = adapted if with_adapter else None
    for prompt in PROMPTS:
        lps = tiny_host.compute_logprobs(aid, prompt)
        assert lps[0] is None and len(lps) == len(prompt)
        want = reference_logprobs(reference_models[aid], prompt[:-1], prompt[1:])
        torch.testing.assert_close(torch.tensor(lps[1:]), want, atol=1e-5, rtol=1e-5)
    assert tiny_host.compute_logprobs(aid, [42]) == [None]
    if with_adapter:  # the adapter really changes these numbers
        base = reference_logprobs(reference_models[None], PROMPTS[2][:-1], PROMPTS[2][1:])
        assert not torch.allclose(torch.tensor(lps[1:]), base, atol=1e-2)
    req = SampleRequest(aid, PROMPTS[2], 1, SamplingConfig(max_tokens=1), prompt_logprobs=True)
    assert tiny_host.sample([req])[0].prompt_logprobs == lps


# -- the distribution of draws ------------------------------------------------------------

# The draws come from a tiny Llama with a 512-token vocabulary: thousands of draws over
# 49k tokens would spend their time sorting logits (top-p), not testing anything more.
# Its random-init logits are nearly uniform at any temperature; an lm_head adapter with
# large B spreads them to a std of a few nats, so that T visibly reshapes the distribution.
DIST_PROMPT = [1, 5, 9, 200, 31]
DIST_SEEDS = (11, 12)  # one request of 1024 samples per seed
DRAWS = 1024 * len(DIST_SEEDS)
BIN_MASS = 0.02  # each bin of tokens holds >= 2% of the reference mass: >= 40 expected draws
Z_MAX = 4.5  # tolerated |observed - expected| per bin, in binomial standard deviations


@pytest.fixture(scope="module")
def small_vocab_host(tiny_host, tmp_path_factory):
    """The tiny Llama's shape with a 512-token vocabulary (the tokenizer decodes its ids)."""
    config = copy.deepcopy(tiny_host.model.config)
    config.vocab_size = 512
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("small-vocab")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tiny_host.tokenizer.save_pretrained(folder)
    TEST_CATALOG.add_folder("small-vocab", folder)  # where the reference helpers look too
    return ModelHost("small-vocab", dtype="float32", catalog=TEST_CATALOG)


@pytest.fixture(scope="module")
def sharp(small_vocab_host):
    """(adapter id, the plain merged model's next-token logits (V,) after DIST_PROMPT)."""
    aid = "sampler-sharp"
    small_vocab_host.create_adapter(aid, LoraConfig(rank=4, seed=2, train_attn=False, train_mlp=False))
    randomize_adapter(small_vocab_host, aid, seed=7, scale=0.3)
    yield aid, reference_next_logits(merged_model(small_vocab_host, aid), DIST_PROMPT)
    small_vocab_host.delete_adapter(aid)


def filtered_distribution(logits, temperature, top_k=-1, top_p=1.0):
    """softmax(logits / T) kept on its top_k most likely tokens, then on the fewest most
    likely of those whose renormalised mass reaches top_p; renormalised, float64 (V,)."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(p, descending=True)
    n = p.numel() if top_k <= 0 else min(top_k, p.numel())
    if top_p < 1:
        kept = p[order[:n]] / p[order[:n]].sum()
        mass_before = torch.cumsum(kept, 0) - kept
        assert float((mass_before - top_p).abs().min()) > 1e-4  # no token on the edge
        n = int((mass_before < top_p).sum())
    out = torch.zeros_like(p)
    out[order[:n]] = p[order[:n]]
    return out / out.sum()


def rank_bins(p):
    """Tokens of the support of p by decreasing probability, cut into consecutive groups
    of at least BIN_MASS each (the last group takes what is left)."""
    order = torch.argsort(p, descending=True)
    order = order[p[order] > 0]
    bins, start, mass = [], 0, 0.0
    for i, x in enumerate(p[order].tolist()):
        mass += x
        if mass >= BIN_MASS:
            bins.append(order[start : i + 1])
            start, mass = i + 1, 0.0
    if start < len(order):
        if bins:
            bins[-1] = torch.cat([bins[-1], order[start:]])
        else:
            bins.append(order[start:])
    return bins


def bin_z_scores(counts, p):
    """(observed - expected) / binomial std of DRAWS draws from p, per rank bin of p."""
    z = []
    for b in rank_bins(p):
        mass = float(p[b].sum())
        if mass < 1 - 1e-9:
            z.append((float(counts[b].sum()) - DRAWS * mass) / (DRAWS * mass * (1 - mass)) ** 0.5)
    return torch.tensor(z)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(0.5, -1, 1.0), (2.0, -1, 1.0), (0.5, 40, 1.0), (2.0, 40, 1.0), (0.5, -1, 0.8), (2.0, 300, 0.7)],
)
def test_draws_follow_softmax_over_temperature(small_vocab_host, sharp, temperature, top_k, top_p):
    """Many one-token draws match softmax(logits / T) (then top-k, top-p) of a plain forward."""
    aid, logits = sharp
    requests = [
        SampleRequest(aid, DIST_PROMPT, DRAWS // len(DIST_SEEDS),
                      SamplingConfig(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, seed=s))
        for s in DIST_SEEDS
    ]
    seqs = [seq for result in small_vocab_host.sample(requests) for seq in result.sequences]
    drawn = torch.tensor([seq.tokens[0] for seq in seqs])
    assert len(drawn) == DRAWS

    want = filtered_distribution(logits, temperature, top_k, top_p)
    counts = torch.bincount(drawn, minlength=want.numel()).double()
    assert float(counts[want == 0].sum()) == 0  # nothing outside the top-k / top-p support
    z = bin_z_scores(counts, want)
    assert len(z) >= 2 and float(z.abs().max()) < Z_MAX, z

    # The test has the power to see an ignored temperature: the draws such a sampler makes
    # would land outside the support, or miss some bin's expected count by > 3 * Z_MAX.
    ignored = filtered_distribution(logits, 1.0, top_k, top_p)
    outside = DRAWS * float(ignored[want == 0].sum())
    assert outside > 20 or float(bin_z_scores(DRAWS * ignored, want).abs().max()) > 3 * Z_MAX

    # each draw's logprob is log p(token) under the model at temperature 1, whatever T
    ref_lp = torch.log_softmax(logits.double(), -1)[drawn]
    torch.testing.assert_close(torch.tensor([seq.logprobs[0] for seq in seqs], dtype=torch.float64), ref_lp,
                               atol=1e-4, rtol=1e-4)


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


VOCAB, CONTEXT = 100, 50  # for validate_request, which is pure


def valid(**changes) -> SampleRequest:
    config = {k: changes.pop(k) for k in list(changes) if k in SamplingConfig.__dataclass_fields__}
    return SampleRequest(None, changes.pop("prompt", [0, VOCAB - 1]), changes.pop("num_samples", 1),
                         SamplingConfig(**{"max_tokens": 4, **config}))


@pytest.mark.parametrize("changes, field, message", [
    (dict(prompt=[]), "prompt", "must not be empty, got 0"),
    (dict(num_samples=0), "num_samples", "must be in [1, 1024], got 0"),
    (dict(num_samples=1025), "num_samples", "must be in [1, 1024], got 1025"),
    (dict(max_tokens=0), "sampling_params.max_tokens", "must be > 0, got 0"),
    (dict(temperature=-0.5), "sampling_params.temperature", "must be >= 0, got -0.5"),
    (dict(temperature=math.inf), "sampling_params.temperature", "must be >= 0, got inf"),
    (dict(top_p=0.0), "sampling_params.top_p", "must be in (0, 1], got 0.0"),
    (dict(top_k=-2), "sampling_params.top_k", "must be -1 (off) or >= 0, got -2"),
    (dict(prompt=[1, 2], max_tokens=CONTEXT - 1), "prompt",
     f"prompt length + max_tokens exceeds the context of {CONTEXT}, got {CONTEXT + 1}"),
    (dict(prompt=[1, VOCAB]), "prompt", f"token id {VOCAB} outside the vocabulary [0, {VOCAB})"),
    (dict(prompt=[-1, 1]), "prompt", f"token id -1 outside the vocabulary [0, {VOCAB})"),
    (dict(stop_token_ids=(3, VOCAB)), "sampling_params.stop", f"token id {VOCAB} outside the vocabulary [0, {VOCAB})"),
    (dict(seed=2**64), "sampling_params.seed", f"must be in [{-2**63}, {2**64}) (torch's generator seeds), got {2**64}"),
    (dict(seed=-2**63 - 1), "sampling_params.seed",
     f"must be in [{-2**63}, {2**64}) (torch's generator seeds), got {-2**63 - 1}"),
    (dict(stop_strings=("\n", "")), "sampling_params.stop",
     "a stop string must not be empty (it would end every sequence at its first token), got ['\\n', '']"),
])
def test_a_bad_sample_request_is_named_exactly(changes, field, message):
    """The error names the request's index, the field and the value, word for word."""
    from trio_engine.sampler import validate_request

    with pytest.raises(InvalidInputError) as info:
        validate_request(valid(**changes), 3, VOCAB, CONTEXT)
    assert (str(info.value), info.value.index, info.value.field) == (f"requests[3].{field}: {message}", 3, field)


@pytest.mark.parametrize("changes", [
    dict(prompt=[5]), dict(num_samples=1), dict(num_samples=1024), dict(max_tokens=1), dict(temperature=0.0),
    dict(top_p=1.0), dict(top_k=-1), dict(top_k=0), dict(prompt=[1, 2], max_tokens=CONTEXT - 2),
    dict(prompt=[0, VOCAB - 1], stop_token_ids=(0, VOCAB - 1)), dict(seed=2**64 - 1), dict(seed=-2**63),
])
def test_a_sample_request_at_the_edge_of_every_bound_is_valid(changes):
    from trio_engine.sampler import validate_request

    validate_request(valid(**changes), 0, VOCAB, CONTEXT)


@pytest.mark.parametrize("cfg, allowed", [
    (SamplingConfig(temperature=1.0), {0, 1, 2, 3, 4}),
    (SamplingConfig(temperature=1.0, top_k=2), {0, 1}),
    (SamplingConfig(temperature=1.0, top_p=0.7), {0, 1}),
])
@pytest.mark.parametrize("draw, width", [("_inverse_cdf", 1), ("_exponential_race", None)])
def test_draws_follow_the_filtered_distribution(cfg, allowed, draw, width):
    """Empirical frequencies of draws (inverse CDF, exponential race) match softmax of the
    filtered logits."""
    from trio_engine import sampler
    from trio_engine.sampler import filtered_probs

    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]])).repeat(20_000, 1)
    u = torch.rand(20_000, width or sampler.race_width(5), generator=torch.Generator().manual_seed(0))
    draws = getattr(sampler, draw)(filtered_probs(logits, cfg), u)
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    mask = torch.tensor([k in allowed for k in range(5)])
    expected = torch.where(mask, probs, 0) / probs[mask].sum()
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_a_race_number_of_zero_still_draws_the_one_block_with_mass():
    """u = 0 (1 in 2^24) made E infinite and every ratio 0, so argmax took block 0."""
    from trio_engine import sampler

    assert sampler._race(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.5, 0.0, 0.5]])).tolist() == [1]


def test_the_race_draws_across_blocks_of_the_vocabulary_in_proportion():
    """Tokens at both ends of blocks, and in a last block the padding fills, are drawn as
    often as their probabilities say (a block's race weighs its mass, its index places it)."""
    from trio_engine import sampler

    vocab, rows = 3 * sampler.RACE_BLOCK + 90, 40_000
    chosen = {0: 0.2, 255: 0.15, 256: 0.25, 700: 0.1, vocab - 1: 0.2}
    probs = torch.full((vocab,), 0.1 / (vocab - len(chosen)))
    for token, p in chosen.items():
        probs[token] = p
    u = torch.rand(rows, sampler.race_width(vocab), generator=torch.Generator().manual_seed(0))
    draws = sampler._exponential_race(probs.repeat(rows, 1), u)
    freq = torch.bincount(draws, minlength=vocab).float() / rows
    assert len(freq) == vocab  # every draw in the vocabulary, none in the padding
    for token, p in chosen.items():
        assert abs(float(freq[token]) - p) < 0.01, (token, float(freq[token]), p)
    assert abs(float(freq.sum() - sum(freq[t] for t in chosen)) - 0.1) < 0.01  # the rest, together


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, -1, 1.0), (0.7, 0, 1.0), (1.0, 2, 1.0), (1.5, 7, 1.0), (1.0, 12, 1.0), (1.0, -1, 0.6), (0.5, 5, 0.8),
])
def test_filtered_probs_equal_the_hand_written_filter(rows, temperature, top_k, top_p):
    """Every row's probabilities are the reference filter's (top_k 0 and -1 are off, a top_k
    of the vocabulary size or more keeps every token), a single row as well as several."""
    from trio_engine.sampler import filtered_probs

    logits = torch.randn(rows, 12, generator=torch.Generator().manual_seed(rows))
    got = filtered_probs(logits, SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
    want = torch.stack([filtered_distribution(row, temperature, top_k, top_p) for row in logits])
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)


# -- continuous batching: requests join and leave a running decode batch -------------------


def run_alone(host, req):
    return host.sample([req])[0]


def test_a_request_admitted_mid_decode_gets_its_solo_tokens_and_trainer_logprobs(tiny_host, adapted):
    """Requests joining a running batch (prompts longer and shorter than its cache) draw what
    they draw alone, seeded or greedy, and their logprobs still match the trainer's."""
    first = SampleRequest(adapted, PROMPTS[1], 2, SamplingConfig(max_tokens=12, temperature=1.0, seed=21))
    joining = [SampleRequest(adapted, PROMPTS[2] + PROMPTS[0], 3, SamplingConfig(max_tokens=6, seed=22)),
               SampleRequest(None, PROMPTS[0][:2], 1, SamplingConfig(max_tokens=5, temperature=0.0)),
               SampleRequest(adapted, PROMPTS[0], 2, SamplingConfig(max_tokens=4, top_k=50, top_p=0.9, seed=23))]
    batch = tiny_host.decode_batch()
    tiny_host.admit(batch, [first], ["first"])
    results = {}
    for _ in range(3):
        results.update(tiny_host.decode_step(batch))
    width = batch.width
    tiny_host.admit(batch, joining[:2], ["long-prompt", "short-prompt"])
    assert batch.width == len(joining[0].prompt) > width  # the running cache was padded on the left
    results.update(tiny_host.decode_step(batch))
    tiny_host.admit(batch, joining[2:], ["late"])  # a prompt narrower than the cache: padded itself
    while len(batch):
        results.update(tiny_host.decode_step(batch))

    for ticket, req in zip(["first", "long-prompt", "short-prompt", "late"], [first, *joining]):
        alone = run_alone(tiny_host, req)
        assert [s.tokens for s in results[ticket].sequences] == [s.tokens for s in alone.sequences], ticket
        for seq in results[ticket].sequences:
            full = req.prompt + seq.tokens
            ex = Example(full[:-1], {"target_tokens": full[1:]})
            trainer = tiny_host.forward([ForwardJob(req.adapter_id, [ex])])[0].logprobs[0][len(req.prompt) - 1:]
            assert max(abs(a - b) for a, b in zip(seq.logprobs, trainer)) < 1e-4, ticket


def test_finished_requests_leave_the_batch_at_once(tiny_host):
    """A request is returned by the step that finishes it; its rows and the cache columns only
    it used leave the batch."""
    fixed = lambda n: SamplingConfig(max_tokens=n, temperature=1.0, seed=n, ignore_eos=True)  # noqa: E731
    short = SampleRequest(None, PROMPTS[2], 3, fixed(2))  # the longer prompt: the widest columns
    long = SampleRequest(None, PROMPTS[1], 2, fixed(5))
    batch = tiny_host.decode_batch()
    assert batch.width == 0  # no cache yet
    tiny_host.admit(batch, [short, long], ["short", "long"])
    assert len(batch) == 5 and batch.tickets == ["short", "long"]
    assert tiny_host.decode_step(batch) == []
    [(ticket, result)] = tiny_host.decode_step(batch)
    assert ticket == "short" and [len(s.tokens) for s in result.sequences] == [2, 2, 2]
    assert len(batch) == 2 and batch.tickets == ["long"] and batch.adapters == {None}
    # the long request's prompt and its tokens so far (the newest is fed at the next step)
    assert batch.width == len(long.prompt) + 2
    for _ in range(2):
        assert tiny_host.decode_step(batch) == []
    [(ticket, result)] = tiny_host.decode_step(batch)
    assert ticket == "long" and [len(s.tokens) for s in result.sequences] == [5, 5]
    assert len(batch) == 0 and batch.tickets == [] and tiny_host.decode_step(batch) == []
    assert batch.width == 0  # the last row took the cache with it


def test_a_row_leaving_cuts_even_a_single_unused_column(tiny_host):
    """The wider prompt (by one token) finishes first: its extra column leaves with it."""
    greedy = lambda n: SamplingConfig(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    wide, narrow = SampleRequest(None, [5, 6, 7], 1, greedy(1)), SampleRequest(None, [5, 6], 1, greedy(3))
    batch = tiny_host.decode_batch()
    tiny_host.admit(batch, [wide, narrow], ["wide", "narrow"])
    [(ticket, _)] = tiny_host.decode_step(batch)
    assert ticket == "wide" and batch.width == len(narrow.prompt) + 1


# Measured (benchmarks are not needed: a forward pass each), max / mean |sampler - trainer|
# logprob over 8 sequences x 16 sampled tokens, the requests admitted one step apart into one
# batch: tiny-llama bf16 0.000 / 0.0000 nats; SmolLM2-135M bf16 with a random adapter 0.074 /
# 0.0009. The trainer's pass and the decode steps both attend by bf16 matmuls
# (trio_engine.attention); with SDPA's kernels for both, as before, 0.090 / 0.0054 and
# 0.569 / 0.0877: its decode and its full-sequence pass rounded differently. The bounds
# leave room for other CPUs' bf16 kernels yet fail the old pair. Prefilled together (one
# padded pass): tiny-llama 0.000 / 0.0000, and 0.096 / 0.0056 while that pass took SDPA's
# kernel.
BF16_MAX_DIFF, BF16_MEAN_DIFF = 0.05, 0.005


@pytest.mark.parametrize("together", [False, True])
def test_bf16_logprobs_stay_near_the_trainers_in_a_shared_batch(new_id, together):
    """``together``: the prompts prefilled in one padded pass (an RL group sent at once),
    else admitted one step apart."""
    from trio_engine import TINY_LLAMA, ModelHost

    host = ModelHost(TINY_LLAMA, dtype="bfloat16")
    aid = new_id("bf16")
    host.create_adapter(aid, LoraConfig(rank=4, seed=1))
    randomize_adapter(host, aid, seed=5, scale=0.2)
    prompts = [*PROMPTS, list(range(40, 70))]
    reqs = [SampleRequest(aid if k % 2 else None, p, 2, SamplingConfig(max_tokens=16, seed=k, ignore_eos=True))
            for k, p in enumerate(prompts)]
    batch, results = host.decode_batch(), {}
    if together:
        host.admit(batch, reqs, list(range(len(reqs))))
    for k, req in enumerate(reqs if not together else []):
        host.admit(batch, [req], [k])
        results.update(host.decode_step(batch))
    assert isinstance(batch.cache, GrowingCache)  # decode steps read its buffers, room hidden
    while len(batch):
        results.update(host.decode_step(batch))
    diffs = []
    for k, req in enumerate(reqs):
        for seq in results[k].sequences:
            full = req.prompt + seq.tokens
            ex = Example(full[:-1], {"target_tokens": full[1:]})
            trainer = host.forward([ForwardJob(req.adapter_id, [ex])])[0].logprobs[0][len(req.prompt) - 1:]
            diffs += [abs(a - b) for a, b in zip(seq.logprobs, trainer)]
    assert len(diffs) == 8 * 16
    assert max(diffs) < BF16_MAX_DIFF and sum(diffs) / len(diffs) < BF16_MEAN_DIFF, (max(diffs), sum(diffs) / len(diffs))


# -- the prefix cache: a prompt extending a recent one prefills only its new tokens -----------


def without_prefix_cache(host, req):
    """The request decoded with no prefix cache at all: the reference."""
    from trio_engine import DecodeBatch

    batch = DecodeBatch(host, None)
    batch.admit([req], ["ref"])
    results = {}
    while len(batch):
        results.update(batch.step())
    return results["ref"]


@pytest.fixture
def fresh(tiny_host, new_id):
    """A new randomized adapter: no prefix-cache entry has its weights, whatever ran before
    (the host and its cache are shared by the whole session)."""
    def make() -> str:
        aid = new_id("prefix")
        tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=1))
        randomize_adapter(tiny_host, aid, seed=5, scale=0.2)
        made.append(aid)
        return aid

    made: list[str] = []
    yield make
    for aid in made:
        tiny_host.delete_adapter(aid)


def test_a_next_turn_reuses_the_last_turns_kv_and_samples_as_without_it(tiny_host, fresh):
    """Turn 2 = turn 1's prompt + its sampled tokens + new tokens: all but the newest
    sampled token's KV come from the cache, and tokens and logprobs are as without it."""
    cfg = SamplingConfig(max_tokens=6, temperature=1.0, seed=31, ignore_eos=True)
    adapted = fresh()
    turn1 = SampleRequest(adapted, [11, 12, 13, 14, 15, 16], 1, cfg)
    first = tiny_host.sample([turn1])[0]
    assert first.cached_prompt_tokens == 0
    turn2 = SampleRequest(adapted, turn1.prompt + first.sequences[0].tokens + [17, 18], 1, cfg)
    with torch.no_grad():
        want = without_prefix_cache(tiny_host, turn2)
    got = tiny_host.sample([turn2])[0]
    assert got.cached_prompt_tokens == len(turn1.prompt) + len(first.sequences[0].tokens) - 1
    assert got.sequences[0].tokens == want.sequences[0].tokens
    torch.testing.assert_close(torch.tensor(got.sequences[0].logprobs), torch.tensor(want.sequences[0].logprobs),
                               atol=1e-5, rtol=1e-5)
    # the same prompt with other weights reuses nothing
    assert tiny_host.sample([SampleRequest(fresh(), turn2.prompt, 1, cfg)])[0].cached_prompt_tokens == 0


def test_prompts_with_and_without_a_cached_prefix_share_one_admission(tiny_host, fresh):
    """One admission of a prompt extending a cached one and of a prompt with no cached
    prefix: each samples what it samples with no prefix cache at all."""
    cfg = SamplingConfig(max_tokens=5, temperature=1.0, seed=41, ignore_eos=True)
    adapted = fresh()
    tiny_host.sample([SampleRequest(adapted, [31, 32, 33, 34, 35], 1, cfg)])
    requests = [SampleRequest(adapted, [31, 32, 33, 34, 35, 36, 37], 1, cfg),
                SampleRequest(adapted, [51, 52, 53], 2, cfg)]
    with torch.no_grad():
        want = [without_prefix_cache(tiny_host, r) for r in requests]
    got = tiny_host.sample(requests)
    # 5 cached, the 5th run again to fill the width of the 3-token prompt beside it: no
    # padding between a row's reused and new tokens (sampler._without_gaps)
    assert got[0].cached_prompt_tokens == 4 and got[1].cached_prompt_tokens == 0
    for g, w in zip(got, want):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        torch.testing.assert_close(torch.tensor([s.logprobs for s in g.sequences]),
                                   torch.tensor([s.logprobs for s in w.sequences]), atol=1e-5, rtol=1e-5)


def test_a_prompt_cached_but_its_last_token_joins_the_next_decode_pass(tiny_host, fresh, monkeypatch):
    """A prompt resent while a batch decodes has its KV cached but for its last token: it is
    not prefilled, its last token runs in the next step's decode pass and its samples draw
    from the step after, while the running request finishes in that step. In the same
    admission a prompt with nothing cached, and one of a single token, are prefilled. Each
    samples what it samples with no prefix cache."""
    from trio_engine import sampler

    cfg = lambda seed: SamplingConfig(max_tokens=4, temperature=1.0, seed=seed, ignore_eos=True)  # noqa: E731
    adapted = fresh()
    prompt = list(range(61, 72))  # more than the cache's min_shared tokens
    running = SampleRequest(adapted, prompt, 1, SamplingConfig(max_tokens=2, temperature=1.0, seed=1, ignore_eos=True))
    resent = SampleRequest(adapted, prompt, 2, cfg(2))
    others = [SampleRequest(adapted, [81, 82, 83], 1, cfg(3)), SampleRequest(adapted, [91], 1, cfg(4))]
    with torch.no_grad():
        want = {t: without_prefix_cache(tiny_host, r) for t, r in
                zip(["running", "resent", "new", "one token"], [running, resent, *others])}
    prefilled = []
    real_prefill = sampler._prefill
    monkeypatch.setattr(sampler, "_prefill", lambda host, requests, *rest: (
        prefilled.append([r.prompt for r in requests]) or real_prefill(host, requests, *rest)))
    batch = tiny_host.decode_batch()
    tiny_host.admit(batch, [running], ["running"])  # stores its prompt's KV
    results = dict(tiny_host.decode_step(batch))
    tiny_host.admit(batch, [resent, *others], ["resent", "new", "one token"])
    assert prefilled == [[prompt], [r.prompt for r in others]]
    results.update(tiny_host.decode_step(batch))  # the running request finishes and leaves meanwhile
    assert "running" in results
    assert [len(row.tokens) for row in batch.rows] == [1, 1, 0, 0]  # resent (last): its last prompt token ran
    while len(batch):
        results.update(tiny_host.decode_step(batch))
    assert results["resent"].cached_prompt_tokens == len(prompt) - 1
    for ticket, w in want.items():
        got = results[ticket]
        assert [s.tokens for s in got.sequences] == [s.tokens for s in w.sequences], ticket
        torch.testing.assert_close(torch.tensor([s.logprobs for s in got.sequences]),
                                   torch.tensor([s.logprobs for s in w.sequences]), atol=1e-5, rtol=1e-5)


def test_stored_kv_is_each_rows_real_tokens_in_memory_of_its_own(tiny_host, fresh):
    """Two prompts of different lengths share a padded prefill: each entry the prefix cache
    keeps is its row's real (last) positions, copied out, so the batch's buffers (and
    their room) are not held by the cache, nor its counted bytes understated."""
    from trio_engine import DecodeBatch
    from trio_engine.sampler import PrefixCache, _kv_bytes, _kv_layers

    adapted = fresh()
    prompts = [list(range(31, 43)), list(range(51, 60))]
    cache = PrefixCache()
    batch = DecodeBatch(tiny_host, cache)
    cfg = SamplingConfig(max_tokens=3, temperature=1.0, seed=5, ignore_eos=True)
    with torch.no_grad():
        batch.admit([SampleRequest(adapted, p, 1, cfg) for p in prompts])
    layers = _kv_layers(batch.cache)
    batch_storages = {t.untyped_storage().data_ptr() for layer in layers for t in (layer.keys, layer.values)}
    assert len(cache.entries) == 2
    for row, ((_, tokens), kv) in enumerate(cache.entries.items()):
        assert list(tokens) == prompts[row]
        for layer, (k, v) in zip(layers, kv, strict=True):
            assert k.shape[1] == v.shape[1] == len(prompts[row])
            torch.testing.assert_close(k, layer.keys[row][:, -len(prompts[row]):], rtol=0, atol=0)
            torch.testing.assert_close(v, layer.values[row][:, -len(prompts[row]):], rtol=0, atol=0)
            assert k.untyped_storage().data_ptr() not in batch_storages
            assert v.untyped_storage().data_ptr() not in batch_storages
            assert k.untyped_storage().nbytes() == k.numel() * k.element_size()
            assert v.untyped_storage().nbytes() == v.numel() * v.element_size()
    assert cache.nbytes == sum(_kv_bytes(kv) for kv in cache.entries.values())


def test_changed_weights_never_reuse_old_kv(tiny_host, new_id):
    aid = new_id("prefix")
    tiny_host.create_adapter(aid, LoraConfig(rank=2, seed=3))
    randomize_adapter(tiny_host, aid, seed=1, scale=0.2)
    greedy = SamplingConfig(max_tokens=4, temperature=0.0)
    base = [21, 22, 23, 24, 25]
    tiny_host.sample([SampleRequest(aid, base, 1, greedy)])
    longer = SampleRequest(aid, base + [26, 27], 1, greedy)
    assert tiny_host.sample([longer])[0].cached_prompt_tokens >= len(base)
    randomize_adapter(tiny_host, aid, seed=2, scale=0.2)  # as an optim_step or a load would
    with torch.no_grad():
        want = without_prefix_cache(tiny_host, longer)
    got = tiny_host.sample([longer])[0]
    assert got.cached_prompt_tokens == 0
    assert got.sequences[0].tokens == want.sequences[0].tokens
    tiny_host.delete_adapter(aid)


def test_the_prefix_cache_is_bounded_least_recently_used_out_first():
    from trio_engine.sampler import PrefixCache, _kv_bytes

    def kv(n):  # one layer, 2 heads, n tokens, dim 4: 2 * 2 * n * 4 * 4 bytes
        return [(torch.zeros(2, n, 4), torch.zeros(2, n, 4))]

    cache = PrefixCache(max_bytes=64 * 10, min_shared=1)  # room for 10 tokens
    cache.store("w", [1, 2, 3, 4], kv(4))
    cache.store("w", [5, 6, 7, 8], kv(4))
    assert cache.lookup("w", [1, 2, 3, 4, 9])[0] == 4  # now the most recently used
    cache.store("w", [9, 9, 9], kv(3))  # over the bound: [5..8] leaves, not [1..4]
    assert cache.nbytes <= cache.max_bytes
    assert cache.lookup("w", [5, 6, 7, 8, 1])[0] == 0 and cache.lookup("w", [1, 2, 3, 4, 1])[0] == 4
    assert cache.lookup("other", [1, 2, 3, 4, 1])[0] == 0  # per weights
    assert cache.lookup("w", [1, 2, 3, 4])[0] == 3  # a hit leaves a token to run
    cache.store("w", list(range(20)), kv(20))  # larger than the whole cache: not stored, nothing leaves
    assert cache.lookup("w", list(range(21)))[0] == 0 and cache.lookup("w", [1, 2, 3, 4, 1])[0] == 4
    assert cache.nbytes == sum(_kv_bytes(kv) for kv in cache.entries.values()) <= cache.max_bytes
    cache.store("w", [1, 2, 3, 4], kv(4))  # already there: counted once
    assert cache.nbytes == sum(_kv_bytes(kv) for kv in cache.entries.values())


def test_the_prefix_cache_reuses_the_longest_common_start_of_any_entry():
    """An entry as long as the prompt, longer, or parting from it mid-way gives the KV of
    the tokens they share (never the prompt's last): the first positions of its KV."""
    from trio_engine.sampler import PrefixCache

    def kv(tokens):  # one layer; position i holds the value tokens[i], so slices are checkable
        t = torch.tensor(tokens, dtype=torch.float32)[None, :, None].expand(2, len(tokens), 4)
        return [(t.clone(), -t.clone())]

    cache = PrefixCache(min_shared=1)
    cache.store("w", [1, 2, 3, 4, 5, 6], kv([1, 2, 3, 4, 5, 6]))
    cache.store("w", [1, 2, 7], kv([1, 2, 7]))
    cases = {(1, 2, 3, 4, 5, 6): 5, (1, 2, 3, 4): 3, (1, 2, 3, 9, 9): 3, (1, 2, 7, 8): 3, (1, 2, 8): 2,
             (1, 9): 1, (9, 1, 2): 0, (1,): 0}
    for prompt, want in cases.items():
        n, got = cache.lookup("w", list(prompt))
        assert n == want, prompt
        if want:
            assert got is not None and got[0][0].shape == (2, want, 4)
            assert got[0][0][0, :, 0].tolist() == list(prompt[:want]) and torch.equal(got[0][1], -got[0][0])
    assert cache.lookup("v", [1, 2, 3, 4])[0] == 0
    # by default a match ending inside an entry needs 8 shared tokens; a whole entry any
    cache = PrefixCache()
    cache.store("w", [1, 2, 3], kv([1, 2, 3]))
    cache.store("w", list(range(10, 30)), kv(list(range(10, 30))))
    assert cache.lookup("w", [1, 2, 3, 4])[0] == 3 and cache.lookup("w", [1, 2, 9])[0] == 0
    assert cache.lookup("w", list(range(10, 17)) + [0])[0] == 0
    assert cache.lookup("w", list(range(10, 18)) + [0])[0] == 8


def test_a_repeated_prompt_reuses_all_but_its_last_token_and_samples_as_without_it(tiny_host, fresh):
    """The same prompt again (a group of rollouts sent as separate requests), and one that
    parts from it after 9 tokens: each reuses the shared KV and, in fp32, samples exactly
    what it samples with no prefix cache at all (seeded)."""
    cfg = SamplingConfig(max_tokens=5, temperature=1.0, seed=43, ignore_eos=True)
    adapted = fresh()
    prompt = list(range(61, 73))
    tiny_host.sample([SampleRequest(adapted, prompt, 2, cfg)])
    requests = [SampleRequest(adapted, prompt, 1, cfg), SampleRequest(adapted, prompt[:9] + [90, 91], 1, cfg)]
    with torch.no_grad():
        want = [without_prefix_cache(tiny_host, r) for r in requests]
    got = tiny_host.sample(requests)
    # the repeat's 11 cached tokens but one, to match the other's 2 new ones (_without_gaps)
    assert [g.cached_prompt_tokens for g in got] == [len(prompt) - 2, 9]
    for g, w in zip(got, want):
        assert g.sequences[0].tokens == w.sequences[0].tokens
        torch.testing.assert_close(torch.tensor(g.sequences[0].logprobs), torch.tensor(w.sequences[0].logprobs),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family_host", ["mistral", "qwen2", "gemma3_text"], indirect=True)
def test_a_cached_prefix_prefilled_beside_a_longer_prompt_keeps_its_sliding_window(family_host):
    """A multi-turn rollout's next turn (its first 21 tokens cached) prefilled in one pass
    with a fresh prompt, on models whose layers see 4 tokens back: the turn's new tokens see
    exactly the window they see alone, so its logprobs are the trainer's. Beside 8 fresh
    tokens part of the hit is reused; beside 30, none (its 24 tokens fit the width)."""
    host = family_host
    cfg = lambda seed: SamplingConfig(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)  # noqa: E731
    first = list(range(40, 56))
    for fresh, reused in ((8, range(1, 22)), (30, range(0, 1))):
        host.prefix_cache.entries.clear()
        turn = first + host.sample([SampleRequest(None, first, 1, cfg(1))])[0].sequences[0].tokens + [70, 71]
        got = host.sample([SampleRequest(None, turn, 1, cfg(2)),
                           SampleRequest(None, list(range(80, 80 + fresh)), 1, cfg(3))])
        assert got[0].cached_prompt_tokens in reused, (fresh, got[0].cached_prompt_tokens)
        sampled = got[0].sequences[0]
        full = turn + sampled.tokens
        trainer = host.forward([ForwardJob(None, [Example(full[:-1], {"target_tokens": full[1:]})])])[0].logprobs[0]
        torch.testing.assert_close(torch.tensor(sampled.logprobs), torch.tensor(trainer[len(turn) - 1:]),
                                   atol=1e-4, rtol=1e-4)


def test_in_bf16_only_unseeded_random_requests_reuse_cached_kv(new_id):
    """bf16 KV from the cache rounds differently from a whole prefill, enough to change
    sampled tokens: a request that asked for reproducible tokens (seeded, or greedy: 5 of
    8 greedy resends on the bundled model changed) reuses none, so a resend gets the same
    tokens; an unseeded random one reuses it."""
    from trio_engine import TINY_LLAMA, ModelHost

    host = ModelHost(TINY_LLAMA, dtype="bfloat16")
    prompt = list(range(61, 81))
    for config in (SamplingConfig(max_tokens=8, seed=7, ignore_eos=True),
                   SamplingConfig(max_tokens=8, temperature=0, ignore_eos=True),
                   SamplingConfig(max_tokens=8, top_k=1, ignore_eos=True)):
        request = SampleRequest(None, prompt, 2, config)
        first, again = host.sample([request])[0], host.sample([request])[0]
        assert first.cached_prompt_tokens == again.cached_prompt_tokens == 0, config
        assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    unseeded = SampleRequest(None, prompt, 1, SamplingConfig(max_tokens=2, ignore_eos=True))
    assert host.sample([unseeded])[0].cached_prompt_tokens == len(prompt) - 1


def test_the_prefix_cache_fills_to_exactly_its_bound():
    from trio_engine.sampler import PrefixCache

    def kv(n):  # 64 bytes per token, as above
        return [(torch.zeros(2, n, 4), torch.zeros(2, n, 4))]

    cache = PrefixCache(max_bytes=64 * 6)
    cache.store("w", [1, 2], kv(2))
    cache.store("w", [3, 4, 5, 6], kv(4))  # now exactly full: both stay
    assert cache.nbytes == cache.max_bytes
    assert cache.lookup("w", [1, 2, 9])[0] == 2 and cache.lookup("w", [3, 4, 5, 6, 9])[0] == 4
    cache.store("w", [7, 8], kv(2))  # one token over: the least recently used ([1, 2]) leaves
    assert cache.lookup("w", [1, 2, 9])[0] == 0 and cache.nbytes == 64 * 6
    whole = PrefixCache(max_bytes=64 * 3)
    whole.store("w", [1, 2, 3], kv(3))  # an entry the size of the whole cache fits
    assert whole.lookup("w", [1, 2, 3, 4])[0] == 3
