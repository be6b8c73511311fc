"""A `speculative_decoding` request's inputs, validated: `ParsedRequest.parse` over plain numpy arrays
(vLLM's `sampling_parameters` JSON read into the same inputs first, `vllm_parameters.py`).

No `pb_utils` here: the adapter hands in a lookup from input name to array, so every rule is unit-tested
without a server. Every error names the input it refuses.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

import numpy as np

from specdec import tensor_names as tn
from specdec.decoding.grammar import Grammar, GuideError
from specdec.decoding.logit_bias import TokenBias
from specdec.decoding.loop import GenerationRequest
from specdec.decoding.penalties import Penalties
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.thinking import ThinkingBudget, ThinkingTags
from specdec.engine.lora_config import directory_adapter, parse_adapters
from specdec.triton.config import ModelParameters
from specdec.triton.inputs import InputError, InputLookup, Inputs
from specdec.triton.vllm_parameters import MAX_TOKEN_IDS, with_sampling_parameters

Encode = Callable[[str], "list[int]"]  # text -> token ids, without special tokens (the target's tokenizer)
CompileGuide = Callable[[str, str], Grammar]  # (guide type, guide) -> its grammar; raises GuideError
MAX_PREDICTION_CHARS_PER_TOKEN = 64  # a prediction's text longer than this per context token is refused untokenized
MAX_STREAM_INTERVAL_MS = 60_000  # sampling_parameters' stream_interval_ms: longer holds text back for nothing


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask for, from speculative_decoding's config parameters (validated at load)."""

    vocab_size: int  # token ids a request may name (end_id)
    draft_names: tuple[str, ...]  # draft methods a request may choose; the first is the default
    default_end_ids: frozenset[int] = frozenset()
    max_context: int = tn.DEFAULT_MAX_CONTEXT_TOKENS
    max_max_tokens: int = tn.DEFAULT_MAX_MAX_TOKENS
    default_max_tokens: int = tn.DEFAULT_MAX_TOKENS
    max_num_draft_tokens: int = tn.DEFAULT_MAX_NUM_DRAFT_TOKENS
    default_num_draft_tokens: int = tn.DEFAULT_NUM_DRAFT_TOKENS
    adaptive_draft: bool = True  # num_draft_tokens is the most a round drafts; K adapts per round
    # draft_branches: a draft model's (or head's) candidates per drafted position, as one token tree (1: chains);
    # a request's num_draft_branches may ask for fewer
    max_num_draft_branches: int = 1
    max_stop_words: int = 16
    max_bad_words: int = 16
    # A guide compiles when its request arrives (a large one on a thread, a small one on the orchestrator's
    # event loop); compiling grows with the guide, so its length is bounded.
    max_guide_chars: int = 65536
    # tokens whose logits a request may have the server hold for it (tn.DEFAULT_MAX_LOGITS_TOKENS)
    max_logits_tokens: int = tn.DEFAULT_MAX_LOGITS_TOKENS
    lora_names: tuple[str, ...] = ()  # the LoRA adapters target_model serves (its lora_adapters, by name)
    lora_directory: str = ""  # and the directory it reads more from on demand (its lora_directory)
    # a streamed request's responses at least this many tokens apart unless it asks otherwise (its
    # sampling_parameters' stream_interval; 1: a response per round), SGLang's --stream-interval
    default_stream_interval: int = 1

    @classmethod
    def from_parameters(cls, params: ModelParameters, vocab_size: int, end_ids: frozenset[int]) -> RequestLimits:
        max_max_tokens = params.int("max_max_tokens", tn.DEFAULT_MAX_MAX_TOKENS, low=1)
        max_k = params.int("max_num_draft_tokens", tn.DEFAULT_MAX_NUM_DRAFT_TOKENS, low=0)
        draft_names = tuple(params.list("draft_models", tn.DRAFT_MODEL_NAME))
        if not draft_names:
            raise ValueError(f"{params.model_name}: parameter 'draft_models' lists no model")
        return cls(
            vocab_size=vocab_size, draft_names=draft_names, default_end_ids=end_ids,
            max_context=params.int("max_context_tokens", tn.DEFAULT_MAX_CONTEXT_TOKENS, low=2),
            max_max_tokens=max_max_tokens,
            default_max_tokens=params.int("default_max_tokens", tn.DEFAULT_MAX_TOKENS, low=1, high=max_max_tokens),
            max_num_draft_tokens=max_k,
            default_num_draft_tokens=params.int("default_num_draft_tokens", tn.DEFAULT_NUM_DRAFT_TOKENS, low=0,
                                                high=max_k),
            adaptive_draft=params.bool("adaptive_draft", True),
            max_num_draft_branches=params.int("draft_branches", 1, low=1, high=tn.MAX_DRAFT_BRANCHES),
            max_stop_words=params.int("max_stop_words", 16, low=0),
            max_bad_words=params.int("max_bad_words", 16, low=0),
            max_guide_chars=params.int("max_guide_chars", 65536, low=1),
            max_logits_tokens=params.int("max_logits_tokens", tn.DEFAULT_MAX_LOGITS_TOKENS, low=0),
            lora_names=tuple(parse_adapters(params.str("lora_adapters", ""), "parameter 'lora_adapters'")),
            lora_directory=params.str("lora_directory", ""),
            default_stream_interval=params.int("stream_interval", 1, low=1, high=tn.MAX_STREAM_INTERVAL_TOKENS),
        )


