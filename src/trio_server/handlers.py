"""Execute a scheduled batch on an engine: wire types in, outcomes out.

The only module that translates between wire types (pytrio.types) and the engine's
dataclasses, and it reaches the engine only through the ``Engine`` protocol. Each item
of a batch succeeds or fails on its own: a bad datum fails only its own request, and
no state changes for it. ``execute`` returns the outcomes; the worker resolves them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal, cast

import pydantic

from pytrio import types as t
from trio_engine import (
    AdamConfig,
    CheckpointWriteError,
    Example,
    ForwardJob,
    ForwardResult,
    LoraConfig,
    SampleRequest,
    SampleResult,
    SamplingConfig,
    merge_results,
)

from . import checkpoints as ckpt
from .engine import Engine, Failure, SampleJob, failure_from
from .errors import HostRestarted, ServiceError, check_quota
from .metrics import StepTotals
from .scheduler import WorkItem, tokens
from .splitting import Split, in_whole_request, split_of
from .store import Store, later, now
from .store import checkpoints as checkpoints_table
from .store import runs as runs_table
from .store import samplers as samplers_table

log = logging.getLogger("trio.server")

StopReason = Literal["stop", "length"]
STATUS = {"validation": 400, "not_found": 404, "server": 500}


@dataclass
class Context:
    """What a batch runs against: one base model's engine, and the service's records."""

    base_model: str
    engine: Engine
    store: Store
    data_dir: Path
    ephemeral_per_run: int = 8  # unnamed sampler weights a run keeps (Limits.ephemeral_samplers_per_run)
    checkpoint_bytes_per_user: int | None = None  # Limits.max_checkpoint_bytes_per_user
    # run id -> the sums of its forming step (None: a call of it could not be counted)
    steps: dict[str, StepTotals | None] = field(default_factory=dict)
    # run id -> forward_backward calls done since its last step (or load): an optim_step
    # that finds no gradients after some lost them with a restarted model host
    unstepped: Counter[str] = field(default_factory=Counter)
    # run id -> of those, the calls whose gradients a restart (of the service or its model host) lost
    lost: Counter[str] = field(default_factory=Counter)

    def checkpoint_folder(self, path: str) -> str:
        return str(ckpt.folder(self.data_dir, *ckpt.parse_path(path)))

    def checkpoint_to_load(self, path: str) -> str:
        """The folder of a checkpoint a call loads now. It was there when the call was
        accepted; deleted or expired since, it is a 404 naming the path (a load ran on an
        expired one, and a deleted one's error named the server's folder)."""
        row = self.store.get(checkpoints_table, path=path)
        if row is None or expired(row):
            raise ServiceError("not_found", f"checkpoint {path!r} no longer exists (deleted or expired since this "
                               "call was accepted)", 404)
        return self.checkpoint_folder(path)


Result = tuple[pydantic.BaseModel | None, ServiceError | None]


def _load(ctx: Context) -> ServiceError | None:
    """Load the model if it is not; a model that fails to load fails its requests, not the worker."""
    _, error = _guard(ctx.engine.load)
    return ServiceError("server", f"loading {ctx.base_model}: {error.message}", 500) if error else None


def execute(ctx: Context, batch: list[WorkItem]) -> list[Result]:
    """Run one batch (one op; several items only for forward(_backward)); one result per item.
    Sampling does not come here: the worker runs it step by step through ``decode``."""
    started = time.monotonic()
    failed = _load(ctx)
    if failed:
        return [(None, failed)] * len(batch)
    if batch[0].op in ("forward", "forward_backward"):
        results = _forward(ctx, batch)
    else:
        results = [_guard(HANDLERS[batch[0].op], ctx, batch[0])]
    elapsed = (time.monotonic() - started) * 1000
    for item, outcome in zip(batch, results):
        if isinstance(outcome[0], t.ForwardBackwardOutput):
            outcome[0].elapsed_time = elapsed
        log_outcome(item, outcome, elapsed)
    return results


def _guard(fn: Callable[..., Any], *args: Any) -> tuple[Any, ServiceError | None]:
    """Run one handler, turning engine exceptions into client-facing errors."""
    try:
        return fn(*args), None
    except ServiceError as exc:
        return None, exc
    except Exception as exc:
        failure = failure_from(exc)
        if failure.category == "server":
            log.exception("request failed")
        return None, _service_error(failure)


def _service_error(failure: Failure) -> ServiceError:
    return ServiceError(failure.category, failure.message, STATUS.get(failure.category, 500))


def _outcome(out: Any, wire: Callable[[Any], pydantic.BaseModel]) -> Result:
    if isinstance(out, Failure):
        return None, _service_error(out)
    return wire(out), None


# -- batched: forward / forward_backward, sample -------------------------------------


def _forward(ctx: Context, batch: list[WorkItem]) -> list[Result]:
    results: dict[int, Result] = {}
    jobs: dict[int, ForwardJob] = {}
    for k, item in enumerate(batch):
        _, error = _hold_grads_if_first_part(ctx, item)
        if error:
            results[k] = (None, error)
            continue
        req: t.ForwardRequest = item.request
        examples = [Example(d.model_input.to_ints(), {n: v.data for n, v in d.loss_fn_inputs.items()}) for d in req.data]
        jobs[k] = ForwardJob(req.model_id, examples, req.loss_fn, dict(req.loss_fn_config or {}))
    run = ctx.engine.forward_backward if batch[0].op == "forward_backward" else ctx.engine.forward
    outs, error = _guard(run, list(jobs.values())) if jobs else ([], None)
    if error:  # the whole pass failed: every job in it, with that error
        results.update({k: (None, error) for k in jobs})
        outs = []
        if isinstance(error, HostRestarted) and batch[0].op == "forward_backward":
            for k in jobs:  # cut short with the host: a call its run's next step must not go without
                ctx.unstepped[batch[k].request.model_id] += 1
    for k, out in zip(jobs, outs):
        item = batch[k]
        split = split_of(item)
        if split is not None:
            if isinstance(out, ForwardResult):
                split.results.append(out)  # merged, and counted in the step, once all parts are done
        elif batch[0].op == "forward_backward" and isinstance(out, ForwardResult):
            _count_in_step(ctx, item, out)  # forward trains nothing: no step's metrics
        results[k] = _outcome(out, _forward_output)
    return [results[k] for k in range(len(batch))]


def _hold_grads_if_first_part(ctx: Context, item: WorkItem) -> tuple[None, ServiceError | None]:
    """Before a split forward_backward's first part: keep the run's grads to go back to."""
    split = split_of(item)
    if split is None or split.index > 0 or not split.holds_grads:
        return None, None
    return _guard(ctx.engine.hold_grads, item.request_id, item.request.model_id)


def finish_split(ctx: Context, split: Split, error: ServiceError | None) -> Result:
    """The outcome of a request run in parts, once its last part is done or one failed.

    On failure the run's grads go back to how they were before the first part; else the
    held copy is freed and the parts' results merge into the request's."""
    item = split.whole
    if split.holds_grads:
        held, release_error = _guard(ctx.engine.release_grads, item.request_id, item.request.model_id, error is not None)
        if held is False and error is None:  # the earlier parts' gradients went with the host
            error = ServiceError("server", "the model host restarted while this request ran in parts; the "
                                 "gradients of its earlier parts were lost and the run's were dropped: the run's "
                                 "next optim_step is refused, then run the forward_backward calls since its last "
                                 "step again, this one with them", 500)
        if release_error and error is None:
            error = release_error
        elif release_error:
            log.error("request=%s run=%s: grads not restored after a failed part: %s", item.request_id,
                      item.run_id, release_error.message)
    if error is not None:
        return None, ServiceError(error.category, in_whole_request(error.message, split), error.status)
    merged = merge_results(split.results)
    if split.holds_grads:
        _count_in_step(ctx, item, merged)
    output = _forward_output(merged)
    output.elapsed_time = split.elapsed_ms
    return output, None


def _count_in_step(ctx: Context, item: WorkItem, out: ForwardResult) -> None:
    ctx.unstepped[item.request.model_id] += 1
    if not _record(item, _add_to_step, ctx, item, out):
        ctx.steps[item.request.model_id] = None  # its sums lack this call: not recorded


def _add_to_step(ctx: Context, item: WorkItem, out: ForwardResult) -> None:
    req: t.ForwardRequest = item.request
    totals = ctx.steps.setdefault(req.model_id, StepTotals())
    if totals is not None:
        totals.add(req.data, out.metrics, req.custom_metrics)


def _record(item: WorkItem, fn: Callable[..., None], *args: Any) -> bool:
    """Record metrics; never fail the request that produced them. False if it failed."""
    try:
        fn(*args)
        return True
    except Exception:
        log.exception("request=%s run=%s: recording step metrics failed; the request goes on",
                      item.request_id, item.run_id)
        return False


def _forward_output(out: ForwardResult) -> t.ForwardBackwardOutput:
    per_datum = [
        {"logprobs": t.TensorData(data=lp), "elementwise_loss": t.TensorData(data=loss)}
        for lp, loss in zip(out.logprobs, out.elementwise_loss)
    ]
    return t.ForwardBackwardOutput(loss_fn_outputs=per_datum, metrics=out.metrics)


def _sample_job(ctx: Context, item: WorkItem) -> SampleJob:
    req: t.SampleRequest = item.request
    p = req.sampling_params
    stops = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
    config = SamplingConfig(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
        ignore_eos=p.ignore_eos or p.stop == [],  # stop=[]: no stop at all, not even EOS
        stop_strings=tuple(s for s in stops if isinstance(s, str)),
        stop_token_ids=tuple(s for s in stops if isinstance(s, int)),
    )
    request = SampleRequest(None, req.prompt.to_ints(), req.num_samples, config, req.include_prompt_logprobs,
                            cache_scope=item.user_id)  # no user reuses another's KV (sampler.PrefixCache)
    return SampleJob(_sampler_weights(ctx, item.context["sampler"]), request)


def decode(ctx: Context, admit: list[WorkItem], live: list[str], max_steps: int = 1) -> dict[str, Result]:
    """Continuous batching: add ``admit`` to the engine's running decode batch (which holds
    the requests ``live``) and run ``max_steps`` steps; the outcome of every request that
    finished or failed, by request id. If the engine call itself fails (its process died),
    or the engine no longer holds a request, those requests fail with a server error."""
    results: dict[str, Result] = {}
    jobs: dict[str, SampleJob] = {}
    if admit and (failed := _load(ctx)):
        return dict.fromkeys([*live, *(i.request_id for i in admit)], (None, failed))
    for item in admit:
        job, error = _guard(_sample_job, ctx, item)
        if error:
            results[item.request_id] = (None, error)
        else:
            jobs[item.request_id] = job
    if not jobs and not live:
        return results
    update, error = _guard(ctx.engine.decode, jobs, max_steps)
    if error:
        return results | dict.fromkeys([*live, *jobs], (None, error))
    results.update((rid, _outcome(out, _sample_response)) for rid, out in update.finished.items())
    # A request the engine neither finished nor still holds was lost with its process (a Ray
    # actor that restarted between two steps comes back with an empty batch).
    lost = ServiceError("server", "the model host restarted while this request was decoding; submit it again", 500)
    still = set(update.decoding)
    results.update((rid, (None, lost)) for rid in [*live, *jobs] if rid not in results and rid not in still)
    return results


def log_outcome(item: WorkItem, result: Result, elapsed_ms: float) -> None:
    error = result[1]
    log.info("request=%s run=%s op=%s ms=%.0f tokens=%d status=%s", item.request_id, item.run_id or "-",
             item.op, elapsed_ms, tokens(item), "failed" if error else "done")
    if error is not None and error.category == "server":  # ours, not the caller's: find it by request id
        log.error("request=%s run=%s op=%s server error: %s", item.request_id, item.run_id or "-", item.op,
                  error.message)


def _sample_response(out: SampleResult) -> t.SampleResponse:
    seqs = [t.SampledSequence(tokens=s.tokens, logprobs=s.logprobs, text=s.text,
                              stop_reason=cast(StopReason, s.stop_reason)) for s in out.sequences]
    return t.SampleResponse(sequences=seqs, prompt_logprobs=out.prompt_logprobs,
                            prompt_cache_hit_tokens=out.cached_prompt_tokens)


def _sampler_weights(ctx: Context, sampler: dict) -> str | None:
    """The folder of a sampler's weights; None for a base-model sampler."""
    path = sampler["model_path"]
    return None if path is None else ctx.checkpoint_folder(path)


