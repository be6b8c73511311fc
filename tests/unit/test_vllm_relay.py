"""vllm_compatible's relay of the ensemble's gRPC stream: each response sent on as vLLM's backend shapes it, the
stream read to its end and never cancelled (Triton 24.10 keeps for good a request whose stream is cancelled
just after its final response), a client's cancellation passed on by generation id, a broken stream answered
UNAVAILABLE naming the endpoint. Fakes stand in for Triton's request, sender and pb_utils, and for the stream:
this is the relay's own logic (the integration tests run it against a real server)."""

from types import SimpleNamespace

import grpc
import numpy as np
from tritonclient.grpc import service_pb2
from tritonclient.utils import serialize_byte_tensor

from specdec import tensor_names as tn
from specdec.triton.vllm_compatible import VllmCompatibleAdapter

FINAL = 1


class TritonError:
    INVALID_ARG, UNAVAILABLE, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "INTERNAL"

    def __init__(self, message, code=INTERNAL):
        self.message, self.code = message, code


PB = SimpleNamespace(TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL, TritonError=TritonError,
                     Tensor=lambda name, value: (name, value),
                     InferenceResponse=lambda output_tensors=(), error=None: SimpleNamespace(
                         outputs=dict(output_tensors), error=error))


class Sender:
    def __init__(self, cancelled=False):
        self.sent, self.cancelled = [], cancelled

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled


class Tensor:
    def __init__(self, name, value):
        self._name, self._value = name, value

    def name(self):
        return self._name

    def as_numpy(self):
        return self._value


class Request:
    def __init__(self, sender, stream=True, outputs=(tn.TEXT_OUTPUT, tn.FINISH_REASON), finish_reason=False):
        self.sender, self.outputs = sender, outputs
        self._inputs = [Tensor(tn.TEXT_INPUT, np.array([b"Hi"], dtype=np.object_)),
                        Tensor(tn.STREAM, np.array([stream]))]
        if finish_reason:
            self._inputs.append(Tensor(tn.RETURN_FINISH_REASON, np.array([True])))

    def requested_output_names(self):  # (Triton lists them all where the client named none)
        return list(self.outputs)

    def inputs(self):
        return self._inputs

    def parameters(self):
        return "{}"

    def request_id(self):
        return "r1"

    def get_response_sender(self):
        return self.sender


def reply(text=None, finish="", final=False, error="", key=tn.GENERATION_ID):
    out = service_pb2.ModelStreamInferResponse(error_message=error)
    response = out.infer_response
    if text is not None:
        for name, array in ((tn.TEXT_OUTPUT, np.array([[text.encode()]], dtype=np.object_)),
                            (tn.FINISH_REASON, np.array([[finish.encode()]], dtype=np.object_))):
            response.outputs.add(name=name, datatype="BYTES", shape=[1, 1])
            response.raw_output_contents.append(serialize_byte_tensor(array).item())
        response.outputs.add(name=key, datatype="UINT64", shape=[1, 1])
        response.raw_output_contents.append(np.array([[5]], dtype=np.uint64).tobytes())
    response.parameters["triton_final_response"].bool_param = final
    return out


class Stream:
    """A ModelStreamInfer call: its replies in order (an exception among them is raised there)."""

    def __init__(self, replies):
        self.replies, self.ended, self.cancelled = replies, False, False

    def __iter__(self):
        for item in self.replies:
            if isinstance(item, Exception):
                raise item
            yield item
        self.ended = True  # read to its end: Triton ended the RPC

    def cancel(self):
        self.cancelled = True


class Broken(grpc.RpcError):
    """A call of the server's gRPC endpoint that failed with `code` (default: the endpoint is not there)."""

    def __init__(self, code=grpc.StatusCode.UNAVAILABLE, details="failed to connect to all addresses"):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class Endpoint:
    """The server's gRPC endpoint as the direct relay calls it: the two models' inputs, preprocessing's
    `input_ids` (or its refusal `refusal`); the messages it was sent."""

    TAKEN = {tn.PREPROCESSING: (tn.TEXT_INPUT, tn.STREAM, tn.SAMPLING_PARAMETERS),
             tn.SPECULATIVE_DECODING: (tn.INPUT_IDS, tn.STREAM, tn.SAMPLING_PARAMETERS, tn.RETURN_FINISH_REASON)}

    def __init__(self, refusal: grpc.RpcError | None = None):
        self.refusal, self.infers, self.streams = refusal, [], []

    def ModelConfig(self, request):
        response = service_pb2.ModelConfigResponse()
        response.config.name = request.name
        for name in self.TAKEN[request.name]:
            response.config.input.add(name=name)
        return response

    def ModelInfer(self, message):
        self.infers.append(message)
        if self.refusal is not None:
            raise self.refusal
        response = service_pb2.ModelInferResponse(model_name=message.model_name)
        response.outputs.add(name=tn.INPUT_IDS, datatype="INT32", shape=[1, 3])
        response.raw_output_contents.append(np.array([[4, 5, 6]], dtype=np.int32).tobytes())
        return response


