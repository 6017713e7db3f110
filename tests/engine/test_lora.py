"""LoRA against a hand-written W0 + (α/r)·B·A, and multi-adapter batches against solo runs."""

import threading

import pytest
import torch
from torch import nn

from trio_engine import (
    LORA_ALPHA,
    Example,
    ForwardJob,
    LoraConfig,
    SampleRequest,
    SamplingConfig,
    lora,
)
from trio_engine.lora import (
    WEIGHT_MAJOR_MAX_ROWS,
    LoRALinear,
    Routing,
    linear_product,
    weight_major,
)
from trio_engine.sampler import PrefixCache

from .helpers import plain_model, randomize_adapter, reference_logprobs

TOL = 1e-5  # fp32, tiny shapes


def _layer_with_adapter(bias: bool = True) -> tuple[torch.nn.Linear, Routing, LoRALinear]:
    """A 12 -> 7 linear wrapped with one rank-4 adapter "a" whose B is non-zero."""
    torch.manual_seed(0)
    base = torch.nn.Linear(12, 7, bias=bias)
    routing = Routing()
    layer = LoRALinear(base, routing)
    layer.add("a", rank=4, scale=LORA_ALPHA / 4, gen=torch.Generator().manual_seed(1))
    with torch.no_grad():
        layer.lora_B["a"].normal_()
    return base, routing, layer


def test_lora_linear_matches_formula():
    base, routing, layer = _layer_with_adapter()
    x = torch.randn(3, 5, 12)
    a, b = layer.lora_A["a"], layer.lora_B["a"]
    expected = x @ base.weight.T + base.bias + (LORA_ALPHA / 4) * (x @ a.T @ b.T)
    with routing.use([("a", None)]):
        torch.testing.assert_close(layer(x), expected, atol=TOL, rtol=TOL)
    torch.testing.assert_close(layer(x), base(x))  # unrouted rows run the base model


@pytest.fixture
def weight_major_pays(monkeypatch):
    """This process's few-row fp32 products take W x^T, whatever this CPU measured."""
    monkeypatch.setattr(lora, "weight_major_pays", lambda rows, forms: True)


@pytest.fixture
def no_form_in_environment(monkeypatch):
    monkeypatch.delenv(lora.FEW_ROW_FORM_ENV, raising=False)


@pytest.mark.parametrize("shape", [(1, 12), (1, 1, 12), (2, 12), (5, 1, 12), (2, 3, 12), (WEIGHT_MAJOR_MAX_ROWS, 12)])
@pytest.mark.parametrize("bias", [True, False])
def test_decode_sized_products_equal_the_linear_layer(shape, bias, weight_major_pays):
    """The W x^T form that few-row fp32 inference takes gives the layer's own output, shape
    and all (one row is padded to two on the way, and must not leak out)."""
    base, routing, layer = _layer_with_adapter(bias)
    with torch.no_grad():
        x = torch.randn(shape)
        assert weight_major(x, base.weight)
        product = linear_product(base.weight, base.bias, x)
        assert not product.is_contiguous()  # W x^T's own layout: the form was taken
        torch.testing.assert_close(product, base(x), atol=TOL, rtol=TOL)
        plain = layer(x)  # no adapter routed: the base output, as rows again
        a, b = layer.lora_A["a"], layer.lora_B["a"]
        with routing.use([("a", None)]):
            adapted = layer(x)
    assert plain.is_contiguous()
    torch.testing.assert_close(linear_product(base.weight, base.bias, x), base(x))  # with autograd on: the layer's own path
    torch.testing.assert_close(plain, base(x), atol=TOL, rtol=TOL)
    torch.testing.assert_close(adapted, base(x) + (LORA_ALPHA / 4) * (x @ a.T @ b.T), atol=TOL, rtol=TOL)


def test_only_few_row_fp32_cpu_inference_takes_the_weight_major_form(weight_major_pays):
    weight = torch.zeros(7, 12)
    few, many = torch.zeros(WEIGHT_MAJOR_MAX_ROWS, 12), torch.zeros(WEIGHT_MAJOR_MAX_ROWS + 1, 12)
    with torch.no_grad():
        assert weight_major(few, weight) and weight_major(few[:1], weight)
        assert weight_major(torch.zeros(8, 1, 12), weight)  # a decode step's (batch, 1, hidden)
        assert not weight_major(many, weight)
        assert not weight_major(few.bfloat16(), weight.bfloat16())
        assert not weight_major(few.view(2, -1, 12), weight.to("meta"))  # a GPU's own kernels are left alone
    assert not weight_major(few, weight)  # training keeps the layer's own autograd path


def test_a_cpu_where_the_weight_major_form_does_not_pay_keeps_the_usual_one(monkeypatch):
    monkeypatch.setattr(lora, "weight_major_pays", lambda rows, forms: False)
    with torch.no_grad():
        assert not weight_major(torch.zeros(2, 12), torch.zeros(7, 12))
        linear = nn.Linear(12, 7)
        product = linear_product(linear.weight, linear.bias, torch.zeros(2, 12))
    assert product.is_contiguous()  # nn.Linear's own layout


def test_an_undecided_product_takes_the_usual_form(no_form_in_environment):
    with torch.no_grad():
        assert not weight_major(torch.zeros(2, 12), torch.zeros(7, 12), {})
        assert not weight_major(torch.zeros(2, 12), torch.zeros(7, 12), {8: True})  # band 2 undecided


