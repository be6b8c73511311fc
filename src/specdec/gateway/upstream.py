"""The gateway's way to the server: one gRPC stream (`ModelStreamInfer`, from asyncio) per request, cancelled
when the request's caller goes away before its final response. The stream is the ensemble's, or with `direct`
(what the launcher runs) `speculative_decoding`'s after one call to `preprocessing` for the prompt's tokens: the
text then comes from the orchestrator's own `text_output`, without the ensemble's `postprocessing` step for every
streamed response (docs/results/2026-12-07-openai-direct.md), and a caller that leaves reaches the generation
through its response sender's flag instead of postprocessing's.

After the final response (or an error) a stream is never cancelled: Triton 24.10's gRPC frontend keeps for
good a request whose RPC is cancelled between its last response and Triton's end of the RPC (its memory, and
the ensemble then never unloads: the server's stop waits its exit timeout; docs/api.md). A caller
that leaves at that moment (a client that disconnects on its last chunk) hands the rest of the stream to a
task of its own that reads it to its end (`_read_out`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from specdec import tensor_names as tn
from specdec.gateway.protocol import STATS, ApiError, server_error

_COUNTS = (tn.NUM_INPUT_TOKENS, tn.NUM_OUTPUT_TOKENS, tn.NUM_CACHED_TOKENS)  # usage's
_INT_STATS = (*_COUNTS, tn.NUM_ROUNDS, tn.TOTAL_DRAFT_TOKENS, tn.TOTAL_ACCEPTED_DRAFT_TOKENS)
_STAT_NAMES = frozenset((*_COUNTS, *STATS))
_OUTPUTS = (tn.TEXT_OUTPUT, tn.OUTPUT_IDS, tn.FINISH_REASON, *_COUNTS, *STATS)
READ_OUT_TIMEOUT_S = 30.0  # a stream past its final response that Triton has not ended by then is cancelled
READ_OUT_AT_CLOSE_S = 5.0  # how long closing waits for them (Triton ends such an RPC within milliseconds)
_READING_OUT: set[asyncio.Task] = set()  # the tasks `_read_out` started (the loop keeps only weak references)


@dataclass
class Piece:
    """One response of the ensemble: a text delta, its tokens and (on request) their log-probabilities;
    the last one also says why generation ended and carries the statistics."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    # with top log-probabilities: per token its position's most likely tokens and their log-probabilities
    top_ids: list[list[int]] = field(default_factory=list)
    top_log_probs: list[list[float]] = field(default_factory=list)
    # with the prompt's log-probabilities (the first response): its tokens, each one's after the first
    # (None for the first, which has no context: as OpenAI's echo lists them) and their positions' top rows
    prompt_ids: list[int] = field(default_factory=list)
    prompt_log_probs: list[float | None] = field(default_factory=list)
    prompt_ranks: list[int | None] = field(default_factory=list)  # each's rank there (1: the most likely)
    prompt_top_ids: list[list[int] | None] = field(default_factory=list)
    prompt_top_log_probs: list[list[float] | None] = field(default_factory=list)
    finish_reason: str = ""
    stats: dict[str, float] = field(default_factory=dict)

    def add(self, piece: "Piece") -> None:
        """Append the next response of the same generation: a whole answer is its responses added up."""
        if piece.prompt_ids:  # the first response's
            self.prompt_ids, self.prompt_log_probs = piece.prompt_ids, piece.prompt_log_probs
            self.prompt_ranks = piece.prompt_ranks
            self.prompt_top_ids, self.prompt_top_log_probs = piece.prompt_top_ids, piece.prompt_top_log_probs
        self.text += piece.text
        self.ids += piece.ids
        self.log_probs += piece.log_probs
        self.top_ids += piece.top_ids
        self.top_log_probs += piece.top_log_probs
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.stats.update(piece.stats)


def _inputs(arrays: dict[str, np.ndarray]) -> list[InferInput]:
    out = []
    for name, array in arrays.items():
        tensor = InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


_NUMBERS = {"INT32": "<i4", "FP32": "<f4", "INT64": "<i8", "FP64": "<f8"}


def _strings(raw: bytes) -> list[bytes]:
    """A BYTES tensor's raw form: each element a 4-byte little-endian length, then its bytes."""
    out, at = [], 0
    while at < len(raw):
        size = int.from_bytes(raw[at:at + 4], "little")
        out.append(raw[at + 4:at + 4 + size])
        at += 4 + size
    return out


