"""The BLS messages (`wire.py`): each kind decodes to what was encoded, a quiet call carries the same input
set as a full one, and a malformed bitmask is refused naming the input."""

import numpy as np
import pytest
import torch

from specdec import tensor_names as tn
from specdec.decoding.interfaces import ForwardStats
from specdec.decoding.sampling import SamplingParams
from specdec.triton import wire


def test_a_step_round_trips_and_needs_its_ids():
    for message in (wire.StepMessage(5, [1, 2, 3], reserve=40), wire.StepMessage(0, [], release=True),
                    wire.StepMessage(0, [4], salt="tenant-7")):
        assert wire.StepMessage.decode(message.encode()) == message
    with pytest.raises(ValueError, match=tn.INPUT_IDS):
        wire.StepMessage.decode({tn.CACHE_LENGTH: np.zeros((1, 1), dtype=np.int32)})


def test_a_proposal_round_trips_with_its_sampling_settings_and_seed():
    for message in (wire.ProposeMessage(4, SamplingParams(), 0),
                    wire.ProposeMessage(2, SamplingParams(temperature=0.5, top_k=20, top_p=0.75, min_p=0.125), 2**63 + 5),
                    wire.ProposeMessage(8, SamplingParams(), 3, branches=3),
                    wire.ProposeMessage(4, SamplingParams(), 0, adapter="sql")):
        arrays = message.encode()
        assert arrays[tn.SEED].dtype == np.uint64 and arrays[tn.TEMPERATURE].dtype == np.float32
        assert wire.ProposeMessage.decode(arrays) == message
    # A direct caller that sends no settings: greedy, one token, unseeded.
    assert wire.ProposeMessage.decode({}) == wire.ProposeMessage(1, SamplingParams(), None)


def test_a_quiet_call_sends_the_same_input_set_as_a_full_one():
    assert set(wire.QUIET_PROPOSE.encode()) == set(wire.ProposeMessage(3, SamplingParams(temperature=1.0), 9).encode())
    bits = torch.tensor([[1, 2]], dtype=torch.int32)
    assert set(wire.QUIET_VERIFY.encode()) == set(wire.VerifyMessage(1, bits).encode())


def test_answers_round_trip():
    drafted = wire.DraftedMessage([7, 8, 9], 14)
    assert wire.DraftedMessage.decode(drafted.encode()) == drafted
    tree = wire.DraftedMessage([7, 8, 9], 14, (-1, -1, 0))  # a drafted tree: its parents go with it
    assert wire.DraftedMessage.decode(tree.encode()) == tree
    timed = wire.DraftedMessage([7], 9, None, ForwardStats(3, 3, 0.25))  # the draft's batched execution
    assert wire.DraftedMessage.decode(timed.encode()) == timed
    verified = wire.VerifiedMessage(np.array([3, 4], dtype=np.int32), ForwardStats(9, 2, 0.5),
                                    np.array([-0.25, -1.5], dtype=np.float32))
    back = wire.VerifiedMessage.decode(verified.encode())
    assert back.greedy_tokens.tolist() == [3, 4] and back.forward == verified.forward
    assert back.log_probs.tolist() == [-0.25, -1.5]
    bare = wire.VerifiedMessage.decode(wire.VerifiedMessage(np.array([5], dtype=np.int32)).encode())
    assert bare.forward is None and bare.log_probs is None and bare.cached_tokens is None
    first = wire.VerifiedMessage(np.array([5], dtype=np.int32), cached_tokens=32, block_size=16)  # a first answer
    back = wire.VerifiedMessage.decode(first.encode())
    assert (back.cached_tokens, back.block_size) == (32, 16)


def test_a_verify_round_trips_its_bitmask_and_refuses_a_bad_one():
    bits = torch.tensor([[0b110, -1], [-1, 7]], dtype=torch.int32)
    back = wire.VerifyMessage.decode(wire.VerifyMessage(2, bits).encode())
    assert back.num_logits == 2 and torch.equal(back.allowed, bits)
    assert wire.VerifyMessage.decode(wire.VerifyMessage(3).encode()) == wire.VerifyMessage(3)  # empty: every token
    with pytest.raises(ValueError, match=tn.ALLOWED_TOKENS):
        wire.VerifyMessage.decode(wire.VerifyMessage(3, bits).encode())  # 2 rows of bits for 3 positions


def test_a_verify_round_trips_its_tree_and_path_and_always_sends_them():
    message = wire.VerifyMessage(4, None, (-1, 0, 0, 1), (0, 2))
    assert wire.VerifyMessage.decode(message.encode()) == message
    encoded = wire.VerifyMessage(1).encode()
    assert encoded[tn.TREE_PARENTS].shape == encoded[tn.ACCEPTED_PATH].shape == (1, 0)  # one input set
    assert wire.VerifyMessage.decode(encoded).tree is None


def test_a_prompt_to_score_round_trips_its_rows_and_their_answer():
    message = wire.VerifyMessage(2, score_rows=9)
    assert wire.VerifyMessage.decode(message.encode()) == message
    chunk = wire.VerifyMessage(0, score_rows=4, score_next=17)  # a long prompt's chunk: the next token to score
    assert wire.VerifyMessage.decode(chunk.encode()) == chunk
    assert wire.VerifyMessage(1).encode()[tn.SCORE_ROWS].tolist() == [[0]]  # always sent: one input set
    for bad in (wire.VerifyMessage(2, score_rows=-1), wire.VerifyMessage(2, None, (-1, 0), score_rows=3)):
        with pytest.raises(ValueError, match=tn.SCORE_ROWS):  # a tree's rows are nodes, not a prompt
            wire.VerifyMessage.decode(bad.encode())
    answer = wire.VerifiedMessage(np.array([5], dtype=np.int32), scored_log_probs=np.array([-1.0, -2.5]),
                                  scored_top_ids=np.arange(40).reshape(2, 20), scored_top_log_probs=np.zeros((2, 20)),
                                  scored_ranks=np.array([1, 37]))
    back = wire.VerifiedMessage.decode(answer.encode())
    assert back.scored_ranks.tolist() == [1, 37]
    assert back.scored_log_probs.tolist() == [-1.0, -2.5] and back.scored_top_ids.tolist() == answer.scored_top_ids.tolist()
    assert back.scored_top_log_probs.shape == (2, 20) and back.log_probs is None
    bare = wire.VerifiedMessage.decode(wire.VerifiedMessage(np.array([5], dtype=np.int32)).encode())
    assert bare.scored_log_probs is None and bare.scored_ranks is None