def _model(*shapes: tuple[int, int], dtype=torch.float32) -> nn.Module:
    """A model of linears of ``shapes`` (out, in)."""
    return nn.ModuleList(nn.Linear(i, o, bias=False, dtype=dtype) for o, i in shapes)


def _forward_of(model: nn.Module, forms: dict, calls: list | None = None):
    """A forward that runs each of ``model``'s linears on ``band`` rows, in the forms ``forms`` decided."""
    def forward(band):
        if calls is not None:
            calls.append(band)
        for layer in model:
            linear_product(layer.weight, layer.bias, torch.zeros(band, layer.in_features, dtype=layer.weight.dtype),
                           forms)
    return forward


@pytest.mark.parametrize("gain, major", [(1.3, True), (1.05, True), (1.04, False), (0.7, False)])
def test_a_trial_decides_its_band_of_rows_for_its_model(no_form_in_environment, monkeypatch, gain, major):
    model, forms = _model((7, 12), (5, 7)), {}
    tried = []
    monkeypatch.setattr(lora, "_tried", lambda forward, band, repeats: tried.append((band, repeats)) or gain)
    lora.decide_few_row_forms(forms, model, 5, _forward_of(model, forms))
    lora.decide_few_row_forms(forms, model, 8, _forward_of(model, forms))  # the same band: decided once
    assert tried == [(8, 5)]
    assert forms == {8: major}
    with torch.no_grad():
        assert weight_major(torch.zeros(6, 12), model[0].weight, forms) is major
        assert weight_major(torch.zeros(6, 7), model[1].weight, forms) is major
        assert not weight_major(torch.zeros(9, 12), model[0].weight, forms)  # band 16: undecided
        assert not weight_major(torch.zeros(6, 12), model[0].weight, {})  # another model's forms


def test_each_band_has_a_trial_of_its_own_and_many_rows_none(no_form_in_environment):
    model, forms, calls = _model((7, 12)), {}, []
    for rows in (1, 2, 3, 8, 9, 16, 17, 64, 65, 600, 40):
        lora.decide_few_row_forms(forms, model, rows, _forward_of(model, forms, calls), repeats=1)
    assert calls == [1] * 4 + [2] * 4 + [8] * 4 + [16] * 4 + [32] * 4 + [64] * 4  # 1 warm round + 1 timed, 2 forms
    assert set(forms) == set(lora.FEW_ROW_BANDS)
    assert lora.FEW_ROW_BANDS[-1] == WEIGHT_MAJOR_MAX_ROWS


def test_a_model_off_fp32_or_off_the_cpu_has_no_trial(no_form_in_environment):
    for model in (_model((7, 12), dtype=torch.bfloat16), _model((7, 12)).to("meta"), nn.Module()):
        forms: dict[int, bool] = {}
        lora.decide_few_row_forms(forms, model, 2, lambda band: pytest.fail("tried"))
        assert forms == {2: False}


@pytest.mark.parametrize("form, major", [("weight_major", True), ("usual", False)])
def test_the_environment_decides_the_form_without_timing(no_form_in_environment, monkeypatch, form, major):
    monkeypatch.setenv(lora.FEW_ROW_FORM_ENV, form)
    monkeypatch.setattr(lora, "_tried", lambda *a: pytest.fail("timed although the environment decides"))
    model, forms = _model((7, 12)), {}
    with torch.no_grad():
        assert weight_major(torch.zeros(2, 12), model[0].weight, forms) is major  # before any trial too
    lora.decide_few_row_forms(forms, model, 2, _forward_of(model, forms))
    assert forms == {2: major}


def test_an_empty_form_in_the_environment_times_a_trial(no_form_in_environment, monkeypatch):
    monkeypatch.setenv(lora.FEW_ROW_FORM_ENV, "")
    monkeypatch.setattr(lora, "_tried", lambda forward, band, repeats: 2.0)
    model, forms = _model((7, 12)), {}
    lora.decide_few_row_forms(forms, model, 2, _forward_of(model, forms))
    assert forms == {2: True}


def test_a_bad_form_in_the_environment_names_the_variable(no_form_in_environment, monkeypatch):
    monkeypatch.setenv(lora.FEW_ROW_FORM_ENV, "fast")
    with pytest.raises(ValueError, match="TRIO_FEW_ROW_FORM.*'fast'"), torch.no_grad():
        weight_major(torch.zeros(2, 12), torch.zeros(7, 12))


def test_in_a_trial_every_product_on_its_thread_takes_its_form(no_form_in_environment):
    weight, decided = torch.zeros(7, 12), {8: True}
    seen, elsewhere = [], []

    def on_another_thread():
        with torch.no_grad():
            elsewhere.append(weight_major(torch.zeros(8, 12), weight, {}))

    def forward(band):
        seen.append((weight_major(torch.zeros(band, 12), weight, {}), weight_major(torch.zeros(band, 12), weight, decided),
                     torch.is_grad_enabled()))
        thread = threading.Thread(target=on_another_thread)
        thread.start()
        thread.join()

    lora._in_form(forward, 8, True)
    lora._in_form(forward, 8, False)
    assert seen == [(True, True, False), (False, False, False)]
    assert elsewhere == [False, False]  # another thread's products keep their own form
    with pytest.raises(RuntimeError), torch.no_grad():
        lora._in_form(lambda band: (_ for _ in ()).throw(RuntimeError()), 8, True)
    with torch.no_grad():
        assert not weight_major(torch.zeros(2, 12), weight, {})  # the trial's form is gone after it


