"""The public SDK, end to end through each transport, on the tiny Llama."""

from __future__ import annotations

import asyncio
import tarfile
import threading
from datetime import datetime, timedelta

import numpy as np
import pytest
import torch

import pytrio as trio

from ..polling import wait_until

MODEL = "trio/tiny-llama"
TOKENS = [1, 17, 300, 42, 9, 77, 5, 1024, 31, 8]


def datum(tokens=TOKENS, **extra) -> trio.Datum:
    inputs = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1), **extra}
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def trainer(service, seed=0, rank=4):
    return service.create_lora_training_client(base_model=MODEL, rank=rank, seed=seed)


def test_training_loop_lowers_loss(service):
    tc = trainer(service)
    losses = []
    for _ in range(4):
        fb = tc.forward_backward([datum()], "cross_entropy")
        op = tc.optim_step(trio.AdamParams(learning_rate=1e-2))
        out = fb.result()
        assert op.result().metrics["grad_norm"] > 0
        losses.append(out.metrics["loss:sum"])
        per_token = out.loss_fn_outputs[0]
        assert len(per_token["logprobs"].tolist()) == len(TOKENS) - 1
        assert sum(per_token["elementwise_loss"].tolist()) == pytest.approx(out.metrics["loss:sum"], rel=1e-5)
        assert out.elapsed_time > 0
    assert losses[-1] < losses[0]


def test_calls_run_in_submission_order(service):
    """fb/optim submitted back to back without waiting equal the same calls with waits."""
    eager, careful = trainer(service, seed=5), trainer(service, seed=5)
    futures = []
    for _ in range(3):
        futures.append(eager.forward_backward([datum()]))
        futures.append(eager.optim_step(trio.AdamParams(learning_rate=1e-2)))
    assert eager.get_info().step == 3  # in order too: after the calls made before it, unawaited
    waited = []
    for _ in range(3):
        waited.append(careful.forward_backward([datum()]).result())
        waited.append(careful.optim_step(trio.AdamParams(learning_rate=1e-2)).result())
    for got, want in zip([f.result() for f in futures], waited):
        assert got.metrics == pytest.approx(want.metrics, rel=1e-5)
    assert [f.result().metrics["step"] for f in futures[1::2]] == [1.0, 2.0, 3.0]


def test_futures_and_async_twins(service):
    tc = trainer(service)
    fut = tc.forward([datum()])
    assert isinstance(fut, trio.APIFuture)
    assert fut.result(timeout=60).metrics["loss:sum"] > 0 and fut.done()

    async def main():
        tc2 = await service.create_lora_training_client_async(base_model=MODEL, rank=4, seed=0)
        fb = await tc2.forward_backward_async([datum()], "cross_entropy")
        op = await tc2.optim_step_async(trio.AdamParams(learning_rate=1e-3))
        sampler = await tc2.save_weights_and_get_sampling_client_async(name="async-s")
        sample = await sampler.sample_async(prompt=trio.ModelInput.from_ints(TOKENS[:3]), num_samples=2,
                                            sampling_params=trio.SamplingParams(max_tokens=3, seed=1))
        return await fb, await op, await sample

    fb, op, sample = asyncio.run(main())
    assert fb.metrics["loss:sum"] > 0 and op.metrics["step"] == 1.0 and len(sample.sequences) == 2


