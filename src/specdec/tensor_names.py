"""Public tensor names, names of things and defaults: the one place models, clients, load tests and tests
read them. Every layer may import this module; it imports nothing.

Names follow TensorRT-LLM's ensemble and vLLM's Triton backend so Triton LLM clients work unchanged.
Dims exclude the batch dimension (every public model has max_batch_size > 0).
"""

# ---- ensemble inputs -------------------------------------------------------------------------
TEXT_INPUT = "text_input"  # STRING [1]: the prompt; this or messages is required
# STRING [1]: instead of text_input, a chat as a JSON list of {"role": ..., "content": "..."} rendered through the
# tokenizer's chat template with the assistant's turn opened (what the OpenAI API's chat endpoint sends)
MESSAGES = "messages"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# INT32 [-1]: instead of text_input or messages, the prompt as token ids of the target's tokenizer (no chat
# template; what the OpenAI API's completions endpoint sends for a prompt of token ids)
PROMPT_TOKEN_IDS = "prompt_token_ids"
# STRING [1]: with messages, the tools the model may call: a JSON list of OpenAI's tool objects
# ({"type": "function", "function": {"name", "description", "parameters"}}), which the chat template renders
TOOLS = "tools"
MAX_TOKENS = "max_tokens"  # INT32 [1]
NUM_DRAFT_TOKENS = "num_draft_tokens"  # INT32 [1]; 0 = target-only decoding through the same path
ADAPTIVE_DRAFT = "adaptive_draft"  # BOOL [1]; true: num_draft_tokens is the maximum, K adapts per round
TEMPERATURE = "temperature"  # FP32 [1]; 0 = greedy
TOP_K = "top_k"  # INT32 [1]; 0 = no top-k filter
TOP_P = "top_p"  # FP32 [1]; 1 = no nucleus filter
MIN_P = "min_p"  # FP32 [1]; keep tokens at least min_p x the most likely one's probability; 0 = off
SEED = "seed"  # UINT64 [1]
STREAM = "stream"  # BOOL [1]
END_ID = "end_id"  # INT32 [1]
# For benchmark clients that force output lengths (TensorRT-LLM's and vLLM's conventions):
MIN_LENGTH = "min_length"  # INT32 [1]: no end token ends generation before this many tokens
MIN_TOKENS = "min_tokens"  # INT32 [1]: the same, by the name of TensorRT-LLM's current ensemble, vLLM and aiperf
IGNORE_EOS = "ignore_eos"  # BOOL [1]: end tokens never end generation (it runs to max_tokens)
STOP_WORDS = "stop_words"  # STRING [-1]: generation ends before the first occurrence of any ("" = none)
BAD_WORDS = "bad_words"  # STRING [-1]: token sequences the output never contains ("" = none)
# STRING [-1] and FP32 [-1], paired (TensorRT-LLM's embedding bias): each word's tokens get its weight added to
# their logits (a token of several words: the sum), as logit_bias does for token ids; "" = none
EMBEDDING_BIAS_WORDS = "embedding_bias_words"
EMBEDDING_BIAS_WEIGHTS = "embedding_bias_weights"
# FP32 [1] each, on the target's logits before temperature (decoding/penalties.py): repetition divides a
# positive logit of a token in prompt + output by r (multiplies a negative one); frequency and presence
# subtract f x its count and p once it occurs in the output
REPETITION_PENALTY = "repetition_penalty"
PRESENCE_PENALTY = "presence_penalty"
FREQUENCY_PENALTY = "frequency_penalty"
# STRING [1]: vLLM's Triton backend's JSON of sampling settings; its keys stand for inputs here
# (request.SAMPLING_PARAMETER_KEYS), each given once, as a key or as its input
SAMPLING_PARAMETERS = "sampling_parameters"
# TensorRT-LLM's ensemble inputs that its clients send; only their one supported value is accepted:
BEAM_WIDTH = "beam_width"  # INT32 [1]: 1 (speculative decoding decodes one sequence)
NUM_RETURN_SEQUENCES = "num_return_sequences"  # INT32 [1]: 1 (the same)
# BOOL [1]: true (the default: text_output is the generated text); false: a response that is not streamed
# holds the prompt's tokens before the generated ones (output_ids, text_output), as TensorRT-LLM's does
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
PAD_ID = "pad_id"  # INT32 [1]: a token id >= 0; no effect (responses carry no padding)
DRAFT_MODEL = "draft_model"  # STRING [1]: which configured draft model proposes
# STRING [1]: the LoRA adapter the target runs for this request (engine/lora.py; vLLM's name, also a
# sampling_parameters key); empty: the base model. Also target_model's input of that name, on every call.
LORA_NAME = "lora_name"
APPLY_CHAT_TEMPLATE = "apply_chat_template"  # BOOL [1]
# STRING [1]: a JSON object of more variables for the chat template (vLLM's field; e.g. enable_thinking)
CHAT_TEMPLATE_KWARGS = "chat_template_kwargs"
# STRING [1]: a chat template (Jinja text) this request's chat is rendered with instead of the server's (vLLM's
# request field); refused unless the server trusts requests' templates (preprocessing's trust_request_chat_template)
CHAT_TEMPLATE = "chat_template"
# BOOL [1]: the chat's last message, an assistant's, is continued (its turn left open, no new one opened) instead
# of answered: vLLM's continue_final_message, Anthropic's prefilled answer
CONTINUE_FINAL_MESSAGE = "continue_final_message"
RETURN_LOG_PROBS = "return_log_probs"  # BOOL [1]: also return each generated token's log-probability
# INT32 [1]: with return_log_probs, also the n most likely tokens at each generated position (0 to
# MAX_TOP_LOG_PROBS; 0: none, the default)
NUM_TOP_LOG_PROBS = "num_top_log_probs"
MAX_TOP_LOG_PROBS = 20  # OpenAI's bound on top_logprobs
# BOOL [1]: also return the prompt's tokens and each one's log-probability given the tokens before it (what
# evaluation harnesses score, OpenAI's `echo` with `logprobs`); with num_top_log_probs n, each prompt
# position's n most likely tokens too. The prompt then runs whole, with every row's logits.
RETURN_PROMPT_LOG_PROBS = "return_prompt_log_probs"
# BOOL [1]: also return the prompt's tokens as the model reads them, without scoring it (vLLM's
# return_token_ids: what reinforcement-learning trainers read to train on exactly the tokens sampled)
RETURN_PROMPT_IDS = "return_prompt_ids"
# BOOL [1], TensorRT-LLM's: also return the target's raw logits at each generated position (GENERATION_LOGITS,
# each response its tokens') and at every prompt position (CONTEXT_LOGITS, the first response: the prompt then
# runs whole, as for RETURN_PROMPT_LOG_PROBS). V floats a position: for scoring, not for every request.
RETURN_GENERATION_LOGITS = "return_generation_logits"
RETURN_CONTEXT_LOGITS = "return_context_logits"
# STRING [1]: vLLM's cache_salt: the request's prompt finds in the models' prefix caches only the blocks of
# requests with the same salt (and its own are found only by them), so that one tenant cannot learn from
# timings what another's prompts were ("" or none: the shared cache). Also each model's BLS input.
CACHE_SALT = "cache_salt"
MAX_CACHE_SALT = 1024  # characters
# BOOL [1] each: vLLM's Triton backend's additional outputs, by its names and meanings (its clients send
# them): finish_reason "None" on a streamed response that is not the last; cumulative_logprob; logprobs (the
# JSON of its `sampling_parameters` key `logprobs`); num_output_tokens this response's tokens (not the total
# so far); num_input_tokens as always
RETURN_FINISH_REASON = "return_finish_reason"
RETURN_CUMULATIVE_LOGPROB = "return_cumulative_logprob"
RETURN_LOGPROBS = "return_logprobs"
RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"
RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"
VLLM_OUTPUT_FLAGS = (RETURN_FINISH_REASON, RETURN_CUMULATIVE_LOGPROB, RETURN_LOGPROBS, RETURN_NUM_INPUT_TOKENS,
                     RETURN_NUM_OUTPUT_TOKENS)
