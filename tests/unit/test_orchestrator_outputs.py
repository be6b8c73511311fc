"""What a response of speculative_decoding holds (orchestrator._response): its own `text_output` (the text
postprocessing makes of the same tokens: what a direct caller, the OpenAI API's `--upstream direct`, reads), and only
the outputs its caller asked for. Triton 24.10's stub drops unasked outputs inside the response sender's send after
releasing the GIL, freeing their numpy arrays without it while the stub's other threads run Python: a heap
corruption (a stub crash under Locust when speculative_decoding sent one output the ensemble does not map). Fakes
stand in for the stub's Tensor and InferenceResponse: this is the orchestrator's own logic."""

from types import SimpleNamespace

import numpy as np
import pytest
from transformers import AutoTokenizer

from specdec import tensor_names as tn
from specdec.decoding.loop import Stats
from specdec.decoding.text import TextEmitter, decode_delta
from specdec.serving.pairs import smollm2_tokenizer_dir
from specdec.triton.orchestrator import SpeculativeDecodingAdapter


class Tensor:
    def __init__(self, name, value):
        self._name, self.value = name, value

    def name(self):
        return self._name


PB = SimpleNamespace(Tensor=Tensor,
                     InferenceResponse=lambda output_tensors: {t.name(): t.value for t in output_tensors})


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())


def respond(tokenizer, words: list[str], stop=(), outputs=frozenset(), echo=False):
    """The response of the last of `words`' rounds (each word a round's tokens)."""
    adapter = SpeculativeDecodingAdapter.__new__(SpeculativeDecodingAdapter)
    adapter.pb, adapter.tokenizer = PB, tokenizer
    emitter = TextEmitter(tokenizer, stop)
    prompt = tokenizer.encode("Say hi.", add_special_tokens=False)
    for word in words:
        emission = emitter.push(tokenizer.encode(word, add_special_tokens=False), final=False)
    if echo:  # a whole answer: everything emitted, cut where the emitter cut it (as _Responses.final sends it)
        emission = type(emission)(emitter.emitted, [], emitter.text, len(emitter.text), False)
    generation = SimpleNamespace(log_probs=False, top_log_probs=0, generation_logits=False, context_logits=False,
                                 prompt_log_probs=False, prompt_ids=prompt, seq_id=3)
    parsed = SimpleNamespace(generation=generation, return_prompt_ids=False, vllm_outputs=frozenset(),
                             echo_prompt=echo, skip_special=True, outputs=outputs)
    return emission, adapter._response(emission, parsed, emitter, Stats(), None, []), prompt


def postprocessed(tokenizer, response) -> str:
    """What the ensemble's postprocessing makes of a response's tokens (text_models.PostprocessingAdapter)."""
    text = decode_delta(tokenizer, response[tn.PREFIX_IDS].reshape(-1).tolist(),
                        response[tn.OUTPUT_IDS].reshape(-1).tolist(), True)
    length = int(response[tn.TEXT_LENGTH].reshape(-1)[0])
    return text[:length] if length >= 0 else text


@pytest.mark.parametrize("words, stop", [(["Hello", " world"], ()), (["Hello", " wor", "ld. Then"], ("ld.",)),
                                         (["Über", " café"], ())])
def test_text_output_is_the_text_postprocessing_makes_of_the_same_tokens(tokenizer, words, stop):
    emission, response, _ = respond(tokenizer, words, stop)
    text = response[tn.TEXT_OUTPUT].reshape(-1)[0].decode()
    assert text == emission.text == postprocessed(tokenizer, response)


def test_an_echoed_answer_holds_the_prompt_before_its_text(tokenizer):
    _, response, prompt = respond(tokenizer, ["Hello", " world"], echo=True)
    text = response[tn.TEXT_OUTPUT].reshape(-1)[0].decode()
    assert text == postprocessed(tokenizer, response) and text.startswith(tokenizer.decode(prompt))


def test_a_response_holds_only_the_outputs_asked_for(tokenizer):
    _, everything, _ = respond(tokenizer, ["Hello"])
    assert {tn.TEXT_OUTPUT, tn.OUTPUT_IDS, tn.PREFIX_IDS, tn.FINISH_REASON, tn.NUM_ROUNDS} <= set(everything)
    # the ensemble's: no text_output
    asked = frozenset({tn.OUTPUT_IDS, tn.PREFIX_IDS, tn.TEXT_LENGTH, tn.FINISH_REASON})
    _, response, _ = respond(tokenizer, ["Hello"], outputs=asked)
    assert set(response) == asked
    assert np.array_equal(response[tn.OUTPUT_IDS], everything[tn.OUTPUT_IDS])
