"""The static executor (paged pool, bucketed shapes; eager on CPU) served by a real tritonserver: greedy
speculative output equals target-only output, seeded sampling repeats, the pool's blocks are reported and
returned when requests end, a pool too small for the context fails the load naming the parameter, and a
request the pool has no room for waits for it (or, with when_full=reject, is refused UNAVAILABLE)."""

import json
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from client import Client, GenerationParams, ServerBusyError
from specdec.engine.draft_heads import EAGLE3, random_head, save_head
from specdec.serving import pairs, server
from specdec.serving.metrics_text import sum_samples

from .helpers import retire_server

pytestmark = pytest.mark.integration


def static_args(*more):
    pair = pairs.tiny_pair()
    args = ["--target", pair.target_path, "--draft", pair.draft_paths["draft_model"], "--tokenizer", pair.tokenizer_path]
    for model in ("target_model", "draft_model"):
        args += ["--set", f"{model}.executor=static", "--set", f"{model}.kv_pool_tokens=8192"]
    return args + list(more)


# target_model's pool holds 128 tokens (4 blocks of 32) and so does its context: a request of ~110 tokens
# reserves 4 blocks at its start, and a second one finds no room until the first ends.
SMALL_POOL = ("--set", "target_model.kv_pool_tokens=128", "--set", "target_model.max_context_tokens=128",
              "--set", "speculative_decoding.max_context_tokens=128")
