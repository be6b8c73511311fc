"""OpenAI's Predicted Outputs as a draft: a request brings the text it expects back (`prediction`: a file being
edited, a document being revised), and its rounds draft from it.

While the answer is the prediction's beginning, the draft is the prediction's next tokens; once they part,
prompt lookup runs over the prediction, the prompt and the answer (Saxena's prompt lookup with the prediction
as more context): the latest earlier occurrence of the answer's suffix n-gram proposes what followed it, so
that after an edit the draft finds its place again in the prediction where the answer rejoins it. Any draft stays exact (the target verifies it); a
prediction that is wrong costs a round's verify rows, and the adaptive policy prices them as for any draft.
"""

from __future__ import annotations

from specdec.decoding.interfaces import Proposal
from specdec.decoding.ngram_proposer import NgramIndex
from specdec.decoding.sampling import SamplingParams

BOUNDARY = -1  # between the prediction and the sequence: no n-gram spans it, no draft crosses it


class PredictionProposer:
    """One request's proposer: `prediction` its token ids, `prompt_length` the sequence's prompt tokens (the
    answer follows them). The loop's Proposer protocol (model-free: no distributions, nothing to release but
    the index)."""

    branches = 1

    def __init__(self, prediction: list[int], prompt_length: int, max_ngram: int = 4, min_ngram: int = 2):
        self.prediction, self.prompt_length = list(prediction), prompt_length
        self.index = NgramIndex(max_ngram, min_ngram)
        self.index.extend([*self.prediction, BOUNDARY])
        self.offset = len(self.prediction) + 1  # the sequence's tokens start here in the index
        self.synced = 0  # the answer's first tokens that are the prediction's

    async def propose(self, seq_id: int, keep: int, new_ids: list[int], k: int, params: SamplingParams,
                      round_seed: int, reserve: int = 0, branches: int | None = None) -> Proposal:
        self.index.truncate(self.offset + keep)
        self.synced = min(self.synced, max(keep - self.prompt_length, 0))  # a rollback keeps what it kept
        self.index.extend(new_ids)
        length = len(self.index.tokens) - self.offset
        return Proposal(self.draft(length - self.prompt_length, k), None, cached_length=length)

    def draft(self, answered: int, k: int) -> list[int]:
        """Up to k tokens after the sequence's `answered` answer tokens: the prediction's next ones while the
        answer is its beginning, else prompt lookup over prediction, prompt and answer."""
        answered = max(answered, 0)
        start, tokens, prediction = self.offset + self.prompt_length, self.index.tokens, self.prediction
        while self.synced < min(answered, len(prediction)) and tokens[start + self.synced] == prediction[self.synced]:
            self.synced += 1
        if self.synced == answered:  # the answer so far is the prediction's beginning
            return prediction[answered:answered + k]
        follow = self.index.lookup(k)
        return follow[:follow.index(BOUNDARY)] if BOUNDARY in follow else follow

    async def release(self, seq_id: int) -> None:
        self.index = NgramIndex(self.index.max_ngram, self.index.min_ngram)