def relay(replies, sender, request=None, endpoint: Endpoint | None = None):
    """The relay of `request` over `replies` (with an `endpoint`, direct: preprocessing, then
    speculative_decoding's stream; else the ensemble's)."""
    model = VllmCompatibleAdapter()
    cancelled = []
    model.pb, model.ensemble, model.url = PB, tn.ENSEMBLE, "127.0.0.1:9"
    model.direct, model._taken, model._endpoint = endpoint is not None, {}, lambda: endpoint
    model.cancellations = SimpleNamespace(cancel=cancelled.append)
    stream = Stream(replies)

    def stream_of(message):
        if endpoint is not None:
            endpoint.streams.append(message)
        return stream
    model._stream = stream_of
    model._relay(request or Request(sender))
    return stream, cancelled


def test_each_response_is_sent_on_and_the_stream_is_read_to_its_end_never_cancelled():
    sender = Sender()
    stream, cancelled = relay([reply("He"), reply("llo", finish="length"), reply(final=True)], sender)
    assert [(r.outputs[tn.TEXT_OUTPUT].tolist(), flags) for r, flags in sender.sent] == [([b"He"], 0),
                                                                                         ([b"llo"], FINAL)]
    assert stream.ended and not stream.cancelled and cancelled == []


def test_only_the_outputs_the_client_asked_for_are_sent():
    """return_finish_reason with only text_output asked for: finish_reason is left out here, not by the stub's
    send (which drops it without the GIL: orchestrator._response)."""
    for outputs, expected in (((tn.TEXT_OUTPUT,), {tn.TEXT_OUTPUT}),
                              ((tn.TEXT_OUTPUT, tn.FINISH_REASON), {tn.TEXT_OUTPUT, tn.FINISH_REASON})):
        sender = Sender()
        relay([reply("He"), reply("llo", finish="length"), reply(final=True)], sender,
              Request(sender, outputs=outputs, finish_reason=True))
        assert [set(r.outputs) for r, _ in sender.sent] == [expected, expected]


def test_a_client_cancellation_reaches_the_generation_and_the_stream_is_still_read_out():
    sender = Sender(cancelled=True)
    stream, cancelled = relay([reply("He"), reply("", finish="cancelled"), reply(final=True)], sender)
    assert cancelled == [5] and stream.ended and not stream.cancelled
    assert sender.sent[-1][1] == FINAL


def test_the_ensembles_error_is_sent_once_with_its_code():
    sender = Sender()
    stream, _ = relay([reply(error="in ensemble 'ensemble', input 'top_p' must be within (0, 1]", final=True)],
                      sender)
    [(response, flags)] = sender.sent
    assert flags == FINAL and response.error.code == TritonError.INVALID_ARG and "top_p" in response.error.message


def test_a_broken_stream_is_answered_unavailable_naming_the_endpoint():
    sender = Sender()
    relay([reply("He"), Broken()], sender)
    (first, flags0), (failure, flags1) = sender.sent
    assert flags0 == 0 and flags1 == FINAL and failure.error.code == TritonError.UNAVAILABLE
    assert "127.0.0.1:9" in failure.error.message and "UNAVAILABLE" in failure.error.message


# ---- direct (the default): preprocessing, then speculative_decoding's stream --------------------------------


def test_direct_asks_preprocessing_for_the_prompts_tokens_and_streams_speculative_decoding_with_them():
    sender, endpoint = Sender(cancelled=True), Endpoint()
    request = Request(sender, finish_reason=True)
    stream, cancelled = relay([reply("He", key=tn.SEQUENCE_ID), reply("", finish="cancelled", key=tn.SEQUENCE_ID),
                               reply(final=True)], sender, request, endpoint)
    [infer], [message] = endpoint.infers, endpoint.streams
    assert infer.model_name == tn.PREPROCESSING and [each.name for each in infer.inputs] == [tn.TEXT_INPUT, tn.STREAM]
    assert [each.name for each in infer.outputs] == [tn.INPUT_IDS]
    assert "triton_enable_empty_final_response" not in infer.parameters  # (a unary call)
    assert message.model_name == tn.SPECULATIVE_DECODING
    assert [each.name for each in message.inputs] == [tn.INPUT_IDS, tn.STREAM, tn.RETURN_FINISH_REASON]
    assert np.frombuffer(message.raw_input_contents[0], dtype=np.int32).tolist() == [4, 5, 6]
    # the generation's id under speculative_decoding's name, the cancel passed on by it
    assert tn.SEQUENCE_ID in [each.name for each in message.outputs]
    assert tn.GENERATION_ID not in [each.name for each in message.outputs]
    assert cancelled == [5] and stream.ended and not stream.cancelled
    assert sender.sent[0][0].outputs[tn.TEXT_OUTPUT].tolist() == [b"He"]


def test_a_refusal_of_preprocessing_is_the_requests_error_and_nothing_is_streamed():
    refused = Broken(grpc.StatusCode.INVALID_ARGUMENT,
                     "preprocessing: input 'sampling_parameters' key 'truncate_prompt_tokens' must be an integer")
    for refusal, code, says in ((refused, TritonError.INVALID_ARG, "truncate_prompt_tokens"),
                                (Broken(), TritonError.UNAVAILABLE, "127.0.0.1:9"),
                                (Broken(grpc.StatusCode.NOT_FOUND, "unknown model"), TritonError.UNAVAILABLE,
                                 "NOT_FOUND"),
                                (Broken(grpc.StatusCode.INTERNAL, "something unforeseen"), TritonError.INTERNAL,
                                 "unforeseen")):
        sender, endpoint = Sender(), Endpoint(refusal)
        relay([], sender, endpoint=endpoint)
        [(response, flags)] = sender.sent
        assert flags == FINAL and response.error.code == code and says in response.error.message
        assert endpoint.streams == []
