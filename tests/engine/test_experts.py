"""LoRA on a mixture-of-experts block's experts (``lora.LoRAExperts``): against a
hand-written per-token formula, plain transformers with the adapter merged into each
expert's weights, and peft's LoRA on ``target_parameters`` (both ways)."""

import random

import pytest
import torch
from torch.nn import functional as F

from trio_engine import ForwardJob, InvalidInputError, LoraConfig, ModelHost, lora
from trio_engine.export import merge_into, read_adapter
from trio_engine.lora import LORA_ALPHA, LoRAExperts, install, segments
from trio_engine.model import GENERIC, family_of, select_targets
from trio_engine.sampler import SampleRequest, SamplingConfig

from .helpers import (
    QWEN2_MOE,
    QWEN3_MOE,
    TEST_CATALOG,
    needs_cuda,
    plain_model,
    random_example,
    randomize_adapter,
    reference_logprobs,
)

TOL = 1e-5  # fp32, tiny shapes


def _tiny(model_type: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**sizes, **overrides}))


MOE = {  # families whose experts are 3-D gate_up_proj (E, 2I, H) / down_proj (E, H, I)
    "qwen2_moe": dict(moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_experts_of_each_layout_are_wrapped_and_adapted_with_the_mlp(model_type):
    model = _tiny(model_type, **MOE[model_type])
    install(model, GENERIC.all_targets())
    assert all(isinstance(layer.mlp.experts, LoRAExperts) for layer in model.model.layers)
    targets = select_targets(model, family_of(model.config), LoraConfig())
    assert {"gate_up_proj", "down_proj"} <= set(targets)


def test_experts_of_another_layout_stay_refused():
    """GPT-OSS's experts have biases and interleaved gate/up columns: not wrapped, and an
    adapter of the MLP is refused, naming them, rather than made without them."""
    model = _tiny("gpt_oss", num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * 2)
    install(model, GENERIC.all_targets())
    assert not any(isinstance(m, LoRAExperts) for m in model.modules())
    with pytest.raises(InvalidInputError, match=r"train_mlp: true, .*gate_up_proj.* in a layout TRIO's LoRA does not"):
        select_targets(model, GENERIC, LoraConfig())


def test_experts_whose_forward_differs_or_fails_on_the_probe_are_left_alone(monkeypatch):
    """Experts of the right shapes and flags whose own forward computes otherwise, or
    raises on the probe's arguments, are not wrapped (and their MLP then refused)."""
    model = _tiny("qwen3_moe", **MOE["qwen3_moe"])
    experts_class = type(model.model.layers[0].mlp.experts)
    own = experts_class.forward
    monkeypatch.setattr(experts_class, "forward", lambda self, x, i, w: own(self, x, i, w) * 1.01)
    install(model, GENERIC.all_targets())
    monkeypatch.setattr(experts_class, "forward", lambda self, x, i, w, extra: own(self, x, i, w))
    other = _tiny("qwen3_moe", **MOE["qwen3_moe"])
    install(other, GENERIC.all_targets())
    for m in (model, other):
        assert not any(isinstance(module, LoRAExperts) for module in m.modules())
        with pytest.raises(InvalidInputError, match="train_mlp: true, .* in a layout TRIO's LoRA does not adapt"):
            select_targets(m, GENERIC, LoraConfig())


def _experts_with_adapters():
    """Qwen3-MoE's first experts block (4 experts, 2 a token) with adapters "a" (rank 4) and
    "b" (rank 1), their B non-zero."""
    model = _tiny("qwen3_moe", **MOE["qwen3_moe"])
    routing = install(model, GENERIC.all_targets())
    experts = model.model.layers[0].mlp.experts
    for aid, rank in (("a", 4), ("b", 1)):
        experts.add(aid, rank, LORA_ALPHA / rank, torch.Generator().manual_seed(rank))
        with torch.no_grad():
            for b in experts.lora_B[aid].values():
                b.normal_(std=0.1)
    return experts, routing


def _by_hand(experts, x, index, weights, token_adapters, factors):
    """Each token: the sum over its experts e of weight · down_e(silu(gate_e) · up_e), each
    projection W_e x plus its adapter's s · B_e A_e x (``factors``: adapter -> part -> (A, B))."""
    rows = []
    for t in range(x.shape[0]):
        total = torch.zeros(x.shape[1])
        for k in range(index.shape[1]):
            e, h = int(index[t, k]), x[t]
            outs = []
            for part, inp in (("gate_up_proj", h), ("down_proj", None)):
                inp = h if inp is not None else outs[-1]
                y = getattr(experts.base, part)[e] @ inp
                aid = token_adapters[t]
                if aid is not None:
                    a, b = factors[aid][part]
                    y = y + experts.scales[aid] * (b[e] @ (a[e] @ inp))
                if part == "gate_up_proj":
                    gate, up = y.chunk(2)
                    y = F.silu(gate) * up
                outs.append(y)
            total = total + weights[t, k] * outs[-1]
        rows.append(total)
    return torch.stack(rows)


@pytest.mark.parametrize("products", ["grouped", "per_expert"])
@pytest.mark.parametrize("row_adapters", [["a", "a", "a"], ["a", None, "b"], [None, "b", "b"], ["b", "a", "a"]])
def test_each_token_goes_through_its_experts_and_its_adapter(row_adapters, products, monkeypatch):
    """Rows of several adapters and of the base model in one pass: each token's output,
    its input's gradient and each adapter's gradients as the per-token formula gives them,
    with grouped products where they fit (not adapter "b"'s rank-1 B products) and with a
    product per expert throughout."""
    if products == "per_expert":
        monkeypatch.setattr(lora, "_groups_fit", lambda x, weight: False)
    experts, routing = _experts_with_adapters()
    torch.manual_seed(1)
    per_row = 5
    x = torch.randn(len(row_adapters) * per_row, 32)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(x.shape[0])])
    weights = torch.rand(x.shape[0], 2)
    ours_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    with routing.route(row_adapters):
        (experts(ours_x, index, weights) ** 2).sum().backward()

    factors = {aid: {part: (experts.lora_A[aid][part].detach().clone().requires_grad_(),
                            experts.lora_B[aid][part].detach().clone().requires_grad_())
                     for part in LoRAExperts.PARTS} for aid in ("a", "b")}
    token_adapters = [aid for aid in row_adapters for _ in range(per_row)]
    want = _by_hand(experts, theirs_x, index, weights, token_adapters, factors)
    (want**2).sum().backward()
    torch.testing.assert_close(ours_x.grad, theirs_x.grad, atol=1e-4, rtol=1e-4)  # what earlier layers get
    with torch.no_grad(), routing.route(row_adapters):
        torch.testing.assert_close(experts(x, index, weights), want, atol=TOL, rtol=TOL)
    for aid in ("a", "b"):
        for part in LoRAExperts.PARTS:
            for ours, theirs in zip((experts.lora_A[aid][part], experts.lora_B[aid][part]), factors[aid][part]):
                if theirs.grad is None:  # an adapter with no rows gets no gradient
                    assert ours.grad is None
                else:
                    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_grouped_product_gives_a_product_per_experts_numbers(dtype, monkeypatch):
    """``grouped_linear`` as one grouped call and as a product per expert, experts without
    rows among them: the same bits, so which one runs never moves a result."""
    torch.manual_seed(3)
    weight = torch.randn(6, 48, 32).to(dtype)
    ends = torch.tensor([3, 0, 17, 7, 0, 2]).cumsum(0)
    x = torch.randn(int(ends[-1]), 32).to(dtype)
    assert lora._groups_fit(x, weight)
    grouped = lora.grouped_linear(x, weight, ends)
    monkeypatch.setattr(lora, "_groups_fit", lambda x, weight: False)
    assert torch.equal(grouped, lora.grouped_linear(x, weight, ends))
    starts = [0, *ends[:-1].tolist()]
    by_hand = torch.cat([x[lo:hi].double() @ weight[e].double().T for e, (lo, hi) in enumerate(zip(starts, ends.tolist()))])
    torch.testing.assert_close(grouped.double(), by_hand, rtol=0.02 if dtype == torch.bfloat16 else 1e-5, atol=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_products_are_taken_where_the_kernel_takes_them_forward_and_backward(dtype):
    """For each rank, an adapter's two products (x Aᵀ over (N, in) rows, then Bᵀ over (N, r)
    rows): where ``_groups_fit`` says yes, ``torch._grouped_mm`` runs forward and backward;
    ranks that are multiples of 16 bytes say yes, the others (rank 1 among them) no."""
    ends = torch.tensor([2, 2, 5])
    aligned = 16 // torch.empty(0, dtype=dtype).element_size()
    for rank in (1, 2, 4, 6, 8, 16):
        for x, weight in ((torch.randn(5, 64), torch.randn(3, rank, 64)),
                          (torch.randn(5, rank), torch.randn(3, 64, rank))):
            x, weight = x.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
            fits = lora._groups_fit(x, weight)
            assert fits is (rank % aligned == 0), (rank, tuple(weight.shape))
            if fits:
                out = torch._grouped_mm(x, weight.mT, offs=ends.to(torch.int32))
                out.backward(torch.randn(out.shape).to(dtype))
    with pytest.raises(RuntimeError, match="16 bytes"):  # what the loop spares a rank-1 B product
        torch._grouped_mm(torch.randn(5, 1).to(dtype), torch.randn(3, 64, 1).to(dtype).mT, offs=ends.to(torch.int32))


@needs_cuda
def test_grouped_products_on_a_gpu_give_a_product_per_experts_numbers(monkeypatch):
    torch.manual_seed(4)
    weight = torch.randn(8, 64, 32, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor([5, 0, 9, 1, 0, 0, 17, 3], device="cuda").cumsum(0)
    x = torch.randn(int(ends[-1]), 32, device="cuda", dtype=torch.bfloat16)
    grouped = lora.grouped_linear(x, weight, ends)
    monkeypatch.setattr(lora, "_groups_fit", lambda x, weight: False)
    torch.testing.assert_close(grouped, lora.grouped_linear(x, weight, ends))


def test_tokens_counted_over_a_packed_row_reach_their_adapters():
    experts, routing = _experts_with_adapters()
    torch.manual_seed(2)
    x = torch.randn(9, 32)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(9)])
    weights = torch.rand(9, 2)
    token_adapters = ["b"] * 2 + [None] * 3 + ["a"] * 4
    factors = {aid: {p: (experts.lora_A[aid][p].detach(), experts.lora_B[aid][p].detach()) for p in LoRAExperts.PARTS}
               for aid in ("a", "b")}
    with torch.no_grad(), routing.route(token_adapters, over_tokens=True):
        torch.testing.assert_close(experts(x, index, weights),
                                   _by_hand(experts, x, index, weights, token_adapters, factors), atol=TOL, rtol=TOL)


