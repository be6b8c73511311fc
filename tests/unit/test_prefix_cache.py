"""Prefix caching in the static executor: a new sequence reuses the pool's blocks that hold its prompt's
first tokens, and everything it computes is what it would have computed from scratch: one after another
and side by side, with drafts, rollbacks into shared blocks, eviction, and whole speculative generations."""

import pytest
import torch

from specdec.decoding.sampling import SamplingParams
from specdec.engine.build import ExecutorConfig, build_executor, dynamic_executor, static_executor
from specdec.engine.executor import Step
from specdec.engine.prefix_cache import FEATURES_SHARE, ROOT, PrefixIndex

from .conftest import run_fixed_k


def paged(model, **settings):
    options = dict(kv_pool_tokens=1024, block_size=8, max_context=256, max_batch=4, max_rows=5, min_window=16,
                   compile="off", prefix_caching=True)
    return static_executor(model, **{**options, **settings})


def dynamic(model, prefix_caching=True, **settings):
    """The dynamic executor, its prefix store holding 64 blocks of 8 unless told otherwise."""
    return dynamic_executor(model, **{"block_size": 8, "prefix_cache_tokens": 512 if prefix_caching else 0, **settings})


EXECUTORS = {"static": paged, "dynamic": dynamic}


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_index_matches_whole_prefixes_exactly():
    index = PrefixIndex(block_size=2)
    a = index.add(10, ROOT, (1, 2))
    b = index.add(11, a, (3, 4))
    assert index.match([1, 2, 3, 4, 5], 2) == ([10, 11], [a, b])
    assert index.match([1, 2, 3, 4], 1) == ([10], [a])  # at most max_blocks
    assert index.match([1, 2, 3, 9], 2) == ([10], [a])
    assert index.match([3, 4, 1, 2], 2) == ([], [])  # the same tokens at other positions are another key
    assert index.add(12, ROOT, (1, 2)) == a and not index.registered(12)  # a duplicate stays out
    index.remove(10)  # evicted: what followed it can no longer be reached, even once 10 is reused
    assert index.match([1, 2, 3, 4], 2) == ([], [])
    c = index.add(10, ROOT, (1, 2))
    assert c != a and index.match([1, 2, 3, 4], 2) == ([10], [c])
    assert len(index) == 2  # 10 again, and 11 left to age out


@pytest.mark.parametrize("kind", EXECUTORS)
def test_a_repeated_prompt_runs_only_its_uncached_tail_with_the_same_logits(tiny_lm, kind):
    lm, reference = EXECUTORS[kind](tiny_lm), EXECUTORS[kind](tiny_lm, prefix_caching=False)
    ids = prompt(29)
    first = lm.extend(1, 0, ids, 2)
    assert lm.tokens_processed == 29
    second = lm.extend(2, 0, ids, 2)  # while the first still holds its blocks
    assert lm.tokens_processed == 29 + 5  # 3 full blocks of 8 reused
    expected = reference.extend(1, 0, ids, 2)
    assert torch.allclose(first, expected, atol=1e-10) and torch.allclose(second, expected, atol=1e-10)
    assert (lm.prefix_queried_tokens, lm.prefix_hit_tokens) == (58, 24)
    assert (lm.sequences[1].cached, lm.sequences[2].cached) == (0, 24)  # what each request reports
    if kind == "static":  # shared blocks count once; released, they stay cached but are not held
        assert lm.sequences[2].blocks[:3] == lm.sequences[1].blocks[:3]
        assert lm.kv_bytes_allocated == (4 + 1) * lm.kv.pool.block_bytes
    lm.release(1), lm.release(2)
    if kind == "static":
        assert lm.kv_bytes_allocated == 0 and len(lm.kv.pool.cached) == 3
        assert lm.prefix_cache_bytes == 3 * lm.kv.pool.block_bytes
    else:  # the store: 3 blocks of 8 positions, keys and values of 2 layers x 2 heads x 8 float64s
        assert lm.prefix_cache_bytes == 3 * 8 * 2 * 2 * 2 * 8 * 8
    third = lm.extend(3, 0, ids + [5, 6], 1)  # after both ended
    assert lm.prefix_hit_tokens == 48 and torch.allclose(third, reference.extend(1, 29, [5, 6], 1), atol=1e-10)


