"""attention: the matmul path against SDPA in fp64, and which calls take it."""

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from trio_engine import TINY_LLAMA, attention
from trio_engine.catalog import Catalog, load_model_and_tokenizer


def _qkv(dtype, heads=6, kv_heads=2, length=5, q_length=None, seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(h, n):
        return torch.randn(2, h, n, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    return make(heads, q_length or length), make(kv_heads, length), make(kv_heads, length)


def _causal_module(causal=True):
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = causal, 3
    return module


def test_grouped_matches_sdpa_in_values_and_gradients():
    """Query head h reads key/value head h // 3, as SDPA's enable_gqa (and repeat_kv) has it."""
    q, k, v = _qkv(torch.float64)
    got = attention.grouped(q, k, v, 0.3, torch.ones(5, 5, dtype=torch.bool).triu(1))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # its softmax runs in fp32
    out = torch.randn_like(want)
    got_grads = torch.autograd.grad(got, (q, k, v), out)
    want_grads = torch.autograd.grad(want, (q, k, v), out)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 2])
def test_grouped_applies_a_padding_mask_of_each_batch_row(batch):
    """A decode step's mask (batch, 1, 1, 1, keys): one row's (shared by every head, as
    SDPA's) or a batch of them."""
    q, k, v = (t[:batch] for t in _qkv(torch.float64, q_length=1))
    hidden = torch.zeros(batch, 1, 1, 1, 5, dtype=torch.bool)
    hidden[-1, ..., :2] = True
    got = attention.grouped(q, k, v, 0.3, hidden)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden[:, :, 0], scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_decode_row_weighs_its_keys_as_the_trainers_causal_row():
    """The sampler's decode row (its keys after hidden left padding) and the trainer's row of
    a causal pass (hidden keys after it) give their real keys the same bf16 weights, bit for
    bit: a value matrix of one-hot rows returns the weights themselves. A softmax rounding
    to bf16 itself fails this (its vector tails depend on the row's length)."""
    length, dim = 60, 64
    g = torch.Generator().manual_seed(0)
    q, k = (3 * torch.randn(1, heads, length, dim, generator=g).bfloat16() for heads in (96, 2))
    one_hot = torch.eye(dim).bfloat16()
    causal = attention.grouped(q, k, one_hot[:length].expand(1, 2, length, dim), dim ** -0.5,
                               torch.ones(length, length, dtype=torch.bool).triu(1))
    for t in range(length):
        for pad in (1, 2, 3, 5, 8, 13):
            keys = pad + t + 1
            if keys > dim:
                continue
            padded = torch.cat([torch.randn(1, 2, pad, dim, generator=g).bfloat16(), k[:, :, :t + 1]], 2)
            hidden = torch.zeros(1, 1, 1, 1, keys, dtype=torch.bool)
            hidden[..., :pad] = True
            row = attention.grouped(q[:, :, t:t + 1], padded, one_hot[:keys].expand(1, 2, keys, dim), dim ** -0.5,
                                    hidden)
            assert torch.equal(row[:, :, 0, pad:keys], causal[:, :, t, :t + 1]), (t, pad)


@pytest.fixture
def grouped_calls(monkeypatch):
    calls = []
    real = attention.grouped

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(attention, "grouped", spy)
    return calls


def test_attend_takes_the_grouped_path_for_an_unmasked_causal_bf16_pass_on_the_cpu(grouped_calls, monkeypatch):
    monkeypatch.setattr(attention, "GROUPED_MAX_SCORES", 2 * 6 * 5 * 5)  # just enough
    q, k, v = _qkv(torch.bfloat16)
    out, weights = attention.attend(_causal_module(), q, k, v, None, scaling=0.3)
    assert grouped_calls == [q.shape] and weights is None
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, scale=0.3,
                                          enable_gqa=True)
    assert out.shape == (2, 5, 6, 8) and out.dtype == torch.bfloat16  # (batch, length, heads, dim)
    torch.testing.assert_close(out.double(), want.transpose(1, 2), rtol=0, atol=0.05)


def test_attend_defaults_to_a_causal_module_and_one_over_root_dim_scaling(grouped_calls):
    q, k, v = _qkv(torch.bfloat16)
    out, _ = attention.attend(torch.nn.Module(), q, k, v, None)  # no is_causal attribute: causal
    assert len(grouped_calls) == 1
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.double(), want.transpose(1, 2), rtol=0, atol=0.05)


