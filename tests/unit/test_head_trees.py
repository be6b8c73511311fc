"""Token trees from trained heads (EAGLE-2's dynamic trees, draft_tree.best_first_tree; Step.branches > 1 on a
HeadExecutor): the search against an exhaustive one, each node's children scored by the head as if it had
drafted that node's path as a chain (float64), the target's features handed to the head along the accepted
path (its cache equal to a fresh pass after rounds that took a non-first branch), greedy output equal to
target-only for every kind and both executors, and sampled output in the target's distribution."""

import asyncio
import copy
import math

import pytest
import torch

from specdec.decoding.draft_length import DraftLengthPolicy
from specdec.decoding.draft_tree import best_first_tree
from specdec.decoding.loop import GenerationRequest, Stats, generate
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.tree_sampler import children
from specdec.engine.build import dynamic_executor
from specdec.engine.draft_heads import EAGLE, EAGLE3, KINDS, MEDUSA, MLP, HeadCache, random_head, target_tensors
from specdec.engine.head_executor import HeadExecutor
from specdec.engine.interfaces import Step
from specdec.engine.local import LocalProposer, LocalScorer

from .conftest import run_fixed_k_many
from .stats import chi_square_rejects
from .test_draft_heads import AUX, LAYERED, PROMPT, _marginals, head_for, pair, reference_greedy


# ---- the search -----------------------------------------------------------------------------------------
def fake_draft(vocab=7, seed=0):
    """log-probabilities of a path's next token, a fixed function of the path (what a draft computes)."""
    def next_scores(path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((seed,) + path) % 2**31)
        return torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 2.5, -1)
    return next_scores


def exhaustive(next_scores, budget, branches, depth):
    """Every candidate of the same search (levels of `branches` best nodes, each expanded into its
    `branches` best children), no pruning; the `budget` best paths."""
    level = [((t,), s) for s, t in zip(*[x.tolist() for x in next_scores(()).topk(branches)])]
    everything = list(level)
    for _ in range(1, depth):
        best = sorted(level, key=lambda c: -c[1])[:branches]
        level = []
        for path, score in best:
            top = next_scores(path).topk(branches)
            level += [(path + (t,), score + s) for s, t in zip(top.values.tolist(), top.indices.tolist())]
        everything += level
    return {path for path, _ in sorted(everything, key=lambda c: (-c[1], len(c[0])))[:budget]}


def paths_of(tokens, parents):
    out = []
    for node, parent in enumerate(parents):
        out.append((out[parent] if parent >= 0 else ()) + (tokens[node],))
    return out


@pytest.mark.parametrize("budget,branches,depth", [(4, 2, 4), (8, 3, 8), (10, 4, 3), (6, 1, 6), (16, 4, 16)])
@pytest.mark.parametrize("seed", range(4))
def test_the_tree_holds_the_likeliest_paths_of_the_search(budget, branches, depth, seed):
    next_scores = fake_draft(seed=seed)
    calls = []
    ids = {}

    def expand(nodes, parents, tokens):
        calls.append(len(nodes))
        rows = []
        for node, parent, token in zip(nodes, parents, tokens):
            ids[node] = (ids[parent] if parent >= 0 else ()) + (token,)
            rows.append(next_scores(ids[node]))
        return torch.stack(rows)

    tokens, parents = best_first_tree(next_scores(()), expand, budget, branches, depth)
    assert len(tokens) == budget
    assert all(-1 <= p < i for i, p in enumerate(parents))  # topological
    assert set(paths_of(tokens, parents)) == exhaustive(next_scores, budget, branches, depth)
    assert len(calls) <= depth - 1 and max(calls, default=0) <= branches  # one draft call per level, at most B rows
    # Each node's first child is its likeliest
    scores = {path: sum(next_scores(path[:i])[path[i]].item() for i in range(len(path)))
              for path in paths_of(tokens, parents)}
    paths = paths_of(tokens, parents)
    for row in children(parents):
        assert [scores[paths[c]] for c in row] == sorted((scores[paths[c]] for c in row), reverse=True)


def test_one_wide_is_the_greedy_chain_and_the_stop_cuts_depth():
    next_scores = fake_draft(seed=5)
    tokens, parents = best_first_tree(next_scores(()), _chain_expand(next_scores), 5, 1, 5)
    assert parents == (-1, 0, 1, 2, 3)
    path = ()
    for token in tokens:
        assert token == int(next_scores(path).argmax())
        path += (token,)
    # stop_below: a level is expanded only while its best path is at least that likely
    unstopped: list = []
    best_first_tree(next_scores(()), _chain_expand(next_scores, unstopped), 8, 2, 8)
    for stop in (0.02, 0.1, 0.3, 0.9):
        seen = []
        expand = _chain_expand(next_scores, seen)
        _, parents = best_first_tree(next_scores(()), expand, 8, 2, 8, stop_below=stop)
        best = [max(sum(next_scores(p[:i])[p[i]].item() for i in range(len(p))) for p in level) for level in seen]
        assert all(math.exp(b) >= stop for b in best)
        assert max(_depths(parents)) <= len(seen) <= len(unstopped)
    assert len(seen) < len(unstopped)  # the strictest stop cut the search short


