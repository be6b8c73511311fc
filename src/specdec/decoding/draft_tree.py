"""A draft model's proposal as a token tree: its drafted chain and, beside the chain's first tokens, the
draft's other candidates for the same position (EAGLE's top-k trees, without extra draft forwards).

The chain is drafted as always (one forward per token); at each position the same forward's distribution
also gives the next candidates: the most likely after the drafted token (greedy), or tokens drawn without
replacement after it (sampling, which tree_sampler's SAMPLED rule verifies exactly). They are leaves: the
target verifies every node in one forward, and a round whose chain fails at position d can still take the
target's token there when it is one of the siblings. Within a budget of nodes the chain takes
ceil(budget / branches) and siblings fill the rest from the first position on (where a rejection is most
likely to end the round early).
"""

from __future__ import annotations


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