LONG = GenerationParams(max_tokens=110, num_draft_tokens=3, ignore_eos=True)
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def small_pool(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("static")
    # One torch thread for the draft (torch_threads as a count: what a small model on CPU may want).
    # Prompt lookup proposes trees of up to 3 continuations (lookup_branches), the draft model trees of its
    # 2 likeliest tokens per position (draft_branches), and so does a random EAGLE-3 head (EAGLE-2's dynamic
    # trees, 2 wide; no confidence stop: its flat distributions would stop every search at the first level).
    head_dir = save_head(_head_over_likely_tokens(), tmp_path / "head")
    own = server.start(tmp_path / "run", tmp_path / "server.log",
                       static_args(*SMALL_POOL, "--set", "draft_model.torch_threads=1",
                                   "--set", "speculative_decoding.lookup_branches=3",
                                   "--set", "speculative_decoding.draft_branches=2",
                                   "--draft-head", f"head_tree={head_dir}", "--default-draft", "draft_model",
                                   "--set", "head_tree.draft_stop_below=0"))
    yield own
    retire_server(own)  # nothing in flight, no stub left, exit code 0


DISTRIBUTION_PROMPT = "the cat sat on the mat and the cat sat on the"


def _head_over_likely_tokens():
    """A random EAGLE-3 head whose draft vocabulary is the tiny target's 4 likeliest first and second tokens
    after DISTRIBUTION_PROMPT: its candidates there carry the target's mass, so sampled requests see what
    the rule does with taken candidates (a random head over the whole vocabulary proposes tokens the
    target never samples)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    pair = pairs.tiny_pair()
    model = AutoModelForCausalLM.from_pretrained(pair.target_path, dtype=torch.float64).eval()
    ids = AutoTokenizer.from_pretrained(pair.tokenizer_path).encode(DISTRIBUTION_PROMPT, add_special_tokens=True)
    with torch.inference_mode():
        first = model(torch.tensor([ids])).logits[0, -1].topk(4).indices.tolist()
        second = model(torch.tensor([ids + [t] for t in first])).logits[:, -1].topk(4).indices.flatten().tolist()
    likely = torch.tensor(sorted(set(first + second)))
    head = random_head(EAGLE3, AutoConfig.from_pretrained(pair.target_path), seed=1, aux_layers=(0, 1, 1),
                       draft_vocab_size=len(likely))
    with torch.no_grad():
        head.d2t.copy_(likely - torch.arange(len(likely)))
        head.t2d.zero_()
        head.t2d[likely] = True
    return head


def test_static_executor_serves_exactly(small_pool):
    own = small_pool
    log = own.log_path.read_text()
    assert "target_model: static executor, eager (compile=off)" in log
    assert re.search(r"draft_model: warmed up in [\d.]+ s on cpu, torch threads: 1", log)
    client = Client(own.grpc_url)
    for prompt in ("Once upon a time", "The capital of France is"):
        # a fixed K: the adaptive rule pauses a draft that does not pay for its measured costs (the tiny pair's)
        alone, fast = (client.generate(prompt, GenerationParams(max_tokens=40, num_draft_tokens=k, adaptive_draft=False))
                       for k in (0, 4))
        assert fast.text == alone.text and fast.total_draft_tokens > 0
    sampled = GenerationParams(max_tokens=20, num_draft_tokens=3, temperature=0.8, seed=3)
    assert client.generate("Hi", sampled).text == client.generate("Hi", sampled).text
    # Every request has ended: the pools hold no blocks.
    assert own.metric("specdec_model_kv_cache_bytes", model="target_model") == 0
    assert own.metric("specdec_model_tokens_processed_total", model="target_model") > 0


def test_prompt_lookup_trees_are_verified_exactly(small_pool):
    """lookup_branches=3: a prompt whose suffix occurred three times before, each time followed differently,
    gets token trees; greedy text equals target-only text over gRPC and HTTP, rounds verified trees (the
    metric), and every sequence's blocks go back."""
    prompt = "red apple green pear red apple blue plum red apple gold fig red apple"
    trees = lambda: small_pool.metric("specdec_tree_rounds_total")  # noqa: E731
    before = trees()
    for url, protocol in ((small_pool.grpc_url, "grpc"), (small_pool.http_url, "http")):
        client = Client(url, protocol=protocol)
        alone = client.generate(prompt, GenerationParams(max_tokens=32, num_draft_tokens=0))
        lookup = client.generate(prompt, GenerationParams(max_tokens=32, num_draft_tokens=6, adaptive_draft=False,
                                                          draft_model="ngram"))
        assert lookup.text == alone.text and lookup.total_draft_tokens > 0
    seeded = GenerationParams(max_tokens=24, num_draft_tokens=6, draft_model="ngram", temperature=0.8, seed=5)
    client = Client(small_pool.grpc_url)
    assert client.generate(prompt, seeded).text == client.generate(prompt, seeded).text  # sampled trees: seeded
    assert trees() > before
    assert small_pool.metric("specdec_model_kv_cache_bytes", model="target_model") == 0


@pytest.mark.parametrize("draft", ["draft_model", "head_tree"])
def test_model_draft_trees_are_verified_exactly(small_pool, draft):
    """draft_branches=2: draft_model proposes its chain with its second choice beside each token, one tree
    of K nodes; the trained head EAGLE-2's tree over target_model's features from the static executor.
    Greedy text equals target-only over gRPC and HTTP, the rounds verified trees (a head's every round after
    a request's first), seeded sampled trees repeat, and every sequence's blocks go back."""
    trees = lambda: small_pool.metric("specdec_tree_rounds_total")  # noqa: E731
    before = trees()
    for url, protocol in ((small_pool.grpc_url, "grpc"), (small_pool.http_url, "http")):
        client = Client(url, protocol=protocol)
        for prompt in ("The capital of France is", "Numbers: 1 2 3 4 5"):
            alone = client.generate(prompt, GenerationParams(max_tokens=24, num_draft_tokens=0))
            drafted = client.generate(prompt, GenerationParams(max_tokens=24, num_draft_tokens=4, adaptive_draft=False,
                                                               draft_model=draft))
            assert drafted.text == alone.text and drafted.total_draft_tokens > 0
            if draft == "head_tree":  # 4 nodes a round but its first (no features yet) and the last few (room)
                assert drafted.total_draft_tokens >= 4 * (drafted.num_rounds - 4)
    assert trees() >= before + 4 * 3
    seeded = GenerationParams(max_tokens=16, num_draft_tokens=4, draft_model=draft, temperature=0.8, seed=5)
    client = Client(small_pool.grpc_url)
    assert client.generate(PROMPT, seeded).text == client.generate(PROMPT, seeded).text
    assert small_pool.metric("specdec_model_kv_cache_bytes", model="target_model") == 0


def test_sampled_trees_follow_the_targets_distribution(small_pool):
    """Served sampled trees against the target's exact distribution of the first three tokens' text
    (chi-square at 1e-3, four tokens generated): the draft model's, its first round a tree of 3 nodes, the
    siblings drawn without replacement after the drafted tokens (the SAMPLED rule, its probability rows
    carried over BLS). The served path end to end; the rules' power against planted bugs is shown in
    process (tests/unit/test_tree_sampler.py, test_draft_trees.py, test_head_trees.py): here the tiny
    pair's draft is close to its target, so rejections, where such bugs act, are rare. A head's sampled
    trees (deterministic nodes, no probability rows) are served in test_model_draft_trees_are_verified_exactly."""
    draft = "draft_model"
    from collections import Counter

    from transformers import AutoTokenizer

    from specdec.decoding.sampling import SamplingParams
    from specdec.decoding.text import decode

    from .helpers import http_generate
    from .test_draft_heads import exact_three_token_texts
    from .test_sampling_distribution import chi_square

    requests = 300
    tokenizer = AutoTokenizer.from_pretrained(pairs.tiny_pair().tokenizer_path)
    expected = exact_three_token_texts(DISTRIBUTION_PROMPT, SamplingParams(temperature=1.0, top_k=4))
    assert len([p for p in expected.values() if p * requests >= 5]) >= 3  # enough cells to test anything
    before = small_pool.metric("specdec_tree_rounds_total")

    def one(seed):
        out = http_generate(small_pool.http_url, DISTRIBUTION_PROMPT, max_tokens=4, seed=seed, temperature=1.0,
                            top_k=4, num_draft_tokens=4, draft_model=draft, adaptive_draft=False)
        return decode(tokenizer, out["output_ids"][:3]), out["total_accepted_draft_tokens"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(requests)))
    assert small_pool.metric("specdec_tree_rounds_total") - before >= requests // 2  # trees were verified
    assert sum(accepted for _, accepted in results) >= requests // 4  # their candidates were taken
    statistic, critical = chi_square(Counter(text for text, _ in results), expected, requests)
    assert statistic < critical, (draft, statistic, critical)


