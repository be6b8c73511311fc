"""Speculative decoding served end to end by a real tritonserver with the tiny pair.

Greedy speculative output must equal target-only output token for token (num_output_tokens and the
text), whatever the draft: a partially agreeing draft (rejections and rollbacks every few tokens),
the target itself (everything accepted) and an unrelated model (almost everything rejected).
"""

from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec import tensor_names as tn

from .helpers import grpc_stream, http_generate

pytestmark = pytest.mark.integration

PROMPTS = [
    "Hello there, how are you today?",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "Summarize: the quick brown fox jumps over the lazy dog.",
    "1, 2, 3, 4, 5,",
    "Translate to French: good morning",
    "Q: What is speculative decoding?\nA:",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def target_only(server):
    return {p: grpc_stream(server.grpc_url, p, max_tokens=MAX_TOKENS, num_draft_tokens=0) for p in PROMPTS}


def test_target_only_baseline_is_sane(target_only):
    for result in target_only.values():
        assert result[tn.NUM_OUTPUT_TOKENS] >= 1
        assert result[tn.TEXT_OUTPUT]
        assert result[tn.TOTAL_DRAFT_TOKENS] == 0
        assert result[tn.NUM_ROUNDS] == result[tn.NUM_OUTPUT_TOKENS] + (result[tn.FINISH_REASON] == "stop")
        assert result[tn.FINISH_REASON] in ("length", "stop")


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_speculative_equals_target_only(server, target_only, k):
    drafted = accepted = 0
    for prompt in PROMPTS:
        result = grpc_stream(server.grpc_url, prompt, max_tokens=MAX_TOKENS, num_draft_tokens=k, adaptive_draft=False)
        assert result[tn.TEXT_OUTPUT] == target_only[prompt][tn.TEXT_OUTPUT], prompt
        assert result[tn.NUM_OUTPUT_TOKENS] == target_only[prompt][tn.NUM_OUTPUT_TOKENS]
        assert result[tn.FINISH_REASON] == target_only[prompt][tn.FINISH_REASON]
        drafted += result[tn.TOTAL_DRAFT_TOKENS]
        accepted += result[tn.TOTAL_ACCEPTED_DRAFT_TOKENS]
    # The default tiny draft agrees partially: both acceptances and rejections (rollbacks) happened.
    assert 0 < accepted < drafted


def test_draft_identical_to_target_accepts_every_token(server, target_only):
    for prompt in PROMPTS[:4]:
        result = grpc_stream(server.grpc_url, prompt, max_tokens=MAX_TOKENS, num_draft_tokens=4,
                             draft_model="draft_model_exact", adaptive_draft=False)
        assert result[tn.TEXT_OUTPUT] == target_only[prompt][tn.TEXT_OUTPUT]
        assert result[tn.ACCEPTANCE_RATE] == 1.0
        assert result[tn.MEAN_ACCEPTED_LENGTH] == pytest.approx(1 + result[tn.TOTAL_ACCEPTED_DRAFT_TOKENS] / result[tn.NUM_ROUNDS])
        assert result[tn.TOTAL_ACCEPTED_DRAFT_TOKENS] == result[tn.TOTAL_DRAFT_TOKENS] > 0
        # 5 tokens per round when everything is accepted
        assert result[tn.NUM_ROUNDS] <= -(-MAX_TOKENS // 5) + 1


def test_adaptive_draft_length_keeps_the_output_and_stops_a_useless_draft(server, target_only):
    """Adaptive K (the default) is lossless, and a draft that never agrees is soon switched off: it
    drafts far fewer tokens than the same request with a fixed K."""
    fixed = adaptive = 0
    for prompt in PROMPTS[:4]:
        a = grpc_stream(server.grpc_url, prompt, max_tokens=MAX_TOKENS, num_draft_tokens=4,
                        draft_model="draft_model_random")
        f = grpc_stream(server.grpc_url, prompt, max_tokens=MAX_TOKENS, num_draft_tokens=4,
                        draft_model="draft_model_random", adaptive_draft=False)
        assert a[tn.TEXT_OUTPUT] == f[tn.TEXT_OUTPUT] == target_only[prompt][tn.TEXT_OUTPUT]
        assert f[tn.TOTAL_DRAFT_TOKENS] <= 4 * f[tn.NUM_ROUNDS]
        fixed += f[tn.TOTAL_DRAFT_TOKENS]
        adaptive += a[tn.TOTAL_DRAFT_TOKENS]
    assert adaptive < fixed / 2
    for k in (1, 3):  # and with the partially agreeing draft, at any maximum K
        for prompt in PROMPTS[4:]:
            result = grpc_stream(server.grpc_url, prompt, max_tokens=MAX_TOKENS, num_draft_tokens=k)
            assert result[tn.TEXT_OUTPUT] == target_only[prompt][tn.TEXT_OUTPUT], prompt
            assert result[tn.TOTAL_DRAFT_TOKENS] <= k * result[tn.NUM_ROUNDS]


def test_disagreeing_draft_still_gives_identical_output(server, target_only):
    for prompt in PROMPTS[:4]:
        result = grpc_stream(server.grpc_url, prompt, max_tokens=MAX_TOKENS, num_draft_tokens=4,
                             draft_model="draft_model_random", adaptive_draft=False)
        assert result[tn.TEXT_OUTPUT] == target_only[prompt][tn.TEXT_OUTPUT]
        assert result[tn.ACCEPTANCE_RATE] < 0.2


@pytest.mark.parametrize("k", [2, 5])
def test_ngram_draft_gives_identical_output(server, target_only, k):
    accepted = 0
    for prompt in PROMPTS:
        result = grpc_stream(server.grpc_url, prompt, max_tokens=MAX_TOKENS, num_draft_tokens=k, draft_model="ngram")
        assert result[tn.TEXT_OUTPUT] == target_only[prompt][tn.TEXT_OUTPUT], prompt
        accepted += result[tn.TOTAL_ACCEPTED_DRAFT_TOKENS]
        assert result[tn.TOTAL_DRAFT_TOKENS] <= k * result[tn.NUM_ROUNDS]  # rounds without a match draft nothing


def test_suffix_draft_repeats_earlier_requests_text_losslessly(server, target_only):
    """"suffix": prompt lookup also over the text of earlier requests of the same orchestrator instance.
    A prompt sent again is drafted from its first answer: everything it drafts is accepted (greedy: the
    same answer) in a few long rounds, and the text is the target's, over gRPC and HTTP. The sends go to
    either of the server's two instances, each with a cache of its own."""
    prompt = PROMPTS[3]
    sends = [grpc_stream(server.grpc_url, prompt, max_tokens=MAX_TOKENS, num_draft_tokens=8, draft_model="suffix",
                         adaptive_draft=False) for _ in range(3)]
    sends.append(http_generate(server.http_url, prompt, max_tokens=MAX_TOKENS, num_draft_tokens=8,
                               draft_model="suffix", adaptive_draft=False))
    for result in sends:
        assert result[tn.TEXT_OUTPUT] == target_only[prompt][tn.TEXT_OUTPUT]
    # The best repeat (an instance's cache may also hold this prompt's text from another module's sampled
    # request, until a greedy one replaces it).
    best = max(sends[1:], key=lambda r: r[tn.TOTAL_ACCEPTED_DRAFT_TOKENS])
    assert best[tn.TOTAL_ACCEPTED_DRAFT_TOKENS] >= MAX_TOKENS // 2 and best[tn.ACCEPTANCE_RATE] >= 0.8, best
    assert best[tn.NUM_ROUNDS] <= 8, best


def test_http_generate_matches_grpc(server, target_only):
    prompt = PROMPTS[1]
    result = http_generate(server.http_url, prompt, max_tokens=MAX_TOKENS, num_draft_tokens=3)
    assert result[tn.TEXT_OUTPUT] == target_only[prompt][tn.TEXT_OUTPUT]
    assert result[tn.NUM_INPUT_TOKENS] == target_only[prompt][tn.NUM_INPUT_TOKENS]


def test_concurrent_requests_equal_their_solo_output(server, target_only):
    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        return prompt, grpc_stream(server.grpc_url, prompt, max_tokens=MAX_TOKENS, num_draft_tokens=1 + i % 5)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for prompt, result in results:
        assert result[tn.TEXT_OUTPUT] == target_only[prompt][tn.TEXT_OUTPUT], prompt


@pytest.mark.parametrize("k", [0, 4])
def test_each_model_processes_at_most_prompt_plus_rounds_times_k_plus_one(server, k):
    """No prefix is re-sent: P + R (K + 1) tokens per model at most, counted by the models' own metric."""
    prompt = PROMPTS[3]
    before = {m: server.metric("specdec_model_tokens_processed_total", model=m) for m in ("draft_model", "target_model")}
    result = grpc_stream(server.grpc_url, prompt, max_tokens=40, num_draft_tokens=k, adaptive_draft=False)
    after = {m: server.metric("specdec_model_tokens_processed_total", model=m) for m in ("draft_model", "target_model")}
    p, r = result[tn.NUM_INPUT_TOKENS], result[tn.NUM_ROUNDS]
    target_tokens = after["target_model"] - before["target_model"]
    draft_tokens = after["draft_model"] - before["draft_model"]
    assert target_tokens <= p + r * (k + 1)
    assert draft_tokens <= p + r * (k + 1)
    # Every generated token but the last went through the target; the prompt exactly once.
    assert target_tokens >= p + result[tn.NUM_OUTPUT_TOKENS] - 1
    assert (draft_tokens == 0) == (k == 0)


def test_caches_are_freed_after_requests(server):
    grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=8, num_draft_tokens=2)
    for model in ("draft_model", "target_model"):
        assert server.metric("specdec_model_live_sequences", model=model) == 0


def test_invalid_request_gets_clear_error_and_server_keeps_serving(server, target_only):
    from .helpers import GenerationError

    with pytest.raises(GenerationError, match="num_draft_tokens"):
        grpc_stream(server.grpc_url, PROMPTS[0], num_draft_tokens=-1)
    with pytest.raises(GenerationError, match="draft_model"):
        grpc_stream(server.grpc_url, PROMPTS[0], draft_model="no_such_model")
    assert server.ready()
    ok = grpc_stream(server.grpc_url, PROMPTS[0], max_tokens=MAX_TOKENS, num_draft_tokens=2)
    assert ok[tn.TEXT_OUTPUT] == target_only[PROMPTS[0]][tn.TEXT_OUTPUT]
