"""What the orchestrator's BLS proposer and scorer send the models, with a stand-in for pb_utils (the
stub's module exists only inside a server): one input set per model, whatever the call; long prompts in
chunks; a grammar's bitmask with a verify."""

import asyncio

import numpy as np
import pytest
import torch

from specdec import tensor_names as tn
from specdec.decoding.interfaces import DraftAsk, VerifyCall
from specdec.decoding.sampling import SamplingParams
from specdec.triton.bls import BlsProposer, BlsScorer, ModelUnavailable

from .conftest import FakeTensor


class _Tensor(FakeTensor):
    def is_cpu(self):
        return True


class _Pb:
    """The parts of pb_utils a BLS call uses; records each request's inputs and answers two draft tokens."""

    TRITONSERVER_REQUEST_FLAG_SEQUENCE_START, TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 1, 2
    Tensor = _Tensor

    def __init__(self):
        self.sent = []
        self.asked = set()  # every output name requested

    def InferenceRequest(self, model_name, inputs, requested_output_names, correlation_id, flags, timeout):  # noqa: N802
        sent = {t.name(): t.as_numpy() for t in inputs}
        self.sent.append(sent)
        self.asked.update(requested_output_names)
        # What the draft model's executor reports: every drafted token but the last runs through its cache.
        cached = sent[tn.CACHE_LENGTH].item() + sent[tn.INPUT_IDS].size + sent.get(tn.NUM_DRAFT_TOKENS, np.ones(1)).item() - 1
        outputs = {tn.DRAFT_TOKENS: _Tensor(tn.DRAFT_TOKENS, [[3, 4]]),
                   tn.CACHED_LENGTH: _Tensor(tn.CACHED_LENGTH, [[cached]]),
                   tn.DRAFT_PARENTS: _Tensor(tn.DRAFT_PARENTS, np.zeros((1, 0), dtype=np.int32)),
                   tn.DRAFT_PROBS: _Tensor(tn.DRAFT_PROBS, np.full((1, 2, 5), 0.2, dtype=np.float32)),
                   tn.GREEDY_TOKENS: _Tensor(tn.GREEDY_TOKENS, [[7, 8]]),
                   # each scored row's position, negated: the order of a chunked prompt's scores shows
                   tn.SCORED_LOG_PROBS: _Tensor(tn.SCORED_LOG_PROBS, -(sent[tn.CACHE_LENGTH].item() + np.arange(
                       sent[tn.SCORE_ROWS].item(), dtype=np.float32))[None]) if tn.SCORE_ROWS in sent else None,
                   tn.SCORED_RANKS: _Tensor(tn.SCORED_RANKS, (sent[tn.CACHE_LENGTH].item() + 1 + np.arange(
                       sent[tn.SCORE_ROWS].item(), dtype=np.int32))[None]) if tn.SCORE_ROWS in sent else None,
                   # each score row's logits: its position in every column (1, rows, 3)
                   tn.SCORED_LOGITS: _Tensor(tn.SCORED_LOGITS, np.repeat((sent[tn.CACHE_LENGTH].item() + np.arange(
                       sent[tn.SCORE_ROWS].item(), dtype=np.float32))[None, :, None], 3, 2))
                   if tn.SCORE_ROWS in sent else None,
                   tn.FORWARD_STATS: _Tensor(tn.FORWARD_STATS, [[2, 1, 0.01]]),
                   tn.DRAFT_STATS: _Tensor(tn.DRAFT_STATS, [[6, 1, 0.002]]),
                   # as if the prefix cache held 8 tokens, in blocks of 4
                   tn.CACHED_TOKENS: _Tensor(tn.CACHED_TOKENS, [[8, 4]])}

        class _Response:
            def has_error(self):
                return False

        class _Request:
            async def async_exec(self):
                response = _Response()
                response.outputs = {name: outputs[name] for name in requested_output_names}
                return response

        return _Request()

    @staticmethod
    def get_output_tensor_by_name(response, name):
        return response.outputs[name]


def _input_sets(sent):
    return {frozenset(call) for call in sent}