@dataclass(frozen=True)
class ParsedRequest:
    generation: GenerationRequest
    num_draft_tokens: int  # K: every round's (fixed) or the most a round drafts (adaptive)
    adaptive: bool
    draft_name: str  # which proposer drafts
    stream: bool
    stop_words: tuple[str, ...]
    include_stop: bool = False  # the stop word that ends the text stays at its end (vLLM's include_stop_str_in_output)
    num_draft_branches: int = 1  # a draft model's candidates per drafted position (1: chains), <= draft_branches
    # vLLM's backend's return_* flags that are true (tn.VLLM_OUTPUT_FLAGS), and its `logprobs` n (None: unset)
    vllm_outputs: frozenset[str] = frozenset()
    vllm_logprobs: int | None = None
    # exclude_input_in_output false on a request that is not streamed: its response holds the prompt's tokens
    # before the generated ones (TensorRT-LLM's meaning; streamed responses hold the new tokens either way)
    echo_prompt: bool = False
    perf_metrics: bool = False  # return_perf_metrics: TensorRT-LLM's timing outputs in every response
    priority: int = 0  # its place among waiting requests when the server is full: lower first (tn.PRIORITY)
    stream_interval_s: float = 0.0  # streamed: at most one response per this long (0: one per round)
    skip_special: bool = True  # the text leaves special tokens out (vLLM's skip_special_tokens)
    # OpenAI's Predicted Outputs: the answer the request expects, as token ids, which its rounds draft from
    # (decoding/prediction_proposer.py); () for none
    prediction: tuple[int, ...] = ()
    return_prompt_ids: bool = False  # the first response also holds the prompt's tokens (tn.RETURN_PROMPT_IDS)
    stream_interval_tokens: int = 1  # streamed: a response once this many tokens are waiting (1: one per round)
    # The outputs its caller asked for (Triton lists them all when it named none), set by the adapter after
    # parsing (empty: all): every response holds only these (see orchestrator._response)
    outputs: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, lookup: InputLookup, limits: RequestLimits, seq_id: int | None = None,
              encode: Encode | None = None, compile_guide: CompileGuide | None = None,
              parameters: str | None = None) -> ParsedRequest:
        """Validate a request's inputs against `limits`; raises InputError naming the input.

        seq_id keys both models' KV caches; by default a fresh random one (nonzero: 0 means "no
        sequence" to Triton). `encode` turns bad words into token sequences and `compile_guide` a guide
        into its grammar (each required when a request has any). `parameters`: the request's parameters
        (Triton's JSON of them), vLLM's settings like `sampling_parameters`' keys."""
        settings = with_sampling_parameters(lookup, parameters)
        inputs = Inputs(settings)
        prompt_ids = inputs.array(tn.INPUT_IDS, np.int32)
        if prompt_ids is None or prompt_ids.size == 0:
            raise InputError(f"input '{tn.TEXT_INPUT}' is empty: the prompt needs at least one token")
        prompt_ids = prompt_ids.reshape(-1).tolist()
        given = inputs.scalar(tn.MAX_TOKENS, np.int32, None)
        # this server's own setting (the OpenAI API's): no max_tokens generates what the context leaves, up to
        # max_max_tokens, as OpenAI's and vLLM's APIs do, rather than the Triton API's default_max_tokens
        to_context = given is None and bool(inputs.scalar(tn.MAX_TOKENS_TO_CONTEXT, np.bool_, False))
        max_tokens = limits.default_max_tokens if given is None else given
        if not 1 <= max_tokens <= limits.max_max_tokens:
            raise InputError(f"input '{tn.MAX_TOKENS}' must be within [1, {limits.max_max_tokens}], got {max_tokens}")
        prompt_ids = _truncated(prompt_ids, inputs.scalar("truncate_prompt_tokens", np.int32, None),
                                limits.max_context - (1 if to_context else max_tokens), settings.field)
        if to_context:
            max_tokens = min(limits.max_max_tokens, limits.max_context - len(prompt_ids))
            if max_tokens < 1:
                raise InputError(f"input '{tn.TEXT_INPUT}' has {len(prompt_ids)} tokens: the model context of "
                                 f"{limits.max_context} tokens leaves none to generate")
        if len(prompt_ids) + max_tokens > limits.max_context:
            raise InputError(
                f"input '{tn.TEXT_INPUT}' has {len(prompt_ids)} tokens; with '{tn.MAX_TOKENS}'={max_tokens} that "
                f"exceeds the model context of {limits.max_context} tokens")
        k = inputs.scalar(tn.NUM_DRAFT_TOKENS, np.int32, limits.default_num_draft_tokens)
        if not 0 <= k <= limits.max_num_draft_tokens:
            raise InputError(
                f"input '{tn.NUM_DRAFT_TOKENS}' must be within [0, {limits.max_num_draft_tokens}], got {k}")
        adaptive = bool(inputs.scalar(tn.ADAPTIVE_DRAFT, np.bool_, limits.adaptive_draft))
        branches = inputs.scalar(tn.NUM_DRAFT_BRANCHES, np.int32, limits.max_num_draft_branches)
        if not 1 <= branches <= limits.max_num_draft_branches:
            raise InputError(f"input '{tn.NUM_DRAFT_BRANCHES}' must be within [1, {limits.max_num_draft_branches}] "
                             f"(the server's draft_branches), got {branches}")
        temperature = inputs.scalar(tn.TEMPERATURE, np.float32, tn.DEFAULT_TEMPERATURE)
        if not 0.0 <= temperature < float("inf"):  # also rejects NaN
            raise InputError(f"input '{tn.TEMPERATURE}' must be a finite number >= 0, got {temperature}")
        if temperature < tn.GREEDY_BELOW_TEMPERATURE:
            temperature = 0.0
        top_k = inputs.scalar(tn.TOP_K, np.int32, tn.DEFAULT_TOP_K)
        if top_k < 0:
            raise InputError(f"input '{tn.TOP_K}' must be >= 0, got {top_k}")
        top_p = inputs.scalar(tn.TOP_P, np.float32, tn.DEFAULT_TOP_P)
        if not 0.0 < top_p <= 1.0:
            raise InputError(f"input '{tn.TOP_P}' must be within (0, 1], got {top_p}")
        min_p = inputs.scalar(tn.MIN_P, np.float32, tn.DEFAULT_MIN_P)
        if not 0.0 <= min_p <= 1.0:  # also rejects NaN
            raise InputError(f"input '{tn.MIN_P}' must be within [0, 1], got {min_p}")
        seed = inputs.scalar(tn.SEED, np.uint64, None)
        penalties = _penalties(inputs)
        end_id = inputs.scalar(tn.END_ID, np.int32, None)
        # An id past the vocabulary is never generated: no token ends the request (what TensorRT-LLM's
        # benchmarks send, 1048576, to run to max_tokens), as on TensorRT-LLM
        if end_id is not None and end_id < 0:
            raise InputError(f"input '{tn.END_ID}' must be a token id (>= 0; past the vocabulary's "
                             f"{limits.vocab_size}: none ends the request), got {end_id}")
        min_length = _min_length(inputs, max_tokens)
        ignore_eos = bool(inputs.scalar(tn.IGNORE_EOS, np.bool_, False))
        # vLLM's stop_token_ids: end tokens besides the end id (ignore_eos leaves them), dropped from the text.
        stop_ids = frozenset(_token_ids(inputs, "stop_token_ids", limits.vocab_size, settings.field) or [])
        stop_words = inputs.words(tn.STOP_WORDS, limits.max_stop_words)
        bad_words = tuple(_bad_word_ids(word, encode) for word in inputs.words(tn.BAD_WORDS, limits.max_bad_words))
        names = inputs.strings(tn.DRAFT_MODEL)
        draft_name = names[0] if names else limits.draft_names[0]
        if len(names) > 1 or draft_name not in limits.draft_names:
            raise InputError(f"input '{tn.DRAFT_MODEL}' must be one of {sorted(limits.draft_names)}, got {names}")
        lora_name = _lora_name(inputs, limits, settings.input_field(tn.LORA_NAME))
        sampling = SamplingParams(temperature, top_k, top_p, seed, min_p)
        log_probs = bool(inputs.scalar(tn.RETURN_LOG_PROBS, np.bool_, False))
        top = inputs.scalar(tn.NUM_TOP_LOG_PROBS, np.int32, 0)
        if not 0 <= top <= tn.MAX_TOP_LOG_PROBS:
            raise InputError(f"input '{tn.NUM_TOP_LOG_PROBS}' must be within [0, {tn.MAX_TOP_LOG_PROBS}], got {top}")
        if top and not log_probs:
            raise InputError(f"input '{tn.NUM_TOP_LOG_PROBS}' needs '{tn.RETURN_LOG_PROBS}': true")
        vllm_outputs = frozenset(name for name in tn.VLLM_OUTPUT_FLAGS if inputs.scalar(name, np.bool_, False))
        vllm_logprobs = _vllm_logprobs(inputs, top, settings.field)
        if vllm_logprobs is not None:  # vLLM computes them whether or not return_logprobs sends them
            log_probs, top = True, vllm_logprobs
        log_probs = log_probs or tn.RETURN_CUMULATIVE_LOGPROB in vllm_outputs
        generation = GenerationRequest(
            seq_id=seq_id if seq_id is not None else random.getrandbits(63) | 1,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=sampling,
            end_ids=stop_ids | (frozenset() if ignore_eos else limits.default_end_ids if end_id is None
                                else frozenset([end_id])),
            min_tokens=min_length,
            log_probs=log_probs,
            top_log_probs=int(top),
            log_ranks=vllm_logprobs is not None and tn.RETURN_LOGPROBS in vllm_outputs,
            prompt_log_probs=bool(inputs.scalar(tn.RETURN_PROMPT_LOG_PROBS, np.bool_, False)),
            generation_logits=bool(inputs.scalar(tn.RETURN_GENERATION_LOGITS, np.bool_, False)),
            context_logits=bool(inputs.scalar(tn.RETURN_CONTEXT_LOGITS, np.bool_, False)),
            bad_words=bad_words,
            penalties=penalties,
            grammar=_grammar(inputs, compile_guide, limits.max_guide_chars, encode, limits.vocab_size,
                             settings.input_field(tn.THINKING_TOKEN_BUDGET)),
            token_bias=_token_bias(inputs, limits.vocab_size, settings.field, encode),
            lora_name=lora_name,
            cache_salt=_cache_salt(inputs),
        )
        # A seeded sampled request must be reproducible: measured costs vary from run to run, and a
        # different K changes which random draws pick which token, so it drafts a fixed K.
        adaptive = adaptive and (sampling.greedy or seed is None)
        stream = bool(inputs.scalar(tn.STREAM, np.bool_, False))
        _check_logits(generation, stream, limits, settings.input_field)
        echo = not inputs.scalar(tn.EXCLUDE_INPUT_IN_OUTPUT, np.bool_, True) and not stream
        interval_ms = int(inputs.scalar("stream_interval_ms", np.int32, 0))
        if not 0 <= interval_ms <= MAX_STREAM_INTERVAL_MS:
            raise InputError(f"{settings.field('stream_interval_ms')} must be within [0, {MAX_STREAM_INTERVAL_MS}] "
                             f"(milliseconds), got {interval_ms}")
        interval_tokens = int(inputs.scalar("stream_interval", np.int32, limits.default_stream_interval))
        if not 1 <= interval_tokens <= tn.MAX_STREAM_INTERVAL_TOKENS:
            raise InputError(f"{settings.field('stream_interval')} must be within [1, {tn.MAX_STREAM_INTERVAL_TOKENS}] "
                             f"(tokens), got {interval_tokens}")
        return cls(generation, k, adaptive, draft_name, stream, stop_words,
                   bool(inputs.scalar("include_stop_str_in_output", np.bool_, False)), int(branches),
                   vllm_outputs, vllm_logprobs, echo,
                   bool(inputs.scalar(tn.RETURN_PERF_METRICS, np.bool_, False)),
                   int(inputs.scalar(tn.PRIORITY, np.int32, 0)), interval_ms / 1000.0,
                   bool(inputs.scalar(tn.SKIP_SPECIAL_TOKENS, np.bool_, True)),
                   _prediction(inputs, encode, limits, settings.field),
                   bool(inputs.scalar(tn.RETURN_PROMPT_IDS, np.bool_, False)), interval_tokens)