def _piece(result) -> Piece:
    """One response's outputs, read in one pass over the message (tritonclient's as_numpy looks each name up
    anew: with ten outputs per response that was a fifth of the gateway's time per chunk)."""
    response = result.get_response()
    piece = Piece()
    for output, raw in zip(response.outputs, response.raw_output_contents):
        name = output.name
        if output.datatype == "BYTES":
            values = _strings(raw)
            if name == tn.TEXT_OUTPUT:
                piece.text = b"".join(values).decode("utf-8")
            elif name == tn.FINISH_REASON and values:
                piece.finish_reason = values[0].decode()
            continue
        values = np.frombuffer(raw, dtype=_NUMBERS[output.datatype])
        if name == tn.OUTPUT_IDS:
            piece.ids = values.tolist()
        elif name == tn.OUTPUT_LOG_PROBS:
            piece.log_probs = values.tolist()
        elif name in (tn.OUTPUT_TOP_IDS, tn.OUTPUT_TOP_LOG_PROBS):  # (1, tokens, n)
            rows = values.reshape(-1, int(output.shape[-1])).tolist() if values.size else []
            if name == tn.OUTPUT_TOP_IDS:
                piece.top_ids = rows
            else:
                piece.top_log_probs = rows
        elif name == tn.OUTPUT_PROMPT_IDS:
            piece.prompt_ids = values.tolist()
        elif name == tn.OUTPUT_PROMPT_LOG_PROBS:
            piece.prompt_log_probs = [None] + values.tolist()
        elif name == tn.OUTPUT_PROMPT_RANKS:
            piece.prompt_ranks = [None] + values.tolist()
        elif name in (tn.OUTPUT_PROMPT_TOP_IDS, tn.OUTPUT_PROMPT_TOP_LOG_PROBS):  # (1, tokens - 1, n)
            rows = [None] + (values.reshape(-1, int(output.shape[-1])).tolist() if values.size else [])
            if name == tn.OUTPUT_PROMPT_TOP_IDS:
                piece.prompt_top_ids = rows
            else:
                piece.prompt_top_log_probs = rows
        elif values.size and name in _STAT_NAMES:
            piece.stats[name] = int(values[0]) if name in _INT_STATS else float(values[0])
    return piece


def _is_final(result) -> bool:
    final = result.get_response().parameters.get("triton_final_response")
    return final is not None and final.bool_param


def _read_out(responses) -> None:
    """Read a stream whose final response (or error) has come to its end, on a task of its own, so that the
    caller leaving now cancels nothing; cancel it only where Triton has not ended it READ_OUT_TIMEOUT_S later."""
    async def read() -> None:
        async def to_end() -> None:
            async for _ in responses:
                pass
        try:
            await asyncio.wait_for(to_end(), READ_OUT_TIMEOUT_S)
        except asyncio.TimeoutError:
            responses.cancel()
        except Exception:  # noqa: BLE001 - the answer is complete: how its stream ended does not matter
            pass

    task = asyncio.get_running_loop().create_task(read())
    _READING_OUT.add(task)
    task.add_done_callback(_READING_OUT.discard)


