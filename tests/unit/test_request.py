"""ParsedRequest: every input rule of speculative_decoding, without a server."""

import json
import re

import numpy as np
import pytest

from specdec import tensor_names as tn
from specdec.triton.config import ModelParameters
from specdec.decoding.penalties import Penalties
from specdec.decoding.sampling import SamplingParams
from specdec.triton.request import InputError, ParsedRequest, RequestLimits

LIMITS = RequestLimits(vocab_size=100, draft_names=(tn.NGRAM, "draft_model"), default_end_ids=frozenset([2]),
                       max_context=64, max_max_tokens=32, default_max_tokens=16, max_num_draft_tokens=8,
                       default_num_draft_tokens=4, max_num_draft_branches=3, max_stop_words=2, max_bad_words=2)


def parse(**inputs):
    arrays = {tn.INPUT_IDS: np.array([[5, 6, 7]], dtype=np.int32)}
    for name, value in inputs.items():
        if value is None:
            arrays.pop(name, None)
        elif isinstance(value, np.ndarray):
            arrays[name] = value
        else:
            arrays[name] = np.array([[value]])
    return ParsedRequest.parse(arrays.get, LIMITS, seq_id=7, encode=_encode)


def _encode(word: str) -> list[int]:
    """A stand-in tokenizer: a token per character (its code point), none for a blank word."""
    return [ord(c) for c in word.strip()]


def test_defaults_come_from_the_limits():
    parsed = parse()
    gen = parsed.generation
    assert (gen.seq_id, gen.prompt_ids, gen.max_tokens, gen.end_ids) == (7, [5, 6, 7], 16, frozenset([2]))
    assert gen.sampling.greedy and gen.sampling.top_p == tn.DEFAULT_TOP_P
    assert (parsed.num_draft_tokens, parsed.adaptive, parsed.draft_name) == (4, True, tn.NGRAM)
    assert (parsed.stream, parsed.stop_words, gen.log_probs) == (False, (), False)
    assert parsed.num_draft_branches == 3  # the server's draft_branches


def test_values_are_read():
    parsed = parse(**{tn.MAX_TOKENS: np.array([[20]], dtype=np.int32),
                      tn.NUM_DRAFT_TOKENS: np.array([[0]], dtype=np.int32),
                      tn.TEMPERATURE: np.array([[0.7]], dtype=np.float32),
                      tn.TOP_K: np.array([[5]], dtype=np.int32), tn.TOP_P: np.array([[0.9]], dtype=np.float32),
                      tn.STREAM: np.array([[True]]), tn.END_ID: np.array([[9]], dtype=np.int32),
                      tn.STOP_WORDS: np.array([[b"\n\n", b"END"]], dtype=np.object_),
                      tn.DRAFT_MODEL: np.array([[b"draft_model"]], dtype=np.object_)})
    gen = parsed.generation
    assert gen.max_tokens == 20 and gen.end_ids == frozenset([9])
    assert (gen.sampling.temperature, gen.sampling.top_k, gen.sampling.min_p) == (pytest.approx(0.7), 5, 0.0)
    assert parse(**{tn.MIN_P: np.array([[0.25]], dtype=np.float32)}).generation.sampling.min_p == 0.25
    assert parsed.num_draft_tokens == 0 and parsed.stream and parsed.stop_words == ("\n\n", "END")
    assert parsed.draft_name == "draft_model"
    assert parse(**{tn.NUM_DRAFT_BRANCHES: np.array([[1]], dtype=np.int32)}).num_draft_branches == 1


def test_bad_words_are_encoded_and_empty_entries_mean_none():
    parsed = parse(**{tn.BAD_WORDS: np.array([[b"ab", b"", b"c"]], dtype=np.object_),
                      tn.STOP_WORDS: np.array([[b""]], dtype=np.object_)})
    assert parsed.generation.bad_words == ((97, 98), (99,)) and parsed.stop_words == ()
    # TensorRT-LLM's clients send [""] for "none": counted after dropping them.
    assert parse(**{tn.BAD_WORDS: np.array([[b"", b"", b"a"]], dtype=np.object_)}).generation.bad_words == ((97,),)
    assert parse().generation.bad_words == ()
    with pytest.raises(InputError, match=f"'{tn.BAD_WORDS}'.*tokenizer"):
        ParsedRequest.parse({tn.INPUT_IDS: np.array([[1]], dtype=np.int32),
                             tn.BAD_WORDS: np.array([[b"a"]], dtype=np.object_)}.get, LIMITS)


def test_penalties_are_read_and_default_to_off():
    assert parse().generation.penalties == Penalties() and not parse().generation.penalties.active
    gen = parse(**{tn.REPETITION_PENALTY: np.array([[1.25]], dtype=np.float32),
                   tn.PRESENCE_PENALTY: np.array([[-2.0]], dtype=np.float32),
                   tn.FREQUENCY_PENALTY: np.array([[0.5]], dtype=np.float32)}).generation
    assert gen.penalties == Penalties(1.25, -2.0, 0.5) and gen.edits_logits


def test_return_log_probs_is_read_and_typed():
    assert parse(**{tn.RETURN_LOG_PROBS: np.array([[True]])}).generation.log_probs
    with pytest.raises(InputError, match=tn.RETURN_LOG_PROBS):
        parse(**{tn.RETURN_LOG_PROBS: np.array([[1]], dtype=np.int32)})
    both = {tn.RETURN_LOG_PROBS: np.array([[True]]), tn.NUM_TOP_LOG_PROBS: np.array([[20]], dtype=np.int32)}
    assert parse(**both).generation.top_log_probs == 20 and parse().generation.top_log_probs == 0
    for value, words in ((21, "within"), (-1, "within")):
        with pytest.raises(InputError, match=f"{tn.NUM_TOP_LOG_PROBS}.*{words}"):
            parse(**{**both, tn.NUM_TOP_LOG_PROBS: np.array([[value]], dtype=np.int32)})
    with pytest.raises(InputError, match=f"{tn.NUM_TOP_LOG_PROBS}.*needs"):
        parse(**{tn.NUM_TOP_LOG_PROBS: np.array([[2]], dtype=np.int32)})
    assert parse(**{tn.RETURN_PROMPT_LOG_PROBS: np.array([[True]])}).generation.prompt_log_probs
    assert not parse().generation.prompt_log_probs
    with pytest.raises(InputError, match=tn.RETURN_PROMPT_LOG_PROBS):
        parse(**{tn.RETURN_PROMPT_LOG_PROBS: np.array([[1]], dtype=np.int32)})


def test_forced_lengths():
    assert parse(**{tn.IGNORE_EOS: np.array([[True]])}).generation.end_ids == frozenset()
    # a temperature below 1e-5 is greedy (vLLM's and SGLang's rule; TensorRT-LLM's benchmarks send 1e-6)
    tiny = parse(**{tn.TEMPERATURE: np.array([[1e-6]], dtype=np.float32)}).generation.sampling
    assert tiny.greedy and tiny.temperature == 0.0
    assert not parse(**{tn.TEMPERATURE: np.array([[1e-4]], dtype=np.float32)}).generation.sampling.greedy
    # an end id past the vocabulary (TensorRT-LLM's benchmarks' 1048576): no token ends the request
    assert parse(**{tn.END_ID: np.array([[1048576]], dtype=np.int32)}).generation.end_ids == frozenset([1048576])
    assert parse(**{tn.MIN_LENGTH: np.array([[7]], dtype=np.int32)}).generation.min_tokens == 7
    # min_tokens is the same setting under TensorRT-LLM's current, vLLM's and aiperf's name.
    assert parse(**{tn.MIN_TOKENS: np.array([[5]], dtype=np.int32)}).generation.min_tokens == 5
    both = {tn.MIN_LENGTH: np.array([[5]], dtype=np.int32), tn.MIN_TOKENS: np.array([[5]], dtype=np.int32)}
    assert parse(**both).generation.min_tokens == 5
    with pytest.raises(InputError, match=f"'{tn.MIN_LENGTH}' and '{tn.MIN_TOKENS}'.* 5 and 6"):
        parse(**{**both, tn.MIN_TOKENS: np.array([[6]], dtype=np.int32)})
    assert parse().generation.min_tokens == 0


