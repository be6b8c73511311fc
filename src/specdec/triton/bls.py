"""The orchestrator's Proposer and Scorer over Triton BLS calls to draft_model and target_model.

Both callees use Triton's sequence batcher: every call of one generation carries the same
correlation ID, so Triton routes it to the model instance holding that sequence's KV cache, the first
call carries the START flag and the release call the END flag. Imported only inside the server
(`triton_python_backend_utils` exists only in a Python-backend stub).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.utils.dlpack

from specdec import tensor_names as tn
from specdec.decoding.interfaces import ForwardStats, NoCapacity, Proposal, Scores
from specdec.decoding.sampling import SamplingParams


class BlsError(RuntimeError):
    pass


def _torch(tensor) -> torch.Tensor:
    """A BLS output as a torch tensor where it lives: a device tensor (a model's `device_outputs`) stays
    on the device (DLPack, copied out of the response's buffer), a host one becomes a CPU tensor."""
    if tensor.is_cpu():
        return torch.from_numpy(tensor.as_numpy().copy())
    return torch.utils.dlpack.from_dlpack(tensor.to_dlpack()).clone()


def _i32(value) -> np.ndarray:
    return np.asarray(value, dtype=np.int32).reshape(1, -1)


class _SequenceModel:
    """Shared plumbing: one BLS call into a sequence-batched model.

    `prefill_chunk` (tokens; 0: off): a call appending more tokens than that beyond the positions it
    needs (a long prompt) goes first as calls of that many tokens that ask for nothing back (chunked
    prefill): each is one execute of the model, so the other requests' rounds run between them instead
    of waiting for the whole prompt's forward. Chunks the model's prefix cache holds are not run again."""

    def __init__(self, pb_utils, model_name: str, timeout_us: int = 0, prefill_chunk: int = 0):
        self.pb = pb_utils
        self.model_name = model_name
        self.timeout_us = timeout_us
        self.prefill_chunk = prefill_chunk
        self._started: set[int] = set()

    async def _prefill(self, seq_id: int, keep: int, new_ids: list[int], needed: int, reserve: int,
                       chunk_inputs: dict[str, np.ndarray], output: str) -> tuple[int, list[int], int]:
        """Send new_ids in chunks while more than `needed` tokens would be left after one; returns the
        (keep, new_ids, reserve) of the call that remains."""
        chunk = self.prefill_chunk
        while chunk and len(new_ids) - needed > chunk:
            inputs = {tn.INPUT_IDS: _i32(new_ids[:chunk]), tn.CACHE_LENGTH: _i32([keep]), **chunk_inputs}
            if reserve:  # the first call takes the generation's room
                inputs[tn.RESERVE_TOKENS] = _i32([reserve])
            await self._call(seq_id, inputs, [output])
            keep, new_ids, reserve = keep + chunk, new_ids[chunk:], 0
        return keep, new_ids, reserve

    async def _call(self, seq_id: int, inputs: dict[str, np.ndarray], outputs: list[str], end: bool = False):
        pb = self.pb
        flags = 0
        if seq_id not in self._started:
            flags |= pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
            self._started.add(seq_id)
        if end:
            flags |= pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
            self._started.discard(seq_id)
        request = pb.InferenceRequest(
            model_name=self.model_name,
            inputs=[pb.Tensor(name, value) for name, value in inputs.items()],
            requested_output_names=outputs,
            correlation_id=seq_id,
            flags=flags,
            timeout=self.timeout_us,
        )
        response = await request.async_exec()
        if response.has_error():
            # The model has no room for a new sequence now (its KV budget or sequence limit): it answers
            # UNAVAILABLE, but a BLS response carries only the message (the code reads INTERNAL).
            message = response.error().message()
            if not message.startswith(f"{self.model_name}: "):  # our adapters name themselves; Triton may not
                message = f"{self.model_name}: {message}"
            raise (NoCapacity if message.endswith(tn.RETRY_LATER) else BlsError)(message)
        return {name: pb.get_output_tensor_by_name(response, name) for name in outputs}

    async def release(self, seq_id: int) -> None:
        if seq_id not in self._started:
            return
        await self._call(seq_id, {tn.INPUT_IDS: _i32([]), tn.CACHE_LENGTH: _i32([0]),
                                  tn.RELEASE: np.array([[True]])}, [], end=True)


class BlsProposer(_SequenceModel):
    async def propose(self, seq_id: int, keep: int, new_ids: list[int], k: int,
                      params: SamplingParams, round_seed: int, reserve: int = 0) -> Proposal:
        keep, new_ids, reserve = await self._prefill(seq_id, keep, new_ids, 1, reserve,
                                                     {tn.NUM_DRAFT_TOKENS: _i32([0])}, tn.DRAFT_TOKENS)
        inputs = {tn.INPUT_IDS: _i32(new_ids), tn.CACHE_LENGTH: _i32([keep]), tn.NUM_DRAFT_TOKENS: _i32([k])}
        if reserve:
            inputs[tn.RESERVE_TOKENS] = _i32([reserve])
        # Greedy drafting is what draft_model does without sampling inputs: every tensor left out is one
        # less to build, pass through tritonserver and parse, on every round.
        if not params.greedy:
            inputs.update({
                tn.TEMPERATURE: np.array([[params.temperature]], dtype=np.float32),
                tn.TOP_K: _i32([params.top_k]),
                tn.TOP_P: np.array([[params.top_p]], dtype=np.float32),
                tn.SEED: np.array([[round_seed]], dtype=np.uint64),
            })
            if params.min_p:
                inputs[tn.MIN_P] = np.array([[params.min_p]], dtype=np.float32)
        outputs = [tn.DRAFT_TOKENS] + ([] if params.greedy else [tn.DRAFT_PROBS])
        result = await self._call(seq_id, inputs, outputs)
        probs = None if params.greedy else _torch(result[tn.DRAFT_PROBS])[0]
        # The draft model runs every proposed token but the last through its cache.
        return Proposal(result[tn.DRAFT_TOKENS].as_numpy()[0].tolist(), probs,
                        cached_length=keep + len(new_ids) + k - 1)


class BlsScorer(_SequenceModel):
    async def score(self, seq_id: int, keep: int, new_ids: list[int], num_positions: int,
                    want_logits: bool, reserve: int = 0, want_log_probs: bool = False,
                    allowed: torch.Tensor | None = None) -> Scores:
        keep, new_ids, reserve = await self._prefill(seq_id, keep, new_ids, num_positions, reserve,
                                                     {tn.NUM_LOGITS: _i32([0])}, tn.GREEDY_TOKENS)
        inputs = {tn.INPUT_IDS: _i32(new_ids), tn.CACHE_LENGTH: _i32([keep])}
        if reserve:
            inputs[tn.RESERVE_TOKENS] = _i32([reserve])
        if num_positions != 1:  # target_model's default: a target-only round's one position
            inputs[tn.NUM_LOGITS] = _i32([num_positions])
        if allowed is not None:  # (K+1) x V/32 words instead of (K+1) x V logits back
            inputs[tn.ALLOWED_TOKENS] = allowed.numpy()[None]
        outputs = [tn.GREEDY_TOKENS, tn.FORWARD_STATS] + ([tn.LOGITS] if want_logits else []) + (
            [tn.GREEDY_LOG_PROBS] if want_log_probs else [])
        result = await self._call(seq_id, inputs, outputs)
        logits = _torch(result[tn.LOGITS])[0] if want_logits else None
        rows, sequences, seconds = result[tn.FORWARD_STATS].as_numpy()[0].tolist()
        log_probs = torch.from_numpy(result[tn.GREEDY_LOG_PROBS].as_numpy()[0].copy()) if want_log_probs else None
        return Scores(torch.from_numpy(result[tn.GREEDY_TOKENS].as_numpy()[0].astype(np.int64)), logits,
                      forward=ForwardStats(int(rows), int(sequences), float(seconds)), log_probs=log_probs)
