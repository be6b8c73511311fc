"""return_log_probs in the decode loop: every generated token's log-probability under the target's raw
distribution, checked against one forward of the target over prompt + output (real tiny models, in
process), greedy and sampled, with a draft model and prompt lookup, and cut where generation stops."""

import asyncio

import pytest
import torch
from specdec.decoding.draft_length import DraftLengthPolicy
from specdec.decoding.loop import GenerationRequest, generate
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.decoding.sampling import (SamplingParams, greedy_log_probs, scored_log_probs, scored_rows, token_log_probs,
                                      top_log_probs)
from specdec.engine.build import dynamic_executor
from specdec.engine.local import LocalProposer, LocalScorer

from .conftest import noisy_copy

PROMPT = [5, 17, 3, 5, 17, 3, 8, 40, 5, 17]


def test_greedy_and_token_log_probs_are_the_log_softmax_entries():
    torch.manual_seed(0)
    logits = torch.randn(6, 50, dtype=torch.float64) * 4
    logits[:, 40:] = float("-inf")  # padded vocabulary
    reference = torch.log_softmax(logits, -1)
    assert torch.allclose(greedy_log_probs(logits).double(), reference.max(-1).values, atol=1e-5)
    tokens = torch.tensor([0, 3, 39, 7, 7, 12])
    assert torch.allclose(token_log_probs(logits, tokens).double(), reference[torch.arange(6), tokens], atol=1e-5)
    assert greedy_log_probs(logits.to(torch.bfloat16)).dtype == torch.float32


def _reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The target's log-probability of each output token, from one forward over prompt + output."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    rows = torch.log_softmax(logits[len(prompt) - 1:-1].double(), -1)
    return rows[torch.arange(len(output)), torch.tensor(output)]


def _run(req, proposer, scorer, k):
    async def main():
        return [rnd async for rnd in generate(req, proposer, scorer, DraftLengthPolicy.fixed(k))]
    return asyncio.run(main())


@pytest.mark.parametrize("draft,k,temperature", [
    ("none", 0, 0.0), ("draft_model", 3, 0.0), ("ngram", 4, 0.0), ("draft_model", 3, 1.0), ("ngram", 4, 0.8)])
def test_each_token_carries_the_targets_log_probability(tiny_lm, draft, k, temperature):
    target = dynamic_executor(tiny_lm)
    proposer = NgramProposer(min_ngram=1) if draft == "ngram" else LocalProposer(dynamic_executor(noisy_copy(tiny_lm)))
    req = GenerationRequest(seq_id=3, prompt_ids=PROMPT, max_tokens=40, log_probs=True,
                            sampling=SamplingParams(temperature=temperature, seed=11))
    rounds = _run(req, proposer, LocalScorer(target), k)
    output = [token for rnd in rounds for token in rnd.new_tokens]
    log_probs = [value for rnd in rounds for value in rnd.log_probs]
    assert all(len(rnd.log_probs) == len(rnd.new_tokens) for rnd in rounds)
    assert len(output) == 40
    if k:  # rounds that took several tokens, and rounds that rejected
        assert sum(rnd.num_accepted for rnd in rounds) > 0 and any(rnd.num_accepted < k for rnd in rounds[:-1])
    # Raw log-probabilities: temperature and filters change which tokens are drawn, not what is reported.
    assert torch.allclose(torch.tensor(log_probs, dtype=torch.float64), _reference(tiny_lm, PROMPT, output),
                          atol=1e-4)
    plain = _run(GenerationRequest(seq_id=4, prompt_ids=PROMPT, max_tokens=40,
                                   sampling=SamplingParams(temperature=temperature, seed=11)),
                 NgramProposer(min_ngram=1) if draft == "ngram" else LocalProposer(dynamic_executor(noisy_copy(tiny_lm))),
                 LocalScorer(dynamic_executor(tiny_lm)), k)
    assert all(rnd.log_probs is None for rnd in plain)  # not asked: nothing computed
    assert [token for rnd in plain for token in rnd.new_tokens] == output  # asking changes no token