def test_seeded_sampling_drafts_a_fixed_k_greedy_stays_adaptive():
    seeded = {tn.TEMPERATURE: np.array([[1.0]], dtype=np.float32), tn.SEED: np.array([[3]], dtype=np.uint64)}
    assert not parse(**seeded).adaptive
    assert parse(**{tn.SEED: np.array([[3]], dtype=np.uint64)}).adaptive  # greedy: the seed changes nothing
    assert not parse(**{tn.ADAPTIVE_DRAFT: np.array([[False]])}).adaptive


@pytest.mark.parametrize("name, value", [
    (tn.INPUT_IDS, np.zeros((1, 0), dtype=np.int32)),
    (tn.MAX_TOKENS, np.array([[0]], dtype=np.int32)),
    (tn.MAX_TOKENS, np.array([[33]], dtype=np.int32)),
    (tn.MAX_TOKENS, np.array([[5]], dtype=np.int64)),  # wrong dtype
    (tn.MAX_TOKENS, np.array([[5, 6]], dtype=np.int32)),  # not one value
    (tn.NUM_DRAFT_TOKENS, np.array([[9]], dtype=np.int32)),
    (tn.NUM_DRAFT_TOKENS, np.array([[-1]], dtype=np.int32)),
    (tn.NUM_DRAFT_BRANCHES, np.array([[0]], dtype=np.int32)),
    (tn.NUM_DRAFT_BRANCHES, np.array([[4]], dtype=np.int32)),  # over the server's draft_branches (3)
    (tn.TEMPERATURE, np.array([[-0.1]], dtype=np.float32)),
    (tn.TEMPERATURE, np.array([[np.nan]], dtype=np.float32)),
    (tn.TOP_K, np.array([[-1]], dtype=np.int32)),
    (tn.TOP_P, np.array([[0.0]], dtype=np.float32)),
    (tn.TOP_P, np.array([[1.5]], dtype=np.float32)),
    (tn.MIN_P, np.array([[-0.1]], dtype=np.float32)),
    (tn.MIN_P, np.array([[1.5]], dtype=np.float32)),
    (tn.MIN_P, np.array([[np.nan]], dtype=np.float32)),
    (tn.END_ID, np.array([[-1]], dtype=np.int32)),
    (tn.MIN_LENGTH, np.array([[17]], dtype=np.int32)),  # over max_tokens (16)
    (tn.MIN_LENGTH, np.array([[-1]], dtype=np.int32)),
    (tn.MIN_TOKENS, np.array([[17]], dtype=np.int32)),
    (tn.REPETITION_PENALTY, np.array([[0.0]], dtype=np.float32)),
    (tn.REPETITION_PENALTY, np.array([[np.inf]], dtype=np.float32)),
    (tn.REPETITION_PENALTY, np.array([[1.2]], dtype=np.float64)),  # wrong dtype
    (tn.PRESENCE_PENALTY, np.array([[2.5]], dtype=np.float32)),
    (tn.PRESENCE_PENALTY, np.array([[np.nan]], dtype=np.float32)),
    (tn.FREQUENCY_PENALTY, np.array([[-2.01]], dtype=np.float32)),
    (tn.STOP_WORDS, np.array([[b"a", b"b", b"c"]], dtype=np.object_)),
    (tn.BAD_WORDS, np.array([[b"a", b"b", b"c"]], dtype=np.object_)),
    (tn.BAD_WORDS, np.array([[b" "]], dtype=np.object_)),  # encodes to no token
    (tn.BAD_WORDS, np.array([[b"\xff"]], dtype=np.object_)),
    (tn.STOP_WORDS, np.array([[b"\xff"]], dtype=np.object_)),
    (tn.DRAFT_MODEL, np.array([[b"nope"]], dtype=np.object_)),
    (tn.DRAFT_MODEL, np.array([[b"ngram", b"draft_model"]], dtype=np.object_)),
])
def test_bad_inputs_are_refused_by_name(name, value):
    with pytest.raises(InputError) as info:
        parse(**{name: value})
    named = tn.TEXT_INPUT if name == tn.INPUT_IDS else name  # the user sent text, not ids
    assert f"'{named}'" in str(info.value)


def test_prompt_and_max_tokens_must_fit_the_context():
    ids = np.arange(60, dtype=np.int32).reshape(1, -1)
    with pytest.raises(InputError, match=f"'{tn.TEXT_INPUT}' has 60 tokens.*context of 64"):
        parse(**{tn.INPUT_IDS: ids, tn.MAX_TOKENS: np.array([[5]], dtype=np.int32)})
    assert parse(**{tn.INPUT_IDS: ids, tn.MAX_TOKENS: np.array([[4]], dtype=np.int32)}).generation.max_tokens == 4


def test_missing_prompt_is_refused_by_name():
    with pytest.raises(InputError, match=f"'{tn.TEXT_INPUT}'"):
        ParsedRequest.parse({}.get, LIMITS)


def test_fresh_sequence_ids_are_nonzero_and_distinct():
    ids = {ParsedRequest.parse({tn.INPUT_IDS: np.array([[1]], dtype=np.int32)}.get, LIMITS).generation.seq_id
           for _ in range(50)}
    assert len(ids) == 50 and 0 not in ids


def test_limits_from_config_are_validated_at_load():
    def config(**parameters):
        return {"name": "speculative_decoding",
                "parameters": {k: {"string_value": v} for k, v in parameters.items()}}

    limits = RequestLimits.from_parameters(ModelParameters(config(draft_models="ngram, draft_model",
                                                                  max_num_draft_tokens="6")), 10, frozenset())
    assert limits.draft_names == (tn.NGRAM, "draft_model") and limits.max_num_draft_tokens == 6
    assert limits.default_num_draft_tokens == tn.DEFAULT_NUM_DRAFT_TOKENS and limits.max_num_draft_branches == 1
    wide = RequestLimits.from_parameters(ModelParameters(config(draft_branches="3")), 10, frozenset())
    assert wide.max_num_draft_branches == 3
    with pytest.raises(ValueError, match="'draft_branches'"):
        RequestLimits.from_parameters(ModelParameters(config(draft_branches=str(tn.MAX_DRAFT_BRANCHES + 1))), 10,
                                      frozenset())
    with pytest.raises(ValueError, match="'default_num_draft_tokens'"):
        RequestLimits.from_parameters(ModelParameters(config(max_num_draft_tokens="2")), 10, frozenset())
    with pytest.raises(ValueError, match="'draft_models'"):
        RequestLimits.from_parameters(ModelParameters(config(draft_models=" , ")), 10, frozenset())


