"""The static executor (paged pool, bucketed shapes; eager on CPU) served by a real tritonserver: greedy
speculative output equals target-only output, seeded sampling repeats, the pool's blocks are reported and
returned when requests end, and a pool too small for the context fails the load naming the parameter."""

import re

import pytest

from client import Client, GenerationParams
from specdec.serving import pairs, server

pytestmark = pytest.mark.integration


def static_args(*more):
    pair = pairs.tiny_pair()
    args = ["--target", pair.target_path, "--draft", pair.draft_paths["draft_model"], "--tokenizer", pair.tokenizer_path]
    for model in ("target_model", "draft_model"):
        args += ["--set", f"{model}.executor=static", "--set", f"{model}.kv_pool_tokens=8192"]
    return args + list(more)


def test_static_executor_serves_exactly(tmp_path):
    # One torch thread for the draft (torch_threads as a count: what a small model on CPU may want).
    own = server.start(tmp_path / "run", tmp_path / "server.log", static_args("--set", "draft_model.torch_threads=1"))
    try:
        log = own.log_path.read_text()
        assert "target_model: static executor, eager (compile=off)" in log
        assert re.search(r"draft_model: warmed up in [\d.]+ s on cpu, torch threads: 1", log)
        client = Client(own.grpc_url)
        for prompt in ("Once upon a time", "The capital of France is"):
            alone, fast = (client.generate(prompt, GenerationParams(max_tokens=40, num_draft_tokens=k)) for k in (0, 4))
            assert fast.text == alone.text and fast.total_draft_tokens > 0
        sampled = GenerationParams(max_tokens=20, num_draft_tokens=3, temperature=0.8, seed=3)
        assert client.generate("Hi", sampled).text == client.generate("Hi", sampled).text
        # Every request has ended: the pools hold no blocks.
        assert own.metric("specdec_model_kv_cache_bytes", model="target_model") == 0
        assert own.metric("specdec_model_tokens_processed_total", model="target_model") > 0
    finally:
        own.stop()


def test_a_pool_smaller_than_the_context_fails_the_load_naming_it(tmp_path):
    args = static_args("--set", "target_model.kv_pool_tokens=64")
    with pytest.raises(server.ServerStartError):
        server.start(tmp_path / "run", tmp_path / "server.log", args, ready_timeout_s=300)
    log = (tmp_path / "server.log").read_text()
    assert "cannot hold one sequence of max_context=" in log and "raise kv_pool_tokens" in log
