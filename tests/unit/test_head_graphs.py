"""A head's captured draft steps (head_graphs.py: chain steps, fills, tree levels in row x window buckets)
computed by their static-tensor code on the CPU (uncaptured there; tests/gpu replays them as CUDA graphs):
the same drafts and distributions as the eager head's (float64), for EAGLE-1 and EAGLE-3 (of one layer and of
three), chains and trees,
several sequences in the pool's slots and one past them, across window buckets and rollbacks; and greedy
speculation with the static steps equal to target-only."""

import asyncio

import pytest
import torch

from specdec.decoding.draft_length import DraftLengthPolicy
from specdec.decoding.loop import GenerationRequest, generate
from specdec.decoding.sampling import SamplingParams
from specdec.engine.build import dynamic_executor
from specdec.engine.draft_heads import EAGLE, EAGLE3, MTP
from specdec.engine.head_executor import HeadExecutor
from specdec.engine.head_graphs import HeadPool, window_sizes
from specdec.engine.interfaces import Step
from specdec.engine.local import LocalProposer, LocalScorer

from .test_draft_heads import LAYERED, PROMPT, head_for, reference_greedy


def counting(executor):
    """executor's captured runs by row bucket, counted."""
    counts, run = {}, executor.steps.run

    def counted(tokens, hidden, positions, *args, **kwargs):
        rows = next(rows for rows in executor.steps.rows if rows >= len(positions))
        counts[rows] = counts.get(rows, 0) + 1
        return run(tokens, hidden, positions, *args, **kwargs)
    executor.steps.run = counted
    return counts


@pytest.mark.parametrize("kind,together", [(EAGLE, False), (EAGLE3, False), (EAGLE3, True), (LAYERED, True),
                                           (MTP, True)])
def test_the_static_steps_draft_what_the_eager_head_does(tiny_lm, kind, together):
    """together: the static executor gets a round's three steps in one propose_many (their chains in
    lockstep, each sequence's captured outputs overwritten by the next one's step), the eager one a step
    a call."""
    head = head_for(tiny_lm, kind)
    eager = HeadExecutor(head, graphs=False)
    static = HeadExecutor(head, graphs=True, max_context=256, graph_slots=2)
    assert static.warm_up()[0] == len(static.steps.rows) * 2  # windows 128, 256
    counts = counting(static)
    width = head.config.feature_width
    torch.manual_seed(0)
    prompt = [5 + i % 90 for i in range(100)]
    features = torch.randn(len(prompt) - 1, width, dtype=torch.float64)
    keep = {}
    for seq in (1, 2, 3):  # 3 finds the pool's two slots taken: eager, its own cache
        for executor in (eager, static):
            executor.propose(seq, 0, prompt, 0, SamplingParams(), features=features)
        keep[seq] = len(prompt) - 1
    assert static.sequences[1].slot is not None and static.sequences[3].slot is None
    sampled = SamplingParams(temperature=0.9)
    for round_ in range(24):  # past position 128: the second window bucket
        steps = []
        for seq in (1, 2, 3):
            accepted = 1 + (round_ + seq) % 6  # fills of 1..6 rows; rollbacks of the drafted entries
            new_ids = [7 + (round_ * seq + i) % 80 for i in range(accepted)]
            new = torch.randn(accepted - 1, width, dtype=torch.float64)
            branches = 1 if seq == 2 else 1 + round_ % 3  # chains of all three, or beside trees
            params = sampled if round_ % 4 == 3 else SamplingParams()
            steps.append(lambda seq=seq, new_ids=new_ids, new=new, params=params, branches=branches: Step(
                seq, keep[seq], new_ids, k=4 + (round_ + seq) % 3, params=params, features=new,
                branches=1 if params is sampled else branches, generator=torch.Generator().manual_seed(round_)))
        expected = [eager.propose_many([step()])[0] for step in steps]
        got = (static.propose_many([step() for step in steps]) if together else
               [static.propose_many([step()])[0] for step in steps])
        for seq, a, b in zip((1, 2, 3), expected, got):
            assert (a.tokens, a.parents, a.cached_length) == (b.tokens, b.parents, b.cached_length)
            if a.probs is not None:
                assert torch.allclose(a.probs, b.probs, atol=1e-12)
            keep[seq] = a.cached_length
    assert min(keep.values()) > 128
    assert set(counts) >= {1, 2, 4, 8}  # chain steps, fills and tree levels of every size here
    assert sum(counts.values()) > 100


def test_the_pool_keeps_scratch_columns_past_each_slots_cache(tiny_lm):
    head = head_for(tiny_lm, EAGLE3)
    pool = HeadPool(head, slots=2, capacity=64, scratch=16)
    slot, cache = pool.cache()
    assert pool.keys.shape[2] == 80 and cache.keys.shape[1] == 64 and cache.fixed
    with pytest.raises(ValueError, match="holds 64 positions"):
        cache.write(60, torch.zeros(5, *cache.keys.shape[2:], dtype=cache.keys.dtype),
                    torch.zeros(5, *cache.keys.shape[2:], dtype=cache.keys.dtype))
    assert window_sizes(300) == [128, 256, 300] and window_sizes(128) == [128]


@pytest.mark.parametrize("branches", [1, 3])
def test_greedy_speculation_over_the_static_steps_equals_target_only(tiny_lm, branches):
    expected = reference_greedy(tiny_lm, PROMPT, 24)
    head = head_for(tiny_lm, EAGLE3)
    executor = HeadExecutor(head, graphs=True, max_context=128)
    executor.warm_up()
    counts = counting(executor)
    proposer = LocalProposer(executor, branches=branches)
    scorer = LocalScorer(dynamic_executor(tiny_lm, hidden_layers=head.config.feature_layers(2)))

    async def run():
        rounds = generate(GenerationRequest(seq_id=1, prompt_ids=PROMPT, max_tokens=24), proposer, scorer,
                          DraftLengthPolicy.fixed(4))
        return [t async for rnd in rounds for t in rnd.new_tokens]
    assert asyncio.run(run()) == expected
    assert sum(counts.values()) > 10