def test_custom_cross_entropy_gives_builtin_gradient(service):
    """The custom path puts exactly the builtin gradient on the weights, not a multiple.

    Adam's first step moves each weight by about lr·sign(g) whatever the gradient's
    scale, so the weights after a step cannot tell; the step's grad_norm and the per-token
    losses of the weighted cross-entropy the custom path sends can.
    """
    builtin, custom = trainer(service, seed=3), trainer(service, seed=3)
    weights = [1.0, 0.5, 0.0, 2.0, 1.0, 1.0, 0.25, 1.0, 1.5]
    data = [datum(weights=weights), datum(TOKENS[:6])]

    def ce(batch, logprobs):
        loss = sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].tolist())).sum() for d, lp in zip(batch, logprobs))
        return loss, {"custom_metric": 1.0}

    out_custom = custom.forward_backward_custom(data, ce)
    op_custom = custom.optim_step(trio.AdamParams(learning_rate=1e-2))
    out_builtin = builtin.forward_backward(data, "cross_entropy")
    op_builtin = builtin.optim_step(trio.AdamParams(learning_rate=1e-2))
    got, want = out_custom.result(), out_builtin.result()
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
    assert got.metrics["custom_metric"] == 1.0
    for a, b in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-6)
        # cross_entropy with weights -dloss/dlogp: -w·logp per token, as the builtin's
        np.testing.assert_allclose(a["elementwise_loss"].to_numpy(), b["elementwise_loss"].to_numpy(),
                                   rtol=1e-5, atol=1e-6)
    grad_custom, grad_builtin = op_custom.result().metrics["grad_norm"], op_builtin.result().metrics["grad_norm"]
    assert grad_builtin > 0 and grad_custom == pytest.approx(grad_builtin, rel=1e-5)
    after = [tc.forward(data).result().loss_fn_outputs for tc in (custom, builtin)]
    for a, b in zip(*after):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)


def test_load_state_restores_a_run_that_moved_on(service):
    """load_state / load_state_with_optimizer bring a run back to its checkpoint, and the
    next step equals a step of a fresh client created from that checkpoint."""
    data = [datum(), datum(TOKENS[:6])]
    adam = trio.AdamParams(learning_rate=1e-2)

    def logprobs(tc):
        return [o["logprobs"].to_numpy() for o in tc.forward(data).result().loss_fn_outputs]

    def step(tc):
        tc.forward_backward(data)
        return tc.optim_step(adam).result().metrics

    def assert_same(a, b):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-6)

    tc = trainer(service, seed=11)
    for _ in range(2):
        step(tc)
    path = tc.save_state("mid").result().path
    at_save = logprobs(tc)
    for _ in range(2):
        step(tc)
    assert tc.get_info().step == 4
    moved = logprobs(tc)
    assert max(float(np.abs(x - y).max()) for x, y in zip(moved, at_save)) > 1e-3  # the run differs now

    def reload_like_a_fresh_client(load, fresh_from, step_after):
        """Load into the moved-on run: it equals the checkpoint, and its next step equals a
        fresh client's first step from that checkpoint. Returns the logprobs after it."""
        load(path).result()
        assert tc.get_info().step == step_after - 1
        assert_same(logprobs(tc), at_save)
        fresh = fresh_from(path)
        got, want = step(tc), step(fresh)
        assert got["step"] == want["step"] == float(step_after)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        after = logprobs(tc)
        assert_same(after, logprobs(fresh))
        return after

    with_moments = reload_like_a_fresh_client(
        tc.load_state_with_optimizer, service.create_training_client_from_state_with_optimizer, 3)
    weights_only = reload_like_a_fresh_client(  # the optimizer starts again
        tc.load_state, service.create_training_client_from_state, 1)
    # the moments mattered: a first step from the checkpoint differs from a third one
    assert max(float(np.abs(x - y).max()) for x, y in zip(weights_only, with_moments)) > 1e-4


def test_checkpoints_resume_and_sample(service):
    tc = trainer(service, seed=1)
    tc.forward_backward([datum()])
    tc.optim_step(trio.AdamParams(learning_rate=1e-2))
    saved = tc.save_state("step-1").result()
    assert saved.path == f"trio://{tc.model_id}/weights/step-1"
    resumed = service.create_training_client_from_state_with_optimizer(saved.path)
    assert resumed.get_info().step == 1
    fresh = service.create_training_client_from_state(saved.path)
    assert fresh.get_info().step == 0
    rest = service.create_rest_client()  # the run's record (the console, `trio runs list`) agrees
    assert (rest.get_training_run(resumed.model_id).step, rest.get_training_run(fresh.model_id).step) == (1, 0)
    a = resumed.forward([datum()]).result().loss_fn_outputs[0]["logprobs"].tolist()
    b = tc.forward([datum()]).result().loss_fn_outputs[0]["logprobs"].tolist()
    assert a == pytest.approx(b, abs=1e-6)
    tc.load_state_with_optimizer(saved.path).result()

    path = tc.save_weights_for_sampler("s1").result().path
    assert path == f"trio://{tc.model_id}/sampler_weights/s1"
    sampler = service.create_sampling_client(model_path=path)
    greedy = trio.SamplingParams(max_tokens=4, temperature=0.0)
    seq = sampler.sample(trio.ModelInput.from_ints(TOKENS[:4]), 1, greedy).result().sequences[0]
    logprobs = sampler.compute_logprobs(trio.ModelInput.from_ints(TOKENS[:4] + seq.tokens)).result()
    assert logprobs[0] is None
    assert logprobs[4:] == pytest.approx(seq.logprobs, abs=1e-4)