def test_logits_outputs_are_held_for_at_most_max_logits_tokens():
    """A whole answer's generation logits stay until it ends, the prompt's until the first response: both
    bounded by the server's max_logits_tokens; a streamed answer lets each row go, so any max_tokens streams."""
    limits = RequestLimits.from_parameters(ModelParameters({"name": "speculative_decoding", "parameters": {
        "draft_models": {"string_value": "ngram"}, "max_logits_tokens": {"string_value": "4"}}}), 100, frozenset())
    assert limits.max_logits_tokens == 4
    assert RequestLimits(vocab_size=1, draft_names=("ngram",)).max_logits_tokens == tn.DEFAULT_MAX_LOGITS_TOKENS

    def parse_with(prompt, **inputs):
        arrays = {tn.INPUT_IDS: np.array([prompt], dtype=np.int32),
                  **{name: np.array([[value]]) for name, value in inputs.items()}}
        return ParsedRequest.parse(arrays.get, limits, seq_id=7)

    generation = {tn.RETURN_GENERATION_LOGITS: True}
    assert parse_with([5, 6], max_tokens=np.int32(4), **generation).generation.generation_logits  # the cap itself
    with pytest.raises(InputError, match=r"^input 'return_generation_logits' of a whole \(not streamed\) answer of 5 "
                                         r"tokens \(input 'max_tokens'\): .*at most 4 tokens' logits .*"
                                         r"\(max_logits_tokens\)"):
        parse_with([5, 6], max_tokens=np.int32(5), **generation)
    assert parse_with([5, 6], max_tokens=np.int32(30), stream=True, **generation).generation.generation_logits
    assert not parse_with([5, 6], max_tokens=np.int32(30)).generation.generation_logits  # not asked: no cap
    with pytest.raises(InputError, match=r"^input 'return_generation_logits' .* \(input 'sampling_parameters': key "
                                         r"'max_tokens'\)"):
        ParsedRequest.parse({tn.INPUT_IDS: np.array([[5]], dtype=np.int32),
                             tn.RETURN_GENERATION_LOGITS: np.array([[True]]),
                             **_vllm({"max_tokens": 5})}.get, limits, seq_id=7)

    context = {tn.RETURN_CONTEXT_LOGITS: True}
    assert parse_with([5, 6, 7, 8], stream=True, **context).generation.context_logits
    for stream in (False, True):  # the prompt's rows go in the first response either way, all at once
        with pytest.raises(InputError, match=r"^input 'return_context_logits' of a prompt of 5 tokens: .*at most 4 "):
            parse_with([5, 6, 7, 8, 9], stream=stream, **context)
    refusing = RequestLimits(vocab_size=100, draft_names=("ngram",), max_logits_tokens=0)
    with pytest.raises(InputError, match="return_context_logits"):
        ParsedRequest.parse({tn.INPUT_IDS: np.array([[5]], dtype=np.int32),
                             tn.RETURN_CONTEXT_LOGITS: np.array([[True]])}.get, refusing, seq_id=7)


def _vllm(settings) -> dict:
    return {tn.SAMPLING_PARAMETERS: np.array([[json.dumps(settings).encode()]], dtype=np.object_)}


def test_vllm_sampling_parameters_stand_for_their_inputs():
    parsed = parse(**_vllm({"max_tokens": 20, "temperature": "0.5", "top_p": 0.9, "top_k": -1, "seed": "3",
                            "min_tokens": 2, "ignore_eos": "true", "stop": "END", "bad_words": ["ab", "c"],
                            "presence_penalty": None, "n": 1, "best_of": None}))  # null or neutral: as if absent
    gen = parsed.generation
    assert (gen.max_tokens, gen.min_tokens, gen.end_ids, parsed.stop_words) == (20, 2, frozenset(), ("END",))
    assert gen.sampling == SamplingParams(0.5, 0, pytest.approx(0.9), 3)  # vLLM's top_k -1 is "off": our 0
    assert gen.bad_words == ((97, 98), (99,))
    assert parse(**_vllm({"stop": ["a", "b"], "top_k": 5})).stop_words == ("a", "b")
    assert parse(**_vllm({"min_p": "0.05"})).generation.sampling.min_p == pytest.approx(0.05)
    assert parse(**_vllm({})).generation.max_tokens == LIMITS.default_max_tokens
    penalised = parse(**_vllm({"repetition_penalty": "1.1", "presence_penalty": 0.5, "frequency_penalty": -1}))
    assert penalised.generation.penalties == Penalties(pytest.approx(1.1), 0.5, -1.0)
    assert not parse(**_vllm({"repetition_penalty": 1, "frequency_penalty": 0})).generation.penalties.active


@pytest.mark.parametrize("value, message", [
    (np.array([[b"{not json"]], dtype=np.object_), "not valid JSON"),
    (np.array([[b"[" * 100000 + b"]" * 100000]], dtype=np.object_), "not valid JSON"),  # past the decoder's depth
    (np.array([[b"[1, 2]"]], dtype=np.object_), "JSON object"),
    (_vllm({"n": 2})[tn.SAMPLING_PARAMETERS], "key 'n' is supported only at 1"),
    (_vllm({"use_beam_search": True})[tn.SAMPLING_PARAMETERS], "key 'use_beam_search' is not supported"),
    (_vllm({"logit_bias": [5]})[tn.SAMPLING_PARAMETERS], "key 'logit_bias' must be an object"),
    (_vllm({"logit_bias": {"a": 1}})[tn.SAMPLING_PARAMETERS], "key 'logit_bias': 'a' is not a token id"),
    (_vllm({"logit_bias": {"5": 100.5}})[tn.SAMPLING_PARAMETERS], "the bias of token 5 must be a number within"),
    (_vllm({"logit_bias": {"5": "1"}})[tn.SAMPLING_PARAMETERS], "the bias of token 5 must be a number"),
    (_vllm({"logit_bias": {"5": 1, "05": 2}})[tn.SAMPLING_PARAMETERS], "names a token id twice"),
    (_vllm({"logit_bias": {"100": 1}})[tn.SAMPLING_PARAMETERS], "key 'logit_bias': token id 100 is not within"),
    (_vllm({"allowed_token_ids": 5})[tn.SAMPLING_PARAMETERS], "key 'allowed_token_ids' must be a list"),
    (_vllm({"allowed_token_ids": []})[tn.SAMPLING_PARAMETERS], "'allowed_token_ids' is empty"),
    (_vllm({"stop_token_ids": [-1]})[tn.SAMPLING_PARAMETERS], "key 'stop_token_ids': token id -1 is not within"),
    (_vllm({"stop_token_ids": [1.5]})[tn.SAMPLING_PARAMETERS], "key 'stop_token_ids': 1.5 is not a token id"),
    (_vllm({"stop_token_ids": list(range(1025))})[tn.SAMPLING_PARAMETERS], "at most 1024"),
    (_vllm({"max_tokens": 1.5})[tn.SAMPLING_PARAMETERS], "key 'max_tokens' must be an integer"),
    (_vllm({"max_tokens": True})[tn.SAMPLING_PARAMETERS], "key 'max_tokens' must be an integer"),
    (_vllm({"temperature": "hot"})[tn.SAMPLING_PARAMETERS], "key 'temperature' must be a number"),
    (_vllm({"seed": -1})[tn.SAMPLING_PARAMETERS], "key 'seed' must be >= 0"),
    (_vllm({"ignore_eos": 1})[tn.SAMPLING_PARAMETERS], "key 'ignore_eos' must be true or false"),
    (_vllm({"stop": [1]})[tn.SAMPLING_PARAMETERS], "key 'stop' must be a string or a list of strings"),
    (_vllm({"repetition_penalty": "high"})[tn.SAMPLING_PARAMETERS], "key 'repetition_penalty' must be a number"),
    (_vllm({"n": True})[tn.SAMPLING_PARAMETERS], "key 'n' must be an integer"),
    (_vllm({"spaces_between_special_tokens": "no"})[tn.SAMPLING_PARAMETERS],
     "key 'spaces_between_special_tokens' must be true or false"),
    (_vllm({"skip_special_tokens": "no"})[tn.SAMPLING_PARAMETERS], "key 'skip_special_tokens' must be true or false"),
    (_vllm({"detokenize": "no"})[tn.SAMPLING_PARAMETERS], "key 'detokenize' must be true or false"),
    (_vllm({"include_stop_str_in_output": 1})[tn.SAMPLING_PARAMETERS], "key 'include_stop_str_in_output' must be true"),
    (_vllm({"truncate_prompt_tokens": 0})[tn.SAMPLING_PARAMETERS], "key 'truncate_prompt_tokens' must be >= 1 or -1"),
    (_vllm({"truncate_prompt_tokens": 2.5})[tn.SAMPLING_PARAMETERS], "key 'truncate_prompt_tokens' must be an integer"),
    (_vllm({"logprobs": 21})[tn.SAMPLING_PARAMETERS], r"key 'logprobs' must be within \[0, 20\], got 21"),
    (_vllm({"logprobs": -1})[tn.SAMPLING_PARAMETERS], r"key 'logprobs' must be within \[0, 20\]"),
    (_vllm({"logprobs": "many"})[tn.SAMPLING_PARAMETERS], "key 'logprobs' must be an integer"),
    (_vllm({"stream_interval_ms": -1})[tn.SAMPLING_PARAMETERS], r"key 'stream_interval_ms' must be within \[0, 60000\]"),
    (_vllm({"stream_interval_ms": 0.5})[tn.SAMPLING_PARAMETERS], "key 'stream_interval_ms' must be an integer"),
    (_vllm({"stream_interval": 0})[tn.SAMPLING_PARAMETERS], r"key 'stream_interval' must be within \[1, 4096\]"),
    (_vllm({"stream_interval": 4097})[tn.SAMPLING_PARAMETERS], r"key 'stream_interval' must be within \[1, 4096\]"),
    (_vllm({"prompt_logprobs": 1})[tn.SAMPLING_PARAMETERS], "key 'prompt_logprobs' is not supported"),
    # numbers the inputs cannot hold: numpy would raise on them after the request was accepted
    (_vllm({"min_tokens": 1e308})[tn.SAMPLING_PARAMETERS], r"key 'min_tokens' must be within \[-2147483648"),
    (_vllm({"max_tokens": 2**40})[tn.SAMPLING_PARAMETERS], r"key 'max_tokens' must be within"),
    (_vllm({"seed": 1e308})[tn.SAMPLING_PARAMETERS], r"key 'seed' must be within \[0, 18446744073709551615\]"),
    (_vllm({"seed": 2**64})[tn.SAMPLING_PARAMETERS], r"key 'seed' must be within"),
    (_vllm({"top_k": "1e400"})[tn.SAMPLING_PARAMETERS], "key 'top_k' must be an integer"),
    (_vllm({"temperature": 1e308})[tn.SAMPLING_PARAMETERS], "key 'temperature' must be a number"),
    (_vllm({"top_p": "nan"})[tn.SAMPLING_PARAMETERS], "key 'top_p' must be a number"),
    (_vllm({"allowed_token_ids": [[1]]})[tn.SAMPLING_PARAMETERS], r"key 'allowed_token_ids': \[1\] is not a token id"),
    (_vllm({"logit_bias": {str(2**70): 1}})[tn.SAMPLING_PARAMETERS], "is not a token id"),
])
def test_bad_sampling_parameters_are_refused_by_name(value, message):
    with pytest.raises(InputError, match=f"'{tn.SAMPLING_PARAMETERS}'.*{message}"):
        parse(**{tn.SAMPLING_PARAMETERS: value})