def _check_logits(req: GenerationRequest, stream: bool, limits: RequestLimits, field: Callable[[str], str]):
    """Logits outputs within the server's max_logits_tokens: a whole answer's generation logits are held until
    it ends (a streamed one's leave with each response), the prompt's until the first response."""
    cap = limits.max_logits_tokens
    if req.generation_logits and not stream and req.max_tokens > cap:
        raise InputError(f"{field(tn.RETURN_GENERATION_LOGITS)} of a whole (not streamed) answer of {req.max_tokens} "
                         f"tokens ({field(tn.MAX_TOKENS)}): this server holds at most {cap} tokens' logits for a "
                         f"request (max_logits_tokens); ask for fewer tokens or stream")
    if req.context_logits and len(req.prompt_ids) > cap:
        raise InputError(f"{field(tn.RETURN_CONTEXT_LOGITS)} of a prompt of {len(req.prompt_ids)} tokens: this server "
                         f"holds at most {cap} tokens' logits for a request (max_logits_tokens)")


def _prediction(inputs: Inputs, encode: Encode | None, limits: RequestLimits,
                field: Callable[[str], str]) -> tuple[int, ...]:
    """sampling_parameters' `prediction` (OpenAI's Predicted Outputs): the expected answer's text as token ids,
    at most the context's worth; () when unset or empty."""
    texts = inputs.strings(tn.PREDICTION)
    if len(texts) > 1:
        raise InputError(f"{field(tn.PREDICTION)} must be one text, got {len(texts)}")
    if not texts or not texts[0]:
        return ()
    if encode is None:
        raise InputError(f"{field(tn.PREDICTION)} is not supported here (no tokenizer)")
    if len(texts[0]) > MAX_PREDICTION_CHARS_PER_TOKEN * limits.max_context:  # before tokenizing a huge text
        raise InputError(f"{field(tn.PREDICTION)} is longer than the model's context of {limits.max_context} tokens")
    ids = tuple(int(token) for token in encode(texts[0]))
    if len(ids) > limits.max_context:
        raise InputError(f"{field(tn.PREDICTION)} has {len(ids)} tokens, more than the model's context of "
                         f"{limits.max_context}")
    return ids


