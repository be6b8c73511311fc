"""What the executor offers trained draft heads and token trees: a forward that also returns the hidden
states of chosen layers, and new tokens verified as a tree (each attending to the cache and its ancestors),
each against a plain forward of the model."""

import pytest
import torch

from specdec.engine.build import dynamic_executor, static_executor
from specdec.engine.executor import CacheError, Step
from specdec.engine.kv_cache import tree_depths, tree_mask

PROMPT = [5, 17, 3, 88, 41]


def full(model, ids, **kwargs):
    with torch.no_grad():
        return model(torch.tensor([ids]), **kwargs)


def test_tree_masks_and_depths():
    # two branches: 0 -> 1 -> 3 and 2 (a root of its own)
    tree = (-1, 0, -1, 1)
    assert tree_depths(tree) == [0, 1, 0, 2]
    mask = tree_mask(2, tree, "cpu").int().tolist()
    assert mask == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 0, 1]]
    with pytest.raises(ValueError, match="earlier node"):
        tree_depths((-1, 2, 0))


def _executor(model, kind: str, prefix_caching: bool = False, **kwargs):
    if kind == "dynamic":
        return dynamic_executor(model, prefix_cache_tokens=64 if prefix_caching else 0, block_size=8, **kwargs)
    return static_executor(model, kv_pool_tokens=512, block_size=8, max_context=128, max_batch=4, max_rows=8,
                           min_window=16, compile="off", prefix_caching=prefix_caching, **kwargs)