def test_every_draft_call_carries_one_input_set_with_the_sampling_settings_greedy_or_not():
    """Triton's sequence batcher runs requests together only when they carry the same inputs: greedy and
    sampled proposals, first calls and later ones all send the same set (greedy settings included)."""
    pb = _Pb()
    proposer = BlsProposer(pb, tn.DRAFT_MODEL_NAME)
    greedy = asyncio.run(proposer.propose(1, 0, [1, 2], 2, SamplingParams(), 0, reserve=30))
    assert greedy.tokens == [3, 4] and greedy.probs is None
    assert pb.sent[-1][tn.TEMPERATURE].item() == 0.0 and pb.sent[-1][tn.RESERVE_TOKENS].item() == 30
    sampled = asyncio.run(proposer.propose(1, 2, [5], 2, SamplingParams(temperature=0.9, top_p=0.8, min_p=0.1), 7))
    assert sampled.probs.shape == (2, 5) and isinstance(sampled.probs, torch.Tensor)
    sent = pb.sent[-1]
    assert sent[tn.MIN_P].dtype == np.float32 and sent[tn.MIN_P].item() == np.float32(0.1)
    assert (sent[tn.TEMPERATURE].item(), sent[tn.SEED].item(), sent[tn.RESERVE_TOKENS].item()) == (np.float32(0.9), 7, 0)
    asyncio.run(proposer.propose(1, 4, [6], 2, SamplingParams(temperature=0.9), 8))
    assert pb.sent[-1][tn.MIN_P].item() == 0.0 and not pb.sent[-1][tn.RELEASE].item()
    asyncio.run(proposer.release(1))
    assert pb.sent[-1][tn.RELEASE].item() and pb.sent[-1][tn.NUM_DRAFT_TOKENS].item() == 0
    assert _input_sets(pb.sent) == {frozenset([tn.INPUT_IDS, tn.CACHE_LENGTH, tn.RESERVE_TOKENS, tn.RELEASE,
                                               tn.CACHE_SALT,
                                               tn.NUM_DRAFT_TOKENS, tn.NUM_DRAFT_BRANCHES, tn.TEMPERATURE, tn.TOP_K,
                                               tn.TOP_P, tn.MIN_P, tn.SEED, tn.LORA_NAME])}


def test_a_requests_adapter_goes_with_each_of_its_draft_calls_a_prompts_chunks_included():
    """A draft made of the target's layers takes a sequence's adapter at its first call: a long prompt's
    chunks (the first call) carry it as the drafting call does; without one the name is empty."""
    pb = _Pb()
    proposer = BlsProposer(pb, tn.DRAFT_MODEL_NAME, prefill_chunk=4)
    assert proposer.adapts
    asyncio.run(proposer.propose(1, 0, list(range(1, 12)), 2, SamplingParams(), 0, reserve=30, adapter="sql"))
    assert len(pb.sent) > 1 and all(call[tn.LORA_NAME].reshape(-1)[0] == b"sql" for call in pb.sent)
    asyncio.run(proposer.propose(2, 0, [1, 2], 2, SamplingParams(), 0))
    assert pb.sent[-1][tn.LORA_NAME].reshape(-1)[0] == b""
    assert not BlsProposer(pb, "head", wants_features=True).adapts  # a head drafts from the adapted features


def test_a_requests_cache_salt_goes_with_every_call_of_both_models_its_prompts_chunks_too():
    pb = _Pb()
    scorer, proposer = BlsScorer(pb, tn.TARGET_MODEL_NAME, prefill_chunk=4), BlsProposer(pb, tn.DRAFT_MODEL_NAME,
                                                                                     prefill_chunk=4)
    assert proposer.salted
    asyncio.run(scorer.score(VerifyCall(1, 0, list(range(1, 12)), 1, reserve=30, salt="tenant-1")))
    asyncio.run(proposer.propose(1, 0, list(range(1, 12)), 2, SamplingParams(), 0, reserve=30, salt="tenant-1"))
    assert len(pb.sent) == 6 and all(call[tn.CACHE_SALT].reshape(-1)[0] == b"tenant-1" for call in pb.sent)