def test_sampling_params(service):
    sampler = service.create_sampling_client(base_model=MODEL)
    prompt = trio.ModelInput.from_ints(TOKENS[:5])
    params = trio.SamplingParams(max_tokens=6, temperature=1.0, seed=42)
    a = sampler.sample(prompt, 3, params).result()
    b = sampler.sample(prompt, 3, params).result()
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert all(s.stop_reason == "length" and len(s.logprobs) == 6 for s in a.sequences)
    first = a.sequences[0].tokens[0]
    stopped = sampler.sample(prompt, 1, params.model_copy(update={"stop": [first]})).result().sequences[0]
    assert stopped.tokens == [first] and stopped.stop_reason == "stop"
    with_prompt = sampler.sample(prompt, 1, params, include_prompt_logprobs=True).result()
    assert with_prompt.prompt_logprobs[0] is None and len(with_prompt.prompt_logprobs) == 5


def test_tokenizer_comes_from_the_service(service):
    tok = trainer(service).get_tokenizer()
    ids = tok.encode("Question: what is trio\nAnswer:", add_special_tokens=True)
    assert tok.decode(ids) == "Question: what is trio\nAnswer:"


def test_bad_input_errors(service):
    tc = trainer(service)
    with pytest.raises(trio.ValidationError, match="name"):
        tc.save_state("bad name!")
    bad = datum(TOKENS[:3], weights=[1.0])
    with pytest.raises(trio.ValidationError, match=r"data\[1\].*weights.*length 1") as err:
        tc.forward_backward([datum(), bad]).result()
    assert err.value.request_id
    oov = datum([1, 2, 10**7])
    with pytest.raises(trio.ValidationError, match=r"data\[0\].*10000000"):
        tc.forward([oov]).result()
    with pytest.raises(trio.ValidationError, match="cross_entropy"):
        tc.forward([datum()], "crossentropy").result()
    with pytest.raises(trio.ValidationError, match=r"Available models.*trio/tiny-llama"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-4B-Instruct-2507")
    with pytest.raises(trio.NotFoundError):
        service.create_training_client_from_state(f"trio://{tc.model_id}/weights/never-saved")
    with pytest.raises(trio.ValidationError, match="path"):
        service.create_training_client_from_state("s3://elsewhere")
    with pytest.raises(trio.ValidationError, match="max_tokens"):
        service.create_sampling_client(base_model=MODEL).sample(
            trio.ModelInput.from_ints([1, 2]), 1, trio.SamplingParams(max_tokens=0)).result()
    # the run still works after all that: nothing accepted was lost
    assert tc.forward_backward([datum()]).result().metrics["loss:sum"] > 0


def test_rest_client(service, tmp_path, request):
    tc = trainer(service)
    path = tc.save_state("rest-ckpt").result().path
    rest = service.create_rest_client()
    assert tc.model_id in [r.run_id for r in rest.list_training_runs()]
    assert [c.path for c in rest.list_checkpoints(tc.model_id)] == [path]
    assert path in [c.path for c in rest.list_user_checkpoints()]
    archive = rest.download_checkpoint_archive(path, tmp_path, progress=False)
    with tarfile.open(archive) as tar:
        assert {"rest-ckpt/adapter.safetensors", "rest-ckpt/trio_state.json"} <= set(tar.getnames())
    into = rest.download_checkpoint_archive(path, f"{tmp_path}/new/", progress=False)  # a folder, made
    assert into.parent == tmp_path / "new" and into.name == archive.name
    archives = _core_of(request).data_dir / "archives"
    assert any(p.name.startswith(tc.model_id) for p in archives.iterdir())  # built for the download
    wait_until(lambda: not list(archives.glob(".serving-*")), "each download's own link gone with it")
    rest.delete_checkpoint(path)
    assert rest.list_checkpoints(tc.model_id) == []
    assert not any(p.name.startswith(tc.model_id) for p in archives.iterdir())  # and removed with it
    with pytest.raises(trio.NotFoundError):
        rest.delete_checkpoint(path)


def test_a_call_keeps_the_values_it_was_made_with(service):
    """A loop that reuses one AdamParams and sets the next step's learning rate right after
    calling optim_step: the step waiting its turn (here behind a custom loss held open)
    still uses the rate it was called with; the same for SamplingParams and a datum's lists."""
    tc = trainer(service)
    release = threading.Event()

    def held_open(data, logprobs):
        release.wait(60)
        return sum(lp.sum() for lp in logprobs) * 0, {}

    custom = tc.forward_backward_custom([datum()], held_open)  # holds this client's order
    params = trio.AdamParams(learning_rate=1e-3)
    step = tc.optim_step(params)
    params.learning_rate = 5.0
    tokens = list(TOKENS)
    forward = tc.forward([datum(tokens)])
    tokens[3] = 99  # the datum's lists change too
    sampling = trio.SamplingParams(max_tokens=1, temperature=0.0)
    sample = service.create_sampling_client(base_model=MODEL).sample(trio.ModelInput.from_ints(TOKENS), 1, sampling)
    sampling.max_tokens = 5
    release.set()
    custom.result()
    assert step.result().metrics["learning_rate"] == 1e-3
    assert forward.result().loss_fn_outputs[0]["logprobs"].tolist() == tc.forward([datum()]).result().loss_fn_outputs[0]["logprobs"].tolist()
    assert len(sample.result().sequences[0].tokens) == 1


def test_non_finite_values_are_refused_when_called_naming_them_and_take_no_place(service):
    """Over HTTP they could not even be sent (JSON has no NaN), and a call that took its
    place in the client's order without being sent stalled the next one."""
    tc = trainer(service)
    d = datum()
    d.loss_fn_inputs["weights"] = trio.TensorData.model_construct(data=[1.0, float("nan")] + [1.0] * 7)
    with pytest.raises(trio.ValidationError, match=r"data\[0\].loss_fn_inputs\['weights'\]: contains non-finite "
                                                   r"value nan at index 1"):
        tc.forward_backward([d])
    params = trio.AdamParams()
    params.learning_rate = float("inf")  # set after it was built, unvalidated
    with pytest.raises(trio.ValidationError, match="learning_rate.*finite"):
        tc.optim_step(params)
    with pytest.raises(trio.ValidationError, match="loss_fn_config"):
        tc.forward_backward([datum()], "ppo", {"clip_low_threshold": float("nan")})
    sampling = trio.SamplingParams(max_tokens=2)
    sampling.temperature = float("inf")
    with pytest.raises(trio.ValidationError, match="temperature.*finite"):
        service.create_sampling_client(base_model=MODEL).sample(trio.ModelInput.from_ints([1, 2]), 1, sampling)
    assert tc._order._next_number == 0  # none of them took a number: the next call is not held up
    assert tc.forward_backward([datum()]).result().metrics["loss:sum"] > 0


def test_a_custom_loss_with_a_non_finite_gradient_names_the_datum_and_token(service):
    tc = trainer(service)

    def bad(data, logprobs):  # sqrt at 0: the value is finite (0), its gradient is not
        x = logprobs[1][2]
        return (x - x.detach()).sqrt() + sum(lp.sum() for lp in logprobs), {}

    with pytest.raises(trio.ValidationError, match=r"gradient .* data\[1\]'s logprobs is (nan|-?inf) at token 2"):
        tc.forward_backward_custom([datum(), datum()], bad).result()
    with pytest.raises(trio.ValidationError, match="non-finite loss"):
        tc.forward_backward_custom([datum()], lambda data, lps: (lps[0].sum() * float("nan"), {})).result()


def test_the_types_refuse_bad_values():
    """As ValueErrors: pydantic's from the models, the SDK's from from_ints (which rounded 1.5)."""
    for make in (lambda: trio.ModelInput.from_ints([1, 2.5]), lambda: trio.ModelInput.from_ints(["3"])):
        with pytest.raises(trio.ValidationError, match="not a token id"):
            make()
    for make in (lambda: trio.Datum(model_input=trio.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [1.5]}),
                 lambda: trio.AdamParams(learning_rate="fast"), lambda: trio.SamplingParams(),
                 lambda: trio.AdamParams(learning_rate=float("nan"))):
        with pytest.raises(ValueError):
            make()
    with pytest.raises(ValueError, match="weights"):  # an int past float's range: not an OverflowError
        trio.Datum(model_input=trio.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [1], "weights": [10**400]})
    assert trio.ModelInput.from_ints(np.array([3, 4])).to_ints() == [3, 4]  # numpy integers are token ids
    assert trio.ModelInput.from_ints([3.0]).to_ints() == [3]