# -- everything else: one request at a time -------------------------------------------


def _create_model(ctx: Context, item: WorkItem) -> t.CreateModelResponse:
    req: t.CreateModelRequest = item.request
    cfg = req.lora_config
    # No seed given: 0, so the same program gives the same run, in-process or on any server.
    seed = cfg.seed if cfg.seed is not None else 0
    config = LoraConfig(rank=cfg.rank, seed=seed, train_attn=cfg.train_attn, train_mlp=cfg.train_mlp,
                        train_unembed=cfg.train_unembed)
    run_id = item.context["run_id"]
    ctx.engine.create_adapter(run_id, config)
    _insert_run(ctx, item, run_id, config)
    return t.CreateModelResponse(model_id=run_id, base_model=ctx.base_model)


def _create_model_from_state(ctx: Context, item: WorkItem) -> t.CreateModelResponse:
    req: t.CreateModelFromStateRequest = item.request
    run_id = item.context["run_id"]
    config = ctx.engine.load_state(run_id, ctx.checkpoint_to_load(req.path), req.with_optimizer)
    _insert_run(ctx, item, run_id, config, step=ctx.engine.adapter_info(run_id).step)
    return t.CreateModelResponse(model_id=run_id, base_model=ctx.base_model)


def _insert_run(ctx: Context, item: WorkItem, run_id: str, config: LoraConfig, step: int = 0) -> None:
    """``step``: the optimizer's (a run made from a state with its optimizer goes on from its step)."""
    ctx.store.insert(runs_table, run_id=run_id, user_id=item.user_id, base_model=ctx.base_model,
                     lora_config=json.dumps(asdict(config)), created_at=now(), next_seq=0, step=step)


