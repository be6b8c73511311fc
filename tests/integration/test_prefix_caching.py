"""Prefix caching and chunked prefill served by a real tritonserver (the tiny pair, float64): on the
session's server (the static executor, its pool's blocks), requests sharing a long system prompt compute it
once, over gRPC and HTTP, greedy and speculative, and their text is the text computed from scratch; the
models count what they looked up and found. On a server of its own on the dynamic executor (transformers'
forward, its prefix store) with prefill_chunk_tokens=512, a longer prompt reaches the models in chunks, is
found again chunk after chunk, and scores as the static executor scores it whole."""

import pytest

from specdec import tensor_names as tn

from specdec.serving import server as serving

from .helpers import grpc_stream, http_generate, retire_server, run_bench

pytestmark = pytest.mark.integration

# ~140 tokens (the tiny pair's tokenizer): four full blocks of 32 and a tail. Its first words are no other
# test's (loadtest/system_prompt.txt, which Locust's test sends, has the rest), so its first request computes it.
SYSTEM = ("Served-cache test. You are the support assistant of a hardware store in a small mountain town. "
          "Answer in two short sentences, politely, and never invent prices: if you do not know one, say that a colleague will call "
          "back. Opening hours are eight to six on weekdays and nine to one on Saturdays; the store is closed on "
          "Sundays and public holidays. Deliveries within twenty kilometres are free for orders above fifty "
          "francs. Returns are accepted within thirty days with the receipt, except for cut materials such as "
          "chains, ropes, cables and timber. The workshop sharpens knives and tools while customers wait.\n\n")
QUESTIONS = ["Question: can I return a rope I bought last week?\nAnswer:",
             "Question: are you open on Sunday morning?\nAnswer:"]
MODELS = ("target_model", "draft_model")


def shared_blocks(a: str, b: str) -> int:
    """Full blocks of 32 tokens two prompts begin with alike (the tiny pair's tokenizer, no chat template)."""
    from specdec.decoding.text import load_tokenizer
    from specdec.serving.pairs import tiny_pair

    tokenizer = load_tokenizer(tiny_pair().tokenizer_path)
    ids = [tokenizer.encode(text) for text in (a, b)]
    common = next((i for i, (x, y) in enumerate(zip(*ids)) if x != y), min(map(len, ids)))
    return common // 32


def counters(server) -> dict:
    return {(name, model): server.metric(f"specdec_model_{name}", model=model)
            for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "tokens_processed_total")
            for model in MODELS}


def delta(before: dict, after: dict, name: str, model: str) -> float:
    return after[(name, model)] - before[(name, model)]


def test_a_shared_system_prompt_is_computed_once_and_reused_exactly(server):
    prompt = SYSTEM + QUESTIONS[0]
    start = counters(server)
    cold = grpc_stream(server.grpc_url, prompt, max_tokens=20, num_draft_tokens=4, adaptive_draft=False)
    first = counters(server)
    tokens = cold[tn.NUM_INPUT_TOKENS]
    assert tokens > 128 and cold[tn.NUM_CACHED_TOKENS] == 0
    for model in MODELS:  # nothing cached yet: the whole prompt ran
        assert delta(start, first, "prefix_cache_queries_total", model) >= tokens
        assert delta(start, first, "prefix_cache_hits_total", model) == 0
        assert delta(start, first, "tokens_processed_total", model) >= tokens

    # The same prompt again, target-only over HTTP and speculative over gRPC: the same text, from blocks.
    again = http_generate(server.http_url, prompt, max_tokens=20, num_draft_tokens=0)
    second = counters(server)
    assert again[tn.TEXT_OUTPUT] == cold[tn.TEXT_OUTPUT]
    reusable = (tokens - 1) // 32 * 32
    assert delta(first, second, "prefix_cache_hits_total", "target_model") == reusable
    assert again[tn.NUM_CACHED_TOKENS] == reusable  # the request's own count, over HTTP
    assert delta(first, second, "tokens_processed_total", "target_model") <= tokens - reusable + 20
    spec = grpc_stream(server.grpc_url, prompt, max_tokens=20, num_draft_tokens=4, adaptive_draft=False)
    third = counters(server)
    assert spec[tn.TEXT_OUTPUT] == cold[tn.TEXT_OUTPUT] and spec[tn.NUM_CACHED_TOKENS] == reusable
    for model in MODELS:
        assert delta(second, third, "prefix_cache_hits_total", model) >= reusable

    # Another question after the same system prompt, K=0 then K=4: the same text.
    other = SYSTEM + QUESTIONS[1]
    results = [grpc_stream(server.grpc_url, other, max_tokens=20, num_draft_tokens=k, adaptive_draft=False)
               for k in (0, 4)]
    assert results[0][tn.TEXT_OUTPUT] == results[1][tn.TEXT_OUTPUT]
    # The first finds the full blocks the two questions' prompts share, the second every full block of its own.
    found = shared_blocks(SYSTEM + QUESTIONS[0], other) * 32 + (results[0][tn.NUM_INPUT_TOKENS] - 1) // 32 * 32
    assert delta(third, counters(server), "prefix_cache_hits_total", "target_model") == found
    for model in MODELS:
        assert server.metric("specdec_model_live_sequences", model=model) == 0
        assert server.metric("specdec_model_kv_cache_bytes", model=model) == 0  # the store is not a sequence's
        assert server.metric("specdec_model_prefix_cache_bytes", model=model) > 0