# BOOL [1]: TensorRT-LLM's timing outputs (PERF_METRIC_OUTPUTS) in every response
RETURN_PERF_METRICS = "return_perf_metrics"
# INT32 [1]: where the request waits when the server is full (max_live_sequences reached, or no room in
# target_model's KV cache): a lower value goes first, then arrival (vLLM's order); 0 by default
PRIORITY = "priority"
# Structured output (TensorRT-LLM's names; decoding/grammar.py): the output follows a guide of this type,
# one of GUIDE_TYPES. vLLM's `sampling_parameters` key `guided_decoding` (or `structured_outputs`) says the same.
GUIDED_DECODING_GUIDE_TYPE = "guided_decoding_guide_type"  # STRING [1]
GUIDED_DECODING_GUIDE = "guided_decoding_guide"  # STRING [1]: the schema, pattern, grammar or choices
# json: any JSON object (the guide is empty); json_schema: a JSON schema; regex; ebnf_grammar: GBNF or Lark;
# choice: a JSON list of strings, the output is one of them; structural_tag: free text in which each of the JSON's
# `triggers` opens one of its `structures` (`begin`, JSON following `schema`, `end`), vLLM's and SGLang's form
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "choice", "structural_tag")
# STRING [1]: a reasoning model's parser, one of REASONING_PARSERS (decoding/thinking.py): the guide applies to the
# answer after the thinking, as that parser splits it (the OpenAI gateway sends it with --reasoning-parser)
REASONING_PARSER = "reasoning_parser"
HARMONY_REASONING = "openai_gptoss"  # gpt-oss's harmony channels (vLLM's name)
REASONING_PARSERS = ("deepseek_r1", "qwen3", HARMONY_REASONING)  # as vLLM and SGLang name them (`--reasoning-parser`)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # where deepseek_r1's and qwen3's thinking starts and ends
# gpt-oss's harmony markers (special tokens in its vocabulary): its answer is the message on the final channel,
# `<|channel|>final<|message|>`; a message before it closes with `<|end|>` and the next opens `<|start|>assistant`
HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE, HARMONY_END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
HARMONY_ROLE, HARMONY_FINAL = "assistant", "final"
# An assistant message's thinking in the messages input (vLLM's name), handed to the chat template under it and
# under "thinking" (gpt-oss's template's name)
REASONING_CONTENT = "reasoning_content"
TEMPLATE_THINKING = "thinking"
# INT32 [1]: with reasoning_parser, the thinking ends after at most this many tokens: the close tag is then forced
# (decoding/thinking.py; vLLM's thinking_token_budget); -1: no budget (the default)
THINKING_TOKEN_BUDGET = "thinking_token_budget"

