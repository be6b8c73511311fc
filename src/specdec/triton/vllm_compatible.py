"""Triton adapter for `vllm_compatible`: vLLM's Triton backend's interface over the ensemble's models, for its
clients as they are. vLLM's backend model has max_batch_size 0, so its clients send [1]-shaped tensors, which the
batching models refuse; this decoupled model takes them, calls the server's models with its inputs batch-shaped
(through the server's own gRPC endpoint: loopback.py says why not BLS): `preprocessing`, then a stream of
`speculative_decoding`, whose responses carry their text (upstream "direct", the default: no `postprocessing`
step per response), or the `ensemble`'s stream (upstream "ensemble"); and answers with vLLM's outputs and
meanings: `text_output` with the prompt before it when not streamed (unless exclude_input_in_output), the
additional outputs only with their return_* flags, num_input_tokens and num_output_tokens as UINT32. A
client's cancellation goes on to the generation through the cancellation board, keyed by the generation's id:
the inner stream is never cancelled, but read to its end (Triton 24.10 keeps for good a request whose stream is
cancelled just after its final response; docs/api.md, "Cancellation").
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import threading
from dataclasses import dataclass

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from specdec import tensor_names as tn
from specdec.triton.adapter import TritonAdapter
from specdec.triton.admission.cancellation import CancellationBoard
from specdec.triton.config import ModelParameters
from specdec.triton import loopback, vllm_outputs
from specdec.triton.inputs import InputError, InputLookup, Inputs

# This server's own inputs that vllm_compatible takes beside vLLM's ([1]-shaped too): the draft, its length and width,
# whether the length adapts
SPECULATION_INPUTS = (tn.DRAFT_MODEL, tn.NUM_DRAFT_TOKENS, tn.NUM_DRAFT_BRANCHES, tn.ADAPTIVE_DRAFT)
# Finish reasons that mean "not finished": this server's own ("") and vLLM's (with its flag)
NOT_FINISHED = ("", vllm_outputs.NOT_FINISHED)


@dataclass(frozen=True)
class VllmRequest:
    """One request in vLLM's backend's form, validated."""

    prompt: str
    stream: bool
    prepend: bool  # text_output starts with the prompt (vLLM's default when not streamed)
    flags: frozenset[str]  # its return_* flags that are true
    settings: str | None  # the sampling_parameters JSON
    parameters: dict  # the request's parameters (read as the settings when sampling_parameters is not sent)
    speculation: dict = dataclasses.field(default_factory=dict)  # this server's own inputs (SPECULATION_INPUTS)

    @classmethod
    def parse(cls, lookup: InputLookup, parameters: str = "") -> VllmRequest:
        inputs = Inputs(lookup)
        prompts = inputs.strings(tn.TEXT_INPUT)
        if len(prompts) != 1:
            raise InputError(f"input '{tn.TEXT_INPUT}' must hold exactly one string, got {len(prompts)}")
        stream = bool(inputs.scalar(tn.STREAM, np.bool_, False))
        exclude = inputs.scalar(tn.EXCLUDE_INPUT_IN_OUTPUT, np.bool_, None)
        prepend = not stream if exclude is None else not exclude
        if prepend and stream:
            raise InputError(f"input '{tn.EXCLUDE_INPUT_IN_OUTPUT}' false is not allowed when streaming (as in vLLM's "
                             f"backend: the prompt would have to come before every chunk)")
        flags = frozenset(name for name in tn.VLLM_OUTPUT_FLAGS if inputs.scalar(name, np.bool_, False))
        settings = inputs.strings(tn.SAMPLING_PARAMETERS)
        if len(settings) > 1:
            raise InputError(f"input '{tn.SAMPLING_PARAMETERS}' must hold exactly one JSON string, got {len(settings)}")
        speculation = {name: value.reshape(1, -1) for name in SPECULATION_INPUTS
                       if (value := lookup(name)) is not None}  # checked by the ensemble, by name
        return cls(prompts[0], stream, prepend, flags, settings[0] if settings else None,
                   json.loads(parameters) if parameters else {}, speculation)

    def ensemble_inputs(self) -> dict[str, np.ndarray]:
        """The ensemble's inputs, batch-shaped: the prompt, stream, the settings and the flags (the
        orchestrator computes what they ask for)."""
        arrays = {tn.TEXT_INPUT: np.array([[self.prompt.encode()]], dtype=np.object_),
                  tn.STREAM: np.array([[self.stream]]), **{flag: np.array([[True]]) for flag in self.flags},
                  **self.speculation}
        if self.settings is not None:
            arrays[tn.SAMPLING_PARAMETERS] = np.array([[self.settings.encode()]], dtype=np.object_)
        return arrays

    def requested_outputs(self) -> list[str]:
        return [tn.TEXT_OUTPUT, tn.FINISH_REASON, tn.NUM_INPUT_TOKENS, tn.NUM_OUTPUT_TOKENS, tn.GENERATION_ID,
                *([tn.CUMULATIVE_LOGPROB] if tn.RETURN_CUMULATIVE_LOGPROB in self.flags else []),
                *([tn.LOGPROBS] if tn.RETURN_LOGPROBS in self.flags else [])]

    def outputs(self, got: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """vLLM's outputs of one ensemble response (`got`: its outputs by name), shaped as vLLM's backend
        shapes them ([1] each, no batch dimension)."""
        text = "".join(item.decode() if isinstance(item, bytes) else str(item)
                       for item in got[tn.TEXT_OUTPUT].reshape(-1))
        out = {tn.TEXT_OUTPUT: np.array([(self.prompt + text if self.prepend else text).encode()], dtype=np.object_)}
        if tn.RETURN_FINISH_REASON in self.flags:
            out[tn.FINISH_REASON] = got[tn.FINISH_REASON].reshape(-1)
        if tn.RETURN_CUMULATIVE_LOGPROB in self.flags:
            out[tn.CUMULATIVE_LOGPROB] = got[tn.CUMULATIVE_LOGPROB].reshape(-1).astype(np.float32)
        if tn.RETURN_LOGPROBS in self.flags:
            out[tn.LOGPROBS] = got[tn.LOGPROBS].reshape(-1)
        for flag, name in ((tn.RETURN_NUM_INPUT_TOKENS, tn.NUM_INPUT_TOKENS),
                           (tn.RETURN_NUM_OUTPUT_TOKENS, tn.NUM_OUTPUT_TOKENS)):
            if flag in self.flags:
                out[name] = got[name].reshape(-1).astype(np.uint32)
        return out


def finished(got: dict[str, np.ndarray]) -> bool:
    """Whether an ensemble response is its generation's last (it carries a finish reason)."""
    reason = got[tn.FINISH_REASON].reshape(-1)[0]
    return (reason.decode() if isinstance(reason, bytes) else str(reason)) not in NOT_FINISHED


