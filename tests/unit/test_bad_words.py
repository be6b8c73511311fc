"""bad_words: which tokens each verify position bans, and the decode loop under bans with real tiny models
(greedy speculative output equals greedy target-only decoding under the same bans; sampled output follows
the target's banned distribution)."""

import math
import random

import pytest
import torch
from specdec.decoding.bad_words import banned_tokens, mask_banned
from specdec.decoding.loop import GenerationRequest
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.decoding.sampling import SamplingParams
from specdec.engine.build import dynamic_executor
from specdec.engine.local import LocalProposer, LocalScorer

from .conftest import noisy_copy, run_fixed_k, run_fixed_k_many

PROMPT = [5, 17, 3, 5, 17, 3, 8, 40, 5, 17]


def _naive_bans(context, draft, bad_words, positions):
    """By definition: position j bans a word's last token where context + draft[:j] ends with the rest."""
    out = []
    for j in range(positions):
        before = list(context) + list(draft[:j])
        out.append([w[-1] for w in bad_words if len(w) == 1 or before[len(before) - (len(w) - 1):] == list(w[:-1])
                    and len(before) >= len(w) - 1])
    return out


def test_one_token_words_are_banned_everywhere_longer_ones_after_their_front():
    assert banned_tokens([1, 2], [4, 5], [(7,)], 3) == [[7], [7], [7]]
    # (5, 17, 3): 3 is banned right after 5, 17 (in the context, in the draft, across the boundary).
    assert banned_tokens([1, 5, 17], [9, 5, 17], [(5, 17, 3)], 4) == [[3], [], [], [3]]
    assert banned_tokens([1, 5], [17, 9], [(5, 17, 3)], 3) == [[], [3], []]
    assert banned_tokens([17], [], [(5, 17, 3)], 1) == [[]]  # too little before it
    # A context shorter than the longest word's front still counts whole (not only its last tokens).
    assert banned_tokens([5, 17], [], [(5, 17, 3), (1, 2, 3, 4)], 1) == [[3]]
    assert banned_tokens([1, 2], [3], [], 2) == [[], []]


def test_bans_match_the_definition_on_random_cases():
    rng = random.Random(0)
    for _ in range(500):
        context = [rng.randrange(4) for _ in range(rng.randrange(0, 8))]
        draft = [rng.randrange(4) for _ in range(rng.randrange(0, 5))]
        words = [tuple(rng.randrange(4) for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        positions = len(draft) + 1
        assert banned_tokens(context, draft, words, positions) == _naive_bans(context, draft, words, positions), \
            (context, draft, words)


def test_mask_sets_banned_logits_to_minus_infinity_in_a_copy():
    logits = torch.zeros(3, 5)
    masked = mask_banned(logits, [[1], [], [4, 9]])  # 9 is beyond the vocabulary: no model produces it
    assert masked[0, 1] == float("-inf") and masked[2, 4] == float("-inf")
    assert torch.isinf(masked).sum() == 2 and not torch.isinf(logits).any()
    assert mask_banned(logits, [[], [], []]) is logits


def _reference_greedy(model, prompt, n, bad_words):
    """Greedy decoding one token at a time over the whole sequence, banned tokens masked by definition."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            for token in _naive_bans(tokens, [], bad_words, 1)[0]:
                logits[token] = float("-inf")
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def _contains(output, word):
    return any(tuple(output[i:i + len(word)]) == tuple(word) for i in range(len(output) - len(word) + 1))


@pytest.mark.parametrize("draft,k", [("none", 0), ("draft_model", 3), ("ngram", 4)])
def test_greedy_speculation_under_bans_is_greedy_target_decoding_under_them(tiny_lm, draft, k):
    plain = run_fixed_k(GenerationRequest(seq_id=1, prompt_ids=PROMPT, max_tokens=30), NgramProposer(),
                 LocalScorer(dynamic_executor(tiny_lm)), 0)
    # Ban what greedy decoding does produce: a one-token word and a two-token word of its output.
    bad_words = ((plain[2],), (plain[6], plain[7]))
    proposer = NgramProposer(min_ngram=1) if draft == "ngram" else LocalProposer(dynamic_executor(noisy_copy(tiny_lm)))
    output = run_fixed_k(GenerationRequest(seq_id=2, prompt_ids=PROMPT, max_tokens=30, bad_words=bad_words),
                  proposer, LocalScorer(dynamic_executor(tiny_lm)), k)
    assert output != plain
    assert output == _reference_greedy(tiny_lm, PROMPT, 30, bad_words)
    assert not any(_contains(output, word) for word in bad_words)


def test_sampled_speculation_follows_the_targets_banned_distribution(tiny_lm):
    """The first token of K=1 rounds (accepted draft tokens and resampled ones) against the target's
    softmax with the banned logits removed; the banned tokens never appear."""
    with torch.no_grad():
        logits = tiny_lm(torch.tensor([PROMPT])).logits[0, -1].float()
    order = logits.argsort(descending=True).tolist()
    # The target's favourite banned everywhere; its second banned only right after PROMPT[-1].
    bad_words = ((order[0],), (PROMPT[-1], order[1]))
    masked = logits.clone()
    masked[order[:2]] = float("-inf")
    expected = torch.softmax(masked.double(), -1)
    target, proposer = dynamic_executor(tiny_lm), LocalProposer(dynamic_executor(noisy_copy(tiny_lm)))
    n = 1500
    counts = torch.zeros(len(expected), dtype=torch.float64)
    seconds = []
    requests = [GenerationRequest(seq_id=10 + seed, prompt_ids=PROMPT, max_tokens=2, bad_words=bad_words,
                                  sampling=SamplingParams(temperature=1.0, seed=seed)) for seed in range(n)]
    for out in run_fixed_k_many(requests, proposer, LocalScorer(target), 1):
        counts[out[0]] += 1
        seconds.append(out[1])
    assert counts[order[0]] == counts[order[1]] == 0 and order[0] not in seconds
    tv = 0.5 * (counts / n - expected).abs().sum().item()
    # The total variation a sample of n draws from `expected` shows on average, and a wide margin over it.
    noise = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in expected.tolist())
    assert tv < 2 * noise + 0.01, (tv, noise)
    # The bans matter: the unbanned target puts far more than that margin on the two banned tokens.
    assert torch.softmax(logits.double(), -1)[order[:2]].sum() > 4 * (2 * noise + 0.01)