def _optim_step(ctx: Context, item: WorkItem) -> t.OptimStepResponse:
    req: t.OptimStepRequest = item.request
    if lost := ctx.lost.get(req.model_id, 0):
        _refuse_part_of_a_batch(ctx, req.model_id, lost)
    # popped before the host is asked: a restart it finds now (HostWorker._host_restarted)
    # leaves this run unmarked, its calls refused once below, not again at the next step
    calls = ctx.unstepped.pop(req.model_id, 0)
    try:
        before = ctx.engine.adapter_info(req.model_id).step if calls else None  # the host's own count
        metrics, write = ctx.engine.optim_step(req.model_id, AdamConfig(**req.adam_params.model_dump()))
    except Exception:  # not stepped: the calls are still to step on (lost, if the host died in it)
        ctx.unstepped[req.model_id] += calls
        raise
    totals = ctx.steps.pop(req.model_id, None)
    if calls and int(metrics["step"]) == before:  # the host had no gradients
        raise _lost_calls(calls, "its model host restarted")
    # The step's number is stored with its answer, in one transaction (ServiceCore._store_outcome):
    # a crash between the two would leave one without the other, and recovery tells a step
    # that landed from one that did not by the snapshot being ahead of the stored step.
    item.context["step"] = int(metrics["step"])
    store = partial(_store_step_metrics, ctx, item, req.model_id, metrics, totals)
    if write is None:
        store()
    else:  # stored once the step is on disk (worker.Answers): until then a crash undoes it
        item.context["durable"], item.context["when_kept"] = write, store
    return t.OptimStepResponse(metrics=metrics)


