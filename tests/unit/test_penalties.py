"""Repetition, presence and frequency penalties: the logits of each verify position against the definition
and transformers, and the decode loop with real tiny models (greedy speculative output equals greedy
target-only decoding under the same penalties; sampled output follows the penalised target)."""

import itertools
import math
import random

import pytest
import torch
from specdec.decoding.loop import GenerationRequest
from specdec.decoding.penalties import Penalties, TokenOccurrences, penalize
from specdec.decoding.sampling import SamplingParams
from specdec.engine.build import dynamic_executor
from specdec.engine.local import LocalProposer, LocalScorer
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from .conftest import greedy_plain_and_edited, noisy_copy, run_fixed_k, run_fixed_k_many, tiny_llama

PROMPT = [5, 17, 3, 5, 17, 3, 8, 40, 5, 17]


def _naive(logits_row, context, generated, penalties):
    """One position by the definition: repetition over context (prompt + output), then frequency and presence
    over the output."""
    out = logits_row.clone()
    for token in set(context):
        out[token] = out[token] / penalties.repetition if out[token] > 0 else out[token] * penalties.repetition
    for token in set(generated):
        out[token] -= penalties.frequency * generated.count(token) + penalties.presence
    return out


def _penalize(logits, prompt, generated, draft, penalties):
    """penalize over the occurrences of prompt + generated, as the loop calls it."""
    occurrences = TokenOccurrences(prompt)
    occurrences.add_output(generated)
    return penalize(logits, *occurrences.rows(draft, logits.shape[0], logits.shape[1]), penalties)


def test_a_position_is_penalised_by_the_definition():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = _penalize(logits, prompt=[1], generated=[3, 3], draft=[], penalties=Penalties(2.0, 0.25, 0.5))
    # 1 (prompt only): -1 * 2; 3 (twice in the output): 3 / 2 - 0.5 * 2 - 0.25; the rest unchanged.
    assert out.tolist() == [[2.0, -2.0, 0.5, 0.25]]
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0]]  # a copy
    assert not Penalties().active and Penalties(presence=0.1).active


def test_verify_positions_count_the_drafts_before_them_on_random_cases():
    rng = random.Random(0)
    for _ in range(300):
        width = rng.choice([3, 6, 9])
        prompt = [rng.randrange(width + 2) for _ in range(rng.randrange(1, 6))]  # ids >= width: ignored
        generated = [rng.randrange(width) for _ in range(rng.randrange(0, 6))]
        draft = [rng.randrange(width) for _ in range(rng.randrange(0, 5))]
        penalties = Penalties(rng.choice([1.0, 0.5, 1.7]), rng.choice([0.0, -0.4, 1.1]), rng.choice([0.0, 0.3, -2.0]))
        logits = torch.randn(len(draft) + 1, width, dtype=torch.float64)
        logits[0, 0] = 0.0
        out = _penalize(logits, prompt, generated, draft, penalties)
        for j in range(len(draft) + 1):
            output = generated + draft[:j]
            expected = _naive(logits[j], [t for t in prompt if t < width] + output, output, penalties)
            torch.testing.assert_close(out[j], expected, rtol=0, atol=1e-12)


def test_repetition_is_transformers_repetition_penalty_and_half_precision_is_computed_in_float32():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    prompt, generated, draft = [4, 9, 4], [11, 0], [30, 9]
    ours = _penalize(logits.to(torch.bfloat16), prompt, generated, draft, Penalties(repetition=1.3))
    assert ours.dtype == torch.float32
    for j in range(3):
        ids = torch.tensor([prompt + generated + draft[:j]])
        theirs = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.to(torch.bfloat16)[j:j + 1].float())
        torch.testing.assert_close(ours[j], theirs[0], rtol=0, atol=0)


def test_occurrences_grow_with_the_output_and_a_round_sees_its_drafts():
    occurrences = TokenOccurrences([4, 2, 4])
    occurrences.add_output([2, 7, 7])
    assert (occurrences.ids.tolist(), occurrences.counts.tolist()) == ([4, 2, 7], [0, 1, 2])
    columns, counts, present = occurrences.rows([9, 7, 9], positions=4, width=10)
    assert columns.tolist() == [4, 2, 7, 9]
    assert counts.tolist() == [[0, 1, 2, 0], [0, 1, 2, 1], [0, 1, 3, 1], [0, 1, 3, 2]]
    assert present.tolist() == [[True, True, True, False], [True] * 4, [True] * 4, [True] * 4]
    columns, counts, present = occurrences.rows([9], positions=2, width=8)  # 9: no column in 8 logits
    assert columns.tolist() == [4, 2, 7] and counts.shape == present.shape == (2, 3)