def _vllm_logprobs(inputs: Inputs, top: int, field: Callable[[str], str]) -> int | None:
    """sampling_parameters' `logprobs` n (vLLM's: each generated token's n most likely tokens besides its
    own), None when unset; num_top_log_probs is the same setting, so both only if they agree."""
    n = inputs.scalar("logprobs", np.int32, None)
    if n is None:
        return None
    if not 0 <= n <= tn.MAX_TOP_LOG_PROBS:
        raise InputError(f"{field('logprobs')} must be within [0, {tn.MAX_TOP_LOG_PROBS}], got {n}")
    if top and top != n:
        raise InputError(f"{field('logprobs')} and input '{tn.NUM_TOP_LOG_PROBS}' are one setting; got {n} and {top}")
    return int(n)


def _truncated(prompt_ids: list[int], keep: int | None, room: int, field: Callable[[str], str]) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: the last `room`, what fits before
    max_tokens in the context); the whole prompt when it is shorter, or without the setting."""
    if keep is None:
        return prompt_ids
    if keep == -1:
        keep = max(room, 1)
    if keep < 1:
        raise InputError(f"{field('truncate_prompt_tokens')} must be >= 1 or -1, got {keep}")
    return prompt_ids[-keep:]


def _token_ids(inputs: Inputs, key: str, vocab_size: int, field: Callable[[str], str]) -> list[int] | None:
    """A TOKEN_ID_KEYS setting's ids, each a token of the vocabulary; None when the request has none."""
    array = inputs.array(key, np.int64)
    if array is None:
        return None
    ids = array.reshape(-1).tolist()
    for token in ids:
        if not 0 <= token < vocab_size:
            raise InputError(f"{field(key)}: token id {token} is not within [0, {vocab_size})")
    return ids


