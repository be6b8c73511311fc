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


def test_a_tree_scores_every_node_as_a_forward_of_its_own_branch_would(tiny_lm):
    """Nodes a -> b, c -> d -> e (two branches after the cached prompt): each node's logits are those of the
    prompt followed by its path; a tree that is a chain gives the chain's logits."""
    lm = dynamic_executor(tiny_lm)
    lm.extend(1, 0, PROMPT, 1)
    a, b, c, d, e = 7, 9, 11, 13, 15
    (logits,) = lm.extend_many([Step(1, len(PROMPT), [a, b, c, d, e], num_logits=5, tree=(-1, 0, -1, 2, 3))])
    for node, path in enumerate([[a], [a, b], [c], [c, d], [c, d, e]]):
        expected = full(tiny_lm, PROMPT + path).logits[0, -1]
        assert torch.allclose(logits[node], expected, atol=1e-10), node
    chain = dynamic_executor(tiny_lm)
    chain.extend(1, 0, PROMPT, 1)
    (as_tree,) = lm.extend_many([Step(1, len(PROMPT), [a, b, c], num_logits=3, tree=(-1, 0, 1))])
    assert torch.allclose(as_tree, chain.extend(1, len(PROMPT), [a, b, c], 3), atol=1e-10)


def test_a_bad_tree_is_refused_naming_it_and_the_static_forward_refuses_trees(tiny_lm):
    lm = dynamic_executor(tiny_lm)
    (error,) = lm.extend_many([Step(1, 0, [1, 2, 3], num_logits=1, tree=(-1, 2, 0))])
    assert isinstance(error, CacheError) and "tree" in str(error) and 1 not in lm.sequences
    paged = static_executor(tiny_lm, kv_pool_tokens=256, block_size=8, max_context=128, max_batch=2, max_rows=5,
                            min_window=16, compile="off", prefix_caching=False)
    (error,) = paged.extend_many([Step(1, 0, [1, 2], num_logits=2, tree=(-1, -1))])
    assert isinstance(error, CacheError) and "chains only" in str(error)


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
