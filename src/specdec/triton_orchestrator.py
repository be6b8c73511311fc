"""Triton adapter for `speculative_decoding`: a decoupled BLS model running `orchestrator.generate`.

`execute` is a coroutine (decoupled async execute, Triton 24.04+): each request runs as its own task
on the stub's event loop and awaits its BLS calls with `async_exec`, so one instance interleaves the
rounds of many requests instead of blocking on one. Non-streaming requests get one response; with
`stream` each round's text-complete tokens go out as soon as they are accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import numpy as np

from specdec import tensor_names as tn
from specdec.bls import BlsProposer, BlsScorer
from specdec.config import ModelParameters
from specdec.orchestrator import GenerationRequest, Stats, generate
from specdec.sampling import SamplingParams
from specdec.text import StreamChunker, load_tokenizer


class InputError(ValueError):
    """A bad request input; the message names the field."""


class SpeculativeDecodingAdapter:
    def initialize(self, args):
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        params = ModelParameters(args["model_config"])
        self.tokenizer = load_tokenizer(params.str("tokenizer_path"))
        self.max_context = params.int("max_context_tokens", 2048, low=2)
        self.max_max_tokens = params.int("max_max_tokens", tn.DEFAULT_MAX_MAX_TOKENS, low=1)
        self.default_max_tokens = params.int("default_max_tokens", tn.DEFAULT_MAX_TOKENS, low=1,
                                             high=self.max_max_tokens)
        self.max_num_draft_tokens = params.int("max_num_draft_tokens", tn.DEFAULT_MAX_NUM_DRAFT_TOKENS, low=0)
        self.default_num_draft_tokens = params.int("default_num_draft_tokens", tn.DEFAULT_NUM_DRAFT_TOKENS,
                                                   low=0, high=self.max_num_draft_tokens)
        timeout_us = params.int("bls_timeout_us", 0, low=0)
        draft_names = params.list("draft_models", tn.DRAFT_MODEL_NAME)
        if not draft_names:
            raise ValueError(f"{params.model_name}: parameter 'draft_models' lists no model")
        self.proposers = {name: BlsProposer(pb_utils, name, timeout_us) for name in draft_names}
        self.default_draft = draft_names[0]
        self.scorer = BlsScorer(pb_utils, params.str("target_model", tn.TARGET_MODEL_NAME), timeout_us)
        eos = self.tokenizer.eos_token_id
        self.default_end_ids = frozenset([] if eos is None else [int(eos)])

    async def execute(self, requests):
        await asyncio.gather(*(self._serve(request) for request in requests))
        return None

    # ---- one request -----------------------------------------------------------------------------
    async def _serve(self, request):
        pb = self.pb
        sender = request.get_response_sender()
        try:
            gen_request, stream = self._parse(request)
        except InputError as exc:
            sender.send(pb.InferenceResponse(error=pb.TritonError(str(exc), pb.TritonError.INVALID_ARG)),
                        flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        proposer = self.proposers[self._draft_name(request)]
        stats = Stats()
        chunker = StreamChunker(self.tokenizer)
        output: list[int] = []
        finish = None
        try:
            async with contextlib.aclosing(generate(gen_request, proposer, self.scorer, stats)) as rounds:
                async for rnd in rounds:
                    output += rnd.new_tokens
                    finish = rnd.finish_reason
                    if stream and not finish:
                        chunk = chunker.push(rnd.new_tokens, final=False)
                        if chunk:
                            sender.send(self._response(chunk[0], chunk[1], gen_request, output, stats, None))
                    if not finish and (sender.is_cancelled() or request.is_cancelled()):
                        finish = tn.FINISH_CANCELLED
                        break
        except Exception as exc:  # noqa: BLE001 - the request fails, the server keeps serving
            sender.send(pb.InferenceResponse(error=pb.TritonError(f"speculative_decoding: {exc}")),
                        flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        if stream:
            chunk = chunker.push(output[len(chunker.emitted) + len(chunker.pending):], final=True) or ([], [])
            final = self._response(chunk[0], chunk[1], gen_request, output, stats, finish)
        else:
            final = self._response(output, [], gen_request, output, stats, finish)
        sender.send(final, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _response(self, ids, prefix, req: GenerationRequest, output, stats: Stats, finish):
        pb = self.pb

        def i32(value):
            return pb.Tensor(value[0], np.asarray(value[1], dtype=np.int32).reshape(1, -1))

        tensors = [
            i32((tn.OUTPUT_IDS, ids)),
            i32((tn.PREFIX_IDS, prefix)),
            i32((tn.NUM_INPUT_TOKENS, [len(req.prompt_ids)])),
            i32((tn.NUM_OUTPUT_TOKENS, [len(output)])),
            i32((tn.TOTAL_DRAFT_TOKENS, [stats.drafted])),
            i32((tn.TOTAL_ACCEPTED_DRAFT_TOKENS, [stats.accepted])),
            i32((tn.NUM_ROUNDS, [stats.rounds])),
            pb.Tensor(tn.ACCEPTANCE_RATE, np.array([[stats.acceptance_rate]], dtype=np.float32)),
            pb.Tensor(tn.FINISH_REASON, np.array([[(finish or "").encode()]], dtype=np.object_)),
        ]
        return pb.InferenceResponse(output_tensors=tensors)

    # ---- input parsing and validation ---------------------------------------------------------------
    def _input(self, request, name, dtype):
        tensor = self.pb.get_input_tensor_by_name(request, name)
        if tensor is None:
            return None
        value = tensor.as_numpy()
        if value.dtype != dtype:
            raise InputError(f"input '{name}' must be {np.dtype(dtype).name}, got {value.dtype.name}")
        return value

    def _scalar(self, request, name, dtype, default):
        value = self._input(request, name, dtype)
        if value is None:
            return default
        if value.size != 1:
            raise InputError(f"input '{name}' must hold exactly one value, got shape {list(value.shape)}")
        return value.reshape(-1)[0].item()

    def _draft_name(self, request) -> str:
        value = self._input(request, tn.DRAFT_MODEL, np.object_)
        if value is None or value.size == 0:
            return self.default_draft
        name = value.reshape(-1)[0]
        return name.decode() if isinstance(name, bytes) else str(name)

    def _parse(self, request) -> tuple[GenerationRequest, bool]:
        prompt_ids = self._input(request, tn.INPUT_IDS, np.int32)
        if prompt_ids is None or prompt_ids.size == 0:
            raise InputError(f"input '{tn.TEXT_INPUT}' is empty: the prompt needs at least one token")
        prompt_ids = prompt_ids.reshape(-1).tolist()
        max_tokens = self._scalar(request, tn.MAX_TOKENS, np.int32, self.default_max_tokens)
        if not 1 <= max_tokens <= self.max_max_tokens:
            raise InputError(f"input '{tn.MAX_TOKENS}' must be within [1, {self.max_max_tokens}], got {max_tokens}")
        if len(prompt_ids) + max_tokens > self.max_context:
            raise InputError(
                f"input '{tn.TEXT_INPUT}' has {len(prompt_ids)} tokens; with '{tn.MAX_TOKENS}'={max_tokens} that "
                f"exceeds the model context of {self.max_context} tokens")
        k = self._scalar(request, tn.NUM_DRAFT_TOKENS, np.int32, self.default_num_draft_tokens)
        if not 0 <= k <= self.max_num_draft_tokens:
            raise InputError(
                f"input '{tn.NUM_DRAFT_TOKENS}' must be within [0, {self.max_num_draft_tokens}], got {k}")
        temperature = self._scalar(request, tn.TEMPERATURE, np.float32, 0.0)
        if not temperature >= 0.0:  # also rejects NaN
            raise InputError(f"input '{tn.TEMPERATURE}' must be >= 0, got {temperature}")
        top_k = self._scalar(request, tn.TOP_K, np.int32, 0)
        if top_k < 0:
            raise InputError(f"input '{tn.TOP_K}' must be >= 0, got {top_k}")
        top_p = self._scalar(request, tn.TOP_P, np.float32, 1.0)
        if not 0.0 < top_p <= 1.0:
            raise InputError(f"input '{tn.TOP_P}' must be within (0, 1], got {top_p}")
        seed = self._scalar(request, tn.SEED, np.uint64, None)
        stream = bool(self._scalar(request, tn.STREAM, np.bool_, False))
        end_id = self._scalar(request, tn.END_ID, np.int32, None)
        end_ids = self.default_end_ids if end_id is None else frozenset([end_id])
        if self._draft_name(request) not in self.proposers:
            raise InputError(f"input '{tn.DRAFT_MODEL}' must be one of {sorted(self.proposers)}")
        gen = GenerationRequest(
            seq_id=random.getrandbits(63) | 1,  # nonzero: 0 means "no sequence" to Triton
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            num_draft_tokens=k,
            sampling=SamplingParams(temperature, top_k, top_p, seed),
            end_ids=end_ids,
        )
        return gen, stream
