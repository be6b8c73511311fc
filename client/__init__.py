"""Python client for the speculative decoding ensemble, over Triton's gRPC and HTTP APIs (tritonclient).

    from client import Client, GenerationParams
    result = Client("localhost:8001", protocol="grpc").generate("Hello", GenerationParams(max_tokens=32))
    print(result.text, result.acceptance_rate, result.ttft_s)

`AsyncClient` is the asyncio twin for driving many concurrent requests.
"""

from client.core import (
    ClientError,
    GenerationParams,
    GenerationResult,
    GenerationTimeoutError,
    InvalidArgumentError,
    ModelNotReadyError,
    ServerBusyError,
    ServerUnavailableError,
)
from client.sync import Client
from client.aio import AsyncClient

__all__ = [
    "AsyncClient", "Client", "ClientError", "GenerationParams", "GenerationResult", "GenerationTimeoutError",
    "InvalidArgumentError", "ModelNotReadyError", "ServerBusyError", "ServerUnavailableError",
]
