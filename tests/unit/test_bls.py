"""What the orchestrator's BLS proposer sends draft_model, with a stand-in for pb_utils (the stub's module
exists only inside a server): sampling settings only when sampling, min_p only when set."""

import asyncio

import numpy as np
import torch

from specdec import tensor_names as tn
from specdec.decoding.sampling import SamplingParams
from specdec.triton.bls import BlsProposer

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

    def InferenceRequest(self, model_name, inputs, requested_output_names, correlation_id, flags, timeout):  # noqa: N802
        self.sent.append({t.name(): t.as_numpy() for t in inputs})
        outputs = {tn.DRAFT_TOKENS: _Tensor(tn.DRAFT_TOKENS, [[3, 4]]),
                   tn.DRAFT_PROBS: _Tensor(tn.DRAFT_PROBS, np.full((1, 2, 5), 0.2, dtype=np.float32))}

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


def test_sampling_settings_go_to_the_draft_only_when_sampling_and_min_p_only_when_set():
    pb = _Pb()
    proposer = BlsProposer(pb, tn.DRAFT_MODEL_NAME)
    greedy = asyncio.run(proposer.propose(1, 0, [1, 2], 2, SamplingParams(), 0))
    assert greedy.tokens == [3, 4] and greedy.probs is None
    assert set(pb.sent[-1]) == {tn.INPUT_IDS, tn.CACHE_LENGTH, tn.NUM_DRAFT_TOKENS}
    sampled = asyncio.run(proposer.propose(1, 2, [5], 2, SamplingParams(temperature=0.9, top_p=0.8, min_p=0.1), 7))
    assert sampled.probs.shape == (2, 5) and isinstance(sampled.probs, torch.Tensor)
    sent = pb.sent[-1]
    assert sent[tn.MIN_P].dtype == np.float32 and sent[tn.MIN_P].item() == np.float32(0.1)
    assert (sent[tn.TEMPERATURE].item(), sent[tn.SEED].item()) == (np.float32(0.9), 7)
    asyncio.run(proposer.propose(1, 4, [6], 2, SamplingParams(temperature=0.9), 8))
    assert tn.MIN_P not in pb.sent[-1] and tn.TEMPERATURE in pb.sent[-1]
