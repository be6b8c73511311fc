"""An EAGLE head's step on the CPU layer kernels (head_kernels.py) against the module's own step: logits and
the cache's entries for chains and tree levels, EAGLE-1 and EAGLE-3 (three Qwen3 layers too); the draft
vocabulary's logits kept unscattered (DraftLogits) against the scattered ones; and the head executor drafting
the same with and without the kernels (chains, trees past the kernel's 64 ancestor bits, the confidence stop,
sampling)."""

import pytest
import torch

from specdec.decoding.sampling import SamplingParams, greedy, token_probability
from specdec.engine import kernels, panel_linear
from specdec.engine.draft_heads import EAGLE, EAGLE3, MTP, HeadCache, random_head, target_tensors
from specdec.engine.head_executor import HeadExecutor
from specdec.engine.head_kernels import DraftLogits, HeadKernels
from specdec.engine.interfaces import Step

CPU = kernels.cpu(torch.device("cpu"), torch.float32)
pytestmark = pytest.mark.skipif(CPU is None, reason=f"the CPU kernels did not build: {panel_linear.build().problem}")
AUX = (0, 1, 1)  # EAGLE-3's layers on a 2-layer target


LAYERED = "eagle3-layers"  # an EAGLE-3 head of three decoder layers, of Qwen3's type (per-head q/k norms)


def float_head(tiny_lm, kind, seed=0, draft_vocab=40):
    """A random float32 head; EAGLE-3's draft vocabulary the even target ids (draft id i -> target id 2i)."""
    layered = kind == LAYERED
    kind = EAGLE3 if layered else kind
    head = random_head(kind, tiny_lm.config, seed=seed, aux_layers=AUX if kind == EAGLE3 else (),
                       **({"draft_vocab_size": draft_vocab} if kind == EAGLE3 else {}),
                       **({"num_layers": 3, "layer_type": "qwen3", "attention_bias": True} if layered else {})).float()
    head.attach(*(t.float() for t in target_tensors(tiny_lm)))
    if kind == EAGLE3:
        head.d2t.copy_(torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[torch.arange(draft_vocab) * 2] = True
    return head


def filled(head, length, generator):
    """A head cache holding `length` entries of the module's own, and the rows that wrote them."""
    cache = HeadCache()
    tokens = torch.randint(0, head.config.vocab_size, (length,), generator=generator)
    hidden = torch.randn(length, head.config.hidden_size, generator=generator)
    with torch.inference_mode():
        head(tokens, hidden, cache, 0)
    return cache


@pytest.mark.parametrize("kind", [EAGLE, EAGLE3, LAYERED, MTP])
def test_a_chain_of_rows_gives_the_modules_logits_and_cache_entries(tiny_lm, kind):
    head = float_head(tiny_lm, kind)
    step = HeadKernels.serving(head)
    gen = torch.Generator().manual_seed(1)
    start, m = 9, 4
    ours, theirs = filled(head, start, gen), filled(head, start, torch.Generator().manual_seed(1))
    tokens = torch.randint(0, head.config.vocab_size, (m,), generator=gen)
    hidden = torch.randn(m, head.config.hidden_size, generator=gen)
    positions = torch.arange(start, start + m)
    with torch.inference_mode():
        want_hidden, want = head(tokens, hidden, theirs, start)
        got_hidden, got = step.step(tokens, hidden, positions, ours, start, positions + 1, torch.zeros(m, dtype=torch.long))
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and finite.any()
    assert torch.allclose(got[finite], want[finite], atol=1e-4, rtol=1e-4), (got[finite] - want[finite]).abs().max()
    assert torch.allclose(got_hidden, want_hidden, atol=1e-4, rtol=1e-4)
    assert torch.allclose(ours.keys[:, :start + m], theirs.keys[:, :start + m], atol=1e-5)
    assert torch.allclose(ours.values[:, :start + m], theirs.values[:, :start + m], atol=1e-5)
    assert ours.length == theirs.length == start + m


@pytest.mark.parametrize("kind", [EAGLE, EAGLE3, LAYERED, MTP])
def test_a_tree_levels_rows_see_the_entries_their_ancestors_and_themselves(tiny_lm, kind):
    """Rows written after two earlier levels' entries, each with its own ancestors (bits past `before`),
    against the module's step over the same boolean mask."""
    head = float_head(tiny_lm, kind, seed=2)
    step = HeadKernels.serving(head)
    gen = torch.Generator().manual_seed(3)
    start = 7
    ours, theirs = filled(head, start + 3, gen), filled(head, start + 3, torch.Generator().manual_seed(3))
    ours.length = theirs.length = start + 3  # entries start.. start+2: an earlier level's nodes
    bits = torch.tensor([0b1001, 0b1010, 0b10100])  # rows at start+3.. : one ancestor each, and themselves
    m = len(bits)
    tokens = torch.randint(0, head.config.vocab_size, (m,), generator=gen)
    hidden = torch.randn(m, head.config.hidden_size, generator=gen)
    positions = torch.full((m,), start + 2)
    visible = torch.zeros(m, start + 3 + m, dtype=torch.bool)
    visible[:, :start] = True
    for row, value in enumerate(bits.tolist()):
        for bit in range(8):
            if value >> bit & 1:
                visible[row, start + bit] = True

    def window(layer, k, v):
        keys, values = theirs.write(start + 3, k, v, layer)
        return keys, values, visible

    with torch.inference_mode():
        want_hidden, want = head.step(tokens, hidden, positions, window)
        got_hidden, got = step.step(tokens, hidden, positions, ours, start + 3, torch.full((m,), start), bits)
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], atol=1e-4, rtol=1e-4), (got[finite] - want[finite]).abs().max()
    assert torch.allclose(got_hidden, want_hidden, atol=1e-4, rtol=1e-4)