def test_log_probs_are_cut_with_the_tokens_at_an_end_token(tiny_lm):
    target = dynamic_executor(tiny_lm)
    free = _run(GenerationRequest(seq_id=5, prompt_ids=PROMPT, max_tokens=30, log_probs=True),
                LocalProposer(dynamic_executor(noisy_copy(tiny_lm))), LocalScorer(target), 4)
    output = [token for rnd in free for token in rnd.new_tokens]
    end = output[12]  # generation stops at its first occurrence, which is dropped
    stopped = _run(GenerationRequest(seq_id=6, prompt_ids=PROMPT, max_tokens=30, log_probs=True,
                                     end_ids=frozenset([end])),
                   LocalProposer(dynamic_executor(noisy_copy(tiny_lm))), LocalScorer(dynamic_executor(tiny_lm)), 4)
    kept = [token for rnd in stopped for token in rnd.new_tokens]
    assert kept == output[:output.index(end)] and stopped[-1].finish_reason == "stop"
    assert [len(rnd.log_probs) for rnd in stopped] == [len(rnd.new_tokens) for rnd in stopped]
    assert [v for rnd in stopped for v in rnd.log_probs] == [v for rnd in free for v in rnd.log_probs][:len(kept)]


def test_top_log_probs_are_the_rows_most_likely_tokens():
    torch.manual_seed(0)
    logits = torch.randn(4, 50, dtype=torch.float64) * 3
    logits[:, 45:] = float("-inf")
    ids, values = top_log_probs(logits, 5)
    reference = torch.log_softmax(logits, -1)
    assert ids.tolist() == reference.topk(5).indices.tolist() and values.dtype == torch.float32
    assert torch.allclose(values.double(), reference.topk(5).values, atol=1e-5)
    assert torch.equal(values[:, 0], greedy_log_probs(logits)) and torch.equal(ids[:, 0], logits.argmax(-1))
    assert top_log_probs(logits[:, :3], 5)[0].shape == (4, 3)  # never more than the vocabulary


def test_score_rows_score_the_new_token_after_each_and_a_chunks_last_row_the_next_chunks_first():
    torch.manual_seed(2)
    new_ids = [11, 12, 13, 14, 15, 16]
    logits = torch.randn(5, 40, dtype=torch.float64)  # the last 5 positions: 3 score rows, 2 verified
    log_softmax = torch.log_softmax(logits, -1)
    values, ranks, ids, tops = scored_rows(logits, new_ids, 3, 2)  # rows of positions 1-3 score tokens 2-4
    assert torch.allclose(values.double(), log_softmax[[0, 1, 2], [13, 14, 15]], atol=1e-6)
    assert ranks.tolist() == _sorted_ranks(logits[:3], torch.tensor([13, 14, 15]))
    assert ids.shape == tops.shape == (3, 2)
    # a chunk scored alone: every row is a score row, its last one scores the next chunk's first token
    values, _, _, _ = scored_rows(logits, new_ids[:4] + [15], 5, score_next=39)  # rows of new_ids[0..4]
    assert torch.allclose(values.double(), log_softmax[torch.arange(5), torch.tensor([12, 13, 14, 15, 39])], atol=1e-6)
    with pytest.raises(ValueError, match="5 score rows need the 5 tokens after them, got 4"):
        scored_rows(logits, new_ids[:5], 5)  # no next token given for the last row


@pytest.mark.parametrize("draft,k,temperature,branches", [
    ("none", 0, 0.0, 1), ("draft_model", 3, 0.0, 1), ("draft_model", 6, 0.0, 2), ("ngram", 4, 0.8, 1),
    ("draft_model", 3, 1.0, 1)])