def _core_of(request):
    """The ServiceCore behind the ``service`` fixture's client, on either transport."""
    if request.node.callspec.params["service"] == "local":
        return request.getfixturevalue("local_core")
    return request.getfixturevalue("http_server").core


def test_a_checkpoint_without_ttl_or_metadata_goes_out_without_those_fields():
    """An SDK from before they were added refuses fields it does not know; this one ignores
    what a newer server may add."""
    import tempfile

    import httpx

    from trio_server.app import create_app
    from trio_server.core import ServiceCore

    from .conftest import ServerThread

    with tempfile.TemporaryDirectory() as tmp:
        core = ServiceCore(tmp, dtype="float32")
        server = ServerThread(create_app(core, auth=False))
        try:
            svc = trio.ServiceClient(base_url=server.url, api_key="any")
            tc = trainer(svc)
            tc.save_state("plain").result()
            listed = httpx.get(server.url + "/api/v1/checkpoints").json()
            assert len(listed) == 1 and "expires_at" not in listed[0] and "user_metadata" not in listed[0]
            run = httpx.get(server.url + f"/api/v1/runs/{tc.model_id}").json()
            assert "expires_at" not in run["checkpoints"][0]
        finally:
            server.stop()
            core.close()
    future = trio.Checkpoint.model_validate({**listed[0], "a_future_field": 1})
    assert future.path == listed[0]["path"]