def test_row_slices_without_the_batch_rows_are_an_error():
    experts, routing = _experts_with_adapters()
    with routing.use(segments(["a", "b"])), pytest.raises(RuntimeError, match="rows"):
        experts(torch.randn(4, 32), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2))


def test_a_pass_without_adapters_runs_the_modules_own_forward(monkeypatch):
    experts, routing = _experts_with_adapters()
    calls = []
    own = experts.base.forward
    monkeypatch.setattr(experts.base, "forward", lambda *args: calls.append(1) or own(*args))
    with routing.route([None, None]):
        experts(torch.randn(4, 32), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2))
    assert calls == [1]


@pytest.fixture(scope="module")
def moe_host():
    return ModelHost(QWEN3_MOE.name, dtype="float32", catalog=TEST_CATALOG)


@pytest.fixture(scope="module")
def shared_expert_host():
    """Qwen2-MoE: a shared expert beside the experts, and no packed passes (a mixed batch
    runs padded, its shared expert's linears fed (B·T, H))."""
    return ModelHost(QWEN2_MOE.name, dtype="float32", catalog=TEST_CATALOG)


def _merged(host, adapter_id):
    """The plain model with the adapter merged into every adapted weight by hand: linear
    layers W + s·B@A, each expert's tensors W[e] + s·B[e]@A[e]."""
    model = plain_model(host.model_name)
    config, _ = host.adapter_config(adapter_id)
    tensors = {k: v.detach().float() for k, v in host.adapter_params(adapter_id).items()}
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith(".lora_A"):
                path = key[: -len(".lora_A")]
                b = tensors[path + ".lora_B"]
                if a.dim() == 3:
                    module, _, part = path.rpartition(".")
                    weight = getattr(model.get_submodule(module), part)
                    for e in range(a.shape[0]):
                        weight[e] += config.scale * (b[e] @ a[e])
                else:
                    model.get_submodule(path).weight += config.scale * (b @ a)
    return model


