"""TrainingClient: one LoRA training run on the service.

Calls execute strictly in the order they are made, so ``forward_backward`` and
``optim_step`` may be submitted back to back before waiting. Each call is sent in call
order and numbered as it is sent (see ``ordering``), so no timing (a slow custom loss,
a submit retried through a restart) can let a later call run before an earlier one.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from . import types as t
from .errors import TrioError, ValidationError, validated
from .futures import (
    APIFuture,
    async_twin,
    begun_at_call,
    in_user_thread,
    on_background,
    run_sync,
    schedule,
    sync_twin,
)
from .ordering import SubmitOrder, Ticket
from .sampling import SamplingClient, new_sampling_client
from .session import Session

CustomLossFn = Callable[[list[t.Datum], list[Any]], tuple[Any, dict[str, float]]]
LossFn = str | CustomLossFn
R = TypeVar("R")


class TrainingClient:
    """Train one LoRA adapter: forward_backward, optim_step, checkpoints, sampling.

    Example:
        >>> fb = training_client.forward_backward(data, "cross_entropy")
        >>> op = training_client.optim_step(trio.AdamParams(learning_rate=1e-4))
        >>> fb.result().metrics["loss:sum"]; op.result()
    """

    def __init__(self, session: Session, model_id: str, base_model: str):
        self._session = session
        self.model_id = model_id
        self.base_model = base_model
        self._order = SubmitOrder()
        self._in_loss_fn = threading.local()  # set in the thread running a custom loss_fn
        self._last_sent: str | None = None  # request id of the newest call sent (log_metrics waits for it)

    def __repr__(self) -> str:
        return f"TrainingClient(model_id={self.model_id!r}, base_model={self.base_model!r})"

    # -- ordered operations ------------------------------------------------------------

    def _submit(self, op: str, request_type: type[Any], result_type: type[Any], **fields: Any) -> APIFuture:
        request = validated(request_type, model_id=self.model_id, seq=0, **fields)
        (ticket,) = self._take(op)  # only a valid request takes a place in the order
        return schedule(self._ordered(op, request, result_type, ticket))

    def _take(self, op: str, count: int = 1) -> list[Ticket]:
        if getattr(self._in_loss_fn, "active", False):
            raise ValidationError(
                f"{op}: called inside forward_backward_custom's loss_fn on the same TrainingClient; it "
                "would run after that backward, which waits for the loss (a deadlock). Call it before or after")
        return self._order.take(count)

    async def _ordered(self, op: str, request: Any, result_type: type[Any], ticket: Ticket) -> Any:
        request_id = await self._send(op, request, ticket)
        return await self._session.result(request_id, result_type)

    async def _send(self, op: str, request: Any, ticket: Ticket) -> str:
        """Submit once every earlier call was sent, numbered then; then let the next go."""
        try:
            await ticket.turn()
            request.seq = ticket.number()
            try:
                self._last_sent = await self._session.submit(op, request)
            except TrioError as exc:
                if exc.seq_unused:  # never read by the service: the next call takes this number
                    ticket.give_back_number()
                raise
            return self._last_sent
        finally:
            ticket.release()

    def forward(
        self, data: Sequence[t.Datum], loss_fn: str = "cross_entropy", loss_fn_config: dict[str, float] | None = None
    ) -> APIFuture[t.ForwardBackwardOutput]:
        """Logprobs and losses for ``data``; no gradients."""
        return self._submit("forward", t.ForwardRequest, t.ForwardBackwardOutput,
                            data=_datums(data), loss_fn=loss_fn, loss_fn_config=loss_fn_config)

    def forward_backward(
        self, data: Sequence[t.Datum], loss_fn: LossFn = "cross_entropy",
        loss_fn_config: dict[str, float] | None = None,
    ) -> APIFuture[t.ForwardBackwardOutput]:
        """Compute the loss and add its gradient to the run's accumulated gradients.

        Args:
            data: datums with ``target_tokens`` and the loss's inputs in ``loss_fn_inputs``.
            loss_fn: ``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``, ``gspo`` or ``dro``;
                or a function ``loss_fn(data, logprobs) -> (loss, metrics)``, which runs as
                ``forward_backward_custom`` (then ``loss_fn_config`` must be None).
            loss_fn_config: e.g. ``{"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}``.
        Returns:
            A future of ``ForwardBackwardOutput`` (per-datum logprobs and elementwise_loss,
            ``metrics["loss:sum"]``).
        Raises:
            ValidationError: naming the datum index, field and value.
        """
        if callable(loss_fn):
            if loss_fn_config is not None:
                raise ValidationError("loss_fn_config: a custom loss_fn takes no config; close over it instead")
            return self.forward_backward_custom(data, loss_fn)
        return self._submit("forward_backward", t.ForwardRequest, t.ForwardBackwardOutput,
                            data=_datums(data), loss_fn=loss_fn, loss_fn_config=loss_fn_config)

    def forward_backward_custom(self, data: Sequence[t.Datum], loss_fn: CustomLossFn) -> APIFuture[t.ForwardBackwardOutput]:
        """Train on any differentiable function of the per-datum logprobs.

        ``loss_fn(data, logprobs) -> (loss, metrics)`` gets one torch tensor of target
        logprobs per datum. As in Tinker: a forward pass gives the logprobs, the loss is
        differentiated locally, and a ``cross_entropy`` forward_backward with
        ``weights = -dloss/dlogprobs`` puts exactly that gradient on the weights.
        Needs torch on the client.

        Ordering: the call holds its place for both passes; later calls on this client
        are sent after its backward, however long the forward and the loss take. If the
        forward fails or ``loss_fn`` raises, the place is freed at once and later calls
        go on; the future raises that error.

        ``loss_fn`` runs in a worker thread, not on the SDK's event loop, so it may use
        the SDK (a sampler, another client). It may not call this client's ordered
        operations: they would queue behind this very backward (ValidationError).
        """
        data = validated(t.ForwardRequest, model_id=self.model_id, seq=0, data=_datums(data)).data
        targets_only = [
            t.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
            for d in data
        ]
        forward = validated(t.ForwardRequest, model_id=self.model_id, seq=0, data=targets_only)
        forward_ticket, backward_ticket = self._take("forward_backward_custom", 2)
        return schedule(self._custom(data, loss_fn, forward, forward_ticket, backward_ticket))

    async def _custom(self, data: list[t.Datum], loss_fn: CustomLossFn, forward: t.ForwardRequest,
                      forward_ticket: Ticket, backward_ticket: Ticket) -> t.ForwardBackwardOutput:
        try:
            out = await self._ordered("forward", forward, t.ForwardBackwardOutput, forward_ticket)
            weighted, loss, metrics = await in_user_thread(self._gradients, data, loss_fn, out)
            recorded = {name: v for name, v in {"loss:sum": loss, **metrics}.items() if math.isfinite(v)}
            backward = validated(t.ForwardRequest, model_id=self.model_id, seq=0, data=weighted, loss_fn="cross_entropy",
                                 custom_metrics=recorded)
            request_id = await self._send("forward_backward", backward, backward_ticket)
        finally:
            backward_ticket.release()  # a failed forward or loss frees its place at once
        result = await self._session.result(request_id, t.ForwardBackwardOutput)
        result.metrics = {**result.metrics, **metrics, "loss:sum": loss}
        return result

    def _gradients(self, data: list[t.Datum], loss_fn: CustomLossFn,
                   out: t.ForwardBackwardOutput) -> tuple[list[t.Datum], float, dict[str, float]]:
        """Run the user's loss (in a worker thread) and turn its gradient into weights."""
        import torch

        logprobs = [torch.tensor(o["logprobs"].data, dtype=torch.float32, requires_grad=True) for o in out.loss_fn_outputs]
        self._in_loss_fn.active = True
        try:
            returned = loss_fn(data, logprobs)
        finally:
            self._in_loss_fn.active = False
        loss, metrics = _loss_and_metrics(returned)
        if not torch.isfinite(loss.detach()).all():
            raise ValidationError(f"forward_backward_custom: loss_fn returned a non-finite loss ({loss.item()})")
        grads = torch.autograd.grad(loss, logprobs, allow_unused=True)
        for i, g in enumerate(grads):
            bad = [] if g is None else (~torch.isfinite(g)).nonzero().flatten().tolist()
            if bad:
                raise ValidationError(f"forward_backward_custom: the gradient of loss_fn's loss with respect to "
                                      f"data[{i}]'s logprobs is {float(g[bad[0]])} at token {bad[0]}")
        weighted = [
            t.Datum(model_input=d.model_input, loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": t.TensorData.coerce((-g if g is not None else torch.zeros_like(lp)).tolist())})
            for d, g, lp in zip(data, grads, logprobs)
        ]
        return weighted, float(loss.detach()), metrics

    def optim_step(self, adam_params: t.AdamParams | None = None) -> APIFuture[t.OptimStepResponse]:
        """Apply AdamW to the accumulated gradients, then clear them."""
        return self._submit("optim_step", t.OptimStepRequest, t.OptimStepResponse,
                            adam_params=adam_params or t.AdamParams())

    def save_state(self, name: str, overwrite: bool = False, ttl_seconds: int | None = None,
                   user_metadata: dict[str, str] | None = None) -> APIFuture[t.SaveWeightsResponse]:
        """Save adapter + optimizer state; ``.path`` is ``trio://<run>/weights/<name>``.

        ``ttl_seconds``: the service removes the checkpoint that long after the save (None:
        kept until deleted; ``RestClient.set_checkpoint_ttl`` changes it). ``user_metadata``
        is kept with it and listed with it.

        Raises:
            ValidationError: (status 409) the run already has a checkpoint ``name`` and
                ``overwrite`` is False; nothing is written.
        """
        return self._submit("save_weights", t.SaveWeightsRequest, t.SaveWeightsResponse, name=name, kind="weights",
                            overwrite=overwrite, ttl_seconds=ttl_seconds, user_metadata=user_metadata)

    def load_state(self, path: str) -> APIFuture[t.LoadWeightsResponse]:
        """Load adapter weights from a training-state checkpoint; optimizer state starts fresh."""
        return self._submit("load_weights", t.LoadWeightsRequest, t.LoadWeightsResponse, path=path, with_optimizer=False)

    def load_state_with_optimizer(self, path: str) -> APIFuture[t.LoadWeightsResponse]:
        """Load adapter weights and the optimizer's moments and step."""
        return self._submit("load_weights", t.LoadWeightsRequest, t.LoadWeightsResponse, path=path, with_optimizer=True)

    def save_weights_for_sampler(self, name: str, overwrite: bool = False, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None
                                 ) -> APIFuture[t.SaveWeightsForSamplerResponse]:
        """Save a PEFT adapter folder; ``.path`` is ``trio://<run>/sampler_weights/<name>``.

        A used ``name`` is refused (ValidationError, status 409) unless ``overwrite``.
        With ``overwrite=True``, samplers already made on that path sample the new
        weights from their next request. ``ttl_seconds`` and ``user_metadata``: as
        ``save_state``'s.
        """
        return self._submit("save_weights", t.SaveWeightsRequest, t.SaveWeightsForSamplerResponse,
                            name=name, kind="sampler_weights", overwrite=overwrite, ttl_seconds=ttl_seconds,
                            user_metadata=user_metadata)

    def log_metrics(
        self, metrics: Mapping[str, float], step: int | None = None
    ) -> APIFuture[t.LogMetricsResponse]:
        """Record your own metrics for a step of this run, e.g. an RL loop's mean reward.

        They are stored beside the service's (``loss``, ``tokens``, ``grad_norm``, ...);
        ``RestClient.get_run_metrics`` and the web console show them all.

        Args:
            metrics: name -> finite number (numpy and 0-d torch scalars are fine). A
                name the service also records (``loss``, say) shows your value instead.
            step: the step to record at. None: the run's step (its optim_steps so far)
                once every call made before this one on this client has run; so
                ``optim_step(...)`` then ``log_metrics(...)`` records at the new step,
                without waiting for the step in between.
        Returns:
            A future of ``LogMetricsResponse`` (``.step``: where they were recorded).
        Raises:
            ValidationError: an empty name or a value that is not a finite number, named
                with its value, at call time; nothing is sent.

        Example:
            >>> training_client.log_metrics({"reward": 0.75})
        """
        if isinstance(metrics, Mapping):  # scalars of numpy and torch: as python numbers
            metrics = {k: _scalar(v) for k, v in metrics.items()}
        request = validated(t.LogMetricsRequest, step=step, metrics=metrics)
        ticket = self._take("log_metrics (with step=None)")[0] if step is None else None
        return schedule(self._log_metrics(request, ticket))

    async def _log_metrics(self, request: t.LogMetricsRequest, ticket: Ticket | None) -> t.LogMetricsResponse:
        def send() -> Awaitable[t.LogMetricsResponse]:
            return on_background(self._session.transport.log_metrics(self.model_id, request))

        if ticket is None:
            return await send()
        return await self._after_earlier_calls(ticket, send, hold=False)  # the current step

    async def _after_earlier_calls(self, ticket: Ticket, request: Callable[[], Awaitable[R]], *, hold: bool) -> R:
        """``request()`` once every call made before ``ticket`` was taken has run (or
        failed). ``hold``: keep the place until it is answered, so that no call made later
        (an ``optim_step``) can reach the run first and be counted (``get_info``); else it
        is given up at its turn and later calls pipeline on (``log_metrics``, which a step
        made after it and run within its round trip is counted in)."""
        try:
            await ticket.turn()
            last = self._last_sent
            if not hold:
                ticket.release()
            if last is not None:  # the run executes in order: the newest call finishing is all of them
                await self._session.settled(last)
            return await request()
        finally:
            ticket.release()  # takes no number

    forward_async = async_twin(forward)
    forward_backward_async = async_twin(forward_backward)
    forward_backward_custom_async = async_twin(forward_backward_custom)
    optim_step_async = async_twin(optim_step)
    save_state_async = async_twin(save_state)
    load_state_async = async_twin(load_state)
    load_state_with_optimizer_async = async_twin(load_state_with_optimizer)
    save_weights_for_sampler_async = async_twin(save_weights_for_sampler)
    log_metrics_async = async_twin(log_metrics)

    # -- value-returning operations ----------------------------------------------------

    async def create_sampling_client_async(self, model_path: str) -> SamplingClient:
        """A sampler over saved sampler weights (any ``trio://`` path you own)."""
        return await new_sampling_client(self._session, model_path=model_path)

    def save_weights_and_get_sampling_client(self, name: str | None = None, overwrite: bool = False) -> SamplingClient:
        """Save the current weights for sampling and return a sampler on them.

        With a ``name``: a checkpoint, as ``save_weights_for_sampler(name, overwrite)``.
        Without: ephemeral weights, just for this sampler. They are not listed among the
        checkpoints, and the service removes them when it restarts, or once the run has
        saved ``ephemeral_samplers_per_run`` (default 8) newer ones; a sampler on removed
        weights raises NotFoundError.
        """
        return run_sync(self._sampling_client_on(self._save_for_sampler(name, overwrite)))

    @begun_at_call
    def save_weights_and_get_sampling_client_async(
        self, name: str | None = None, overwrite: bool = False
    ) -> Awaitable[SamplingClient]:
        """``save_weights_and_get_sampling_client``, awaited; the save takes its place in
        the order at the call."""
        return self._sampling_client_on(self._save_for_sampler(name, overwrite))

    def _save_for_sampler(self, name: str | None, overwrite: bool) -> APIFuture:
        """The save, its place in the order taken now, in the caller's thread (inside a
        custom loss_fn that is refused, not left waiting behind its own backward)."""
        if name is None:
            return self._submit("save_weights", t.SaveWeightsRequest, t.SaveWeightsForSamplerResponse,
                                kind="ephemeral")
        return self.save_weights_for_sampler(name, overwrite)

    async def _sampling_client_on(self, saved: APIFuture) -> SamplingClient:
        return await self.create_sampling_client_async((await saved).path)

    def get_info(self) -> t.GetInfoResponse:
        """The run's info once every call made before this one on this client has run:
        ``.step`` counts the ``optim_step`` calls made before it, awaited or not, and no
        call made after it (those are sent once it is answered)."""
        return self._get_info().result()

    @begun_at_call
    def get_info_async(self) -> Awaitable[t.GetInfoResponse]:
        """``get_info``, awaited; its place in the order is taken at the call."""
        return self._get_info()

    def _get_info(self) -> APIFuture[t.GetInfoResponse]:
        """Its place taken in the caller's thread; its wait on the SDK's loop, where no
        cancelled ``await`` can end it early."""
        request = t.GetInfoRequest(model_id=self.model_id)
        ticket = self._take("get_info")[0]
        return schedule(self._after_earlier_calls(
            ticket, lambda: self._session.call("get_info", request, t.GetInfoResponse), hold=True))

    async def get_tokenizer_async(self) -> Any:
        return await self._session.tokenizer(self.base_model)

    create_sampling_client = sync_twin(create_sampling_client_async)

    def get_tokenizer(self) -> Any:
        """The base model's Hugging Face tokenizer (files come from the service)."""
        return run_sync(self.get_tokenizer_async())


def _datums(data: Sequence[t.Datum]) -> list[t.Datum]:
    """``data`` as a list. One Datum alone is refused naming the fix: ``list()`` of it gave
    its fields, refused as "data[0]: ... (got ('model_input', ...))"."""
    if isinstance(data, t.Datum):
        raise ValidationError("data: a list of Datum, got one Datum; pass [datum]")
    return list(data)


def _loss_and_metrics(returned: Any) -> tuple[Any, dict[str, float]]:
    """A custom ``loss_fn``'s ``(loss, metrics)``, checked: the loss a 0-d torch tensor
    that depends on the logprobs it was given, the metrics names to numbers."""
    import torch

    where = "forward_backward_custom: loss_fn"
    if not (isinstance(returned, tuple | list) and len(returned) == 2):
        raise ValidationError(f"{where} must return (loss, metrics), got {type(returned).__name__}")
    loss, metrics = returned
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValidationError(f"{where}'s loss must be a 0-d torch tensor (e.g. a .sum() of the logprobs), got {got}")
    if not loss.requires_grad:
        raise ValidationError(f"{where}'s loss does not depend on the logprobs it was given: it has no gradient")
    if not isinstance(metrics, Mapping):
        raise ValidationError(f"{where}'s metrics must be a dict of name -> number, got {type(metrics).__name__}")
    numbers = {}
    for name, value in metrics.items():
        try:
            numbers[str(name)] = float(_scalar(value))
        except (TypeError, ValueError, RuntimeError):
            raise ValidationError(f"{where}'s metric {name!r} must be a number, got {value!r}") from None
    return loss, numbers


def _scalar(value: Any) -> Any:
    """A numpy or 0-d torch scalar as the python number it holds; anything else as is
    (for validation to accept or name)."""
    item = getattr(value, "item", None)
    if not callable(item) or isinstance(value, str | bytes):
        return value
    try:
        return item()
    except (ValueError, RuntimeError):  # an array of several values: validation names it
        return value
