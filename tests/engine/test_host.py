"""forward / forward_backward: reference logprobs, batch independence, accumulation, bad input."""

import math
import random

import pytest
import torch

from trio_engine import Example, ForwardJob, InvalidInputError, LoraConfig
from trio_engine.model import LogitTransform

from .helpers import (
    LONGROPE,
    TEST_CATALOG,
    assert_same_snapshot,
    merged_model,
    plain_model,
    random_example,
    randomize_adapter,
    reference_logprobs,
    saved_random_adapter,
    snapshot,
)

TOL = 1e-5


def test_logprobs_match_plain_transformers(family_host, new_id):
    """Every family (its LoRA targets and its logit transform) against a plain transformers
    forward of the base with W0 + (alpha/r)·B·A merged by hand (B random, non-zero).
    The base without adapter is covered by the sampler's greedy and logprob tests."""
    host = family_host
    aid = new_id()
    host.create_adapter(aid, LoraConfig(rank=4, seed=3))
    randomize_adapter(host, aid, seed=6, scale=0.1)
    rng = random.Random(0)
    data = [random_example(host.vocab_size, n, rng) for n in (5, 17, 9)]
    result = host.forward([ForwardJob(aid, data)])[0]
    ref_model = merged_model(host, aid)
    for ex, lp, loss in zip(data, result.logprobs, result.elementwise_loss):
        ref = reference_logprobs(ref_model, ex.tokens, ex.inputs["target_tokens"])
        torch.testing.assert_close(torch.tensor(lp), ref, atol=TOL, rtol=TOL)
        expected_loss = -ref * torch.tensor(ex.inputs["weights"])
        torch.testing.assert_close(torch.tensor(loss), expected_loss, atol=TOL, rtol=TOL)
    total = sum(sum(x) for x in result.elementwise_loss)
    assert result.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    assert not torch.allclose(torch.tensor(result.logprobs[0]), reference_logprobs(
        plain_model(host.model_name), data[0].tokens, data[0].inputs["target_tokens"]), atol=1e-3)
    host.delete_adapter(aid)


def test_sequences_within_the_window_run_packed_and_match_plain_transformers(family_host, new_id, monkeypatch):
    """Sequences no longer than any sliding window run as one packed row (no padding) in
    every family whose attention is ours, each sequence with its own positions, those of
    one length attending side by side, and still match plain transformers; one longer
    than a window runs padded instead."""
    from trio_engine import attention

    from .helpers import WINDOW

    host = family_host
    aid = new_id()
    host.create_adapter(aid, LoraConfig(rank=4, seed=3))
    randomize_adapter(host, aid, seed=6, scale=0.1)
    rng = random.Random(2)
    data = [random_example(host.vocab_size, n, rng) for n in (2, WINDOW, 3, 3)]  # the 3s attend as one batch
    positions = []
    trunk = host.trunk.forward
    monkeypatch.setattr(host.trunk, "forward", lambda **kw: positions.append(kw.get("position_ids")) or trunk(**kw))
    result = host.forward([ForwardJob(aid, data)])[0]
    ref_model = merged_model(host, aid)
    for ex, lp in zip(data, result.logprobs):
        torch.testing.assert_close(torch.tensor(lp), reference_logprobs(ref_model, ex.tokens, ex.inputs["target_tokens"]),
                                   atol=TOL, rtol=TOL)
    [seen] = positions  # one pass
    if host.model.config._attn_implementation == attention.NAME:
        assert seen.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 0, 1]]  # longest first, each from 0
    window = getattr(host.model.config, "sliding_window", None)
    assert (WINDOW + 1 <= host.pack_limit) == (host.model.config._attn_implementation == attention.NAME
                                               and window is None)
    host.delete_adapter(aid)


@pytest.mark.parametrize("family_host", ["gemma2", "gemma3_text", "cohere", "granite"], indirect=True)
def test_family_logit_transform_matters(family_host):
    """Where a family transforms lm_head's output, leaving it out moves the logprobs far
    beyond TOL, so the parity test above would catch its loss."""
    host = family_host
    assert host.unembed.transform != LogitTransform()
    ex = random_example(host.vocab_size, 9, random.Random(1))
    model = plain_model(host.model_name)
    ids = torch.tensor([ex.tokens])
    with torch.no_grad():
        raw = model.lm_head(model.get_decoder()(input_ids=ids).last_hidden_state)[0]
    targets = torch.tensor(ex.inputs["target_tokens"])
    untransformed = torch.log_softmax(raw, -1).gather(1, targets[:, None])[:, 0]
    assert (untransformed - reference_logprobs(model, ex.tokens, ex.inputs["target_tokens"])).abs().max() > 1e-2


