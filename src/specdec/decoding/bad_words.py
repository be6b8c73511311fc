"""Bad words: token sequences the output never contains (TensorRT-LLM's `bad_words`).

A bad word is the token sequence its text encodes to. At every position the target would generate, a
one-token word's token is banned; a longer word's last token is banned where the tokens so far end with
the rest of it. Bans apply to the target's logits before anything reads them (greedy argmax, or
sampling's processing and the acceptance test), so speculative output stays exactly the target's output
under the same bans: a drafted banned token is simply never the target's choice (greedy) or has target
probability 0 (sampled: always rejected; the draft's own distribution needs no ban for the accept/reject
rule to stay exact).
"""

from __future__ import annotations

from typing import Sequence

import torch


def banned_tokens(context: Sequence[int], draft: Sequence[int], bad_words: Sequence[Sequence[int]],
                  positions: int) -> list[list[int]]:
    """The token ids banned at each of a verify's `positions` positions.

    Position j predicts the token after `context + draft[:j]` (context: every token before the round's
    drafts, prompt included). Returns `positions` lists of token ids (possibly empty)."""
    longest = max((len(word) for word in bad_words), default=0)
    # Only the last (longest - 1) tokens before a position can match the front of a word.
    tail = list(context[max(len(context) - (longest - 1), 0):]) if longest > 1 else []
    history = tail + list(draft[:max(positions - 1, 0)])
    bans: list[list[int]] = []
    for j in range(positions):
        end = len(tail) + j  # history[:end] is what precedes position j (its tail)
        banned = []
        for word in bad_words:
            front = len(word) - 1
            if front == 0 or (front <= end and history[end - front:end] == list(word[:-1])):
                banned.append(word[-1])
        bans.append(banned)
    return bans


def mask_banned(logits: torch.Tensor, bans: Sequence[Sequence[int]]) -> torch.Tensor:
    """logits [P, V] with each position's banned ids set to -inf (a copy; ids beyond V are ignored:
    a token the model cannot produce needs no ban)."""
    rows = [j for j, banned in enumerate(bans) for token in banned if token < logits.shape[-1]]
    if not rows:
        return logits
    cols = [token for banned in bans for token in banned if token < logits.shape[-1]]
    masked = logits.clone()
    masked[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
    return masked
