"""``RayEngine``: a base model's host in a Ray actor, on this machine or another node.

The actor holds a ``LocalEngine`` (the same code as the in-process default), so
co-batching, validation and snapshots behave identically; only the calls travel.
Arguments and results are the Engine protocol's pickled dataclasses, which Ray moves
through its object store (large ones are stored there rather than inlined); nothing
goes through JSON. Checkpoints and snapshots are written by the actor itself, to the
data dir, which every node must see at the same path (one machine, or shared storage).

Placement: on a cluster with GPUs (or with ``device`` cuda) each actor asks Ray for
``gpus`` of a GPU (one by default; a fraction lets small models share one), and Ray's
``CUDA_VISIBLE_DEVICES`` makes it the actor's ``cuda``. A model the cluster has no GPU
room left for is refused by name (``check_gpu_room``): its actor would wait for one
forever. A base model can be pinned to nodes that offer a custom resource
(``ray start --resources``).

Crashes: the actor restarts on its own (``max_restarts=-1``) with an empty model, and
each run comes back from its snapshot on its next request. A call that was running
when the actor died fails with a clear restart error, unless it only reads state:
those are retried on the restarted actor. A step whose snapshot the dead actor had not
yet written fails the same way when its answer is due (``RayEngine.durable``). A CUDA
error that leaves the GPU's context unusable (``engine.device_lost``) ends the actor's
process, so it restarts the same way instead of failing every later call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from trio_engine import AdamConfig, ForwardJob, ForwardResult, LoraConfig, SampleResult
from trio_engine.device import KEEP_FREED_ENV

from . import engine as local
from .engine import (
    AdapterInfo,
    DecodeUpdate,
    Durability,
    EngineSettings,
    Failure,
    LocalEngine,
    SampleJob,
    device_lost,
    written_before_it_died,
)
from .errors import HostRestarted, ServiceError

log = logging.getLogger("trio.server")

# Calls that change nothing on the host: safe to run again on a restarted actor.
RETRY_SAFE = {"load", "tokenizer_files", "forward", "adapter_info", "prepare_sampler", "sample",
              "compute_logprobs", "flush"}
RESTART_WAIT_SECONDS = 120.0
PLACEMENT_WAIT_SECONDS = 60.0  # an actor Ray has not placed by then has no node offering what it asks for
PLACEMENT_POLL_SECONDS = 5.0  # how often a call waiting on an actor looks whether it is placed
UNPLACED = ("PENDING_CREATION", "DEPENDENCIES_UNREADY")  # Ray's states of an actor waiting for a node
DURABLE_WAIT_SECONDS = 600.0  # a snapshot write, behind at most a few others (SnapshotWriter)


class NotRun:
    """``HostActor.call``'s answer to a caller that has not yet heard of the actor's restart."""


def _exit_to_restart(exc: BaseException) -> None:
    """A lost device context fails every later call of this process: end it, and Ray starts
    a new actor (``max_restarts``), whose runs come back from their snapshots. The call in
    flight fails as any call a restart interrupts does."""
    log.critical("the GPU's context is lost (%s: %s); exiting so that Ray restarts this host",
                 type(exc).__name__, exc)
    os._exit(1)


class HostActor:
    """The Ray actor: one LocalEngine, with torch using the node's cores."""

    def __init__(self, base_model: str, settings: EngineSettings, threads: int):
        import torch

        torch.set_num_threads(threads)
        local.on_device_lost = _exit_to_restart
        self.engine = LocalEngine(base_model, settings, {"ray_node_id": ray.get_runtime_context().get_node_id()})
        self.incarnation = secrets.token_hex(8)  # a restart (a new process) makes another

    def call(self, seen: str | None, method: str, *args: Any) -> tuple[str, Any]:
        """(this incarnation, the method's result). ``seen``: the incarnation the caller last
        heard from; another one means this actor restarted since, and the method is not run
        (``NotRun``): the caller first learns what the restart lost (``RayEngine._call``)."""
        if seen not in (None, self.incarnation):
            return self.incarnation, NotRun()
        try:
            return self.incarnation, getattr(self.engine, method)(*args)
        except Exception as exc:  # most reach failure_from in the engine; the rest pass here
            if device_lost(exc):
                _exit_to_restart(exc)
            raise

    @ray.method(concurrency_group="durable")
    def durable(self, write: Durability) -> None:
        """Its own thread: it waits for a snapshot write while ``call`` runs the next work."""
        self.engine.durable(write)