def test_lora_gradients_match_peft_autograd(family_host, new_id, tmp_path):
    """Every family, every adapted layer: the gradients of forward_backward (our LoRA
    layers, attention and fused norms, backwards) equal autograd through peft on plain
    transformers, given our weights, for the same weighted cross-entropy (two datums)."""
    peft = pytest.importorskip("peft")
    host = family_host
    aid = saved_random_adapter(host, new_id, tmp_path, seed=5, b_seed=9)
    rng = random.Random(7)
    data = [random_example(host.vocab_size, n, rng) for n in (11, 6)]
    host.forward_backward([ForwardJob(aid, data)])

    model = peft.PeftModel.from_pretrained(plain_model(host.model_name), str(tmp_path), is_trainable=True)
    for ex in data:
        logits = model(input_ids=torch.tensor([ex.tokens])).logits[0].float()
        logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ex.inputs["target_tokens"])[:, None])[:, 0]
        (-(logp * torch.tensor(ex.inputs["weights"])).sum()).backward()
    theirs = {name.removeprefix("base_model.model.").replace(".default.weight", ""): p.grad
              for name, p in model.named_parameters() if p.requires_grad}
    ours = {name: p.grad for name, p in host.adapter_params(aid).items()}
    assert ours.keys() == theirs.keys()
    for name, grad in ours.items():  # fp32 sums in another order: bounded by the tensor's scale
        error = (grad - theirs[name]).abs().max() / theirs[name].abs().max()
        assert error < 1e-5, (name, float(error))
    assert all(g.abs().max() > 0 for g in ours.values())
    host.delete_adapter(aid)


def test_a_longrope_model_is_served_up_to_its_original_context():
    """Phi-3's LongRoPE takes its short or long factors per forward pass, from the longest
    sequence in it: served up to its original context (32), a sequence beside a full-length
    one has the logprobs transformers gives it alone; a longer one is refused."""
    from trio_engine import ModelHost

    host = ModelHost(LONGROPE.name, dtype="float32", catalog=TEST_CATALOG)
    assert host.max_seq_len == 32
    rng = random.Random(3)
    data = [random_example(host.vocab_size, n, rng) for n in (32, 20)]
    result = host.forward([ForwardJob(None, data)])[0]
    model = plain_model(LONGROPE.name)
    for ex, lp in zip(data, result.logprobs):
        torch.testing.assert_close(torch.tensor(lp), reference_logprobs(model, ex.tokens, ex.inputs["target_tokens"]),
                                   atol=TOL, rtol=TOL)
    with pytest.raises(InvalidInputError, match="length 33 exceeds the model's context of 32 tokens"):
        host.forward([ForwardJob(None, [random_example(host.vocab_size, 33, rng)])])