@pytest.mark.parametrize("kind", EXECUTORS)
def test_a_salted_sequence_finds_only_blocks_of_its_own_salt(tiny_lm, kind):
    """Step.salt (vLLM's cache_salt): a prompt finds the blocks of sequences with the same salt, never those of
    another salt or of the shared cache, and its own are not found by them; its logits are the same."""
    lm = EXECUTORS[kind](tiny_lm)
    ids = prompt(25)
    [plain] = lm.extend_many([Step(1, 0, ids, 1)])
    [alice] = lm.extend_many([Step(2, 0, ids, 1, salt="alice")])
    [bob] = lm.extend_many([Step(3, 0, ids, 1, salt="bob")])
    assert [lm.sequences[i].cached for i in (1, 2, 3)] == [0, 0, 0]  # each its own: nothing shared
    [again] = lm.extend_many([Step(4, 0, ids, 1, salt="alice")])
    [shared] = lm.extend_many([Step(5, 0, ids, 1)])
    assert (lm.sequences[4].cached, lm.sequences[5].cached) == (24, 24)  # found within its own salt, and without one
    for logits in (alice, bob, again, shared):
        assert torch.allclose(logits, plain, atol=1e-10)


@pytest.mark.parametrize("kind", EXECUTORS)
def test_at_least_the_positions_whose_logits_are_wanted_run(tiny_lm, kind):
    lm = EXECUTORS[kind](tiny_lm)
    ids = prompt(16)  # two full blocks
    lm.extend(1, 0, ids, 1)
    before = lm.tokens_processed
    lm.extend(2, 0, ids, 1)
    assert lm.tokens_processed - before == 8  # the last block runs: its last position's logits are wanted
    lm.extend(3, 0, ids, 9)
    assert lm.tokens_processed - before == 8 + 16  # 9 logits: nothing reusable


@pytest.mark.parametrize("kind", EXECUTORS)
def test_shared_prefixes_with_decoding_rollbacks_and_a_rollback_into_shared_blocks(tiny_lm, kind):
    """Sequences sharing a prompt decode side by side in one forward with verify-like steps and rejections;
    one then rolls back into the shared blocks (a client may): it gets a copy, the others keep theirs."""
    lm, reference = EXECUTORS[kind](tiny_lm), dynamic_executor(tiny_lm)
    gen = torch.Generator().manual_seed(3)
    shared = prompt(20, seed=1)
    lengths = {}
    for seq in (1, 2, 3):
        ids = shared + prompt(seq, seed=10 + seq)
        a, b = reference.extend(seq, 0, ids, 1), lm.extend(seq, 0, ids, 1)
        assert torch.allclose(a, b, atol=1e-10)
        lengths[seq] = len(ids)
    assert lm.prefix_hit_tokens == 2 * 16
    for _ in range(6):
        steps = []
        for seq in (1, 2, 3):
            keep = lengths[seq] - int(torch.randint(0, 3, (1,), generator=gen))  # 0-2 rejected tokens
            new = torch.randint(1, 97, (4,), generator=gen).tolist()
            steps.append(Step(seq, keep, new, num_logits=4))
            lengths[seq] = keep + 4
        for a, b in zip(reference.extend_many(steps), lm.extend_many(steps)):
            assert torch.allclose(a, b, atol=1e-10)
    held = list(lm.sequences[2].blocks[:2]) if kind == "static" else []
    rolled = reference.extend(1, 5, [7, 8, 9], 3), lm.extend(1, 5, [7, 8, 9], 3)
    assert torch.allclose(*rolled, atol=1e-10)
    if kind == "static":
        assert lm.sequences[1].blocks[0] not in held and lm.sequences[2].blocks[:2] == held  # a copy of its own
    steps = [Step(seq, lengths[seq], [11], 1) for seq in (2, 3)]
    for a, b in zip(reference.extend_many(steps), lm.extend_many(steps)):
        assert torch.allclose(a, b, atol=1e-10)
    # The prompt is still found, with the keys and values it had.
    later = reference.extend(9, 0, shared + [4], 1), lm.extend(9, 0, shared + [4], 1)
    assert lm.prefix_hit_tokens == 3 * 16 and torch.allclose(*later, atol=1e-10)


