"""Triton Python-backend adapters for draft_model and target_model over an `engine.executor.Executor`.

Both models are sequence-batched: a request's correlation ID names the sequence whose KV cache it
extends. Inputs: input_ids (tokens to append), cache_length (cached tokens to keep: rollback), and
`release` with the sequence END flag to free the cache. target_model returns the greedy tokens (the best
of those an `allowed_tokens` bitmask allows, when one comes) and, on request, the logits of the last
num_logits positions; draft_model proposes num_draft_tokens tokens
(and their distributions when sampling).
"""

from __future__ import annotations


import os
import threading
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.utils.dlpack

from specdec import tensor_names as tn
from specdec.decoding.interfaces import ForwardStats
from specdec.decoding.rejection_sampler import greedy_verify
from specdec.decoding.token_mask import allowed_greedy
from specdec.decoding.sampling import (SamplingParams, greedy, greedy_log_probs, make_generator, scored_rows,
                                      token_log_probs, top_log_probs)
from specdec.decoding.text import load_tokenizer, same_tokenizer_files, vocabulary_mismatch
from specdec.engine import host_memory, onednn_linear, threads
from specdec.engine.lora_config import parse_adapters, parse_layer_map
from specdec.engine.build import ExecutorConfig, build_executor, plans_static
from specdec.engine.draft_heads import (HeadError, borrowed, load_head_for, rows_forward, served_layers,
                                        shared_target_tensors)
from specdec.engine.executor import CacheError, CapacityError, Scored, Step
from specdec.engine.head_executor import HeadExecutor
from specdec.engine.hosted_heads import HostedHeads
from specdec.engine.interfaces import Drafted
from specdec.engine.loading import check_q8, load_causal_lm, q8_kernels, quantize_q8, resolve_dtype
from specdec.engine.skip_layers import LayerSkipForward, SkipTuner, parse_layers
from specdec.triton.adapter import TritonAdapter
from specdec.triton.config import ConfigError, ModelParameters
from specdec.triton.metrics import HostedHeadMetrics, ModelMetrics, SkipMetrics
from specdec.triton.profiling import execute_profile
from specdec.triton import cache_reset, live_profile, marker_file, wire
from specdec.triton.responder import Job, Responder


RELEASED = object()  # the outcome of a release job (its answer: an empty response)


def _inputs(request) -> wire.Arrays:
    """A request's inputs by name, listed once: pb_utils.get_input_tensor_by_name lists them all (a call
    into the stub that builds every tensor object) on each lookup, and a step reads up to ten. A device
    tensor (a head's features handed over on the GPU) stays there, as a torch tensor."""
    return {tensor.name(): tensor.as_numpy() if tensor.is_cpu() else torch.utils.dlpack.from_dlpack(tensor.to_dlpack())
            for tensor in request.inputs()}


