"""Prompt-lookup (n-gram) drafting: propose the tokens that followed the latest earlier occurrence of
the sequence's own suffix (Saxena 2023, "prompt lookup decoding"; transformers' prompt_lookup_num_tokens).

No model, so a draft costs nothing and a round without a match is a plain target-only step. It pays on
grounded tasks (summarise, rewrite, edit code, answer from a given text), where the output copies spans
of the prompt. Runs inside the orchestrator process: a BLS call would cost more than the lookup.
"""

from __future__ import annotations

import torch

from specdec.orchestrator import Proposal
from specdec.sampling import SamplingParams


def lookup(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram.

    Tries n = max_ngram down to min_ngram; the suffix itself (the last n tokens) is not a match.
    Returns [] when no suffix of length >= min_ngram occurred before.
    """
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n:]
        # Scan right to left: the latest occurrence is the most relevant continuation.
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + k]
                if follow:
                    return follow
    return []


class NgramProposer:
    """Proposer over `lookup`, keeping each sequence's tokens as its 'cache'.

    min_ngram 2: a single repeated token predicts its continuation poorly; on SmolLM2 (2-core CPU,
    K=4, 64 tokens) min_ngram 1 measured α 0.13 and 1.01x on grounded prompts, 0.86x on open-ended
    ones; min_ngram 2 measured α 0.38 and 1.13x grounded, 0.96x open-ended.
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, vocab_size: int = 0):
        self.max_ngram, self.min_ngram, self.vocab_size = max_ngram, min_ngram, vocab_size
        self.sequences: dict[int, list[int]] = {}

    async def propose(self, seq_id: int, keep: int, new_ids: list[int], k: int,
                      params: SamplingParams, round_seed: int) -> Proposal:
        tokens = self.sequences.setdefault(seq_id, [])
        del tokens[keep:]
        tokens.extend(new_ids)
        proposal = lookup(tokens, k, self.max_ngram, self.min_ngram)
        probs = None
        if proposal and not params.greedy:
            # A deterministic draft is the one-hot distribution on its token: rejection sampling then
            # accepts with probability p_target(x) and resamples from the target without x: lossless.
            probs = torch.nn.functional.one_hot(torch.tensor(proposal), self.vocab_size).float()
        return Proposal(proposal, probs, cached_length=len(tokens))

    async def release(self, seq_id: int) -> None:
        self.sequences.pop(seq_id, None)