def test_a_64_bit_seed_is_read_exactly():
    assert parse(**_vllm({"seed": 2**64 - 1})).generation.sampling.seed == 2**64 - 1  # not through a float
    assert parse(**_vllm({"seed": "18446744073709551615"})).generation.sampling.seed == 2**64 - 1


def test_vllm_text_settings_are_read_and_neutral_ones_accepted():
    neutral = {"skip_special_tokens": True, "spaces_between_special_tokens": "true", "detokenize": True}
    parsed = parse(**_vllm({**neutral, "stop": "END"}))
    assert parsed.stop_words == ("END",) and not parsed.include_stop
    assert parse(**_vllm({"stop": "END", "include_stop_str_in_output": "true"})).include_stop
    assert not parse(**_vllm({"include_stop_str_in_output": False})).include_stop
    assert parsed.skip_special and parse().skip_special  # special tokens left out of the text by default
    assert not parse(**_vllm({"skip_special_tokens": False})).skip_special
    assert not parse(**_vllm({"skip_special_tokens": "false"})).skip_special


def test_stream_interval_ms_spaces_a_streamed_requests_responses():
    assert parse(**_vllm({"stream_interval_ms": 250})).stream_interval_s == 0.25
    assert parse().stream_interval_s == 0.0


def test_a_token_stream_interval_comes_from_the_server_unless_the_request_asks():
    """stream_interval (tokens): speculative_decoding's parameter (SGLang's --stream-interval), 1 by default
    (a response per round); a request's sampling_parameters may ask for another, either way."""
    assert parse().stream_interval_tokens == 1
    assert parse(**_vllm({"stream_interval": 8})).stream_interval_tokens == 8
    limits = RequestLimits.from_parameters(ModelParameters({"name": "speculative_decoding", "parameters": {
        "draft_models": {"string_value": "ngram"}, "stream_interval": {"string_value": "6"}}}), 100, frozenset())
    assert limits.default_stream_interval == 6
    prompt = {tn.INPUT_IDS: np.array([[5, 6, 7]], dtype=np.int32)}
    assert ParsedRequest.parse(prompt.get, limits, seq_id=1, encode=_encode).stream_interval_tokens == 6
    asked = {**prompt, **_vllm({"stream_interval": 1})}
    assert ParsedRequest.parse(asked.get, limits, seq_id=1, encode=_encode).stream_interval_tokens == 1
    with pytest.raises(ValueError, match="stream_interval"):
        RequestLimits.from_parameters(ModelParameters({"name": "speculative_decoding", "parameters": {
            "draft_models": {"string_value": "ngram"}, "stream_interval": {"string_value": "0"}}}), 100, frozenset())


def test_vllm_truncate_prompt_tokens_keeps_the_prompts_last_tokens():
    prompt = np.array([list(range(10, 70))], dtype=np.int32)  # 60 tokens in a context of 64
    cut = parse(**{tn.INPUT_IDS: prompt, **_vllm({"truncate_prompt_tokens": 5, "max_tokens": 8})}).generation
    assert cut.prompt_ids == list(range(65, 70))
    assert parse(**_vllm({"truncate_prompt_tokens": 50})).generation.prompt_ids == [5, 6, 7]  # shorter: whole
    fitted = parse(**{tn.INPUT_IDS: prompt, **_vllm({"truncate_prompt_tokens": -1, "max_tokens": 8})}).generation
    assert fitted.prompt_ids == list(range(14, 70))  # -1: what fits before max_tokens in the context (64 - 8)
    with pytest.raises(InputError, match="'text_input' has 60 tokens"):  # without it, the same prompt is refused
        parse(**{tn.INPUT_IDS: prompt, **_vllm({"max_tokens": 8})})


def test_vllm_token_id_settings_are_read():
    from specdec.decoding.logit_bias import TokenBias

    gen = parse(**_vllm({"logit_bias": {"5": -100, 7: 2.5}, "allowed_token_ids": [5, 7, 9],
                         "stop_token_ids": [11, 12]})).generation
    assert gen.token_bias == TokenBias(((5, -100.0), (7, 2.5)), frozenset([5, 7, 9])) and gen.edits_logits
    assert gen.end_ids == frozenset([2, 11, 12])  # the end id, and the stop tokens beside it
    assert parse(**_vllm({"stop_token_ids": [11], "ignore_eos": True})).generation.end_ids == frozenset([11])
    assert not parse(**_vllm({"logit_bias": {}})).generation.token_bias.active