def test_each_token_carries_its_positions_most_likely_tokens(tiny_lm, draft, k, temperature, branches):
    """num_top_log_probs: per generated token the n most likely tokens of the target's raw distribution at
    its position, most likely first, with their log-probabilities; through chains, trees (accepted paths
    off the first branch) and sampled rounds (computed from the logits there, sent by the target otherwise)."""
    proposer = (NgramProposer(min_ngram=1) if draft == "ngram" else
                LocalProposer(dynamic_executor(noisy_copy(tiny_lm)), branches=branches))
    req = GenerationRequest(seq_id=7, prompt_ids=PROMPT, max_tokens=40, log_probs=True, top_log_probs=5,
                            sampling=SamplingParams(temperature=temperature, seed=11))

    async def main():
        policy = DraftLengthPolicy.fixed(k, branches=branches)
        return [rnd async for rnd in generate(req, proposer, LocalScorer(dynamic_executor(tiny_lm)), policy)]
    rounds = asyncio.run(main())
    output = [token for rnd in rounds for token in rnd.new_tokens]
    assert all(len(rnd.top[0]) == len(rnd.top[1]) == len(rnd.new_tokens) for rnd in rounds)
    if branches > 1:
        assert any(rnd.depth is not None and rnd.num_accepted for rnd in rounds)
    ids = torch.tensor([row for rnd in rounds for row in rnd.top[0]])
    values = torch.tensor([row for rnd in rounds for row in rnd.top[1]], dtype=torch.float64)
    with torch.no_grad():
        logits = tiny_lm(torch.tensor([PROMPT + output])).logits[0]
    reference = torch.log_softmax(logits[len(PROMPT) - 1:-1].double(), -1)  # (40, V)
    assert ids.shape == (40, 5) and torch.allclose(reference.gather(1, ids), values, atol=1e-4)  # each id's own
    assert torch.allclose(values, reference.topk(5).values, atol=1e-4)  # and they are the five most likely
    assert torch.allclose(values[:, 0], torch.tensor([v for rnd in rounds for v in rnd.log_probs], dtype=torch.float64)
                          if temperature == 0 else values[:, 0], atol=1e-5)
    if temperature == 0:
        assert ids[:, 0].tolist() == output  # greedy: each token is its position's first


def _sorted_ranks(logits: torch.Tensor, tokens: torch.Tensor) -> list[int]:
    """Each row's token's place in its row sorted most likely first, from 1 (rows without ties)."""
    return ((logits.argsort(-1, descending=True) == tokens[:, None]).nonzero()[:, 1] + 1).tolist()


def test_scored_log_probs_are_the_rows_tokens_their_ranks_and_tops_in_blocks():
    torch.manual_seed(1)
    logits = torch.randn(7, 50, dtype=torch.float64) * 3
    tokens = torch.tensor([1, 4, 49, 0, 7, 7, 30])
    tokens[3] = logits[3].argmax()  # one row's token its most likely: rank 1
    values, ranks, ids, tops = scored_log_probs(logits, tokens, 4, block=3)  # blocks of 3, 3 and 1 rows
    assert torch.allclose(values.double(), torch.log_softmax(logits, -1)[torch.arange(7), tokens], atol=1e-5)
    assert ranks.tolist() == _sorted_ranks(logits, tokens) and ranks[3] == 1 and ranks.max() > 4
    top_ids, top_values = top_log_probs(logits, 4)
    assert torch.equal(ids, top_ids) and torch.allclose(tops, top_values)
    assert scored_log_probs(logits, tokens)[2:] == (None, None)  # no tops unless asked
    tied = logits[:1].clone()
    tied[0, 9] = tied[0, 2] = tied[0].max() + 1  # two most likely: each ranks 1 (ties share the better rank)
    third = tied[0].clone().index_fill_(0, torch.tensor([2, 9]), -torch.inf).argmax()
    assert scored_log_probs(tied.repeat(3, 1), torch.tensor([9, 2, third]))[1].tolist() == [1, 1, 3]
    empty = scored_log_probs(logits[:0], tokens[:0], 3)
    assert empty[0].shape == empty[1].shape == (0,) and empty[2].shape == (0, 3)


@pytest.mark.parametrize("draft,k,temperature,branches", [
    ("none", 0, 0.0, 1), ("draft_model", 3, 0.0, 1), ("draft_model", 4, 0.0, 2), ("ngram", 4, 0.8, 1),
    ("draft_model", 3, 1.0, 1)])