def test_a_long_prompt_goes_in_chunks_that_ask_for_nothing_the_first_taking_the_room():
    pb = _Pb()
    scorer, proposer = BlsScorer(pb, tn.TARGET_MODEL_NAME, prefill_chunk=4), BlsProposer(pb, tn.DRAFT_MODEL_NAME,
                                                                                     prefill_chunk=4)
    prompt = list(range(1, 12))  # 11 tokens
    scores = asyncio.run(scorer.score(VerifyCall(1, 0, prompt + [50, 51], 2, reserve=40)))
    assert scores.greedy_tokens.tolist() == [7, 8] and (scores.cached_tokens, scores.block_size) == (8, 4)  # asked
    # on its first verify
    sent = [{name: value.reshape(-1).tolist() for name, value in call.items()} for call in pb.sent]
    assert sent == [
        {tn.INPUT_IDS: [1, 2, 3, 4], tn.CACHE_LENGTH: [0], tn.RESERVE_TOKENS: [40], tn.NUM_LOGITS: [0],
         tn.RELEASE: [False], tn.ALLOWED_TOKENS: [], tn.TREE_PARENTS: [], tn.ACCEPTED_PATH: [],
         tn.SCORE_ROWS: [0], tn.SCORE_NEXT: [-1], tn.LORA_NAME: [b""], tn.CACHE_SALT: [b""],
         tn.DRAFT_HEAD: [b""], tn.DRAFT_ASK: [0.0] * 7},
        {tn.INPUT_IDS: [5, 6, 7, 8], tn.CACHE_LENGTH: [4], tn.RESERVE_TOKENS: [0], tn.NUM_LOGITS: [0],
         tn.RELEASE: [False], tn.ALLOWED_TOKENS: [], tn.TREE_PARENTS: [], tn.ACCEPTED_PATH: [],
         tn.SCORE_ROWS: [0], tn.SCORE_NEXT: [-1], tn.LORA_NAME: [b""], tn.CACHE_SALT: [b""],
         tn.DRAFT_HEAD: [b""], tn.DRAFT_ASK: [0.0] * 7},
        # at most 4 + 2 tokens
        {tn.INPUT_IDS: [9, 10, 11, 50, 51], tn.CACHE_LENGTH: [8], tn.RESERVE_TOKENS: [0], tn.NUM_LOGITS: [2],
         tn.RELEASE: [False], tn.ALLOWED_TOKENS: [], tn.TREE_PARENTS: [], tn.ACCEPTED_PATH: [],
         tn.SCORE_ROWS: [0], tn.SCORE_NEXT: [-1], tn.LORA_NAME: [b""], tn.CACHE_SALT: [b""],
         tn.DRAFT_HEAD: [b""], tn.DRAFT_ASK: [0.0] * 7},
    ]
    pb.sent.clear()
    proposal = asyncio.run(proposer.propose(2, 0, prompt, 2, SamplingParams(), 0, reserve=40))
    assert proposal.tokens == [3, 4] and proposal.cached_length == 11 + 2 - 1
    assert [call[tn.NUM_DRAFT_TOKENS].item() for call in pb.sent] == [0, 0, 2]
    assert [call[tn.CACHE_LENGTH].item() for call in pb.sent] == [0, 4, 8]
    assert [call[tn.RESERVE_TOKENS].item() for call in pb.sent] == [40, 0, 0]
    assert len(_input_sets(pb.sent)) == 1  # chunks carry the step's input set
    pb.sent.clear()
    later = asyncio.run(scorer.score(VerifyCall(1, 13, [52], 1)))  # a round: one call, as without chunks
    assert later.cached_tokens is None  # not asked again
    asyncio.run(BlsScorer(pb, tn.TARGET_MODEL_NAME).score(VerifyCall(3, 0, prompt, 1)))  # 0: off
    assert [len(call[tn.INPUT_IDS].reshape(-1)) for call in pb.sent] == [1, 11]
    # A tree goes whole, its parents and the last tree's accepted path with it (target_model runs the
    # leading chain ahead itself)
    pb.sent.clear()
    tree = tuple(range(-1, 10)) + (10, 10)
    asyncio.run(scorer.score(VerifyCall(4, 0, prompt + [50, 51], 3, reserve=40, tree=tree)))
    asyncio.run(scorer.score(VerifyCall(4, 13, [52], 1, path=tuple(range(11)) + (12,))))
    assert [call[tn.INPUT_IDS].reshape(-1).tolist() for call in pb.sent] == [prompt + [50, 51], [52]]
    assert pb.sent[0][tn.TREE_PARENTS].reshape(-1).tolist() == list(tree) and pb.sent[0][tn.ACCEPTED_PATH].size == 0
    assert pb.sent[1][tn.ACCEPTED_PATH].reshape(-1).tolist() == list(range(11)) + [12]
    assert pb.sent[1][tn.TREE_PARENTS].size == 0
    # A prompt to score goes in chunks that score every row, the last against the next chunk's first token;
    # the rest with the verified positions; the scores in order
    pb.sent.clear()
    scores = asyncio.run(scorer.score(VerifyCall(5, 0, prompt + [50], 2, reserve=40, score_rows=10)))
    assert [call[tn.INPUT_IDS].reshape(-1).tolist() for call in pb.sent] == [[1, 2, 3, 4], [5, 6, 7, 8],
                                                                             [9, 10, 11, 50]]
    assert [(c[tn.SCORE_ROWS].item(), c[tn.SCORE_NEXT].item(), c[tn.NUM_LOGITS].item(), c[tn.RESERVE_TOKENS].item())
            for c in pb.sent] == [(4, 5, 0, 40), (4, 9, 0, 0), (2, -1, 2, 0)]
    assert scores.scored.log_probs.tolist() == [-float(i) for i in range(10)] and scores.scored.top_ids is None
    assert scores.scored.ranks.tolist() == list(range(1, 11))  # the chunks' ranks joined in order too
    assert scores.scored.logits is None and tn.SCORED_LOGITS not in pb.asked  # not asked for
    pb.sent.clear()
    logged = asyncio.run(scorer.score(VerifyCall(7, 0, prompt + [50], 2, reserve=40, score_rows=10, score_logits=True)))
    assert logged.scored.logits.tolist() == [[float(i)] * 3 for i in range(10)]  # the chunks' rows joined in order
    assert len(_input_sets(pb.sent)) == 1
    pb.sent.clear()
    asyncio.run(BlsScorer(pb, tn.TARGET_MODEL_NAME).score(VerifyCall(6, 0, prompt, 1, score_rows=10)))  # no chunks
    assert len(pb.sent) == 1 and pb.sent[0][tn.SCORE_ROWS].item() == 10
    pb.sent.clear()
    asyncio.run(scorer.score(VerifyCall(3, 0, prompt + [50], 1, reserve=40, adapter="sql")))  # every chunk names it
    assert [call[tn.LORA_NAME].reshape(-1).tolist() for call in pb.sent] == [[b"sql"]] * 3