def test_a_checkpoint_with_a_ttl_lists_when_it_expires_and_is_removed_once_it_has(service, request):
    from trio_server.store import checkpoints

    tc = trainer(service)
    rest = service.create_rest_client()
    saved = tc.save_state("ttl", ttl_seconds=3600, user_metadata={"stage": "warmup"}).result().path
    kept = tc.save_weights_for_sampler("kept").result().path
    listed = {c.path: c for c in rest.list_checkpoints(tc.model_id)}
    assert listed[saved].user_metadata == {"stage": "warmup"} and listed[kept].expires_at is None
    created, expires = (datetime.fromisoformat(x) for x in (listed[saved].created_at, listed[saved].expires_at))
    assert expires - created == timedelta(hours=1)
    assert rest.set_checkpoint_ttl(kept, 60).expires_at is not None
    assert rest.set_checkpoint_ttl(kept, None).expires_at is None  # kept until deleted again
    with pytest.raises(trio.ValidationError, match="ttl_seconds"):
        tc.save_state("bad", ttl_seconds=0)
    for bad in (0, -1, 1.5, "60"):  # refused at the call, nothing sent: no status, no request id
        with pytest.raises(trio.ValidationError, match="ttl_seconds") as err:
            rest.set_checkpoint_ttl(kept, bad)
        assert (err.value.status_code, err.value.request_id) == (None, None)
    sampler = service.create_sampling_client(model_path=kept)
    with pytest.raises(trio.NotFoundError):
        rest.set_checkpoint_ttl(kept.replace("kept", "other"), 60)
    # an hour later (the store's clock moved instead of this test waiting): gone from the
    # list, from disk and for loading; the checkpoint without a TTL stays
    core = _core_of(request)
    core.store.update(checkpoints, "path", saved, expires_at="2000-01-01T00:00:00.000+00:00")
    folder = core.checkpoint_dir(tc.model_id, "weights", "ttl")
    assert [c.path for c in rest.list_checkpoints(tc.model_id)] == [kept] and not folder.exists()
    with pytest.raises(trio.NotFoundError):
        service.create_training_client_from_state(saved)
    assert sampler.sample(trio.ModelInput.from_ints([1, 2]), 1, trio.SamplingParams(max_tokens=1)).result()
    core.store.update(checkpoints, "path", kept, expires_at="2000-01-01T00:00:00.000+00:00")
    assert tc.save_weights_for_sampler("kept").result().path == kept  # an expired name is free again
    assert [c.expires_at for c in rest.list_checkpoints(tc.model_id)] == [None]