@pytest.mark.parametrize("padding", [False, True])
def test_attend_takes_the_grouped_path_for_a_bf16_decode_step(padding, grouped_calls):
    """One query row over the cached keys, with the padding mask SDPA's mask function makes
    (True where a key is seen) or none."""
    q, k, v = _qkv(torch.bfloat16, q_length=1)
    mask = None
    if padding:
        mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
        mask[0, ..., :3] = False
    out, _ = attention.attend(_causal_module(), q, k, v, mask, scaling=0.3)
    assert grouped_calls == [q.shape] and out.shape == (2, 1, 6, 8)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.3,
                                          enable_gqa=True)
    torch.testing.assert_close(out.double(), want.transpose(1, 2), rtol=0, atol=0.05)


@pytest.mark.parametrize("padding", [False, True])
def test_a_bf16_decode_step_over_the_samplers_kv_buffers_hides_their_room(padding, monkeypatch):
    """The sampler's cache gives out views of buffers with room (``GrowingCache``); the step
    reads the whole buffers, so it must zero and hide the room (fresh memory: here NaN):
    the result of the same keys and values copied out, up to the kernels' summation order
    over the longer rows (one bf16 step, 2^-7, at most). Room that were not hidden would
    weigh in (an eighth of the weights here)."""
    from trio_engine.kv_cache import GrowingCache, buffer_of

    from .helpers import poison_kv_room

    poison_kv_room(monkeypatch)
    keys_read, real = [], attention.grouped
    monkeypatch.setattr(attention, "grouped", lambda q, k, *rest: keys_read.append(k.shape[2]) or real(q, k, *rest))
    cache = GrowingCache()
    g = torch.Generator().manual_seed(1)
    for length in (40, 1, 1):  # a prefill, then decode steps into its room
        k, v = (torch.randn(2, 2, length, 8, generator=g).bfloat16() for _ in range(2))
        keys, values = cache.update(k, v, 0)
    q = torch.randn(2, 6, 1, 8, generator=g).bfloat16()
    mask = None
    if padding:
        mask = torch.ones(2, 1, 1, keys.shape[2], dtype=torch.bool)
        mask[0, ..., :3] = False
    out, _ = attention.attend(_causal_module(), q, keys, values, mask, scaling=0.3)
    copied, _ = attention.attend(_causal_module(), q, keys.clone(), values.clone(), mask, scaling=0.3)
    assert keys_read == [buffer_of(keys).shape[2], keys.shape[2]]  # the buffers, then the copies
    assert buffer_of(keys).shape[2] > keys.shape[2]
    torch.testing.assert_close(out, copied, rtol=0, atol=2 ** -7)


@pytest.mark.parametrize("case", ["fp32", "fp32 decode", "float mask decode", "per-head mask decode",
                                  "not causal", "is_causal=False", "too many scores", "not square"])
def test_attend_leaves_every_other_call_to_sdpa(case, grouped_calls, monkeypatch):
    one_row = case.endswith("decode")
    q, k, v = _qkv(torch.float32 if case.startswith("fp32") else torch.bfloat16,
                   q_length=1 if one_row else 3 if case == "not square" else None)
    mask = None
    if case == "float mask decode":
        mask = torch.zeros(2, 1, 1, 5, dtype=torch.bfloat16)
    if case == "per-head mask decode":
        mask = torch.ones(2, 6, 1, 5, dtype=torch.bool)
    monkeypatch.setattr(attention, "GROUPED_MAX_SCORES", 2 * 6 * 5 * 5 - (case == "too many scores"))
    kwargs = {"is_causal": False} if case == "is_causal=False" else {}
    out, _ = attention.attend(_causal_module(case != "not causal"), q, k, v, mask, scaling=0.3, **kwargs)
    assert grouped_calls == []
    causal = case not in ("not causal", "is_causal=False") and not one_row
    if case == "not square":  # transformers crops SDPA's causal keys to the queries' length
        k, v = k[:, :, :3], v[:, :, :3]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize("padding", ["a padding query sees one key", "a padding query sees none"])
def test_a_bf16_pass_of_several_queries_under_a_mask_takes_the_grouped_path(padding, grouped_calls):
    """Prompts prefilled together in one padded pass attend as a lone prompt does (by bf16
    matmuls), so the sampler's logprobs stay the trainer's; SDPA's kernel there drew them
    0.35 nats apart. Any boolean pattern holds (here not a causal one); a query with no
    key to see (SDPA would give NaN) gets finite numbers, never read."""
    q, k, v = _qkv(torch.bfloat16)
    mask = torch.rand(2, 1, 5, 5, generator=torch.Generator().manual_seed(1)) < 0.6
    mask |= torch.eye(5, dtype=torch.bool)
    mask[0, :, :2, :] = False  # two padding queries
    mask[0, :, 2:, :2] = False  # whose keys no real query sees
    if padding == "a padding query sees one key":
        mask[0, :, :2, 0] = True  # as transformers' mask function makes them
    out, _ = attention.attend(_causal_module(), q, k, v, mask, scaling=0.3)
    assert grouped_calls == [q.shape] and torch.isfinite(out).all()
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.3,
                                          enable_gqa=True).transpose(1, 2)
    real = mask.any(-1)[:, 0]  # (B, T): queries with a key to see
    torch.testing.assert_close(out.double()[real], want[real], rtol=0, atol=0.05)


