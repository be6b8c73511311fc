"""OpenAI's Predicted Outputs as a draft (decoding/prediction_proposer.py): the prediction's next tokens while the
answer follows it, prompt lookup over prediction, prompt and answer once they part; exact whatever it predicts."""

import asyncio

from specdec.decoding.loop import GenerationRequest, Stats
from specdec.decoding.prediction_proposer import PredictionProposer
from specdec.decoding.sampling import SamplingParams
from specdec.engine.build import dynamic_executor
from specdec.engine.local import LocalScorer

from .conftest import run_fixed_k

PREDICTION = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]


def drafts(proposer, calls):
    return [asyncio.run(proposer.propose(1, keep, new, k, SamplingParams(), 0)).tokens for keep, new, k in calls]


def test_the_prediction_drafts_while_the_answer_follows_it_and_lookup_finds_its_place_after_an_edit():
    proposer = PredictionProposer(PREDICTION, prompt_length=3)
    assert drafts(proposer, [
        (0, [1, 2, 3], 4),       # no answer yet: the prediction's opening
        (3, [10, 11, 12], 4),    # in step: its next tokens
        (6, [99, 14], 4),        # an edit (99), no 2-gram of the answer's end in the prediction yet: none
        (8, [15, 16], 4),        # the answer rejoins it (14 15 16): what followed there
        (5, [13], 4),            # rolled back to 10 11, then 13: no longer the prediction's beginning
        (5, [12], 4),            # rolled back again and in step: the prediction's next tokens again
    ]) == [[10, 11, 12, 13], [13, 14, 15, 16], [], [17, 18, 19], [], [13, 14, 15, 16]]


def test_no_draft_crosses_from_the_prediction_into_the_prompt():
    proposer = PredictionProposer([5, 6, 7], prompt_length=2)
    # the answer 9 5 6 7 diverged at once; its suffix 6 7 ends the prediction: nothing follows it there
    assert drafts(proposer, [(0, [8, 9], 2), (2, [9, 5, 6, 7], 3)]) == [[5, 6], []]


def test_greedy_output_is_the_targets_whatever_the_prediction(tiny_lm):
    """Right, partly right (an edit in the middle) and wrong predictions: the output equals target-only decoding;
    the right one drafts every token but each round's last (the target's own), and all are accepted."""
    prompt = [5, 17, 3, 88, 41, 2, 9]
    plain = run_fixed_k(GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=24), PredictionProposer([], 7),
                        LocalScorer(dynamic_executor(tiny_lm)), 0)
    edited = plain[:10] + [(plain[10] + 1) % 97] + plain[11:]
    for prediction, accepted_at_least in ((plain, 19), (edited, 12), ([1, 2, 3] * 8, 0)):
        stats = Stats()
        out = run_fixed_k(GenerationRequest(seq_id=2, prompt_ids=prompt, max_tokens=24),
                          PredictionProposer(prediction, len(prompt)), LocalScorer(dynamic_executor(tiny_lm)), 4,
                          stats=stats)
        assert out == plain
        assert stats.accepted >= accepted_at_least, (prediction, stats)
