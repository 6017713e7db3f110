"""The official tinker SDK (0.38) against a ``trio serve`` subprocess, on the tiny Llama.

One client session walks every route of the tinker protocol the SDK uses by default, and
checks the numbers against pytrio on the same server: same data and same initial weights
give the same ``loss:sum``; a sampler's logprobs equal ``compute_logprobs`` of its tokens.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
import pytrio as trio  # noqa: E402
from tinker import types as tt  # noqa: E402

TINY = "trio/tiny-llama"
ADAM = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
# the POST routes this walk must reach (the GET/DELETE ones are checked through their results)
ROUTES = ["client/config", "client/dynamic_config", "create_session", "create_model", "get_info", "forward_backward",
          "optim_step", "save_weights", "save_weights_for_sampler", "load_weights", "create_sampling_session",
          "asample", "retrieve_future", "weights_info"]
TEXTS = ["Question: what is trio\nAnswer: an AI infra product\n\n", "User: hello there\nAssistant: hi!\n\n"]


def _rows(tokenizer):
    rows = []
    for text in TEXTS:
        tokens = tokenizer.encode(text)
        weights = [0.0] * 3 + [1.0] * (len(tokens) - 4)  # the first targets masked, as a prompt
        rows.append((tokens[:-1], tokens[1:], weights))
    return rows


def _close(a, b, tol=1e-4):
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


def test_every_route_and_pytrio_parity(tinker_env, tinker_server):
    with tinker.ServiceClient() as service:  # its exit finishes the session, as in the cookbook
        _walk_every_route(service, tinker_server)
    log = tinker_server.log_text()
    assert "POST /tinker/api/v1/sessions/" in log and "/finish 200" in log
    # no tinker route answered a client error or a server error the SDK would retry
    statuses = re.findall(r"(\S+ /tinker/\S+) (\d{3}) ", log)
    assert {route for route, _ in statuses} >= {f"POST /tinker/api/v1/{r}" for r in ROUTES}
    bad = [(route, status) for route, status in statuses if int(status) >= 400 and status != "408"]
    assert not bad, bad


def _walk_every_route(service, tinker_server):
    rest = tinker.RestClient()
    caps = rest.get_server_capabilities().result()
    assert TINY in [m.model_name for m in caps.supported_models]

    tc = service.create_lora_training_client(base_model=TINY, rank=8, seed=3,
                                             user_metadata={"renderer_name": "role_colon"}).result()
    tokenizer = tc.get_tokenizer()  # by name, from the offline hub cache
    rows = _rows(tokenizer)
    data = [tt.Datum(model_input=tt.ModelInput.from_ints(x), loss_fn_inputs={"target_tokens": y, "weights": w})
            for x, y, w in rows]

    pytrio_service = trio.ServiceClient(base_url=tinker_server.url, api_key=tinker_server.key)
    ptc = pytrio_service.create_lora_training_client(base_model=TINY, rank=8, seed=3)
    pdata = [trio.Datum(model_input=trio.ModelInput.from_ints(x), loss_fn_inputs={"target_tokens": y, "weights": w})
             for x, y, w in rows]

    # forward_backward (protobuf both ways) gives pytrio's loss and logprobs
    fb = tc.forward_backward(data, "cross_entropy").result()
    pfb = ptc.forward_backward(pdata, "cross_entropy").result()
    assert _close(fb.metrics["loss:sum"], pfb.metrics["loss:sum"])
    for out, pout in zip(fb.loss_fn_outputs, pfb.loss_fn_outputs):
        np.testing.assert_allclose(out["logprobs"].to_numpy(), pout["logprobs"].to_numpy(), atol=1e-5)
    first_loss = fb.metrics["loss:sum"]

    # optim_step, then forward: still the same numbers, and the loss fell
    tc.optim_step(tt.AdamParams(**ADAM)).result()
    ptc.optim_step(trio.AdamParams(**ADAM)).result()
    fwd = tc.forward(data, "cross_entropy").result()
    pfwd = ptc.forward(pdata, "cross_entropy").result()
    assert _close(fwd.metrics["loss:sum"], pfwd.metrics["loss:sum"])
    assert fwd.metrics["loss:sum"] < first_loss

    # forward_backward_custom: a forward, then a cross_entropy step with signed weights
    def neg_logprob_sum(batch, logprobs):
        import torch

        loss = sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].to_numpy())).sum() for d, lp in zip(batch, logprobs))
        return loss, {"custom:sum": float(loss.detach())}

    custom = tc.forward_backward_custom(data, neg_logprob_sum).result()
    assert _close(custom.metrics["custom:sum"], fwd.metrics["loss:sum"])

    # a loss TRIO lacks fails its own future, naming the ones it has; later calls still run
    with pytest.raises(tinker.RequestFailedError) as failed:
        tc.forward_backward(data, "stable_reinforce").result()
    assert "stable_reinforce" in str(failed.value) and "importance_sampling" in str(failed.value)
    tc.optim_step(tt.AdamParams(**ADAM)).result()

    # importance_sampling by its tinker name, with the sampler's logprobs as q
    rl = [tt.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": o["logprobs"].to_numpy(),
        "advantages": np.ones(len(o["logprobs"].to_numpy()), dtype=np.float32)})
        for d, o in zip(data, tc.forward(data, "cross_entropy").result().loss_fn_outputs)]
    is_out = tc.forward_backward(rl, "importance_sampling").result()
    assert np.isfinite(is_out.metrics["loss:sum"])
    # gspo with its sequence_ratio_mask (as the cookbook's rl_loop sends it): on-policy, the
    # sequence ratio is 1 and each token's loss -A = -1
    gspo = [tt.Datum(model_input=d.model_input, loss_fn_inputs={
        **d.loss_fn_inputs, "sequence_ratio_mask": np.ones(len(d.loss_fn_inputs["logprobs"].to_numpy()), np.float32)})
        for d in rl]
    gspo_out = tc.forward_backward(gspo, "gspo").result()
    tokens = sum(len(d.loss_fn_inputs["logprobs"].to_numpy()) for d in rl)
    assert _close(gspo_out.metrics["loss:sum"], -tokens)

    # checkpoints: tinker:// paths of the same checkpoints pytrio calls trio://
    state = tc.save_state("st1").result().path
    sampler_path = tc.save_weights_for_sampler("sw1", ttl_seconds=7200, user_metadata={"step": "3"}).result().path
    run_id = tt.ParsedCheckpointTinkerPath.from_tinker_path(state).training_run_id
    assert state == f"tinker://{run_id}/weights/st1"
    assert sampler_path == f"tinker://{run_id}/sampler_weights/sw1"
    trained = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]

    # sampling: the sampler's logprobs are compute_logprobs of the same tokens
    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = tt.ModelInput.from_ints(rows[0][0][:6])
    out = sc.sample(prompt, num_samples=2, sampling_params=tt.SamplingParams(max_tokens=6, seed=7)).result()
    assert len(out.sequences) == 2
    for seq in out.sequences:
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens) > 0
        lp = sc.compute_logprobs(tt.ModelInput.from_ints(prompt.to_ints() + list(seq.tokens))).result()
        assert lp[0] is None
        np.testing.assert_allclose(lp[prompt.length:], seq.logprobs, atol=1e-4)
    from_path = service.create_sampling_client(model_path=sampler_path).result()
    greedy = from_path.sample(prompt, 1, tt.SamplingParams(max_tokens=4, temperature=0.0, stop=["\n\n"])).result()
    assert greedy.sequences[0].stop_reason in ("stop", "length")
    base = service.create_sampling_client(base_model=TINY).result()
    assert len(base.sample(prompt, 1, tt.SamplingParams(max_tokens=2)).result().sequences[0].tokens) <= 2

    # the REST client: runs and checkpoints, listed and described
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert set(listed) == {"weights/st1", "sampler_weights/sw1"}  # the unnamed sampler save is not listed
    ttl = listed["sampler_weights/sw1"]
    assert (ttl.expires_at - ttl.time).total_seconds() == 7200 and ttl.user_metadata == {"step": "3"}
    assert listed["weights/st1"].expires_at is None
    rest.set_checkpoint_ttl_from_tinker_path(state, 3600).result()
    assert rest.list_checkpoints(run_id).result().checkpoints[0].expires_at is not None
    rest.set_checkpoint_ttl_from_tinker_path(state, None).result()
    assert rest.list_checkpoints(run_id).result().checkpoints[0].expires_at is None
    assert state in {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
    run = rest.get_training_run(run_id).result()
    assert run.base_model == TINY and run.lora_rank == 8 and run.user_metadata == {"renderer_name": "role_colon"}
    assert rest.get_training_run_by_tinker_path(state).result().training_run_id == run_id
    assert run_id in {r.training_run_id for r in rest.list_training_runs().result().training_runs}
    assert rest.get_weights_info_by_tinker_path(state).result().lora_rank == 8

    # loading: a new client from the state, with and without the optimizer, and load_state
    restored = service.create_training_client_from_state(state).result()
    assert _close(restored.forward(data, "cross_entropy").result().metrics["loss:sum"], trained)
    with_optim = service.create_training_client_from_state_with_optimizer(state).result()
    with_optim.optim_step(tt.AdamParams(**ADAM)).result()
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(tt.AdamParams(**ADAM)).result()
    tc.load_state(state).result()
    assert _close(tc.forward(data, "cross_entropy").result().metrics["loss:sum"], trained)

    # a state of another rank replaces the run's adapter: the run reports the new rank, and
    # each checkpoint its own
    small = service.create_lora_training_client(base_model=TINY, rank=4)
    small_state = small.save_state("r4").result().path
    tc.load_state(small_state).result()
    assert rest.get_training_run(run_id).result().lora_rank == 4  # (tinker's get_info() is the client's memo)
    assert rest.get_weights_info_by_tinker_path(small_state).result().lora_rank == 4
    assert rest.get_weights_info_by_tinker_path(state).result().lora_rank == 8  # saved at rank 8
    sampler_info = rest.get_weights_info_by_tinker_path(sampler_path).result()
    assert (sampler_info.lora_rank, sampler_info.train_mlp, sampler_info.train_attn) == (8, True, True)

    # deleting a checkpoint
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    ids = {c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert "sampler_weights/sw1" not in ids and "weights/st1" in ids