def _reference_greedy(model, prompt, n, penalties):
    """Greedy decoding one token at a time over the whole sequence, penalised by definition."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            output = tokens[len(prompt):]
            tokens.append(int(_naive(model(torch.tensor([tokens])).logits[0, -1], tokens, output, penalties).argmax()))
    return tokens[len(prompt):]


PENALTIES = Penalties(repetition=1.5, presence=0.5, frequency=0.8)


@pytest.mark.parametrize("draft,k", [("none", 0), ("draft_model", 3), ("ngram", 4)])
def test_greedy_speculation_under_penalties_is_greedy_target_decoding_under_them(tiny_lm, draft, k):
    plain, output = greedy_plain_and_edited(tiny_lm, PROMPT, draft, k, 30, penalties=PENALTIES)
    assert output != plain
    assert output == _reference_greedy(tiny_lm, PROMPT, 30, PENALTIES)


def test_greedy_repetition_penalty_matches_transformers_generate(tiny_lm):
    with torch.no_grad():
        theirs = tiny_lm.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, repetition_penalty=1.4,
                                  attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                  pad_token_id=0, eos_token_id=None)[0, len(PROMPT):].tolist()
    ours = run_fixed_k(GenerationRequest(seq_id=3, prompt_ids=PROMPT, max_tokens=24, penalties=Penalties(repetition=1.4)),
                LocalProposer(dynamic_executor(noisy_copy(tiny_lm))), LocalScorer(dynamic_executor(tiny_lm)), 3)
    assert ours == theirs


@pytest.fixture(scope="module")
def small_vocab_lm():
    """A tiny llama with 8 token ids, so the exact distribution of three sampled tokens can be enumerated."""
    return tiny_llama(8, seed=3, initializer_range=0.3, max_positions=64)


def _exact_joint(model, prompt, penalties, length):
    """P(t_1..t_length) of sampling the penalised target one token at a time (temperature 1), by enumeration."""
    width = model.config.vocab_size
    joint = {(): 1.0}
    with torch.no_grad():
        for _ in range(length):
            prefixes = list(joint)
            logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
            nxt = {}
            for prefix, row in zip(prefixes, logits):
                probs = torch.softmax(_naive(row, prompt + list(prefix), list(prefix), penalties), -1)
                for token in range(width):
                    nxt[prefix + (token,)] = joint[prefix] * float(probs[token])
            joint = nxt
    return joint


def _tv(counts, expected, n):
    return 0.5 * sum(abs(counts.get(key, 0) / n - p) for key, p in expected.items())


def test_sampled_speculation_follows_the_penalised_target(small_vocab_lm):
    """Three tokens drafted two at a time (accepted drafts, resampled and bonus tokens at every verify
    position) against the exact distribution of sampling the penalised target token by token: the joint of
    the first two, and the third (whose position follows two drafts when both were accepted)."""
    prompt = [1, 2, 3, 1]
    penalties = Penalties(repetition=1.6, presence=0.7, frequency=1.2)
    exact = _exact_joint(small_vocab_lm, prompt, penalties, 3)
    pairs = {key: sum(p for full, p in exact.items() if full[:2] == key) for key in itertools.product(range(8), repeat=2)}
    thirds = {(t,): sum(p for full, p in exact.items() if full[2] == t) for t in range(8)}
    target, proposer = dynamic_executor(small_vocab_lm), LocalProposer(dynamic_executor(noisy_copy(small_vocab_lm)))
    n = 3000
    seen_pairs, seen_thirds = {}, {}
    requests = [GenerationRequest(seq_id=100 + seed, prompt_ids=prompt, max_tokens=3, penalties=penalties,
                                  sampling=SamplingParams(temperature=1.0, seed=seed)) for seed in range(n)]
    for out in run_fixed_k_many(requests, proposer, LocalScorer(target), 2):
        seen_pairs[tuple(out[:2])] = seen_pairs.get(tuple(out[:2]), 0) + 1
        seen_thirds[(out[2],)] = seen_thirds.get((out[2],), 0) + 1
    unpenalised = _exact_joint(small_vocab_lm, prompt, Penalties(), 3)
    plain_pairs = {key: sum(p for full, p in unpenalised.items() if full[:2] == key) for key in pairs}
    for seen, expected, plain in ((seen_pairs, pairs, plain_pairs), (seen_thirds, thirds, None)):
        # The total variation a sample of n draws from `expected` shows on average, and a wide margin over it.
        noise = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in expected.values())
        bound = 2 * noise + 0.01
        assert _tv(seen, expected, n) < bound, (_tv(seen, expected, n), noise)
        if plain is not None:  # the penalties matter: without them the pairs are far outside that bound
            assert 0.5 * sum(abs(plain[key] - expected[key]) for key in expected) > 3 * bound