@pytest.mark.parametrize("shape", ["left padding", "after a cached prefix"])
def test_a_masked_pass_of_several_queries_gives_sdpa_the_groups_unrepeated(shape, monkeypatch):
    """transformers repeats keys and values under a mask; attend hands SDPA the grouped
    heads as they are, with the same results to the bit (transformers' own path is the
    reference). (In bf16 such a pass takes ``grouped``: above.)"""
    dtype = torch.float32
    q, k, v = (t.detach() for t in _qkv(dtype, length=7, q_length=7 if shape == "left padding" else 3))
    allowed = torch.arange(q.shape[2])[:, None] + (7 - q.shape[2]) >= torch.arange(7)[None, :]  # causal
    mask = allowed.expand(2, 1, q.shape[2], 7).clone()
    if shape == "left padding":
        mask[0, ..., :3] = False
        mask[0, :, :3, 0] = True  # transformers lets a padding query see one key (no NaN rows)
    want = sdpa_attention_forward(_causal_module(), q, k, v, mask, scaling=0.3)[0]
    seen = []
    real = F.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        seen.append((key.shape[1], kwargs.get("enable_gqa")))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    out, _ = attention.attend(_causal_module(), q, k, v, mask, scaling=0.3)
    assert seen == [(2, True)]  # two key/value heads, not six
    assert torch.equal(out, want)


def test_a_masked_pass_with_dropout_drops():
    q, k, v = (t.detach() for t in _qkv(torch.float32))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    plain, _ = attention.attend(_causal_module(), q, k, v, mask, scaling=0.3)
    dropped, _ = attention.attend(_causal_module(), q, k, v, mask, dropout=0.5, scaling=0.3)
    assert not torch.allclose(plain, dropped)


@pytest.mark.parametrize("case", ["position bias", "dropout", "not on the cpu"])
def test_attend_leaves_what_it_does_not_model_to_sdpa(case, grouped_calls):
    q, k, v = _qkv(torch.bfloat16)
    kwargs = {"position bias": {"position_bias": torch.ones(2, 6, 5, 5)}, "dropout": {"dropout": 0.5}}.get(case, {})
    if case == "not on the cpu":
        q, k, v = (t.detach().to("meta") for t in (q, k, v))
    out, _ = attention.attend(_causal_module(), q, k, v, None, scaling=0.3, **kwargs)
    assert grouped_calls == []
    if case == "dropout":  # and SDPA was told to drop
        plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
        assert not torch.allclose(out, plain.transpose(1, 2))


def test_attend_leaves_softcap_to_sdpa_which_refuses_it(grouped_calls):
    """No silent change of numerics: SDPA's own error, as without TRIO's attention."""
    q, k, v = _qkv(torch.bfloat16)
    with pytest.raises(ValueError, match="softcap"):
        attention.attend(_causal_module(), q, k, v, None, scaling=0.3, softcap=30.0)
    assert grouped_calls == []


def test_a_loaded_bf16_model_attends_through_the_grouped_path(grouped_calls):
    """Every layer of a training forward takes it; the logits stay those of SDPA's kernel
    within bf16's rounding of the scores."""
    model, _ = load_model_and_tokenizer(Catalog().resolve(TINY_LLAMA), torch.bfloat16)
    assert model.config._attn_implementation == attention.NAME
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    ours = model(input_ids=ids).logits.float()
    assert len(grouped_calls) == model.config.num_hidden_layers
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(ours, model(input_ids=ids).logits.float(), rtol=0, atol=0.05)


def test_a_loaded_model_keeps_sdpas_padding_masks():
    """A left-padded batch (as the sampler prefills) in fp32: every call goes to SDPA, with
    the masks SDPA's mask function makes, so the logits are SDPA's own."""
    model, _ = load_model_and_tokenizer(Catalog().resolve(TINY_LLAMA), torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ours = model(input_ids=ids, attention_mask=mask).logits
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(ours, model(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)


def test_a_model_on_another_attention_keeps_it():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(config)
    attention.install(model)
    assert model.config._attn_implementation == "eager"