def test_result_does_not_depend_on_batch(tiny_host, new_id):
    """A datum alone and inside a ragged batch split into several micro-batches agree."""
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=4))
    randomize_adapter(tiny_host, aid, seed=1)
    rng = random.Random(1)
    data = [random_example(tiny_host.vocab_size, n, rng) for n in (3, 40, 7, 64, 12, 64, 1)]
    budget, tiny_host.max_batch_tokens = tiny_host.max_batch_tokens, 128  # force several micro-batches
    try:
        batched = tiny_host.forward([ForwardJob(aid, data)])[0].logprobs
    finally:
        tiny_host.max_batch_tokens = budget
    for ex, lp in zip(data, batched):
        alone = tiny_host.forward([ForwardJob(aid, [ex])])[0].logprobs[0]
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(alone), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("train_unembed", [True, False])
def test_chunked_unembedding_equals_one_pass(tiny_host, new_id, monkeypatch, train_unembed):
    """The unembedding + log-softmax in chunks of 7 rows (several per datum, some holding
    rows of two adapters) gives the logprobs, losses and grads of a single (N, V) pass,
    forward and forward_backward: with an lm_head LoRA (chunks recomputed in the
    backward) and without (each chunk's gradient taken in the forward)."""
    from trio_engine import host as host_module

    vocab = tiny_host.vocab_size
    ids = [new_id(), new_id()]
    for i, aid in enumerate(ids):
        tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=i, train_unembed=train_unembed))
        randomize_adapter(tiny_host, aid, seed=10 + i)
    rng = random.Random(5)
    jobs = [ForwardJob(ids[0], [random_example(vocab, n, rng) for n in (13, 5)]),
            ForwardJob(ids[1], [random_example(vocab, 11, rng)])]
    chunk_sizes: list[int] = []
    run_chunk = tiny_host._chunk_logprobs
    monkeypatch.setattr(tiny_host, "_chunk_logprobs", lambda h, *rest: chunk_sizes.append(len(h)) or run_chunk(h, *rest))

    def run(chunk_elements):
        monkeypatch.setattr(host_module, "LOGIT_CHUNK_ELEMENTS", chunk_elements)
        results = tiny_host.forward_backward(jobs)
        grads = {a: {k: p.grad.clone() for k, p in tiny_host.adapter_params(a).items()} for a in ids}
        for a in ids:
            tiny_host.zero_grad(a)
        return results, grads, tiny_host.forward(jobs)

    chunked, chunked_grads, chunked_fwd = run(7 * vocab)
    chunks = -(-sum(len(ex.tokens) for job in jobs for ex in job.examples) // 7)
    # really chunked: forward_backward (its chunks twice when recomputed), then forward
    assert max(chunk_sizes) == 7 and len(chunk_sizes) == (3 if train_unembed else 2) * chunks
    whole, whole_grads, whole_fwd = run(10**12)
    for mine, ref in zip(chunked + chunked_fwd, whole + whole_fwd):
        for field in ("logprobs", "elementwise_loss"):
            for x, y in zip(getattr(mine, field), getattr(ref, field)):
                torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=TOL, rtol=TOL)
    for a in ids:
        assert ("lm_head.lora_B" in whole_grads[a]) == train_unembed
        assert all(g.abs().sum() > 0 for k, g in whole_grads[a].items() if k.endswith("lora_B"))
        for k, g in whole_grads[a].items():
            # sums in another order: fp32 rounding, relative to the largest gradient (in float64
            # both ways agree to 1e-7 and better)
            torch.testing.assert_close(chunked_grads[a][k], g, atol=TOL * float(g.abs().max()), rtol=1e-4)
        tiny_host.delete_adapter(a)


def test_grads_accumulate_and_forward_adds_none(tiny_host, new_id):
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=4))
    randomize_adapter(tiny_host, aid, seed=2)
    data = [random_example(tiny_host.vocab_size, 8, random.Random(2))]
    tiny_host.forward_backward([ForwardJob(aid, data)])
    once = {k: p.grad.clone() for k, p in tiny_host.adapter_params(aid).items()}
    tiny_host.forward([ForwardJob(aid, data)])
    assert all(torch.equal(once[k], p.grad) for k, p in tiny_host.adapter_params(aid).items())
    tiny_host.forward_backward([ForwardJob(aid, data)])
    for k, p in tiny_host.adapter_params(aid).items():
        torch.testing.assert_close(p.grad, 2 * once[k], atol=1e-6, rtol=1e-5)


@pytest.mark.co_batch_bug
def test_a_co_batched_pass_that_fails_where_its_jobs_alone_run_is_logged(tiny_host, new_id, monkeypatch, caplog):
    """A bug in co-batching (here: any pass of two jobs raises) must not fail anyone's
    request: each job runs alone, with the grads it would have had alone. But it must not
    pass silently either: an error log with the shared pass's traceback, which fails any
    unmarked test (``tests/conftest.py``)."""
    from trio_engine.host import CO_BATCH_BUG

    a, b = new_id(), new_id()
    for aid, seed in ((a, 3), (b, 4)):
        tiny_host.create_adapter(aid, LoraConfig(rank=4))
        randomize_adapter(tiny_host, aid, seed=seed)
    rng = random.Random(3)
    jobs = [ForwardJob(a, [random_example(tiny_host.vocab_size, 9, rng)]),
            ForwardJob(b, [random_example(tiny_host.vocab_size, 5, rng)])]
    expected = [tiny_host.forward_backward([job])[0] for job in jobs]
    alone_grads = {aid: {k: p.grad.clone() for k, p in tiny_host.adapter_params(aid).items()} for aid in (a, b)}
    for aid in (a, b):
        tiny_host.zero_grad(aid)

    run = tiny_host._run

    def co_batching_bug(batch, backward):
        if len(batch) > 1:
            raise RuntimeError("packing went wrong")
        return run(batch, backward)

    monkeypatch.setattr(tiny_host, "_run", co_batching_bug)
    with caplog.at_level("ERROR", logger="trio.engine"):
        outcomes = tiny_host.forward_backward(jobs)
    for got, want in zip(outcomes, expected):
        assert got.logprobs[0] == pytest.approx(want.logprobs[0], abs=1e-6)
    for aid in (a, b):
        for k, p in tiny_host.adapter_params(aid).items():
            torch.testing.assert_close(p.grad, alone_grads[aid][k], atol=1e-6, rtol=1e-5)
    [record] = [r for r in caplog.records if getattr(r, CO_BATCH_BUG, False)]
    assert "packing went wrong" in str(record.exc_info[1]) and a in record.getMessage()
    for aid in (a, b):
        tiny_host.delete_adapter(aid)


