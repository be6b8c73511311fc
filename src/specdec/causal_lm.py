"""A Hugging Face causal LM that keeps one KV cache per sequence, with rollback.

draft_model and target_model both wrap this class. Every call names the sequence, how many of its
cached tokens to keep (rolling back rejected draft tokens is just a smaller `keep`) and the new
tokens to append, so each round processes only new tokens and the prompt is never re-sent.
Caches live in a keyed store with an idle timeout, so a sequence abandoned without a release call
(client crash, orchestrator restart) cannot hold memory forever.

Known limit: steps of different sequences run one forward each; the store's per-sequence layout is
what a batched (padded) forward over several sequences will gather from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specdec.sampling import SamplingParams, logits_to_probs, sample

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


class CacheError(ValueError):
    """A request that does not match the sequence's cached state (a client or orchestrator bug)."""


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_causal_lm(model_path: str, device: str = "cpu", dtype: str = "float32", device_map: str = ""):
    """Load a causal LM from a Hugging Face directory or a single GGUF file.

    device_map (e.g. "auto") spreads a model too large for one GPU over the visible GPUs.
    """
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if not path.exists():
        raise FileNotFoundError(f"model_path {model_path!r} does not exist")
    torch_dtype = resolve_dtype(dtype)
    kwargs = {"dtype": torch_dtype}
    if device_map:
        kwargs["device_map"] = device_map
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model_path {model_path!r} is a file but not a .gguf file")
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    else:
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model_path {model_path!r} has no config.json (not a Hugging Face model directory)")
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    if not device_map:
        model.to(torch.device(device))
    return model.eval()


@dataclass
class _Sequence:
    cache: object  # transformers DynamicCache
    length: int = 0  # tokens currently in the cache
    last_used: float = field(default=0.0)


class CausalLM:
    """Per-sequence incremental forward passes over one model.

    `clock` is injectable so idle eviction is testable without sleeping.
    """

    def __init__(self, model, max_sequences: int = 256, idle_timeout_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        self.model = model
        self.max_sequences = max_sequences
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self.sequences: dict[int, _Sequence] = {}
        self.tokens_processed = 0  # every token run through the model, for the token-count metric

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def device(self) -> torch.device:
        return self.model.device

    def cached_length(self, seq_id: int) -> int:
        seq = self.sequences.get(seq_id)
        return seq.length if seq else 0

    def _acquire(self, seq_id: int, keep: int) -> _Sequence:
        from transformers import DynamicCache

        seq = self.sequences.get(seq_id)
        if seq is None:
            if keep != 0:
                raise CacheError(
                    f"sequence {seq_id} has no cache (never started, released or evicted after idling)"
                    f" but cache_length={keep} was requested")
            if len(self.sequences) >= self.max_sequences:
                raise CacheError(f"too many live sequences ({self.max_sequences}); retry later")
            seq = self.sequences[seq_id] = _Sequence(DynamicCache(config=self.model.config))
        elif keep > seq.length:
            raise CacheError(f"cache_length={keep} exceeds the {seq.length} tokens cached for sequence {seq_id}")
        elif keep == 0:
            seq.cache, seq.length = DynamicCache(config=self.model.config), 0
        elif keep < seq.length:
            # Roll back rejected tokens. In transformers 5, crop(-n) removes the last n tokens
            # (a positive argument is refused); tests/unit/test_causal_lm.py pins this behaviour.
            seq.cache.crop(keep - seq.length)
            seq.length = keep
        seq.last_used = self.clock()
        return seq

    @torch.inference_mode()
    def extend(self, seq_id: int, keep: int, new_ids: list[int], num_logits: int) -> torch.Tensor:
        """Keep the first `keep` cached tokens, append `new_ids`, return logits of the last positions.

        Returns (num_logits, V) in the model's dtype; num_logits <= len(new_ids).
        """
        if not new_ids:
            raise CacheError("no new tokens to append")
        if not 0 <= num_logits <= len(new_ids):
            raise CacheError(f"num_logits={num_logits} must be within [0, {len(new_ids)}] (the new tokens)")
        seq = self._acquire(seq_id, keep)
        input_ids = torch.tensor([new_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(seq.length, seq.length + len(new_ids), device=self.device).unsqueeze(0)
        out = self.model(input_ids=input_ids, position_ids=positions, past_key_values=seq.cache,
                         use_cache=True, logits_to_keep=max(num_logits, 1))
        seq.length += len(new_ids)
        self.tokens_processed += len(new_ids)
        return out.logits[0, out.logits.shape[1] - num_logits:]

    @torch.inference_mode()
    def propose(self, seq_id: int, keep: int, new_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
        """Draft k tokens autoregressively after appending new_ids.

        Returns (tokens, probs): k draft tokens and, when sampling, their (k, V) float32 processed
        distributions (None when greedy: the greedy rule needs only the tokens). The last drafted token
        is not run through the model (nothing needs its logits until the next round), so the cache
        grows by len(new_ids) + k - 1.
        """
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        logits = self.extend(seq_id, keep, new_ids, 1)[-1]
        for step in range(k):
            if params.greedy:
                token = int(logits.argmax())
            else:
                p = logits_to_probs(logits, params)
                token = int(sample(p, generator))
                probs.append(p)
            tokens.append(token)
            if step < k - 1:
                logits = self.extend(seq_id, self.cached_length(seq_id), [token], 1)[-1]
        return tokens, (torch.stack(probs) if probs else None)

    def release(self, seq_id: int) -> bool:
        return self.sequences.pop(seq_id, None) is not None

    def evict_idle(self) -> list[int]:
        """Drop sequences idle for longer than idle_timeout_s; returns their ids."""
        deadline = self.clock() - self.idle_timeout_s
        stale = [sid for sid, seq in self.sequences.items() if seq.last_used < deadline]
        for sid in stale:
            del self.sequences[sid]
        return stale