def _chain_expand(next_scores, seen=None):
    """An expand over a fake draft; `seen` collects each call's node paths."""
    ids = {}

    def expand(nodes, parents, tokens):
        rows = []
        for node, parent, token in zip(nodes, parents, tokens):
            ids[node] = (ids[parent] if parent >= 0 else ()) + (token,)
            rows.append(next_scores(ids[node]))
        if seen is not None:
            seen.append([ids[node] for node in nodes])
        return torch.stack(rows)
    return expand


def _depths(parents):
    out = []
    for parent in parents:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out


# ---- a head's tree ----------------------------------------------------------------------------------------
def features_of(tiny_lm, head, ids):
    layers = head.config.feature_layers(tiny_lm.config.num_hidden_layers)
    with torch.no_grad():
        out = tiny_lm(torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[layer + 1][0] for layer in layers], dim=-1)


@pytest.mark.parametrize("kind", [*KINDS, LAYERED])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=20)], ids=["greedy", "sampled"])
def test_each_node_is_scored_as_the_head_would_draft_its_path(tiny_lm, kind, params):
    """The executor's tree (its levels run together under a tree mask) equals the search run with a
    reference that drafts every node's path as a chain on a fresh cache."""
    head = head_for(tiny_lm, kind, seed=2)
    if kind == MLP:  # peaked stages: a tree deep enough that nodes expand from their parents' states
        with torch.no_grad():
            for stage in head.head:
                stage.weight.mul_(12)
    features = features_of(tiny_lm, head, PROMPT)[:-1]
    executor = HeadExecutor(head)
    (tree,) = executor.propose_many([Step(1, 0, PROMPT, k=9, branches=3, params=params, features=features)])
    if kind == MLP:
        assert any(parent >= 0 and tree.parents[parent] >= 0 for parent in tree.parents), tree.parents
    seq = executor.sequences[1]
    assert seq.entries == len(PROMPT) - 1  # drafts dropped (Medusa and MLP speculators keep no cache)
    assert seq.cache.length == (0 if kind in (MEDUSA, MLP) else seq.entries)
    scores = HeadExecutor._scores

    with torch.no_grad():
        if kind == MEDUSA:
            logits = head(features[-1], head.config.medusa_heads)
            root = scores(logits[0], params)

            def chain_scores(path):
                return scores(logits[len(path)], params)
        elif kind == MLP:
            def chain_scores(path):  # its stages from the start along the path, the last prompt token first
                state, out = head.stage(0, head.start(features[-1:]), torch.tensor([PROMPT[-1]]))
                for i, token in enumerate(path):
                    state, out = head.stage(i + 1, state, torch.tensor([token]))
                return scores(out[0], params)
            root = chain_scores(())
        else:
            cache = HeadCache()
            hidden, logits = head(torch.tensor(PROMPT[1:]), head.from_target(features), cache, 0)
            root = scores(logits[-1], params)

            def chain_scores(path):
                fresh = HeadCache()
                h, _ = head(torch.tensor(PROMPT[1:]), head.from_target(features), fresh, 0)
                h = h[-1:]
                for i, token in enumerate(path):
                    h, out = head(torch.tensor([token]), h, fresh, len(PROMPT) - 1 + i)
                return scores(out[-1], params)
        depth = {MEDUSA: head.config.medusa_heads, MLP: head.config.mlp_stages}.get(kind, 9)
        expected = best_first_tree(root, _chain_expand(chain_scores), 9, 3, depth)
    assert (tree.tokens, tree.parents) == (list(expected[0]), expected[1]) and tree.probs is None
    assert len(tree.tokens) == 9 and tree.cached_length == len(PROMPT) - 1


class Recording:
    """A proposer that keeps every proposal (to find rounds whose accepted path left the first branch)."""

    def __init__(self, inner):
        self.inner, self.proposals = inner, []
        self.wants_features, self.branches = inner.wants_features, inner.branches

    async def propose(self, *args, **kwargs):
        proposal = await self.inner.propose(*args, **kwargs)
        self.proposals.append(proposal)
        return proposal

    async def release(self, seq_id):
        await self.inner.release(seq_id)


def run(req, proposer, scorer, k, stats=None, rounds_out=None):
    async def main():
        out = []
        async for rnd in generate(req, proposer, scorer, DraftLengthPolicy.fixed(k, branches=proposer.branches), stats):
            out += rnd.new_tokens
            if rounds_out is not None:
                rounds_out.append(rnd)
        return out
    return asyncio.run(main())


