"""A model's streamed call into another model of the same server through the server's own gRPC endpoint
(`ModelStreamInfer`), for where Triton 24.10's decoupled BLS is not safe to use.

Why not BLS: Triton 24.10's stub corrupts its heap on its decoupled BLS response path (`exec(decoupled=True)`:
every core shows its C++ threads, the response monitor building a response's numpy arrays, handed a corrupt
block by pymalloc; the bug itself was not found). `vllm_compatible`, which relayed the ensemble's stream that
way, crashed under sustained streamed traffic, and does not over this stream (measured in
docs/results/2026-12-07-vllm-compatible-loopback.md). A gRPC stream is read by the calling thread, like any
other Python code, and never enters that path.

Plain protobuf messages in and out (no `pb_utils`): unit-tested without a server.
"""

from __future__ import annotations

import os

import numpy as np
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

# The launcher puts its server's gRPC address here for the stubs (127.0.0.1:GRPC_PORT)
URL_ENV = "SPECDEC_SERVER_GRPC_URL"
DEFAULT_URL = "127.0.0.1:8001"  # tritonserver's default gRPC port
# Responses as large as the server sends them (gRPC's default cap is 4 MiB: a long logprobs JSON can pass it)
CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
# A stream that Triton has not ended this long after its final response is cancelled (it ends within ms)
READ_OUT_TIMEOUT_S = 30.0


def server_url(configured: str) -> str:
    """The server's own gRPC address: the model's config parameter if set, else the launcher's, else the
    default port on this host."""
    return configured or os.environ.get(URL_ENV, "") or DEFAULT_URL


def parameter_value(key: str, value) -> service_pb2.InferParameter:
    """A request parameter as Triton's gRPC protocol holds one (bool, integer, float or string)."""
    if isinstance(value, bool):
        return service_pb2.InferParameter(bool_param=value)
    if isinstance(value, int):
        return service_pb2.InferParameter(int64_param=value)
    if isinstance(value, float):
        return service_pb2.InferParameter(double_param=value)
    if isinstance(value, str):
        return service_pb2.InferParameter(string_param=value)
    raise ValueError(f"request parameter '{key}' must be a boolean, a number or a string, got {type(value).__name__}")


def stream_request(model: str, arrays: dict[str, np.ndarray], outputs: list[str], parameters: dict,
                   request_id: str = "") -> service_pb2.ModelInferRequest:
    """One request of a `ModelStreamInfer` stream to `model` (infer_request's), with Triton's empty final response
    turned on (the only way a stream says that a decoupled request has ended)."""
    message = infer_request(model, arrays, outputs, parameters, request_id)
    message.parameters["triton_enable_empty_final_response"].bool_param = True
    return message


def infer_request(model: str, arrays: dict[str, np.ndarray], outputs: list[str], parameters: dict,
                  request_id: str = "") -> service_pb2.ModelInferRequest:
    """A request to `model` (`ModelInfer`): its inputs (`arrays`, object arrays of bytes for strings), the
    outputs it asks for and the request's parameters."""
    message = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, array in arrays.items():
        tensor = message.inputs.add(name=name, datatype=np_to_triton_dtype(array.dtype))
        tensor.shape.extend(array.shape)
        if array.dtype == np.object_:
            message.raw_input_contents.append(serialize_byte_tensor(array).item() if array.size else b"")
        else:
            message.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    for name in outputs:
        message.outputs.add(name=name)
    for key, value in parameters.items():
        message.parameters[key].CopyFrom(parameter_value(key, value))
    return message


def reply_outputs(reply: service_pb2.ModelStreamInferResponse) -> dict[str, np.ndarray]:
    """A stream's response's outputs by name (strings as object arrays of bytes); {} for the empty final one."""
    response = reply.infer_response
    result = InferResult(response)
    return {output.name: result.as_numpy(output.name) for output in response.outputs}


def infer_outputs(reply: service_pb2.ModelInferResponse) -> dict[str, np.ndarray]:
    """A `ModelInfer` response's outputs by name (strings as object arrays of bytes)."""
    result = InferResult(reply)
    return {output.name: result.as_numpy(output.name) for output in reply.outputs}


def is_final(reply: service_pb2.ModelStreamInferResponse) -> bool:
    """Whether a response is its request's last (Triton's `triton_final_response` parameter)."""
    final = reply.infer_response.parameters.get("triton_final_response")
    return final is not None and final.bool_param
