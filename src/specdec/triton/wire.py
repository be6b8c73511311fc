"""The BLS messages between the orchestrator and draft_model / target_model, encoded and decoded in one
place: each message kind's tensors by name, as numpy arrays, both ways.

  step       what both models take: the sequence's cached tokens to keep, the tokens to append, a new
             sequence's room (reserve), release
  propose    draft_model's own inputs: K and the sampling settings (with the round's seed)
  drafted    draft_model's answer: the drafted tokens and the cache's length after them
  verify     target_model's own inputs: how many positions to score, the grammar's bitmask
  verified   target_model's answer: greedy tokens and the forward's statistics (logits, log-probabilities
             and draft distributions travel as tensors of their own, on the device where they can)
  hosted     a head hosted in target_model: what a verify call asks it to draft first, and what it drafted

Every call of a model carries the same input set, defaults included: Triton's sequence batcher runs
requests in one execution only when they carry the same inputs. No pb_utils here: the adapters wrap these
arrays into Triton tensors, so every encoding round-trips in a unit test.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec import tensor_names as tn
from specdec.decoding.interfaces import DraftAsk, ForwardStats
from specdec.decoding.sampling import SamplingParams

Arrays = dict[str, np.ndarray]


def _i32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32).reshape(1, -1)


def _f32(value: float) -> np.ndarray:
    return np.array([[value]], dtype=np.float32)


def _scalar(inputs: Arrays, name: str, default):
    value = inputs.get(name)
    return default if value is None else value.reshape(-1)[0].item()


@dataclass(frozen=True)
class StepMessage:
    """What every call to either model says about its sequence."""

    keep: int  # cached tokens to keep (rollback is a smaller keep)
    new_ids: list[int]  # tokens to append
    reserve: int = 0  # a new sequence's room for its whole generation (positions)
    release: bool = False  # free the sequence's cache (sent with the sequence END flag)
    salt: str = ""  # a new sequence's prefix-cache salt (tn.CACHE_SALT; read at its first step)

    def encode(self) -> Arrays:
        return {tn.INPUT_IDS: _i32(self.new_ids), tn.CACHE_LENGTH: _i32([self.keep]),
                tn.RESERVE_TOKENS: _i32([self.reserve]), tn.RELEASE: np.array([[self.release]]),
                tn.CACHE_SALT: np.array([[self.salt.encode()]], dtype=np.object_)}

    @classmethod
    def decode(cls, inputs: Arrays) -> StepMessage:
        ids = inputs.get(tn.INPUT_IDS)
        if ids is None:
            raise ValueError(f"missing input {tn.INPUT_IDS}")
        salt = inputs.get(tn.CACHE_SALT)
        return cls(int(_scalar(inputs, tn.CACHE_LENGTH, 0)), ids.reshape(-1).tolist(),
                   int(_scalar(inputs, tn.RESERVE_TOKENS, 0)), bool(_scalar(inputs, tn.RELEASE, False)),
                   "" if salt is None or not salt.size else _text(salt.reshape(-1)[0]))


@dataclass(frozen=True)
class ProposeMessage:
    """draft_model's own inputs. k = 0 appends only (a prompt's chunk)."""

    k: int
    params: SamplingParams = SamplingParams()
    seed: int | None = None  # the round's seed for the draft's generator (None: unseeded; sent as 0)
    branches: int = 1  # candidates per drafted position: above 1 a tree of at most k nodes
    # the sequence's LoRA adapter (read at its first step), which a draft made of the target's layers runs
    # too (its lora_layers); "": the base model. Others leave it.
    adapter: str = ""

    def encode(self) -> Arrays:
        params = self.params
        return {tn.NUM_DRAFT_TOKENS: _i32([self.k]), tn.NUM_DRAFT_BRANCHES: _i32([self.branches]),
                tn.TEMPERATURE: _f32(params.temperature),
                tn.TOP_K: _i32([params.top_k]), tn.TOP_P: _f32(params.top_p), tn.MIN_P: _f32(params.min_p),
                tn.SEED: np.array([[self.seed or 0]], dtype=np.uint64), tn.LORA_NAME: adapter_name(self.adapter)}

    @classmethod
    def decode(cls, inputs: Arrays) -> ProposeMessage:
        params = SamplingParams(
            temperature=float(_scalar(inputs, tn.TEMPERATURE, tn.DEFAULT_TEMPERATURE)),
            top_k=int(_scalar(inputs, tn.TOP_K, tn.DEFAULT_TOP_K)),
            top_p=float(_scalar(inputs, tn.TOP_P, tn.DEFAULT_TOP_P)),
            min_p=float(_scalar(inputs, tn.MIN_P, tn.DEFAULT_MIN_P)),
        )
        name = inputs.get(tn.LORA_NAME)
        return cls(int(_scalar(inputs, tn.NUM_DRAFT_TOKENS, 1)), params, _scalar(inputs, tn.SEED, None),
                   int(_scalar(inputs, tn.NUM_DRAFT_BRANCHES, 1)),
                   "" if name is None or not name.size else _text(name.reshape(-1)[0]))


def _forward_stats(forward: ForwardStats) -> np.ndarray:
    return np.asarray([forward], dtype=np.float32)


def _decode_forward_stats(outputs: Arrays) -> ForwardStats | None:
    forward = outputs.get(tn.FORWARD_STATS)
    if forward is None or not forward.size:
        return None
    rows, sequences, seconds = forward.reshape(-1).tolist()
    return ForwardStats(int(rows), int(sequences), float(seconds))


@dataclass(frozen=True)
class DraftedMessage:
    """draft_model's answer (its distributions, when sampling, go as the DRAFT_PROBS tensor)."""

    tokens: list[int]
    cached_length: int  # tokens the draft's cache holds after the proposal
    parents: tuple[int, ...] | None = None  # a tree's (sent as an empty list for a chain)
    forward: ForwardStats | None = None  # the batched execution the call ran in (every drafted step)

    def encode(self) -> Arrays:
        out = {tn.DRAFT_TOKENS: _i32(self.tokens), tn.CACHED_LENGTH: _i32([self.cached_length]),
               tn.DRAFT_PARENTS: _i32(self.parents or [])}
        if self.forward is not None:
            out[tn.FORWARD_STATS] = _forward_stats(self.forward)
        return out

    @classmethod
    def decode(cls, outputs: Arrays) -> DraftedMessage:
        return cls(outputs[tn.DRAFT_TOKENS].reshape(-1).tolist(), int(outputs[tn.CACHED_LENGTH].reshape(-1)[0]),
                   _tuple(outputs, tn.DRAFT_PARENTS), _decode_forward_stats(outputs))


