"""Triton adapter for `speculative_decoding`: a decoupled BLS model running `orchestrator.generate`.

`execute` is a coroutine (decoupled async execute, Triton 24.04+): each request runs as its own task
on the stub's event loop and awaits its BLS calls with `async_exec`, so one instance interleaves the
rounds of many requests instead of blocking on one. A non-streaming request gets one response; with
`stream`, each round's text-complete tokens go out as soon as they are accepted. Cancellation is
checked every round (an ensemble's) or every CANCEL_POLL_S and with every streamed response (a direct
caller's); stopping the loop releases both models' caches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import threading
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch

from specdec import tensor_names as tn
from specdec.decoding.draft_length import CostModel, DraftLengthPolicy, PartPolicies
from specdec.decoding.grammar import GuideCompiler
from specdec.decoding.interfaces import HostedProposer, NoCapacity
from specdec.decoding import generation_config, lookup_first
from specdec.decoding.loop import GenerationRequest, RoundOutput, Stats, generate
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.decoding.prediction_proposer import PredictionProposer
from specdec.decoding.suffix_proposer import MAX_TOKENS, SuffixCache, SuffixProposer
from specdec.decoding.text import Emission, TextEmitter, decode, joined, load_tokenizer, with_prompt
from specdec.engine import host_memory
from specdec.triton.adapter import TritonAdapter
from specdec.triton.bls import BlsProposer, BlsScorer, ModelUnavailable
from specdec.triton.admission.cancellation import CancellationBoard
from specdec.triton.admission.counts import RequestCounts
from specdec.triton.config import ConfigError, ModelParameters
from specdec.triton.fallback import FallbackProposer
from specdec.triton.metrics import OrchestratorMetrics
from specdec.triton.request import InputError, ParsedRequest, RequestLimits
from specdec.triton import cache_reset, marker_file, vllm_outputs
from specdec.triton.admission.kv_room import RoomLine, RoomWait
from specdec.triton.admission.sequence_slots import SlotPool
from specdec.triton.admission.verify_gate import GatedScorer, VerifyGate


# Guides longer than this (characters of the guide input or of the sampling_parameters JSON that may hold
# one) compile on a thread (see `_serve`).
THREAD_GUIDE_CHARS = 16384


def _guide_chars(inputs: dict) -> int:
    """The characters of a request's inputs that may hold a guide."""
    return sum(len(item) for name in (tn.GUIDED_DECODING_GUIDE, tn.SAMPLING_PARAMETERS) if name in inputs
               for item in inputs[name].reshape(-1) if isinstance(item, (bytes, str)))


# How often a round without a streamed response asks Triton whether a direct caller cancelled (an IPC round
# trip through a thread, the costliest bookkeeping of a round; a streamed response asks with every send).
# An ensemble's cancellation comes through the board, checked every round (a stat).
CANCEL_POLL_S = 0.01