def _refuse_part_of_a_batch(ctx: Context, run_id: str, lost: int) -> None:
    """The first optim_step after a restart (of the service, or of its model host: a Ray
    actor) lost the gradients of ``lost`` calls: refused, and the gradients of calls made
    since (a failed call resubmitted, the next batch) are dropped too. Stepping on them,
    the run would train on part of a batch and say nothing."""
    ctx.engine.drop_grads(run_id)  # first: a host dying in it leaves the counts for the next try's refusal
    ctx.lost.pop(run_id, None)
    calls = ctx.unstepped.pop(run_id, 0)
    ctx.steps.pop(run_id, None)
    since = calls - lost
    dropped = f"; the {since} made since are dropped with them, not to step on part of a batch" if since > 0 else ""
    raise _lost_calls(calls, f"the service or its model host restarted ({lost} made before it{dropped})")


def _lost_calls(calls: int, when: str) -> ServiceError:
    """The refusal of an optim_step whose run lost the gradients of its ``calls``."""
    return ServiceError("server", f"optim_step: the gradients of the {calls} forward_backward call(s) since the run's "
                        f"last step were lost when {when}; nothing changed. Run them again, then optim_step", 500)


def _store_step_metrics(ctx: Context, item: WorkItem, run_id: str, optim_metrics: dict[str, float],
                        totals: StepTotals | None) -> None:
    """Store the metrics of the step optim_step made, unless no step was made (with no
    gradients accumulated optim_step changes nothing, not even the step number) or a call
    of the step could not be counted (partial sums would mislead)."""
    if totals is not None:
        _record(item, ctx.store.put_metrics, run_id, int(optim_metrics["step"]), "service", totals.finish(optim_metrics))


