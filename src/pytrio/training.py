"""TrainingClient: one LoRA training run on the service.

Calls execute strictly in the order they are made: each gets the next sequence number
at call time and the service runs a run's requests in that order, so
``forward_backward`` and ``optim_step`` may be submitted back to back before waiting.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import Any

from . import types as t
from .errors import validated
from .futures import APIFuture, async_twin, run_sync, schedule, sync_twin
from .sampling import SamplingClient, new_sampling_client
from .session import Session

CustomLossFn = Callable[[list[t.Datum], list[Any]], tuple[Any, dict[str, float]]]


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
        self._seq = itertools.count()
        self._seq_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"TrainingClient(model_id={self.model_id!r}, base_model={self.base_model!r})"

    # -- ordered operations ------------------------------------------------------------

    def _submit(self, op: str, request_type: type[Any], result_type: type[Any], **fields: Any) -> APIFuture:
        request = validated(request_type, model_id=self.model_id, seq=0, **fields)
        request.seq = self._next_seq()  # only a valid request takes a sequence number
        return schedule(self._session.call(op, request, result_type))

    def _next_seq(self) -> int:
        with self._seq_lock:
            return next(self._seq)

    def forward(
        self, data: Sequence[t.Datum], loss_fn: str = "cross_entropy", loss_fn_config: dict[str, float] | None = None
    ) -> APIFuture[t.ForwardBackwardOutput]:
        """Logprobs and losses for ``data``; no gradients."""
        return self._submit("forward", t.ForwardRequest, t.ForwardBackwardOutput,
                            data=list(data), loss_fn=loss_fn, loss_fn_config=loss_fn_config)

    def forward_backward(
        self, data: Sequence[t.Datum], loss_fn: str = "cross_entropy", loss_fn_config: dict[str, float] | None = None
    ) -> APIFuture[t.ForwardBackwardOutput]:
        """Compute the loss and add its gradient to the run's accumulated gradients.

        Args:
            data: datums with ``target_tokens`` and the loss's inputs in ``loss_fn_inputs``.
            loss_fn: ``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo`` or ``dro``.
            loss_fn_config: e.g. ``{"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}``.
        Returns:
            A future of ``ForwardBackwardOutput`` (per-datum logprobs and elementwise_loss,
            ``metrics["loss:sum"]``).
        Raises:
            ValidationError: naming the datum index, field and value.
        """
        return self._submit("forward_backward", t.ForwardRequest, t.ForwardBackwardOutput,
                            data=list(data), loss_fn=loss_fn, loss_fn_config=loss_fn_config)

    def forward_backward_custom(self, data: Sequence[t.Datum], loss_fn: CustomLossFn) -> APIFuture[t.ForwardBackwardOutput]:
        """Train on any differentiable function of the per-datum logprobs.

        ``loss_fn(data, logprobs) -> (loss, metrics)`` gets one torch tensor of target
        logprobs per datum. As in Tinker: a forward pass gives the logprobs, the loss is
        differentiated locally, and a ``cross_entropy`` forward_backward with
        ``weights = -dloss/dlogprobs`` puts exactly that gradient on the weights.
        Needs torch on the client.
        """
        data = validated(t.ForwardRequest, model_id=self.model_id, seq=0, data=list(data)).data
        targets_only = [
            t.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
            for d in data
        ]
        forward = validated(t.ForwardRequest, model_id=self.model_id, seq=self._next_seq(), data=targets_only)
        backward_seq = self._next_seq()  # reserved now, so later calls queue behind it
        return schedule(self._custom(data, loss_fn, forward, backward_seq))

    async def _custom(self, data: list[t.Datum], loss_fn: CustomLossFn, forward: t.ForwardRequest, seq: int) -> t.ForwardBackwardOutput:
        import torch

        out = await self._session.call("forward", forward, t.ForwardBackwardOutput)
        logprobs = [torch.tensor(o["logprobs"].data, dtype=torch.float32, requires_grad=True) for o in out.loss_fn_outputs]
        loss, metrics = loss_fn(data, logprobs)
        grads = torch.autograd.grad(loss, logprobs, allow_unused=True)
        weighted = [
            t.Datum(model_input=d.model_input, loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": t.TensorData.coerce((-g if g is not None else torch.zeros_like(lp)).tolist())})
            for d, g, lp in zip(data, grads, logprobs)
        ]
        request = t.ForwardRequest(model_id=self.model_id, seq=seq, data=weighted, loss_fn="cross_entropy")
        result = await self._session.call("forward_backward", request, t.ForwardBackwardOutput)
        result.metrics = {**result.metrics, **{k: float(v) for k, v in metrics.items()}, "loss:sum": float(loss.detach())}
        return result

    def optim_step(self, adam_params: t.AdamParams | None = None) -> APIFuture[t.OptimStepResponse]:
        """Apply AdamW to the accumulated gradients, then clear them."""
        return self._submit("optim_step", t.OptimStepRequest, t.OptimStepResponse,
                            adam_params=adam_params or t.AdamParams())

    def save_state(self, name: str) -> APIFuture[t.SaveWeightsResponse]:
        """Save adapter + optimizer state; ``.path`` is ``trio://<run>/weights/<name>``."""
        return self._submit("save_weights", t.SaveWeightsRequest, t.SaveWeightsResponse, name=name, kind="weights")

    def load_state(self, path: str) -> APIFuture[t.LoadWeightsResponse]:
        """Load adapter weights from a training-state checkpoint; optimizer state starts fresh."""
        return self._submit("load_weights", t.LoadWeightsRequest, t.LoadWeightsResponse, path=path, with_optimizer=False)

    def load_state_with_optimizer(self, path: str) -> APIFuture[t.LoadWeightsResponse]:
        """Load adapter weights and the optimizer's moments and step."""
        return self._submit("load_weights", t.LoadWeightsRequest, t.LoadWeightsResponse, path=path, with_optimizer=True)

    def save_weights_for_sampler(self, name: str) -> APIFuture[t.SaveWeightsForSamplerResponse]:
        """Save a PEFT adapter folder; ``.path`` is ``trio://<run>/sampler_weights/<name>``."""
        return self._submit("save_weights", t.SaveWeightsRequest, t.SaveWeightsForSamplerResponse,
                            name=name, kind="sampler_weights")

    forward_async = async_twin(forward)
    forward_backward_async = async_twin(forward_backward)
    forward_backward_custom_async = async_twin(forward_backward_custom)
    optim_step_async = async_twin(optim_step)
    save_state_async = async_twin(save_state)
    load_state_async = async_twin(load_state)
    load_state_with_optimizer_async = async_twin(load_state_with_optimizer)
    save_weights_for_sampler_async = async_twin(save_weights_for_sampler)

    # -- value-returning operations ----------------------------------------------------

    async def create_sampling_client_async(self, model_path: str) -> SamplingClient:
        """A sampler over saved sampler weights (any ``trio://`` path you own)."""
        return await new_sampling_client(self._session, model_path=model_path)

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None) -> SamplingClient:
        """Save sampler weights (named ``name``, or a fresh name) and return a sampler on them."""
        saved = await self.save_weights_for_sampler(name or f"sampler-{secrets.token_hex(6)}")
        return await self.create_sampling_client_async(saved.path)

    async def get_info_async(self) -> t.GetInfoResponse:
        return await self._session.call("get_info", t.GetInfoRequest(model_id=self.model_id), t.GetInfoResponse)

    async def get_tokenizer_async(self) -> Any:
        return await self._session.tokenizer(self.base_model)

    create_sampling_client = sync_twin(create_sampling_client_async)
    save_weights_and_get_sampling_client = sync_twin(save_weights_and_get_sampling_client_async)
    get_info = sync_twin(get_info_async)

    def get_tokenizer(self) -> Any:
        """The base model's Hugging Face tokenizer (files come from the service)."""
        return run_sync(self.get_tokenizer_async())