# ---- ensemble outputs ------------------------------------------------------------------------
TEXT_OUTPUT = "text_output"  # STRING [-1]
OUTPUT_IDS = "output_ids"  # INT32 [-1]: the tokens of this response (public; postprocessing decodes them)
FINISH_REASON = "finish_reason"  # STRING [1]: length | stop | cancelled
NUM_INPUT_TOKENS = "num_input_tokens"  # INT32 [1]
NUM_OUTPUT_TOKENS = "num_output_tokens"  # INT32 [1]
TOTAL_DRAFT_TOKENS = "total_draft_tokens"  # INT32 [1]
TOTAL_ACCEPTED_DRAFT_TOKENS = "total_accepted_draft_tokens"  # INT32 [1]
ACCEPTANCE_RATE = "acceptance_rate"  # FP32 [1]: accepted / drafted (0 when nothing was drafted)
NUM_ROUNDS = "num_rounds"  # INT32 [1]: propose/verify rounds (target forward passes)
MEAN_ACCEPTED_LENGTH = "mean_accepted_length"  # FP32 [1]: tokens per round = 1 + accepted / rounds
# INT32 [1]: of the prompt's num_input_tokens, those target_model found in its prefix cache (their keys and values
# reused, not computed; whole blocks); 0 until the prompt has run, and without prefix caching (vLLM's name)
NUM_CACHED_TOKENS = "num_cached_tokens"
# With return_log_probs: the target's log-probability of each token of this response (its raw distribution:
# before temperature, top_k and top_p), and their sum over every token generated so far.
OUTPUT_LOG_PROBS = "output_log_probs"  # FP32 [-1]
CUM_LOG_PROBS = "cum_log_probs"  # FP32 [1]
# vLLM's Triton backend's outputs (with its return_* flags above): the sum of the log-probabilities of every
# token generated so far, and per token of this response a JSON object {"<token id>": {"logprob", "rank",
# "decoded_token"}} of the generated token and its position's n most likely (sampling_parameters' `logprobs`
# n), as a JSON list ("null" without `logprobs`)
CUMULATIVE_LOGPROB = "cumulative_logprob"  # FP32 [1]
LOGPROBS = "logprobs"  # STRING [1]
# INT64 [1] each, with return_perf_metrics (TensorRT-LLM's names): when the request arrived, when it started
# generating (its wait for a generation slot and KV room over), and when its first and its latest tokens were
# generated, in nanoseconds of the machine's monotonic clock (CLOCK_MONOTONIC, TensorRT-LLM's steady clock);
# 0: not yet
ARRIVAL_TIME_NS = "arrival_time_ns"
FIRST_SCHEDULED_TIME_NS = "first_scheduled_time_ns"
FIRST_TOKEN_TIME_NS = "first_token_time_ns"
LAST_TOKEN_TIME_NS = "last_token_time_ns"
PERF_METRIC_OUTPUTS = (ARRIVAL_TIME_NS, FIRST_SCHEDULED_TIME_NS, FIRST_TOKEN_TIME_NS, LAST_TOKEN_TIME_NS)
# INT32 [1] each, with return_perf_metrics too (TensorRT-LLM's KV reuse metrics, in target_model's KV blocks): the
# blocks of the prompt found in the prefix cache (num_cached_tokens in blocks), and the blocks the request computed
# into, which are all new here (no block is taken over from another sequence but a found one): the blocks its
# prompt and generated tokens so far span, less the reused ones
KV_CACHE_REUSED_BLOCKS = "kv_cache_reused_blocks"
KV_CACHE_ALLOC_NEW_BLOCKS = "kv_cache_alloc_new_blocks"
KV_CACHE_ALLOC_TOTAL_BLOCKS = "kv_cache_alloc_total_blocks"
KV_CACHE_METRIC_OUTPUTS = (KV_CACHE_REUSED_BLOCKS, KV_CACHE_ALLOC_NEW_BLOCKS, KV_CACHE_ALLOC_TOTAL_BLOCKS)
# UINT64 [1]: the key this server's models know the generation by (its KV caches, its cancellation flag;
# `sequence_id` to the models): for logs, and for vllm_compatible to pass a client's cancellation on
GENERATION_ID = "generation_id"
# With num_top_log_probs n > 0: at each token of this response the n most likely tokens of the same raw
# distribution, most likely first, and their log-probabilities (one row per token)
OUTPUT_TOP_IDS = "output_top_ids"  # INT32 [-1, -1]
OUTPUT_TOP_LOG_PROBS = "output_top_log_probs"  # FP32 [-1, -1]
# With return_prompt_log_probs, in the first response only: the prompt's P tokens as the model reads them
# (chat template and special tokens included), the log-probabilities of its tokens after the first (P - 1:
# the first has no context) and their ranks in their distributions (1: the most likely), and with
# num_top_log_probs n each of those positions' n most likely tokens.
# With return_prompt_ids, the first response's output_prompt_ids alone.
OUTPUT_PROMPT_IDS = "output_prompt_ids"  # INT32 [-1]
OUTPUT_PROMPT_LOG_PROBS = "output_prompt_log_probs"  # FP32 [-1]
OUTPUT_PROMPT_RANKS = "output_prompt_ranks"  # INT32 [-1]
OUTPUT_PROMPT_TOP_IDS = "output_prompt_top_ids"  # INT32 [-1, -1]
OUTPUT_PROMPT_TOP_LOG_PROBS = "output_prompt_top_log_probs"  # FP32 [-1, -1]
# With return_generation_logits / return_context_logits, as TensorRT-LLM's ensemble shapes them: (beam 1,
# tokens, V) per response, its tokens' rows; (P, V) in the first response, row i the logits after prompt token i
GENERATION_LOGITS = "generation_logits"  # FP32 [-1, -1, -1]
CONTEXT_LOGITS = "context_logits"  # FP32 [-1, -1]