def _save_weights(ctx: Context, item: WorkItem) -> t.SaveWeightsResponse:
    """Save a checkpoint; a used name is refused, before anything is written, unless
    ``overwrite`` (which replaces its TTL and metadata too) or that checkpoint has expired.
    Ephemeral weights are named by their request's seq (so they sort). Every save also
    removes the checkpoints whose TTL has run out (and the archives made to download them),
    so a run that saves with TTLs keeps its disk bounded."""
    req: t.SaveWeightsRequest = item.request
    # checked at submit too, where the saves queued before this one are not yet counted
    check_checkpoint_bytes(ctx.store, item.user_id, req.kind, ctx.checkpoint_bytes_per_user)
    name = req.name or f"{item.seq:010d}"
    path = ckpt.make_path(req.model_id, req.kind, name)
    with _writing(path):  # no sweep or delete removes this path until its record is written
        existing = ctx.store.get(checkpoints_table, path=path)
        if existing is not None and not req.overwrite and not expired(existing):
            raise ServiceError("validation", f"name: checkpoint {path!r} already exists; pass overwrite=True to "
                               "replace it, or use another name", 409)
        folder = ctx.checkpoint_folder(path)
        try:
            if req.kind == "weights":
                ctx.engine.save_state(req.model_id, folder)
            else:  # the engine frees a sampler copy it had loaded from this folder
                ctx.engine.save_sampler_weights(req.model_id, folder)
        except CheckpointWriteError as exc:  # disk full, read-only...: ours to fix, not the caller's
            raise ServiceError("server", f"saving checkpoint {path!r} failed: {exc.reason}; the previous "
                               "checkpoint of this name, if any, is unchanged", 500) from exc
        created = now()
        ctx.store.replace(checkpoints_table, path=path, user_id=item.user_id, run_id=req.model_id, kind=req.kind,
                          name=name, created_at=created, size_bytes=ckpt.folder_size(Path(folder)),
                          expires_at=None if req.ttl_seconds is None else later(created, req.ttl_seconds),
                          user_metadata=None if req.user_metadata is None else json.dumps(req.user_metadata))
    if req.kind == "ephemeral":
        _expire_ephemeral(ctx, req.model_id)
    remove_expired_checkpoints(ctx.store, ctx.data_dir)
    return t.SaveWeightsResponse(path=path)


def check_checkpoint_bytes(store: Store, user_id: str, kind: str, limit: int | None) -> None:
    """A 403 when the user's checkpoints reached ``limit`` bytes (so the last save allowed
    may pass it by its own size). Ephemeral sampler weights are never refused (a run keeps
    its newest few); expired checkpoints take no room (every save removes them)."""
    if kind == "ephemeral" or limit is None:
        return
    used = sum(r["size_bytes"] or 0 for r in store.select(checkpoints_table, user_id=user_id) if not expired(r))
    check_quota("max_checkpoint_bytes_per_user", "checkpoint bytes", used, limit,
                "delete checkpoints, or ask the operator for more")


def _expire_ephemeral(ctx: Context, run_id: str) -> None:
    """Keep a run's newest ``ephemeral_per_run`` unnamed sampler weights; a sampler on an
    older one fails with not_found (its folder is gone)."""
    rows = sorted(ctx.store.select(checkpoints_table, run_id=run_id, kind="ephemeral"), key=lambda r: r["name"])
    for row in rows[:-ctx.ephemeral_per_run]:
        remove_checkpoint(ctx.store, ctx.data_dir, row)


# Checkpoint paths being written, and the lock over that set and every removal (a record and
# its folder). A save holds no lock while it writes, which may take long; it holds its path
# in WRITING, which a sweep skips and a delete refuses: a sweep that read a row as expired
# must not remove the folder an overwrite of that path has just written.
CHECKPOINT_FILES = threading.Lock()
WRITING: set[str] = set()


@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
    with CHECKPOINT_FILES:
        if path in WRITING:
            raise ServiceError("validation", f"checkpoint {path!r} is being saved by another request; try again "
                               "once it is done", 409)
        WRITING.add(path)
    try:
        yield
    finally:
        with CHECKPOINT_FILES:
            WRITING.discard(path)


def expired(row: dict) -> bool:
    """Whether a checkpoints row's TTL has run out."""
    return row["expires_at"] is not None and row["expires_at"] <= now()


