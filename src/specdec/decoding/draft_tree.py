"""A model draft's proposal as a token tree, two ways.

`top_k_tree` (draft models): the drafted chain and, beside the chain's first tokens, the draft's other
candidates for the same position (EAGLE's top-k trees, without extra draft forwards).

The chain is drafted as always (one forward per token); at each position the same forward's distribution
also gives the next candidates: the most likely after the drafted token (greedy), or tokens drawn without
replacement after it (sampling, which tree_sampler's SAMPLED rule verifies exactly). They are leaves: the
target verifies every node in one forward, and a round whose chain fails at position d can still take the
target's token there when it is one of the siblings. Within a budget of nodes the chain takes
ceil(budget / branches) and siblings fill the rest from the first position on (where a rejection is most
likely to end the round early).

`best_first_tree` (trained heads, whose step is cheap and reads its own output): EAGLE-2's dynamic tree,
a search that runs the draft once per depth over that depth's likeliest nodes and keeps the budget's
likeliest paths of all it found.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


def chain_depth(budget: int, branches: int) -> int:
    """How many tokens the draft runs for a tree of at most `budget` nodes of `branches` candidates per
    position (1: a chain of `budget`)."""
    return budget if branches <= 1 else max(1, -(-budget // branches))


def top_k_tree(chain: list[int], alternatives: list[list[int]], budget: int) -> tuple[list[int], tuple[int, ...], list[int]]:
    """The tree of `chain` (drafted tokens) with alternatives[d], the other candidates at position d (most
    likely or first drawn first), as siblings of chain[d], at most `budget` nodes.

    Returns (tokens, parents, chain_of): parents[i] the index of token i's parent (-1: the root), and
    chain_of[i] = d where token i is chain[d], else -1. Each node's first child is the chain's next token,
    so the chain is the tree's first branch (what a proposer's cache holds)."""
    room = max(budget - len(chain), 0)
    tokens: list[int] = []
    parents: list[int] = []
    chain_of: list[int] = []
    parent = -1
    for d, token in enumerate(chain):
        here = len(tokens)
        tokens.append(token)
        parents.append(parent)
        chain_of.append(d)
        siblings = [t for t in (alternatives[d] if d < len(alternatives) else []) if t != token][:room]
        room -= len(siblings)
        tokens += siblings
        parents += [parent] * len(siblings)
        chain_of += [-1] * len(siblings)
        parent = here
    return tokens, tuple(parents), chain_of


def best_first_tree(root: torch.Tensor, expand: Callable[[list[int], list[int], list[int]], torch.Tensor],
                    budget: int, branches: int, depth: int, stop_below: float = 0.0) -> tuple[list[int], tuple[int, ...]]:
    """EAGLE-2's dynamic tree: the `budget` most likely nodes of a search `branches` wide and `depth` deep.

    root (V,): log-probabilities of the first drafted token. Level 0 is root's `branches` most likely
    tokens; each further level expands the previous level's `branches` best nodes (by the log-probability
    of their whole path), each into its `branches` most likely children. `expand(nodes, parents, tokens)`
    gets those nodes (candidate indices: level 0 first, then each level in the order its expansions
    returned), their parents (-1: the root) and tokens, and returns their children's log-probabilities
    (len(nodes), V): the draft runs once per level, however wide. Deepening stops once the best path's
    probability falls below `stop_below` (0: never), or once no node of the level scores as high as the
    budget's last candidate (none of its descendants could enter the tree). Of every candidate, the
    `budget` with the highest path probability are the tree (a child never scores above its parent, so
    each kept node's parent is kept too).

    Returns (tokens, parents) in topological order (by depth, then by path probability: each node's
    first child is its most likely), parents[i] the index of token i's parent or -1. The choice is
    deterministic: tree_sampler's DETERMINISTIC rule verifies it exactly for sampled requests too.
    """
    width = max(1, min(branches, root.shape[-1]))
    scores, tokens = root.topk(width)
    # Candidates: token, parent candidate (-1: the root), path log-probability, depth
    cand_tokens = [t for s, t in zip(scores.tolist(), tokens.tolist()) if s > -math.inf]
    cand_scores = [s for s in scores.tolist() if s > -math.inf]
    cand_parents, cand_depths = [-1] * len(cand_tokens), [0] * len(cand_tokens)
    level = list(range(len(cand_tokens)))
    for d in range(1, max(depth, 1)):
        ranked = sorted(level, key=lambda c: -cand_scores[c])[:width]
        if len(cand_scores) >= budget:  # a node scoring below the budget's last can have no child in the tree
            floor = sorted(cand_scores, reverse=True)[budget - 1]
            ranked = [c for c in ranked if cand_scores[c] >= floor]
        if not ranked or math.exp(cand_scores[ranked[0]]) < stop_below:
            break
        child_scores, child_tokens = expand(ranked, [cand_parents[c] for c in ranked],
                                            [cand_tokens[c] for c in ranked]).topk(width, dim=-1)
        level = []
        for row, parent in enumerate(ranked):
            for score, token in zip(child_scores[row].tolist(), child_tokens[row].tolist()):
                if score == -math.inf:
                    continue  # outside the draft's vocabulary (EAGLE-3) or filtered out
                level.append(len(cand_tokens))
                cand_tokens.append(token)
                cand_parents.append(parent)
                cand_scores.append(cand_scores[parent] + score)
                cand_depths.append(d)
    order = sorted(range(len(cand_tokens)), key=lambda c: (-cand_scores[c], cand_depths[c], c))
    kept = sorted(order[:max(budget, 0)], key=lambda c: (cand_depths[c], -cand_scores[c], c))
    index = {c: i for i, c in enumerate(kept)}
    return [cand_tokens[c] for c in kept], tuple(index[cand_parents[c]] if cand_parents[c] >= 0 else -1 for c in kept)