# ---- internal tensors between the models -----------------------------------------------------
INPUT_IDS = "input_ids"  # INT32 [-1]: preprocessing output; draft/target: tokens to append
INPUT_LENGTH = "input_length"  # INT32 [1]
PREFIX_IDS = "prefix_ids"  # INT32 [-1]: tokens emitted before output_ids (detokenization context)
CACHE_LENGTH = "cache_length"  # INT32 [1]: keep this many cached tokens, drop the rest (rollback)
NUM_LOGITS = "num_logits"  # INT32 [1]: target returns the last num_logits positions
# INT32 [1]: the score_rows positions before the last num_logits are scored too: at each, the log-probability
# of the new token that follows it (SCORED_LOG_PROBS), and with GREEDY_TOP_IDS asked its top row
# (SCORED_TOP_*); the step's other outputs still cover its last num_logits positions. 0: none (every step
# but the first of a request that asked for its prompt's log-probabilities).
SCORE_ROWS = "score_rows"
# INT32 [1]: the token after the step's new tokens, which its last score row scores when no position is verified
# after it (a long prompt's chunk: the next chunk's first token); -1: none
SCORE_NEXT = "score_next"
SCORED_LOG_PROBS = "scored_log_probs"  # FP32 [-1]
SCORED_LOGITS = "scored_logits"  # FP32 [-1, V]: with return_context_logits, each score row's logits
SCORED_RANKS = "scored_ranks"  # INT32 [-1]: each scored token's rank (1 + the tokens its row makes more likely)
SCORED_TOP_IDS = "scored_top_ids"  # INT32 [-1, MAX_TOP_LOG_PROBS]
SCORED_TOP_LOG_PROBS = "scored_top_log_probs"  # FP32 [-1, MAX_TOP_LOG_PROBS]
# INT32 [num_logits, ceil(V / 32)]: bit i of word w allows token 32 w + i at that position (structured output):
# greedy_tokens are then the best allowed tokens, their log-probabilities still the raw distribution's
ALLOWED_TOKENS = "allowed_tokens"
# INT32 [-1]: the new tokens as a tree of candidates (each one's parent among them, -1 after the cache);
# empty: a chain
TREE_PARENTS = "tree_parents"
# INT32 [-1]: the last step was a tree and these of its new tokens were accepted, root to leaf: their keys
# and values move where a chain's would be before this step runs; empty: none
ACCEPTED_PATH = "accepted_path"
# INT32 [1]: on a sequence's first step, the positions its whole generation needs (set aside then, or the
# step is answered UNAVAILABLE: the model's KV budget is full)
RESERVE_TOKENS = "reserve_tokens"
LOGITS = "logits"  # FP32 [-1, -1]
GREEDY_TOKENS = "greedy_tokens"  # INT32 [-1]: argmax of each returned position
GREEDY_LOG_PROBS = "greedy_log_probs"  # FP32 [-1]: each greedy token's log-probability (log-softmax)
# Each returned position's MAX_TOP_LOG_PROBS most likely tokens and their log-probabilities (the caller keeps
# the n it was asked for): INT32 / FP32 [-1, MAX_TOP_LOG_PROBS]
GREEDY_TOP_IDS = "greedy_top_ids"
GREEDY_TOP_LOG_PROBS = "greedy_top_log_probs"
# FP32 [3]: the target forward this step ran in: [token rows, sequences, seconds] (the policy's costs)
FORWARD_STATS = "forward_stats"
DRAFT_TOKENS = "draft_tokens"  # INT32 [-1]
DRAFT_PROBS = "draft_probs"  # FP32 [-1, -1]: processed draft distributions, one per draft token
# INT32 [1]: draft_model's candidates per drafted position; above 1 a tree of at most num_draft_tokens nodes
NUM_DRAFT_BRANCHES = "num_draft_branches"
MAX_DRAFT_BRANCHES = 8  # speculative_decoding's draft_branches and lookup_branches: at most this wide
# speculative_decoding's lookup_min_ngram and lookup_max_ngram: prompt lookup's shortest and longest match
LOOKUP_NGRAM = (2, 4)
MAX_LOOKUP_NGRAM = 16
# speculative_decoding's stream_interval and a request's (SGLang's --stream-interval): a streamed answer's
# responses at least this many tokens apart, at most this many
MAX_STREAM_INTERVAL_TOKENS = 4096
DRAFT_PARENTS = "draft_parents"  # INT32 [-1]: a drafted tree's parent of each token (-1: the root); empty: a chain
CACHED_LENGTH = "cached_length"  # INT32 [1]: tokens the draft's cache holds after the proposal
# INT32 [2]: target_model's answer, on request: of the sequence's tokens so far, those its prefix cache held (a
# prompt's; the orchestrator's num_cached_tokens), and its KV block's tokens (the unit it finds them in)
CACHED_TOKENS = "cached_tokens"
# FP32 [-1, -1]: the target's features (its hidden_layers' states, concatenated) at every new position:
# target_model's output on request, a draft head's input (the positions before its last new token)
FEATURES = "features"
# target_model hosting heads (engine/hosted_heads.py): a verify call's head that drafts first, BYTES [1] ("": none),
# and what it drafts, FP64 [7]: k, candidates per position, temperature, top_k, top_p, min_p, the round's seed;
# its answer: DRAFT_TOKENS, DRAFT_PARENTS, DRAFT_PROBS (sampled chains) and the head's execution, FP32 [3] as
# FORWARD_STATS
DRAFT_HEAD = "draft_head"
DRAFT_ASK = "draft_ask"
DRAFT_STATS = "draft_stats"
TEXT_LENGTH = "text_length"  # INT32 [1]: characters of the decoded chunk to keep; -1 = all (stop words)
# BOOL [1]: whether the chunk's text leaves special tokens out (vLLM's skip_special_tokens, a sampling setting;
# true unless the request says false)
SKIP_SPECIAL_TOKENS = "skip_special_tokens"
# sampling_parameters' key of this server's own: true with no max_tokens generates what the context leaves (up to
# max_max_tokens), what OpenAI's and vLLM's APIs do; the OpenAI API sends it with every request
MAX_TOKENS_TO_CONTEXT = "max_tokens_to_context"
# sampling_parameters' key of this server's own: OpenAI's Predicted Outputs, the text a request expects back, which
# its rounds draft from (prompt lookup over it: decoding/prediction_proposer.py)
PREDICTION = "prediction"
PREDICTION_DRAFT = "prediction"  # the draft method's name in the policy's measured costs and the metrics
SEQUENCE_ID = "sequence_id"  # UINT64 [1]: the generation's key, for cancellation flags
RELEASE = "release"  # BOOL [1]: free this sequence's cache (sent with the sequence END flag)