def test_tensorrt_llms_embedding_bias_gives_each_words_tokens_its_weight_summed_with_logit_bias():
    """TensorRT-LLM's embedding_bias_words / _weights: every token of a word gets the word's weight; a token
    of two words, or also in logit_bias, gets the sum; an empty word is skipped with its weight."""
    from specdec.decoding.logit_bias import TokenBias

    words = np.array([[b"AB", b"", b"B", b"c"]], dtype=np.object_)  # stand-in tokens: A=65, B=66, c=99
    weights = np.array([[1.5, 7.0, -4.0, 2.0]], dtype=np.float32)
    gen = parse(**{tn.EMBEDDING_BIAS_WORDS: words, tn.EMBEDDING_BIAS_WEIGHTS: weights},
                **_vllm({"logit_bias": {"99": 0.5, "5": -1}})).generation
    assert gen.token_bias == TokenBias(((99, 2.5), (5, -1.0), (65, 1.5), (66, -2.5))) and gen.edits_logits
    empty = parse(**{tn.EMBEDDING_BIAS_WORDS: np.array([[b""]], dtype=np.object_),
                     tn.EMBEDDING_BIAS_WEIGHTS: np.array([[3.0]], dtype=np.float32)}).generation
    assert not empty.token_bias.active  # TensorRT-LLM's clients' "none"


def test_priority_is_read_and_defaults_to_zero():
    assert parse().priority == 0
    assert parse(**{tn.PRIORITY: np.array([[-7]], np.int32)}).priority == -7
    assert parse(**{tn.PRIORITY: np.array([[2**31 - 1]], np.int32)}).priority == 2**31 - 1
    with pytest.raises(InputError, match="'priority' must be int32"):
        parse(**{tn.PRIORITY: np.array([[1]], np.int64)})


def test_return_perf_metrics_is_read():
    assert parse(**{tn.RETURN_PERF_METRICS: np.array([[True]])}).perf_metrics
    assert not parse().perf_metrics
    with pytest.raises(InputError, match="'return_perf_metrics' must be bool"):
        parse(**{tn.RETURN_PERF_METRICS: np.array([[1]], dtype=np.int32)})


@pytest.mark.parametrize("words, weights, message", [
    ([b"A", b"B"], [1.0], "'embedding_bias_words' and 'embedding_bias_weights' are pairs: got 2 words and 1 weights"),
    ([b"A"], None, "are pairs: got 1 words and 0 weights"),
    (None, [1.0], "are pairs: got 0 words and 1 weights"),
    ([b"A"], [float("nan")], "'embedding_bias_weights' must be finite, got nan for 'A'"),
    ([b"A"], [float("inf")], "'embedding_bias_weights' must be finite, got inf"),
    ([b"A"] * 1025, [1.0] * 1025, "'embedding_bias_words' has 1025 entries; at most 1024"),
    ([b"\xff"], [1.0], "'embedding_bias_words' is not valid UTF-8"),
])
def test_bad_embedding_bias_is_refused_by_name(words, weights, message):
    inputs = {tn.EMBEDDING_BIAS_WORDS: None if words is None else np.array([words], dtype=np.object_),
              tn.EMBEDDING_BIAS_WEIGHTS: None if weights is None else np.array([weights], dtype=np.float32)}
    with pytest.raises(InputError, match=re.escape(message)):
        parse(**inputs)
    with pytest.raises(InputError, match="'embedding_bias_weights' must be float32, got float64"):
        parse(**{tn.EMBEDDING_BIAS_WORDS: np.array([[b"A"]], dtype=np.object_),
                 tn.EMBEDDING_BIAS_WEIGHTS: np.array([[1.0]])})


def test_vllm_additional_output_flags_and_logprobs_are_read():
    """vLLM's backend's return_* flags (each true one kept), and its `logprobs` n: log-probabilities with the n
    most likely tokens, and the generated tokens' ranks only when return_logprobs sends them."""
    flags = {name: np.array([[True]]) for name in tn.VLLM_OUTPUT_FLAGS}
    parsed = parse(**{**flags, tn.RETURN_NUM_INPUT_TOKENS: np.array([[False]])})
    assert parsed.vllm_outputs == frozenset(tn.VLLM_OUTPUT_FLAGS) - {tn.RETURN_NUM_INPUT_TOKENS}
    assert parsed.vllm_logprobs is None and not parsed.generation.log_ranks
    assert parsed.generation.log_probs and parsed.generation.top_log_probs == 0  # for cumulative_logprob
    assert parse(**{tn.RETURN_FINISH_REASON: np.array([[True]])}).generation.log_probs is False
    plain = parse()
    assert (plain.vllm_outputs, plain.vllm_logprobs) == (frozenset(), None)
    for n in (0, 3):
        asked = parse(**_vllm({"logprobs": n}), **{tn.RETURN_LOGPROBS: np.array([[True]])})
        gen = asked.generation
        assert (asked.vllm_logprobs, gen.log_probs, gen.top_log_probs, gen.log_ranks) == (n, True, n, True)
    unsent = parse(**_vllm({"logprobs": "2"})).generation  # computed as vLLM does, not sent: no ranks
    assert (unsent.log_probs, unsent.top_log_probs, unsent.log_ranks) == (True, 2, False)
    same = parse(**_vllm({"logprobs": 2}), **{tn.RETURN_LOG_PROBS: np.array([[True]]),
                                             tn.NUM_TOP_LOG_PROBS: np.array([[2]], dtype=np.int32)})
    assert same.generation.top_log_probs == 2
    with pytest.raises(InputError, match=f"key 'logprobs' and input '{tn.NUM_TOP_LOG_PROBS}' are one setting"):
        parse(**_vllm({"logprobs": 2}), **{tn.RETURN_LOG_PROBS: np.array([[True]]),
                                          tn.NUM_TOP_LOG_PROBS: np.array([[3]], dtype=np.int32)})


def _with_parameters(parameters: dict, **inputs):
    arrays = {tn.INPUT_IDS: np.array([[5, 6, 7]], dtype=np.int32), **inputs}
    return ParsedRequest.parse(arrays.get, LIMITS, seq_id=7, encode=_encode, parameters=json.dumps(parameters))


def test_request_parameters_are_vllm_settings_too():
    """vLLM's backend reads its settings from the request's parameters too (tritonclient's `parameters=`,
    the HTTP generate endpoint's keys that name no input): the same keys, rules and errors, named as request
    parameters; Triton's own parameters are left to it; with a sampling_parameters input they are not read
    (vLLM's sample client sends its settings both ways)."""
    parsed = _with_parameters({"max_tokens": 5, "temperature": "0.5", "seed": 2, "stop_token_ids": [9],
                               "logprobs": 1, "triton_enable_empty_final_response": True, "priority": 1})
    gen = parsed.generation
    assert (gen.max_tokens, gen.sampling.temperature, gen.sampling.seed) == (5, 0.5, 2)
    assert gen.end_ids == frozenset([2, 9]) and parsed.vllm_logprobs == 1
    both = _with_parameters({"max_tokens": 5, "temperature": "0.1", "foo": 1}, **_vllm({"temperature": 0.5}))
    assert (both.generation.max_tokens, both.generation.sampling.temperature) == (LIMITS.default_max_tokens, 0.5)
    assert _with_parameters({}).generation.max_tokens == LIMITS.default_max_tokens
    for parameters, message in [
            ({"foo": 1}, "request parameter 'foo' is not supported"),
            ({"max_tokens": "many"}, "request parameter 'max_tokens' must be an integer"),
            ({"logprobs": 30}, r"request parameter 'logprobs' must be within \[0, 20\]"),
            ({"stop_token_ids": [1000]}, "request parameter 'stop_token_ids': token id 1000 is not within"),
            ({"truncate_prompt_tokens": 0}, "request parameter 'truncate_prompt_tokens' must be >= 1 or -1")]:
        with pytest.raises(InputError, match=message):
            _with_parameters(parameters)
    with pytest.raises(InputError, match=f"request parameter 'max_tokens' and input '{tn.MAX_TOKENS}' are one setting"):
        _with_parameters({"max_tokens": 5}, **{tn.MAX_TOKENS: np.array([[5]], dtype=np.int32)})


