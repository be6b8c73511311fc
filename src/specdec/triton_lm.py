"""Triton Python-backend adapters for draft_model and target_model over `CausalLM`.

Both models are sequence-batched: a request's correlation ID names the sequence whose KV cache it
extends. Inputs: input_ids (tokens to append), cache_length (cached tokens to keep: rollback), and
`release` with the sequence END flag to free the cache. target_model returns the greedy tokens and,
on request, the logits of the last num_logits positions; draft_model proposes num_draft_tokens tokens
(and their distributions when sampling).
"""

from __future__ import annotations


import time

import numpy as np
import torch

from specdec import onednn_linear
from specdec import tensor_names as tn
from specdec.causal_lm import CacheError, CausalLM, Step, load_causal_lm
from specdec.config import ModelParameters
from specdec.sampling import SamplingParams, make_generator


def _scalar(pb_utils, request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    return tensor.as_numpy().reshape(-1)[0].item()


class LanguageModelAdapter:
    """Shared initialize / execute plumbing; subclasses implement `_step`."""

    def initialize(self, args):
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        params = ModelParameters(args["model_config"])
        self.name = params.model_name
        device = params.str("device", "cpu")
        # "cuda" (or "cpu" under a GPU instance group) means the GPU Triton gave this instance.
        if args.get("model_instance_kind") == "GPU" and device in ("cpu", "cuda"):
            device = f"cuda:{args.get('model_instance_device_id', '0')}"
        model = load_causal_lm(
            params.str("model_path"),
            device=device,
            dtype=params.str("dtype", "float32", choices=("float32", "float16", "bfloat16", "float64")),
            device_map=params.str("device_map", ""),
            linear_kernels=params.str("linear_kernels", "auto", choices=onednn_linear.KINDS),
        )
        prepacked = any(isinstance(m, onednn_linear.PrepackedLinear) for m in model.modules())
        torch.set_num_threads(params.int("torch_threads", torch.get_num_threads(), low=1))
        # false: one forward per sequence (the unbatched baseline of the batching benchmark).
        self.batched = params.bool("batched_forward", True)
        self.lm = CausalLM(
            model,
            max_sequences=params.int("max_sequences", 256, low=1),
            idle_timeout_s=params.float("sequence_idle_timeout_s", 600.0, low=1.0),
            # 4 on CPU with torch's linear kernels: its 2-3 row GEMMs are slower than 4 (measured; see
            # CausalLM). oneDNN's reordered weights have no such cliff; 1 = no padding.
            min_forward_rows=params.int("min_forward_rows", 4 if model.device.type == "cpu" and not prepacked else 1,
                                        low=1),
        )
        # The families must outlive their metrics: keep references to both.
        self.metric_families = [
            pb_utils.MetricFamily(
                name="specdec_model_tokens_processed_total",
                description="Tokens run through the model's forward pass (prompt, catch-up, draft and verify tokens)",
                kind=pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily(
                name="specdec_model_live_sequences",
                description="Sequences whose KV cache the model currently holds",
                kind=pb_utils.MetricFamily.GAUGE),
            pb_utils.MetricFamily(
                name="specdec_model_kv_cache_bytes",
                description="Bytes allocated for the model's KV caches (per-sequence buffers, grown by doubling)",
                kind=pb_utils.MetricFamily.GAUGE),
        ]
        self.tokens_metric, self.live_metric, self.kv_metric = (
            f.Metric(labels={"model": self.name}) for f in self.metric_families)
        self._reported = {"tokens": 0, "live": None, "kv": None, "at": 0.0}

    def execute(self, requests):
        """All pending steps (of different sequences: the sequence batcher sends one step per sequence
        at a time) run as one batched forward; each request gets its own response or error."""
        pb = self.pb
        self.lm.evict_idle()
        released = False
        responses: list = [None] * len(requests)
        steps, owners = [], []
        for i, request in enumerate(requests):
            try:
                seq_id = request.correlation_id()
                if _scalar(pb, request, tn.RELEASE, False):
                    self.lm.release(seq_id)
                    released = True
                    responses[i] = pb.InferenceResponse(output_tensors=[])
                    continue
                steps.append(self._parse_step(request, seq_id))
                owners.append(i)
            except (CacheError, ValueError) as exc:
                responses[i] = self._error(exc)
        if steps:
            groups = [steps] if self.batched else [[step] for step in steps]
            results, forwards = [], []
            for group in groups:
                started = time.perf_counter()
                try:
                    results += self._run(group)
                except Exception as exc:  # noqa: BLE001 - the batch fails, the server keeps serving
                    results += [RuntimeError(f"{type(exc).__name__}: {exc}")] * len(group)
                # What this forward cost, for the orchestrator's cost model: rows, sequences, seconds.
                forward = (sum(len(step.new_ids) for step in group), len(group), time.perf_counter() - started)
                forwards += [forward] * len(group)
            for i, step, result, forward in zip(owners, steps, results, forwards):
                responses[i] = self._error(result) if isinstance(result, Exception) else \
                    self._respond(requests[i], step, result, forward)
        self._report_metrics(flush=released)
        return responses

    def _report_metrics(self, flush: bool) -> None:
        """Update the metrics only when they changed, and the token counter at most twice a second or
        when a sequence ends: each update is an IPC round trip to the server, paid per execute."""
        reported, now = self._reported, time.monotonic()
        pending = self.lm.tokens_processed - reported["tokens"]
        if pending and (flush or now - reported["at"] >= 0.5):
            self.tokens_metric.increment(pending)
            reported["tokens"], reported["at"] = self.lm.tokens_processed, now
        for key, metric, value in (("live", self.live_metric, len(self.lm.sequences)),
                                   ("kv", self.kv_metric, self.lm.kv_bytes_allocated)):
            if value != reported[key]:
                metric.set(value)
                reported[key] = value

    def _error(self, exc: Exception):
        return self.pb.InferenceResponse(error=self.pb.TritonError(f"{self.name}: {exc}"))

    def _parse_step(self, request, seq_id: int) -> Step:
        pb = self.pb
        return Step(seq_id, int(_scalar(pb, request, tn.CACHE_LENGTH, 0)),
                    pb.get_input_tensor_by_name(request, tn.INPUT_IDS).as_numpy().reshape(-1).tolist(),
                    **self._step_options(request))

    def _step_options(self, request) -> dict:
        """The model-specific fields of a Step (num_logits, or k and sampling)."""
        raise NotImplementedError

    def _run(self, steps: list[Step]) -> list:
        raise NotImplementedError

    def _respond(self, request, step: Step, result, forward: tuple[int, int, float]):
        raise NotImplementedError

    def finalize(self):
        self.lm.sequences.clear()


class TargetModel(LanguageModelAdapter):
    def _step_options(self, request):
        return {"num_logits": int(_scalar(self.pb, request, tn.NUM_LOGITS, 1))}

    def _run(self, steps):
        return self.lm.extend_many(steps)

    def _respond(self, request, step, logits, forward):
        pb = self.pb
        outputs = [pb.Tensor(tn.GREEDY_TOKENS, logits.argmax(-1).to(torch.int32).cpu().numpy()[None])]
        requested = set(request.requested_output_names())
        if tn.LOGITS in requested:
            outputs.append(pb.Tensor(tn.LOGITS, logits.float().cpu().numpy()[None]))
        if tn.FORWARD_STATS in requested:
            outputs.append(pb.Tensor(tn.FORWARD_STATS, np.asarray([forward], dtype=np.float32)))
        return pb.InferenceResponse(output_tensors=outputs)


class DraftModel(LanguageModelAdapter):
    def _step_options(self, request):
        pb = self.pb
        params = SamplingParams(
            temperature=float(_scalar(pb, request, tn.TEMPERATURE, 0.0)),
            top_k=int(_scalar(pb, request, tn.TOP_K, 0)),
            top_p=float(_scalar(pb, request, tn.TOP_P, 1.0)),
        )
        seed = _scalar(pb, request, tn.SEED, None)
        return {"k": int(_scalar(pb, request, tn.NUM_DRAFT_TOKENS, 1)), "params": params,
                "generator": None if params.greedy else make_generator(seed)}

    def _run(self, steps):
        return self.lm.propose_many(steps)

    def _respond(self, request, step, result, forward):
        pb = self.pb
        tokens, probs = result
        outputs = [pb.Tensor(tn.DRAFT_TOKENS, np.asarray([tokens], dtype=np.int32))]
        if tn.DRAFT_PROBS in set(request.requested_output_names()):
            if probs is None:
                probs = torch.zeros(0, self.lm.vocab_size)
            outputs.append(pb.Tensor(tn.DRAFT_PROBS, probs.float().numpy()[None]))
        return pb.InferenceResponse(output_tensors=outputs)