@dataclass(frozen=True)
class VerifyMessage:
    """target_model's own inputs. num_logits = 0 appends only (a prompt's chunk)."""

    num_logits: int
    allowed: torch.Tensor | None = None  # (num_logits, words) int32 bitmask; None: every token
    tree: tuple[int, ...] | None = None  # the new tokens' parents (a tree of candidates); None: a chain
    path: tuple[int, ...] | None = None  # the last step's tree nodes accepted; None: none
    score_rows: int = 0  # the positions before the last num_logits scored too (tn.SCORE_ROWS)
    score_next: int = -1  # the token after the new ones, for the last score row of a prompt's chunk (tn.SCORE_NEXT)
    adapter: str = ""  # the sequence's LoRA adapter (tn.LORA_NAME; read at its first step); "": the base model
    draft: DraftAsk | None = None  # a head hosted in target_model drafts first (tn.DRAFT_HEAD, tn.DRAFT_ASK)

    def encode(self) -> Arrays:
        # An empty bitmask, tree or path stands for none: the input is always there (one input set).
        allowed = np.zeros((1, 0, 0), dtype=np.int32) if self.allowed is None else self.allowed.cpu().numpy()[None]
        return {tn.NUM_LOGITS: _i32([self.num_logits]), tn.ALLOWED_TOKENS: allowed,
                tn.TREE_PARENTS: _i32(self.tree or []), tn.ACCEPTED_PATH: _i32(self.path or []),
                tn.SCORE_ROWS: _i32([self.score_rows]), tn.SCORE_NEXT: _i32([self.score_next]),
                tn.LORA_NAME: adapter_name(self.adapter), **_encode_ask(self.draft)}

    @classmethod
    def decode(cls, inputs: Arrays) -> VerifyMessage:
        num_logits = int(_scalar(inputs, tn.NUM_LOGITS, 1))
        score_rows = int(_scalar(inputs, tn.SCORE_ROWS, 0))
        score_next = int(_scalar(inputs, tn.SCORE_NEXT, -1))
        tree, path = (_tuple(inputs, name) for name in (tn.TREE_PARENTS, tn.ACCEPTED_PATH))
        name = inputs.get(tn.LORA_NAME)
        adapter = "" if name is None or not name.size else _text(name.reshape(-1)[0])
        if score_rows < 0 or (score_rows and tree is not None):
            raise ValueError(f"{tn.SCORE_ROWS} must be >= 0, and 0 with {tn.TREE_PARENTS}; got {score_rows}")
        allowed = inputs.get(tn.ALLOWED_TOKENS)
        draft = _decode_ask(inputs)
        if allowed is None or not allowed.size:
            return cls(num_logits, None, tree, path, score_rows, score_next, adapter, draft)
        if allowed.ndim != 3 or allowed.shape[0] != 1 or allowed.shape[1] != num_logits:
            raise ValueError(f"{tn.ALLOWED_TOKENS} must be [1, {tn.NUM_LOGITS} = {num_logits}, words], got "
                             f"{list(allowed.shape)}")
        return cls(num_logits, torch.from_numpy(np.ascontiguousarray(allowed[0])), tree, path, score_rows, score_next,
                   adapter, draft)