def test_exclude_input_in_output_false_echoes_the_prompt_of_a_whole_answer_only():
    assert not parse().echo_prompt and not parse(**{tn.EXCLUDE_INPUT_IN_OUTPUT: np.array([[True]])}).echo_prompt
    assert parse(**{tn.EXCLUDE_INPUT_IN_OUTPUT: np.array([[False]])}).echo_prompt
    assert not parse(**{tn.EXCLUDE_INPUT_IN_OUTPUT: np.array([[False]]), tn.STREAM: np.array([[True]])}).echo_prompt
    with pytest.raises(InputError, match=f"input '{tn.EXCLUDE_INPUT_IN_OUTPUT}' must be bool"):
        parse(**{tn.EXCLUDE_INPUT_IN_OUTPUT: np.array([[0]], dtype=np.int32)})


def test_sampling_parameters_keep_the_inputs_rules():
    with pytest.raises(InputError, match=f"key 'max_tokens' and input '{tn.MAX_TOKENS}' are one setting"):
        parse(**{**_vllm({"max_tokens": 5}), tn.MAX_TOKENS: np.array([[5]], dtype=np.int32)})
    with pytest.raises(InputError, match=f"'{tn.TEMPERATURE}' must be a finite number"):
        parse(**_vllm({"temperature": -1}))
    with pytest.raises(InputError, match=f"'{tn.PRESENCE_PENALTY}' must be within \\[-2, 2\\]"):
        parse(**_vllm({"presence_penalty": 3}))


def _compile_guide(guide_type, guide):
    """A stand-in compiler: the guide as it arrived, refusing the word "bad"."""
    from specdec.decoding.grammar import GuideError
    if guide == "bad":
        raise GuideError("does not compile")
    return (guide_type, guide)


def parse_guided(**inputs):
    arrays = {tn.INPUT_IDS: np.array([[5, 6, 7]], dtype=np.int32)}
    arrays.update({name: value if isinstance(value, np.ndarray) else np.array([[value]], dtype=np.object_)
                   for name, value in inputs.items()})
    return ParsedRequest.parse(arrays.get, LIMITS, seq_id=7, encode=_encode, compile_guide=_compile_guide)


def test_a_guide_comes_as_tensorrt_llms_inputs_or_vllms_guided_decoding():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert parse_guided().generation.grammar is None
    assert parse_guided(**{tn.GUIDED_DECODING_GUIDE_TYPE: b"", tn.GUIDED_DECODING_GUIDE: b""}).generation.grammar is None
    assert parse_guided(**{tn.GUIDED_DECODING_GUIDE_TYPE: b"regex", tn.GUIDED_DECODING_GUIDE: b"[0-9]+"}
                        ).generation.grammar == ("regex", "[0-9]+")
    assert parse_guided(**{tn.GUIDED_DECODING_GUIDE_TYPE: b"json"}).generation.grammar == ("json", "")
    longest = "a" * LIMITS.max_guide_chars  # max_guide_chars itself is allowed
    assert parse_guided(**{tn.GUIDED_DECODING_GUIDE_TYPE: b"regex", tn.GUIDED_DECODING_GUIDE: longest.encode()}
                        ).generation.grammar == ("regex", longest)
    for key in ("guided_decoding", "structured_outputs"):
        for value in ({"json": schema, "backend": "xgrammar"}, json.dumps({"json": json.dumps(schema)})):
            assert parse_guided(**_vllm({key: value})).generation.grammar == ("json_schema", json.dumps(schema))
    vllm = {"regex": ("regex", "a+"), "choice": ("choice", json.dumps(["x", "y"])), "grammar": ("ebnf_grammar", "g"),
            "json_object": ("json", "")}
    for key, expected in vllm.items():
        value = {"regex": "a+", "choice": ["x", "y"], "grammar": "g", "json_object": True}[key]
        assert parse_guided(**_vllm({"guided_decoding": {key: value, "whitespace_pattern": None}})).generation.grammar == expected
    # vLLM's disable_any_whitespace: a compact JSON guide (llguidance's option in the schema).
    compact = parse_guided(**_vllm({"guided_decoding": {"json": schema, "disable_any_whitespace": True}})).generation
    assert compact.grammar == ("json_schema", json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}}))
    compact = parse_guided(**_vllm({"guided_decoding": {"json_object": True, "disable_any_whitespace": True}}))
    assert compact.generation.grammar == ("json_schema", json.dumps({"type": "object", "x-guidance": {"whitespace_flexible": False}}))
    assert parse_guided(**_vllm({"guided_decoding": {"regex": "a", "disable_any_whitespace": True}})
                        ).generation.grammar == ("regex", "a")
    # structural tags: an object or its JSON; compact, each structure's schema (a malformed one left to compile)
    tags = {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}, {"begin": "<g>", "end": ""}, 7],
            "triggers": ["<f>", "<g>"]}
    for value in (tags, json.dumps(tags)):
        assert parse_guided(**_vllm({"structured_outputs": {"structural_tag": value}})).generation.grammar == (
            "structural_tag", json.dumps(tags))
    compact = parse_guided(**_vllm({"structured_outputs": {"structural_tag": tags, "disable_any_whitespace": True}}))
    flat = {"x-guidance": {"whitespace_flexible": False}}
    assert json.loads(compact.generation.grammar[1]) == {**tags, "structures": [
        {"begin": "<f>", "schema": {**schema, **flat}, "end": "</f>"}, {"begin": "<g>", "end": "", "schema": flat}, 7]}
    # vLLM's disable_additional_properties (its guidance backend's): objects that leave additionalProperties
    # unsaid are closed, at every depth; those that say it keep it; a property named "properties" is a name
    nested = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}}, "properties": {"type": "string"},
        "open": {"type": "object", "additionalProperties": True}},
              "$defs": {"x": {"properties": {"c": {}}}}, "anyOf": [{"type": "object"}]}
    closed = json.loads(parse_guided(**_vllm({"structured_outputs": {"json": nested, "disable_additional_properties":
                                                                     True}})).generation.grammar[1])
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["properties"] == {"type": "string"} and closed["properties"]["open"][
        "additionalProperties"] is True
    assert closed["$defs"]["x"]["additionalProperties"] is False and closed["anyOf"][0]["additionalProperties"] is False
    assert parse_guided(**_vllm({"structured_outputs": {"json": nested, "disable_additional_properties": False}})
                        ).generation.grammar == ("json_schema", json.dumps(nested))
    # whitespace_pattern: the JSON's whitespace as a regex (llguidance's option)
    spaced = json.loads(parse_guided(**_vllm({"structured_outputs": {
        "json_object": True, "whitespace_pattern": "[ ]?"}})).generation.grammar[1])
    assert spaced == {"type": "object", "x-guidance": {"whitespace_pattern": "[ ]?"}}
    from specdec.decoding.grammar import GuideCompiler
    from specdec.decoding.text import load_tokenizer
    from specdec.serving.pairs import smollm2_tokenizer_dir
    tokenizer = load_tokenizer(str(smollm2_tokenizer_dir()))
    grammar = GuideCompiler(tokenizer).compile("json_schema", json.dumps(spaced))
    for text, held in (('{"a": 1, "b":2}', True), ('{\n"a": 1}', False), ('{"a":  1}', False)):
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        assert (grammar.matcher().valid_prefix(ids) == len(ids)) is held, text
    # xgrammar's format form: each JSON-style json_schema format compact, wherever it is nested (XML styles not)
    fmt = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "json_schema", "json_schema": schema}, {"type": "tag", "begin": "<a>", "end": "</a>", "content": {
            "type": "json_schema", "json_schema": schema, "style": "qwen_xml"}}]}}
    compact = json.loads(parse_guided(**_vllm({"structured_outputs": {"structural_tag": fmt, "disable_any_whitespace":
                                                                      True}})).generation.grammar[1])
    first, tagged = compact["format"]["elements"]
    assert first["json_schema"] == {**schema, **flat} and tagged["content"]["json_schema"] == schema
    # A guided request's greedy rounds fetch the target's logits, to mask them.
    assert parse_guided(**{tn.GUIDED_DECODING_GUIDE_TYPE: b"json"}).generation.edits_logits