def _token_bias(inputs: Inputs, vocab_size: int, field: Callable[[str], str], encode: Encode | None) -> TokenBias:
    """vLLM's logit_bias and allowed_token_ids, and TensorRT-LLM's embedding bias, which add up."""
    biased = _token_ids(inputs, "logit_bias", vocab_size, field) or []
    allowed = _token_ids(inputs, "allowed_token_ids", vocab_size, field)
    if allowed is not None and not allowed:
        raise InputError(f"{field('allowed_token_ids')} is empty: no token could follow")
    values = inputs.array("logit_bias.values", np.float32)
    bias: dict[int, float] = {}
    # Summed per token: apply_bias adds each id's value once (a repeated index would keep only one value).
    for token, value in [*zip(biased, values.reshape(-1).tolist() if values is not None else []),
                         *_embedding_bias(inputs, vocab_size, encode)]:
        bias[token] = bias.get(token, 0.0) + value
    return TokenBias(tuple(bias.items()), None if allowed is None else frozenset(allowed))


def _embedding_bias(inputs: Inputs, vocab_size: int, encode: Encode | None) -> list[tuple[int, float]]:
    """TensorRT-LLM's embedding_bias_words and _weights as (token id, weight): every token of a word (its
    tokenizer's encoding, without special tokens) gets the word's weight; an empty word is skipped with its
    weight, as TensorRT-LLM's preprocessing skips a word that encodes to nothing."""
    words_name, weights_name = tn.EMBEDDING_BIAS_WORDS, tn.EMBEDDING_BIAS_WEIGHTS
    words = inputs.strings(words_name)
    weights = inputs.array(weights_name, np.float32)
    weights = [] if weights is None else weights.reshape(-1).tolist()
    if len(words) != len(weights):
        raise InputError(f"inputs '{words_name}' and '{weights_name}' are pairs: got {len(words)} words and "
                         f"{len(weights)} weights")
    if len(words) > MAX_TOKEN_IDS:  # as many as logit_bias' entries
        raise InputError(f"input '{words_name}' has {len(words)} entries; at most {MAX_TOKEN_IDS}")
    out = []
    for word, weight in zip(words, weights):
        if not word:
            continue
        if not math.isfinite(weight):
            raise InputError(f"input '{weights_name}' must be finite, got {weight} for {word!r}")
        if encode is None:
            raise InputError(f"input '{words_name}' is not supported here (no tokenizer)")
        out += [(int(token), weight) for token in encode(word) if 0 <= int(token) < vocab_size]
    return out


