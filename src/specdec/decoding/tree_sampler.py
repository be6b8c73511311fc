"""Token trees: the accept/reject rule over a tree of drafted candidates, as pure functions with the
randomness passed in (the tree counterpart of `rejection_sampler`).

A tree of N drafted tokens: `tokens[i]` and `parents[i]`, the index of node i's parent (always an earlier
node) or -1 where node i follows the committed tokens (the root). The target scores every node in one
forward (each node seeing the context and its ancestors: engine/kv_cache.tree_mask), giving N + 1 rows:
row 0 after the context (the root's children are drawn from it), row i + 1 after node i.

Greedy: walk from the root, at each node moving to the child whose token is the target's argmax there;
stop where no child is, and emit the target's argmax (the correction, or the bonus after a leaf).

Sampling: recursive rejection sampling over siblings (SpecInfer, Miao et al. 2024; SpecTr). At a node
with target distribution p and children x_1..x_m, in order:
  accept x_j with probability min(1, p(x_j) / q_j(x_j)); on acceptance move to x_j and start again;
  on rejection p <- normalize(max(p - q_j, 0)) and try x_{j+1};
  after the last rejection (or at a leaf) emit a token drawn from p and stop.
q_j is the proposal x_j was drawn from, and the rule is exact (the emitted path is distributed as the
target's) when the children were drawn so:
  DETERMINISTIC  children chosen without randomness (a draft's top-k, prompt lookup's continuations,
                 Medusa's static choices): q_j is a point mass on x_j, so x_j is accepted with probability
                 p(x_j) and a rejection zeroes p(x_j). Any choice of tokens is exact, duplicates included.
  SAMPLED        children drawn one after another *without replacement* from the draft's distribution q
                 at their parent (`proposal[parent + 1]`): q_1 = q and q_{j+1} = q_j with x_j removed,
                 renormalized. Higher acceptance than point masses when the draft is close to the target.
With one child per node and SAMPLED this is exactly `rejection_sampler.rejection_sample`.

Shapes: N nodes, V vocabulary. Probabilities are processed distributions (`sampling.logits_to_probs`,
the same processing for draft and target), on any one device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.decoding.interfaces import Proposal
from specdec.decoding.sampling import sample

DETERMINISTIC, SAMPLED = "deterministic", "sampled"
PROPOSALS = (DETERMINISTIC, SAMPLED)


@dataclass(frozen=True)
class TreeVerdict:
    path: tuple[int, ...]  # the accepted nodes, root to leaf (each the parent of the next)
    next_token: int  # the target's correction or bonus token after the path


def check_tree(parents: Sequence[int]) -> None:
    """ValueError unless every node's parent is -1 or an earlier node (a tree in topological order)."""
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(f"tree: node {node}'s parent must be -1 or an earlier node, got {parent}")