def test_a_reasoning_parser_applies_the_guide_after_the_thinking():
    """With `reasoning_parser` the request's grammar (a real one, over SmolLM2's tokenizer) holds for the answer
    after the thinking, its tags read with the tokenizer; without a guide it changes nothing; another value
    is refused naming the input."""
    from specdec.decoding.grammar import GuideCompiler
    from specdec.decoding.text import load_tokenizer
    from specdec.decoding.thinking import THINKING, AnswerMatcher
    from specdec.serving.pairs import smollm2_tokenizer_dir

    tokenizer = load_tokenizer(str(smollm2_tokenizer_dir()))
    guides = GuideCompiler(tokenizer)

    def parse(**inputs):
        arrays = {tn.INPUT_IDS: np.array([[5, 6, 7]], dtype=np.int32),
                  **{name: np.array([[value]], dtype=np.object_) for name, value in inputs.items()}}
        return ParsedRequest.parse(arrays.get, LIMITS, seq_id=7, compile_guide=guides.compile,
                                   encode=lambda text: tokenizer.encode(text, add_special_tokens=False)).generation

    guided = {tn.GUIDED_DECODING_GUIDE_TYPE: b"regex", tn.GUIDED_DECODING_GUIDE: b"[0-9]+"}
    plain = parse(**guided).grammar
    grammar = parse(**guided, **{tn.REASONING_PARSER: b"deepseek_r1"}).grammar
    assert plain.after is None and grammar.after.start == THINKING and isinstance(grammar.matcher(), AnswerMatcher)
    assert grammar.after.close == tuple(tokenizer.encode("</think>", add_special_tokens=False))
    assert parse(**{tn.REASONING_PARSER: b"qwen3"}).grammar is None
    with pytest.raises(InputError, match=f"input '{tn.REASONING_PARSER}' must be one of deepseek_r1, qwen3"):
        parse(**guided, **{tn.REASONING_PARSER: b"o1"})


def test_a_thinking_budget_needs_the_parser_and_holds_the_guide_after_it():
    """thinking_token_budget (vLLM's): with a reasoning parser, a ThinkingBudget over the tags (the guide after
    it, if any), as an input or a sampling_parameters key; without the parser, or negative, refused by name."""
    import json

    from specdec.decoding.grammar import GuideCompiler
    from specdec.decoding.text import load_tokenizer
    from specdec.decoding.thinking import ThinkingBudget
    from specdec.serving.pairs import smollm2_tokenizer_dir

    tokenizer = load_tokenizer(str(smollm2_tokenizer_dir()))
    guides = GuideCompiler(tokenizer)

    def parse(budget=None, **inputs):
        arrays = {tn.INPUT_IDS: np.array([[5, 6, 7]], dtype=np.int32),
                  **{name: np.array([[value]], dtype=np.object_) for name, value in inputs.items()}}
        if budget is not None:
            arrays[tn.THINKING_TOKEN_BUDGET] = np.array([[budget]], dtype=np.int32)
        return ParsedRequest.parse(arrays.get, LIMITS, seq_id=7, compile_guide=guides.compile,
                                   encode=lambda text: tokenizer.encode(text, add_special_tokens=False)).generation

    rule = parse(16, **{tn.REASONING_PARSER: b"deepseek_r1"}).grammar
    assert isinstance(rule, ThinkingBudget) and rule.budget == 16 and rule.answer is None
    assert rule.tags.close == tuple(tokenizer.encode("</think>", add_special_tokens=False))
    assert rule.matcher().words == (LIMITS.vocab_size + 31) // 32
    guided = parse(0, **{tn.REASONING_PARSER: b"qwen3", tn.GUIDED_DECODING_GUIDE_TYPE: b"regex",
                         tn.GUIDED_DECODING_GUIDE: b"[0-9]+"}).grammar
    assert guided.budget == 0 and guided.answer.after is None and guided.answer.definition
    keyed = parse(**{tn.REASONING_PARSER: b"deepseek_r1",
                     tn.SAMPLING_PARAMETERS: json.dumps({"thinking_token_budget": 3}).encode()}).grammar
    assert keyed.budget == 3
    with pytest.raises(InputError, match=f"input '{tn.THINKING_TOKEN_BUDGET}' needs '{tn.REASONING_PARSER}'"):
        parse(16)
    with pytest.raises(InputError, match=f"input '{tn.THINKING_TOKEN_BUDGET}' must be >= 0"):
        parse(-2, **{tn.REASONING_PARSER: b"deepseek_r1"})
    with pytest.raises(InputError, match="key 'thinking_token_budget' needs"):
        parse(**{tn.SAMPLING_PARAMETERS: json.dumps({"thinking_token_budget": 3}).encode()})