def test_capabilities(service):
    caps = service.get_server_capabilities()
    assert MODEL in caps.supported_models and caps.max_seq_len > 0 and caps.max_batch_size > 0


def test_errors_carry_their_status_code_on_both_transports(service):
    tc = trainer(service)
    with pytest.raises(trio.NotFoundError) as err:
        service.create_training_client_from_state(f"trio://{tc.model_id}/weights/never-saved")
    assert err.value.status_code == 404
    with pytest.raises(trio.ValidationError) as err:  # refused by the engine: a failed future
        tc.forward([datum([1, 2, 10**7])]).result()
    assert err.value.status_code == 400


def test_sample_needs_sampling_params(service):
    sampler = service.create_sampling_client(base_model=MODEL)
    with pytest.raises(trio.ValidationError, match="max_tokens"):
        sampler.sample(trio.ModelInput.from_ints(TOKENS[:3]), 1)


def test_ignore_eos_reaches_the_engine(local_core):
    """``stop`` adds stop sequences to EOS; ``stop=[]`` (tinker's meaning) and
    ``ignore_eos=True`` turn EOS off; ``stop=None`` keeps it."""
    from pytrio.transport.local import LocalTransport

    sampler = trio.ServiceClient(transport=LocalTransport(local_core)).create_sampling_client(base_model=MODEL)
    engine = local_core.workers[MODEL].engine
    seen, real = [], engine.decode

    def spy(admit, max_steps=1):
        seen.extend(job.request.config for job in admit.values())
        return real(admit, max_steps)

    engine.decode = spy
    try:
        prompt = trio.ModelInput.from_ints(TOKENS[:3])
        for params in (trio.SamplingParams(max_tokens=2), trio.SamplingParams(max_tokens=2, stop=[]),
                       trio.SamplingParams(max_tokens=2, stop=["\n"], ignore_eos=True)):
            sampler.sample(prompt, 1, params).result()
    finally:
        del engine.decode
    assert [(c.ignore_eos, c.stop_strings) for c in seen] == [(False, ()), (True, ()), (True, ("\n",))]


@pytest.mark.parametrize("save", ["save_state", "save_weights_for_sampler"])
def test_a_used_checkpoint_name_is_refused_unless_overwrite(service, save):
    tc = trainer(service, seed=21)
    rest = service.create_rest_client()
    path = getattr(tc, save)("taken").result().path
    before = rest.list_checkpoints(tc.model_id)
    tc.forward_backward([datum()])
    tc.optim_step(trio.AdamParams(learning_rate=1e-2))
    with pytest.raises(trio.ValidationError, match=r"already exists.*overwrite=True") as err:
        getattr(tc, save)("taken").result()
    assert path in err.value.message and err.value.status_code == 409
    assert rest.list_checkpoints(tc.model_id) == before  # the old checkpoint is untouched
    assert getattr(tc, save)("taken", overwrite=True).result().path == path
    assert [c.path for c in rest.list_checkpoints(tc.model_id)] == [path]
    assert tc.get_info().step == 1  # the refusal took its turn; the run went on


def test_a_sampler_saved_without_a_name_is_ephemeral(service):
    tc = trainer(service, seed=22)
    rest = service.create_rest_client()
    sampler = tc.save_weights_and_get_sampling_client()
    named = tc.save_weights_and_get_sampling_client(name="kept")
    listed = [c.path for c in rest.list_checkpoints(tc.model_id)]
    assert listed == [named.model_path] and sampler.model_path not in listed
    assert sampler.model_path not in [c.path for c in rest.list_user_checkpoints()]
    prompt, params = trio.ModelInput.from_ints(TOKENS[:3]), trio.SamplingParams(max_tokens=2, temperature=0.0)
    assert sampler.sample(prompt, 1, params).result().sequences == named.sample(prompt, 1, params).result().sequences