def test_a_pass_within_a_trial_runs_no_trial_of_its_own(no_form_in_environment):
    """A trial's forward that reaches another decision point returns at once (the lock is not
    re-entrant: it would wait for itself)."""
    model, forms, inner = _model((7, 12)), {}, {}

    def forward(band):
        lora.decide_few_row_forms(inner, model, 2, lambda band: pytest.fail("tried within a trial"))

    thread = threading.Thread(target=lora.decide_few_row_forms, args=(forms, model, 8, forward), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive() and 8 in forms and inner == {}


def test_a_trial_leaves_the_sampled_tokens_as_they_were(monkeypatch, tiny_host, new_id):
    """A trial that keeps x W^T samples exactly what a host with every band decided does."""
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=0))
    request = SampleRequest(aid, list(range(5, 15)), 3, SamplingConfig(max_tokens=4, seed=0), prompt_logprobs=True)
    monkeypatch.delenv(lora.FEW_ROW_FORM_ENV, raising=False)
    monkeypatch.setattr(tiny_host.routing.packed, "enabled", False)
    monkeypatch.setattr(tiny_host.routing, "few_row_forms", dict.fromkeys(lora.FEW_ROW_BANDS, False))
    monkeypatch.setattr(tiny_host, "prefix_cache", PrefixCache())
    decided = tiny_host.sample([request])
    tiny_host.prefix_cache = PrefixCache()  # the same prefill again, not a cached prompt
    tried = []
    monkeypatch.setattr(tiny_host.routing, "few_row_forms", {})
    monkeypatch.setattr(lora, "_tried", lambda forward, band, repeats: tried.append(band) or
                        lora._in_form(forward, band, True) or lora._in_form(forward, band, False) or 0.5)
    assert tiny_host.sample([request]) == decided
    assert tried == [16, 8]


def test_the_gain_is_the_median_rounds_usual_time_over_the_other(monkeypatch):
    """With the timings given (no clock involved): a warm round dropped, the forms'
    order alternating, and the median of the rounds' ratios."""
    elapsed = {True: iter([0.1, 1, 1, 1, 1]), False: iter([0.1, 3, 2, 9, 1])}  # ratios 3, 2, 9, 1 after the warm round
    order, now = [], [0.0]

    def in_form(forward, band, form):
        assert band == 8
        order.append(form)
        now[0] += next(elapsed[form])

    monkeypatch.setattr(lora, "_in_form", in_form)
    monkeypatch.setattr(lora.time, "perf_counter", lambda: now[0])
    assert lora._tried(lambda band: None, 8, repeats=4) == pytest.approx(2.5)  # the median of 3, 2, 9, 1
    assert order == [True, False, False, True, True, False, False, True, True, False]


@pytest.mark.parametrize("warm_pair, timed_rounds", [(0.1, 5), (0.5, 4), (0.9, 2), (1.5, 1), (30.0, 1)])
def test_a_slower_model_has_fewer_timed_rounds(monkeypatch, warm_pair, timed_rounds):
    """As many rounds as fit in TRIAL_SECONDS (2 s) after the warm one, 1 to ``repeats``."""
    pairs, now = [], [0.0]

    def in_form(forward, band, form):
        now[0] += warm_pair / 2 if len(pairs) < 2 else 0.1
        pairs.append(form)

    monkeypatch.setattr(lora, "_in_form", in_form)
    monkeypatch.setattr(lora.time, "perf_counter", lambda: now[0])
    lora._tried(lambda band: None, 8, repeats=5)
    assert len(pairs) == 2 * (1 + timed_rounds)


@pytest.fixture
def fresh_forms(monkeypatch, tiny_host):
    """The tiny host with no form decided, and its trials deciding W x^T (whatever this CPU
    measures); its weights not packed (a host that packs them runs no trial)."""
    monkeypatch.setattr(tiny_host.routing.packed, "enabled", False)
    monkeypatch.setattr(tiny_host.routing, "few_row_forms", {})
    monkeypatch.setattr(lora, "_tried", lambda forward, band, repeats: lora._in_form(forward, band, True) or 2.0)
    monkeypatch.delenv(lora.FEW_ROW_FORM_ENV, raising=False)
    return tiny_host.routing.few_row_forms


def test_the_sampler_decides_the_forms_before_prefill_decode_and_draw(fresh_forms, monkeypatch, tiny_host, new_id):
    """The trial runs the trunk and the head on that many one-token rows of the request's
    adapter, before the first pass of its band: the prompt's products already take W x^T."""
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=0))
    routed, major_rows = [], []
    real_route, real_major = tiny_host.routing.route, lora.weight_major_product
    monkeypatch.setattr(tiny_host.routing, "route", lambda adapters, **k: routed.append(list(adapters)) or
                        real_route(adapters, **k))
    monkeypatch.setattr(lora, "weight_major_product", lambda x, w, b: major_rows.append((x.numel() // x.shape[-1],
                                                                                         w.shape)) or real_major(x, w, b))
    tiny_host.sample([SampleRequest(aid, list(range(5, 15)), 3, SamplingConfig(max_tokens=2, seed=0))])
    # the prompt's 10 rows (prefilled once for its 3 samples), then 3 rows: drawn, decoded
    assert fresh_forms == {16: True, 8: True}
    assert routed.count([aid] * 16) == routed.count([aid] * 8) == 1  # a trial's forward each
    head = tiny_host.model.get_output_embeddings().weight.shape
    assert {(10, (64, 64)), (3, (64, 64))} <= set(major_rows)
    assert major_rows.count((3, head)) == 2  # both draws, the first one too


