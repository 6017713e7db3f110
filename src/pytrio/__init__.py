"""pytrio: the TRIO SDK. Post-train LLMs from plain Python; the model lives elsewhere.

    import pytrio as trio
    service = trio.ServiceClient()                 # in-process unless PYTRIO_BASE_URL is set
    trainer = service.create_lora_training_client(base_model=..., rank=32)
    trainer.forward_backward(data, "cross_entropy"); trainer.optim_step(trio.AdamParams())

This package never imports torch.
"""

from .errors import (
    AuthenticationError,
    CapacityError,
    ConnectionError,
    NotFoundError,
    ServerError,
    TimeoutError,
    TrioError,
    ValidationError,
)
from .futures import APIFuture
from .rest import RestClient
from .sampling import SamplingClient
from .service import ServiceClient
from .training import TrainingClient
from .types import (
    AdamParams,
    Checkpoint,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    LoadWeightsResponse,
    LogMetricsResponse,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    ServerCapabilities,
    StepMetrics,
    TensorData,
    TrainingRun,
    Usage,
)

APIFutureResult = APIFuture  # the name the user docs use

__all__ = [
    "APIFuture", "APIFutureResult", "AdamParams", "AuthenticationError", "CapacityError", "Checkpoint",
    "ConnectionError", "Datum", "EncodedTextChunk", "ForwardBackwardOutput", "LoadWeightsResponse", "LogMetricsResponse",
    "ModelInput",
    "NotFoundError", "OptimStepResponse", "RestClient", "SampleResponse", "SampledSequence", "SamplingClient",
    "SamplingParams", "SaveWeightsForSamplerResponse", "SaveWeightsResponse", "ServerCapabilities", "ServerError",
    "ServiceClient", "StepMetrics", "TensorData", "TimeoutError", "TrainingClient", "TrainingRun", "TrioError", "Usage",
    "ValidationError",
]