def test_a_grammar_bitmask_goes_with_the_verify_and_no_logits_come_back():
    pb = _Pb()
    bits = torch.tensor([[0b110, -1], [-1, 7]], dtype=torch.int32)
    scorer = BlsScorer(pb, tn.TARGET_MODEL_NAME)
    scores = asyncio.run(scorer.score(VerifyCall(1, 3, [5, 6], 2, allowed=bits)))
    assert scores.greedy_tokens.tolist() == [7, 8] and scores.logits is None
    sent = pb.sent[-1][tn.ALLOWED_TOKENS]
    assert sent.dtype == np.int32 and sent.shape == (1, 2, 2) and sent[0].tolist() == bits.tolist()
    asyncio.run(scorer.score(VerifyCall(1, 5, [7], 1)))
    assert pb.sent[-1][tn.ALLOWED_TOKENS].size == 0 and pb.sent[-1][tn.NUM_LOGITS].item() == 1  # every token
    asyncio.run(scorer.release(1))
    assert pb.sent[-1][tn.RELEASE].item() and pb.sent[-1][tn.NUM_LOGITS].item() == 0
    assert _input_sets(pb.sent) == {frozenset([tn.INPUT_IDS, tn.CACHE_LENGTH, tn.RESERVE_TOKENS, tn.RELEASE,
                                               tn.CACHE_SALT,
                                               tn.NUM_LOGITS, tn.ALLOWED_TOKENS, tn.TREE_PARENTS,
                                               tn.ACCEPTED_PATH, tn.SCORE_ROWS, tn.SCORE_NEXT, tn.LORA_NAME,
                                               tn.DRAFT_HEAD, tn.DRAFT_ASK])}


class _StallingPb(_Pb):
    """Its model hangs while `stalled` is set: calls are answered only once `answer` is set."""

    def __init__(self):
        super().__init__()
        self.stalled = False
        self.answer: asyncio.Event | None = None

    def InferenceRequest(self, *args, **kwargs):  # noqa: N802
        request, pb = super().InferenceRequest(*args, **kwargs), self
        if not self.stalled:
            return request

        class _Hanging:
            async def async_exec(self):
                await pb.answer.wait()
                return await request.async_exec()
        return _Hanging()