def test_a_call_gives_the_same_numbers_before_and_after_a_sample_decided_its_forms(fresh_forms, tiny_host, new_id):
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=0))
    tokens = [5, 17, 300, 42, 9, 11]
    before = tiny_host.compute_logprobs(aid, tokens)
    assert fresh_forms == {8: True}  # compute_logprobs ran its own trial first
    tiny_host.sample([SampleRequest(aid, tokens, 2, SamplingConfig(max_tokens=3, seed=0))])
    assert tiny_host.compute_logprobs(aid, tokens) == before


# -- packed weights: inference products read oneDNN's blocked copies -----------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_product_is_the_linear_layers_and_follows_a_changed_weight(dtype):
    packed = lora.PackedWeights(enabled=lora.PackedWeights.works(dtype, torch.device("cpu")))
    if dtype == torch.bfloat16 and not packed.enabled:
        pytest.skip("oneDNN packs no bf16 weights on this CPU")
    assert packed.enabled  # fp32: on every CPU torch's oneDNN serves
    gen = torch.Generator().manual_seed(0)
    layer = nn.Linear(48, 80).to(dtype).requires_grad_(False)
    x = torch.randn(2, 5, 48, generator=gen).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    with torch.no_grad():
        for _ in range(2):
            got = lora.linear_product(layer.weight, layer.bias, x, packed=packed)
            torch.testing.assert_close(got, layer(x), rtol=tolerance, atol=tolerance)
            assert packed.copy_of(layer.weight) is packed.copy_of(layer.weight)  # kept while unchanged
            layer.weight.add_(1.0)  # a changed weight is packed again
        assert packed.applies(x, layer.weight)
        assert not packed.applies(x.float() if dtype == torch.bfloat16 else x.double(), layer.weight)
    assert not packed.applies(x, layer.weight)  # with gradients: the operator has no backward


def test_passes_without_gradients_read_packed_weights_and_training_does_not(tiny_host, new_id, monkeypatch):
    """forward and compute_logprobs take packed products (their parity with plain
    transformers is tested elsewhere); forward_backward, which needs gradients, none."""
    calls = []
    real = lora.packed_product
    monkeypatch.setattr(lora, "packed_product", lambda *args: calls.append(1) or real(*args))
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=0))
    ex = Example([5, 17, 300, 42], {"target_tokens": [17, 300, 42, 9]})
    tiny_host.forward_backward([ForwardJob(aid, [ex])])
    assert not calls
    tiny_host.forward([ForwardJob(aid, [ex])])
    assert calls
    tiny_host.delete_adapter(aid)


def test_a_host_that_packs_runs_no_few_row_trial(tiny_host, monkeypatch):
    monkeypatch.setattr(tiny_host.routing, "few_row_forms", {})
    monkeypatch.setattr(lora, "_tried", lambda forward, band, repeats: pytest.fail("a trial ran"))
    assert tiny_host.routing.packed.enabled
    tiny_host.compute_logprobs(None, [5, 17, 300, 42])
    assert tiny_host.routing.few_row_forms == {}


def test_packing_turns_off_where_the_probe_fails_or_the_environment_says(monkeypatch):
    from trio_engine import TINY_LLAMA, ModelHost

    assert not lora.PackedWeights.works(torch.float32, torch.device("meta"))
    real_pack = lora.pack
    monkeypatch.setattr(lora, "pack", lambda weight: real_pack(weight * 2))  # packing that gives wrong products
    assert not lora.PackedWeights.works(torch.float32, torch.device("cpu"))
    monkeypatch.undo()
    monkeypatch.setenv("TRIO_PACK_WEIGHTS", "0")
    assert not ModelHost(TINY_LLAMA, dtype="float32").routing.packed.enabled
    monkeypatch.setenv("TRIO_PACK_WEIGHTS", "yes")
    with pytest.raises(ValueError, match="TRIO_PACK_WEIGHTS: 'yes'"):
        ModelHost(TINY_LLAMA, dtype="float32")


def test_new_adapter_changes_nothing(tiny_host, new_id):
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=8, seed=3))
    ex = Example([5, 17, 300, 42], {"target_tokens": [17, 300, 42, 9]})
    ours = tiny_host.forward([ForwardJob(aid, [ex])])[0].logprobs[0]
    ref = reference_logprobs(plain_model("trio/tiny-llama"), ex.tokens, ex.inputs["target_tokens"])
    torch.testing.assert_close(torch.tensor(ours), ref, atol=TOL, rtol=TOL)