def test_draft_vocabulary_logits_pick_and_weigh_as_the_scattered_ones(tiny_lm):
    head = float_head(tiny_lm, EAGLE3, seed=4, draft_vocab=40)
    step = HeadKernels.serving(head)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 97, (3,), generator=gen)
    hidden = torch.randn(3, head.config.hidden_size, generator=gen)
    positions = torch.arange(3)
    with torch.inference_mode():
        _, full = step.step(tokens, hidden, positions, HeadCache(), 0, positions + 1, torch.zeros(3, dtype=torch.long))
        _, reduced = step.step(tokens, hidden, positions, HeadCache(), 0, positions + 1, torch.zeros(3, dtype=torch.long),
                               reduced=True)
    assert isinstance(reduced, DraftLogits)
    assert torch.equal(reduced.full(), full)
    for row in range(3):
        token = reduced[row].greedy()
        assert int(token) == int(greedy(full[row])) and int(token) % 2 == 0
        assert torch.allclose(reduced[row].probability(token), token_probability(full[row], token))
        assert float(reduced[row].probability(torch.tensor(1))) == 0.0  # outside the draft vocabulary
    # ids that do not ascend: the scattered logits, whose first maximum is the target's order
    head.d2t.copy_(torch.arange(40).flip(0) * 2 - torch.arange(40))
    with torch.inference_mode():
        _, unordered = HeadKernels.serving(head).step(tokens, hidden, positions, HeadCache(), 0, positions + 1,
                                                      torch.zeros(3, dtype=torch.long), reduced=True)
    assert isinstance(unordered, torch.Tensor) and unordered.shape == (3, 97)


@pytest.mark.parametrize("kind", [EAGLE, EAGLE3, MTP])
def test_the_executor_drafts_the_same_on_the_kernels_round_after_round(tiny_lm, kind):
    """Chains (with and without the confidence stop), trees, rounds that roll back, a tree past the
    kernel's 64 ancestor bits (the module's step then): the same drafts with and without the kernels."""
    head = float_head(tiny_lm, kind, seed=6)
    width = head.config.feature_width if kind == EAGLE3 else head.config.hidden_size
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 97, (30,), generator=gen).tolist()
    features = torch.randn(60, width, generator=gen)
    on, off = HeadExecutor(head, cpu_kernels=True), HeadExecutor(head, cpu_kernels=False)
    assert on.kernels is not None and off.kernels is None
    rounds = [(0, prompt, 4, 1), (29, prompt[29:] + [3, 8], 5, 1), (30, [8, 11, 12], 6, 3), (31, [11, 4, 2], 5, 2),
              (32, [4, 9], 70, 4), (33, [9, 5], 3, 1)]
    for stop in (0.0, 0.3):
        on.stop_below = off.stop_below = stop
        for keep, new_ids, k, branches in rounds:
            step = Step(stop > 0, keep, new_ids, k=k, branches=branches, features=features[:keep + len(new_ids) - 1])
            (a,), (b,) = on.propose_many([step]), off.propose_many([step])
            assert (a.tokens, a.parents, a.cached_length) == (b.tokens, b.parents, b.cached_length), (keep, k, branches)
            assert len(a.tokens) > 0 and (kind != EAGLE3 or all(token % 2 == 0 for token in a.tokens))
    # sampling: the same tokens and draft distributions from the same generator; trees ranked by the same
    # processed distribution (on the kernels over the draft vocabulary's columns)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    on.stop_below = off.stop_below = 0.0
    for branches in (1, 3):
        drafted = []
        for executor in (on, off):
            step = Step(5 + branches, 0, prompt, k=4, params=params, generator=torch.Generator().manual_seed(9),
                        features=features[:len(prompt) - 1], branches=branches)
            (result,) = executor.propose_many([step])
            drafted.append(result)
        assert (drafted[0].tokens, drafted[0].parents) == (drafted[1].tokens, drafted[1].parents)
        assert len(drafted[0].tokens) > 1
        if branches == 1:
            assert torch.allclose(drafted[0].probs, drafted[1].probs, atol=1e-5)


