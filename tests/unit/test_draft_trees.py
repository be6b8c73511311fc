"""A draft model's proposals as token trees (decoding/draft_tree.py, Step.branches): the layout within the
node budget; the executor's candidates (greedy: the next most likely; sampled: drawn without replacement
after the drafted token, which the tree rule's SAMPLED children assume: tested against the exact pair
distribution, with planted bugs); greedy output equal to target-only through the loop, with siblings
accepted; seeded sampled trees repeat."""

import asyncio
import copy
import math

import pytest
import torch

from specdec.decoding.draft_length import DraftLengthPolicy
from specdec.decoding.draft_tree import chain_depth, top_k_tree
from specdec.decoding.loop import GenerationRequest, Stats, generate
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.decoding.sampling import SamplingParams, logits_to_probs, make_generator, sample
from specdec.engine.build import dynamic_executor
from specdec.engine.executor import Step, _candidates
from specdec.engine.local import LocalProposer, LocalScorer

from .stats import chi_square_rejects
from .test_trees_in_the_loop import executor as executors

PROMPT = [5, 17, 3, 88, 41, 60, 2, 44]


def test_the_chain_takes_its_share_of_the_budget_and_siblings_fill_the_rest_from_the_first_position():
    assert [chain_depth(8, b) for b in (1, 2, 3, 4)] == [8, 4, 3, 2]
    assert chain_depth(1, 3) == 1
    tokens, parents, chain_of = top_k_tree([10, 11, 12], [[20, 21], [22, 23], [24, 25]], 7)
    assert tokens == [10, 20, 21, 11, 22, 23, 12] and parents == (-1, -1, -1, 0, 0, 0, 3)
    assert chain_of == [0, -1, -1, 1, -1, -1, 2]
    # The drafted token among the candidates is dropped; the budget cuts the deepest siblings first.
    tokens, parents, _ = top_k_tree([10, 11], [[10, 20, 21], [11, 22]], 4)
    assert tokens == [10, 20, 21, 11] and parents == (-1, -1, -1, 0)
    assert top_k_tree([10, 11], [[20], [21]], 2)[0] == [10, 11]  # no room: the chain


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_greedy_tree_is_the_chain_and_the_next_most_likely_tokens(tiny_lm, kind):
    lm, chain = executors(tiny_lm, kind), executors(tiny_lm, kind)
    (tree,) = lm.propose_many([Step(1, 0, PROMPT, k=6, branches=3)])
    drafted = chain.propose(1, 0, PROMPT, 2, SamplingParams())  # the tree's chain: ceil(6 / 3) tokens
    assert tree.parents == (-1, -1, -1, 0, 0, 0) and tree.probs is None
    assert [tree.tokens[0], tree.tokens[3]] == drafted.tokens and tree.cached_length == drafted.cached_length
    with torch.no_grad():
        logits = tiny_lm(torch.tensor([PROMPT + drafted.tokens[:1]])).logits[0, -2:]
    for position, nodes in ((0, tree.tokens[:3]), (1, tree.tokens[3:])):
        assert nodes == logits[position].topk(3).indices.tolist()


def test_a_sampled_tree_gives_each_node_the_row_its_children_were_drawn_from(tiny_lm):
    lm = dynamic_executor(tiny_lm)
    params = SamplingParams(temperature=1.0)
    (tree,) = lm.propose_many([Step(1, 0, PROMPT, k=6, branches=3, params=params,
                                    generator=make_generator(3, "cpu"))])
    assert tree.parents == (-1, -1, -1, 0, 0, 0)
    assert len(set(tree.tokens[:3])) == 3 and len(set(tree.tokens[3:])) == 3  # without replacement
    with torch.no_grad():
        logits = tiny_lm(torch.tensor([PROMPT + tree.tokens[:1]])).logits[0, -2:]
    rows = logits_to_probs(logits, params)
    assert tree.probs.shape == (7, 97)
    assert torch.allclose(tree.probs[0], rows[0]) and torch.allclose(tree.probs[1], rows[1])
    assert not tree.probs[2:].any()  # leaves (and the chain's last token): nothing drawn from them