def test_seed_determines_weights(tiny_host, new_id):
    ids = [new_id() for _ in range(3)]
    for aid, seed in zip(ids, (7, 7, 8)):
        tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=seed))
    p0, p1, p2 = (tiny_host.adapter_params(a) for a in ids)
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    assert any(not torch.equal(p0[k], p2[k]) for k in p0 if k.endswith("lora_A"))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(rank=0), "rank"),
        (dict(rank=1000), "rank"),
        (dict(rank=2.5), "rank"),
        (dict(train_attn=False, train_mlp=False, train_unembed=False), "train_attn"),
    ],
)
def test_bad_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoraConfig(**kwargs)


@pytest.mark.parametrize("flags, want", [
    (dict(train_attn=False, train_unembed=False), {"gate_proj", "up_proj", "down_proj"}),
    (dict(train_mlp=False, train_unembed=False), {"q_proj", "k_proj", "v_proj", "o_proj"}),
    (dict(train_attn=False, train_mlp=False), {"lm_head"}),
])
def test_targets_follow_flags(tiny_host, new_id, flags, want):
    aid = new_id()
    tiny_host.create_adapter(aid, LoraConfig(rank=2, **flags))
    names = {k.rsplit(".", 2)[-2] for k in tiny_host.adapter_params(aid)}
    assert names == want


def test_one_base_copy_for_many_adapters(tiny_host, new_id):
    base_ptrs = {id(p) for p in tiny_host.model.parameters()}
    for _ in range(3):
        tiny_host.create_adapter(new_id(), LoraConfig(rank=4))
    assert {id(p) for p in tiny_host.model.parameters()} == base_ptrs


def test_mixed_adapter_batch_equals_solo_runs(tiny_host, new_id, monkeypatch):
    """Rows of adapters a, b and of the base model in one pass (packed: the lengths differ,
    so the adapters' runs are runs of tokens): each equals its solo run."""
    a, b = new_id(), new_id()
    for k, aid in enumerate((a, b)):
        tiny_host.create_adapter(aid, LoraConfig(rank=4, seed=k))
        randomize_adapter(tiny_host, aid, seed=10 + k)
    ex = lambda toks: Example(toks[:-1], {"target_tokens": toks[1:]})  # noqa: E731
    data = {a: [ex([1, 2, 3, 4, 5, 6])], b: [ex([9, 8, 7]), ex([3, 3, 3, 3])], None: [ex([4, 5, 6, 7])]}

    passes = []
    run = tiny_host._run
    monkeypatch.setattr(tiny_host, "_run", lambda jobs, backward: passes.append(len(jobs)) or run(jobs, backward))
    mixed = tiny_host.forward_backward([ForwardJob(k, v) for k, v in data.items()])
    assert passes == [3]  # one pass of all three jobs (a failing co-batched pass would rerun each alone)
    monkeypatch.undo()
    mixed_grads = {aid: {k: p.grad.clone() for k, p in tiny_host.adapter_params(aid).items()} for aid in (a, b)}
    for aid in (a, b):
        tiny_host.zero_grad(aid)

    for j, (aid, examples) in enumerate(data.items()):
        solo = tiny_host.forward_backward([ForwardJob(aid, examples)])[0]
        for got, want in zip(mixed[j].logprobs, solo.logprobs):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=TOL, rtol=TOL)
        if aid is not None:
            for k, p in tiny_host.adapter_params(aid).items():
                torch.testing.assert_close(mixed_grads[aid][k], p.grad, atol=TOL, rtol=1e-4)
            tiny_host.zero_grad(aid)


def test_inference_cast_cache_follows_updates():
    """bf16 activations: a cached cast of A/B must refresh after an in-place update."""
    base = torch.nn.Linear(8, 6).to(torch.bfloat16)
    routing = Routing()
    layer = LoRALinear(base, routing)
    layer.add("a", rank=2, scale=1.0, gen=torch.Generator().manual_seed(0))
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    with routing.use([("a", None)]), torch.no_grad():
        before = layer(x)
        layer.lora_B["a"].add_(1.0)  # what the optimizer does: an in-place update
        after = layer(x)
        want = base(x) + (x @ layer.lora_A["a"].to(torch.bfloat16).T) @ layer.lora_B["a"].to(torch.bfloat16).T
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, want, atol=1e-2, rtol=1e-2)


def test_bf16_training_casts_the_fp32_adapter_and_inference_reuses_one_cast():
    """bf16 activations with autograd on: A and B (fp32 leaves) are cast in the graph, so the
    output is the formula's and the gradients reach the fp32 weights; with autograd off the
    cast is made once and reused (what decode steps rely on)."""
    base = torch.nn.Linear(8, 6).to(torch.bfloat16)
    routing = Routing()
    layer = LoRALinear(base, routing)
    layer.add("a", rank=2, scale=0.5, gen=torch.Generator().manual_seed(0))
    a, b = layer.lora_A["a"], layer.lora_B["a"]
    with torch.no_grad():
        b.normal_()  # B starts at zero, which would leave A without a gradient
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    with routing.use([("a", None)]):
        out = layer(x)
    want = base(x) + 0.5 * (x @ a.to(torch.bfloat16).T) @ b.to(torch.bfloat16).T
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)
    out.float().sum().backward()
    assert a.grad is not None and b.grad is not None and a.grad.dtype == b.grad.dtype == torch.float32
    assert bool(a.grad.abs().sum() > 0) and bool(b.grad.abs().sum() > 0)
    with torch.no_grad():
        first = layer._as(a, torch.bfloat16)
        assert first.dtype == torch.bfloat16 and layer._as(a, torch.bfloat16) is first