def error_code(pb, message: str):
    """A BLS error keeps its message, not its code: capacity and restoring refusals say so (UNAVAILABLE, as
    the ensemble answers them), an error naming an input or parameter is the request's (INVALID_ARG)."""
    if tn.RETRY_LATER in message or tn.MODEL_DOWN in message:
        return pb.TritonError.UNAVAILABLE
    if any(word in message for word in ("input '", "inputs '", "request parameter '")):
        return pb.TritonError.INVALID_ARG
    return pb.TritonError.INTERNAL


class VllmCompatibleAdapter(TritonAdapter):
    def load(self, params: ModelParameters, args: dict) -> None:
        self.ensemble = params.str("ensemble", tn.ENSEMBLE)
        self.direct = params.str("upstream", "direct", choices=tn.UPSTREAMS) == "direct"
        self._taken: dict[str, frozenset[str]] = {}  # the inputs preprocessing and speculative_decoding take
        self.url = loopback.server_url(params.str("server_grpc_url", ""))
        self.cancellations = CancellationBoard()
        # A request is relayed on a thread of its own: the ensemble's responses come from a blocking iterator
        # (waiting with the GIL released), each sent on as it arrives. Past this many streams at once,
        # requests wait for a thread.
        self.relays = concurrent.futures.ThreadPoolExecutor(
            max_workers=params.int("max_streams", 256, low=1), thread_name_prefix="vllm-relay")
        # One channel for every stream (HTTP/2 carries them side by side), opened at the first request: the
        # server's endpoint is not up while it loads its models
        self._channel_lock = threading.Lock()
        self._server: service_pb2_grpc.GRPCInferenceServiceStub | None = None

    def execute(self, requests):
        for request in requests:
            self.relays.submit(self._relay, request)
        return None

    def finalize(self):
        self.relays.shutdown(wait=True)
        super().finalize()

    def _endpoint(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        with self._channel_lock:
            if self._server is None:
                channel = grpc.insecure_channel(self.url, options=loopback.CHANNEL_OPTIONS)
                self._server = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return self._server

    def _stream(self, message):
        return self._endpoint().ModelStreamInfer(iter([message]))

    def _infer(self, message) -> service_pb2.ModelInferResponse:
        return self._endpoint().ModelInfer(message)

    def _taking(self, model: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Those of the ensemble's inputs `arrays` that `model` takes (its config's, asked once)."""
        if model not in self._taken:
            config = self._endpoint().ModelConfig(service_pb2.ModelConfigRequest(name=model)).config
            self._taken[model] = frozenset(each.name for each in config.input)
        return {name: array for name, array in arrays.items() if name in self._taken[model]}

    def _upstream_request(self, req: VllmRequest, request_id: str):
        """The stream request that generates `req`, and the output naming its generation: the ensemble's, or
        (direct) speculative_decoding's for preprocessing's `input_ids` (a call of its own; grpc.RpcError where it
        refuses the request or cannot be reached)."""
        arrays, outputs = req.ensemble_inputs(), req.requested_outputs()
        if not self.direct:
            return loopback.stream_request(self.ensemble, arrays, outputs, req.parameters, request_id), tn.GENERATION_ID
        ids = loopback.infer_outputs(self._infer(loopback.infer_request(
            tn.PREPROCESSING, self._taking(tn.PREPROCESSING, arrays), [tn.INPUT_IDS], req.parameters, request_id)))
        arrays = {tn.INPUT_IDS: ids[tn.INPUT_IDS], **self._taking(tn.SPECULATIVE_DECODING, arrays)}
        outputs = [tn.SEQUENCE_ID if name == tn.GENERATION_ID else name for name in outputs]  # (the ensemble's name)
        return loopback.stream_request(tn.SPECULATIVE_DECODING, arrays, outputs, req.parameters, request_id), \
            tn.SEQUENCE_ID

    def _relay(self, request) -> None:
        pb = self.pb
        sender = request.get_response_sender()
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        done = False
        try:
            inputs = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
            # Only what the caller asked for: the stub drops the rest inside send without the GIL, from this
            # thread while others run Python, and corrupts its heap (orchestrator._response says more)
            wanted = frozenset(request.requested_output_names())
            try:
                req = VllmRequest.parse(inputs.get, request.parameters())
                # (the request's parameters passed on: the orchestrator reads them)
                message, generation = self._upstream_request(req, request.request_id())
            except (InputError, ValueError) as exc:
                sender.send(pb.InferenceResponse(error=pb.TritonError(str(exc), pb.TritonError.INVALID_ARG)),
                            flags=final)
                return
            except grpc.RpcError as exc:  # preprocessing refused the request, or is not there (retry)
                gone = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
                sender.send(pb.InferenceResponse(error=pb.TritonError(
                    f"{tn.VLLM_COMPATIBLE}: {tn.PREPROCESSING} through the server's gRPC endpoint {self.url} failed: "
                    f"{exc.code().name}: {exc.details()}" if gone else exc.details(),
                    pb.TritonError.UNAVAILABLE if gone else pb.TritonError.INVALID_ARG
                    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else error_code(pb, exc.details()))), flags=final)
                return
            stream = self._stream(message)
            read_out = None  # after the last response: cancels a stream Triton has not ended in time
            try:
                for reply in stream:
                    if loopback.is_final(reply) and read_out is None:
                        read_out = threading.Timer(loopback.READ_OUT_TIMEOUT_S, stream.cancel)
                        read_out.daemon = True
                        read_out.start()
                    if done:
                        continue  # the ensemble's own end, after the last response went out
                    if reply.error_message:
                        error = reply.error_message
                        sender.send(pb.InferenceResponse(error=pb.TritonError(error, error_code(pb, error))),
                                    flags=final)
                        done = True
                        continue
                    got = loopback.reply_outputs(reply)
                    if tn.TEXT_OUTPUT not in got:
                        continue  # an empty response: the ensemble's end
                    done = finished(got)
                    sender.send(pb.InferenceResponse(output_tensors=[
                        pb.Tensor(name, value) for name, value in req.outputs(got).items() if name in wanted]),
                        flags=final if done else 0)
                    if not done and sender.is_cancelled():  # the orchestrator stops at its next round
                        self.cancellations.cancel(int(got[generation].reshape(-1)[0]))
            except grpc.RpcError as exc:
                if not done:  # the server's endpoint is not there, or the stream broke
                    sender.send(pb.InferenceResponse(error=pb.TritonError(
                        f"{tn.VLLM_COMPATIBLE}: the ensemble's stream through the server's gRPC endpoint {self.url} "
                        f"failed: {exc.code().name}: {exc.details()}", pb.TritonError.UNAVAILABLE)), flags=final)
                    done = True
            finally:
                if read_out is not None:
                    read_out.cancel()
        except Exception as exc:  # noqa: BLE001 - the request fails, the model keeps serving
            if not done:
                sender.send(pb.InferenceResponse(error=pb.TritonError(f"{tn.VLLM_COMPATIBLE}: {exc}",
                                                                      pb.TritonError.INTERNAL)), flags=final)
                done = True
        if not done:  # ended without a last response
            sender.send(flags=final)