def test_repeated_prompts_are_served_from_the_pools_blocks(small_pool):
    """Prefix caching in the pool: a prompt sent again reuses its full blocks (released, they stayed cached
    in the pool), greedy and speculative, with the text computed from scratch; cached blocks are not held."""
    own = small_pool
    prompt = ("Opening hours are eight to six on weekdays and nine to one on Saturdays; the store is closed on "
              "Sundays and public holidays. Deliveries within twenty kilometres are free for orders above fifty "
              "francs. Returns are accepted within thirty days with the receipt, except for cut materials such as "
              "chains, ropes, cables and timber. The workshop sharpens knives and tools while customers wait.")
    client = Client(own.grpc_url)
    hits = {m: own.metric("specdec_model_prefix_cache_hits_total", model=m) for m in ("target_model", "draft_model")}
    # K fixed: adapting, the policy may pause the draft for a whole request (its costs measured on this
    # server so far), and a draft never called finds nothing in its pool
    cold = client.generate(prompt, GenerationParams(max_tokens=16, num_draft_tokens=3, adaptive_draft=False))
    assert own.metric("specdec_model_prefix_cache_hits_total", model="target_model") == hits["target_model"]
    for k in (0, 3):
        assert client.generate(prompt, GenerationParams(max_tokens=16, num_draft_tokens=k,
                                                        adaptive_draft=False)).text == cold.text
    found = {m: own.metric("specdec_model_prefix_cache_hits_total", model=m) - hits[m] for m in hits}
    reusable = (cold.num_input_tokens - 1) // 32 * 32
    assert reusable >= 64 and found["target_model"] == 2 * reusable and found["draft_model"] == reusable
    assert own.metric("specdec_model_kv_cache_bytes", model="target_model") == 0
    assert own.metric("specdec_model_prefix_cache_bytes", model="target_model") > 0  # kept, not held