def test_new_adapter_is_initialised_like_peft():
    """PEFT's default: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0,
    fp32 leaves that train; scale alpha / rank."""
    layer = LoRALinear(torch.nn.Linear(64, 10), Routing())
    layer.add("a", rank=8, scale=LORA_ALPHA / 8, gen=torch.Generator().manual_seed(0))
    a, b = layer.lora_A["a"], layer.lora_B["a"]
    bound = 1 / 64**0.5
    assert a.shape == (8, 64) and b.shape == (10, 8)
    assert a.dtype == b.dtype == torch.float32 and a.requires_grad and b.requires_grad
    assert float(a.abs().max()) <= bound and float(a.abs().max()) > 0.95 * bound  # 512 draws fill U(-b, b)
    assert abs(float(a.mean())) < 0.1 * bound and float(a.min()) < -0.9 * bound
    assert torch.count_nonzero(b) == 0
    assert layer.scales["a"] == LoraConfig(rank=8).scale == LORA_ALPHA / 8


def test_removing_an_adapter_drops_its_weights_and_casts_only():
    routing = Routing()
    layer = LoRALinear(torch.nn.Linear(6, 4), routing)
    for aid in ("a", "b"):
        layer.add(aid, rank=2, scale=1.0, gen=torch.Generator().manual_seed(0))
    x = torch.randn(1, 3, 6, dtype=torch.bfloat16)
    layer.base.to(torch.bfloat16)
    for aid in ("a", "b"):
        with torch.no_grad(), routing.use([(aid, None)]):
            layer(x)  # fills the bf16 cast cache for both adapters
    kept = {k for k in layer._casts if k[0] in (id(layer.lora_A["b"]), id(layer.lora_B["b"]))}
    assert len(kept) == 2 and len(layer._casts) == 4
    layer.remove("a")
    assert list(layer.lora_A) == list(layer.lora_B) == list(layer.scales) == ["b"]
    assert set(layer._casts) == kept


def test_segments_are_runs_of_one_adapter():
    from trio_engine.lora import segments

    assert segments(["a", "a"]) == [("a", None)]  # every row: no slicing needed
    assert segments(["a", None]) == [("a", slice(0, 1))]  # row 1 runs the base model
    assert segments([None, "a", "a", "b", "a"]) == [("a", slice(1, 3)), ("b", slice(3, 4)), ("a", slice(4, 5))]
    assert segments([None, None]) == []
    assert segments([]) == []