def two_jobs(host, new_id, lengths: tuple[int, int]) -> tuple[str, str, list[ForwardJob]]:
    """Two new rank-4 adapters, and one job of one example of each length for each."""
    a, b = new_id(), new_id()
    for aid in (a, b):
        host.create_adapter(aid, LoraConfig(rank=4))
    rng = random.Random(5)
    return a, b, [ForwardJob(aid, [random_example(host.vocab_size, n, rng)]) for aid, n in zip((a, b), lengths)]


def test_a_job_whose_grads_cannot_be_copied_alone_fails_alone(tiny_host, new_id, monkeypatch):
    """A co-batched pass short of memory runs its jobs alone; the second's copy of its grads
    ran short too and raised out of the whole call, after the first had added its
    gradients: both were reported failed, and a retry (the worker's, after making room)
    added the first's again."""
    a, b, jobs = two_jobs(tiny_host, new_id, (9, 5))
    tiny_host.forward_backward(jobs[:1])
    once = {k: p.grad.clone() for k, p in tiny_host.adapter_params(a).items()}
    tiny_host.zero_grad(a)
    run, save, saves = tiny_host._run, tiny_host._save_grads, []

    def shared_pass_short(batch, backward):
        if len(batch) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (the shared pass)")
        return run(batch, backward)

    def third_copy_short(adapters):
        saves.append(adapters)
        if len(saves) == 3:  # the shared pass's copy, a's alone, then b's
            raise torch.OutOfMemoryError("CUDA out of memory (b's copy)")
        return save(adapters)

    monkeypatch.setattr(tiny_host, "_run", shared_pass_short)
    monkeypatch.setattr(tiny_host, "_save_grads", third_copy_short)
    first, second = tiny_host.forward_backward(jobs)
    assert not isinstance(first, Exception) and isinstance(second, torch.OutOfMemoryError)
    for k, p in tiny_host.adapter_params(a).items():
        torch.testing.assert_close(p.grad, once[k])  # added once
    for aid in (a, b):
        tiny_host.delete_adapter(aid)


@pytest.mark.co_batch_bug
@pytest.mark.parametrize(("shared_error", "alone_error", "logged"), [
    (RuntimeError, ValueError, True), (RuntimeError, RuntimeError, False), (InvalidInputError, "nan", True)])
def test_a_job_failing_alone_explains_a_shared_failure_only_when_it_fails_alike(tiny_host, new_id, monkeypatch,
                                                                               caplog, shared_error, alone_error,
                                                                               logged):
    """The shared pass raises; one job alone fails too. If it fails otherwise (another
    exception type, or a NaN loss found after its pass), its failure does not explain the
    shared pass's: still a co-batching bug, logged. If it raises the same, its own data may
    be why: not logged. Either way that job gets its own error and the other its answer."""
    from trio_engine.host import CO_BATCH_BUG

    a, b, jobs = two_jobs(tiny_host, new_id, (7, 4))
    run = tiny_host._run

    def failing(batch, backward):
        if len(batch) > 1:
            raise shared_error("packing went wrong")
        results = run(batch, backward)
        if batch[0].adapter_id == b:
            if alone_error != "nan":
                raise alone_error("b's own failure")
            results[0].elementwise_loss[0][1] = math.nan
        return results

    monkeypatch.setattr(tiny_host, "_run", failing)
    with caplog.at_level("ERROR", logger="trio.engine"):
        got_a, got_b = tiny_host.forward_backward(jobs)
    assert got_a.logprobs
    if alone_error == "nan":
        assert isinstance(got_b, InvalidInputError) and "non-finite loss" in str(got_b)
    else:
        assert isinstance(got_b, alone_error) and "b's own failure" in str(got_b)
    reports = [r for r in caplog.records if getattr(r, CO_BATCH_BUG, False)]
    assert len(reports) == logged
    for aid in (a, b):
        tiny_host.delete_adapter(aid)


