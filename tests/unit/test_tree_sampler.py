"""The accept/reject rule over token trees: greedy cases exactly; sampling against the target's exact joint
distribution (chi-square), with planted bugs the same test must catch."""

import pytest
import torch

from specdec.decoding.rejection_sampler import rejection_sample
from specdec.decoding.sampling import SamplingParams, logits_to_probs
from specdec.decoding.tree_sampler import (DETERMINISTIC, SAMPLED, TreeVerdict, children, depths, draw_children,
                                           greedy_tree_verify, path_to, tree_rejection_sample)

from .stats import chi_square_rejects, exact_joint

# A tree of 6 nodes:          root
#                          /   |    \
#                    0:a=5   1:b=6   2:c=7
#                     |        |  \
#                  3:d=8    4:e=9  5:f=5
TOKENS = [5, 6, 7, 8, 9, 5]
PARENTS = [-1, -1, -1, 0, 1, 1]


def test_tree_helpers():
    assert children(PARENTS) == [[0, 1, 2], [3], [4, 5], [], [], [], []]
    assert depths(PARENTS) == [0, 0, 0, 1, 1, 1]
    assert path_to(PARENTS, 5) == [1, 5] and path_to(PARENTS, -1) == []


@pytest.mark.parametrize("argmax, path, nxt", [
    # rows: root, after 0..5
    ([6, 0, 5, 0, 0, 0, 3], (1, 5), 3),  # the second branch, then its second child: bonus after the leaf
    ([6, 0, 9, 0, 0, 4, 0], (1, 4), 4),
    ([5, 8, 0, 0, 2, 0, 0], (0, 3), 2),  # the first branch to its leaf
    ([7, 0, 0, 1, 0, 0, 0], (2,), 1),  # a leaf at depth 0: the bonus from its row
    ([4, 0, 0, 0, 0, 0, 0], (), 4),  # no child matches: the target's token at the root
    ([6, 0, 1, 0, 0, 0, 0], (1,), 1),  # node 1 matches, none of its children does
])
def test_greedy_tree_verify(argmax, path, nxt):
    assert greedy_tree_verify(TOKENS, PARENTS, argmax) == TreeVerdict(path, nxt)
    assert greedy_tree_verify(torch.tensor(TOKENS), PARENTS, torch.tensor(argmax)) == TreeVerdict(path, nxt)


def test_a_chain_is_the_chain_rule():
    assert greedy_tree_verify([3, 4], [-1, 0], [3, 4, 9]) == TreeVerdict((0, 1), 9)
    assert greedy_tree_verify([3, 4], [-1, 0], [3, 5, 9]) == TreeVerdict((0,), 5)
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        k, vocab = 3, 6
        target = torch.rand(k + 1, vocab, generator=g).softmax(-1)
        draft = torch.rand(k + 1, vocab, generator=g).softmax(-1)
        drafted = [int(torch.multinomial(draft[i], 1, generator=g)) for i in range(k)]
        uniforms = torch.rand(k, generator=g)
        seed = int(torch.randint(0, 1 << 30, (1,), generator=g))
        chain = rejection_sample(torch.tensor(drafted), draft[:k], target, uniforms, torch.Generator().manual_seed(seed))
        tree = tree_rejection_sample(drafted, [-1, 0, 1], target, uniforms, SAMPLED, draft,
                                     torch.Generator().manual_seed(seed))
        assert (len(tree.path), tree.next_token) == (chain.num_accepted, chain.next_token)


def test_bad_trees_and_arguments_are_refused():
    with pytest.raises(ValueError, match="parent"):
        greedy_tree_verify([1, 2], [-1, 1], [0, 0, 0])
    with pytest.raises(ValueError, match="target rows"):
        greedy_tree_verify([1, 2], [-1, 0], [0, 0])
    probs = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="draft_probs"):
        tree_rejection_sample([1, 2], [-1, -1], probs, torch.rand(2), SAMPLED)
    with pytest.raises(ValueError, match="proposal"):
        tree_rejection_sample([1, 2], [-1, -1], probs, torch.rand(2), "eagle")


def test_a_certain_target_accepts_its_token_wherever_it_is_among_siblings():
    target = torch.zeros(4, 5)
    target[0, 3] = 1  # root: token 3 for sure
    target[1:, 0] = 1
    verdict = tree_rejection_sample([1, 2, 3], [-1, -1, -1], target, torch.full((3,), 0.999), DETERMINISTIC)
    assert verdict == TreeVerdict((2,), 0)
    verdict = tree_rejection_sample([1, 2], [-1, -1], target[:3], torch.full((2,), 0.0), DETERMINISTIC)
    assert verdict == TreeVerdict((), 3)  # both rejected (no mass): the draw from what is left


# ---- the joint distribution of whole rounds, against planted bugs ------------------------------------
# A context-dependent pair over V = 5 (as in test_rejection_sampler: rows depend on the first 4 tokens of
# the prefix), peaked, with top-k / top-p zeros. Each round drafts a tree of depth 3 (2 children at the
# root, 2 under the first of them, 1 under every other node: 2 + 4 + 4 = up to 10 nodes) and runs until 4
# tokens are out; the empirical joint of those 4 is compared with the target's exact joint (chi-square at
# significance 1e-3).
V, DEPTH, OUT, ROUNDS = 5, 3, 4, 6_000