# ---- the draws a sampled tree's SAMPLED rule assumes -------------------------------------------------
P = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=torch.float64)


def pair_counts(draw_sibling, n=8_000) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(25)
    for _ in range(n):
        token = sample(P, g)
        sibling = int(draw_sibling(P, token, g))
        counts[int(token) * 5 + sibling] += 1
    return counts


def exact_pairs() -> torch.Tensor:
    """P(first = a, second = b) drawing two without replacement: p(a) p(b) / (1 - p(a))."""
    return torch.tensor([0.0 if a == b else float(P[a] * P[b] / (1 - P[a])) for a in range(5) for b in range(5)])


def test_sampled_siblings_are_drawn_without_replacement_after_the_drafted_token():
    ours = lambda p, token, g: _candidates(torch.log(p), token, p, 2, g)[0]  # noqa: E731
    assert not chi_square_rejects(pair_counts(ours), exact_pairs())


@pytest.mark.parametrize("planted", ["with replacement", "from the target's shape", "second most likely"])
def test_the_pair_test_catches_planted_bugs(planted):
    def draw(p, token, g):
        if planted == "with replacement":  # may repeat the drafted token
            return torch.multinomial(p, 1, generator=g)[0]
        if planted == "from the target's shape":  # uniform over the others
            rest = torch.ones_like(p)
            rest[token] = 0
            return torch.multinomial(rest, 1, generator=g)[0]
        rest = p.clone()
        rest[token] = 0
        return rest.argmax()  # deterministic, though verified as drawn
    assert chi_square_rejects(pair_counts(draw), exact_pairs())


# ---- through the loop ---------------------------------------------------------------------------------
def close_draft(target):
    """The target with a little noise on its head: its first choice is often the target's, its second
    often the target's where the first is not (what trees gain from)."""
    draft = copy.deepcopy(target)
    torch.manual_seed(1)
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.randn_like(draft.lm_head.weight) * draft.lm_head.weight.std() * 0.3)
    return draft


def run(req, proposer, scorer, k, stats=None):
    async def main():
        policy = DraftLengthPolicy.fixed(k, branches=proposer.branches)
        return [t async for r in generate(req, proposer, scorer, policy, stats) for t in r.new_tokens]
    return asyncio.run(main())


@pytest.mark.parametrize("kind,branches,k", [("dynamic", 2, 4), ("dynamic", 3, 8), ("static", 3, 8)])
def test_greedy_draft_trees_give_the_target_only_output(tiny_lm, kind, branches, k):
    draft = close_draft(tiny_lm)
    plain = run(GenerationRequest(1, PROMPT, 32), NgramProposer(), LocalScorer(executors(tiny_lm, kind)), 0)
    chain_stats, tree_stats = Stats(), Stats()
    chain = run(GenerationRequest(1, PROMPT, 32), LocalProposer(executors(draft, kind)),
                LocalScorer(executors(tiny_lm, kind)), math.ceil(k / branches), chain_stats)
    trees = run(GenerationRequest(1, PROMPT, 32), LocalProposer(executors(draft, kind), branches=branches),
                LocalScorer(executors(tiny_lm, kind)), k, tree_stats)
    assert chain == trees == plain
    # The same chains drafted, and siblings taken where the chain was wrong: fewer rounds than the chain's
    assert tree_stats.rounds < chain_stats.rounds and tree_stats.accepted > chain_stats.accepted


def test_sampled_draft_trees_are_seeded(tiny_lm):
    draft = close_draft(tiny_lm)
    params = SamplingParams(temperature=0.8, seed=7)
    outs = [run(GenerationRequest(1, PROMPT, 24, sampling=params), LocalProposer(dynamic_executor(draft), branches=3),
                LocalScorer(dynamic_executor(tiny_lm)), 6) for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) == 24