def test_the_first_round_scores_every_prompt_token(tiny_lm, draft, k, temperature, branches):
    """prompt_log_probs: each prompt token's log-probability given the tokens before it, and its position's
    most likely tokens, from the first round's one forward (the prompt scored as a chain: a tree-drafting
    proposer drafts a chain then); the generation is the one it is without (same tokens, same log-probs)."""
    def run(**asked):
        proposer = (NgramProposer(min_ngram=1) if draft == "ngram" else
                    LocalProposer(dynamic_executor(noisy_copy(tiny_lm)), branches=branches))
        req = GenerationRequest(seq_id=9, prompt_ids=PROMPT, max_tokens=20, log_probs=True, top_log_probs=3,
                                sampling=SamplingParams(temperature=temperature, seed=5), **asked)

        async def main():
            policy = DraftLengthPolicy.fixed(k, branches=branches)
            return [rnd async for rnd in generate(req, proposer, LocalScorer(dynamic_executor(tiny_lm)), policy)]
        return asyncio.run(main())
    rounds, plain = run(prompt_log_probs=True), run()
    first = rounds[0]
    assert first.depth is None and all(rnd.prompt_log_probs is None for rnd in rounds[1:] + plain)
    with torch.no_grad():
        reference = torch.log_softmax(tiny_lm(torch.tensor([PROMPT])).logits[0, :-1].double(), -1)  # (P - 1, V)
    values = torch.tensor(first.prompt_log_probs, dtype=torch.float64)
    assert len(values) == len(PROMPT) - 1
    assert torch.allclose(values, reference[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])], atol=1e-4)
    assert first.prompt_ranks == _sorted_ranks(reference, torch.tensor(PROMPT[1:]))
    ids, tops = torch.tensor(first.prompt_top[0]), torch.tensor(first.prompt_top[1], dtype=torch.float64)
    assert ids.shape == (len(PROMPT) - 1, 3) and torch.allclose(tops, reference.topk(3).values, atol=1e-4)
    assert torch.allclose(reference.gather(1, ids), tops, atol=1e-4)
    assert [t for rnd in rounds for t in rnd.new_tokens] == [t for rnd in plain for t in rnd.new_tokens]
    assert torch.allclose(torch.tensor([v for rnd in rounds for v in rnd.log_probs]),
                          torch.tensor([v for rnd in plain for v in rnd.log_probs]), atol=1e-5)
    if k and temperature == 0:  # the scoring round verified a draft too
        assert first.num_drafted > 0


def test_a_one_token_prompt_scores_nothing(tiny_lm):
    req = GenerationRequest(seq_id=10, prompt_ids=[7], max_tokens=3, prompt_log_probs=True)
    rounds = _run(req, NgramProposer(min_ngram=1), LocalScorer(dynamic_executor(tiny_lm)), 2)
    assert rounds[0].prompt_log_probs == rounds[0].prompt_ranks == [] and rounds[0].prompt_top is None


def test_a_prompt_the_prefix_cache_holds_is_scored_whole_by_the_paged_executor(tiny_lm):
    """The paged executor with prefix caching: a prompt served before is in the cache, yet the scoring round
    runs all of it (a cached block has no logits) and gets every row's score."""
    from specdec.engine.build import static_executor

    target = static_executor(tiny_lm, kv_pool_tokens=512, block_size=4, max_context=128, max_batch=2, max_rows=6,
                             compile="off", prefix_caching=True)
    scorer = LocalScorer(target)
    _run(GenerationRequest(seq_id=11, prompt_ids=PROMPT, max_tokens=4), NgramProposer(min_ngram=1), scorer, 2)
    hits = target.prefix_hit_tokens
    _run(GenerationRequest(seq_id=12, prompt_ids=PROMPT, max_tokens=4), NgramProposer(min_ngram=1), scorer, 2)
    assert target.prefix_hit_tokens > hits  # the cache serves this prompt
    hits = target.prefix_hit_tokens
    rounds = _run(GenerationRequest(seq_id=13, prompt_ids=PROMPT, max_tokens=4, prompt_log_probs=True),
                  NgramProposer(min_ngram=1), scorer, 2)
    assert target.prefix_hit_tokens == hits  # not for the one to score
    with torch.no_grad():
        reference = torch.log_softmax(tiny_lm(torch.tensor([PROMPT])).logits[0, :-1].double(), -1)
    assert torch.allclose(torch.tensor(rounds[0].prompt_log_probs, dtype=torch.float64),
                          reference[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])], atol=1e-4)


@pytest.mark.parametrize("draft,k,temperature,branches,bans", [
    ("none", 0, 0.0, 1, False), ("draft_model", 3, 0.0, 2, False), ("draft_model", 3, 1.0, 1, False),
    ("ngram", 4, 0.8, 1, False), ("draft_model", 3, 0.0, 1, True)])
