"""Execute a scheduled batch on a worker's ModelHost and resolve each item's future.

The only module that translates between wire types (pytrio.types) and engine types.
Each item is validated on its own before a batch runs, so one user's bad datum fails
only that user's request and changes no state; the others run together.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TypeVar

import pydantic

from pytrio import types as t

from . import checkpoints as ckpt
from .core import ServiceError
from .scheduler import WorkItem
from .store import checkpoints as checkpoints_table
from .store import now
from .store import runs as runs_table
from .store import samplers as samplers_table

if TYPE_CHECKING:
    from .core import HostWorker

log = logging.getLogger("trio.server")


def execute(worker: HostWorker, batch: list[WorkItem]) -> None:
    started = time.monotonic()
    try:
        host = worker.host()
    except Exception as exc:  # a model that fails to load fails its requests, not the worker
        for item in batch:
            worker.core.resolve(item, None, ServiceError("server", f"loading {worker.base_model}: {exc}", 500))
        return
    for item in batch:
        if item.run_id is not None:
            _, error = _guard(worker.ensure_resident, item.run_id)
            if error:
                log.error("could not restore run %s: %s", item.run_id, error.message)
    if batch[0].op in ("forward", "forward_backward"):
        results = _forward(host, batch)
    elif batch[0].op == "sample":
        results = _sample(worker, host, batch)
    else:
        results = [_single(worker, host, batch[0])]
    elapsed = (time.monotonic() - started) * 1000
    for item, (result, error) in zip(batch, results):
        if isinstance(result, t.ForwardBackwardOutput):
            result.elapsed_time = elapsed
        worker.core.resolve(item, result, error)
        log.info("request=%s run=%s op=%s ms=%.0f tokens=%d status=%s", item.request_id, item.run_id or "-",
                 item.op, elapsed, _tokens(item), "failed" if error else "done")


T = TypeVar("T")
Result = tuple[pydantic.BaseModel | None, ServiceError | None]


def _guard(fn: Callable[..., T], *args: Any) -> tuple[T | None, ServiceError | None]:
    """Run one handler, turning engine exceptions into client-facing errors."""
    from trio_engine import AdapterNotFoundError

    try:
        return fn(*args), None
    except ServiceError as exc:
        return None, exc
    except AdapterNotFoundError:
        return None, ServiceError("not_found", "the run's weights are not loaded on this server "
                                  "(it restarted); create a client from a saved checkpoint", 404)
    except (ValueError, FileNotFoundError) as exc:
        return None, ServiceError("validation", str(exc))
    except Exception as exc:
        log.exception("request failed")
        return None, ServiceError("server", f"{type(exc).__name__}: {exc}", 500)


# -- forward / forward_backward ---------------------------------------------------


def _forward(host: Any, batch: list[WorkItem]) -> list[Result]:
    from trio_engine import Example, ForwardJob

    jobs: dict[int, Any] = {}
    results: list[Result] = [(None, None)] * len(batch)
    for k, item in enumerate(batch):
        req: t.ForwardRequest = item.request
        examples = [Example(d.model_input.to_ints(), {n: v.data for n, v in d.loss_fn_inputs.items()}) for d in req.data]
        job = ForwardJob(req.model_id, examples, req.loss_fn, dict(req.loss_fn_config or {}))
        _, error = _guard(host.validate_job, job)
        if error:
            results[k] = (None, error)
        else:
            jobs[k] = job
    if jobs:
        fn = host.forward_backward if batch[0].op == "forward_backward" else host.forward
        outs, error = _guard(fn, list(jobs.values()))
        for n, k in enumerate(jobs):
            results[k] = (None, error) if outs is None else (_forward_output(outs[n]), None)
    return results


def _forward_output(out: Any) -> t.ForwardBackwardOutput:
    per_datum = [
        {"logprobs": t.TensorData(data=lp), "elementwise_loss": t.TensorData(data=loss)}
        for lp, loss in zip(out.logprobs, out.elementwise_loss)
    ]
    return t.ForwardBackwardOutput(loss_fn_outputs=per_datum, metrics=out.metrics)


# -- sampling -----------------------------------------------------------------------


def _sample(worker: HostWorker, host: Any, batch: list[WorkItem]) -> list[Result]:
    from trio_engine import SampleRequest, SamplingConfig
    from trio_engine.sampler import validate_request

    requests: dict[int, Any] = {}
    results: list[Result] = [(None, None)] * len(batch)
    for k, item in enumerate(batch):
        req: t.SampleRequest = item.request
        p = req.sampling_params
        stops = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
        config = SamplingConfig(
            max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
            stop_strings=tuple(s for s in stops if isinstance(s, str)),
            stop_token_ids=tuple(s for s in stops if isinstance(s, int)),
        )
        adapter, error = _guard(_sampler_adapter, worker, host, item.context["sampler"])
        engine_req = SampleRequest(adapter, req.prompt.to_ints(), req.num_samples, config, req.include_prompt_logprobs)
        if error is None:
            _, error = _guard(validate_request, engine_req, 0, host.vocab_size, host.max_seq_len)
        if error:
            error.message = error.message.removeprefix("requests[0].")
            results[k] = (None, error)
        else:
            requests[k] = engine_req
    if requests:
        outs, error = _guard(host.sample, list(requests.values()))
        for n, k in enumerate(requests):
            results[k] = (None, error) if outs is None else (_sample_response(outs[n]), None)
    return results


def _sample_response(out: Any) -> t.SampleResponse:
    seqs = [t.SampledSequence(tokens=s.tokens, logprobs=s.logprobs, text=s.text, stop_reason=s.stop_reason)
            for s in out.sequences]
    return t.SampleResponse(sequences=seqs, prompt_logprobs=out.prompt_logprobs)


def _sampler_adapter(worker: HostWorker, host: Any, sampler: dict) -> str | None:
    """The host adapter serving a sampler: None for a base model, else its weights (LRU)."""
    path = sampler["model_path"]
    if path is None:
        return None
    cache = worker.sampler_adapters
    if path in cache:
        cache.move_to_end(path)
        return cache[path]
    run_id, kind, name = ckpt.parse_path(path)
    folder = worker.core.checkpoint_dir(run_id, kind, name)
    if not folder.exists():
        raise ServiceError("not_found", f"checkpoint {path!r} no longer exists", 404)
    adapter_id = "sampler-" + secrets.token_hex(6)
    if kind == "sampler_weights":
        host.load_sampler_weights(adapter_id, str(folder))
    else:
        host.load_state(adapter_id, str(folder), with_optimizer=False)
    cache[path] = adapter_id
    while len(cache) > worker.core.limits.max_sampler_adapters:
        _, evicted = cache.popitem(last=False)
        host.delete_adapter(evicted)
    return adapter_id


# -- everything else: one request at a time -------------------------------------------


def _single(worker: HostWorker, host: Any, item: WorkItem) -> Result:
    handler = HANDLERS[item.op]
    return _guard(handler, worker, host, item)


def _create_model(worker: HostWorker, host: Any, item: WorkItem) -> t.CreateModelResponse:
    from trio_engine import LoraConfig

    req: t.CreateModelRequest = item.request
    cfg = req.lora_config
    seed = cfg.seed if cfg.seed is not None else secrets.randbits(31)
    config = LoraConfig(rank=cfg.rank, seed=seed, train_attn=cfg.train_attn, train_mlp=cfg.train_mlp,
                        train_unembed=cfg.train_unembed)
    run_id = item.context["run_id"]
    host.create_adapter(run_id, config)
    worker.touch(run_id)
    _insert_run(worker, item, run_id, req.base_model, config)
    return t.CreateModelResponse(model_id=run_id, base_model=req.base_model)


def _create_model_from_state(worker: HostWorker, host: Any, item: WorkItem) -> t.CreateModelResponse:
    req: t.CreateModelFromStateRequest = item.request
    row = item.context["checkpoint"]
    run_id = item.context["run_id"]
    host.load_state(run_id, str(worker.core.checkpoint_dir(row["run_id"], "weights", row["name"])), req.with_optimizer)
    worker.touch(run_id)
    _insert_run(worker, item, run_id, worker.base_model, host.adapters[run_id].config)
    return t.CreateModelResponse(model_id=run_id, base_model=worker.base_model)


def _insert_run(worker: HostWorker, item: WorkItem, run_id: str, base_model: str, config: Any) -> None:
    worker.core.store.insert(runs_table, run_id=run_id, user_id=item.user_id, base_model=base_model,
                             lora_config=json.dumps(asdict(config)), created_at=now(), next_seq=0, step=0)


def _optim_step(worker: HostWorker, host: Any, item: WorkItem) -> t.OptimStepResponse:
    from trio_engine import AdamConfig

    req: t.OptimStepRequest = item.request
    metrics = host.optim_step(req.model_id, AdamConfig(**req.adam_params.model_dump()))
    worker.core.store.update(runs_table, "run_id", req.model_id, step=int(metrics["step"]))
    return t.OptimStepResponse(metrics=metrics)


def _save_weights(worker: HostWorker, host: Any, item: WorkItem) -> t.SaveWeightsResponse:
    req: t.SaveWeightsRequest = item.request
    folder = worker.core.checkpoint_dir(req.model_id, req.kind, req.name)
    if req.kind == "weights":
        host.save_state(req.model_id, str(folder))
    else:
        host.save_sampler_weights(req.model_id, str(folder))
    path = ckpt.make_path(req.model_id, req.kind, req.name)
    store = worker.core.store
    store.delete(checkpoints_table, path=path)  # saving under a used name replaces it
    store.insert(checkpoints_table, path=path, user_id=item.user_id, run_id=req.model_id, kind=req.kind,
                 name=req.name, created_at=now(), size_bytes=ckpt.folder_size(folder))
    worker.sampler_adapters.pop(path, None)  # a sampler made from the old weights reloads
    return t.SaveWeightsResponse(path=path)


def _load_weights(worker: HostWorker, host: Any, item: WorkItem) -> t.LoadWeightsResponse:
    req: t.LoadWeightsRequest = item.request
    row = item.context["checkpoint"]
    host.load_state(req.model_id, str(worker.core.checkpoint_dir(row["run_id"], "weights", row["name"])), req.with_optimizer)
    return t.LoadWeightsResponse(path=req.path)


def _get_info(worker: HostWorker, host: Any, item: WorkItem) -> t.GetInfoResponse:
    req: t.GetInfoRequest = item.request
    adapter = host.adapters.get(req.model_id)
    if adapter is None:
        raise ServiceError("not_found", f"training run {req.model_id!r} has no weights loaded", 404)
    c = adapter.config
    return t.GetInfoResponse(model_id=req.model_id, base_model=worker.base_model, lora_rank=c.rank,
                             train_attn=c.train_attn, train_mlp=c.train_mlp, train_unembed=c.train_unembed,
                             step=adapter.optim.step, model_info=host.info())


def _create_sampler(worker: HostWorker, host: Any, item: WorkItem) -> t.CreateSamplerResponse:
    req: t.CreateSamplerRequest = item.request
    sampler_id = "sampler-" + secrets.token_hex(8)
    worker.core.store.insert(samplers_table, sampler_id=sampler_id, user_id=item.user_id, base_model=worker.base_model,
                             model_path=req.model_path, created_at=now())
    sampler = {"model_path": req.model_path}
    _sampler_adapter(worker, host, sampler)  # load now, so a bad checkpoint fails here
    return t.CreateSamplerResponse(sampler_id=sampler_id, base_model=worker.base_model, model_path=req.model_path)


def _compute_logprobs(worker: HostWorker, host: Any, item: WorkItem) -> t.ComputeLogprobsResponse:
    req: t.ComputeLogprobsRequest = item.request
    adapter = _sampler_adapter(worker, host, item.context["sampler"])
    return t.ComputeLogprobsResponse(logprobs=host.compute_logprobs(adapter, req.prompt.to_ints()))


def _rejected(worker: HostWorker, host: Any, item: WorkItem) -> None:
    raise item.context["error"]


HANDLERS = {
    "rejected": _rejected,
    "create_model": _create_model,
    "create_model_from_state": _create_model_from_state,
    "optim_step": _optim_step,
    "save_weights": _save_weights,
    "load_weights": _load_weights,
    "get_info": _get_info,
    "create_sampler": _create_sampler,
    "compute_logprobs": _compute_logprobs,
}


def _tokens(item: WorkItem) -> int:
    req = item.request
    if isinstance(req, t.ForwardRequest):
        return sum(d.model_input.length for d in req.data)
    if isinstance(req, t.SampleRequest):
        return req.prompt.length + req.num_samples * req.sampling_params.max_tokens
    return 0