@pytest.mark.parametrize("row_adapters", [
    ["a", "a", None, "b", "a"],  # runs with a gap in the middle, an adapter twice
    [None, "b", "b", "a", None],  # base rows at both ends
    ["b", None, None, None, None],
])
def test_rows_of_several_adapters_match_the_formula(row_adapters):
    """Each row: W0 x + (alpha/r) B_a A_a x for its own adapter (the base alone for None),
    and each adapter's gradients come from its own rows only."""
    from trio_engine.lora import segments

    torch.manual_seed(0)
    base = torch.nn.Linear(12, 7)
    routing = Routing()
    layer = LoRALinear(base, routing)
    for aid, rank in (("a", 4), ("b", 2)):
        layer.add(aid, rank=rank, scale=LORA_ALPHA / rank, gen=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            layer.lora_B[aid].normal_()
    x = torch.randn(len(row_adapters), 3, 12)
    with routing.use(segments(row_adapters)):
        (layer(x) ** 2).sum().backward()
    got = {k: (layer.lora_A[k].grad, layer.lora_B[k].grad) for k in ("a", "b")}

    want = []
    ref = {k: (layer.lora_A[k].detach().clone().requires_grad_(), layer.lora_B[k].detach().clone().requires_grad_())
           for k in ("a", "b")}
    for row, aid in zip(x, row_adapters):
        y = base(row)
        if aid is not None:
            a, b = ref[aid]
            y = y + layer.scales[aid] * (row @ a.T @ b.T)
        want.append(y)
    want = torch.stack(want)
    (want**2).sum().backward()
    with torch.no_grad(), routing.use(segments(row_adapters)):
        torch.testing.assert_close(layer(x), want, atol=TOL, rtol=TOL)
    for k in ("a", "b"):
        for ours, theirs in zip(got[k], ref[k]):
            if theirs.grad is None:  # an adapter with no rows gets no gradient
                assert ours is None
            else:
                torch.testing.assert_close(ours, theirs.grad, atol=1e-4, rtol=1e-4)


def test_rank_bounds():
    from trio_engine.lora import MAX_RANK

    assert LoraConfig(rank=1).rank == 1 and LoraConfig(rank=MAX_RANK).rank == MAX_RANK
    with pytest.raises(ValueError, match=f"rank: must be an integer in \\[1, {MAX_RANK}\\], got {MAX_RANK + 1}"):
        LoraConfig(rank=MAX_RANK + 1)


def test_install_wraps_only_the_target_linears():
    from trio_engine.lora import install

    model = torch.nn.ModuleDict({"q_proj": torch.nn.Linear(4, 4), "score": torch.nn.Linear(4, 2),
                                 "lm_head": torch.nn.Linear(4, 9), "norm": torch.nn.LayerNorm(4)})
    install(model, ("q_proj", "k_proj", "lm_head"))
    assert {name for name, m in model.items() if isinstance(m, LoRALinear)} == {"q_proj", "lm_head"}


def test_deleting_an_adapter_removes_it_from_every_layer(tiny_host, new_id):
    from trio_engine.lora import adapter_tensors

    keep, gone = new_id(), new_id()
    for aid in (keep, gone):
        tiny_host.create_adapter(aid, LoraConfig(rank=2))
    tiny_host.delete_adapter(gone)
    assert adapter_tensors(tiny_host.model, gone) == {} and adapter_tensors(tiny_host.model, keep)


# -- sibling groups: q/k/v (and gate/up) as one product in bf16 inference ------------------

SIBLINGS = (("q", "k", "v"),)
BF16_TOL = 2e-2  # bf16 products against the fp32 formula, values of order 1


def _siblings(bias: bool = True, layout: str = "adjacent", originals: list | None = None
              ) -> tuple[torch.nn.ModuleDict, Routing]:
    """Three bf16 linears 12 -> 8 / 4 / 4 named q, k, v, wrapped and fused. ``layout`` of
    their weights: "adjacent", side by side in one buffer (as ``gather_on_huge_pages``
    leaves them); "apart", tensors of their own; "gap", one buffer with a row between q
    and k; "transposed", one buffer, but k is a transposed view starting where q ends.
    ``originals`` receives their weights as they were before the fusion."""
    from trio_engine.lora import install

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({n: torch.nn.Linear(12, o, bias=bias).to(torch.bfloat16)
                                 for n, o in (("q", 8), ("k", 4), ("v", 4))})
    if layout != "apart":
        buffer = torch.empty(17 * 12, dtype=torch.bfloat16)
        start = 0
        for name, m in model.items():
            start += 12 if layout == "gap" and name == "k" else 0
            size = m.out_features * 12
            view = buffer[start:start + size].view(m.out_features, 12)
            if layout == "transposed" and name == "k":
                view = buffer[start:start + size].view(12, m.out_features).t()
            view.copy_(m.weight.detach())
            m.weight = torch.nn.Parameter(view, requires_grad=False)
            start += size
    if originals is not None:
        originals += [m.weight.detach() for m in model.values()]
    return model, install(model, ("q", "k", "v"), SIBLINGS)


def _add(model: torch.nn.ModuleDict, adapter_id: str, names=("q", "k", "v"), rank: int = 2, scale: float = 0.5,
         seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name in names:
        layer = model[name]
        layer.add(adapter_id, rank=rank, scale=scale, gen=gen)
        with torch.no_grad():
            layer.lora_B[adapter_id].normal_(generator=gen)


def _formula(layer: LoRALinear, x: torch.Tensor, adapter_id: str | None) -> torch.Tensor:
    """x W0ᵀ + b + s·(x Aᵀ)Bᵀ in fp32 from the bf16 base and the fp32 adapter."""
    xf = x.float()
    out = xf @ layer.base.weight.float().T
    if layer.base.bias is not None:
        out = out + layer.base.bias.float()
    if adapter_id is not None and adapter_id in layer.lora_A:
        out = out + layer.scales[adapter_id] * (xf @ layer.lora_A[adapter_id].T) @ layer.lora_B[adapter_id].T
    return out


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", ["adjacent", "apart", "gap", "transposed"])
def test_fused_siblings_compute_each_members_formula(bias, layout):
    """One stacked product for q, k, v gives each its own x W0ᵀ + b + s·(x Aᵀ)Bᵀ; the
    members' weights become frozen views of the stack, made in place only when they lay
    side by side, and copied once otherwise."""
    originals: list[torch.Tensor] = []
    model, routing = _siblings(bias, layout, originals)
    group = model["q"].group
    assert group is not None and all(model[n].group is group for n in model)
    assert all(model[n].base.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
               for n in model)
    in_place = group.weight.untyped_storage().data_ptr() == originals[0].untyped_storage().data_ptr()
    assert in_place == (layout == "adjacent")
    assert all(torch.equal(model[n].base.weight, w) for n, w in zip(("q", "k", "v"), originals, strict=True))
    assert not any(p.requires_grad for n in model for p in model[n].base.parameters())
    _add(model, "a")
    x = torch.randn(2, 3, 12).to(torch.bfloat16)
    with routing.use([("a", None)]), torch.no_grad():
        outs = {n: model[n](x) for n in ("q", "k", "v")}
    for n, out in outs.items():
        assert out.shape == (2, 3, model[n].base.out_features) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), _formula(model[n], x, "a"), atol=BF16_TOL, rtol=BF16_TOL)


def test_siblings_fed_one_input_make_one_product_and_reuse_their_stacks(monkeypatch):
    """q, k, v on one input: one group product, whose stacked A / block-diagonal B are
    built once and reused by later steps (a decode step must not rebuild them)."""
    from trio_engine.lora import SiblingGroup

    model, routing = _siblings()
    _add(model, "a")
    group = model["q"].group
    computed = []
    real = SiblingGroup._compute
    monkeypatch.setattr(SiblingGroup, "_compute", lambda self, x: computed.append(x) or real(self, x))
    x = torch.randn(3, 1, 12).to(torch.bfloat16)
    with routing.use([("a", None)]), torch.no_grad():
        for _ in range(2):
            [model[n](x) for n in ("q", "k", "v")]
        first = group._stacked("a", torch.bfloat16)
        again = group._stacked("a", torch.bfloat16)
    assert len(computed) == 2 and group._pending is None
    assert first[0] is again[0] and first[1] is again[1]