@pytest.mark.parametrize("executor", ["dynamic", "static"])
@pytest.mark.parametrize("kind", [*KINDS, LAYERED])
def test_greedy_head_trees_give_the_target_only_output(tiny_lm, kind, executor):
    expected = reference_greedy(tiny_lm, PROMPT, 40)
    proposer, scorer = pair(tiny_lm, kind, executor=executor)
    proposer.branches = 3
    stats, rounds = Stats(), []
    # 5 nodes: with the round's one token the target lacks, the static executor's 6 rows
    assert run(GenerationRequest(seq_id=4, prompt_ids=PROMPT, max_tokens=40), proposer, scorer, 5, stats,
               rounds) == expected
    assert any(r.depth is not None for r in rounds)  # trees were verified
    assert not proposer.lm.sequences


def test_the_head_reads_the_features_of_the_accepted_path(tiny_lm):
    """Rounds that accept a sibling (not the tree's first branch): afterwards the head's cache equals one
    pass of the head over the target's features of prompt + output (a row of a rejected node read as the
    accepted one's would differ)."""
    for seed in range(12):
        head = head_for(tiny_lm, EAGLE, seed=seed)
        target_layers = head.config.feature_layers(2)
        executor = HeadExecutor(head)
        proposer = Recording(LocalProposer(executor, branches=4))
        scorer = LocalScorer(dynamic_executor(tiny_lm, hidden_layers=target_layers))
        rounds: list = []

        async def main():
            tokens = []
            async for rnd in generate(GenerationRequest(seq_id=3, prompt_ids=PROMPT, max_tokens=48), proposer,
                                      scorer, DraftLengthPolicy.fixed(8, branches=proposer.branches)):
                tokens += rnd.new_tokens
                rounds.append(rnd)
                if len(tokens) >= 40:
                    cache = executor.sequences[3].cache
                    return tokens, cache.keys[:, :cache.length].clone(), cache.length
        tokens, keys, entries = asyncio.run(main())
        off_branch = 0
        for proposal, rnd in zip(proposer.proposals, rounds):
            if proposal.parents is None or not rnd.num_accepted:
                continue
            first = children(proposal.parents)
            node, branch = -1, []
            while first[node + 1]:
                node = first[node + 1][0]
                branch.append(proposal.tokens[node])
            off_branch += rnd.new_tokens[:rnd.num_accepted] != branch[:rnd.num_accepted]
        if off_branch:
            break
    assert off_branch, "no seed gave a round that accepted a sibling"
    ids = PROMPT + tokens
    with torch.no_grad():
        hidden = tiny_lm(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        fresh = HeadCache()
        head(torch.tensor(ids[1:entries + 1]), hidden[:entries], fresh, 0)
    assert torch.allclose(keys, fresh.keys[:, :entries], atol=1e-9)


@pytest.fixture(scope="module")
def peaked_lm(tiny_lm):
    """The tiny target with most of its mass on tokens 0-7 (the other rows of its head shrunk): heads whose
    draft vocabulary is those 8 tokens propose what the target may sample, so a rule that mishandles a
    rejected candidate shows in the output's distribution."""
    lm = copy.deepcopy(tiny_lm)
    with torch.no_grad():
        lm.lm_head.weight[8:] *= 0.1
    return lm


@pytest.mark.parametrize("kind", [EAGLE3, MEDUSA])
def test_sampled_head_trees_follow_the_targets_distribution(peaked_lm, kind):
    """Tokens 2 and 3 (the first round a head drafts in: a tree of 2 nodes, 2 wide) of 800 seeded
    generations against the target's exact marginals (chi-square at 1e-3); the tree is a deterministic
    choice verified by point masses (tree_sampler). The head drafts among the 8 tokens holding most of
    the target's mass (EAGLE-3: its draft vocabulary; Medusa: its heads' other rows zeroed), so its
    candidates are often taken: a rule that keeps a rejected candidate's mass fails here (checked)."""
    temperature = 1.0
    p2, p3 = _marginals(peaked_lm, PROMPT, temperature)
    if kind == EAGLE3:
        head = random_head(EAGLE3, peaked_lm.config, seed=3, aux_layers=AUX, draft_vocab_size=8).to(torch.float64)
        head.attach(*target_tensors(peaked_lm))
    else:
        head = head_for(peaked_lm, kind, seed=3)
        with torch.no_grad():
            for medusa in head.heads:
                medusa[-1].weight[8:] = 0
                medusa[-1].weight[:8] *= 20
    layers = head.config.feature_layers(peaked_lm.config.num_hidden_layers)
    proposer = LocalProposer(HeadExecutor(head), branches=2)
    scorer = LocalScorer(dynamic_executor(peaked_lm, hidden_layers=layers))
    counts = torch.zeros(2, len(p2), dtype=torch.float64)
    stats = Stats()
    requests = [GenerationRequest(seq_id=100 + seed, prompt_ids=PROMPT, max_tokens=4,
                                  sampling=SamplingParams(temperature=temperature, seed=seed)) for seed in range(800)]
    for out in run_fixed_k_many(requests, proposer, scorer, 4, branches=proposer.branches, stats=stats):
        counts[0, out[1]] += 1
        counts[1, out[2]] += 1
    assert stats.accepted >= 100  # the trees' candidates were taken often: a wrong rule would show
    assert not chi_square_rejects(counts[0], p2) and not chi_square_rejects(counts[1], p3)