def overlapping(client: Client, second):
    """Run a LONG request, and `second()` once the first has streamed its first text (it holds the pool)."""
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.generate, PROMPT, LONG, True, lambda _text: started.set())
        assert started.wait(120)
        try:
            other = second()
        except Exception as exc:  # noqa: BLE001 - the caller checks what it got
            other = exc
        return first.result(), other


def test_a_request_waits_for_kv_room_and_keeps_its_output(small_pool):
    own = small_pool
    client = Client(own.grpc_url)
    solo = client.generate(PROMPT, LONG)
    waits_before = own.metric("specdec_queue_time_seconds_count"), own.metric("specdec_queue_time_seconds_sum")
    queued = []

    def two_more():  # the pool holds one: they wait, then run one after the other
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(client.generate, PROMPT, LONG) for _ in range(2)]
            while not all(w.done() for w in waiting):
                text = own.metrics()
                queued.append((sum_samples(text, "specdec_queued_requests"),
                               sum_samples(text, "specdec_live_sequences")))
                time.sleep(0.02)
            return [w.result() for w in waiting]

    first, others = overlapping(client, two_more)
    assert not isinstance(others, Exception), others
    assert first.text == others[0].text == others[1].text == solo.text and solo.num_output_tokens == 110
    # They waited for room, counted among the queued requests meanwhile (not the live ones), and were not
    # refused. A request is live while its first call is in flight (it may get room), so while one waits
    # the other may still be live; once both wait, only the running request is (1, or 0 between its end
    # and a waiter's next try).
    assert max(waiters for waiters, _ in queued) == 2, queued
    waiting = [live for waiters, live in queued if waiters]
    assert 1 in waiting and all(live <= 1 for waiters, live in queued if waiters == 2), queued
    assert own.metric("specdec_queued_requests") == 0
    assert own.metric("specdec_requests_total", finish_reason="rejected") == 0
    # Every request's wait is observed: the first's ~0; the second waiter waited a whole generation of the
    # first waiter's at least (half a solo one: this machine's noise).
    count = own.metric("specdec_queue_time_seconds_count") - waits_before[0]
    waited = own.metric("specdec_queue_time_seconds_sum") - waits_before[1]
    assert count == 3 and waited >= 0.5 * solo.latency_s, (count, waited, solo.latency_s)
    assert own.metric("specdec_model_kv_cache_bytes", model="target_model") == 0


def test_with_when_full_reject_a_request_without_kv_room_is_refused_unavailable(tmp_path):
    own = server.start(tmp_path / "run", tmp_path / "server.log",
                       static_args(*SMALL_POOL, "--set", "speculative_decoding.when_full=reject"))
    try:
        client = Client(own.grpc_url)

        def over_http():  # the generate endpoint, as any HTTP caller sees it
            body = json.dumps(LONG.json(PROMPT, False)).encode()
            request = urllib.request.Request(f"{own.http_url}/v2/models/ensemble/generate", data=body,
                                             headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as raised:
                urllib.request.urlopen(request, timeout=60)
            return raised.value.code, raised.value.read().decode()

        first, (status, body) = overlapping(client, over_http)
        assert first.num_output_tokens == 110
        # Through the ensemble the generate endpoint answers this refusal 400 (not 503); the message says it.
        assert status == 400 and "KV cache budget full" in body and "kv_pool_tokens=128" in body, (status, body)
        assert body.rstrip('"}').endswith("retry later")
        first, refused = overlapping(client, lambda: client.generate(PROMPT, LONG))  # over gRPC, typed
        assert isinstance(refused, ServerBusyError) and "retry later" in str(refused), refused
        assert own.metric("specdec_requests_total", finish_reason="rejected") == 2
        assert client.generate(PROMPT, LONG).text == first.text  # room again once the first has ended
        assert own.metric("specdec_model_kv_cache_bytes", model="target_model") == 0
    finally:
        retire_server(own)