def test_a_rollback_into_a_block_it_alone_holds_rekeys_that_block(tiny_lm):
    lm, reference = paged(tiny_lm), paged(tiny_lm, prefix_caching=False)
    ids = prompt(20, seed=2)
    lm.extend(1, 0, ids, 1)
    assert len(lm.prefix) == 2
    blocks = list(lm.sequences[1].blocks)
    lm.extend(1, 3, [5, 5, 5, 5, 5], 1)  # rewrites positions 3..7 of block 0, in place
    assert lm.sequences[1].blocks == blocks
    assert lm.prefix.match(ids, 2) == ([], []) and lm.prefix.match(ids[:3] + [5] * 5, 1)[0] == blocks[:1]
    after = lm.extend(2, 0, ids, 1)  # nothing reusable: block 0 no longer holds the prompt
    assert lm.prefix_hit_tokens == 0 and torch.allclose(after, reference.extend(1, 0, ids, 1), atol=1e-10)


@pytest.mark.parametrize("kind", EXECUTORS)
def test_a_reset_forgets_every_cached_prefix_while_running_sequences_keep_theirs(tiny_lm, kind):
    """A client's reset (cache_reset.py): no later prompt finds a block cached before it, the blocks no sequence
    holds are free again, one still running keeps its blocks and goes on computing what it would have; once it
    ends its blocks are free, and the cache fills again from the prompts after the reset."""
    lm, reference = EXECUTORS[kind](tiny_lm), EXECUTORS[kind](tiny_lm, prefix_caching=False)
    ended, running = prompt(25, seed=7), prompt(25, seed=8)
    lm.extend(1, 0, ended, 1)
    lm.extend(2, 0, running, 1)
    reference.extend(2, 0, running, 1)
    lm.release(1)
    assert lm.prefix_cache_bytes > 0 and len(lm.prefix) == 6
    held = list(lm.sequences[2].blocks) if kind == "static" else None
    assert lm.reset_prefix_cache() == 6
    assert len(lm.prefix) == 0 and lm.prefix_cache_bytes == 0 and lm.prefix.match(ended, 3) == ([], [])
    if kind == "static":  # ended's blocks free again; running's still its own, no longer offered to anyone
        assert not lm.kv.pool.cached and lm.sequences[2].blocks == held
        assert lm.kv_bytes_allocated == len(held) * lm.kv.pool.block_bytes
    hits = lm.prefix_hit_tokens
    for seq_id, ids in ((3, ended), (4, running)):  # neither prompt is found any more: both run whole
        lm.extend(seq_id, 0, ids, 1)
    assert lm.prefix_hit_tokens == hits and lm.tokens_processed == 4 * 25
    assert torch.allclose(lm.extend(2, 25, [3, 4], 1), reference.extend(2, 25, [3, 4], 1), atol=1e-10)
    lm.release(2)
    if kind == "static":  # released after the reset: free, not cached
        assert not any(block in lm.kv.pool.cached for block in held)
    [again] = lm.extend_many([Step(5, 0, ended + [1], 1)])  # the cache fills again from after the reset
    assert lm.sequences[5].cached == 24
    assert torch.allclose(again, reference.extend(6, 0, ended + [1], 1), atol=1e-10)


