"""The orchestrator's Proposer and Scorer over Triton BLS calls to draft_model and target_model.

Both callees use Triton's sequence batcher: every call of one generation carries the same
correlation ID, so Triton routes it to the model instance holding that sequence's KV cache, the first
call carries the START flag and the release call the END flag. Imported only inside the server
(`triton_python_backend_utils` exists only in a Python-backend stub).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import numpy as np
import torch
import torch.utils.dlpack

from specdec import tensor_names as tn
from specdec.decoding.interfaces import NoCapacity, Proposal, ScoredRows, Scores, VerifyCall
from specdec.decoding.sampling import SamplingParams
from specdec.triton import wire


class BlsError(RuntimeError):
    pass


class ModelUnavailable(BlsError):
    """The called model is down (its stub died) or reloading: the request may be retried once it is back."""


# How Triton words a call to a model whose stub died, that is unloaded, or that is reloading; and a
# sequence's next step after its model was loaded again (the new instance never saw the sequence start).
_DOWN = ("is not healthy", "is not ready", "unknown model", "no available versions",
         "must specify the START flag on the first request")


NO_FEATURES = np.zeros((1, 0, 0), dtype=np.float32)  # a head's call without features (the input is always there)


def _torch(tensor) -> torch.Tensor:
    """A BLS output as a torch tensor where it lives: a device tensor (a model's `device_outputs`) stays
    on the device (DLPack, copied out of the response's buffer), a host one becomes a CPU tensor."""
    if tensor.is_cpu():
        return torch.from_numpy(tensor.as_numpy().copy())
    return torch.utils.dlpack.from_dlpack(tensor.to_dlpack()).clone()


def _tensor(pb, name: str, value):
    """An input tensor: numpy as it is; a torch tensor from the host, or handed over on its device (DLPack)."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            return pb.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(value.contiguous()))
        value = value.cpu().numpy()
    return pb.Tensor(name, value)


class _SequenceModel:
    """Shared plumbing: one BLS call into a sequence-batched model.

    Every call of a model carries the same set of inputs, defaults included (a reservation of 0, release
    false, greedy sampling settings, an empty bitmask): Triton's sequence batcher puts requests into one
    execution only when they carry the same inputs, so a call that left one out ran in an execution of its
    own (wire.py encodes them). `QUIET` holds the model's own inputs as a call that asks for nothing back
    sends them (a prompt's chunk, the release).

    `prefill_chunk` (tokens; 0: off): a call appending more tokens than that beyond the positions it
    needs (a long prompt) goes first as calls of that many tokens that ask for nothing back (chunked
    prefill): each is one execute of the model, so the other requests' rounds run between them instead
    of waiting for the whole prompt's forward. Chunks the model's prefix cache holds are not run again.

    `call_timeout_s` (0: none): a call the model has not answered in that long fails (ModelUnavailable)
    instead of waiting for ever on a model whose stub hangs while its process runs (a deadlock, a stuck
    device), which the watchdog cannot see from /proc; `on_timeout(model_name)` reports it (a metric the
    launcher's watchdog reads, then kills the model's stubs so that it is reloaded). The call itself cannot
    be withdrawn: until it is answered the model counts as stalled and every other call to it fails at once."""

    QUIET: wire.Arrays = {}

    def __init__(self, pb_utils, model_name: str, timeout_us: int = 0, prefill_chunk: int = 0,
                 call_timeout_s: float = 0.0, on_timeout: Callable[[str], None] = lambda _name: None):
        self.pb = pb_utils
        self.model_name = model_name
        self.timeout_us = timeout_us
        self.prefill_chunk = prefill_chunk
        self.call_timeout_s, self.on_timeout = call_timeout_s, on_timeout
        self.overdue = 0  # calls past call_timeout_s not answered yet: while any, the model counts as stalled
        self._started: set[int] = set()

    async def _exec(self, request):
        """The request's response, within call_timeout_s (see the class)."""
        if self.call_timeout_s <= 0:
            return await request.async_exec()
        if self.overdue:
            raise ModelUnavailable(f"{self.model_name}: not answering (a call has waited more than "
                                   f"{self.call_timeout_s:g} s)")
        call = asyncio.ensure_future(request.async_exec())
        done, _ = await asyncio.wait({call}, timeout=self.call_timeout_s)
        if call in done:
            return call.result()
        self.overdue += 1
        call.add_done_callback(self._answered)
        self.on_timeout(self.model_name)
        raise ModelUnavailable(f"{self.model_name}: no answer in {self.call_timeout_s:g} s")

    def _answered(self, call: asyncio.Future) -> None:
        self.overdue -= 1
        if not call.cancelled():
            call.exception()  # retrieved: an overdue call's failure (its stub killed) is expected

    async def _prefill(self, seq_id: int, keep: int, new_ids: list[int], needed: int, reserve: int,
                       outputs: list[str], answers: list | None = None,
                       own: wire.Arrays | None = None, salt: str = "") -> tuple[int, list[int], int]:
        """Send new_ids in chunks while more than `needed` tokens would be left after one; returns the
        (keep, new_ids, reserve) of the call that remains. `answers` collects the chunks' outputs; `own`: the
        chunks' own inputs (QUIET's otherwise); `salt`: the sequence's prefix-cache salt."""
        chunk = self.prefill_chunk
        while chunk and len(new_ids) - needed > chunk:
            answer = await self._call(seq_id, new_ids[:chunk], keep, outputs, reserve=reserve,
                                      own=own, salt=salt)  # the first takes the room
            if answers is not None:
                answers.append(answer)
            keep, new_ids, reserve = keep + chunk, new_ids[chunk:], 0
        return keep, new_ids, reserve

    async def _call(self, seq_id: int, new_ids: list[int], keep: int, outputs: list[str], reserve: int = 0,
                    end: bool = False, own: wire.Arrays | None = None, salt: str = "") -> dict:
        """Keep `keep` cached tokens and append new_ids, the model's own inputs `own` (QUIET's otherwise);
        `end`: release the sequence; `salt`: its prefix-cache salt (every call carries it: the first, which
        the model reads it from, may be a chunk's)."""
        pb = self.pb
        flags = 0
        if seq_id not in self._started:
            flags |= pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
            self._started.add(seq_id)
        if end:
            flags |= pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
            self._started.discard(seq_id)
        inputs = {**wire.StepMessage(keep, new_ids, reserve, end, salt).encode(), **self.QUIET, **(own or {})}
        request = pb.InferenceRequest(
            model_name=self.model_name,
            inputs=[_tensor(pb, name, value) for name, value in inputs.items()],
            requested_output_names=outputs,
            correlation_id=seq_id,
            flags=flags,
            timeout=self.timeout_us,
        )
        response = await self._exec(request)
        if response.has_error():
            # The model has no room for a new sequence now (its KV budget or sequence limit): it answers
            # UNAVAILABLE, but a BLS response carries only the message (the code reads INTERNAL).
            message = response.error().message()
            if not message.startswith(f"{self.model_name}: "):  # our adapters name themselves; Triton may not
                message = f"{self.model_name}: {message}"
            if message.endswith(tn.RETRY_LATER):
                raise NoCapacity(message)
            raise (ModelUnavailable if any(text in message for text in _DOWN) else BlsError)(message)
        return {name: pb.get_output_tensor_by_name(response, name) for name in outputs}

    async def release(self, seq_id: int) -> None:
        if seq_id not in self._started:
            return
        await self._call(seq_id, [], 0, [], end=True)


class BlsProposer(_SequenceModel):
    """A draft model; with wants_features, a trained head: each call carries the target's features
    (`features`, an empty tensor when there are none), and a prompt is never chunked (its features
    come whole, and a head's pass over a prompt is cheap)."""

    QUIET = wire.QUIET_PROPOSE.encode()  # appends only

    def __init__(self, pb_utils, model_name: str, timeout_us: int = 0, prefill_chunk: int = 0,
                 wants_features: bool = False, branches: int = 1, call_timeout_s: float = 0.0,
                 on_timeout: Callable[[str], None] = lambda _name: None):
        super().__init__(pb_utils, model_name, timeout_us, 0 if wants_features else prefill_chunk,
                         call_timeout_s, on_timeout)
        self.wants_features = wants_features
        self.branches = branches  # candidates per drafted position (draft_tree.py): above 1, trees
        # a request's LoRA adapter goes with its calls (adapter=): a draft made of the target's layers runs it
        # (draft_model's lora_layers), any other leaves it
        self.adapts = not wants_features
        self.salted = True  # a request's prefix-cache salt goes with its calls (salt=): the draft's cache is salted
        if wants_features:  # every call carries the same input set (wire.py)
            self.QUIET = {**self.QUIET, tn.FEATURES: NO_FEATURES}

    async def propose(self, seq_id: int, keep: int, new_ids: list[int], k: int,
                      params: SamplingParams, round_seed: int, reserve: int = 0,
                      features: torch.Tensor | None = None, branches: int | None = None,
                      adapter: str = "", salt: str = "") -> Proposal:
        # a prompt's chunks carry the adapter too: the sequence's first call names it (the draft takes it then)
        chunk = {**self.QUIET, tn.LORA_NAME: wire.adapter_name(adapter)} if adapter else None
        keep, new_ids, reserve = await self._prefill(seq_id, keep, new_ids, 1, reserve, [tn.DRAFT_TOKENS], own=chunk,
                                                     salt=salt)
        outputs = [tn.DRAFT_TOKENS, tn.CACHED_LENGTH, tn.DRAFT_PARENTS, tn.FORWARD_STATS] + \
            ([] if params.greedy else [tn.DRAFT_PROBS])
        width = self.branches if branches is None else max(1, min(branches, self.branches))
        own = wire.ProposeMessage(k, params, round_seed, width, adapter).encode()
        if self.wants_features:
            own[tn.FEATURES] = NO_FEATURES if features is None else features.float()[None]
        result = await self._call(seq_id, new_ids, keep, outputs, reserve, own=own, salt=salt)
        drafted = wire.DraftedMessage.decode({name: result[name].as_numpy() for name in outputs[:4]})
        probs = None if params.greedy else _torch(result[tn.DRAFT_PROBS])[0]
        if probs is not None and not len(probs):  # a deterministic proposal (a head's tree): point masses
            probs = None
        return Proposal(drafted.tokens, probs, drafted.cached_length, drafted.parents, drafted.forward)


def _scored(parts: list[wire.VerifiedMessage], logits: list[torch.Tensor] | None = None) -> ScoredRows:
    """A prompt's scores over its chunks' answers and the last call's, in order (logits: their rows' logits,
    with VerifyCall.score_logits)."""
    def joined(name: str, dtype=None) -> torch.Tensor | None:
        values = [getattr(part, name) for part in parts]
        if any(value is None for value in values):
            return None
        value = np.concatenate(values)
        return torch.from_numpy(value.astype(dtype) if dtype else value)
    return ScoredRows(joined("scored_log_probs"), joined("scored_ranks", np.int64), joined("scored_top_ids", np.int64),
                      joined("scored_top_log_probs"), None if logits is None else torch.cat(logits))


class BlsScorer(_SequenceModel):
    QUIET = wire.QUIET_VERIFY.encode()

    async def _score_chunks(self, call: VerifyCall, chunks: list[dict]) -> tuple[int, list[int], int, int]:
        """A prompt to score (score_rows) longer than a chunk beyond the verified positions: first as calls of
        `prefill_chunk` tokens that score every row, the last against the next chunk's first token (score_next).
        Returns the last call's keep, new_ids, reserve and score rows; `chunks` collects the calls' answers."""
        keep, new_ids, reserve, rows = call.keep, call.new_ids, call.reserve, call.score_rows
        chunk = self.prefill_chunk
        outputs = [tn.GREEDY_TOKENS, tn.SCORED_LOG_PROBS, tn.SCORED_RANKS] + (
            [tn.SCORED_TOP_IDS, tn.SCORED_TOP_LOG_PROBS] if call.score_top else []) + (
            [tn.SCORED_LOGITS] if call.score_logits else []) + ([tn.FEATURES] if call.want_features else [])
        quiet = dataclasses.replace(call.draft, k=0) if call.draft is not None else None  # a hosted head's features
        while chunk and rows > chunk and len(new_ids) - call.num_positions > chunk:
            own = wire.VerifyMessage(0, score_rows=chunk, score_next=new_ids[chunk], adapter=call.adapter,
                                     draft=quiet).encode()
            chunks.append(await self._call(call.seq_id, new_ids[:chunk], keep, outputs, reserve, own=own,
                                           salt=call.salt))
            keep, new_ids, reserve, rows = keep + chunk, new_ids[chunk:], 0, rows - chunk
        return keep, new_ids, reserve, rows

    async def score(self, call: VerifyCall) -> Scores:
        chunks: list[dict] = []  # a chunked prompt's answers: their features, with want_features
        rows = call.score_rows
        # A tree goes whole (its parents and the next call's path count its tokens from the first): target_model
        # runs its leading chain, a prompt's tokens, ahead of it (engine/executor.leading_chain)
        if call.tree is not None:
            keep, new_ids, reserve = call.keep, call.new_ids, call.reserve
        elif rows:  # a prompt to score: in chunks that score their rows
            keep, new_ids, reserve, rows = await self._score_chunks(call, chunks)
        else:  # a hosted head's chunks carry its name: the target keeps their features for it
            quiet = dataclasses.replace(call.draft, k=0) if call.draft is not None else None
            keep, new_ids, reserve = await self._prefill(
                call.seq_id, call.keep, call.new_ids, call.num_positions, call.reserve,
                [tn.GREEDY_TOKENS] + ([tn.FEATURES] if call.want_features else []), chunks,
                wire.VerifyMessage(0, adapter=call.adapter, draft=quiet).encode() if call.adapter or quiet else None,
                call.salt)
        answer = [tn.GREEDY_TOKENS, tn.FORWARD_STATS] + ([tn.GREEDY_LOG_PROBS] if call.want_log_probs else []) + (
            [tn.GREEDY_TOP_IDS, tn.GREEDY_TOP_LOG_PROBS] if call.want_top_log_probs else []) + (
            [tn.SCORED_LOG_PROBS, tn.SCORED_RANKS] if call.score_rows else []) + (
            [tn.SCORED_TOP_IDS, tn.SCORED_TOP_LOG_PROBS] if call.score_top else []) + (
            [tn.CACHED_TOKENS] if call.keep == 0 else [])  # a sequence's first call: its prompt's cache hits
        drafts = call.draft is not None and call.draft.k > 0  # a hosted head drafts in this call
        hosted = [tn.DRAFT_TOKENS, tn.DRAFT_PARENTS, tn.DRAFT_STATS] if drafts else []
        outputs = answer + ([tn.LOGITS] if call.want_logits else []) + ([tn.FEATURES] if call.want_features else []) \
            + hosted + ([tn.DRAFT_PROBS] if drafts and not call.draft.params.greedy else []) + (
                [tn.SCORED_LOGITS] if call.score_logits else [])  # (apart from `answer`: a tensor as LOGITS are)
        # The grammar's (K+1) x V/32 words instead of (K+1) x V logits back.
        result = await self._call(call.seq_id, new_ids, keep, outputs, reserve,
                                  own=wire.VerifyMessage(call.num_positions, call.allowed, call.tree, call.path,
                                                         rows, adapter=call.adapter, draft=call.draft).encode(),
                                  salt=call.salt)
        verified = wire.VerifiedMessage.decode({name: result[name].as_numpy() for name in answer})
        logits = _torch(result[tn.LOGITS])[0] if call.want_logits else None
        log_probs = None if verified.log_probs is None else torch.from_numpy(verified.log_probs)
        features = None
        if call.want_features:  # (rows, F) over every chunk and the last call, where they live
            parts = [_torch(part[tn.FEATURES])[0] for part in chunks + [result]]
            features = parts[0] if len(parts) == 1 else torch.cat(parts)
        top_ids, top_values = ((None, None) if verified.top_ids is None else
                               (torch.from_numpy(verified.top_ids.astype(np.int64)), torch.from_numpy(verified.top_log_probs)))
        scored = None
        if call.score_rows:
            scored = _scored([wire.VerifiedMessage.decode({name: part[name].as_numpy() for name in part
                                                          if name not in (tn.FEATURES, tn.SCORED_LOGITS)})
                              for part in chunks] + [verified],
                             [_torch(part[tn.SCORED_LOGITS])[0] for part in chunks + [result]] if call.score_logits
                             else None)
        proposal = None
        if drafts:
            drafted = wire.HostedDraftMessage.decode({name: result[name].as_numpy() for name in hosted})
            probs = _torch(result[tn.DRAFT_PROBS])[0] if tn.DRAFT_PROBS in outputs else None
            proposal = Proposal(drafted.tokens, probs if probs is not None and len(probs) else None, 0, drafted.parents,
                                drafted.forward)
        return Scores(torch.from_numpy(verified.greedy_tokens.astype(np.int64)), logits, verified.forward, log_probs,
                      features, top_ids, top_values, scored, verified.cached_tokens, verified.block_size, proposal)