# Ends the message of every refusal for capacity (max_live_sequences, a model's KV budget or sequence
# limit): the same request can succeed later. A BLS response keeps an error's message but not its code,
# so the orchestrator recognises a model's refusal by it, and so do clients reading a stream's error.
RETRY_LATER = "retry later"
# Ends the message of a request that failed because a model it needs is down or reloading (its stub died;
# the launcher's watchdog brings it back): UNAVAILABLE, the same request can succeed once it is back.
MODEL_DOWN = "a model is being restored, retry"
# The orchestrator's counter of calls a model did not answer within model_call_timeout_s (label `model`),
# which the launcher's watchdog reads to restart a model whose stub hangs while its process runs.
MODEL_CALL_TIMEOUTS = "specdec_model_call_timeouts_total"
DEFAULT_MODEL_CALL_TIMEOUT_S = 120.0  # far above any forward's time; 0: calls wait for ever
# Each orchestrator instance's event loop counts its turns, HEARTBEAT_S apart (label `instance`); the watchdog
# restarts the server when an instance with requests generating (LIVE_SEQUENCES) stops counting: a hung loop.
ORCHESTRATOR_HEARTBEATS = "specdec_orchestrator_heartbeats_total"
HEARTBEAT_S = 1.0
LIVE_SEQUENCES = "specdec_live_sequences"