SEED_RANGE = 2**52  # a hosted head's round seed travels in a float64 (the seeds' stream stays deterministic)


def _encode_ask(ask: DraftAsk | None) -> Arrays:
    if ask is None:  # every verify call without one (arrays read only: the BLS tensor copies them)
        return _NO_ASK
    params = ask.params
    values = [ask.k, ask.branches, params.temperature, params.top_k, params.top_p, params.min_p,
              (ask.seed or 0) % SEED_RANGE]
    return {tn.DRAFT_HEAD: adapter_name(ask.head), tn.DRAFT_ASK: np.asarray([values], dtype=np.float64)}


_NO_ASK: Arrays = {tn.DRAFT_HEAD: np.array([[b""]], dtype=np.object_), tn.DRAFT_ASK: np.zeros((1, 7), dtype=np.float64)}


def _decode_ask(inputs: Arrays) -> DraftAsk | None:
    name = inputs.get(tn.DRAFT_HEAD)
    head = "" if name is None or not name.size else _text(name.reshape(-1)[0])
    if not head:
        return None
    values = inputs.get(tn.DRAFT_ASK)
    if values is None or values.size != 7:
        raise ValueError(f"{tn.DRAFT_ASK} must hold 7 values with {tn.DRAFT_HEAD} {head!r}")
    k, branches, temperature, top_k, top_p, min_p, seed = values.reshape(-1).tolist()
    if k < 0 or branches < 1:
        raise ValueError(f"{tn.DRAFT_ASK}: k must be >= 0 and the candidates per position >= 1, got {k:g}, "
                         f"{branches:g}")
    return DraftAsk(head, int(k), SamplingParams(temperature=temperature, top_k=int(top_k), top_p=top_p, min_p=min_p),
                    int(seed), int(branches))


@dataclass(frozen=True)
class HostedDraftMessage:
    """target_model's answer about what its hosted head drafted (the distributions go as DRAFT_PROBS)."""

    tokens: list[int]
    parents: tuple[int, ...] | None
    forward: ForwardStats  # the head's execution

    def encode(self) -> Arrays:
        return {tn.DRAFT_TOKENS: _i32(self.tokens), tn.DRAFT_PARENTS: _i32(self.parents or []),
                tn.DRAFT_STATS: _forward_stats(self.forward)}

    @classmethod
    def decode(cls, outputs: Arrays) -> HostedDraftMessage:
        stats = outputs[tn.DRAFT_STATS].reshape(-1).tolist()
        return cls(outputs[tn.DRAFT_TOKENS].reshape(-1).tolist(), _tuple(outputs, tn.DRAFT_PARENTS),
                   ForwardStats(int(stats[0]), int(stats[1]), float(stats[2])))


def adapter_name(name: str) -> np.ndarray:
    """tn.LORA_NAME as target_model takes it: BYTES [1, 1]."""
    return np.array([[name.encode()]], dtype=np.object_)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _tuple(inputs: Arrays, name: str) -> tuple[int, ...] | None:
    """An optional INT32 [1, n] input as a tuple; None where absent or empty."""
    value = inputs.get(name)
    if value is None or not value.size:
        return None
    return tuple(int(v) for v in value.reshape(-1))