def _tables() -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(11)
    prefixes = [()]
    for _ in range(OUT):
        prefixes += [p + (v,) for p in prefixes if len(p) == len(prefixes[-1]) for v in range(V)]
    target, draft = {}, {}
    for prefix in prefixes:
        logits = 3 * torch.randn(V, generator=g)
        target[prefix] = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
        draft[prefix] = logits_to_probs(logits + 1.5 * torch.randn(V, generator=g), SamplingParams(temperature=1.0, top_p=0.9))
    return target, draft


TARGET, DRAFT = _tables()


def _row(table: dict, prefix: tuple) -> torch.Tensor:
    return table[prefix[:OUT]]


def _draft_tree(out: tuple, proposal: str, g: torch.Generator) -> tuple[list[int], list[int]]:
    """Children of the root: 2; of a depth-0 node: 2 if it is the first child, else 1; deeper: 1."""
    tokens, parents = [], []
    frontier = [(-1, ())]  # (node, its tokens from the root)
    for depth in range(DEPTH):
        nxt = []
        for rank, (node, prefix) in enumerate(frontier):
            count = 2 if depth == 0 or (depth == 1 and rank == 0) else 1
            q = _row(DRAFT, out + prefix)
            picked = draw_children(q, count, g) if proposal == SAMPLED else q.topk(count).indices.tolist()
            for token in picked:
                tokens.append(token)
                parents.append(node)
                nxt.append((len(tokens) - 1, prefix + (token,)))
        frontier = nxt
    return tokens, parents


def _sample_joint(rule, proposal: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V ** OUT)
    for _ in range(ROUNDS):
        out: tuple[int, ...] = ()
        while len(out) < OUT:
            tokens, parents = _draft_tree(out, proposal, g)
            prefixes = [()] + [tuple(tokens[j] for j in path_to(parents, i)) for i in range(len(tokens))]
            target = torch.stack([_row(TARGET, out + prefix) for prefix in prefixes])
            draft = torch.stack([_row(DRAFT, out + prefix) for prefix in prefixes])
            verdict = rule(tokens, parents, target, torch.rand(len(tokens), generator=g), proposal, draft, g)
            out += tuple(tokens[i] for i in verdict.path) + (verdict.next_token,)
        index = 0
        for token in out[:OUT]:
            index = index * V + token
        counts[index] += 1
    return counts


def _eagle_rule(tokens, parents, target, uniforms, proposal, draft, g):
    """Planted: each child accepted with probability p(x) of its parent's unchanged target row (no residual
    between siblings); after all are rejected, the draw from the row without the tried tokens."""
    below, node, path = children(parents), -1, []
    while True:
        p = target[node + 1].clone()
        nxt = next((c for c in below[node + 1] if float(uniforms[c]) < float(target[node + 1][tokens[c]])), None)
        if nxt is None:
            for c in below[node + 1]:
                p[tokens[c]] = 0
            p = p / p.sum() if float(p.sum()) > 0 else target[node + 1]
            return TreeVerdict(tuple(path), int(torch.multinomial(p, 1, generator=g)))
        path.append(nxt)
        node = nxt


def _unchanged_q(tokens, parents, target, uniforms, proposal, draft, g):
    """Planted: siblings drawn without replacement but verified as if each came from the unchanged q."""
    below, node, path = children(parents), -1, []
    while True:
        p, q = target[node + 1], draft[node + 1]
        nxt = None
        for c in below[node + 1]:
            if float(uniforms[c]) * float(q[tokens[c]]) < float(p[tokens[c]]):
                nxt = c
                break
            p = (p - q).clamp_min(0)
            p = p / p.sum() if float(p.sum()) > 0 else target[node + 1]
        if nxt is None:
            return TreeVerdict(tuple(path), int(torch.multinomial(p, 1, generator=g)))
        path.append(nxt)
        node = nxt


def _draft_ratio_for_top_k(tokens, parents, target, uniforms, proposal, draft, g):
    """Planted: top-k (deterministic) children verified with the sampled rule's p / q."""
    return tree_rejection_sample(tokens, parents, target, uniforms, SAMPLED, draft, g)


def _rule(tokens, parents, target, uniforms, proposal, draft, g):
    return tree_rejection_sample(tokens, parents, target, uniforms, proposal, draft if proposal == SAMPLED else None, g)


@pytest.mark.parametrize("proposal", [DETERMINISTIC, SAMPLED])
def test_tree_rounds_give_exactly_the_targets_joint_distribution(proposal):
    assert not chi_square_rejects(_sample_joint(_rule, proposal, seed=0), exact_joint(TARGET, V, OUT))


@pytest.mark.parametrize("planted, proposal", [(_eagle_rule, DETERMINISTIC), (_eagle_rule, SAMPLED),
                                               (_unchanged_q, SAMPLED), (_draft_ratio_for_top_k, DETERMINISTIC)])
def test_the_tree_joint_test_catches_planted_bugs(planted, proposal):
    assert chi_square_rejects(_sample_joint(planted, proposal, seed=0), exact_joint(TARGET, V, OUT))