@pytest.mark.parametrize("kinds", [{}, {"train_attn": False, "train_unembed": False}])
def test_an_experts_adapter_gives_the_merged_models_and_peft_logprobs(moe_host, new_id, tmp_path, kinds):
    """Training forward against plain transformers with the adapter merged, and against
    peft loading our sampler weights (``target_parameters``); loading them back gives the
    same numbers, and ``trio export``'s merge makes the same model."""
    peft = pytest.importorskip("peft")
    aid = new_id()
    moe_host.create_adapter(aid, LoraConfig(rank=4, seed=3, **kinds))
    randomize_adapter(moe_host, aid, seed=6, scale=0.1)
    assert any(t.dim() == 3 for t in moe_host.adapter_params(aid).values())
    data = [random_example(moe_host.vocab_size, n, random.Random(n)) for n in (5, 17)]
    result = moe_host.forward([ForwardJob(aid, data)])[0]
    moe_host.save_sampler_weights(aid, tmp_path)
    moe_host.load_sampler_weights(aid + "-back", str(tmp_path))
    back = moe_host.forward([ForwardJob(aid + "-back", data)])[0]
    with_peft = peft.PeftModel.from_pretrained(plain_model(QWEN3_MOE.name), str(tmp_path))
    exported = plain_model(QWEN3_MOE.name)
    merge_into(exported, read_adapter(tmp_path))
    for k, (example, logprobs) in enumerate(zip(data, result.logprobs, strict=True)):
        for model in (_merged(moe_host, aid), with_peft, exported):
            torch.testing.assert_close(torch.tensor(logprobs), reference_logprobs(
                model, example.tokens, example.inputs["target_tokens"]), atol=1e-5, rtol=1e-5)
        assert back.logprobs[k] == logprobs
    assert not torch.allclose(torch.tensor(result.logprobs[1]), reference_logprobs(  # the adapter matters
        plain_model(QWEN3_MOE.name), data[1].tokens, data[1].inputs["target_tokens"]), atol=1e-3)
    for a in (aid, aid + "-back"):
        moe_host.delete_adapter(a)


