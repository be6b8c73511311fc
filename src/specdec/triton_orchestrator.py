"""Triton adapter for `speculative_decoding`: a decoupled BLS model running `orchestrator.generate`.

`execute` is a coroutine (decoupled async execute, Triton 24.04+): each request runs as its own task
on the stub's event loop and awaits its BLS calls with `async_exec`, so one instance interleaves the
rounds of many requests instead of blocking on one. A non-streaming request gets one response; with
`stream`, each round's text-complete tokens go out as soon as they are accepted. Cancellation is
checked every round; stopping the loop releases both models' caches.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import numpy as np

from specdec import tensor_names as tn
from specdec.bls import BlsProposer, BlsScorer
from specdec.cancellation import CancellationBoard
from specdec.config import ModelParameters
from specdec.metrics import OrchestratorMetrics
from specdec.ngram_proposer import NgramProposer
from specdec.speculation_policy import CostModel, DraftLengthPolicy
from specdec.orchestrator import GenerationRequest, Stats, generate
from specdec.sampling import SamplingParams
from specdec.text import Emission, TextEmitter, load_tokenizer


NGRAM = "ngram"


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
        self.max_stop_words = params.int("max_stop_words", 16, low=0)
        # Adaptive draft length by default: num_draft_tokens is then the most a round drafts.
        self.adaptive_draft = params.bool("adaptive_draft", True)
        self.costs = CostModel()  # measured by every request, shared: the policy's c and v(k)
        # At most max_live_sequences generate at once (each holds a KV cache in both models); over the
        # cap a request waits for a slot, or with when_full=reject gets UNAVAILABLE at once.
        self.max_live = params.int("max_live_sequences", 64, low=1)
        self.when_full = params.str("when_full", "queue", choices=("queue", "reject"))
        self.slots = asyncio.Semaphore(self.max_live)
        self.queued = 0
        timeout_us = params.int("bls_timeout_us", 0, low=0)
        draft_names = params.list("draft_models", tn.DRAFT_MODEL_NAME)
        if not draft_names:
            raise ValueError(f"{params.model_name}: parameter 'draft_models' lists no model")
        # "ngram" is the built-in prompt-lookup method; any other name is a draft model to call over BLS.
        self.proposers = {name: NgramProposer(vocab_size=len(self.tokenizer)) if name == NGRAM
                          else BlsProposer(pb_utils, name, timeout_us) for name in draft_names}
        self.default_draft = draft_names[0]
        self.scorer = BlsScorer(pb_utils, params.str("target_model", tn.TARGET_MODEL_NAME), timeout_us)
        eos = self.tokenizer.eos_token_id
        self.default_end_ids = frozenset([] if eos is None else [int(eos)])
        self.metrics = OrchestratorMetrics(pb_utils, self.max_num_draft_tokens)
        self.cancellations = CancellationBoard()
        self.cancellations.sweep()
        self.last_sweep = time.monotonic()
        self.live = 0

    async def execute(self, requests):
        await asyncio.gather(*(self._serve(request) for request in requests))
        return None

    # ---- one request -----------------------------------------------------------------------------
    async def _serve(self, request):
        pb = self.pb
        arrived = time.monotonic()
        if arrived - self.last_sweep > 60:
            self.cancellations.sweep()
            self.last_sweep = arrived
        sender = request.get_response_sender()
        try:
            gen, stream, stop_words, draft_name, adaptive = self._parse(request)
        except InputError as exc:
            self.metrics.requests["invalid"].increment(1)
            # Triton 24.10's stub registers an async execute's future only after scheduling it; a coroutine
            # that finishes first trips "Cannot remove future from background; KeyError" and the request is
            # never released (server#8537; seen here as an ensemble that never unloads). Valid requests
            # always await BLS calls; a rejected one yields long enough for the stub to register it.
            await asyncio.sleep(0.005)
            sender.send(pb.InferenceResponse(error=pb.TritonError(str(exc), pb.TritonError.INVALID_ARG)),
                        flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        if self.slots.locked() and self.when_full == "reject":
            self.metrics.requests["rejected"].increment(1)
            await asyncio.sleep(0.005)  # see the note on server#8537 above
            sender.send(pb.InferenceResponse(error=pb.TritonError(
                f"speculative_decoding: {self.max_live} sequences are generating (max_live_sequences); "
                f"retry later", pb.TritonError.UNAVAILABLE)), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        self.queued += 1
        self.metrics.queued.set(self.queued)
        try:
            await self.slots.acquire()
        finally:
            self.queued -= 1
            self.metrics.queued.set(self.queued)
        try:
            await self._generate(request, sender, arrived, gen, stream, stop_words, draft_name, adaptive)
        finally:
            self.slots.release()

    async def _generate(self, request, sender, arrived, gen, stream, stop_words, draft_name, adaptive):
        pb = self.pb
        stats = Stats()
        emitter = TextEmitter(self.tokenizer, stop_words)
        first_sent = False

        def send(emission: Emission | None, finish: str | None) -> None:
            nonlocal first_sent
            if not first_sent:
                self.metrics.ttft.observe(time.monotonic() - arrived)
                first_sent = True
            flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if finish else 0
            sender.send(self._response(emission, gen, emitter, stats, finish), flags=flags)

        self.live += 1
        self.metrics.live.set(self.live)
        finish, last = None, None
        try:
            policy = DraftLengthPolicy(gen.num_draft_tokens, self.costs, draft_name, adaptive=adaptive,
                                       free=draft_name == NGRAM)
            rounds = generate(gen, self.proposers[draft_name], self.scorer, stats, policy)
            async with contextlib.aclosing(rounds) as rounds:
                async for rnd in rounds:
                    now = time.monotonic()
                    self.metrics.record_round(rnd.num_drafted, rnd.num_accepted, now)
                    self.metrics.record_costs(self.costs, now)
                    emission = emitter.push(rnd.new_tokens, final=rnd.finish_reason is not None)
                    finish = rnd.finish_reason or (tn.FINISH_STOP if emission and emission.stopped else None)
                    if finish is None and self._cancelled(request, sender, gen.seq_id):
                        finish = tn.FINISH_CANCELLED
                    if finish:
                        last = emission
                        break
                    if stream and emission:
                        send(emission, None)
        except Exception as exc:  # noqa: BLE001 - the request fails, the server keeps serving
            self.metrics.requests["error"].increment(1)
            sender.send(pb.InferenceResponse(error=pb.TritonError(f"speculative_decoding: {exc}")),
                        flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        finally:
            self.live -= 1
            self.metrics.live.set(self.live)
            self.metrics.flush(time.monotonic())  # this request's rounds are counted before it ends
            self.cancellations.clear(gen.seq_id)
        if finish == tn.FINISH_CANCELLED:
            last = emitter.push([], final=True)
        if not stream:  # one response: everything sent, cut where the emitter cut it
            last = Emission(emitter.emitted, [], emitter.text, len(emitter.text), False)
        send(last, finish)
        self.metrics.record_request(finish, len(emitter.emitted), time.monotonic() - arrived)

    def _cancelled(self, request, sender, seq_id: int) -> bool:
        # Direct callers' cancellation reaches this request; an ensemble's arrives through the board.
        return sender.is_cancelled() or request.is_cancelled() or self.cancellations.is_cancelled(seq_id)

    def _response(self, emission: Emission | None, req: GenerationRequest, emitter: TextEmitter, stats: Stats,
                  finish: str | None):
        pb = self.pb
        ids, prefix, length = (emission.ids, emission.prefix_ids, emission.text_length) if emission else ([], [], -1)

        def i32(name, values):
            return pb.Tensor(name, np.asarray(values, dtype=np.int32).reshape(1, -1))

        return pb.InferenceResponse(output_tensors=[
            i32(tn.OUTPUT_IDS, ids),
            i32(tn.PREFIX_IDS, prefix),
            i32(tn.TEXT_LENGTH, [length]),
            pb.Tensor(tn.SEQUENCE_ID, np.array([[req.seq_id]], dtype=np.uint64)),
            i32(tn.NUM_INPUT_TOKENS, [len(req.prompt_ids)]),
            i32(tn.NUM_OUTPUT_TOKENS, [len(emitter.emitted)]),
            i32(tn.TOTAL_DRAFT_TOKENS, [stats.drafted]),
            i32(tn.TOTAL_ACCEPTED_DRAFT_TOKENS, [stats.accepted]),
            i32(tn.NUM_ROUNDS, [stats.rounds]),
            pb.Tensor(tn.ACCEPTANCE_RATE, np.array([[stats.acceptance_rate]], dtype=np.float32)),
            pb.Tensor(tn.MEAN_ACCEPTED_LENGTH, np.array([[stats.mean_accepted_length]], dtype=np.float32)),
            pb.Tensor(tn.FINISH_REASON, np.array([[(finish or "").encode()]], dtype=np.object_)),
        ])

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

    def _strings(self, request, name) -> list[str]:
        value = self._input(request, name, np.object_)
        if value is None:
            return []
        out = []
        for item in value.reshape(-1):
            try:
                out.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
            except UnicodeDecodeError:
                raise InputError(f"input '{name}' is not valid UTF-8") from None
        return out

    def _parse(self, request) -> tuple[GenerationRequest, bool, tuple[str, ...], str, bool]:
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
        adaptive = bool(self._scalar(request, tn.ADAPTIVE_DRAFT, np.bool_, self.adaptive_draft))
        temperature = self._scalar(request, tn.TEMPERATURE, np.float32, 0.0)
        if not 0.0 <= temperature < float("inf"):  # also rejects NaN
            raise InputError(f"input '{tn.TEMPERATURE}' must be a finite number >= 0, got {temperature}")
        top_k = self._scalar(request, tn.TOP_K, np.int32, 0)
        if top_k < 0:
            raise InputError(f"input '{tn.TOP_K}' must be >= 0, got {top_k}")
        top_p = self._scalar(request, tn.TOP_P, np.float32, 1.0)
        if not 0.0 < top_p <= 1.0:
            raise InputError(f"input '{tn.TOP_P}' must be within (0, 1], got {top_p}")
        seed = self._scalar(request, tn.SEED, np.uint64, None)
        stream = bool(self._scalar(request, tn.STREAM, np.bool_, False))
        end_id = self._scalar(request, tn.END_ID, np.int32, None)
        if end_id is not None and not 0 <= end_id < len(self.tokenizer):
            raise InputError(f"input '{tn.END_ID}' must be a token id within [0, {len(self.tokenizer)}), got {end_id}")
        end_ids = self.default_end_ids if end_id is None else frozenset([end_id])
        stop_words = tuple(self._strings(request, tn.STOP_WORDS))
        if len(stop_words) > self.max_stop_words:
            raise InputError(f"input '{tn.STOP_WORDS}' has {len(stop_words)} entries; at most {self.max_stop_words}")
        if any(not word for word in stop_words):
            raise InputError(f"input '{tn.STOP_WORDS}' contains an empty string")
        names = self._strings(request, tn.DRAFT_MODEL)
        draft_name = names[0] if names else self.default_draft
        if len(names) > 1 or draft_name not in self.proposers:
            raise InputError(f"input '{tn.DRAFT_MODEL}' must be one of {sorted(self.proposers)}, got {names}")
        gen = GenerationRequest(
            seq_id=random.getrandbits(63) | 1,  # nonzero: 0 means "no sequence" to Triton
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            num_draft_tokens=k,
            sampling=SamplingParams(temperature, top_k, top_p, seed),
            end_ids=end_ids,
        )
        # A seeded sampled request must be reproducible: measured costs vary from run to run, and a
        # different K changes which random draws pick which token, so it drafts a fixed K.
        adaptive = adaptive and (gen.sampling.greedy or seed is None)
        return gen, stream, stop_words, draft_name, adaptive