KINDS = ["dynamic", "static"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_tree_scores_every_node_as_a_forward_of_its_own_branch_would(tiny_lm, kind):
    """Nodes a -> b, c -> d -> e (two branches after the cached prompt): each node's logits are those of the
    prompt followed by its path; a tree that is a chain gives the chain's logits."""
    lm = _executor(tiny_lm, kind)
    lm.extend(1, 0, PROMPT, 1)
    a, b, c, d, e = 7, 9, 11, 13, 15
    (logits,) = lm.extend_many([Step(1, len(PROMPT), [a, b, c, d, e], num_logits=5, tree=(-1, 0, -1, 2, 3))])
    for node, path in enumerate([[a], [a, b], [c], [c, d], [c, d, e]]):
        expected = full(tiny_lm, PROMPT + path).logits[0, -1]
        assert torch.allclose(logits[node], expected, atol=1e-10), node
    chain = _executor(tiny_lm, kind)
    chain.extend(1, 0, PROMPT, 1)
    (as_tree,) = lm.extend_many([Step(1, len(PROMPT), [a, b, c], num_logits=3, tree=(-1, 0, 1))])
    assert torch.allclose(as_tree, chain.extend(1, len(PROMPT), [a, b, c], 3), atol=1e-10)


# Three sequences of different lengths in one forward: two trees of different shapes and a chain.
BATCH = [
    (1, [5, 17, 3, 88, 41], [7, 9, 11, 13, 15, 19], (-1, 0, -1, 2, 2, 1)),
    (2, [60, 2, 44, 9, 9, 30, 71, 12, 3, 50, 8], [21, 22, 23], (-1, -1, 1)),
    (3, [33, 34], [40, 41], None),
]


def _paths(ids, tree):
    out = []
    for node in range(len(ids)):
        path, at = [], node
        while at >= 0:
            path.append(ids[at])
            at = tree[at]
        out.append(path[::-1])
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_trees_of_several_sequences_in_one_forward_match_each_branch_run_alone(tiny_lm, kind):
    lm = _executor(tiny_lm, kind)
    lm.extend_many([Step(seq, 0, prompt, 1) for seq, prompt, _, _ in BATCH])
    out = lm.extend_many([Step(seq, len(prompt), ids, num_logits=len(ids), tree=tree)
                          for seq, prompt, ids, tree in BATCH])
    for (seq, prompt, ids, tree), logits in zip(BATCH, out):
        paths = _paths(ids, tree) if tree else [ids[:j + 1] for j in range(len(ids))]
        for node, path in enumerate(paths):
            assert torch.allclose(logits[node], full(tiny_lm, prompt + path).logits[0, -1], atol=1e-10), (seq, node)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_after_accepting_a_branch_the_cache_is_the_chains(tiny_lm, kind, prefix_caching):
    """A tree verified, a branch that is not the first accepted (`Step.path`), then steps go on: every
    later logit equals the plain forward of the prompt, the accepted tokens and what follows; a rollback
    within the path (keep < its end) too; and a second tree after the first."""
    lm = _executor(tiny_lm, kind, prefix_caching)
    prompt = [5, 17, 3, 88, 41, 60, 2, 44, 9]  # more than a block of 8: prefix caching keys one
    lm.extend(1, 0, prompt, 1)
    ids, tree = [7, 9, 11, 13, 15, 19], (-1, 0, -1, 2, 2, 1)
    lm.extend_many([Step(1, len(prompt), ids, num_logits=len(ids), tree=tree)])
    accepted = [11, 15]  # nodes 2 -> 4
    (logits,) = lm.extend_many([Step(1, len(prompt) + 2, [23, 24], num_logits=2, path=(2, 4))])
    reference = full(tiny_lm, prompt + accepted + [23, 24]).logits[0, -2:]
    assert torch.allclose(logits, reference, atol=1e-10)
    # A second tree, of which only the root's second child's first node is kept, and rolled back within.
    so_far = prompt + accepted + [23, 24]
    lm.extend_many([Step(1, len(so_far), [30, 31, 32], num_logits=3, tree=(-1, -1, 1))])
    (logits,) = lm.extend_many([Step(1, len(so_far) + 1, [40], num_logits=1, path=(1, 2))])
    assert torch.allclose(logits[0], full(tiny_lm, so_far + [31, 40]).logits[0, -1], atol=1e-10)
    if prefix_caching:  # the accepted tokens are known to the host: a new prompt finds their blocks
        assert lm.sequences[1].tokens[:len(so_far) + 2] == so_far + [31, 40]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_trees_and_paths_are_refused_naming_them(tiny_lm, kind):
    lm = _executor(tiny_lm, kind)
    (error,) = lm.extend_many([Step(1, 0, [1, 2, 3], num_logits=1, tree=(-1, 2, 0))])
    assert isinstance(error, CacheError) and "tree" in str(error) and 1 not in lm.sequences
    lm.extend(1, 0, PROMPT, 1)
    (error,) = lm.extend_many([Step(1, len(PROMPT), [1], 1, path=(0,))])
    assert isinstance(error, CacheError) and "was not a tree" in str(error)
    lm.extend_many([Step(1, len(PROMPT), [1, 2, 3], num_logits=3, tree=(-1, -1, 0))])
    for path, keep, message in (((1, 2), len(PROMPT) + 2, "not a path"), ((2,), len(PROMPT) + 1, "not a path"),
                                ((0, 2), len(PROMPT) + 3, "exceeds")):
        (error,) = lm.extend_many([Step(1, keep, [4], 1, path=path)])
        assert isinstance(error, CacheError) and message in str(error), (path, str(error))
    if kind == "static":  # trees run in the decode buckets: at most max_rows nodes after a leading chain
        (error,) = lm.extend_many([Step(2, 0, list(range(9)), 1, tree=(-1,) * 9)])
        assert isinstance(error, CacheError) and "exceeds" in str(error) and "8" in str(error)
        # a prompt of 12 tokens, then 5 candidates under its last one: the prompt runs as a chain first
        tree = tuple(range(-1, 11)) + (11, 11, 12, 12, 13)
        ids = PROMPT + [30, 31, 32, 33, 34, 35, 36] + [7, 9, 11, 13, 15]
        (logits,) = lm.extend_many([Step(3, 0, ids, 6, tree=tree)])
        assert torch.allclose(logits[3], full(tiny_lm, ids[:12] + [7, 11]).logits[0, -1], atol=1e-10)
        (logits,) = lm.extend_many([Step(3, 14, [40], 1, path=tuple(range(12)) + (12, 15))])
        assert torch.allclose(logits[0], full(tiny_lm, ids[:12] + [7, 13, 40]).logits[0, -1], atol=1e-10)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_hidden_states_of_chosen_layers_come_with_the_logits(tiny_lm, kind):
    """With hidden_layers, each step also gets the residual stream after those layers (in the order asked)
    at every position it ran (a trained head reads every one): transformers' own hidden_states, in both
    executors, prompts and steps, two sequences in one forward."""
    layers = (1, 0)
    build = dynamic_executor if kind == "dynamic" else lambda model, **kw: static_executor(
        model, kv_pool_tokens=256, block_size=8, max_context=128, max_batch=2, max_rows=5, min_window=16,
        compile="off", **kw)
    lm = build(tiny_lm, hidden_layers=layers)
    other = [30, 31, 32]
    first = lm.extend_many([Step(1, 0, PROMPT, num_logits=2), Step(2, 0, other, num_logits=1)], with_hidden=True)
    second = lm.extend_many([Step(1, len(PROMPT), [7, 9], num_logits=2)], with_hidden=True)
    for (logits, hidden), ids, n, ran in ((first[0], PROMPT, 2, len(PROMPT)), (first[1], other, 1, 3),
                                          (second[0], PROMPT + [7, 9], 2, 2)):
        reference = full(tiny_lm, ids, output_hidden_states=True)
        assert hidden.shape == (ran, 2, 32)
        assert torch.allclose(logits, reference.logits[0, -n:], atol=1e-10)
        for column, layer in enumerate(layers):
            assert torch.allclose(hidden[:, column], reference.hidden_states[layer + 1][0, -ran:], atol=1e-10)
    plain = lm.extend_many([Step(3, 0, [1, 2], 1), Step(4, 0, [1, 2], 0)])  # without with_hidden: logits alone
    assert [tuple(logits.shape) for logits in plain] == [(1, 97), (0, 97)]


def test_hidden_states_need_configured_layers(tiny_lm):
    with pytest.raises(ValueError, match="hidden_layers"):
        dynamic_executor(tiny_lm).extend_many([Step(1, 0, [1], 1)], with_hidden=True)
    with pytest.raises(ValueError, match=r"within \[0, 2\)"):
        dynamic_executor(tiny_lm, hidden_layers=(2,))