@pytest.mark.parametrize("inputs, message", [
    ({tn.GUIDED_DECODING_GUIDE_TYPE: b"xml", tn.GUIDED_DECODING_GUIDE: b"<a/>"},
     f"'{tn.GUIDED_DECODING_GUIDE_TYPE}' must be one of json, json_schema"),
    ({tn.GUIDED_DECODING_GUIDE: b"[0-9]"}, f"'{tn.GUIDED_DECODING_GUIDE}' needs '{tn.GUIDED_DECODING_GUIDE_TYPE}'"),
    ({tn.GUIDED_DECODING_GUIDE_TYPE: b"regex", tn.GUIDED_DECODING_GUIDE: b"bad"},
     f"'{tn.GUIDED_DECODING_GUIDE}' \\(regex\\): does not compile"),
    (_vllm({"guided_decoding": {"regex": "a", "choice": ["b"]}}), "exactly one of json, regex"),
    (_vllm({"guided_decoding": {}}), "exactly one of json, regex.*none"),
    (_vllm({"guided_decoding": "{oops"}), "key 'guided_decoding' is not valid JSON"),
    (_vllm({"guided_decoding": "[" * 100000}), "key 'guided_decoding' is not valid JSON"),
    (_vllm({"guided_decoding": ["a"]}), "key 'guided_decoding' must be an object"),
    (_vllm({"guided_decoding": {"regex": 5}}), "'regex' must be a string"),
    (_vllm({"guided_decoding": {"json_object": "yes"}}), "'json_object' must be true"),
    (_vllm({"guided_decoding": {"regex": "a", "whitespace_pattern": " "}}),
     r"'whitespace_pattern' applies to a JSON guide \('json' or 'json_object'\), not 'regex'"),
    (_vllm({"guided_decoding": {"json": {}, "whitespace_pattern": " ", "disable_any_whitespace": True}}),
     "'whitespace_pattern' and 'disable_any_whitespace' both say"),
    (_vllm({"guided_decoding": {"json": {}, "whitespace_pattern": 3}}), "'whitespace_pattern' must be a regex string"),
    (_vllm({"guided_decoding": {"regex": "a", "lark": "t"}}), "'lark' is not supported"),
    (_vllm({"guided_decoding": {"json": "[1]", "disable_any_whitespace": True}}), "must be a JSON schema object"),
    (_vllm({"guided_decoding": {"json": "{", "disable_any_whitespace": True}}), "'json' is not valid JSON"),
    (_vllm({"guided_decoding": {"regex": "a", "disable_any_whitespace": "yes"}}), "must be true or false"),
    ({**_vllm({"structured_outputs": {"regex": "a"}}), tn.GUIDED_DECODING_GUIDE_TYPE: b"json"},
     f"key 'structured_outputs' and input '{tn.GUIDED_DECODING_GUIDE_TYPE}'"),
    (_vllm({"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}}), "are one setting"),
    ({tn.GUIDED_DECODING_GUIDE_TYPE: b"regex", tn.GUIDED_DECODING_GUIDE: b"a" * (LIMITS.max_guide_chars + 1)},
     f"'{tn.GUIDED_DECODING_GUIDE}' has {LIMITS.max_guide_chars + 1} characters; at most {LIMITS.max_guide_chars} "
     f"\\(max_guide_chars\\)"),
])
def test_bad_guides_are_refused_by_name(inputs, message):
    with pytest.raises(InputError, match=message):
        parse_guided(**inputs)
    with pytest.raises(InputError, match="not supported here"):  # no tokenizer, no grammar
        ParsedRequest.parse({tn.INPUT_IDS: np.array([[5]], dtype=np.int32),
                             tn.GUIDED_DECODING_GUIDE_TYPE: np.array([[b"json"]], dtype=np.object_)}.get, LIMITS)


def test_a_cache_salt_is_one_string_of_bounded_length():
    assert parse().generation.cache_salt == ""
    assert parse(**{tn.CACHE_SALT: np.array([[b"tenant-1"]], dtype=np.object_)}).generation.cache_salt == "tenant-1"
    for value in (np.array([[b"a", b"b"]], dtype=np.object_),
                  np.array([[b"x" * (tn.MAX_CACHE_SALT + 1)]], dtype=np.object_)):
        with pytest.raises(InputError, match=tn.CACHE_SALT):
            parse(**{tn.CACHE_SALT: value})


def test_a_lora_name_must_be_one_the_server_serves():
    """lora_name (an input, or vLLM's sampling_parameters key) names one of the orchestrator's lora_adapters."""
    import dataclasses

    import specdec.triton.request as request
    from specdec.triton.config import ModelParameters

    limits = dataclasses.replace(LIMITS, lora_names=("sql", "chat"))
    arrays = {tn.INPUT_IDS: np.array([[5, 6, 7]], dtype=np.int32)}

    def parsed(**extra):
        return ParsedRequest.parse({**arrays, **extra}.get, limits, seq_id=7, encode=_encode)

    assert parsed().generation.lora_name == "" and parse().generation.lora_name == ""
    assert parsed(**{tn.LORA_NAME: np.array([[b"chat"]], dtype=np.object_)}).generation.lora_name == "chat"
    assert parsed(**{tn.SAMPLING_PARAMETERS: np.array([[json.dumps({"lora_name": "sql"}).encode()]], dtype=np.object_)}
                  ).generation.lora_name == "sql"
    with pytest.raises(InputError, match=f"input '{tn.LORA_NAME}': no LoRA adapter 'nope' \\(served: sql, chat\\)"):
        parsed(**{tn.LORA_NAME: np.array([[b"nope"]], dtype=np.object_)})
    with pytest.raises(InputError, match="key 'lora_name'.*no LoRA adapter 'x' \\(served: sql, chat\\)"):
        parsed(**{tn.SAMPLING_PARAMETERS: np.array([[json.dumps({"lora_name": "x"}).encode()]], dtype=np.object_)})
    with pytest.raises(InputError, match="served: none"):
        parse(**{tn.LORA_NAME: np.array([[b"sql"]], dtype=np.object_)})
    # the orchestrator reads them from its lora_adapters, as the launcher renders it
    params = ModelParameters({"name": "sd", "parameters": {"draft_models": {"string_value": "ngram"},
                                                          "lora_adapters": {"string_value": "sql=/a,chat=/b"}}})
    assert request.RequestLimits.from_parameters(params, 100, frozenset()).lora_names == ("sql", "chat")



def test_a_lora_name_of_the_directory_of_adapters_is_admitted(tmp_path):
    """lora_directory: a name of an adapter in it is admitted (the target reads it); one that is not there, or
    that would leave the directory, is refused naming the field and the directory."""
    import dataclasses

    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "adapter_config.json").write_text("{}")
    (tmp_path / "team" / "chat").mkdir(parents=True)
    (tmp_path / "team" / "chat" / "adapter_config.json").write_text("{}")
    limits = dataclasses.replace(LIMITS, lora_directory=str(tmp_path))

    def name(value: str) -> str:
        arrays = {tn.INPUT_IDS: np.array([[5, 6, 7]], dtype=np.int32), tn.LORA_NAME: np.array([[value.encode()]],
                                                                                             dtype=np.object_)}
        return ParsedRequest.parse(arrays.get, limits, seq_id=7, encode=_encode).generation.lora_name

    assert name("sql") == "sql" and name("team/chat") == "team/chat"
    for wrong in ("nope", "team", "../sql", "team/../sql"):
        with pytest.raises(InputError, match=f"no LoRA adapter '{re.escape(wrong)}' \\(served: none; none in {tmp_path}"):
            name(wrong)


def test_max_tokens_to_context_generates_what_the_context_leaves_when_no_max_tokens_is_given():
    """The OpenAI API's requests (OpenAI's and vLLM's rule): no max_tokens runs to the end of the context, at most
    max_max_tokens; a max_tokens given wins; a prompt that fills the context is refused naming it."""
    to_context = {tn.MAX_TOKENS_TO_CONTEXT: True}
    prompt = np.array([list(range(10, 70))], dtype=np.int32)  # 60 tokens in a context of 64
    assert parse(**{tn.INPUT_IDS: prompt, **_vllm(to_context)}).generation.max_tokens == 4
    short = parse(**_vllm(to_context)).generation  # 3 tokens: the rest of the context is over max_max_tokens
    assert short.max_tokens == min(LIMITS.max_max_tokens, LIMITS.max_context - 3)
    assert parse(**_vllm({**to_context, "max_tokens": 2})).generation.max_tokens == 2
    assert parse(**_vllm({tn.MAX_TOKENS_TO_CONTEXT: False})).generation.max_tokens == LIMITS.default_max_tokens
    assert parse().generation.max_tokens == LIMITS.default_max_tokens  # the Triton API's default, unchanged
    cut = parse(**{tn.INPUT_IDS: prompt, **_vllm({**to_context, "truncate_prompt_tokens": -1})}).generation
    assert (len(cut.prompt_ids), cut.max_tokens) == (60, 4)  # fits already: -1 keeps it whole
    full = np.array([list(range(64))], dtype=np.int32)
    with pytest.raises(InputError, match="'text_input' has 64 tokens: the model context of 64 tokens leaves none"):
        parse(**{tn.INPUT_IDS: full, **_vllm(to_context)})
    assert parse(**{tn.INPUT_IDS: full, **_vllm({**to_context, "truncate_prompt_tokens": -1})}).generation.max_tokens == 1


def test_a_prediction_is_the_expected_answers_token_ids_and_one_too_long_is_refused_by_name():
    """sampling_parameters' `prediction` (OpenAI's Predicted Outputs, what the OpenAI API sends): token ids of the
    target's tokenizer; at most the context's worth; none when empty or unset."""
    assert parse(**_vllm({tn.PREDICTION: "abc"})).prediction == (97, 98, 99)
    assert parse().prediction == () and parse(**_vllm({tn.PREDICTION: ""})).prediction == ()
    with pytest.raises(InputError, match=r"key 'prediction' has 65 tokens, more than the model's context of 64"):
        parse(**_vllm({tn.PREDICTION: "x" * 65}))
    with pytest.raises(InputError, match=r"key 'prediction' is longer than the model's context"):
        parse(**_vllm({tn.PREDICTION: "x" * 64 * 65}))
    with pytest.raises(InputError, match=r"key 'prediction' must be one text"):
        parse(**_vllm({tn.PREDICTION: ["a", "b"]}))