def _lora_name(inputs: Inputs, limits: RequestLimits, field: str) -> str:
    """The request's LoRA adapter ("": the base model), one the server serves."""
    names = inputs.strings(tn.LORA_NAME)
    if len(names) > 1:
        raise InputError(f"{field} names one adapter, got {names}")
    name = names[0] if names else ""
    if name and name not in limits.lora_names and directory_adapter(limits.lora_directory, name) is None:
        where = f"; none in {limits.lora_directory}" if limits.lora_directory else ""
        raise InputError(f"{field}: no LoRA adapter {name!r} (served: {', '.join(limits.lora_names) or 'none'}{where})")
    return name


def _cache_salt(inputs: Inputs) -> str:
    """The request's prefix-cache salt ("": none), at most tn.MAX_CACHE_SALT characters."""
    salts = inputs.strings(tn.CACHE_SALT)
    if len(salts) > 1 or (salts and len(salts[0]) > tn.MAX_CACHE_SALT):
        raise InputError(f"input '{tn.CACHE_SALT}' must be one string of at most {tn.MAX_CACHE_SALT} characters, "
                         f"got {len(salts)} of up to {max(map(len, salts))} characters")
    return salts[0] if salts else ""


def _grammar(inputs: Inputs, compile_guide: CompileGuide | None, max_chars: int, encode: Encode | None,
             vocab_size: int, budget_field: str) -> Grammar | ThinkingBudget | None:
    """The request's structured-output grammar (TensorRT-LLM's two inputs), applied after the thinking of
    its reasoning parser if it names one, and its thinking budget (`budget_field`: where it came from, for
    errors); None when it has neither."""
    grammar = _guide_grammar(inputs, compile_guide, max_chars)
    parsers = inputs.strings(tn.REASONING_PARSER)
    parser = (parsers or [""])[0]
    if len(parsers) > 1 or (parser and parser not in tn.REASONING_PARSERS):
        raise InputError(f"input '{tn.REASONING_PARSER}' must be one of {', '.join(tn.REASONING_PARSERS)}, "
                         f"got {parsers}")
    budget = inputs.scalar(tn.THINKING_TOKEN_BUDGET, np.int32, -1)
    if budget < -1:
        raise InputError(f"{budget_field} must be >= 0 (tokens; -1: no budget), got {budget}")
    if budget >= 0 and not parser:
        raise InputError(f"{budget_field} needs '{tn.REASONING_PARSER}' (where the model's "
                         "thinking starts and ends)")
    if not parser or (grammar is None and budget < 0):  # it concerns the guide and the budget only
        return grammar
    if encode is None:
        raise InputError(f"input '{tn.REASONING_PARSER}' is not supported here (no tokenizer)")
    tags = ThinkingTags.of(parser, encode)
    if budget >= 0:
        return ThinkingBudget(tags, int(budget), vocab_size, grammar)
    return grammar.after_thinking(tags)