def test_a_call_the_model_leaves_unanswered_fails_after_the_timeout_and_the_model_counts_as_stalled_until_it_answers():
    """model_call_timeout_s: a hung model (its stub alive, not answering) fails the call instead of holding the
    request for ever; further calls fail at once while the first is unanswered (no pile of waits); once the
    model answers it is called again."""
    pb, timed_out = _StallingPb(), []
    scorer = BlsScorer(pb, tn.TARGET_MODEL_NAME, call_timeout_s=0.2, on_timeout=timed_out.append)
    verify = VerifyCall(1, 0, [1, 2, 3], 1)

    async def scenario():
        pb.answer = asyncio.Event()
        assert (await scorer.score(verify)).greedy_tokens.tolist() == [7, 8]  # answered: no timeout
        pb.stalled = True
        started = asyncio.get_running_loop().time()
        try:
            await scorer.score(verify)
            raise AssertionError("the call did not time out")
        except ModelUnavailable as exc:
            assert "target_model: no answer in 0.2 s" in str(exc)
        assert 0.2 <= asyncio.get_running_loop().time() - started < 1.0
        assert timed_out == [tn.TARGET_MODEL_NAME] and scorer.overdue == 1
        started = asyncio.get_running_loop().time()
        for call in (scorer.score(verify), scorer.release(1)):  # at once, no second wait
            try:
                await call
                raise AssertionError("a stalled model's call went through")
            except ModelUnavailable as exc:
                assert "not answering" in str(exc)
        assert asyncio.get_running_loop().time() - started < 0.1 and timed_out == [tn.TARGET_MODEL_NAME]
        pb.stalled = False
        pb.answer.set()  # the overdue call is answered at last (or fails: its stub was killed)
        await asyncio.sleep(0.01)
        assert scorer.overdue == 0
        assert (await scorer.score(verify)).greedy_tokens.tolist() == [7, 8]

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_without_a_call_timeout_a_slow_answer_is_waited_for():
    pb = _StallingPb()
    scorer = BlsScorer(pb, tn.TARGET_MODEL_NAME)

    async def scenario():
        pb.answer, pb.stalled = asyncio.Event(), True
        asyncio.get_running_loop().call_later(0.3, pb.answer.set)
        assert (await scorer.score(VerifyCall(1, 0, [1, 2, 3], 1))).greedy_tokens.tolist() == [7, 8]

    asyncio.run(scenario())


def test_a_hosted_heads_ask_goes_with_the_verify_and_its_chunks_and_its_proposal_comes_back():
    """A head hosted in target_model: the verify call names it and what to draft (tn.DRAFT_HEAD, tn.DRAFT_ASK;
    a long prompt's chunks name it with k = 0, so that the target keeps their features for it), asks for
    the drafted tokens, their parents and the head's execution (and their distributions when sampled), and
    returns them as Scores.proposal; a call without one sends the empty name, in the same input set."""
    pb = _Pb()
    scorer = BlsScorer(pb, tn.TARGET_MODEL_NAME, prefill_chunk=4)
    sampled = SamplingParams(temperature=0.5, top_k=7, top_p=0.9)
    scores = asyncio.run(scorer.score(VerifyCall(1, 0, list(range(1, 12)), 1, reserve=40,
                                                 draft=DraftAsk("eagle3", 4, sampled, 2**60 + 5, 3))))
    asks = [(call[tn.DRAFT_HEAD].reshape(-1)[0], call[tn.DRAFT_ASK].reshape(-1).tolist()) for call in pb.sent]
    quiet = [0.0, 3.0, 0.5, 7.0, 0.9, 0.0, float((2**60 + 5) % 2**52)]
    assert asks == [(b"eagle3", quiet)] * 2 + [(b"eagle3", [4.0] + quiet[1:])]
    assert scores.proposal.tokens == [3, 4] and scores.proposal.parents is None
    assert scores.proposal.forward == (6, 1, pytest.approx(0.002)) and scores.proposal.probs.shape == (2, 5)
    asyncio.run(scorer.score(VerifyCall(1, 11, [9], 1, draft=DraftAsk("eagle3", 0))))
    later = asyncio.run(scorer.score(VerifyCall(1, 12, [9], 1)))
    assert later.proposal is None and pb.sent[-1][tn.DRAFT_HEAD].reshape(-1)[0] == b""
    assert len(_input_sets(pb.sent)) == 1
    from specdec.triton import wire
    back = wire.VerifyMessage.decode({name: value for name, value in pb.sent[2].items()})
    assert back.draft == DraftAsk("eagle3", 4, sampled, (2**60 + 5) % 2**52, 3)