@pytest.mark.parametrize("kind", [EAGLE, EAGLE3, MTP])
def test_a_batch_drafts_together_what_each_sequence_drafts_alone(tiny_lm, kind):
    """propose_many over several sequences on the kernels (each head step over every sequence's rows at once:
    HeadKernels.step_many) drafts what one call per sequence drafts: chains of different K, stopped early by the
    confidence stop, sampled, trees among them, a first round without features, a step refused (its keep past
    the cache); round after round with rollbacks."""
    head = float_head(tiny_lm, kind, seed=3)
    width = head.config.feature_width if kind == EAGLE3 else head.config.hidden_size
    gen = torch.Generator().manual_seed(11)
    together, alone = HeadExecutor(head, cpu_kernels=True), HeadExecutor(head, cpu_kernels=True)
    together.stop_below = alone.stop_below = 0.05
    sampled = SamplingParams(temperature=0.9)
    keep = {seq: 0 for seq in range(1, 7)}
    tokens = {seq: torch.randint(0, 97, (12 + seq,), generator=gen).tolist() for seq in keep}
    calls = {"many": 0}
    step_many = together.kernels.step_many

    def counted(*args, **kwargs):
        calls["many"] += len(args[3]) > 1
        return step_many(*args, **kwargs)
    together.kernels.step_many = counted
    for round_ in range(8):
        steps = []
        for seq in keep:
            new_ids = tokens[seq][keep[seq]:]
            features = torch.randn(len(tokens[seq]) - 1, width, generator=gen)
            if round_ == 0 and seq == 6:
                features = None  # its first round: the target has run nothing yet
            steps.append(Step(seq, keep[seq], new_ids, k=1 + (seq + round_) % 5, features=features,
                              params=sampled if seq == 2 else SamplingParams(), branches=3 if seq == 3 else 1,
                              generator=torch.Generator().manual_seed(round_)))
        if round_ == 5:
            steps.append(Step(9, 4, [1, 2], k=3, features=torch.randn(5, width)))  # keep 4 of nothing: refused
        many = together.propose_many(steps)
        for step, a in zip(steps, many):
            (b,) = alone.propose_many([step._replace(generator=torch.Generator().manual_seed(round_))])  # same draws
            if isinstance(b, Exception):
                assert type(a) is type(b) and str(a) == str(b)
                continue
            assert (a.tokens, a.parents, a.cached_length) == (b.tokens, b.parents, b.cached_length), (round_, step.seq_id)
            if b.probs is not None:
                assert torch.allclose(a.probs, b.probs, atol=1e-5)
            if step.seq_id in keep:  # the next round: part of the draft accepted, a token of the target's
                accepted = a.tokens[:round_ % 3] if a.parents is None else []
                keep[step.seq_id] = len(tokens[step.seq_id]) - 1 if a.tokens or step.features is not None else 0
                tokens[step.seq_id] += accepted + [int(torch.randint(0, 97, (1,), generator=gen))]
    assert calls["many"] >= 8  # fills and chain steps ran over several sequences at once


def test_the_kernels_are_refused_where_they_do_not_serve(tiny_lm):
    head = float_head(tiny_lm, EAGLE3).double()
    assert HeadKernels.serving(head) is None
    assert HeadExecutor(head).kernels is None
    with pytest.raises(ValueError, match="cpu_kernels"):
        HeadExecutor(head, cpu_kernels=True)