class Upstream:
    """The server at `url` (gRPC host:port): its ensemble, or with `direct` preprocessing, then
    speculative_decoding."""

    def __init__(self, url: str, direct: bool = False):
        self.url, self.direct = url, direct
        self.models = (tn.PREPROCESSING, tn.SPECULATIVE_DECODING) if direct else (tn.ENSEMBLE,)
        self._client: grpcaio.InferenceServerClient | None = None
        self._taken: dict[str, frozenset[str]] = {}  # the inputs preprocessing and speculative_decoding take

    @property
    def client(self) -> grpcaio.InferenceServerClient:
        # Made on first use: a gRPC asyncio channel belongs to the event loop it was made on (the server's).
        if self._client is None:
            self._client = grpcaio.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if _READING_OUT:  # closing the channel cancels their RPCs: let Triton end them first (it takes a moment)
            await asyncio.wait(set(_READING_OUT), timeout=READ_OUT_AT_CLOSE_S)
        if self._client is not None:
            await self._client.close()

    async def ready(self) -> bool:
        try:
            for model in self.models:
                if not await self.client.is_model_ready(model, client_timeout=2.0):
                    return False
            return True
        except Exception:  # noqa: BLE001 - any failure to answer is "not ready"
            return False

    async def _taking(self, model: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Those of the ensemble's inputs `arrays` that `model` takes (its config's, asked once), as the ensemble
        hands them on."""
        if model not in self._taken:
            config = await self.client.get_model_config(model, as_json=True)
            self._taken[model] = frozenset(each["name"] for each in config["config"]["input"])
        return {name: array for name, array in arrays.items() if name in self._taken[model]}

    async def _direct_inputs(self, arrays: dict[str, np.ndarray], request_id: str) -> dict[str, np.ndarray]:
        """The ensemble's inputs `arrays` as speculative_decoding's: preprocessing's `input_ids` for those it takes
        (its checks and refusals, as the ensemble's first step), and those speculative_decoding takes."""
        try:
            result = await self.client.infer(tn.PREPROCESSING, _inputs(await self._taking(tn.PREPROCESSING, arrays)),
                                             outputs=[InferRequestedOutput(tn.INPUT_IDS)], request_id=request_id)
            return {tn.INPUT_IDS: result.as_numpy(tn.INPUT_IDS),
                    **await self._taking(tn.SPECULATIVE_DECODING, arrays)}
        except InferenceServerException as exc:
            # a refused input names its field; a server that cannot be reached, or a model of it being restored
            # (not found meanwhile), is unavailable (retry)
            gone = any(code in str(exc.status()) for code in ("UNAVAILABLE", "NOT_FOUND"))
            raise server_error(exc.message() or str(exc), unavailable=gone) from None

    async def generate(self, arrays: dict[str, np.ndarray], log_probs: bool, top: bool = False,
                       request_id: str = "") -> AsyncIterator[Piece]:
        """The request's responses as they come (with the prompt's log-probabilities when its inputs ask for
        them), under Triton's `request_id` (its logs' and traces'; "": none). Closing the iterator early (the
        caller went away) cancels the request on the server, which frees its sequence within a round."""
        outputs = [InferRequestedOutput(name) for name in _OUTPUTS]
        if log_probs:
            outputs.append(InferRequestedOutput(tn.OUTPUT_LOG_PROBS))
        if top:
            outputs += [InferRequestedOutput(tn.OUTPUT_TOP_IDS), InferRequestedOutput(tn.OUTPUT_TOP_LOG_PROBS)]
        if tn.RETURN_PROMPT_LOG_PROBS in arrays:
            outputs += [InferRequestedOutput(name) for name in (tn.OUTPUT_PROMPT_IDS, tn.OUTPUT_PROMPT_LOG_PROBS,
                                                                tn.OUTPUT_PROMPT_RANKS)]
            if top:
                outputs += [InferRequestedOutput(tn.OUTPUT_PROMPT_TOP_IDS),
                            InferRequestedOutput(tn.OUTPUT_PROMPT_TOP_LOG_PROBS)]
        elif tn.RETURN_PROMPT_IDS in arrays:
            outputs.append(InferRequestedOutput(tn.OUTPUT_PROMPT_IDS))
        model = tn.ENSEMBLE
        if self.direct:
            model, arrays = tn.SPECULATIVE_DECODING, await self._direct_inputs(arrays, request_id)
        request = {"model_name": model, "inputs": _inputs(arrays), "outputs": outputs,
                   "enable_empty_final_response": True, "request_id": request_id}

        async def requests():
            yield request

        responses = self.client.stream_infer(requests())
        failure, finished = None, False
        try:
            async for result, error in responses:
                finished = error is not None or _is_final(result)
                if finished:  # the rest of the stream is read on another task, never cancelled (see above)
                    _read_out(responses)
                if error is not None:
                    failure = error
                elif result.get_response().outputs:
                    yield _piece(result)
                if finished:
                    break
        except InferenceServerException as exc:
            raise server_error(exc.message() or str(exc), unavailable=True) from None
        finally:
            if not finished:
                responses.cancel()
        if failure is not None:
            message = failure.message() if hasattr(failure, "message") else str(failure)
            raise server_error(message or str(failure))
        if not finished:
            raise ApiError(503, "the server ended the stream without a final response", code="unavailable")
