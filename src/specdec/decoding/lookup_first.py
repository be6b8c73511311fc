"""Prompt lookup first, a model draft where it finds nothing: one draft method of both ("ngram+NAME").

Prompt lookup costs nothing and, where the output copies the prompt (summaries, rewrites, answers from a
given text), proposes spans no model draft matches; on open-ended text it rarely finds a match worth
verifying, where a trained head or a small draft model proposes what the target is likely to say. Each
round this proposer drafts the lookup's continuation when the sequence's suffix matched an earlier
n-gram of at least `min_ngram` tokens, else asks the model. Which one drafts depends only on the tokens so
far, so every round is one proposer's proposal and the loop's verification keeps the target's output
(greedy) and distribution (sampling) exact.

The loop asks which part drafts before the round (`choose`), and each part has its own draft-length
policy (draft_length.PartPolicies): the lookup's free and shadowed as prompt lookup alone, the model's
priced and probed as the model alone. (One policy for both priced the lookup's rounds at the model's
cost and paused both at once.)

The model's cache lags over the rounds the lookup drafted: this proposer reports the model's valid
prefix as its own, so the loop sends the tokens (and a trained head's features) the model missed with
the next call that reaches it, as it does after paused rounds. The lookup keeps every token of the
sequence it has seen: it is sent those it has not, and takes the model's accepted drafts, which the
model holds and the loop does not send again, from the model's last proposal.
"""

from __future__ import annotations

import dataclasses

from specdec import tensor_names as tn
from specdec.decoding.interfaces import Proposal, Proposer
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.tree_sampler import first_branch

DEFAULT_MIN_NGRAM = 2  # speculative_decoding's lookup_first_min_ngram: prompt lookup's own shortest match
LOOKUP, MODEL = "lookup", "model"  # the parts a round may draft with (`choose`)


def parts(method: str) -> tuple[str, str] | None:
    """(lookup, model) of a combined method name, None for any other name."""
    lookup, sep, model = method.partition(tn.DRAFT_SEPARATOR)
    return (lookup, model) if sep and lookup and model else None


class LookupFirstProposer:
    def __init__(self, lookup: NgramProposer, model: Proposer, min_ngram: int = DEFAULT_MIN_NGRAM):
        if type(lookup) is not NgramProposer:  # a suffix cache's matches are not the sequence's n-grams
            raise ValueError(f"the lookup first must be prompt lookup ({type(lookup).__name__} given)")
        if min_ngram < lookup.min_ngram:
            raise ValueError(f"min_ngram {min_ngram} is below the lookup's own ({lookup.min_ngram})")
        self.lookup, self.model, self.min_ngram = lookup, model, min_ngram
        self.wants_features = getattr(model, "wants_features", False)
        self.hosted = getattr(model, "hosted", "")  # a head in the target's process (interfaces.HostedProposer)
        self.branches = getattr(model, "branches", 1)
        self.adapts = getattr(model, "adapts", False)
        self.salted = getattr(model, "salted", False)
        self.model_valid: dict[int, int] = {}  # seq -> the model's valid prefix, for sequences it was called for
        self.chosen: dict[int, str] = {}  # seq -> the part `choose` picked for its next call
        self.drafted: dict[int, tuple[int, list[int]]] = {}  # seq -> (where, tokens) of the model's last proposal
        self.behind: set[int] = set()  # sequences the lookup drafted for since the model's last call
        self.lookup_rounds = self.model_rounds = 0

    def choose(self, seq_id: int, keep: int, new_ids: list[int]) -> str:
        """LOOKUP or MODEL: which part drafts the sequence's next round (its tokens are those kept and
        `new_ids`, as the next propose call will be sent). The loop asks first, so that each part's own
        draft-length policy (draft_length.PartPolicies) prices the round."""
        # The lookup holds a prefix of the sequence: every token it was sent, and keep + new_ids is the
        # sequence from keep on. The model's cache (keep) may hold more: its accepted drafts of last round,
        # which the loop does not send again, and the lookup takes from that proposal.
        seen = self.lookup.seen(seq_id)
        accepted = []
        if seen < keep:
            start, drafted = self.drafted.get(seq_id, (seen, []))
            if start != seen or keep - seen > len(drafted):
                raise ValueError(f"sequence {seq_id}: the lookup holds {seen} tokens and the model {keep}")
            accepted = drafted[:keep - seen]
        matched, span = self.lookup.extend(seq_id, seen, accepted + new_ids[max(0, seen - keep):]).longest(1)
        self.chosen[seq_id] = part = LOOKUP if span and matched >= self.min_ngram else MODEL
        return part

    async def propose(self, seq_id: int, keep: int, new_ids: list[int], k: int, params: SamplingParams,
                      round_seed: int, reserve: int = 0, **options) -> Proposal:
        if seq_id not in self.chosen:  # a caller that did not ask first
            self.choose(seq_id, keep, new_ids)
        part = self.chosen.pop(seq_id)
        if part == LOOKUP:
            span = self.lookup.sequences[seq_id].lookup(k)
            self.lookup_rounds += 1
            self.behind.add(seq_id)
            # The model was not called: its valid prefix is at most what the loop asked it to keep
            valid = min(keep, self.model_valid.get(seq_id, 0))
            if seq_id in self.model_valid:
                self.model_valid[seq_id] = valid
            return Proposal(span, None, cached_length=valid)
        self.model_rounds += 1
        proposal = await self.model.propose(seq_id, keep, new_ids, k, params, round_seed, reserve, **options)
        if seq_id in self.behind:  # it caught up on the lookup's rounds
            self.behind.discard(seq_id)
            proposal = dataclasses.replace(proposal, caught_up=True)
        self.model_valid[seq_id] = proposal.cached_length
        self.drafted[seq_id] = (keep + len(new_ids), _first_branch(proposal))
        return proposal

    def drafted_in_verify(self, seq_id: int, proposal: Proposal) -> None:
        """A hosted model's proposal, drafted in the round's verify call after `propose` asked for it."""
        where, _ = self.drafted[seq_id]
        self.drafted[seq_id] = (where, _first_branch(proposal))

    async def release(self, seq_id: int) -> None:
        self.chosen.pop(seq_id, None)
        self.behind.discard(seq_id)
        self.drafted.pop(seq_id, None)
        await self.lookup.release(seq_id)
        if self.model_valid.pop(seq_id, None) is not None:  # a sequence the model never saw is not its to end
            await self.model.release(seq_id)


def _first_branch(proposal: Proposal) -> list[int]:
    """A proposal's chain, or its tree's first branch: what the model's cache holds of it."""
    return list(first_branch(proposal).tokens)