def _guide_grammar(inputs: Inputs, compile_guide: CompileGuide | None, max_chars: int) -> Grammar | None:
    types, guides = inputs.strings(tn.GUIDED_DECODING_GUIDE_TYPE), inputs.strings(tn.GUIDED_DECODING_GUIDE)
    for name, values in ((tn.GUIDED_DECODING_GUIDE_TYPE, types), (tn.GUIDED_DECODING_GUIDE, guides)):
        if len(values) > 1:
            raise InputError(f"input '{name}' must hold exactly one string, got {len(values)}")
    guide_type, guide = (types or [""])[0], (guides or [""])[0]
    if not guide_type:  # TensorRT-LLM's clients send "" for none
        if guide:
            raise InputError(f"input '{tn.GUIDED_DECODING_GUIDE}' needs '{tn.GUIDED_DECODING_GUIDE_TYPE}' "
                             f"(one of {', '.join(tn.GUIDE_TYPES)})")
        return None
    if guide_type not in tn.GUIDE_TYPES:
        raise InputError(f"input '{tn.GUIDED_DECODING_GUIDE_TYPE}' must be one of {', '.join(tn.GUIDE_TYPES)}, "
                         f"got {guide_type!r}")
    if compile_guide is None:
        raise InputError(f"input '{tn.GUIDED_DECODING_GUIDE_TYPE}' is not supported here (no tokenizer)")
    if len(guide) > max_chars:
        raise InputError(f"input '{tn.GUIDED_DECODING_GUIDE}' has {len(guide)} characters; at most {max_chars} "
                         f"(max_guide_chars)")
    try:
        return compile_guide(guide_type, guide)
    except GuideError as exc:
        raise InputError(f"input '{tn.GUIDED_DECODING_GUIDE}' ({guide_type}): {exc}") from None