def children(parents: Sequence[int]) -> list[list[int]]:
    """Row r (0: the root, i + 1: node i) lists that row's children in node order: (N + 1) lists."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        out[parent + 1].append(node)
    return out


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 0 for the root's children."""
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node` (inclusive); [] for node -1."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def greedy_tree_verify(tokens: Sequence[int], parents: Sequence[int], target_argmax: Sequence[int]) -> TreeVerdict:
    """Greedy rule: tokens, parents (N,); target_argmax (N + 1,) the target's argmax at each row (lists or
    1-D tensors). The longest root path whose every token is the target's choice, then the target's token
    after it. Siblings with the same token: the first is taken."""
    check_tree(parents)
    tokens, target = [int(t) for t in tokens], [int(t) for t in target_argmax]
    if len(target) != len(tokens) + 1 or len(parents) != len(tokens):
        raise ValueError(f"a tree of {len(tokens)} tokens needs {len(tokens)} parents and {len(tokens) + 1} "
                         f"target rows, got {len(parents)} and {len(target)}")
    below = children(parents)
    node, path = -1, []
    while True:
        wanted = target[node + 1]
        node = next((child for child in below[node + 1] if tokens[child] == wanted), None)
        if node is None:
            return TreeVerdict(tuple(path), wanted)
        path.append(node)


def tree_rejection_sample(tokens: Sequence[int], parents: Sequence[int], target_probs: torch.Tensor,
                          uniforms: torch.Tensor, proposal: str = DETERMINISTIC,
                          draft_probs: torch.Tensor | None = None,
                          generator: torch.Generator | None = None) -> TreeVerdict:
    """The lossless stochastic rule over a tree (see the module's docstring).

    tokens, parents: (N,) the tree. target_probs: (N + 1, V), row 0 after the context, row i + 1 after
    node i. uniforms: (N,) U[0, 1) draws, one per node (passed in so tests control the randomness; only
    the nodes tried use theirs). proposal: how the children were drawn, DETERMINISTIC or SAMPLED;
    draft_probs (N + 1, V), SAMPLED only: row r the distribution row r's children were drawn from
    (without replacement, in node order). generator: for the final draw only.
    """
    if proposal not in PROPOSALS:
        raise ValueError(f"proposal must be one of {PROPOSALS}, got {proposal!r}")
    n = len(tokens)
    if len(parents) != n or target_probs.shape[0] != n + 1 or uniforms.shape[0] < n:
        raise ValueError(f"a tree of {n} tokens needs {n} parents, {n + 1} target rows and {n} uniforms, got "
                         f"{len(parents)}, {target_probs.shape[0]} and {uniforms.shape[0]}")
    if proposal == SAMPLED and (draft_probs is None or draft_probs.shape[0] != n + 1):
        raise ValueError(f"proposal={SAMPLED!r} needs draft_probs with {n + 1} rows (each row's children's "
                         f"distribution)")
    check_tree(parents)
    below = children(parents)
    u = uniforms.tolist()  # a handful of scalars: Python is faster than tensor ops of one element each
    node, path = -1, []
    while True:
        p = target_probs[node + 1]
        q = draft_probs[node + 1] if proposal == SAMPLED else None
        accepted = None
        for child in below[node + 1]:
            x = int(tokens[child])
            p_x = float(p[x])
            q_x = 1.0 if q is None else float(q[x])
            # Accept with probability min(1, p(x) / q(x)), written without the division (q(x) > 0 for a
            # drawn token; a token the target gives no mass is always rejected).
            if u[child] * q_x < p_x:
                accepted = child
                break
            if q is None:  # a point mass on x: the residual is p without x
                p = p.clone()
                p[x] = 0
            else:  # max(p - q, 0); the next sibling was drawn from q without x
                p = (p - q).clamp_min(0)
                q = q.clone()
                q[x] = 0
                q = q / q.sum() if float(q.sum()) > 0 else q
            total = p.sum()
            if float(total) <= 0:
                # Only through rounding when p equalled the proposal (a rejection of probability 0): what
                # the residual converges to is the target row itself.
                p = target_probs[node + 1]
            else:
                p = p / total
        if accepted is None:
            return TreeVerdict(tuple(path), int(sample(p, generator)))
        path.append(accepted)
        node = accepted


def draw_children(q: torch.Tensor, count: int, generator: torch.Generator | None = None) -> list[int]:
    """`count` distinct tokens drawn one after another without replacement from q (V,): the SAMPLED way of
    choosing a node's children (fewer if q has fewer tokens with mass)."""
    count = min(count, int((q > 0).sum()))
    if count <= 0:
        return []
    return torch.multinomial(q.float(), count, replacement=False, generator=generator).tolist()


def first_branch(proposal: Proposal) -> Proposal:
    """A tree proposal's first branch (each node's first child) as a chain: exact as a chain, since a
    first child was drawn from its parent's distribution itself (or is a point mass)."""
    if proposal.parents is None:
        return proposal
    below = children(proposal.parents)
    branch, row = [], 0
    while below[row]:
        node = below[row][0]
        branch.append((node, row))
        row = node + 1
    probs = None if proposal.probs is None else proposal.probs[[r for _, r in branch]]
    return Proposal([proposal.tokens[node] for node, _ in branch], probs, proposal.cached_length)