def host(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's values in host memory, wherever it lives: the one way tensors become numpy here."""
    return tensor.detach().cpu().numpy()


class LanguageModelAdapter(TritonAdapter):
    """Shared load / execute plumbing; subclasses say what a step is and how it is answered."""

    profile = None  # an ExecuteProfile when SPECDEC_PROFILE_DIR is set (load)
    tracer = None  # a live_profile.Tracer when the launcher enables clients' profiles (load)
    side_seconds = 0.0  # of the last `_run`, the time it spent outside the forward (subtracted from its cost)
    # The parameter listing the served heads whose features this model's executor returns or reads
    heads_parameter = ""
    reset_watch = marker_file.Watch("")  # a client's reset of the caches: the marker's, once started (`_start`)

    def load(self, params: ModelParameters, args: dict) -> None:
        self.name = params.model_name
        device = params.str("device", "cpu")
        # "cuda" (or "cpu" under a GPU instance group) means the GPU Triton gave this instance.
        if args.get("model_instance_kind") == "GPU" and device in ("cpu", "cuda"):
            device = f"cuda:{args.get('model_instance_device_id', '0')}"
        # auto: torch's own count (a thread per core), at most the CPUs this process may use (threads.py).
        threads.set_torch_threads(params.count_or_auto("torch_threads", "auto"))
        # false: one forward per sequence (the unbatched baseline of the batching benchmark).
        self.batched = params.bool("batched_forward", True)
        # On CUDA, logits and draft distributions go to the orchestrator as device tensors (DLPack; Triton
        # hands them over by CUDA IPC): a sampled round's (K+1) x V floats never cross host memory.
        self.device_outputs = params.bool("device_outputs", True)
        self.lm = self._executor(params, device)
        ready, seconds = self.lm.warm_up(params.float("capture_time_budget_s", 120.0, low=0.0))
        self.pb.Logger.log_info(f"{self.name}: {self.lm.forward.summary(ready, seconds)}")
        self._start(params)

    def _executor(self, params: ModelParameters, device: str):
        """The executor over the model at model_path (`Executor`), built as the parameters say."""
        default = ExecutorConfig()
        executor = params.str("executor", default.executor, choices=tn.EXECUTORS)
        compile = params.str("compile", default.compile, choices=tn.COMPILE_MODES)
        dtype = params.str("dtype", "float32", choices=tn.DTYPE_NAMES)
        model = load_causal_lm(
            params.str("model_path"),
            device=device,
            dtype=dtype,
            device_map=params.str("device_map", ""),
            linear_kernels=params.str("linear_kernels", "auto", choices=onednn_linear.KINDS),
            weights_dtype=params.str("weights_dtype", "same", choices=tn.WEIGHTS_DTYPES),
            log=self.pb.Logger.log_info,
            # the static executor reads only the weights: built without transformers' modeling stack
            own_modules=plans_static(executor, compile, device, resolve_dtype(dtype)),
        )
        # Loading freed its temporaries (dequantized blocks, the file's tensors): given back before the KV pool
        # is allocated, which under TCMalloc would otherwise reuse their pages, resident from the start.
        host_memory.trim_heap()
        config = ExecutorConfig(
            executor=executor,
            compile=compile,
            max_sequences=params.int("max_sequences", default.max_sequences, low=1),
            idle_timeout_s=params.float("sequence_idle_timeout_s", default.idle_timeout_s, low=1.0),
            prefix_caching=params.bool("prefix_caching", default.prefix_caching),
            block_size=params.int("kv_block_size", default.block_size, low=1),
            prefix_cache_tokens=params.int("prefix_cache_tokens", default.prefix_cache_tokens, low=0),
            min_forward_rows=params.int("min_forward_rows", 0, low=0) or None,  # 0: the executor's choice
            kv_pool_tokens=params.int("kv_pool_tokens", default.kv_pool_tokens, low=0),
            kv_memory_fraction=params.float("kv_memory_fraction", default.kv_memory_fraction, low=0.0, high=1.0),
            max_context=params.int("max_context_tokens", default.max_context, low=1),
            max_batch=params.int("max_batch_forward", default.max_batch, low=1),
            max_rows=params.int("max_num_draft_tokens", default.max_rows - 1, low=1) + 1,
            fuse_kernels=params.bool("fuse_kernels", default.fuse_kernels),
            fuse_mlp=params.bool("fuse_mlp", default.fuse_mlp),
            prefill_graph_rows=params.int("prefill_graph_rows", default.prefill_graph_rows, low=0),
            attention=params.str("attention", default.attention, choices=tn.ATTENTION_KINDS),
            hidden_layers=self._served_layers(params, model.config.get_text_config().num_hidden_layers),
            skip_layers=self._skip_layers(params, model),
            # the search changes the set between forwards: with CUDA graphs, they follow the set it holds best
            skip_search=self._searches_skip(params),
            **self._lora(params, model))
        try:
            return build_executor(model, config, log=self.pb.Logger.log_info)
        except ValueError as exc:
            raise ConfigError(f"{self.name}: {exc} ({params.str('model_path')})") from None

    def _load_head(self, params: ModelParameters, device: str, head_path: str, target_path: str,
                   weights_dtype: str, name: str = "", target: tuple | None = None
                   ) -> tuple[HeadExecutor, torch.Tensor | None, int]:
        """A trained head over the target at target_path (its embedding, and EAGLE-1's lm_head, read from its
        files, or borrowed from `target`: load_head_for's): (its executor, its layers' columns among the
        target's served ones (None: all of them, in order), the served layers' count). weights_dtype q8
        rounds the head's linears as a model's; fp8 (a pair's setting for its models) leaves them in dtype."""
        where = f"{self.name}{f' head {name!r}' if name else ''}"
        dtype_name = params.str("dtype", "float32", choices=tn.DTYPE_NAMES)
        linear_kernels = params.str("linear_kernels", "auto", choices=onednn_linear.KINDS)
        try:
            if weights_dtype == "q8":
                check_q8(device, dtype_name, linear_kernels)
            head, target_config = load_head_for(head_path, target_path, device, getattr(torch, dtype_name), target)
        except (HeadError, ValueError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if weights_dtype == "q8":  # the head's own linears (the target's embedding it borrows stays)
            quantize_q8(head, head_path, self.pb.Logger.log_info)
        onednn_linear.apply(q8_kernels(linear_kernels, weights_dtype), head, head_path, self.pb.Logger.log_info,
                            forward=rows_forward(head))
        # The target returns the states of the layers its heads read, concatenated: this head's, in its order
        target_layers = target_config.get_text_config().num_hidden_layers
        served = self._served_layers(params, target_layers)
        wanted = head.config.feature_layers(target_layers)
        missing = [layer for layer in wanted if layer not in served]
        if missing:
            fix = ("draft_heads must list every hosted head's directory" if name else
                   "target_draft_heads must list target_model's draft_heads, this head among them")
            raise ConfigError(f"{where}: the head {head_path} reads the target's layers {list(wanted)}, but "
                              f"target_model serves {list(served)} ({fix})")
        columns = [served.index(layer) for layer in wanted]
        self.pb.Logger.log_info(f"{where}: {head.config.kind} head {head_path} over the target {target_path}, "
                                f"reading layers {list(wanted)}")
        # On CUDA its one-token steps replay CUDA graphs (head_graphs.py) unless compile is off.
        compile_mode = params.str("compile", "auto", choices=tn.COMPILE_MODES)
        lm = HeadExecutor(head, max_sequences=params.int("max_sequences", 256, low=1),
                          idle_timeout_s=params.float("sequence_idle_timeout_s", 600.0, low=1.0),
                          graphs=False if compile_mode == "off" else None,
                          max_context=params.int("max_context_tokens", 8192, low=1))
        return lm, None if columns == list(range(len(served))) else torch.tensor(columns), len(served)

    def _searches_skip(self, params: ModelParameters) -> bool:
        """A layer-skip self-draft whose set is searched on the fly (skip_layers auto): a draft's."""
        return False

    def _skip_layers(self, params: ModelParameters, model) -> tuple[int, ...] | None:
        """The layers a layer-skip self-draft leaves out (None: not one)."""
        return None

    def _lora(self, params: ModelParameters, model) -> dict:
        """The LoRA adapters the model serves, as ExecutorConfig's fields (a target's; a draft's where it is
        made of the target's layers)."""
        return {}

    def _adapters(self, params: ModelParameters) -> dict:
        """lora_adapters, lora_directory, max_loras and max_lora_rank as ExecutorConfig's fields."""
        try:
            adapters = tuple(parse_adapters(params.str("lora_adapters", ""), "parameter 'lora_adapters'").items())
        except ValueError as exc:
            raise ConfigError(f"{self.name}: {exc}") from None
        directory = params.str("lora_directory", "")
        if directory and not Path(directory).is_dir():
            raise ConfigError(f"{self.name}: parameter 'lora_directory': {directory} is not a directory")
        return {"lora_adapters": adapters, "lora_directory": directory,
                "max_loras": params.int("max_loras", 0, low=0), "max_lora_rank": params.int("max_lora_rank", 0, low=0)}

    def _served_layers(self, params: ModelParameters, target_layers: int) -> tuple[int, ...]:
        """The layers whose states the served heads read (draft_heads: target_model's list of them)."""
        key = self.heads_parameter
        try:
            return served_layers(params.list(key), target_layers)
        except HeadError as exc:
            raise ConfigError(f"{self.name}: parameter '{key}': {exc}") from None

    def _start(self, params: ModelParameters) -> None:
        """Metrics, the warm-up, the evictor thread and the optional responder, once the executor is built."""
        self.metrics = ModelMetrics(self.pb, self.name)
        self.metrics.kv_capacity.set(self.lm.kv_bytes_capacity)
        self._warm_up()
        # Abandoned sequences (no release call: a crashed orchestrator, a killed client) are evicted by
        # time, also while no request arrives to run `execute`: a thread checks every quarter timeout.
        # The lock keeps it out of a running forward.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # A client's reset of the caches (cache_reset.py): looked for before each execute's work and by the
        # evictor thread, so that an idle model's metrics show it too; not at all without a prefix cache
        self.reset_watch = marker_file.Watch(cache_reset.path_from_env() if self.lm.prefix is not None else "")
        # The same thread hands the host memory of ended sequences back to the OS, at most once per
        # interval (0: never): glibc keeps it otherwise and the stub's RSS creeps up under load.
        self.heap_trim_interval_s = params.float("heap_trim_interval_s", 30.0, low=0.0)
        self.trims = host_memory.TrimSchedule(self.heap_trim_interval_s)
        if self.heap_trim_interval_s:  # what the warm-up's forwards freed
            host_memory.trim_heap()
        interval = min(max(self.lm.idle_timeout_s / 4, 0.25), 30.0)
        if self.heap_trim_interval_s:
            interval = min(interval, max(self.heap_trim_interval_s, 0.25))
        self._evictor = threading.Thread(target=self._evict_periodically, args=(interval,), daemon=True,
                                         name=f"{self.name}-evictor")
        self._evictor.start()
        # true: execute returns once its forward is done, and a thread of the model's own builds and sends
        # the responses while Triton hands over the next batch (responder.py).
        self.responder = None
        self.profile = execute_profile(self.name)  # SPECDEC_PROFILE_DIR set: cProfile over execute (profiling.py)
        if self.profile is not None:
            self.pb.Logger.log_info(f"{self.name}: profiling execute into {self.profile.path}")
        control = os.environ.get(live_profile.CONTROL_ENV, "")  # clients' torch profiles (live_profile.py)
        self.tracer = live_profile.Tracer(self.name, control, self.pb.Logger.log_info) if control else None
        if params.bool("pipelined_execute", False):
            self.responder = self._responder()
            self.pb.Logger.log_info(f"{self.name}: pipelined execute: responses sent from the model's responder thread")

    def _warm_up(self) -> None:
        """Run the shapes of serving once before the server reports ready, so that the first requests do
        not pay lazy initialization (CUDA context, cuBLAS handles and workspaces, kernel selection)."""
        started = time.perf_counter()
        self._warm_up_steps()
        self.lm.tokens_processed = 0  # the metrics count served tokens only
        self.lm.prefix_queried_tokens = self.lm.prefix_hit_tokens = 0
        self.forward_seconds = 0.0
        self.pb.Logger.log_info(f"{self.name}: warmed up in {time.perf_counter() - started:.2f} s "
                                f"on {self.lm.device}, torch threads: {torch.get_num_threads()}")

    def _warm_up_steps(self) -> None:
        raise NotImplementedError

    def _evict_periodically(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            with self._lock:
                reset = self._reset_if_asked()
                if self.lm.evict_idle() or reset:
                    self.trims.freed()
                    self._report_metrics(flush=True)
            self._trim_heap_if_due()

    def _reset_if_asked(self) -> bool:
        """Forget the cached prefixes if a client asked since the last look (under the lock)."""
        if not self.reset_watch.due():
            return False
        forgotten = self.lm.reset_prefix_cache()
        self.pb.Logger.log_info(f"{self.name}: caches reset at a client's request: {forgotten} cached blocks forgotten")
        return True

    def _trim_heap_if_due(self) -> None:
        # Outside the lock: forwards go on meanwhile (malloc_trim locks one heap at a time and ctypes
        # releases the GIL), and a trim after a heavy churn can take tens of milliseconds.
        if self.trims.due():
            if host_memory.trim_heap():
                self.metrics.heap_trims.increment(1)

    def _report_metrics(self, flush: bool) -> None:
        self.metrics.report(self.lm.tokens_processed, len(self.lm.sequences), self.lm.kv_bytes_allocated, flush,
                            self.forward_seconds, (self.lm.prefix_queried_tokens, self.lm.prefix_hit_tokens),
                            self.lm.prefix_cache_bytes, (self.lm.ahead_used, self.lm.ahead_dropped),
                            self.lm.adapters.loads if self.lm.adapters is not None else 0)

    def execute(self, requests):
        """All pending steps (of different sequences: the sequence batcher sends one step per sequence
        at a time) run as one batched forward; each request gets its own response or error. Pipelined,
        the responses are built and sent by the responder's thread (responder.py) and execute returns."""
        run = self._execute if self.profile is None else self._execute_in_cprofile
        return run(requests) if self.tracer is None else self.tracer.run(run, requests)

    def _execute_in_cprofile(self, requests):
        with self.profile:
            return self._execute(requests)

    def _execute(self, requests):
        jobs = [self._parse(request) for request in requests]
        with self._lock:
            outcomes = self._run_jobs(jobs)
        if self.responder is not None:
            self.responder.submit(jobs, outcomes)
            return None
        return [self._answer(job, outcome) for job, outcome in zip(jobs, outcomes)]

    def _parse(self, request) -> Job:
        seq_id = request.correlation_id()
        try:
            inputs = _inputs(request)
            if wire.StepMessage.decode(inputs).release:
                return Job(request, seq_id)
            return Job(request, seq_id, self._parse_step(inputs, seq_id, frozenset(request.requested_output_names())))
        except (CacheError, ValueError) as exc:
            return Job(request, seq_id, error=exc)

    def _run_jobs(self, jobs: list[Job]) -> list:
        """Per job its outcome: (result, ForwardStats) for a step, RELEASED for a release, or an Exception.
        The steps run as one batched forward (one per step with batched_forward false)."""
        released = self._reset_if_asked()
        self.lm.evict_idle()
        outcomes: list = [job.error for job in jobs]
        steps, owners = [], []
        for i, job in enumerate(jobs):
            if job.error is not None:
                continue
            if job.step is None:
                self.lm.release(job.seq_id)
                self.trims.freed()
                released = True
                outcomes[i] = RELEASED
            else:
                steps.append(job.step)
                owners.append(i)
        if steps:
            groups = [steps] if self.batched else [[step] for step in steps]
            results, forwards = [], []
            for group in groups:
                started, processed = time.perf_counter(), self.lm.tokens_processed
                try:
                    results += self._run(group)
                    if self.lm.device.type == "cuda":  # the time below is the GPU's, not the launch's
                        # (the forward's stream only: not a pipelined responder's, responder.py)
                        torch.cuda.current_stream(self.lm.device).synchronize()
                except Exception as exc:  # noqa: BLE001 - the batch fails, the server keeps serving
                    results += [RuntimeError(f"{type(exc).__name__}: {exc}")] * len(group)
                # what _run did besides the forward (a hosted head's drafting) is not the forward's cost
                seconds, self.side_seconds = time.perf_counter() - started - self.side_seconds, 0.0
                if self.lm.ahead_taken and len(self.lm.ahead_taken) == len(group):
                    # Run ahead (run_ahead.py): what the forward took, not the rest of it this execute waited
                    seconds = max(timer.seconds() for timer in self.lm.ahead_taken.values())
                # What this forward cost, for the orchestrator's cost model: rows, sequences, seconds.
                forward = ForwardStats(self._rows(group, processed), len(group), seconds)
                self.forward_seconds += forward.seconds
                forwards += [forward] * len(group)
            try:
                results = self._gather(steps, results)
            except Exception as exc:  # noqa: BLE001 - as a failed forward: every step gets the error
                results = [RuntimeError(f"{type(exc).__name__}: {exc}")] * len(results)
            for i, result, forward in zip(owners, results, forwards):
                outcomes[i] = result if isinstance(result, Exception) else (result, forward)
        self._report_metrics(flush=released)
        return outcomes

    def _responder(self) -> Responder:
        if self.lm.device.type != "cuda":
            return Responder(self.name, self._answer, self._send, self.pb.Logger.log_warn)
        # The responder's kernels (an output's dtype conversion, log-probabilities) go on a stream of their
        # own: on the default one they would queue behind the next batch's forward, and a response would
        # wait for it. Their inputs are complete: execute synchronized before handing them over.
        stream = torch.cuda.Stream(self.lm.device)

        def answer_on_stream(job: Job, outcome):
            with torch.cuda.device(self.lm.device), torch.cuda.stream(stream):
                return self._answer(job, outcome)
        return Responder(self.name, answer_on_stream, self._send, self.pb.Logger.log_warn)

    def _answer(self, job: Job, outcome):
        """A job's response: its error, the empty answer to a release, or its step's outputs."""
        if isinstance(outcome, Exception):
            return self._error(outcome)
        if outcome is RELEASED:
            return self.pb.InferenceResponse(output_tensors=[])
        try:
            return self._respond(job.request, job.step, *outcome)
        except Exception as exc:  # noqa: BLE001 - this request fails, the others are answered
            return self._error(RuntimeError(f"{type(exc).__name__}: {exc}"))

    def _send(self, job: Job, response) -> None:
        """Pipelined: a request's one response goes through its sender (execute returned None)."""
        job.request.get_response_sender().send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _output(self, name: str, tensor: torch.Tensor):
        """A response tensor: a CUDA tensor stays on the device (`device_outputs`), others go to the host."""
        if self.device_outputs and tensor.is_cuda:
            tensor = tensor.contiguous()
            # DLPack carries no stream: the tensor must be complete before Triton reads it.
            torch.cuda.current_stream(tensor.device).synchronize()
            return self.pb.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(tensor))
        return self.pb.Tensor(name, host(tensor))

    def _error(self, exc: Exception):
        # No room for a new sequence (KV budget, max_sequences) is UNAVAILABLE: the orchestrator waits for
        # room or refuses the request with it, as over max_live_sequences.
        code = self.pb.TritonError.UNAVAILABLE if isinstance(exc, CapacityError) else self.pb.TritonError.INTERNAL
        return self.pb.InferenceResponse(error=self.pb.TritonError(f"{self.name}: {exc}", code))

    def _parse_step(self, inputs: wire.Arrays, seq_id: int, wanted: frozenset = frozenset()) -> Step:
        """The step a request asks for (`wanted`: the names of the outputs it asks for)."""
        message = wire.StepMessage.decode(inputs)
        return Step(seq_id, message.keep, message.new_ids, reserve=message.reserve, salt=message.salt,
                    **self._step_options(inputs, wanted))

    def _step_options(self, inputs: wire.Arrays, wanted: frozenset) -> dict:
        """The model-specific fields of a Step (num_logits, or k and sampling)."""
        raise NotImplementedError

    def _rows(self, group: list[Step], processed: int) -> int:
        """A batched execution's token rows, as its ForwardStats report them (processed: the executor's
        tokens_processed before it): the new tokens sent."""
        return sum(len(step.new_ids) for step in group)

    def _run(self, steps: list[Step]) -> list:
        raise NotImplementedError

    def _gather(self, steps: list[Step], results: list) -> list:
        """What the responses need of the execution's results, prepared for all of them at once."""
        return results

    def _respond(self, request, step: Step, result, forward: ForwardStats):
        raise NotImplementedError

    def finalize(self):
        if self.profile is not None:
            self.profile.write()
        if self.tracer is not None:
            self.tracer.close()
        if self.responder is not None:
            self.responder.stop()
        self._stop.set()
        self._evictor.join(timeout=5)
        self.lm.sequences.clear()
        self.metrics.close()
        super().finalize()


WARM_UP_SEQUENCE = 0  # Triton never uses correlation ID 0 for a sequence: it cannot collide with one


class ReadyFeatures(NamedTuple):
    """A step's FEATURES response tensor made before the response (TargetModel._run_ahead)."""

    tensor: object  # a pb.Tensor


class TargetModel(LanguageModelAdapter):
    heads_parameter = "draft_heads"  # the heads it returns features for
    # What a step run ahead can answer: its greedy token, the forward's cost and its features (a head's
    # request that drafts nothing still takes them: ~2.2 ms a round on an H200 without its step run ahead,
    # docs/results/2026-12-04-gpu-h200-heads.md), nothing of its logits.
    AHEAD_OUTPUTS = frozenset({tn.GREEDY_TOKENS, tn.FORWARD_STATS, tn.FEATURES})
    run_ahead = False  # the run_ahead parameter, read at load (_start)

    def _lora(self, params, model):
        return self._adapters(params)

    hosted: HostedHeads | None = None  # hosted_heads, read at load (_start)
    hosted_metrics: HostedHeadMetrics | None = None

    def _start(self, params):
        mode = params.str("run_ahead", "auto", choices=tn.RUN_AHEAD_MODES)
        self.run_ahead = mode == "on" or (mode == "auto" and self.lm.device.type == "cuda")
        self.hosted = self._hosted_heads(params)
        # a hosted head's proposal and its execution, by sequence, from the forward to the response
        self._drafted: dict[int, tuple[Drafted, ForwardStats]] = {}
        # a hosted head's round run ahead, by sequence: (the call expected, the step run, its proposal, what
        # HostedHeads.restore needs where the call asks for another)
        self._hosted_ahead: dict[int, tuple] = {}
        # by sequence: [rounds to let pass before one runs ahead again, the pause after the next drop]. A drop
        # costs a GPU the rest of a forward the call then waits behind: a sequence whose calls often ask for
        # another round (prompt lookup's drafts under ngram+NAME, K rising) runs fewer ahead
        self._ahead_pause: dict[int, list[int]] = {}
        if self.hosted is not None:
            self.hosted_metrics = HostedHeadMetrics(self.pb, self.name, list(self.hosted.heads))
        super()._start(params)

    def _report_metrics(self, flush):
        super()._report_metrics(flush)
        if self.hosted_metrics is not None:
            self.hosted_metrics.report(self.hosted.totals, flush)

    def finalize(self):
        super().finalize()
        if self.hosted_metrics is not None:
            self.hosted_metrics.close()

    def _hosted_heads(self, params) -> HostedHeads | None:
        """hosted_heads (NAME=DIR, ...): heads drafting in this process (engine/hosted_heads.py)."""
        spec = params.str("hosted_heads", "")
        if not spec:
            return None
        weights_dtype = params.str("hosted_head_weights_dtype", "same", choices=tn.WEIGHTS_DTYPES)
        stop_below = params.float("hosted_stop_below", tn.DEFAULT_DRAFT_STOP_BELOW, low=0.0, high=1.0)
        budget = params.float("capture_time_budget_s", 120.0, low=0.0)
        heads, columns = {}, {}
        # the target's embedding (and EAGLE-1's lm_head) borrowed, not copied: one tensor in this process
        dtype = getattr(torch, params.str("dtype", "float32", choices=tn.DTYPE_NAMES))
        target = shared_target_tensors(self.lm.model, dtype, self.lm.device)
        for entry in spec.split(","):
            name, sep, path = entry.strip().partition("=")
            if not sep or not name.isidentifier() or not path or name in heads:
                raise ConfigError(f"{self.name}: parameter 'hosted_heads': {entry!r} is not NAME=DIR (NAME a "
                                  "model name of its own)")
            heads[name], columns[name], _ = self._load_head(params, str(self.lm.device), path, params.str("model_path"),
                                                            weights_dtype, name, target)
            shared = borrowed(heads[name].head, self.lm.model)
            self.pb.Logger.log_info(f"{self.name}: hosted head {name!r} borrows the target's "
                                    f"{' and '.join(shared) or 'nothing'}")
            heads[name].stop_below = stop_below
            ready, seconds = heads[name].warm_up(budget)
            self.pb.Logger.log_info(f"{self.name}: hosted head {name!r}: {heads[name].forward.summary(ready, seconds)}")
        return HostedHeads(heads, columns)

    def _run_jobs(self, jobs):
        if self.hosted is not None:
            for job in jobs:
                if job.error is None and job.step is None:  # a release: the head's side of the sequence too
                    self.hosted.release(job.seq_id)
                    self._drafted.pop(job.seq_id, None)
                    self._hosted_ahead.pop(job.seq_id, None)
                    self._ahead_pause.pop(job.seq_id, None)
        outcomes = super()._run_jobs(jobs)
        if self.hosted is not None:
            self.hosted.keep_only(self.lm.sequences)  # evicted while idle
            for kept in (self._hosted_ahead, self._ahead_pause):
                for seq_id in [seq_id for seq_id in kept if seq_id not in self.lm.sequences]:
                    del kept[seq_id]
        self._run_ahead(jobs, outcomes)
        return outcomes

    def _run_ahead(self, jobs, outcomes) -> None:
        """After a greedy one-token step that asked for nothing but its token (a target-only round), run
        the sequence's next step now (engine/run_ahead.py), while this response travels to the orchestrator
        and its next request comes back; after a hosted head's greedy round, its next round
        (`_run_round_ahead`). Only with one sequence live: with more, a step run ahead for one would hold up
        the forward the others' requests are about to ask for."""
        if not self.run_ahead or len(jobs) != 1 or len(self.lm.sequences) != 1:
            return
        (job,), (outcome,) = jobs, outcomes
        step = job.step
        if step is None or not isinstance(outcome, tuple):
            return
        drafted = getattr(self, "_drafted", {}).get(step.seq_id)
        if drafted is not None and drafted[0].tokens:  # a hosted head drafted in this step
            self._run_round_ahead(job, outcome)
            return
        if len(step.new_ids) != 1 or step.num_logits != 1 or step.allowed is not None or step.tree is not None:
            return
        wanted = set(job.request.requested_output_names())  # none named: all of them
        if not wanted or not wanted <= self.AHEAD_OUTPUTS:
            return
        (logits, tokens, hidden, rows), forward = outcome
        if hidden is not None and tn.FEATURES in wanted:
            # The response's features made now: made once the step run ahead is queued, they (and the
            # response) would wait for its whole forward on the stream
            outcomes[0] = ((logits, tokens, ReadyFeatures(self._features_output(hidden)), rows), forward)
        self.lm.run_ahead(job.seq_id, greedy(logits[-1]).reshape(1), int(tokens[-1]))

    AHEAD_PAUSE_MAX = 8  # rounds a sequence's hosted rounds at most let pass after a drop before one runs ahead
    HOSTED_OUTPUTS = frozenset({tn.GREEDY_TOKENS, tn.FORWARD_STATS, tn.DRAFT_TOKENS, tn.DRAFT_PARENTS, tn.DRAFT_STATS})

    def _run_round_ahead(self, job, outcome) -> None:
        """After a hosted head's greedy chain round that asked for nothing but the greedy picks and the
        proposal (so the orchestrator decides from the picks alone: no logits, no grammar), the next call is
        known but for its K: it keeps the drafts the picks agree with and sends the pick after them. The
        head drafts that round now, at this round's K, and the target verifies it at once (run_ahead.py);
        the call takes it where it asks for that round or for fewer drafts (`_take_ahead`)."""
        step = job.step
        drafted = self._drafted[step.seq_id][0]
        wanted = set(job.request.requested_output_names())
        if (not wanted or not wanted <= self.HOSTED_OUTPUTS or not step.params.greedy or step.branches != 1
                or drafted.parents is not None or step.allowed is not None or step.score_rows or step.tree is not None):
            return
        pause = self._ahead_pause.get(step.seq_id)
        if pause is not None and pause[0] > 0:  # its last one was dropped: this round runs none
            pause[0] -= 1
            return
        (_, tokens, _, _), _ = outcome
        verdict = greedy_verify(drafted.tokens, tokens[-(len(drafted.tokens) + 1):])  # the orchestrator's rule
        expected = step._replace(keep=step.keep + len(step.new_ids) + verdict.num_accepted,
                                 new_ids=[verdict.next_token], num_logits=1, reserve=0, path=None)
        failures = self.hosted.failures
        prepared = self.hosted.ahead(expected)
        if self.hosted.failures > failures:
            self.pb.Logger.log_warn(f"{self.name}: a hosted head failed to draft a round run ahead (the call will "
                                    f"draft its own): {self.hosted.last_failure}")
        if prepared is None:
            return
        run, proposal, saved = prepared
        try:
            ran = self.lm.run_ahead_step(run)
        except Exception as exc:  # noqa: BLE001 - this round's response is made; the next call runs its own
            self.pb.Logger.log_warn(f"{self.name}: a hosted round run ahead failed: {type(exc).__name__}: {exc}")
            self.lm.ahead.pop(step.seq_id, None)
            ran = False
        if not ran:
            self.hosted.restore(step.seq_id, saved)
            return
        self._hosted_ahead[step.seq_id] = (expected, run, proposal, saved)

    def _take_ahead(self, steps: list[Step]) -> dict[int, tuple[Step, tuple[Drafted, ForwardStats]]]:
        """The hosted rounds run ahead that these steps ask for, by index: the step that ran, cut to the drafts
        asked for, and its proposal likewise; the others' sequences' heads are put back as they were (the
        executor drops their steps as it drops any step run ahead that no call asks for)."""
        ready = {}
        for i, step in enumerate(steps):
            pending = self._hosted_ahead.pop(step.seq_id, None)
            if pending is None:
                continue
            expected, run, (drafted, stats), saved = pending
            # more drafts than it ran: the same, where its chain ended before its K (the confidence stop)
            k_fits = 0 < step.k <= expected.k or (step.k > 0 and len(drafted.tokens) < expected.k)
            if (step.keep == expected.keep and [int(token) for token in step.new_ids] == expected.new_ids
                    and step.num_logits == 1 and step.draft_head == expected.draft_head and k_fits
                    and step.branches == 1 and step.params == expected.params and step.allowed is None
                    and step.tree is None and step.path is None and not step.score_rows
                    and step.adapter == expected.adapter):
                m = min(step.k, len(drafted.tokens))
                ready[i] = (run._replace(new_ids=list(run.new_ids[:1 + m]), num_logits=1 + m, k=step.k),
                            (drafted._replace(tokens=list(drafted.tokens[:m])), stats))
            else:  # (a round that drafts nothing may still take its first row's logits: the executor's match)
                self.hosted.restore(step.seq_id, saved)
        return ready

    def _warm_up_steps(self):
        prompt = list(range(1, 17))
        self.lm.extend(WARM_UP_SEQUENCE, 0, prompt, 1)  # a prefill
        self.lm.extend(WARM_UP_SEQUENCE, 16, [1], 1)  # a target-only step
        self.lm.extend(WARM_UP_SEQUENCE, 17, [1, 2, 3, 4, 5], 5)  # a verify of K + 1 = 5 positions
        self.lm.release(WARM_UP_SEQUENCE)
        for head in (self.hosted.heads.values() if self.hosted is not None else ()):  # a head drafts from features
            features = torch.zeros(15, head.config.feature_width, device=head.device)
            head.propose(WARM_UP_SEQUENCE, 0, prompt, 4, SamplingParams(), features=features)
            head.propose(WARM_UP_SEQUENCE, 15, [16, 1], 4, SamplingParams(temperature=1.0, top_p=0.9),
                         make_generator(0, head.logits_device), features=features[:1])
            head.release(WARM_UP_SEQUENCE)

    def _step_options(self, inputs, wanted=frozenset()):
        message = wire.VerifyMessage.decode(inputs)  # allowed: structured output's picks keep to the grammar
        if message.score_rows and not message.num_logits and message.score_next < 0:
            raise ValueError(f"{tn.SCORE_ROWS} with no position verified after them needs {tn.SCORE_NEXT} (the token "
                             "their last row scores)")
        # A head's rounds want the features of every position: cached blocks only where their features are kept
        if message.adapter:  # one it holds or can read (the executor gives it a slot at the sequence's first step)
            problem = self.lm.adapters.problem(message.adapter) if self.lm.adapters is not None else \
                f"no LoRA adapter {message.adapter!r} (this model serves none)"
            if problem:
                raise ValueError(f"input '{tn.LORA_NAME}': {problem}")
        options = {"num_logits": message.num_logits + message.score_rows, "allowed": message.allowed,
                   "adapter": message.adapter,
                   "tree": message.tree, "path": message.path, "score_rows": message.score_rows,
                   "score_next": message.score_next,
                   "whole": tn.FEATURES in wanted and bool(self.lm.forward.hidden_layers)}
        ask = message.draft
        if ask is not None:  # a hosted head drafts first, reading every position's features (whole)
            head = self.hosted.heads.get(ask.head) if self.hosted is not None else None
            if head is None:
                raise ValueError(f"input '{tn.DRAFT_HEAD}': no hosted head {ask.head!r} (this model hosts "
                                 f"{', '.join(self.hosted.heads) if self.hosted is not None else 'none'})")
            options.update(draft_head=ask.head, k=ask.k, params=ask.params, branches=ask.branches, whole=True,
                           generator=None if ask.params.greedy else make_generator(ask.seed, head.logits_device))
        return options

    def _rows(self, group, processed):
        # The rows the forward ran: a prompt's tokens found in the prefix cache are not (counted, a 900-token
        # prompt that ran 31 priced every verify up to 900 rows at the cost of 31)
        return self.lm.tokens_processed - processed

    def _run(self, steps):
        pending = [step.seq_id for step in steps if step.seq_id in getattr(self, "_hosted_ahead", ())]
        if not pending:
            return self._verify(steps, {})
        results = self._verify(steps, self._take_ahead(steps))
        for seq_id in pending:  # the executor took the round run ahead (or its first rows), or dropped it
            if seq_id in self.lm.ahead_taken:
                self._ahead_pause.pop(seq_id, None)
            else:
                pause = self._ahead_pause.setdefault(seq_id, [0, 1])
                pause[0], pause[1] = pause[1], min(2 * pause[1], self.AHEAD_PAUSE_MAX)
        return results

    def _verify(self, steps, ready):
        # With hidden_layers (a draft head is served), every step's features come too (Scored): a head's
        # rounds ask for them, and a forward computes them anyway.
        if self.hosted is None or not any(step.draft_head for step in steps):
            return self.lm.extend_many(steps, with_hidden=bool(self.lm.forward.hidden_layers))
        failures = self.hosted.failures
        # the heads draft (but the rounds run ahead), then the forward
        results, drafted, self.side_seconds = self.hosted.verify(self.lm, steps, ready)
        if self.hosted.failures > failures:
            self.pb.Logger.log_warn(f"{self.name}: a hosted head failed to draft (its rounds verify nothing drafted): "
                                    f"{self.hosted.last_failure}")
        self._drafted.update(drafted)
        return results

    def _gather(self, steps, results):
        """Per step (logits, greedy tokens, features or None, scored rows or None) or its error; a step with
        an allowed-tokens bitmask gets the best allowed tokens. Every step's greedy tokens come to the host in
        one copy: on CUDA the execution waits for the device once, not once per request. A step with score
        rows (a prompt's log-probabilities) keeps all its logits as the fourth entry (the score rows are its
        first); the first entry is the rest, the positions it verifies."""
        results = [(result.logits, result.hidden) if isinstance(result, Scored) else
                   result if isinstance(result, Exception) else (result, None) for result in results]
        prompt_rows = [None] * len(results)
        for i, (step, result) in enumerate(zip(steps, results)):
            if step.score_rows and not isinstance(result, Exception):
                prompt_rows[i] = result[0]  # all of them: sampling.scored_rows reads the score rows' places
                results[i] = (result[0][step.score_rows:], result[1])
        scored = [(step, result[0]) for step, result in zip(steps, results) if not isinstance(result, Exception)]
        if not scored:
            return results
        tokens = host(torch.cat([greedy(logits) if step.allowed is None else allowed_greedy(logits, step.allowed)
                                 for step, logits in scored]).to(torch.int32))
        per_step = iter(np.split(tokens, np.cumsum([len(logits) for _, logits in scored])[:-1]))
        return [result if isinstance(result, Exception) else (result[0], next(per_step), result[1], rows)
                for result, rows in zip(results, prompt_rows)]

    def _respond(self, request, step, result, forward):
        pb = self.pb
        logits, tokens, hidden, scored_logits = result
        requested = set(request.requested_output_names())
        log_probs = top_ids = top_values = None
        if tn.GREEDY_TOP_IDS in requested:  # num_top_log_probs on a greedy round: (K + 1) x 20 of each
            top_ids, top_values = (host(t) for t in top_log_probs(logits, tn.MAX_TOP_LOG_PROBS))
        if tn.GREEDY_LOG_PROBS in requested:  # return_log_probs on a greedy round: K + 1 floats, not logits
            # (the raw distribution's; a greedy token's is its row's first of the top ones, the same bits)
            log_probs = (top_values[:, 0].copy() if top_values is not None and step.allowed is None else
                         host(greedy_log_probs(logits)) if step.allowed is None else
                         host(token_log_probs(logits, torch.from_numpy(tokens).long())))
        scored = scored_ranks = scored_ids = scored_values = None
        if scored_logits is not None:  # each score row's next new token (a chunk's last row: score_next)
            top = tn.MAX_TOP_LOG_PROBS if tn.SCORED_TOP_IDS in requested else 0
            scored, scored_ranks, scored_ids, scored_values = (
                None if t is None else host(t)
                for t in scored_rows(scored_logits, step.new_ids, step.score_rows, top, step.score_next))
        cached = None
        if tn.CACHED_TOKENS in requested:
            seq = self.lm.sequences.get(step.seq_id)
            cached = seq.cached if seq is not None else 0
        message = wire.VerifiedMessage(tokens, forward if tn.FORWARD_STATS in requested else None, log_probs,
                                       top_ids, top_values, scored, scored_ids, scored_values, cached,
                                       self.lm.block_size, scored_ranks=scored_ranks)
        outputs = [pb.Tensor(name, value) for name, value in message.encode().items()]
        if tn.SCORED_LOGITS in requested and scored_logits is not None:  # (1, score rows, V): the context's
            outputs.append(self._output(tn.SCORED_LOGITS, scored_logits[:step.score_rows].float()[None]))
        if tn.LOGITS in requested:
            outputs.append(self._output(tn.LOGITS, logits.float()[None]))
        if tn.FEATURES in requested:  # (1, rows, L x H); none served (no head): empty. A request naming no
            # outputs asks for them all, features too
            if isinstance(hidden, ReadyFeatures):  # complete already (a step run ahead is on the stream)
                outputs.append(hidden.tensor)
            else:
                outputs.append(self._features_output(hidden))
        drafted = self._drafted.pop(step.seq_id, None) if step.draft_head else None
        if tn.DRAFT_TOKENS in requested:  # what a hosted head drafted, verified after the step's new tokens
            proposal, stats = drafted if drafted is not None else (Drafted([], None, 0), ForwardStats(0, 0, 0.0))
            message = wire.HostedDraftMessage(proposal.tokens, proposal.parents, stats)
            outputs += [pb.Tensor(name, value) for name, value in message.encode().items()]
            if tn.DRAFT_PROBS in requested:  # a sampled chain's; none for a tree (its nodes are point masses)
                probs = proposal.probs if proposal.probs is not None else torch.zeros(0, 0)
                outputs.append(self._output(tn.DRAFT_PROBS, probs.float()[None]))
        return pb.InferenceResponse(output_tensors=outputs)

    def _features_output(self, hidden: torch.Tensor | None):
        """The FEATURES response tensor of a step's features (rows, L, H) (None: no head served, empty)."""
        features = hidden.flatten(1).float()[None] if hidden is not None else torch.zeros(1, 0, 0)
        return self._output(tn.FEATURES, features)


class DraftModel(LanguageModelAdapter):
    heads_parameter = "target_draft_heads"  # every head the target serves features for (its layer union)
    tuner: SkipTuner | None = None  # a layer-skip self-draft's search (skip_layers auto)

    def _warm_up_steps(self):
        prompt = list(range(1, 17))
        if isinstance(self.lm, HeadExecutor):  # a head drafts from features: zeros will do
            features = torch.zeros(15, self.lm.config.feature_width, device=self.lm.device)
            self.lm.propose(WARM_UP_SEQUENCE, 0, prompt, 4, SamplingParams(), features=features)
            sampled = SamplingParams(temperature=1.0, top_p=0.9)
            self.lm.propose(WARM_UP_SEQUENCE, 15, [16, 1], 4, sampled, make_generator(0, self.lm.logits_device),
                            features=features[:1])
            self.lm.release(WARM_UP_SEQUENCE)
            return
        self.lm.propose(WARM_UP_SEQUENCE, 0, prompt, 4, SamplingParams())  # greedy drafting
        sampled = SamplingParams(temperature=1.0, top_p=0.9)
        self.lm.propose(WARM_UP_SEQUENCE, 16, [1], 4, sampled, make_generator(0, self.lm.logits_device))
        self.lm.release(WARM_UP_SEQUENCE)

    def load(self, params: ModelParameters, args: dict) -> None:
        # Refuse, before the weights load, a draft that numbers tokens differently from the target.
        target_tokenizer = params.str("target_tokenizer_path", "")
        model_path = Path(params.str("model_path"))
        has_tokenizer = model_path.suffix == ".gguf" or (model_path / "tokenizer_config.json").exists()
        if target_tokenizer and has_tokenizer and not same_tokenizer_files(model_path, target_tokenizer):
            problem = vocabulary_mismatch(load_tokenizer(str(model_path)), load_tokenizer(target_tokenizer))
            if problem:
                raise ConfigError(f"{params.model_name}: the draft's tokenizer ({model_path}) differs from the "
                                  f"target's ({target_tokenizer}): {problem}; a draft must share the target's vocabulary")
        super().load(params, args)

    def _start(self, params: ModelParameters) -> None:
        super()._start(params)
        self._tuner_thread = None
        if self.tuner is not None:
            # The search measures a set between batches: a thread that takes the forward lock after one
            self.skip_metrics = SkipMetrics(self.pb, self.name, self.tuner.search.layers)
            self.skip_metrics.report(self.tuner.search.best, 0, 0.0)
            self._batch_done = threading.Event()
            self._tuner_thread = threading.Thread(target=self._tune, daemon=True, name=f"{self.name}-tuner")
            self._tuner_thread.start()

    def _run_jobs(self, jobs):
        outcomes = super()._run_jobs(jobs)
        if self.tuner is not None:
            self._batch_done.set()
        return outcomes

    def _tune(self) -> None:
        """One trial after a batch, while the search wants one (SkipTuner.due); while its warm trials run, one
        a second without a batch too: a draft the orchestrator keeps paused (no set so far pays) has few
        batches, and its search would stall on the set that does not pay."""
        threads.adopt_torch_threads()  # trials cost what executions cost: on as many threads
        while not self._stop.is_set():
            if not self._batch_done.wait(1.0) and not self.tuner.warming:
                continue
            self._batch_done.clear()
            if not self.tuner.due():
                continue
            with self._lock:
                try:
                    self.tuner.trial()
                except Exception as exc:  # noqa: BLE001 - the search pauses a trial, drafting goes on
                    self.pb.Logger.log_warn(f"{self.name}: a layer-set trial failed: {type(exc).__name__}: {exc}")
                    continue
            search = self.tuner.search
            self.skip_metrics.report(search.best, search.trials, search.best_score)

    def finalize(self):
        if getattr(self, "_tuner_thread", None) is not None:
            self._stop.set()
            self._tuner_thread.join(timeout=5)
            self.skip_metrics.close()
        super().finalize()

    def _executor(self, params: ModelParameters, device: str):
        kind = params.str("draft_kind", "model", choices=tn.DRAFT_KINDS)
        lm = super()._executor(params, device) if kind != "head" else self._head_executor(params, device)
        # The confidence stop, for every kind of model draft
        lm.stop_below = params.float("draft_stop_below", tn.DEFAULT_DRAFT_STOP_BELOW, low=0.0, high=1.0)
        self.tuner = self._tuner(params, lm) if self._searches_skip(params) else None
        return lm

    def _lora(self, params, model):
        """lora_layers: a draft made of some of the target's layers runs the target's adapters on them
        (lora_config.parse_layer_map; a layer-skip self-draft, the target itself: first); "": none."""
        layers = model.config.get_text_config().num_hidden_layers
        try:
            mapped = parse_layer_map(params.str("lora_layers", ""), layers, "parameter 'lora_layers'")
        except ValueError as exc:
            raise ConfigError(f"{self.name}: {exc}") from None
        if mapped is None:
            return {}
        if params.str("draft_kind", "model", choices=tn.DRAFT_KINDS) == "head":
            raise ConfigError(f"{self.name}: parameter 'lora_layers' is a draft model's or a layer-skip draft's "
                              "(a head drafts from the adapted target's features)")
        return {**self._adapters(params), "lora_layers": mapped}

    def _searches_skip(self, params: ModelParameters) -> bool:
        return params.str("draft_kind", "model", choices=tn.DRAFT_KINDS) == "skip" and \
            params.str("skip_layers", tn.SKIP_SEARCH) == tn.SKIP_SEARCH

    def _skip_layers(self, params: ModelParameters, model) -> tuple[int, ...] | None:
        """draft_kind skip: model_path is the target's; skip_layers a list, or auto: searched, starting from
        every other intermediate layer of the middle half."""
        if params.str("draft_kind", "model", choices=tn.DRAFT_KINDS) != "skip":
            return None
        layers = model.config.get_text_config().num_hidden_layers
        spec = params.str("skip_layers", tn.SKIP_SEARCH)
        if spec == tn.SKIP_SEARCH:
            return tuple(range(layers // 4, layers - layers // 4, 2)) if layers >= 4 else ()
        try:
            return parse_layers(spec, layers)
        except ValueError as exc:
            raise ConfigError(f"{self.name}: parameter 'skip_layers': {exc} (or {tn.SKIP_SEARCH!r})") from None

    def _tuner(self, params: ModelParameters, lm) -> SkipTuner:
        """skip_layers auto: the search over the first requests' text, then now and then (skip_layers.py)."""
        if not isinstance(lm.forward, LayerSkipForward):
            raise ConfigError(f"{self.name}: skip_layers={tn.SKIP_SEARCH} needs a forward with a set per sequence "
                              "(executor auto, static or dynamic)")
        tuner = SkipTuner(lm, lm.forward, k_max=params.int("max_num_draft_tokens", 16, low=1),
                          seed=params.int("skip_search_seed", 0, low=0),
                          interval_s=params.float("skip_search_interval_s", 10.0, low=0.0),
                          log=self.pb.Logger.log_info, scratch_sequence=WARM_UP_SEQUENCE)
        graphs = "" if lm.forward.graph_skip is None else " (its CUDA graphs follow the set chosen)"
        self.pb.Logger.log_info(f"{self.name}: layer-skip self-draft, searching the layers to skip from "
                                f"{list(lm.forward.skip)}{graphs}")
        return tuner

    def _head_executor(self, params: ModelParameters, device: str) -> HeadExecutor:
        # A trained head: the target's embedding (and EAGLE-1's lm_head) copied into this process.
        lm, self.feature_columns, self.served_layers = self._load_head(
            params, device, params.str("model_path"), params.str("target_path"),
            params.str("weights_dtype", "same", choices=tn.WEIGHTS_DTYPES))
        return lm

    def _step_options(self, inputs, wanted=frozenset()):
        message = wire.ProposeMessage.decode(inputs)  # num_draft_tokens 0: a prompt's chunk, appended only
        generator = None if message.params.greedy else make_generator(message.seed, self.lm.logits_device)
        if message.branches < 1:
            raise ValueError(f"{tn.NUM_DRAFT_BRANCHES} must be >= 1, got {message.branches}")
        options = {"k": message.k, "params": message.params, "generator": generator, "branches": message.branches}
        # A request's adapter where this draft runs the target's adapters (lora_layers) and can read it; the
        # base model drafts otherwise (it only drafts: the target's verify keeps the output the adapter's)
        adapters = getattr(self.lm, "adapters", None)
        if message.adapter and adapters is not None and adapters.problem(message.adapter) is None:
            options["adapter"] = message.adapter
        if isinstance(self.lm, HeadExecutor):
            options["features"] = self._features(inputs.get(tn.FEATURES))
        return options

    def _features(self, value) -> torch.Tensor | None:
        """The head's columns of the target's features input [1, rows, L x H] (None: absent or empty)."""
        if value is None:
            return None
        features = torch.tensor(value) if isinstance(value, np.ndarray) else value  # a device tensor as it is
        if not features.numel():
            return None
        features = features[0]
        rows, width = features.shape
        if width % self.served_layers:
            raise ValueError(f"{tn.FEATURES} has {width} columns, not a multiple of the target's "
                             f"{self.served_layers} layers")
        if self.feature_columns is None:
            return features
        columns = self.feature_columns.to(features.device)
        return features.view(rows, self.served_layers, -1).index_select(1, columns).flatten(1)

    def _run(self, steps):
        return self.lm.propose_many(steps)

    def _respond(self, request, step, result, forward):
        pb = self.pb
        tokens, probs, cached_length, parents = result
        requested = set(request.requested_output_names())
        message = wire.DraftedMessage(tokens, cached_length, parents,
                                      forward if tn.FORWARD_STATS in requested else None).encode()
        outputs = [pb.Tensor(name, value) for name, value in message.items()]
        if tn.DRAFT_PROBS in requested:
            if probs is None:
                probs = torch.zeros(0, self.lm.vocab_size)
            outputs.append(self._output(tn.DRAFT_PROBS, probs.float()[None]))
        return pb.InferenceResponse(output_tensors=outputs)