class SpeculativeDecodingAdapter(TritonAdapter):
    heartbeat: asyncio.Task | None = None  # _beat, from the first execute

    def load(self, params: ModelParameters, args: dict) -> None:
        pb_utils = self.pb
        self.tokenizer = load_tokenizer(params.str("tokenizer_path"))
        self.guides = GuideCompiler(self.tokenizer)  # structured output's grammars over the same tokenizer
        # a token's text alone (vLLM's `decoded_token` in its logprobs output)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda token: self.tokenizer.decode([token]))
        eos = self.tokenizer.eos_token_id
        # A request ends at the tokenizer's end token and at every one the model's generation_config.json names
        # (as generate() and vLLM end it: Llama-3.1's <|eom_id|>, Qwen's <|endoftext|>); "" reads none.
        field = f"{params.model_name}: parameter 'generation_config'"
        ends = generation_config.end_ids(generation_config.read(params.str("generation_config", ""), field),
                                         len(self.tokenizer), field)
        self.limits = RequestLimits.from_parameters(params, len(self.tokenizer),
                                                    frozenset([] if eos is None else [int(eos)]) | ends)
        self.costs = CostModel()  # measured by every request of this instance, shared: the policy's c and v(k)
        # At most max_live_sequences generate at once across every instance of this model (each holds a
        # KV cache in both models; sequence_slots.py); over the cap a request waits for a slot, or with
        # when_full=reject gets UNAVAILABLE at once.
        # The same choice when target_model has no KV room for a new request (its budget is full): wait
        # for room, or UNAVAILABLE at once.
        self.max_live = params.int("max_live_sequences", 64, low=1)
        self.when_full = params.str("when_full", "queue", choices=("queue", "reject"))
        self.slots = SlotPool(self.max_live)
        self.room = RoomLine()  # the server's requests waiting for KV room in target_model (kv_room.py)
        timeout_us = params.int("bls_timeout_us", 0, low=0)
        # A call to a model unanswered this long fails (the request: UNAVAILABLE, retry) and is counted, which
        # the launcher's watchdog reads to restart a model that hangs (bls.py); 0: calls wait for ever.
        call_timeout_s = params.float("model_call_timeout_s", tn.DEFAULT_MODEL_CALL_TIMEOUT_S, low=0.0)
        # Prompts longer than this go to each model in chunks, other requests' rounds between them (bls.py);
        # 0 (default): whole. Off until measured to pay: on CPU it traded the tail for throughput.
        chunk = params.int("prefill_chunk_tokens", 0, low=0)
        # Gauges of one instance carry its name: the server's figure is their sum (or max for the peak).
        self.metrics = OrchestratorMetrics(pb_utils, self.limits.max_num_draft_tokens,
                                           args.get("model_instance_name", params.model_name), params.model_name)
        # A thread hands the heap that ended requests freed back to the OS at most this often (0: never), as
        # the model stubs do: glibc keeps it otherwise (tens of MiB per instance under a mixed load, measured:
        # docs/results/2026-12-07-orchestrator-memory.md).
        self.trims = host_memory.TrimSchedule(params.float("heap_trim_interval_s", 30.0, low=0.0))
        self._stop_trimming = threading.Event()
        self._trimmer = threading.Thread(target=self._trim_periodically, daemon=True, name="specdec-heap-trim")
        self.metrics.max_live.set(self.max_live)  # the denominator of the chart's backlog signal
        # "ngram" and "suffix" are built in (prompt lookup; "suffix" also over the text of this instance's
        # earlier requests, up to suffix_cache_tokens); any other name is a draft model to call over BLS.
        # A draft model that fails is bypassed (target-only rounds) and retried after a wait.
        retry_s = params.float("draft_retry_after_s", 1.0, low=0.0)
        # Every finished request's prompt and output go into the suffix cache (while "suffix" is offered).
        self.suffix_cache = SuffixCache(params.int("suffix_cache_tokens", 262144, low=0, high=MAX_TOKENS)) \
            if tn.SUFFIX in self.limits.draft_names else None
        if self.suffix_cache is not None:  # a reloaded instance's cache starts empty
            self.metrics.suffix_tokens.set(0)
        # emptied when a client resets the caches (cache_reset.py), looked for as each request arrives
        self.reset_watch = marker_file.Watch(cache_reset.path_from_env() if self.suffix_cache is not None else "")
        # Prompt lookup's continuations of up to this many earlier occurrences, as one token tree (1: a chain)
        branches = params.int("lookup_branches", 1, low=1, high=tn.MAX_DRAFT_BRANCHES)
        # Its matches: the longest n-gram of lookup_max_ngram tokens down to lookup_min_ngram (vLLM's
        # prompt_lookup_max and prompt_lookup_min)
        shortest = params.int("lookup_min_ngram", tn.LOOKUP_NGRAM[0], low=1, high=tn.MAX_LOOKUP_NGRAM)
        longest = params.int("lookup_max_ngram", tn.LOOKUP_NGRAM[1], low=shortest, high=tn.MAX_LOOKUP_NGRAM)
        builtin = {tn.NGRAM: lambda: NgramProposer(longest, shortest, branches),
                   tn.SUFFIX: lambda: SuffixProposer(self.suffix_cache, longest, shortest, branches)}
        # "ngram+MODEL" (lookup_first.py): prompt lookup drafts where the sequence's suffix matched an earlier
        # n-gram of at least lookup_first_min_ngram tokens, the draft model MODEL otherwise.
        combined = {name: lookup_first.parts(name) for name in self.limits.draft_names if lookup_first.parts(name)}
        for name, (lookup, model) in combined.items():
            if lookup != tn.NGRAM or model in tn.BUILTIN_DRAFTS:
                raise ConfigError(f"draft_models entry {name!r}: a combined draft is {tn.NGRAM!r}"
                                  f"{tn.DRAFT_SEPARATOR}MODEL, MODEL a draft model")
        models = [name for name in self.limits.draft_names if name not in combined and name not in builtin]
        models += [model for _, model in combined.values() if model not in models]
        # Trained heads (draft_kind head): their rounds ask target_model for its features and pass them on.
        heads = set(params.list("head_drafts"))
        if heads - set(models):
            raise ConfigError(f"head_drafts {sorted(heads - set(models))} are not among the draft models of "
                              f"draft_models {list(self.limits.draft_names)}")
        # A draft model's other candidates per drafted position, as one token tree of at most K nodes (1: a
        # chain; draft_tree.py); a trained head's: EAGLE-2's dynamic tree that many wide
        draft_branches = self.limits.max_num_draft_branches  # a request's num_draft_branches may ask for fewer
        min_ngram = params.int("lookup_first_min_ngram", lookup_first.DEFAULT_MIN_NGRAM, low=2, high=4)
        # Heads hosted in target_model (its hosted_heads): drafted in the verify call, never called
        hosted = set(params.list("hosted_drafts"))
        if hosted - set(models) or hosted & heads:
            raise ConfigError(f"hosted_drafts {sorted(hosted)}: each must be a draft model of draft_models "
                              f"{list(self.limits.draft_names)} and not among head_drafts")
        called = {name: HostedProposer(name, draft_branches) if name in hosted else FallbackProposer(
            BlsProposer(pb_utils, name, timeout_us, chunk, wants_features=name in heads,
                        branches=draft_branches, call_timeout_s=call_timeout_s,
                        on_timeout=self.metrics.record_call_timeout), name,
            self.metrics.record_fallback, retry_after_s=retry_s) for name in models}
        self.proposers = {name: builtin[name]() if name in builtin else called[name]
                          for name in self.limits.draft_names if name not in combined}
        self.proposers.update({name: lookup_first.LookupFirstProposer(NgramProposer(), called[model], min_ngram)
                               for name, (_, model) in combined.items()})
        # Concurrent requests' verify calls wait for each other up to this window, so that target_model's
        # forwards carry all of them (verify_gate.py); 0: each goes as soon as it is ready.
        self.gate = VerifyGate(params.float("verify_gather_ms", 0.0, low=0.0) / 1e3, self.metrics.record_gate_hold)
        self.counts = RequestCounts(self.gate, self._publish_counts)
        # Past this many live requests (this instance's, the gate's count) every round is target-only: when
        # batched forwards are compute-bound, drafted rows cost the other sequences time. 0: no limit.
        self.max_drafting = params.int("max_drafting_sequences", 0, low=0)
        self.scorer = GatedScorer(BlsScorer(pb_utils, params.str("target_model", tn.TARGET_MODEL_NAME), timeout_us,
                                            chunk, call_timeout_s, self.metrics.record_call_timeout), self.gate)
        # The cancellation check is an IPC round trip to the backend process that blocks its thread (GIL
        # released) for hundreds of microseconds: on the event loop it would hold up every other request's
        # round. (A streamed response leaves from the loop's thread, once the request's next round went out:
        # _Responses._send_and_check.) The request collects both before its next send, so its responses stay
        # in order.
        self.ipc = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="specdec-ipc")
        # The stub runs every async_exec (a BLS call) as a blocking call on its event loop's default executor,
        # asyncio's min(32, cores + 4) threads: past that many calls in flight the next waits for a thread before
        # it reaches its model, out of the batch it was meant to join. A live request has one call in flight at a
        # time; the margin is for calls past model_call_timeout_s, which keep their thread until answered.
        self.bls_threads = concurrent.futures.ThreadPoolExecutor(max_workers=self.max_live + 8,
                                                                 thread_name_prefix="specdec-bls")
        self.compiling = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-guide")
        self.cancellations = CancellationBoard()
        self.cancellations.sweep()
        self.last_sweep = time.monotonic()
        if self.trims.interval_s:  # once the configuration is whole (a load that fails leaves no thread)
            self._trimmer.start()

    def _policy(self, parsed: ParsedRequest, proposer, gen: GenerationRequest) -> DraftLengthPolicy | PartPolicies:
        """The request's draft-length policy: a combined draft's (ngram+NAME) one per part, its lookup rounds
        measured under the combined name (they draft only on long matches), its model's under NAME's."""
        def one(method: str, free: bool, branches: int) -> DraftLengthPolicy:
            return DraftLengthPolicy(parsed.num_draft_tokens, self.costs, method, adaptive=parsed.adaptive,
                                     free=free, busy=self._busy(gen), branches=branches)

        combined = lookup_first.parts(parsed.draft_name)
        # the request's num_draft_branches caps a draft model's trees (prompt lookup's are lookup_branches')
        model_branches = min(proposer.branches, parsed.num_draft_branches)
        if combined is None:
            builtin = parsed.draft_name in tn.BUILTIN_DRAFTS
            return one(parsed.draft_name, builtin, proposer.branches if builtin else model_branches)
        return PartPolicies({lookup_first.LOOKUP: one(parsed.draft_name, True, 1),
                             lookup_first.MODEL: one(combined[1], False, model_branches)})

    async def execute(self, requests):
        if self.heartbeat is None:  # the stub's event loop exists once the first execute runs on it
            loop = asyncio.get_running_loop()
            self.heartbeat = loop.create_task(self._beat())
            loop.set_default_executor(self.bls_threads)  # async_exec's threads (see __init__)
        await asyncio.gather(*(self._serve(request) for request in requests))
        return None

    async def _beat(self) -> None:
        """Count the event loop's turns (tn.ORCHESTRATOR_HEARTBEATS): a loop that stops turning while requests
        generate is hung (a blocking call that never returns, a deadlock), which nothing else would notice:
        the launcher's watchdog then restarts the server (watchdog.py)."""
        while True:
            self.metrics.heartbeats.increment(1)
            await asyncio.sleep(tn.HEARTBEAT_S)

    def _trim_periodically(self) -> None:
        # Off the event loop: a trim after a heavy churn takes milliseconds (ctypes releases the GIL meanwhile).
        while not self._stop_trimming.wait(max(self.trims.interval_s / 4, 0.25)):
            if self.trims.due() and host_memory.trim_heap():
                self.metrics.heap_trims.increment(1)

    def finalize(self):
        self._stop_trimming.set()
        if self._trimmer.is_alive():  # its counter goes with the metrics below
            self._trimmer.join(timeout=5)
        if self.heartbeat is not None:
            with contextlib.suppress(RuntimeError):  # the stub's loop may be closed already
                self.heartbeat.get_loop().call_soon_threadsafe(self.heartbeat.cancel)
        self.metrics.close()
        super().finalize()

    # ---- one request -----------------------------------------------------------------------------
    async def _serve(self, request):
        pb = self.pb
        arrived = time.monotonic()
        if arrived - self.last_sweep > 60:
            self.cancellations.sweep()
            self.last_sweep = arrived
        if self.reset_watch.due():
            forgotten = self.suffix_cache.clear()
            self.metrics.suffix_tokens.set(0)
            pb.Logger.log_info(f"speculative_decoding: suffix cache reset at a client's request: {forgotten} tokens "
                               "forgotten")
        sender = request.get_response_sender()
        # Listed once: pb_utils.get_input_tensor_by_name lists every input on each lookup, and parsing looks
        # up some thirty names.
        inputs = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
        parameters = request.parameters()  # vLLM's clients' sampling settings may come as these
        outputs = frozenset(request.requested_output_names())
        parse = functools.partial(ParsedRequest.parse, inputs.get, self.limits, encode=self._encode_word,
                                  compile_guide=self.guides.compile, parameters=parameters)
        try:
            # A large guide compiles on a thread: on the event loop every other request's round would wait
            # for it. Small ones compile here: on a thread, taking turns at the GIL with the event loop, a
            # compile takes longer than it stalls the others.
            parsed = await asyncio.get_running_loop().run_in_executor(self.compiling, parse) \
                if _guide_chars(inputs) + len(parameters) > THREAD_GUIDE_CHARS else parse()
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
        except Exception as exc:  # noqa: BLE001 - a reading this code did not foresee: the request is answered
            # (escaping execute, it would never be: a decoupled request waits for its final response)
            self.metrics.requests["error"].increment(1)
            pb.Logger.log_error(f"speculative_decoding: reading a request failed: {traceback.format_exc()}")
            await asyncio.sleep(0.005)  # see the note on server#8537 above
            return self._fail(sender, f"the request could not be read: {exc!r}", pb.TritonError.INTERNAL)
        parsed = dataclasses.replace(parsed, outputs=outputs)
        slot = self.slots.take_now()
        if slot is None and self.when_full == "reject":
            self.metrics.requests["rejected"].increment(1)
            await asyncio.sleep(0.005)  # see the note on server#8537 above
            sender.send(pb.InferenceResponse(error=pb.TritonError(
                f"speculative_decoding: {self.max_live} sequences are generating (max_live_sequences); "
                f"{tn.RETRY_LATER}", pb.TritonError.UNAVAILABLE)), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        slot_wait = 0.0
        if slot is None:
            self.counts.waiting(1)
            try:
                slot = await self.slots.acquire(lambda: self.is_cancelled(parsed.generation.seq_id, sender),
                                                parsed.priority)
            finally:
                self.counts.waiting(-1)
            slot_wait = time.monotonic() - arrived
            if slot is None:  # a direct caller cancelled it while it waited: it ends holding nothing
                self.metrics.queue_time.observe(slot_wait)
                self.metrics.record_request(tn.FINISH_CANCELLED, 0, slot_wait)
                sender.send(self._response(None, parsed, TextEmitter(self.tokenizer), Stats(), tn.FINISH_CANCELLED,
                                           []), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
        try:
            await self._generate(sender, arrived, parsed, slot_wait)
        finally:
            self.slots.release(slot)

    def _encode_word(self, word: str) -> list[int]:
        """A bad word's tokens as the target would generate them: no special tokens around them."""
        return self.tokenizer.encode(word, add_special_tokens=False)

    async def is_cancelled(self, seq_id: int, sender) -> bool:
        """Whether a waiting request was cancelled: by its ensemble's client (the board) or by a direct
        caller (Triton's flag, asked on an IPC thread)."""
        return self.cancellations.is_cancelled(seq_id) or await asyncio.get_running_loop().run_in_executor(
            self.ipc, sender.is_cancelled)

    def _busy(self, gen: GenerationRequest) -> Callable[[], bool] | None:
        """The policy's load check (max_drafting_sequences). A seeded sampled request keeps its K: a
        different K draws different tokens, and it must be reproducible whatever the load."""
        if not self.max_drafting or (not gen.sampling.greedy and gen.sampling.seed is not None):
            return None

        def busy() -> bool:
            if self.counts.live <= self.max_drafting:
                return False
            self.metrics.record_load_limited()
            return True
        return busy

    def _publish_counts(self, live: int, queued: int) -> None:
        """This instance's generating requests and the server's peak, and its queued requests (waiting for a
        slot or for KV room, `specdec_queued_requests`), to the gauges."""
        self.metrics.set_live(live, self.slots.highest)
        self.metrics.queued.set(queued)

    async def _generate(self, sender, arrived: float, parsed: ParsedRequest, slot_wait: float):
        """One admitted request: its wait for KV room, its rounds, its responses, and what it leaves behind."""
        gen = parsed.generation
        out = _Responses(self, sender, parsed, arrived)
        room = RoomWait(self.room, self.counts, functools.partial(self.is_cancelled, gen.seq_id, sender),
                        reject=self.when_full == "reject", priority=parsed.priority)
        self.counts.started()
        finish, last, started = None, None, False
        try:
            # First come, first served: while requests wait for KV room, a new one lines up behind them
            # instead of taking room the first in line waits for.
            if not await room.line_up():
                raise NoCapacity("cancelled while waiting in line for KV room")  # room.cancelled is set
            started = True
            out.times[tn.FIRST_SCHEDULED_TIME_NS] = time.monotonic()
            if parsed.prediction:  # OpenAI's Predicted Outputs: the request's own draft, free as prompt lookup
                proposer = PredictionProposer(list(parsed.prediction), len(gen.prompt_ids))
                policy = DraftLengthPolicy(parsed.num_draft_tokens, self.costs, tn.PREDICTION_DRAFT,
                                           adaptive=parsed.adaptive, free=True, busy=self._busy(gen))
            else:
                proposer = self.proposers[parsed.draft_name]
                policy = self._policy(parsed, proposer, gen)
            # Between draft and verify only the board is read (one stat): asking Triton is an IPC round
            # trip, paid once per round (`_Responses.round`), off the event loop.
            rounds = generate(gen, proposer, self.scorer, policy, out.stats,
                              cancelled=lambda: self.cancellations.is_cancelled(gen.seq_id), wait_for_room=room)
            async with contextlib.aclosing(rounds) as rounds:
                async for rnd in rounds:
                    room.admitted()
                    finish, last = await out.round(rnd)
                    if finish:
                        break
        except NoCapacity as exc:  # target_model has no room for it: refused (when_full=reject) or cancelled
            await out.settle()
            if not room.cancelled:
                self.metrics.requests["rejected"].increment(1)
                return self._fail(sender, exc, self.pb.TritonError.UNAVAILABLE)
            finish = tn.FINISH_CANCELLED
        except ModelUnavailable as exc:  # a model's stub died: the watchdog brings it back
            self.metrics.requests["error"].increment(1)
            await out.settle()
            return self._fail(sender, f"{exc}; {tn.MODEL_DOWN}", self.pb.TritonError.UNAVAILABLE)
        except Exception as exc:  # noqa: BLE001 - the request fails, the server keeps serving
            self.metrics.requests["error"].increment(1)
            await out.settle()
            return self._fail(sender, exc, self.pb.TritonError.INTERNAL)
        finally:
            room.admitted()
            if started:  # its caches are released by now: the first in line may ask again at once
                self.room.freed()
                if self.suffix_cache is not None:  # all it generated
                    self.suffix_cache.add(gen.prompt_ids + out.emitter.emitted + out.emitter.pending)
                    self.metrics.suffix_tokens.set(self.suffix_cache.tokens)
            self.metrics.queue_time.observe(slot_wait + room.waited_s)
            self.counts.ended()
            self.trims.freed()
            self.metrics.flush(time.monotonic())  # this request's rounds are counted before it ends
            self.cancellations.clear(gen.seq_id)
        try:
            await out.final(finish, last)
        except Exception as exc:  # noqa: BLE001 - a fault in answering ends the request with an error, not never
            self.metrics.requests["error"].increment(1)
            self.pb.Logger.log_error(f"speculative_decoding: answering a request failed: {traceback.format_exc()}")
            with contextlib.suppress(Exception):  # (its final response may have left already)
                self._fail(sender, exc, self.pb.TritonError.INTERNAL)

    def _fail(self, sender, exc: Exception | str, code) -> None:
        pb = self.pb
        sender.send(pb.InferenceResponse(error=pb.TritonError(f"speculative_decoding: {exc}", code)),
                    flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _response(self, emission: Emission | None, parsed: ParsedRequest, emitter: TextEmitter, stats: Stats,
                  finish: str | None, log_probs: list[float],
                  top: tuple[list[list[int]], list[list[float]]] = ([], []), prompt: RoundOutput | None = None,
                  ranks: list[int] | None = None, times: dict[str, float | None] | None = None,
                  first: bool = False, logits: list[torch.Tensor | None] | None = None):
        """One response's tensors; `times`: with return_perf_metrics, tn.PERF_METRIC_OUTPUTS' moments
        (time.monotonic(), None: not yet); `first`: the request's first response; `logits`: with
        return_generation_logits, each generated token's, those this response sends dropped from it."""
        pb = self.pb
        req = parsed.generation
        ids, prefix, length = (emission.ids, emission.prefix_ids, emission.text_length) if emission else ([], [], -1)

        def i32(name, values):
            return pb.Tensor(name, np.asarray(values, dtype=np.int32).reshape(1, -1))

        def f32(name, values):
            return pb.Tensor(name, np.asarray(values, dtype=np.float32).reshape(1, -1))

        # Only with return_log_probs (not two more tensors in every response). The emitted tokens are a
        # prefix of the generated ones, and this response's ids the last of them.
        sent = len(emitter.emitted)
        extra = [f32(tn.OUTPUT_LOG_PROBS, log_probs[sent - len(ids):sent]),
                 f32(tn.CUM_LOG_PROBS, [sum(log_probs[:sent])])] if req.log_probs else []
        if req.top_log_probs:  # (1, tokens, n): this response's tokens' rows
            shape = (1, len(ids), req.top_log_probs)
            extra += [pb.Tensor(tn.OUTPUT_TOP_IDS, np.asarray(top[0][sent - len(ids):sent], dtype=np.int32).reshape(shape)),
                      pb.Tensor(tn.OUTPUT_TOP_LOG_PROBS,
                                np.asarray(top[1][sent - len(ids):sent], dtype=np.float32).reshape(shape))]
        if req.generation_logits:  # (1, beam 1, tokens, V): this response's tokens' rows, then let go
            logits = logits if logits is not None else []  # (a request that ends before generating)
            rows = logits[sent - len(ids):sent]
            logits[sent - len(ids):sent] = [None] * len(rows)
            extra.append(pb.Tensor(tn.GENERATION_LOGITS, torch.stack(rows).cpu().numpy()[None, None] if rows else
                                   np.zeros((1, 1, 0, 0), dtype=np.float32)))
        if prompt is not None and req.context_logits:  # (1, P, V)
            extra.append(pb.Tensor(tn.CONTEXT_LOGITS, prompt.prompt_logits.cpu().numpy()[None]))
        if prompt is not None and req.prompt_log_probs:  # the first response: the prompt's tokens and scores
            extra += [i32(tn.OUTPUT_PROMPT_IDS, req.prompt_ids), i32(tn.OUTPUT_PROMPT_RANKS, prompt.prompt_ranks),
                      f32(tn.OUTPUT_PROMPT_LOG_PROBS, prompt.prompt_log_probs)]
            if req.top_log_probs:
                shape = (1, len(prompt.prompt_log_probs), req.top_log_probs)
                extra += [pb.Tensor(tn.OUTPUT_PROMPT_TOP_IDS, np.asarray(prompt.prompt_top[0], dtype=np.int32).reshape(shape)),
                          pb.Tensor(tn.OUTPUT_PROMPT_TOP_LOG_PROBS,
                                    np.asarray(prompt.prompt_top[1], dtype=np.float32).reshape(shape))]
        elif first and parsed.return_prompt_ids:
            extra.append(i32(tn.OUTPUT_PROMPT_IDS, req.prompt_ids))
        vllm = {}
        if parsed.vllm_outputs:  # vLLM's backend's outputs, which replace ours of the same names
            this = slice(sent - len(ids), sent)
            vllm = vllm_outputs.additional_outputs(
                parsed.vllm_outputs, ids=ids, finish=finish, cumulative=sum(log_probs[:sent]),
                logprobs=None if parsed.vllm_logprobs is None or tn.RETURN_LOGPROBS not in parsed.vllm_outputs else
                vllm_outputs.logprobs_json(ids, log_probs[this], ranks[this] if ranks else None,
                                           (top[0][this], top[1][this]) if req.top_log_probs else None,
                                           self.token_text))
        out_ids, text = ids, emission.text if emission else ""
        if parsed.echo_prompt and emission is not None:  # the one response: the prompt's tokens before the answer
            out_ids, length = with_prompt(self.tokenizer, req.prompt_ids, ids, length, parsed.skip_special)
            text = decode(self.tokenizer, out_ids, parsed.skip_special)
            text = text[:length] if length >= 0 else text
        tensors = extra + [
            # the text postprocessing makes of the next four (the ensemble's); a direct caller's, unmapped there
            pb.Tensor(tn.TEXT_OUTPUT, np.array([[text.encode("utf-8")]], dtype=np.object_)),
            i32(tn.OUTPUT_IDS, out_ids),
            i32(tn.PREFIX_IDS, prefix),
            i32(tn.TEXT_LENGTH, [length]),
            pb.Tensor(tn.SKIP_SPECIAL_TOKENS, np.array([[parsed.skip_special]], dtype=np.bool_)),
            pb.Tensor(tn.SEQUENCE_ID, np.array([[req.seq_id]], dtype=np.uint64)),
            i32(tn.NUM_INPUT_TOKENS, [len(req.prompt_ids)]),
            i32(tn.NUM_OUTPUT_TOKENS, [len(emitter.emitted)]),
            i32(tn.TOTAL_DRAFT_TOKENS, [stats.drafted]),
            i32(tn.TOTAL_ACCEPTED_DRAFT_TOKENS, [stats.accepted]),
            i32(tn.NUM_ROUNDS, [stats.rounds]),
            pb.Tensor(tn.ACCEPTANCE_RATE, np.array([[stats.acceptance_rate]], dtype=np.float32)),
            pb.Tensor(tn.MEAN_ACCEPTED_LENGTH, np.array([[stats.mean_accepted_length]], dtype=np.float32)),
            i32(tn.NUM_CACHED_TOKENS, [stats.cached_tokens]),
            pb.Tensor(tn.FINISH_REASON, np.array([[(finish or "").encode()]], dtype=np.object_)),
        ]
        if vllm:
            tensors = [t for t in tensors if t.name() not in vllm] + [pb.Tensor(k, v) for k, v in vllm.items()]
        if times is not None:  # time.monotonic() is CLOCK_MONOTONIC's, the clock TensorRT-LLM's steady clock reads
            tensors += [pb.Tensor(name, np.array([[0 if at is None else round(at * 1e9)]], dtype=np.int64))
                        for name, at in times.items()]
            tensors += [i32(name, [blocks]) for name, blocks in zip(
                tn.KV_CACHE_METRIC_OUTPUTS, kv_blocks(stats, len(req.prompt_ids) + len(emitter.emitted)))]
        # Only what the caller asked for. Triton 24.10's stub drops the rest itself inside the response sender's
        # send, after releasing the GIL: the last reference to a dropped tensor's numpy array then goes without
        # the GIL while this process's other threads run Python, which corrupts its heap (a stub crash, seen with
        # an output the ensemble does not map). Dropped here, they go with the GIL held.
        if parsed.outputs:
            tensors = [t for t in tensors if t.name() in parsed.outputs]
        return pb.InferenceResponse(output_tensors=tensors)


def kv_blocks(stats: Stats, positions: int) -> tuple[int, int, int]:
    """TensorRT-LLM's KV reuse metrics (tn.KV_CACHE_METRIC_OUTPUTS) of a request whose prompt and output span
    `positions` tokens: (reused, newly allocated, allocated) blocks; none before the target has answered."""
    size = stats.block_size
    if not size:
        return 0, 0, 0
    reused = stats.cached_tokens // size
    computed = max(0, -(-positions // size) - reused)
    return reused, computed, computed


class _Responses:
    """One request's side of the conversation: its text (stop words cut), statistics and log-probabilities;
    each round's streamed response and cancellation check, done while the next round runs (the request
    collects them before sending the next, so its responses stay in order); the final response."""

    def __init__(self, adapter: SpeculativeDecodingAdapter, sender, parsed: ParsedRequest, arrived: float):
        self.adapter, self.sender, self.arrived = adapter, sender, arrived
        self.gen, self.stream = parsed.generation, parsed.stream
        self.stats = Stats()
        self.emitter = TextEmitter(adapter.tokenizer, parsed.stop_words, parsed.include_stop, parsed.skip_special)
        self.log_probs: list[float] = []  # with return_log_probs: one per generated token, in order
        # with num_top_log_probs: per generated token its n most likely tokens and their log-probabilities
        self.top: tuple[list[list[int]], list[list[float]]] = ([], [])
        self.ranks: list[int] = []  # with vLLM's logprobs and return_logprobs: each generated token's rank
        # with return_generation_logits: each generated token's (V,) logits, None once sent (V floats each)
        self.logits: list[torch.Tensor | None] = []
        self.parsed = parsed
        self.in_flight: asyncio.Future | None = None  # the last round's streamed response and check
        self.asked = arrived  # when Triton was last asked whether the caller cancelled
        # With stream_interval_ms or stream_interval: the rounds' text not yet sent (it goes with the next
        # response) and when a streamed response last left
        self.held: Emission | None = None
        self.streamed_at = arrived
        self.first_sent = False
        self.prompt: RoundOutput | None = None  # with return_prompt_log_probs: the first round, until sent
        # When it arrived, started generating and generated its first and latest tokens (time.monotonic())
        self.times: dict[str, float | None] = dict.fromkeys(tn.PERF_METRIC_OUTPUTS)
        self.times[tn.ARRIVAL_TIME_NS] = arrived

    def response(self, emission: Emission | None, finish: str | None):
        prompt, first = None, not self.first_sent
        if first:
            self.adapter.metrics.ttft.observe(time.monotonic() - self.arrived)
            self.first_sent = True
            prompt = self.prompt
        return self.adapter._response(emission, self.parsed, self.emitter, self.stats, finish, self.log_probs,
                                      self.top, prompt, self.ranks, self.times if self.parsed.perf_metrics else None,
                                      first, self.logits)

    async def round(self, rnd) -> tuple[str | None, Emission | None]:
        """A round's tokens counted and pushed into the text, streamed where they make text; returns the
        finish reason (None: go on) and the round's emission."""
        adapter = self.adapter
        if rnd.finish_reason == tn.FINISH_CANCELLED:  # cancelled between draft and verify
            return rnd.finish_reason, None
        if rnd.prompt_log_probs is not None or rnd.prompt_logits is not None:
            self.prompt = rnd
        if rnd.log_probs:
            self.log_probs += rnd.log_probs
        if rnd.top:
            self.top[0].extend(rnd.top[0])
            self.top[1].extend(rnd.top[1])
        if rnd.ranks:
            self.ranks += rnd.ranks
        if rnd.logits is not None:
            self.logits += list(rnd.logits.cpu())
        now, gap = time.monotonic(), None
        if rnd.new_tokens:
            previous = self.times[tn.LAST_TOKEN_TIME_NS]
            gap = None if previous is None else now - previous
            self.times[tn.FIRST_TOKEN_TIME_NS] = self.times[tn.FIRST_TOKEN_TIME_NS] or now
            self.times[tn.LAST_TOKEN_TIME_NS] = now
        adapter.metrics.record_round(rnd.num_drafted, rnd.num_accepted, now, rnd.depth, gap)
        adapter.metrics.record_costs(adapter.costs, now)
        emission = self.emitter.push(rnd.new_tokens, final=rnd.finish_reason is not None)
        finish = rnd.finish_reason or (tn.FINISH_STOP if emission and emission.stopped else None)
        # An ensemble's cancellation arrives through the board (a stat); a direct caller's reaches the
        # sender, asked after the previous round's response (done by now).
        if finish is None and adapter.cancellations.is_cancelled(self.gen.seq_id):
            finish = tn.FINISH_CANCELLED
        if self.in_flight is not None:
            cancelled, self.in_flight = await self.in_flight, None
            finish = finish or (tn.FINISH_CANCELLED if cancelled else None)
        if finish:
            return finish, emission
        out = None
        if self.stream and emission:
            self.held = joined(self.held, emission)
            # the first tokens leave at once whatever the token interval (the time to first token is kept)
            if ((not self.first_sent or len(self.held.ids) >= self.parsed.stream_interval_tokens)
                    and now - self.streamed_at >= self.parsed.stream_interval_s):
                out, self.held, self.streamed_at = self.response(self.held, None), None, now
        if out is not None or now - self.asked >= CANCEL_POLL_S:
            self.asked = now
            self.in_flight = asyncio.ensure_future(self._send_and_check(out))
        return None, emission

    async def _send_and_check(self, response) -> bool:
        """A streamed response (if any), then whether the request was cancelled. A task: it starts once the
        request's coroutine next waits, i.e. after its next round's calls went out, so the send (an IPC round
        trip that blocks the loop's thread) overlaps that round instead of delaying it. The send stays on the
        loop's thread: Triton 24.10's stub sent from another thread while the loop ran Python code and, after a
        client that stopped reading was killed, corrupted the stub's heap (docs/results/
        2026-12-07-orchestrator-send-thread.md). The cancellation check waits on an IPC thread."""
        if response is not None:
            self.sender.send(response, flags=0)
        return await asyncio.get_running_loop().run_in_executor(self.adapter.ipc, self.sender.is_cancelled)

    async def settle(self) -> None:
        """Let a response still in flight leave before the request's final one (its error is moot)."""
        if self.in_flight is not None:
            with contextlib.suppress(Exception):
                await self.in_flight
            self.in_flight = None

    async def final(self, finish: str | None, last: Emission | None) -> None:
        pb = self.adapter.pb
        if finish == tn.FINISH_CANCELLED:
            last = self.emitter.push([], final=True)
        if not self.stream:  # one response: everything sent, cut where the emitter cut it
            last = Emission(self.emitter.emitted, [], self.emitter.text, len(self.emitter.text), False)
        else:  # with what earlier rounds held back
            last, self.held = joined(self.held, last), None
        await self.settle()  # a round that ended without a finish reason
        # Counted before the final response leaves: a client that reads the metrics after it sees them.
        self.adapter.metrics.record_request(finish, len(self.emitter.emitted), time.monotonic() - self.arrived,
                                            self.gen.lora_name, self.stats.drafted, self.stats.accepted,
                                            len(self.gen.prompt_ids), self.times, self.gen.max_tokens)
        self.sender.send(self.response(last, finish), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