def _min_length(inputs: Inputs, max_tokens: int) -> int:
    """min_length or min_tokens (one meaning, both names in use by clients); both only if they agree."""
    given = {name: value for name in (tn.MIN_LENGTH, tn.MIN_TOKENS)
             if (value := inputs.scalar(name, np.int32, None)) is not None}
    if len(set(given.values())) > 1:
        raise InputError(f"inputs '{tn.MIN_LENGTH}' and '{tn.MIN_TOKENS}' are one setting; got {given[tn.MIN_LENGTH]} "
                         f"and {given[tn.MIN_TOKENS]}")
    for name, value in given.items():
        if not 0 <= value <= max_tokens:
            raise InputError(f"input '{name}' must be within [0, {tn.MAX_TOKENS}={max_tokens}], got {value}")
    return next(iter(given.values()), 0)


def _penalties(inputs: Inputs) -> Penalties:
    repetition = inputs.scalar(tn.REPETITION_PENALTY, np.float32, tn.DEFAULT_REPETITION_PENALTY)
    if not 0.0 < repetition < float("inf"):  # also rejects NaN
        raise InputError(f"input '{tn.REPETITION_PENALTY}' must be a finite number > 0 (1 = off), got {repetition}")
    limit = tn.MAX_ABS_PRESENCE_FREQUENCY_PENALTY
    values = []
    for name, default in ((tn.PRESENCE_PENALTY, tn.DEFAULT_PRESENCE_PENALTY),
                          (tn.FREQUENCY_PENALTY, tn.DEFAULT_FREQUENCY_PENALTY)):
        value = inputs.scalar(name, np.float32, default)
        if not -limit <= value <= limit:
            raise InputError(f"input '{name}' must be within [-{limit:g}, {limit:g}] (0 = off), got {value}")
        values.append(value)
    return Penalties(repetition, *values)


def _bad_word_ids(word: str, encode: Encode | None) -> tuple[int, ...]:
    if encode is None:
        raise InputError(f"input '{tn.BAD_WORDS}' is not supported here (no tokenizer)")
    ids = tuple(int(token) for token in encode(word))
    if not ids:
        raise InputError(f"input '{tn.BAD_WORDS}': {word!r} encodes to no token")
    return ids