def test_cached_blocks_are_evicted_oldest_first_when_the_pool_needs_them(tiny_lm):
    lm = paged(tiny_lm, kv_pool_tokens=64, max_context=64)  # 8 blocks of 8
    old, new = prompt(17, seed=4), prompt(17, seed=5)
    lm.extend(1, 0, old, 1)
    lm.extend(2, 0, new, 1)
    lm.release(1), lm.release(2)
    assert len(lm.kv.pool.cached) == 4 and len(lm.kv.pool.free) == 4 and lm.kv_bytes_allocated == 0
    lm.extend(3, 0, prompt(9, seed=6), 1, reserve=40)  # 5 blocks: the 4 free ones, then old's tail
    assert len(lm.prefix.match(old, 2)[0]) == 1 and len(lm.prefix.match(new, 2)[0]) == 2
    lm.extend(4, 0, new + [1], 1)  # takes new's cached blocks back, and evicts old's head for its third
    assert lm.prefix_hit_tokens == 16 and not lm.kv.pool.cached and not lm.kv.pool.free
    assert lm.prefix.match(old, 2) == ([], [])


@pytest.mark.parametrize("cap", [16, None])
def test_a_capped_pool_keeps_the_newest_prefixes_and_reuses_their_blocks_before_untouched_ones(tiny_lm, cap):
    """prefix_cache_tokens on the static pool (a CPU's): at most that many tokens' blocks stay cached once no
    sequence holds them, the newest, and the evicted ones are handed out again before a block never used, so a
    long run of new prompts touches a bounded set of blocks (a CPU pool's resident pages). Uncapped, every
    prompt's blocks stay cached and each new prompt takes blocks never used."""
    lm = paged(tiny_lm, kv_pool_tokens=512, max_context=64, prefix_cache_tokens=cap)  # 64 blocks of 8
    touched = set()
    for i in range(12):
        lm.extend(i, 0, prompt(17, seed=10 + i), 1)  # 3 blocks, 2 of them full (keyed)
        touched |= set(lm.sequences[i].blocks)
        lm.release(i)
        assert len(lm.kv.pool.cached) == (min(2 * (i + 1), 2) if cap else 2 * (i + 1))
    # one sequence's 3 blocks and the 2 cached; uncapped 2 new per prompt (its unkeyed tail's block is reused)
    assert len(touched) == (5 if cap else 2 * 12 + 1)
    assert len(lm.prefix.match(prompt(17, seed=21), 2)[0]) == 2  # the newest prompt's are found
    assert len(lm.prefix.match(prompt(17, seed=10), 2)[0]) == (0 if cap else 2)
    assert lm.prefix_cache_bytes == len(lm.kv.pool.cached) * lm.kv.pool.block_bytes
    before = lm.tokens_processed
    lm.extend(99, 0, prompt(17, seed=21) + [7], 1)
    assert lm.tokens_processed - before == 2  # the cached blocks serve: 16 positions not run


def test_the_cpu_executor_caps_its_cached_prefixes_at_prefix_cache_tokens(tiny_lm):
    """The executor the server builds on a CPU: its static pool keeps prefix_cache_tokens of cached blocks
    (the pool's pages become resident as used); the features a hosted head keeps, a share of those."""
    lm = build_executor(tiny_lm, ExecutorConfig(executor="static", max_sequences=2, max_context=256, block_size=8,
                                                prefix_cache_tokens=64))
    assert lm.kv.pool.max_cached == 8 < lm.kv.pool.blocks
    assert lm.prefix.features_budget == int(FEATURES_SHARE * 8 * lm.kv.pool.block_bytes)


@pytest.mark.parametrize("kind", EXECUTORS)
def test_drafted_tokens_are_cached_once_the_caller_keeps_them(tiny_lm, kind):
    """A proposal's drafted tokens run through the model on the device; once a later step keeps them
    (accepted), their full blocks are found by the next prompt that holds them: a chat's next turn."""
    draft, reference = EXECUTORS[kind](tiny_lm), EXECUTORS[kind](tiny_lm, prefix_caching=False)
    ids = prompt(6, seed=7)
    for lm in (draft, reference):
        tokens = lm.propose(1, 0, ids, 4, SamplingParams()).tokens
        assert lm.cached_length(1) == 9
    assert len(draft.prefix) == 0  # positions 6..8 are drafts: the first block is not confirmed yet
    draft.propose(1, 9, [tokens[-1], 3], 2, SamplingParams())  # all four accepted, then a bonus token
    assert len(draft.prefix) == 1
    turn = ids + tokens + [3, 8, 8, 8]
    a, b = draft.propose(2, 0, turn, 3, SamplingParams()), reference.propose(2, 0, turn, 3, SamplingParams())
    assert draft.prefix_hit_tokens == 8 and a == b