def test_finite_losses_whose_gradient_overflows_add_nothing_and_name_the_input(tiny_host, new_id):
    """ppo with an advantage of 1e30 gives finite losses but a gradient whose norm
    overflows fp32: AdamW's second moment would turn inf and stop those weights for good.
    That job fails naming the input; a job co-batched with it keeps its own gradient."""
    poisoned, healthy = new_id(), new_id()
    for aid in (poisoned, healthy):
        tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=1))
    rng = random.Random(8)
    huge = random_example(tiny_host.vocab_size, 6, rng, fields=("logprobs", "advantages"))
    huge.inputs["advantages"][2], huge.inputs["weights"][2] = 1e30, 1.0
    good = random_example(tiny_host.vocab_size, 5, rng, fields=("logprobs", "advantages"))
    got_poisoned, got_healthy = tiny_host.forward_backward([ForwardJob(poisoned, [huge], "ppo"),
                                                            ForwardJob(healthy, [good], "ppo")])
    assert isinstance(got_poisoned, InvalidInputError), got_poisoned
    assert "gradient" in str(got_poisoned) and "data[0].loss_fn_inputs['advantages'][2] = 1e+30" in str(got_poisoned)
    assert all(p.grad is None for p in tiny_host.adapter_params(poisoned).values())
    shared = {k: p.grad.clone() for k, p in tiny_host.adapter_params(healthy).items()}
    tiny_host.zero_grad(healthy)
    tiny_host.forward_backward([ForwardJob(healthy, [good], "ppo")])
    for k, p in tiny_host.adapter_params(healthy).items():
        torch.testing.assert_close(shared[k], p.grad, atol=1e-6, rtol=1e-5)
    for aid in (poisoned, healthy):
        tiny_host.delete_adapter(aid)


def test_gradient_matches_autograd_on_plain_formula(tiny_host, new_id):
    """dL/dB of cross-entropy equals autograd through a hand-built W0 + (α/r)·B·A model."""
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=2, train_attn=False, train_mlp=False))
    randomize_adapter(tiny_host, aid, seed=3)
    ex = random_example(tiny_host.vocab_size, 6, random.Random(3))
    tiny_host.forward_backward([ForwardJob(aid, [ex])])
    params = tiny_host.adapter_params(aid)
    a, b = params["lm_head.lora_A"].detach(), params["lm_head.lora_B"].detach().clone().requires_grad_(True)
    model = plain_model("trio/tiny-llama")
    hidden = model.model(input_ids=torch.tensor([ex.tokens])).last_hidden_state[0]
    logits = hidden @ model.lm_head.weight.T + (32 / 2) * hidden @ a.T @ b.T
    logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ex.inputs["target_tokens"])[:, None])[:, 0]
    (-(logp * torch.tensor(ex.inputs["weights"])).sum()).backward()
    torch.testing.assert_close(params["lm_head.lora_B"].grad, b.grad, atol=1e-5, rtol=1e-4)
    tiny_host.zero_grad(aid)


def _bad_cases(vocab):
    ok = lambda: Example([1, 2, 3], {"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})  # noqa: E731

    def with_(**changes):
        ex = ok()
        for k, v in changes.items():
            if k == "tokens":
                ex.tokens = v
            elif v is None:
                ex.inputs.pop(k)
            else:
                ex.inputs[k] = v
        return ex

    return [
        ("token id", "cross_entropy", [ok(), with_(tokens=[1, vocab, 3])], 1, "model_input", str(vocab)),
        ("negative target", "cross_entropy", [with_(target_tokens=[2, -1, 4])], 0, "target_tokens", "-1"),
        ("weights length", "cross_entropy", [ok(), ok(), with_(weights=[1.0, 1.0])], 2, "weights", "length 2"),
        ("nan weight", "cross_entropy", [with_(weights=[1.0, math.nan, 1.0])], 0, "weights", "nan"),
        ("inf advantage", "importance_sampling",
         [with_(logprobs=[0.0] * 3, advantages=[0, math.inf, 0])], 0, "advantages", "inf"),
        ("logprobs length", "ppo", [with_(logprobs=[0.0], advantages=[0.0] * 3)], 0, "logprobs", "length 1"),
        ("missing advantages", "ppo", [with_(logprobs=[0.0] * 3)], 0, "advantages", "missing"),
        ("missing targets", "cross_entropy", [with_(target_tokens=None)], 0, "target_tokens", "missing"),
        ("unknown input", "cross_entropy", [with_(weigths=[1.0] * 3)], 0, "weigths", "unknown"),
        ("empty sequence", "cross_entropy", [Example([], {"target_tokens": []})], 0, "model_input", "empty"),
        ("too long", "cross_entropy", [Example([1] * 600, {"target_tokens": [1] * 600})], 0, "model_input", "600"),
        ("empty batch", "cross_entropy", [], None, "data", "empty"),
        ("unknown loss", "crossentropy", [ok()], None, "loss_fn", "crossentropy"),
    ]


@pytest.mark.parametrize("case", range(13))
def test_bad_input_names_datum_field_value_and_changes_nothing(tiny_host, new_id, case):
    name, loss, data, index, field, value = _bad_cases(tiny_host.vocab_size)[case]
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=2))
    tiny_host.forward_backward([ForwardJob(aid, [Example([1, 2], {"target_tokens": [2, 3]})])])
    before = snapshot(tiny_host, aid)
    with pytest.raises(InvalidInputError) as err:
        tiny_host.forward_backward([ForwardJob(aid, data, loss)])
    assert err.value.index == index, name
    assert field in str(err.value) and value in str(err.value), str(err.value)
    if index is not None:
        assert f"data[{index}]" in str(err.value)
    assert_same_snapshot(before, snapshot(tiny_host, aid))