# ---- finish reasons --------------------------------------------------------------------------
FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_CANCELLED = "cancelled"

# ---- model names -----------------------------------------------------------------------------
ENSEMBLE = "ensemble"
PREPROCESSING = "preprocessing"
SPECULATIVE_DECODING = "speculative_decoding"
POSTPROCESSING = "postprocessing"
DRAFT_MODEL_NAME = "draft_model"
TARGET_MODEL_NAME = "target_model"
# vLLM's Triton backend's interface over the ensemble: max_batch_size 0, as its clients shape their tensors
VLLM_COMPATIBLE = "vllm_compatible"

# ---- draft methods and weights --------------------------------------------------------------------
NGRAM = "ngram"  # the built-in prompt-lookup draft (no model); any other draft name is a draft model
DRAFT_SEPARATOR = "+"  # a draft method "LOOKUP+MODEL" (decoding/lookup_first.py): the lookup first, MODEL otherwise
SUFFIX = "suffix"  # built in too: prompt lookup over the request's tokens and earlier requests' (a shared cache)
DEFAULT_HEAD_NAME = "draft_head"  # the model name of a head served without one given (--draft-head DIR)
# draft_model's draft_kind: a causal LM, a trained head over features, or the target skipping layers (SWIFT)
DRAFT_KINDS = ("model", "head", "skip")
DEFAULT_SKIP_DRAFT_NAME = "draft_skip"  # the model name of a layer-skip self-draft served without one given
SKIP_SEARCH = "auto"  # draft_model's skip_layers: searched on the fly (else a list of layers, "3,5,7-9")
# The confidence stop (sampling.stops_after): every model draft's default draft_stop_below. Of 0-0.5 on the
# default pair, 0.3 cut drafted tokens 14 % for 0.15 tokens per round (docs/results/2026-11-27-swift.md).
DEFAULT_DRAFT_STOP_BELOW = 0.3
BUILTIN_DRAFTS = (NGRAM, SUFFIX)  # the model-free methods: a draft costs (almost) nothing
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")  # the models' `dtype` parameter
# the models' `weights_dtype`: the linears' weights in `dtype`, FP8 (fp8_linear.py, GPUs), or rounded to 8-bit
# blocks (panel_linear.round_q8: the CPU's panel kernel, float32)
WEIGHTS_DTYPES = ("same", "fp8", "q8")

