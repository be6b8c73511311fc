"""loopback: the messages of a model's gRPC stream into its own server, built and read without a server."""

import numpy as np
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from specdec import tensor_names as tn
from specdec.triton import loopback


def test_a_request_carries_its_inputs_outputs_and_parameters_and_asks_for_the_final_flag():
    arrays = {tn.TEXT_INPUT: np.array([["héllo".encode()]], dtype=np.object_), tn.STREAM: np.array([[True]]),
              tn.NUM_DRAFT_TOKENS: np.array([[3]], dtype=np.int32)}
    message = loopback.stream_request("ensemble", arrays, [tn.TEXT_OUTPUT, tn.FINISH_REASON],
                                      {"temperature": 0.5, "max_tokens": 7, "ignore_eos": True, "stop": "x"},
                                      request_id="r1")
    assert message.model_name == "ensemble" and message.id == "r1"
    by_name = {tensor.name: (tensor, raw) for tensor, raw in zip(message.inputs, message.raw_input_contents)}
    text, raw = by_name[tn.TEXT_INPUT]
    assert (text.datatype, list(text.shape)) == ("BYTES", [1, 1])
    assert deserialize_bytes_tensor(raw).tolist() == ["héllo".encode()]
    stream, raw = by_name[tn.STREAM]
    assert (stream.datatype, np.frombuffer(raw, dtype=np.bool_).tolist()) == ("BOOL", [True])
    drafts, raw = by_name[tn.NUM_DRAFT_TOKENS]
    assert (drafts.datatype, np.frombuffer(raw, dtype=np.int32).tolist()) == ("INT32", [3])
    assert [output.name for output in message.outputs] == [tn.TEXT_OUTPUT, tn.FINISH_REASON]
    params = message.parameters
    assert params["temperature"].double_param == 0.5 and params["max_tokens"].int64_param == 7
    assert params["ignore_eos"].bool_param is True and params["stop"].string_param == "x"
    assert params["triton_enable_empty_final_response"].bool_param is True


def test_a_parameter_protocol_cannot_hold_is_refused_by_name():
    with pytest.raises(ValueError, match="request parameter 'stop'"):
        loopback.stream_request("ensemble", {}, [], {"stop": ["a", "b"]})


def _reply(outputs: dict[str, np.ndarray], final: bool) -> service_pb2.ModelStreamInferResponse:
    reply = service_pb2.ModelStreamInferResponse()
    response = reply.infer_response
    for name, array in outputs.items():
        response.outputs.add(name=name, datatype="BYTES" if array.dtype == np.object_ else "UINT64",
                             shape=list(array.shape))
        response.raw_output_contents.append(serialize_byte_tensor(array).item() if array.dtype == np.object_
                                            else array.tobytes())
    response.parameters["triton_final_response"].bool_param = final
    return reply


def test_a_reply_reads_back_as_arrays_and_says_whether_it_is_the_last():
    reply = _reply({tn.TEXT_OUTPUT: np.array([[b"ab"]], dtype=np.object_),
                    tn.GENERATION_ID: np.array([[42]], dtype=np.uint64)}, final=False)
    got = loopback.reply_outputs(reply)
    assert got[tn.TEXT_OUTPUT].tolist() == [[b"ab"]] and got[tn.GENERATION_ID].tolist() == [[42]]
    assert not loopback.is_final(reply)
    end = _reply({}, final=True)
    assert loopback.reply_outputs(end) == {} and loopback.is_final(end)
    assert not loopback.is_final(service_pb2.ModelStreamInferResponse())  # no parameter: not the last


def test_the_servers_address_is_the_configs_then_the_launchers_then_the_default(monkeypatch):
    monkeypatch.delenv(loopback.URL_ENV, raising=False)
    assert loopback.server_url("") == loopback.DEFAULT_URL
    monkeypatch.setenv(loopback.URL_ENV, "127.0.0.1:9101")
    assert loopback.server_url("") == "127.0.0.1:9101"
    assert loopback.server_url("10.0.0.2:8001") == "10.0.0.2:8001"