@pytest.mark.parametrize(("loss", "config", "why"), [
    ("ppo", {"clip_hi": 2.0}, "clip_hi"),
    ("ppo", {"clip_low_threshold": 1.3}, r"clip_low_threshold \(1.3\) and clip_high_threshold \(1.2\)"),
    ("cispo", {"clip_low_threshold": -0.1}, r"\(-0.1\).*0 <= low <= 1 <= high"),
    ("gspo", {"clip_high_threshold": 0.9}, r"clip_high_threshold \(0.9\)"),
    ("dro", {"beta": -1.0}, r"beta \(-1\) must be >= 0"),
])
def test_a_loss_config_that_makes_no_sense_is_refused(tiny_host, loss, config, why):
    ex = Example([1, 2], {"target_tokens": [2, 3], "logprobs": [0, 0], "advantages": [1, 1],
                          "sequence_ratio_mask": [1, 1]})
    with pytest.raises(InvalidInputError, match=why) as err:
        tiny_host.forward([ForwardJob(None, [ex], loss, config)])
    assert err.value.field == "loss_fn_config"


def test_the_widest_sensible_clip_range_and_no_penalty_are_taken(tiny_host):
    ex = Example([1, 2], {"target_tokens": [2, 3], "logprobs": [0, 0], "advantages": [1, 1]})
    tiny_host.forward([ForwardJob(None, [ex], "ppo", {"clip_low_threshold": 0.0, "clip_high_threshold": 1.0})])
    tiny_host.forward([ForwardJob(None, [ex], "ppo", {"clip_low_threshold": 1.0, "clip_high_threshold": 1e9})])
    tiny_host.forward([ForwardJob(None, [ex], "dro", {"beta": 0.0})])


def test_packed_micro_batches_fill_the_budget():
    from trio_engine.host import split_by_budget

    assert split_by_budget([256, 250, 240, 64, 60, 32], 4096) == [6]  # one pass, no padding
    assert split_by_budget([100, 90, 80, 70], 200) == [2, 4]  # as many rows as fit
    assert split_by_budget([100, 100, 50], 200) == [2, 3]  # an exact fit fills a pass
    assert split_by_budget([300, 10, 5], 200) == [1, 3]  # an over-budget row runs alone
    assert split_by_budget([], 200) == []


def test_micro_batches_cut_padding():
    from trio_engine.host import PASS_OVERHEAD_TOKENS, split_by_length

    assert split_by_length([100, 100, 100], 4096) == [3]  # equal lengths: one pass
    ends = split_by_length([256, 250, 240, 64, 60, 32], 4096)
    assert ends == [3, 6]  # long ones together, short ones together
    assert split_by_length([300, 10], 200) == [1, 2]  # over-budget rows run alone
    lengths = sorted(random.Random(0).choices(range(32, 257), k=16), reverse=True)
    ends = split_by_length(lengths, 4096)
    padded = sum((e - b) * lengths[b] for b, e in zip([0, *ends[:-1]], ends)) + PASS_OVERHEAD_TOKENS * len(ends)
    assert padded < 0.8 * len(lengths) * lengths[0]  # well under padding everything to the longest