@pytest.mark.parametrize("targets", [["mlp.experts.down_proj", "mlp.experts.gate_up_proj"],
                                     ["gate_up_proj", "down_proj"]])
def test_a_peft_made_experts_adapter_loads(moe_host, new_id, tmp_path, targets):
    """peft nests its wrappers of one module's tensors in their registration order
    (gate_up_proj inside down_proj's ``base_layer``) whatever order the config lists them,
    and matches a bare name against parameters only (not q_proj's keys)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
                             target_parameters=targets)
    torch.manual_seed(1)
    theirs = peft.get_peft_model(plain_model(QWEN3_MOE.name), config)
    theirs.save_pretrained(tmp_path)
    aid = new_id()
    moe_host.load_sampler_weights(aid, str(tmp_path))
    data = [random_example(moe_host.vocab_size, 9, random.Random(4))]
    ours = moe_host.forward([ForwardJob(aid, data)])[0].logprobs[0]
    torch.testing.assert_close(torch.tensor(ours), reference_logprobs(
        theirs, data[0].tokens, data[0].inputs["target_tokens"]), atol=1e-5, rtol=1e-5)
    moe_host.delete_adapter(aid)


@pytest.mark.parametrize("host_fixture", ["moe_host", "shared_expert_host"])
def test_experts_adapters_in_one_pass_and_in_the_sampler_keep_to_their_rows(host_fixture, request, new_id):
    """Two adapters and the base model co-batched in one training pass (Qwen3-MoE packed,
    Qwen2-MoE padded) give each one's solo numbers and gradients; sampled together, each
    sequence's logprobs are the trainer's."""
    moe_host = request.getfixturevalue(host_fixture)
    a, b = new_id(), new_id()
    for k, aid in enumerate((a, b)):
        moe_host.create_adapter(aid, LoraConfig(rank=4, seed=k))
        randomize_adapter(moe_host, aid, seed=20 + k, scale=0.1)
    rng = random.Random(0)
    data = {a: [random_example(moe_host.vocab_size, 7, rng)],
            b: [random_example(moe_host.vocab_size, 4, rng), random_example(moe_host.vocab_size, 6, rng)],
            None: [random_example(moe_host.vocab_size, 5, rng)]}
    mixed = moe_host.forward_backward([ForwardJob(k, v) for k, v in data.items()])
    grads = {aid: {k: p.grad.clone() for k, p in moe_host.adapter_params(aid).items()} for aid in (a, b)}
    for j, (aid, examples) in enumerate(data.items()):
        if aid is not None:
            moe_host.zero_grad(aid)
        solo = moe_host.forward_backward([ForwardJob(aid, examples)])[0]
        for got, want in zip(mixed[j].logprobs, solo.logprobs, strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=TOL, rtol=TOL)
        if aid is not None:
            for k, p in moe_host.adapter_params(aid).items():
                torch.testing.assert_close(grads[aid][k], p.grad, atol=TOL, rtol=1e-4)
            assert any(bool(g.abs().sum() > 0) for k, g in grads[aid].items() if ".experts." in k)
            moe_host.zero_grad(aid)

    prompt = [3, 14, 15, 9, 2]
    config = SamplingConfig(max_tokens=6, seed=1, ignore_eos=True)
    requests = [SampleRequest(a, prompt, 2, config), SampleRequest(None, prompt[:3], 1, config),
                SampleRequest(b, prompt[1:], 1, config)]
    for request, result in zip(requests, moe_host.sample(requests), strict=True):
        for sequence in result.sequences:
            trainer = moe_host.compute_logprobs(request.adapter_id, request.prompt + sequence.tokens)
            torch.testing.assert_close(torch.tensor(sequence.logprobs),
                                       torch.tensor(trainer[len(request.prompt):]), atol=1e-4, rtol=0)
    for aid in (a, b):
        moe_host.delete_adapter(aid)


def test_experts_of_another_layout_are_not_merged_on_export(tmp_path):
    """GPT-OSS keeps its experts transposed (down_proj (E, I, H)): with I = H a peft
    adapter's B @ A fits the shape but would land transposed, so export refuses it."""
    peft = pytest.importorskip("peft")
    from trio_engine.checkpoint import load_peft_adapter
    from trio_engine.export import Adapter, ExportError

    model = _tiny("gpt_oss", num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * 2,
                  intermediate_size=32)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=[], target_parameters=["mlp.experts.down_proj"],
                             init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(tmp_path)
    adapter = Adapter("tiny-gpt-oss", *load_peft_adapter(tmp_path))
    assert {k.rsplit(".", 2)[-2] for k in adapter.weights} == {"down_proj"}
    with pytest.raises(ExportError, match="GptOssExperts keeps its experts in a layout TRIO does not merge"):
        merge_into(_tiny("gpt_oss", num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * 2,
                         intermediate_size=32), adapter)