def connect(address: str | None) -> None:
    """Join the cluster at ``address`` (None: ``$RAY_ADDRESS``), or else start a local Ray
    instance of this process's own (once per process). Never a cluster found by chance:
    Ray's default joins any ``ray start --head`` this machine once registered, a stale
    one included (start-up then hung)."""
    if ray.is_initialized():
        return
    started = time.monotonic()
    address = address or os.environ.get("RAY_ADDRESS") or None
    # A local instance is for this machine only: keep it on the loopback interface.
    ray.init(address=address or "local", namespace="trio", include_dashboard=False, log_to_driver=True,
             configure_logging=False, _node_ip_address="127.0.0.1" if address is None else None)
    where = address or "a local instance"
    log.info("joined Ray (%s) in %.1f s: %s", where, time.monotonic() - started, ray.cluster_resources())


def check_cluster(device: str | None, placement: dict[str, str]) -> None:
    """Fail at start-up, not at the first request, when no node could host an actor."""
    resources = ray.cluster_resources()
    if wants_gpu(device) and resources.get("GPU", 0) < 1:
        raise ValueError(f"device: {device!r} needs a GPU, and this Ray cluster has none ({resources})")
    for model, resource in placement.items():
        if resources.get(resource, 0) <= 0:
            raise ValueError(f"ray_placement: no node of this Ray cluster offers the resource {resource!r} "
                             f"that {model!r} is pinned to (ray start --resources)")


def check_gpu_room(base_model: str, gpus: float, others: dict[str, float]) -> None:
    """Refuse a model whose actor's share of a GPU the cluster has no room for beside
    ``others`` (model -> its share): Ray would keep the actor pending, and its first call
    would wait for good. (The shares are checked against the cluster's total: a share
    split across nodes can still leave an actor pending.)"""
    total = ray.cluster_resources().get("GPU", 0)
    if sum(others.values()) + gpus <= total + 1e-9:
        return
    held = ", ".join(f"{model} {share:g}" for model, share in others.items()) or "none"
    # 400, as for a model the server does not have: a 5xx would have clients retry for minutes
    raise ServiceError("validation", f"base_model: {base_model!r} needs {gpus:g} of a GPU, and this Ray cluster's "
                       f"{total:g} GPUs are taken (by {held}); serve fewer models, add GPUs or lower "
                       "--ray-gpus-per-model", 400)


def _result(ref: Any, timeout: float | None = None) -> Any:
    """``ray.get``, re-raising the engine's own exception when it raised one."""
    try:
        return ray.get(ref, timeout=timeout)
    except RayTaskError as exc:
        cause = exc.cause
        raise (cause if isinstance(cause, Exception) else exc) from None


def actor_state(actor: Any) -> str | None:
    """Ray's state of ``actor`` (ALIVE, PENDING_CREATION, RESTARTING, ...), from the cluster's
    control store; None when it cannot say. (Ray's public state API needs its dashboard,
    which a local instance here runs without.)"""
    try:
        from ray._private.state import state

        return str(state.actor_table(actor._actor_id.hex())["State"])
    except Exception:
        return None


def wants_gpu(device: str | None) -> bool:
    spec = device or os.environ.get("TRIO_DEVICE") or "auto"
    if spec == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return spec.startswith("cuda")