@dataclass(frozen=True)
class VerifiedMessage:
    """target_model's answer (logits go as the LOGITS tensor, on the device where they can)."""

    greedy_tokens: np.ndarray  # (num_logits,) int32
    forward: ForwardStats | None = None  # the batched forward the step ran in
    log_probs: np.ndarray | None = None  # (num_logits,) float32, when asked for
    # (num_logits, tn.MAX_TOP_LOG_PROBS) int32 / float32, when asked for: each position's most likely tokens
    top_ids: np.ndarray | None = None
    top_log_probs: np.ndarray | None = None
    # with score_rows: (score_rows,) float32 and, when asked for, (score_rows, tn.MAX_TOP_LOG_PROBS) int32 /
    # float32 (tn.SCORED_*)
    scored_log_probs: np.ndarray | None = None
    scored_top_ids: np.ndarray | None = None
    scored_top_log_probs: np.ndarray | None = None
    # when asked for (tn.CACHED_TOKENS): the sequence's tokens its prefix cache held, and the tokens of a KV block
    cached_tokens: int | None = None
    block_size: int = 0
    scored_ranks: np.ndarray | None = None  # with score_rows: (score_rows,) int32, each next token's rank

    def encode(self) -> Arrays:
        out = {tn.GREEDY_TOKENS: _i32(self.greedy_tokens)}
        if self.cached_tokens is not None:
            out[tn.CACHED_TOKENS] = _i32([self.cached_tokens, self.block_size])
        if self.scored_log_probs is not None:
            out[tn.SCORED_LOG_PROBS] = np.asarray(self.scored_log_probs, dtype=np.float32).reshape(1, -1)
        if self.scored_ranks is not None:
            out[tn.SCORED_RANKS] = _i32(self.scored_ranks)
        if self.scored_top_ids is not None:
            out[tn.SCORED_TOP_IDS] = np.asarray(self.scored_top_ids, dtype=np.int32)[None]
            out[tn.SCORED_TOP_LOG_PROBS] = np.asarray(self.scored_top_log_probs, dtype=np.float32)[None]
        if self.forward is not None:
            out[tn.FORWARD_STATS] = _forward_stats(self.forward)
        if self.log_probs is not None:
            out[tn.GREEDY_LOG_PROBS] = np.asarray(self.log_probs, dtype=np.float32).reshape(1, -1)
        if self.top_ids is not None:
            out[tn.GREEDY_TOP_IDS] = np.asarray(self.top_ids, dtype=np.int32)[None]
            out[tn.GREEDY_TOP_LOG_PROBS] = np.asarray(self.top_log_probs, dtype=np.float32)[None]
        return out

    @classmethod
    def decode(cls, outputs: Arrays) -> VerifiedMessage:
        log_probs, top_ids, top_values = (outputs.get(name) for name in (tn.GREEDY_LOG_PROBS, tn.GREEDY_TOP_IDS,
                                                                           tn.GREEDY_TOP_LOG_PROBS))
        scored, scored_ids, scored_values = (outputs.get(name) for name in (
            tn.SCORED_LOG_PROBS, tn.SCORED_TOP_IDS, tn.SCORED_TOP_LOG_PROBS))
        cached, ranks = outputs.get(tn.CACHED_TOKENS), outputs.get(tn.SCORED_RANKS)
        return cls(outputs[tn.GREEDY_TOKENS].reshape(-1).astype(np.int32), _decode_forward_stats(outputs),
                   None if log_probs is None else log_probs.reshape(-1).copy(),
                   None if top_ids is None else top_ids[0].copy(), None if top_values is None else top_values[0].copy(),
                   None if scored is None else scored.reshape(-1).copy(),
                   None if scored_ids is None else scored_ids[0].copy(),
                   None if scored_values is None else scored_values[0].copy(),
                   *((None, 0) if cached is None or not cached.size else (int(v) for v in cached.reshape(-1)[:2])),
                   None if ranks is None else ranks.reshape(-1).astype(np.int32))


# What a call that asks for nothing back sends as the model's own inputs (a prompt's chunk, a release).
QUIET_PROPOSE = ProposeMessage(0)
QUIET_VERIFY = VerifyMessage(0)