@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("chunked")
    own = serving.start(tmp_path / "run", tmp_path / "server.log",
                        # K tokens drafted every round (no confidence stop): the counts below include them
                        ["--pair", "tiny", "--set", "speculative_decoding.prefill_chunk_tokens=512",
                         "--set", "draft_model.draft_stop_below=0",
                         # the dynamic executor, which the tiny pair runs in no other served test
                         "--set", "target_model.executor=dynamic", "--set", "draft_model.executor=dynamic"])
    log = own.log_path.read_text()
    assert all(f"{model}: dynamic executor" in log for model in MODELS)
    yield own
    retire_server(own)


def test_a_prompt_longer_than_a_chunk_is_sent_in_chunks_and_found_again_whole(chunked):
    server = chunked
    prompt = "The store's policies, in full.\n" + (SYSTEM * 5)[:2560] + QUESTIONS[1]  # ~590 tokens: two chunks
    start = counters(server)
    calls = server.metric("nv_inference_request_success", model="target_model")
    cold = grpc_stream(server.grpc_url, prompt, max_tokens=12, num_draft_tokens=4, adaptive_draft=False)
    tokens = cold[tn.NUM_INPUT_TOKENS]
    assert 512 + 32 < tokens < 1024 - 12 and cold[tn.NUM_CACHED_TOKENS] == 0
    # Every round's call, the release, and one more: the prompt's first chunk.
    assert server.metric("nv_inference_request_success", model="target_model") - calls == cold[tn.NUM_ROUNDS] + 2
    first = counters(server)
    for model in MODELS:
        assert delta(start, first, "prefix_cache_hits_total", model) == 0
    assert delta(start, first, "prefix_cache_queries_total", "target_model") == tokens + 4  # the prompt and K
    assert delta(start, first, "prefix_cache_queries_total", "draft_model") == tokens
    again = []
    for k in (0, 4):
        before = counters(server)
        again.append(grpc_stream(server.grpc_url, prompt, max_tokens=12, num_draft_tokens=k, adaptive_draft=False))
        found = {m: delta(before, counters(server), "prefix_cache_hits_total", m) for m in MODELS}
        # The first chunk (512 tokens, no logits wanted) is found whole, the second up to its last block.
        reusable = 512 + (tokens - 512 - 1) // 32 * 32
        assert found == {"target_model": reusable, "draft_model": reusable if k else 0}, k
        assert again[-1][tn.NUM_CACHED_TOKENS] == reusable  # over its chunks
    assert again[0][tn.TEXT_OUTPUT] == again[1][tn.TEXT_OUTPUT] == cold[tn.TEXT_OUTPUT]


def test_a_long_prompt_is_scored_in_chunks_as_it_is_whole(chunked, server):
    """return_prompt_log_probs with prefill_chunk_tokens: the prompt reaches the target in chunks that score
    every row (the last against the next chunk's first token), other requests' rounds between them; the scores
    equal the unchunked server's, and the generation too."""
    from client import Client, GenerationParams

    prompt = "Scored in chunks.\n" + (SYSTEM * 5)[:2560] + QUESTIONS[0]  # ~590 tokens: two chunks
    params = GenerationParams(max_tokens=6, num_draft_tokens=3, adaptive_draft=False, temperature=0.0,
                              return_prompt_log_probs=True, return_log_probs=True, num_top_log_probs=2)
    calls = chunked.metric("nv_inference_request_success", model="target_model")
    parts = Client(chunked.grpc_url).generate(prompt, params)
    # Every round's call, the release, and the prompt's first chunk
    assert chunked.metric("nv_inference_request_success", model="target_model") - calls == parts.num_rounds + 2
    whole = Client(server.grpc_url).generate(prompt, params)
    assert 512 < len(parts.prompt_ids) and parts.prompt_ids == whole.prompt_ids
    assert len(parts.prompt_log_probs) == len(parts.prompt_ids) - 1
    assert max(abs(a - b) for a, b in zip(parts.prompt_log_probs, whole.prompt_log_probs)) < 1e-6
    assert parts.prompt_top_ids == whole.prompt_top_ids and parts.text == whole.text


def test_the_prefix_bench_runs_against_a_server(server, tmp_path):
    """`bench/prefix_bench.py --url`: the shared prompts are found in the cache, the unique ones not; with
    --stall, its two phases run."""
    out = tmp_path / "prefix.md"
    run_bench("prefix_bench.py", "--url", server.grpc_url, "--metrics-url", server.metrics_url, "--system-words", "120",
              "--requests", "2", "--max-tokens", "4", "--out", str(out))
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.split("|")[1:-1]]
                                          for line in out.read_text().splitlines() if line.startswith("| ")
                                          and not line.startswith(("| prompts", "| ---")))}
    assert set(rows) == {"shared", "unique"}
    found = {kind: [float(x) for x in rows[kind][4].split(" / ")] for kind in rows}
    assert found["shared"][0] >= 96 and found["unique"][0] == 0  # prompt tokens found / looked up
    assert found["shared"][1] == found["unique"][1] or abs(found["shared"][1] - found["unique"][1]) < 8
    # --stall: plain streams' response gaps alone, then beside long prompts.
    result = run_bench("prefix_bench.py", "--url", server.grpc_url, "--stall", "--streams", "2", "--seconds", "2",
                       "--max-tokens", "8", "--system-words", "120")
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith(("| plain", "| +"))]
    assert len(rows) == 2 and all(int(row[1]) > 0 for row in rows)  # plain responses in both phases
    assert not rows[0][5].strip() and int(rows[1][5]) > 0  # long prompts beside them in the second