def test_each_token_carries_its_rank_in_the_raw_distribution(tiny_lm, draft, k, temperature, branches, bans):
    """log_ranks (vLLM's logprobs): each generated token's rank at its position, 1 + the tokens the target's
    raw distribution makes likelier, through chains, trees, sampled rounds and greedy rounds whose bans make
    the target's choice another token than its raw first."""
    proposer = (NgramProposer(min_ngram=1) if draft == "ngram" else
                LocalProposer(dynamic_executor(noisy_copy(tiny_lm)), branches=branches))
    free = _run(GenerationRequest(seq_id=8, prompt_ids=PROMPT, max_tokens=30), NgramProposer(min_ngram=1),
                LocalScorer(dynamic_executor(tiny_lm)), 0)
    banned = tuple((token,) for token in {t for rnd in free for t in rnd.new_tokens[:1]} | {free[3].new_tokens[0]})
    req = GenerationRequest(seq_id=9, prompt_ids=PROMPT, max_tokens=30, log_probs=True, log_ranks=True,
                            sampling=SamplingParams(temperature=temperature, seed=5), bad_words=banned if bans else ())

    async def main():
        policy = DraftLengthPolicy.fixed(k, branches=branches)
        return [rnd async for rnd in generate(req, proposer, LocalScorer(dynamic_executor(tiny_lm)), policy)]
    rounds = asyncio.run(main())
    output = [token for rnd in rounds for token in rnd.new_tokens]
    ranks = [rank for rnd in rounds for rank in rnd.ranks]
    assert all(len(rnd.ranks) == len(rnd.new_tokens) for rnd in rounds)
    with torch.no_grad():
        logits = tiny_lm(torch.tensor([PROMPT + output])).logits[0, len(PROMPT) - 1:-1].double()
    chosen = logits.gather(1, torch.tensor(output)[:, None])
    assert ranks == ((logits > chosen).sum(-1) + 1).tolist()
    if temperature or bans:  # tokens other than the raw first were generated and ranked as such
        assert max(ranks) > 1
    else:
        assert set(ranks) == {1}
    assert not GenerationRequest(seq_id=1, prompt_ids=[1], max_tokens=1, grammar=object(), log_ranks=True).target_picks


@pytest.mark.parametrize("draft,k,temperature,branches", [
    ("none", 0, 0.0, 1), ("draft_model", 3, 0.0, 1), ("draft_model", 4, 0.0, 2), ("ngram", 4, 0.8, 1),
    ("draft_model", 3, 1.0, 1)])
def test_generation_and_context_logits_are_the_targets_raw_logits(tiny_lm, draft, k, temperature, branches):
    """TensorRT-LLM's return_generation_logits / return_context_logits: each generated token's row of the
    target's raw logits (chains, trees, sampled rounds; under a grammar: test_grammar) and, in the first round,
    every prompt position's (the last one's the first verified position's); the generation is the one it is
    without asking."""
    def run(**asked):
        proposer = (NgramProposer(min_ngram=1) if draft == "ngram" else
                    LocalProposer(dynamic_executor(noisy_copy(tiny_lm)), branches=branches))
        req = GenerationRequest(seq_id=9, prompt_ids=PROMPT, max_tokens=24,
                                sampling=SamplingParams(temperature=temperature, seed=5), **asked)

        async def main():
            policy = DraftLengthPolicy.fixed(k, branches=branches)
            return [rnd async for rnd in generate(req, proposer, LocalScorer(dynamic_executor(tiny_lm)), policy)]
        return asyncio.run(main())
    rounds, plain = run(generation_logits=True, context_logits=True), run()
    output = [t for rnd in rounds for t in rnd.new_tokens]
    assert output == [t for rnd in plain for t in rnd.new_tokens] and len(output) > 4
    assert all(rnd.logits is None and rnd.prompt_logits is None for rnd in plain)
    assert all(rnd.prompt_logits is None for rnd in rounds[1:])
    with torch.no_grad():
        reference = tiny_lm(torch.tensor([PROMPT + output])).logits[0].float()  # (P + N, V)
    generated = torch.cat([rnd.logits for rnd in rounds])
    assert generated.shape == (len(output), reference.shape[-1])
    assert torch.allclose(generated, reference[len(PROMPT) - 1:-1], atol=1e-4)
    assert torch.allclose(rounds[0].prompt_logits, reference[:len(PROMPT)], atol=1e-4)
    if branches > 1:
        assert any(rnd.depth is not None and rnd.num_accepted for rnd in rounds)
    one = _run(GenerationRequest(seq_id=10, prompt_ids=PROMPT[:1], max_tokens=3, context_logits=True),
               NgramProposer(min_ngram=1), LocalScorer(dynamic_executor(tiny_lm)), k)
    with torch.no_grad():  # a one-token prompt: its one row, the first verified position's
        assert torch.allclose(one[0].prompt_logits, tiny_lm(torch.tensor([PROMPT[:1]])).logits[0].float(), atol=1e-4)