# ---- request defaults (what a request that leaves an input out gets) ---------------------------------
DEFAULT_TEMPERATURE = 0.0  # greedy
# A temperature below this is greedy, as vLLM (1e-5) and SGLang treat it: sampling there differs from the argmax
# only between logits within ~1e-4 of each other, and benchmark clients send 1e-6 for greedy (TensorRT-LLM's)
GREEDY_BELOW_TEMPERATURE = 1e-5
DEFAULT_TOP_K = 0
DEFAULT_TOP_P = 1.0
DEFAULT_MIN_P = 0.0
DEFAULT_REPETITION_PENALTY = 1.0  # off
DEFAULT_PRESENCE_PENALTY = 0.0  # off
DEFAULT_FREQUENCY_PENALTY = 0.0  # off
MAX_ABS_PRESENCE_FREQUENCY_PENALTY = 2.0  # vLLM's and OpenAI's range: [-2, 2]
# Overridable in speculative_decoding's config.pbtxt parameters (and the launcher's pair settings):
DEFAULT_MAX_TOKENS = 64
DEFAULT_NUM_DRAFT_TOKENS = 4
DEFAULT_MAX_NUM_DRAFT_TOKENS = 16
DEFAULT_MAX_MAX_TOKENS = 1024
DEFAULT_MAX_CONTEXT_TOKENS = 8192  # prompt + output tokens per sequence; the chart's default too
# return_generation_logits of a whole (not streamed) answer and return_context_logits hold V floats a token until
# the answer leaves (~200 KB a token for a 49k vocabulary, 0.5 MB for a 128k one): the most tokens they may cover
DEFAULT_MAX_LOGITS_TOKENS = 512
# speculative_decoding stub processes by the models' device: on CPU two, concurrent streams' rounds in
# parallel, not on one Python thread; with the models on GPUs one, where a second gained nothing and each
# instance's adaptive policy measured its costs apart. The committed
# config (CPU), the launcher's and the chart's defaults (by gpu.count) too.
DEFAULT_ORCHESTRATOR_INSTANCES = {"cpu": 2, "gpu": 1}

# ---- executor settings of draft_model / target_model (config parameters, launcher and chart) ---------
# auto: the static executor with CUDA graphs on GPUs, the eager one on CPU; off: eager everywhere;
# graphs: require CUDA graphs.
COMPILE_MODES = ("auto", "off", "graphs")
EXECUTORS = ("auto", "static", "dynamic")  # auto: static on CUDA where the model family allows it
# What the OpenAI API and vllm_compatible call: direct = preprocessing, then speculative_decoding (whose responses
# carry their text: no postprocessing step per response); ensemble = the ensemble
UPSTREAMS = ("direct", "ensemble")
# The static executor's attention: paged (engine/paged_attention.py, a Triton kernel reading the KV pool in
# place), sdpa (the window gathered, then torch's SDPA), auto (paged on CUDA where Triton serves the dtype).
ATTENTION_KINDS = ("auto", "paged", "sdpa")
# target_model's greedy one-token steps run ahead of their requests (engine/run_ahead.py): auto = on CUDA,
# where the device would otherwise idle through each round's host work; on CPU the forward is the host's work.
RUN_AHEAD_MODES = ("auto", "on", "off")
# Where CUDA graphs run, prompts of up to this many tokens replay captured buckets of their own (powers of
# two; 0: eager prompts): an eager prompt pays a kernel launch per operation, which dominated the time
# to first token on a GPU, for a few more graphs per model.
DEFAULT_PREFILL_GRAPH_ROWS = 512