class RayEngine:
    """The Engine protocol over one Ray actor.

    Args:
        base_model: the model its actor hosts.
        settings: as for LocalEngine; ``device`` cuda:N becomes the actor's GPU (which one
            is Ray's choice).
        address: a Ray cluster to join (None: start a local instance).
        resource: a custom Ray resource the actor needs (pins the model to nodes offering it).
        gpus: the share of a GPU the actor asks for when it runs on one.
    """

    def __init__(self, base_model: str, settings: EngineSettings, address: str | None = None,
                 resource: str | None = None, gpus: float = 1.0):
        connect(address)
        self.snapshot_dir = settings.snapshot_dir  # shared with the actor's node
        gpu = wants_gpu(settings.device)
        if gpu and settings.device and settings.device.startswith("cuda:"):
            settings = dataclasses.replace(settings, device="cuda")  # Ray shows the actor only its own GPU
        options: dict[str, Any] = {"max_restarts": -1, "max_task_retries": 0, "num_cpus": 0,
                                   "num_gpus": gpus if gpu else 0}
        if resource:
            options["resources"] = {resource: 0.001}
        self.asks = {"GPU": options["num_gpus"], **options.get("resources", {})}  # for the placement error
        # Ray starts workers with OMP_NUM_THREADS=1; raising torch's thread count afterwards
        # still left a step ~20% slower than in-process here, so the actor starts with it set.
        threads = int(os.environ.get("TRIO_THREADS") or os.cpu_count() or 1)
        env = {"OMP_NUM_THREADS": str(threads)}
        if KEEP_FREED_ENV in os.environ:  # the service's memory policy (trio serve sets it), on any node
            env[KEEP_FREED_ENV] = os.environ[KEEP_FREED_ENV]
        options["runtime_env"] = {"env_vars": env}
        self.base_model = base_model
        # ``durable`` waits in a group of its own, beside ``call`` (ray's stubs lack the argument)
        actor_class = ray.remote(concurrency_groups={"durable": 1})(HostActor)  # type: ignore[call-overload]
        self.actor: Any = actor_class.options(**options).remote(base_model, settings, threads)
        self.incarnation: str | None = None  # the actor's, as last heard (HostActor.call)
        # a call waited its whole time for the actor in vain: later calls try once, until one is answered
        self.gave_up = False
        self.notify_restart: Callable[[], None] = lambda: None

    def watch_restarts(self, notify: Callable[[], None]) -> None:
        self.notify_restart = notify

    def _call(self, method: str, *args: Any, watched: bool = True) -> Any:
        """The actor's ``method``. ``watched``: a call of the worker's thread, which learns of a
        restart (``notify_restart``) before its call runs on the new actor; the calls other
        threads make (they only read) neither check nor notify."""
        deadline = time.monotonic() + (0.0 if self.gave_up else RESTART_WAIT_SECONDS)
        while True:
            try:
                incarnation, result = self._placed_result(self.actor.call.remote(self.incarnation if watched else None,
                                                                                 method, *args))
                self.gave_up = False
                if self.incarnation is None and watched:
                    self.incarnation = incarnation
                if not isinstance(result, NotRun):
                    return result
                log.warning("host actor of %s restarted; its runs come back from their snapshots", self.base_model)
                self.incarnation = incarnation
                self.notify_restart()  # before the call runs on the new actor
            except RayActorError:
                if method not in RETRY_SAFE:
                    log.error("host actor of %s died during %s", self.base_model, method)
                    raise HostRestarted(method) from None
                if time.monotonic() >= deadline:
                    self.gave_up = True  # the model's queued calls are told at once, not one a wait apiece
                    raise ServiceError("server", f"the model host of {self.base_model} is not coming back", 500) from None
                log.warning("host actor of %s is restarting; retrying %s", self.base_model, method)
                time.sleep(0.5)

    def _placed_result(self, ref: Any) -> Any:
        """``_result``; but while the actor waits for a node (none offers the GPU or resource
        it asks for: a pinned node lost, GPUs taken) Ray holds the call for good: after
        PLACEMENT_WAIT_SECONDS (at once once a call gave up) it fails, naming what is missing."""
        unplaced_since = None
        timeout = 0.0 if self.gave_up else PLACEMENT_POLL_SECONDS  # given up on: still unplaced is told at once
        while True:
            try:
                return _result(ref, timeout=timeout)
            except GetTimeoutError:
                timeout = PLACEMENT_POLL_SECONDS
                if actor_state(self.actor) not in UNPLACED:  # placed: a long call
                    unplaced_since = None
                    continue
                now = time.monotonic()
                unplaced_since = unplaced_since or now
                if self.gave_up or now - unplaced_since >= PLACEMENT_WAIT_SECONDS:
                    self.gave_up = True
                    with contextlib.suppress(Exception):
                        ray.cancel(ref)
                    raise ServiceError("server", f"the model host of {self.base_model} waits for a Ray node that "
                                       f"offers what it asks for ({self.asks}); none has it free (available: "
                                       f"{ray.available_resources()})", 500) from None

    def load(self) -> dict[str, Any]:
        return self._call("load", watched=False)

    def tokenizer_files(self) -> dict[str, bytes]:
        return self._call("tokenizer_files", watched=False)

    def create_adapter(self, run_id: str, config: LoraConfig) -> None:
        self._call("create_adapter", run_id, config)

    def forward(self, jobs: list[ForwardJob]) -> list[ForwardResult | Failure]:
        return self._call("forward", jobs)

    def forward_backward(self, jobs: list[ForwardJob]) -> list[ForwardResult | Failure]:
        return self._call("forward_backward", jobs)

    def hold_grads(self, key: str, run_id: str) -> None:
        self._call("hold_grads", key, run_id)

    def release_grads(self, key: str, run_id: str, restore: bool) -> bool:
        return self._call("release_grads", key, run_id, restore)

    def drop_grads(self, run_id: str) -> None:
        self._call("drop_grads", run_id)

    def optim_step(self, run_id: str, config: AdamConfig) -> tuple[dict[str, float], Durability | None]:
        return self._call("optim_step", run_id, config)

    def durable(self, write: Durability) -> None:
        """The actor writes its snapshots. If it dies while we wait (or died before we
        asked: its restarted self is another engine, which checks the same way), the
        snapshot on disk says whether the step was kept. A live actor is waited for, however
        slow its disk: its step stands, and told lost the client would make it twice."""
        ref = self.actor.durable.remote(write)
        while True:
            try:
                _result(ref, timeout=DURABLE_WAIT_SECONDS)
                return
            except GetTimeoutError:
                if actor_state(self.actor) == "ALIVE":  # a slow disk: the write comes, or its retries give up
                    log.warning("host actor of %s: run %s's snapshot not written after %.0f s; waiting on",
                                self.base_model, write.run_id, DURABLE_WAIT_SECONDS)
                    continue
            except RayActorError:
                pass
            # gone (a step read as lost while the actor still held it would be applied twice when redone)
            log.warning("host actor of %s: no answer on run %s's snapshot; reading it", self.base_model, write.run_id)
            written_before_it_died(self.snapshot_dir, write)
            return

    def adapter_info(self, run_id: str) -> AdapterInfo:
        return self._call("adapter_info", run_id)

    def save_state(self, run_id: str, folder: str) -> None:
        self._call("save_state", run_id, folder)

    def load_state(self, run_id: str, folder: str, with_optimizer: bool) -> LoraConfig:
        return self._call("load_state", run_id, folder, with_optimizer)

    def save_sampler_weights(self, run_id: str, folder: str) -> None:
        self._call("save_sampler_weights", run_id, folder)

    def prepare_sampler(self, weights: str | None) -> None:
        self._call("prepare_sampler", weights)

    def sample(self, jobs: list[SampleJob]) -> list[SampleResult | Failure]:
        return self._call("sample", jobs)

    def compute_logprobs(self, weights: str | None, tokens: list[int]) -> list[float | None]:
        return self._call("compute_logprobs", weights, tokens)

    def decode(self, admit: dict[str, SampleJob], max_steps: int = 1) -> DecodeUpdate:
        # Not retried on a restarted actor: the running batch died with the old one.
        return self._call("decode", admit, max_steps)

    def offload(self, run_id: str) -> None:
        self._call("offload", run_id)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        try:  # let pending snapshots land, but do not wait on an actor that is gone
            ray.get(self.actor.call.remote(None, "flush"), timeout=60)
        except Exception as exc:
            log.warning("host actor of %s: snapshots not flushed at close: %s", self.base_model, exc)
        finally:
            ray.kill(self.actor, no_restart=True)