def remove_expired_checkpoints(store: Store, data_dir: Path) -> None:
    """Remove every checkpoint whose ``expires_at`` has passed (any user's: TTLs are kept by
    the service, as the tinker SDK's ``ttl_seconds`` expects)."""
    for row in store.expired_checkpoints(now()):
        with CHECKPOINT_FILES:
            if row["path"] in WRITING or store.get(checkpoints_table, path=row["path"]) != row:  # saved again
                continue
            log.info("checkpoint %s expired at %s: removed", row["path"], row["expires_at"])
            _remove(store, data_dir, row)


def remove_checkpoint(store: Store, data_dir: Path, row: dict) -> None:
    """Its record, then its folder: a sampler on it fails at its next use. A checkpoint
    being saved again meanwhile is not removed (409)."""
    with CHECKPOINT_FILES:
        if row["path"] in WRITING:
            raise ServiceError("validation", f"checkpoint {row['path']!r} is being saved; delete it once that is "
                               "done", 409)
        _remove(store, data_dir, row)


def _remove(store: Store, data_dir: Path, row: dict) -> None:
    store.delete(checkpoints_table, path=row["path"])
    shutil.rmtree(ckpt.folder(data_dir, row["run_id"], row["kind"], row["name"]), ignore_errors=True)
    ckpt.archive_file(data_dir / "archives", row["run_id"], row["kind"], row["name"]).unlink(missing_ok=True)


def set_expiry(store: Store, path: str, expires_at: str | None) -> bool:
    """Set a checkpoint's ``expires_at``, unless a sweep removed it meanwhile; whether it was set."""
    with CHECKPOINT_FILES:
        if store.get(checkpoints_table, path=path) is None:
            return False
        store.update(checkpoints_table, "path", path, expires_at=expires_at)
        return True


def _load_weights(ctx: Context, item: WorkItem) -> t.LoadWeightsResponse:
    req: t.LoadWeightsRequest = item.request
    # The checkpoint's adapter replaces the run's, its rank and targets too: the run reports them.
    config = ctx.engine.load_state(req.model_id, ctx.checkpoint_to_load(req.path), req.with_optimizer)
    ctx.steps.pop(req.model_id, None)  # the loaded weights come without the pending gradients
    ctx.unstepped.pop(req.model_id, None)
    ctx.lost.pop(req.model_id, None)
    ctx.store.update(runs_table, "run_id", req.model_id, step=ctx.engine.adapter_info(req.model_id).step,
                     lora_config=json.dumps(asdict(config)))
    return t.LoadWeightsResponse(path=req.path)


def _get_info(ctx: Context, item: WorkItem) -> t.GetInfoResponse:
    req: t.GetInfoRequest = item.request
    info = ctx.engine.adapter_info(req.model_id)
    c = info.config
    return t.GetInfoResponse(model_id=req.model_id, base_model=ctx.base_model, lora_rank=c.rank,
                             train_attn=c.train_attn, train_mlp=c.train_mlp, train_unembed=c.train_unembed,
                             step=info.step, model_info=ctx.engine.load())


def _create_sampler(ctx: Context, item: WorkItem) -> t.CreateSamplerResponse:
    req: t.CreateSamplerRequest = item.request
    # load now, so a bad checkpoint fails here rather than at the first sample
    ctx.engine.prepare_sampler(None if req.model_path is None else ctx.checkpoint_to_load(req.model_path))
    sampler_id = "sampler-" + secrets.token_hex(8)
    ctx.store.insert(samplers_table, sampler_id=sampler_id, user_id=item.user_id, base_model=ctx.base_model,
                     model_path=req.model_path, created_at=now())
    return t.CreateSamplerResponse(sampler_id=sampler_id, base_model=ctx.base_model, model_path=req.model_path)


def _compute_logprobs(ctx: Context, item: WorkItem) -> t.ComputeLogprobsResponse:
    req: t.ComputeLogprobsRequest = item.request
    weights = _sampler_weights(ctx, item.context["sampler"])
    return t.ComputeLogprobsResponse(logprobs=ctx.engine.compute_logprobs(weights, req.prompt.to_ints()))


def _rejected(ctx: Context, item: WorkItem) -> None:
    raise item.context["error"]


HANDLERS: dict[str, Callable[[Context, WorkItem], pydantic.BaseModel | None]] = {
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


