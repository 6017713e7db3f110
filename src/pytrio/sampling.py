"""SamplingClient: generate from a base model or from saved sampler weights.

``new_sampling_client`` lives here, below both ServiceClient and TrainingClient, which
each create samplers, so the SDK's modules import one way only:
service -> training -> sampling -> session -> transport, futures, errors, types.
"""

from __future__ import annotations

from typing import Any

from . import types as t
from .errors import ValidationError, validated
from .futures import APIFuture, run_sync, schedule
from .session import Session


class SamplingClient:
    """Sample completions; requests from many clients share the service's decode batches.

    Example:
        >>> params = trio.SamplingParams(max_tokens=20, temperature=0.0, stop=["\\n"])
        >>> seq = sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
        >>> seq.text, seq.tokens, seq.logprobs, seq.stop_reason
    """

    def __init__(self, session: Session, sampler_id: str, base_model: str, model_path: str | None = None):
        self._session = session
        self.sampler_id = sampler_id
        self.base_model = base_model
        self.model_path = model_path

    def __repr__(self) -> str:
        return f"SamplingClient(base_model={self.base_model!r}, model_path={self.model_path!r})"

    def sample(
        self,
        prompt: t.ModelInput,
        num_samples: int = 1,
        sampling_params: t.SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
    ) -> APIFuture[t.SampleResponse]:
        """``num_samples`` completions of ``prompt``.

        Each sequence has ``tokens`` (every sampled token, a stop sequence or EOS included),
        their ``logprobs`` under the model (temperature 1, the trainer's numerics),
        ``text`` (the tokens decoded, special tokens skipped) and ``stop_reason``
        (``"stop"`` or ``"length"``). With ``include_prompt_logprobs`` the response also has
        ``prompt_logprobs`` (None for the first token). ``sampling_params`` is required:
        ``max_tokens`` has no default. Sequences stop at EOS unless ``ignore_eos=True``.
        """
        if sampling_params is None:
            raise ValidationError("sampling_params: required, e.g. trio.SamplingParams(max_tokens=20) "
                                  "(max_tokens has no default)")
        request = validated(
            t.SampleRequest, sampler_id=self.sampler_id, prompt=prompt, num_samples=num_samples,
            sampling_params=sampling_params, include_prompt_logprobs=include_prompt_logprobs,
        )
        return schedule(self._session.call("sample", request, t.SampleResponse))

    def compute_logprobs(self, prompt: t.ModelInput) -> APIFuture[list[float | None]]:
        """log p(token_t | tokens_<t) for every prompt token; None for the first."""
        request = validated(t.ComputeLogprobsRequest, sampler_id=self.sampler_id, prompt=prompt)
        return schedule(self._logprobs(request))

    async def _logprobs(self, request: t.ComputeLogprobsRequest) -> list[float | None]:
        return (await self._session.call("compute_logprobs", request, t.ComputeLogprobsResponse)).logprobs

    # Unlike the training twins (which give a future, so calls pipeline), the sampling
    # twins give the result: awaited once it is usable, as in Tinker, and awaited twice
    # (the user docs) it is still the result (see types.AwaitableResult).

    async def sample_async(
        self,
        prompt: t.ModelInput,
        num_samples: int = 1,
        sampling_params: t.SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
    ) -> t.SampleResponse:
        """``sample``, awaited: ``(await sc.sample_async(...)).sequences``. The result is
        awaitable too, so ``fut = await sc.sample_async(...); res = await fut`` works."""
        return await self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs)

    async def compute_logprobs_async(self, prompt: t.ModelInput) -> t.PromptLogprobs:
        """``compute_logprobs``, awaited; a list that is itself awaitable, like ``sample_async``'s."""
        return t.PromptLogprobs(await self.compute_logprobs(prompt))

    async def get_tokenizer_async(self) -> Any:
        return await self._session.tokenizer(self.base_model)

    def get_tokenizer(self) -> Any:
        """The base model's Hugging Face tokenizer (files come from the service)."""
        return run_sync(self.get_tokenizer_async())


async def new_sampling_client(session: Session, base_model: str | None = None, model_path: str | None = None) -> SamplingClient:
    """Create a sampler on the service (a base model, or saved weights) and wrap it in a client."""
    request = validated(t.CreateSamplerRequest, base_model=base_model, model_path=model_path)
    created = await session.call("create_sampler", request, t.CreateSamplerResponse)
    return SamplingClient(session, created.sampler_id, created.base_model, created.model_path)
