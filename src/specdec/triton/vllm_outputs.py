"""vLLM's Triton backend's additional outputs, by its names and meanings: what its clients read when they
send its `return_*` flags (tn.VLLM_OUTPUT_FLAGS), built from one response's tokens and the request's state.
No `pb_utils` here: plain arrays, unit-tested without a server.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import numpy as np

from specdec import tensor_names as tn

TokenText = Callable[[int], str]  # a token's text alone (vLLM's `decoded_token`)
# vLLM's finish reason on a streamed response that is not the last (its backend sends str(None))
NOT_FINISHED = "None"


def logprobs_json(ids: Sequence[int], log_probs: Sequence[float], ranks: Sequence[int] | None,
                  top: tuple[Sequence[Sequence[int]], Sequence[Sequence[float]]] | None,
                  token_text: TokenText) -> str:
    """vLLM's `logprobs` output for one response: a JSON list with, per token of `ids`, an object
    {"<token id>": {"logprob", "rank", "decoded_token"}} holding the generated token first, then its position's
    most likely tokens (`top`: ids and log-probabilities per token, most likely first, rank 1 first), each id
    once. `ranks`: the generated tokens' ranks (None: 1 each, greedy choices)."""
    entries = []
    for i, token in enumerate(ids):
        entry = {str(token): {"logprob": float(log_probs[i]), "rank": int(ranks[i]) if ranks else 1,
                              "decoded_token": token_text(token)}}
        if top is not None:
            for rank, (other, value) in enumerate(zip(top[0][i], top[1][i]), start=1):
                entry.setdefault(str(other), {"logprob": float(value), "rank": rank,
                                              "decoded_token": token_text(int(other))})
        entries.append(entry)
    return json.dumps(entries, ensure_ascii=False)


def additional_outputs(flags: frozenset[str], *, ids: Sequence[int], finish: str | None, cumulative: float,
                       logprobs: str | None) -> dict[str, np.ndarray]:
    """The outputs the request's true flags ask for, shaped (1, 1) for one response: `finish` None on a
    streamed response that is not the last; `cumulative` the log-probability of every token sent so far;
    `logprobs` this response's JSON (None: the request set no `logprobs`, sent as "null"). The caller adds
    these after its own outputs of the same names (finish_reason, num_output_tokens), which they replace."""
    out: dict[str, np.ndarray] = {}
    if tn.RETURN_FINISH_REASON in flags:
        out[tn.FINISH_REASON] = np.array([[(finish or NOT_FINISHED).encode()]], dtype=np.object_)
    if tn.RETURN_CUMULATIVE_LOGPROB in flags:
        out[tn.CUMULATIVE_LOGPROB] = np.array([[cumulative]], dtype=np.float32)
    if tn.RETURN_LOGPROBS in flags:
        out[tn.LOGPROBS] = np.array([[(logprobs if logprobs is not None else "null").encode()]], dtype=np.object_)
    if tn.RETURN_NUM_OUTPUT_TOKENS in flags:  # this response's tokens, not the total so far
        out[tn.NUM_OUTPUT_TOKENS] = np.array([[len(ids)]], dtype=np.int32)
    return out