@pytest.mark.parametrize("kind", EXECUTORS)
def test_speculative_generations_sharing_a_system_prompt_equal_target_only(tiny_lm, kind):
    """The whole loop on in-process executors: three requests with one system prompt, then a second turn
    holding the first's answer, drafted with K=4 from cached prefixes, give target-only's tokens."""
    from specdec.decoding.loop import GenerationRequest, Stats
    from specdec.triton.orchestrator import kv_blocks
    from specdec.engine.local import LocalProposer, LocalScorer
    from .conftest import noisy_copy

    system = prompt(40, seed=8)
    target, draft = EXECUTORS[kind](tiny_lm), EXECUTORS[kind](noisy_copy(tiny_lm))
    plain = LocalScorer(dynamic_executor(tiny_lm))
    proposer, scorer = LocalProposer(draft), LocalScorer(target)
    seq = 0
    for user in (prompt(3, seed=9), prompt(5, seed=10), prompt(3, seed=9)):
        seq += 1
        req = GenerationRequest(seq_id=seq, prompt_ids=system + user, max_tokens=20)
        out = run_fixed_k(req, proposer, scorer, 4)
        assert out == run_fixed_k(req, proposer, plain, 0)
    turn = GenerationRequest(seq_id=seq + 1, prompt_ids=system + user + out + prompt(2, seed=11), max_tokens=12)
    hits = target.prefix_hit_tokens
    stats, plain_stats = Stats(), Stats()
    assert run_fixed_k(turn, proposer, scorer, 4, stats) == run_fixed_k(turn, proposer, plain, 0, plain_stats)
    assert target.prefix_hit_tokens - hits >= 56  # the system prompt, the question and most of the answer
    # the request's own count: its prompt's hits, in whole blocks of 8; none without a prefix cache
    assert stats.cached_tokens == target.prefix_hit_tokens - hits and stats.cached_tokens % 8 == 0
    assert plain_stats.cached_tokens == 0 and stats.block_size == 8
    # TensorRT-LLM's KV reuse metrics of it (orchestrator.kv_blocks): found blocks, and the blocks computed
    positions = len(turn.prompt_ids) + 12
    computed = -(-positions // 8) - stats.cached_tokens // 8
    assert kv_blocks(stats, positions) == (stats.cached_tokens // 8, computed, computed) and computed > 0
    assert kv_blocks(Stats(), positions) == (0, 0, 0)  # before the target has answered
    assert draft.prefix_hit_tokens > 0 and not target.sequences and not draft.sequences


def test_the_dynamic_store_copies_blocks_in_and_evicts_the_least_recently_used(tiny_lm):
    lm, reference = dynamic(tiny_lm, prefix_cache_tokens=32), dynamic_executor(tiny_lm)  # 4 blocks of 8
    a, b, c = prompt(17, seed=12), prompt(17, seed=13), prompt(17, seed=14)
    for seq, ids in enumerate((a, b), 1):
        lm.extend(seq, 0, ids, 1)
        lm.release(seq)
    assert len(lm.kv.store.used) == 4 and not lm.kv.store.free
    lm.extend(3, 0, a + [2], 1)  # a's blocks: used again, so b's are now the oldest
    lm.extend(4, 0, c, 1)  # keys c's two blocks: b's are evicted
    assert lm.prefix.match(b, 2) == ([], []) and len(lm.prefix.match(a, 2)[0]) == 2
    lm.release(3), lm.release(4)  # the store is not the sequences' memory: it keeps its blocks
    assert len(lm.kv.store.used) == 4 and lm.kv.store.nbytes == 4 * 2 * 2 * 8 * 2 * 8 * 8
    # A sequence copies its blocks in and writes past them into its own buffers: the store is unchanged.
    kept = [k.clone() for k in lm.kv.store.keys]
    out = lm.extend(5, 0, c + [9, 9], 2)
    assert torch.allclose(out, reference.extend(1, 0, c + [9, 9], 2), atol=1e-10)
    lm.extend(5, 3, [1, 1, 1], 1)  # a rollback into the copied blocks
    assert all(torch.equal(x, y) for x, y in zip(kept, lm.kv.store.keys))


def test_a_prompt_longer_than_the_dynamic_store_keeps_its_first_blocks(tiny_lm):
    lm, reference = dynamic(tiny_lm, prefix_cache_tokens=32), dynamic_executor(tiny_lm)  # 4 blocks of 8
    ids = prompt(80, seed=15)  # 9 full blocks confirmed
    lm.extend(1, 0, ids, 1)
    assert len(lm.prefix) == 4 and len(lm.prefix.match(ids, 9)[0]) == 4
    lm.release(1)
    out = lm.extend(2, 0, ids + [3], 1)
    assert lm.prefix_hit_tokens == 32 and torch.allclose(out, reference.extend(1, 0, ids + [3], 1), atol=1e-10)


@pytest.mark.parametrize("kind", EXECUTORS)
def test_a_prompt_sent_in_chunks_finds_its_blocks_chunk_after_chunk(tiny_lm, kind):
    """A prompt's chunks (num_logits=0 but the last) go on with known blocks from where the previous one
    ended, up to the whole of a chunk that needs no logits; a decode step at a block boundary is not a
    lookup."""
    lm, reference = EXECUTORS[kind](tiny_lm), dynamic_executor(tiny_lm)
    ids = prompt(40, seed=16)
    lm.extend(1, 0, ids, 1)
    lm.release(1)
    processed, queried = lm.tokens_processed, lm.prefix_queried_tokens
    chunks = [lm.extend(2, 0, ids[:16], 0), lm.extend(2, 16, ids[16:32], 0), lm.extend(2, 32, ids[32:] + [7], 2)]
    assert [len(c) for c in chunks] == [0, 0, 2] and lm.tokens_processed - processed == 9
    assert lm.sequences[2].cached == 40 - 8  # over its chunks
    assert lm.prefix_hit_tokens == 40 - 8 and lm.prefix_queried_tokens - queried == 41  # every chunk looked up
    assert torch.allclose(chunks[-1], reference.extend(1, 0, ids + [7], 2), atol=1e-10)
    lm.extend(2, 41, [5, 6, 7], 3)  # to 44
    lm.extend(2, 44, [1, 2, 3, 4], 4)  # 48: a block boundary
    lm.extend(2, 48, [9], 1)
    assert lm.prefix_queried_tokens - queried == 41


@pytest.mark.parametrize("kind", EXECUTORS)
def test_a_drafts_prompt_chunks_append_without_drafting(tiny_lm, kind):
    """num_draft_tokens=0 appends a prompt's chunk (found in the cache where it can be); the proposal
    after the last chunk is the one a whole-prompt proposal gives."""
    draft, reference = EXECUTORS[kind](tiny_lm), EXECUTORS[kind](tiny_lm, prefix_caching=False)
    ids = prompt(30, seed=17)
    greedy = SamplingParams()
    assert draft.propose(1, 0, ids[:16], 0, greedy) == ([], None, 16, None)
    assert draft.propose(1, 16, ids[16:], 3, greedy) == reference.propose(1, 0, ids, 3, greedy)
    draft.release(1)
    processed = draft.tokens_processed
    assert draft.propose(2, 0, ids[:16], 0, greedy) == ([], None, 16, None)  # found whole: nothing runs
    assert draft.tokens_processed == processed and draft.cached_length(2) == 16