def test_fused_siblings_route_rows_to_their_adapters():
    """Rows of adapter a, base rows, and rows of adapter b, which only q and v carry (so
    it is applied member by member) and with another scale: each row is its own
    adapter's formula, the base model's where it has none."""
    model, routing = _siblings()
    _add(model, "a")
    _add(model, "b", names=("q", "v"), scale=2.0, seed=2)
    x = torch.randn(5, 1, 12).to(torch.bfloat16)  # (rows, one decode position, in)
    rows = ["a", "a", None, "b", "b"]
    from trio_engine.lora import segments

    with routing.use(segments(rows)), torch.no_grad():
        outs = {n: model[n](x) for n in ("q", "k", "v")}
    for n, out in outs.items():
        for i, adapter_id in enumerate(rows):
            assert out.shape == (5, 1, model[n].base.out_features)
            torch.testing.assert_close(out[i].float(), _formula(model[n], x[i], adapter_id),
                                       atol=BF16_TOL, rtol=BF16_TOL)


def test_a_member_fed_another_input_gets_its_own_output():
    """The group keeps k's and v's outputs for the input q saw; k called with another
    tensor (or an input changed in place, or q called twice) must not get them."""
    model, routing = _siblings()
    _add(model, "a")
    x, other = torch.randn(4, 12).to(torch.bfloat16), torch.randn(4, 12).to(torch.bfloat16)
    with routing.use([("a", None)]), torch.no_grad():
        model["q"](x)
        k_other = model["k"](other)
        q_again = model["q"](x)
        q_twice = model["q"](x)
        x.mul_(2)
        v_changed = model["v"](x)
    for got, name, inp in ((k_other, "k", other), (q_again, "q", x / 2), (q_twice, "q", x / 2), (v_changed, "v", x)):
        torch.testing.assert_close(got.float(), _formula(model[name], inp, "a"), atol=BF16_TOL, rtol=BF16_TOL)


def test_fused_stacks_follow_updates_and_deletion():
    """The cached stacked A / block-diagonal B refresh after an in-place update (what the
    optimizer does) and go when the adapter is removed."""
    model, routing = _siblings()
    _add(model, "a")
    x = torch.randn(3, 12).to(torch.bfloat16)
    with routing.use([("a", None)]), torch.no_grad():
        [model[n](x) for n in ("q", "k", "v")]
        model["k"].lora_B["a"].add_(1.0)
        model["k"].lora_A["a"].mul_(-1.0)
        outs = {n: model[n](x) for n in ("q", "k", "v")}
    for n, out in outs.items():
        torch.testing.assert_close(out.float(), _formula(model[n], x, "a"), atol=BF16_TOL, rtol=BF16_TOL)
    group = model["q"].group
    assert group._stacks
    for n in model:
        model[n].remove("a")
    assert not group._stacks


def test_siblings_under_inference_mode_compute_alone():
    """Tensors made under ``torch.inference_mode`` have no version counter, which the
    group's hand-over needs: each member computes its own output, right."""
    model, routing = _siblings()
    _add(model, "a")
    with routing.use([("a", None)]), torch.inference_mode():
        x = torch.randn(3, 12).to(torch.bfloat16)
        outs = {n: model[n](x) for n in ("q", "k", "v")}
    for n, out in outs.items():
        torch.testing.assert_close(out.float(), _formula(model[n], x, "a"), atol=BF16_TOL, rtol=BF16_TOL)
    assert model["q"].group._pending is None


def test_training_and_fp32_products_bypass_the_group():
    """With autograd on, or in fp32, each member computes alone (the group is for bf16
    inference): gradients reach each member's A and B, and nothing is left pending."""
    model, routing = _siblings()
    _add(model, "a")
    x = torch.randn(3, 12).to(torch.bfloat16)
    with routing.use([("a", None)]):
        loss = sum(model[n](x).float().sum() for n in ("q", "k", "v"))
    loss.backward()
    assert all(model[n].lora_A["a"].grad is not None and model[n].lora_B["a"].grad is not None for n in model)
    assert model["q"].group._pending is None and not model["q"].group._stacks


def test_fuse_leaves_siblings_that_do_not_fit_one_product():
    from trio_engine.lora import fuse

    routing = Routing()
    wide = [LoRALinear(torch.nn.Linear(12, 4), routing), LoRALinear(torch.nn.Linear(10, 4), routing)]
    half_bias = [LoRALinear(torch.nn.Linear(12, 4), routing), LoRALinear(torch.nn.Linear(12, 4, bias=False), routing)]
    dtypes = [LoRALinear(torch.nn.Linear(12, 4), routing), LoRALinear(torch.nn.Linear(12, 4).double(), routing)]
    for members in (wide, half_bias, dtypes):
        weights = [m.base.weight for m in members]
        assert fuse(members) is None
        assert all(m.group is None and m.base.weight is w for m, w in zip(members, weights))
