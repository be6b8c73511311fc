"""The GPU benchmark (`make bench-gpu`): the served pair against the hardware, plain PyTorch and transformers.

It builds the synthetic Llama-3-8B-shaped bf16 pair of the GPU notes (random weights, seed 0; every layer's
residual branches scaled by `--residual-scale` so that the draft, the target's first 4 layers plus its
final norm and head, agrees with it about as often as a real early-exit draft), or takes real weights with
--target/--draft, and prints one table:

  bound          weight bytes / measured memory bandwidth: the fastest a token can be (weight streaming)
  reference      plain PyTorch, static KV cache + torch.compile(mode="reduce-overhead"): 1 and K+1 tokens
  executor       the project's Executor.extend in process: 1 and K+1 tokens; the draft's step (c)
  served         the `ensemble` through the launcher, greedy, streamed (--no-stream: one response per request
                 in the 1-stream rows): K=0, K fixed, adaptive K<=K; 1 stream (with --extra-k, more K beside
                 the same K=0; and the first token alone, for the bench's prompts and for prompts of
                 --long-prompts tokens), and 8 concurrent ones (--streams: other counts),
                 with how the streams shared each model's forwards (sequences per forward, the share of
                 the time in forwards and in the adapter's whole execute)
  transformers   `generate` in process: plain and assisted (the same draft, K constant)
  traces         with --traces DIR, after the served rows: a client's profile (POST /start_profile and
                 /stop_profile, live_profile.py) over one stream at K=0 and at K, each model instance's trace
                 in DIR and its summary (executions; CPU operators and, on a GPU, kernels) after the table

with α, tokens per round, the median TTFT and ITL of the streamed requests (ITL as genai-perf defines
it: (latency - TTFT) / (output tokens - 1)), the bound E/(K·c+v) at the measured α, efficiency = speedup /
bound, and the fraction of requests whose speculative text equals the target-only text (bf16 rounds a
(K+1)-row verify and a 1-row step differently, so this is measured, not assumed), for the project and for
transformers.

    python -m bench.gpu_bench                     # on a GPU machine: the 8B-shaped pair, bf16
    python -m bench.gpu_bench --small --compile off --prompts 2 --max-tokens 16   # CPU: checks the script
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import report
from bench.report import print_table
from client import AsyncClient, Client, GenerationParams
from specdec.decoding.draft_length import expected_tokens
from specdec.serving import pairs, server

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    draft_layers: int


SHAPES = {"8b": Shape(4096, 32, 32, 8, 14336, 4), "small": Shape(64, 4, 4, 2, 128, 1)}


def log(message: str) -> None:
    print(f"[bench-gpu] {message}", file=sys.stderr, flush=True)


# ---- the pair ------------------------------------------------------------------------------------------
def build_pair(root: Path, shape: Shape, dtype: torch.dtype, device: str, residual_scale: float) -> tuple[Path, Path]:
    """Target (random, seeded) and its layer-skip draft, saved as Hugging Face directories (once)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    target, draft = root / "target", root / "draft"
    if (target / ".complete").exists() and (draft / ".complete").exists():
        return target, draft
    tokenizer = AutoTokenizer.from_pretrained(pairs.smollm2_tokenizer_dir())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=shape.hidden, intermediate_size=shape.mlp,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    log(f"building the {shape} pair in {root} (seed 0)")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream stays close to the embedding: early exits agree
            layer.self_attn.o_proj.weight.mul_(residual_scale)
            layer.mlp.down_proj.weight.mul_(residual_scale)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / ".complete").write_text("ok\n")
    model.model.layers = model.model.layers[:shape.draft_layers]
    model.config.num_hidden_layers = shape.draft_layers
    model.save_pretrained(draft)
    tokenizer.save_pretrained(draft)
    (draft / ".complete").write_text("ok\n")
    del model
    return target, draft


RESIDUAL_SCALE = 1.5e-4


def synthetic_pair(small: bool, dtype_name: str, device: str, residual_scale: float = RESIDUAL_SCALE) -> tuple[Path, Path]:
    """The 8B-shaped pair (or with `small` the tiny one), built once under the cache directory."""
    root = pairs.cache_dir() / "pairs" / f"bench-{'small' if small else '8b'}-{dtype_name}-{residual_scale}"
    return build_pair(root, SHAPES["small" if small else "8b"], getattr(torch, dtype_name), device, residual_scale)


def synthetic_heads(target: Path) -> dict[str, Path]:
    """Heads for the synthetic pair, built in seconds instead of trained (a head trained on this pair learns
    nothing that serves: its text is its random head's token map, 2026-12-04), saved in the published format
    beside the pair, once:

      eagle1  an EAGLE-1 head whose drafts are the target's exit after its embedding: fc passes the next
              token's embedding (divided by the embeddings' mean RMS, as the final norm (weights 1) divides
              each by its own) and drops the feature, the layer's output projections are zero, so logits ~=
              lm_head(norm(embed(token))): the pair's 0-layer early exit,
              agreeing with the target as that exit does (its α is the pair's, like the draft model's); its
              step computes everything a trained one's does (zeros cost what any weights cost)
      eagle3  an EAGLE-3 head with random weights and a 32000-token draft vocabulary (the published
              Llama-3.1-8B head's): its costs only (it agrees with nothing)
    """
    from transformers import AutoConfig

    from specdec.engine.draft_heads import EAGLE, EAGLE3, random_head, read_target_tensors, save_head

    where = target.parent / "heads"
    heads = {"eagle1": where / "eagle1-embedding-exit", "eagle3": where / "eagle3-random"}
    if all((path / "config.json").exists() for path in heads.values()):
        return heads
    config = AutoConfig.from_pretrained(target)
    _, embed, _ = read_target_tensors(target)  # the embedding alone, in float32
    rms = embed.pow(2).mean(dim=-1).sqrt().mean().item()
    head = random_head(EAGLE, config)
    h = config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :h] = torch.eye(h) / rms
        if head.fc.bias is not None:
            head.fc.bias.zero_()
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
    save_head(head.to(config.dtype), heads["eagle1"])  # in the pair's dtype
    vocab = min(32000, config.vocab_size)
    save_head(random_head(EAGLE3, config, draft_vocab_size=vocab).to(config.dtype), heads["eagle3"])
    log(f"built the pair's heads: {', '.join(str(path) for path in heads.values())}")
    return heads


def load(path: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int) -> float:
    """Median seconds of fn() over reps calls, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# ---- in process ----------------------------------------------------------------------------------------
def bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    n = (1 << 28) if device.startswith("cuda") else (1 << 24)
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    return 2 * n / timed(lambda: dst.copy_(src), device, 10)


def reference_steps(model, device: str, context: int, widths: list[int], compile_mode: str, reps: int) -> dict:
    """Plain PyTorch: a static KV cache and (unless off) a compiled forward; seconds per step of each width."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=context + max(widths) + 8)
    forward = model.forward if compile_mode == "off" else torch.compile(model.forward, mode=compile_mode)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), device=device)
    with torch.inference_mode():
        model(prompt, past_key_values=cache)
        out = {}
        for width in widths:
            ids = torch.randint(0, model.config.vocab_size, (1, width), device=device)
            positions = torch.arange(context, context + width, device=device)[None]

            def step():
                # Always the same positions (the cache's fill level is set back): shapes never change.
                for layer in cache.layers:
                    layer.cumulative_length.fill_(context)
                forward(ids, past_key_values=cache, position_ids=positions)

            out[width] = timed(step, device, reps)
    return out


def executor_steps(model, context: int, widths: list[int], reps: int) -> dict:
    """The project's executor as target_model runs it (the static one with CUDA graphs on a GPU):
    seconds per extend of each width after `context`."""
    from specdec.engine.build import dynamic_executor, static_executor

    if model.device.type == "cuda":
        lm = static_executor(model, max_sequences=2, max_context=context + 64, max_batch=1, max_rows=max(widths))
        lm.warm_up()
    else:
        lm = dynamic_executor(model)
    prompt = torch.randint(0, model.config.vocab_size, (context,)).tolist()
    lm.extend(1, 0, prompt, 1)
    return {width: timed(lambda: lm.extend(1, context, prompt[:width], width), str(lm.device), reps)
            for width in widths}


def transformers_peer(target, draft, tokenizer, prompts: list[str], max_tokens: int, k: int, device: str) -> dict:
    """tokens/s of plain and assisted greedy `generate`, and the fraction of prompts where they agree."""
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    # Always K tokens, like the served "K fixed" row (its default stops drafting below a confidence of
    # 0.4, and tuning that threshold imports scikit-learn).
    draft.generation_config.assistant_confidence_threshold = 0.0
    totals = {"plain": [0, 0.0], "assisted": [0, 0.0]}
    equal = 0
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
        texts = {}
        for name, extra in (("plain", {}), ("assisted", {"assistant_model": draft})):
            sync(device)
            started = time.perf_counter()
            with torch.inference_mode():
                gen = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False, **extra)
            sync(device)
            totals[name][1] += time.perf_counter() - started
            totals[name][0] += gen.shape[1] - ids.shape[1]
            texts[name] = gen[0, ids.shape[1]:].tolist()
        equal += texts["plain"] == texts["assisted"]
    return {"plain": totals["plain"][0] / totals["plain"][1],
            "assisted": totals["assisted"][0] / totals["assisted"][1], "equal": equal / len(prompts)}


# ---- served --------------------------------------------------------------------------------------------
SETTINGS = ("K=0", "K", "adaptive")  # --settings: the served rows' kinds


def parse_draft_rows(specs: list[str]) -> list[tuple[str, int]]:
    """--drafts' NAME[:BRANCHES] specs as (draft model, candidates per drafted position; 1: chains)."""
    out = []
    for spec in specs:
        name, _, branches = spec.partition(":")
        if not name or (branches and not branches.isdigit()) or int(branches or 1) < 1:
            raise SystemExit(f"--drafts {spec!r}: expected NAME or NAME:BRANCHES (a served draft, branches >= 1)")
        out.append((name, int(branches or 1)))
    return out


def one_stream_settings(k: int, extra_k: list[int], kinds=SETTINGS, drafts: list[tuple[str, int]] = ()) -> dict:
    """The batch-1 rows by name, each its GenerationParams' fields: K=0, K fixed and adaptive K<=k (those of
    `kinds`), then each extra K fixed and adaptive up to the largest (the K that pays best, measured beside
    the same K=0 rather than across servers), then each of `drafts` (a draft model the request names, with
    its tree's branches) at K fixed and adaptive K<=k: drafts compared beside one K=0, on one server."""
    rows = [("K=0", 0, False, "K=0"), (f"K={k}", k, False, "K"), (f"adaptive K<={k}", k, True, "adaptive")]
    rows += [(f"K={extra}", extra, False, "K") for extra in extra_k]
    if extra_k and max(extra_k) > k:
        rows.append((f"adaptive K<={max(extra_k)}", max(extra_k), True, "adaptive"))
    out = {name: dict(num_draft_tokens=drafted, adaptive_draft=adaptive)
           for name, drafted, adaptive, kind in rows if kind in kinds}
    for draft, branches in drafts:
        label = draft + (f", trees of {branches} branches" if branches > 1 else "")
        for name, adaptive, kind in ((f"{label}, K={k}", False, "K"), (f"{label}, adaptive K<={k}", True, "adaptive")):
            if kind in kinds:
                out[name] = dict(num_draft_tokens=k, adaptive_draft=adaptive, draft_model=draft,
                                 num_draft_branches=branches)
    return out


def served_one_stream(url: str, prompts: list[str], max_tokens: int, k: int, extra_k: list[int] = (),
                      kinds=SETTINGS, stream: bool = True, drafts: list[tuple[str, int]] = (),
                      warm_passes: int = 0, warm_prompts: list[str] = ()) -> dict:
    """Batch 1: every prompt target-only, K fixed and adaptive K<=k (and extra_k's and drafts' rows), side by
    side; streamed (a response per round, as chat clients ask: TTFT and ITL per request) or not. Each draft
    row first runs `warm_prompts` (others than the timed ones; else those) `warm_passes` times untimed: a
    draft that learns from its traffic (a skip draft searching its layers) is timed with what it learned,
    as a server's later requests would be."""
    client = Client(url, "grpc", timeout_s=900)
    settings = {name: GenerationParams(max_tokens=max_tokens, **fields)
                for name, fields in one_stream_settings(k, list(extra_k), kinds, list(drafts)).items()}
    for params in settings.values():  # warm every path
        client.generate(prompts[0], GenerationParams(max_tokens=8, num_draft_tokens=params.num_draft_tokens,
                                                     draft_model=params.draft_model,
                                                     num_draft_branches=params.num_draft_branches))
    for _ in range(warm_passes):
        for params in settings.values():
            if params.draft_model:
                for prompt in warm_prompts or prompts:
                    client.generate(prompt, params)
    out = {name: dict(tokens=0, s=0.0, drafted=0, accepted=0, rounds=0, equal=0, k=params.num_draft_tokens,
                      draft=params.draft_model,
                      ttft=[], itl=[]) for name, params in settings.items()}
    for prompt in prompts:
        texts = {}
        for name, params in settings.items():
            result = client.generate(prompt, params, stream=stream)
            row = out[name]
            row["tokens"] += result.num_output_tokens
            row["s"] += result.latency_s
            if stream:
                row["ttft"].append(result.ttft_s)
                if result.num_output_tokens > 1:  # one token has no inter-token latency
                    row["itl"].append(result.itl_s)
            row["drafted"] += result.total_draft_tokens
            row["accepted"] += result.total_accepted_draft_tokens
            row["rounds"] += result.num_rounds
            texts[name] = result.text
            row["equal"] += result.text == texts.get("K=0", result.text)
    for row in out.values():
        row["equal"] /= len(prompts)
    return out


def long_prompts(tokenizer, prompts: list[str], tokens: int, count: int) -> list[str]:
    """`count` prompts of about `tokens` tokens: the bench's prompts strung together, each opening with a tag
    of its own, so that no two start alike (prefix caching would serve a later one from the first's keys and
    values, and its first token would time no prompt at all)."""
    filler = " ".join(prompts)
    filler = " ".join([filler] * (tokens // max(len(tokenizer(filler)["input_ids"]), 1) + 1))
    out = []
    for index in range(count):
        ids = tokenizer(f"[{tokens}-token prompt {index}] {filler}")["input_ids"][:tokens]
        out.append(tokenizer.decode(ids, skip_special_tokens=True))
    return out


def served_first_token(url: str, prompts: list[str]) -> float:
    """Mean seconds to the first token alone (max_tokens=1: the prompt's forward and one round's serving;
    a round that can produce one token drafts nothing): what prompt buckets change (prefill_graph_rows)."""
    client = Client(url, "grpc", timeout_s=900)
    return statistics.mean(client.generate(prompt, GenerationParams(max_tokens=1, num_draft_tokens=0)).latency_s
                            for prompt in prompts)


async def served_streams(url: str, prompts: list[str], max_tokens: int, params: GenerationParams,
                         streams: int) -> dict:
    """`streams` concurrent streams, each sending its share of 2 * streams requests: output tokens/s, and
    the requests' tokens, drafted and accepted tokens and rounds summed."""
    from dataclasses import replace

    params = replace(params, max_tokens=max_tokens)
    jobs = [prompts[i % len(prompts)] for i in range(2 * streams)]
    results = []
    async with AsyncClient(url, "grpc", timeout_s=900) as client:
        async def worker():
            while jobs:
                results.append(await client.generate(jobs.pop(), params, stream=True))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        elapsed = time.perf_counter() - started
    tokens = sum(r.num_output_tokens for r in results)
    return {"tps": tokens / elapsed, "tokens": tokens, "drafted": sum(r.total_draft_tokens for r in results),
            "accepted": sum(r.total_accepted_draft_tokens for r in results),
            "rounds": sum(r.num_rounds for r in results),
            "ttft": [r.ttft_s for r in results], "itl": [r.itl_s for r in results if r.num_output_tokens > 1]}


def median_ms(values: list[float]) -> str:
    """A latency column's cell: the median in ms, blank where nothing was streamed."""
    return f"{statistics.median(values) * 1e3:.1f}" if values else ""


def model_batches(own, model: str) -> tuple[float, float, float, float]:
    """A model's (requests, executions, seconds in forwards, seconds in execute) so far: requests /
    executions is the sequences a forward served; forward seconds / wall time how busy the model kept its
    device, and the executions' own time (Triton's batch statistics: each execution's compute_infer once,
    not once per request) says where the rest went: inside execute, the adapter (parsing, responses);
    outside it, Triton and waiting for the streams' next calls."""
    import tritonclient.grpc as grpcclient  # gRPC: the GPU kit's tritonclient has no HTTP dependencies

    with grpcclient.InferenceServerClient(own.grpc_url) as client:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"]
    executing = sum(int(batch["compute_infer"]["ns"]) for entry in stats for batch in entry.get("batch_stats", []))
    return (own.metric("nv_inference_request_success", model=model),
            own.metric("nv_inference_exec_count", model=model),
            own.metric("specdec_model_forward_seconds_total", model=model),
            executing / 1e9)


def batching_note(before: dict, after: dict, wall: float) -> str:
    """How the streams shared each model's forwards (model_batches before and after, per model)."""
    notes = []
    for model in ("target_model", "draft_model"):
        (r0, e0, f0, x0), (r1, e1, f1, x1) = before[model], after[model]
        if e1 > e0:
            notes.append(f"{model.split('_')[0]}: {(r1 - r0) / (e1 - e0):.1f} sequences per forward, "
                         f"in forwards {(f1 - f0) / wall:.0%} of the time, in execute {(x1 - x0) / wall:.0%}")
    return "; ".join(notes)


def sharing_note(before: dict, after: dict, wall: float, costs: dict) -> str:
    """Given what one forward of each model costs alone in process (seconds), how much of the wall time
    the executions' forwards would have filled alone, and how much longer each model was in forwards
    served. Draft and target are two stubs, two CUDA contexts, which one GPU time-slices: where both are
    busy, each forward also waits out the other's kernels (an estimate from counters, not a trace). The
    costs are one sequence's: on a GPU a decode forward's cost hardly depends on its sequences (1 and 8
    within 4 % on an H200); on CPU it grows with them, and the figures there overstate the stretch."""
    alone, stretch = 0.0, []
    for model, cost in costs.items():
        (_, e0, f0, _), (_, e1, f1, _) = before[model], after[model]
        if e1 > e0 and cost:
            work = (e1 - e0) * cost
            alone += work
            stretch.append(f"{model.split('_')[0]} {(f1 - f0) / work:.1f}x")
    if not stretch:
        return ""
    return f"alone the forwards would fill {alone / wall:.0%} of the time, served they took {', '.join(stretch)} as long"


def served_traces(own, prompts: list[str], max_tokens: int, k: int) -> list[str]:
    """A client's profile over one stream's requests at K=0 and at K=k, without Python's frames (a GPU's
    kernels are what it is for): the trace files the stop names."""
    import urllib.request

    root = own.openai_url.removesuffix("/v1")

    def post(path: str, body: dict | None = None) -> str:
        request = urllib.request.Request(root + path, data=json.dumps(body or {}).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as answer:
            return answer.read().decode()

    post("/start_profile", {"with_stack": False})
    for params in (GenerationParams(num_draft_tokens=0), GenerationParams(num_draft_tokens=k, adaptive_draft=False)):
        asyncio.run(served_streams(own.grpc_url, prompts, max_tokens, params, 1))
    return [line for line in post("/stop_profile").splitlines()[1:] if line.endswith(".trace.json.gz")]


# ---- the run -------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny shapes in float32 on CPU (checks the script)")
    parser.add_argument("--target", help="a real target (HF directory) instead of the synthetic one")
    parser.add_argument("--draft", help="its draft model (HF directory)")
    parser.add_argument("--residual-scale", type=float, default=RESIDUAL_SCALE)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on the GPU, float32 on CPU")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--extra-k", type=int, nargs="+", default=[],
                        help="more batch-1 rows in the same server: each K fixed, and adaptive up to the largest")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--long-prompts", type=int, nargs="*", default=[200, 480],
                        help="first-token rows for prompts of about these many tokens (beyond the bench's short "
                             "ones: a deployment's verify buckets take prompts of up to K_max + 1 tokens, "
                             "prefill_graph_rows longer ones)")
    parser.add_argument("--context", type=int, default=256, help="context of the in-process step timings")
    parser.add_argument("--compile", default="reduce-overhead", help='torch.compile mode of the reference, or "off"')
    parser.add_argument("--out", help="also write the table (Markdown) here")
    parser.add_argument("--results", metavar="NAME", help="also write it as docs/results/<date>-NAME.md")
    parser.add_argument("--served-only", action="store_true",
                        help="only the served rows (no in-process timings, no transformers): for sweeping settings")
    parser.add_argument("--streams", type=int, nargs="*", default=[8],
                        help="concurrent streams of the many-stream rows (e.g. 8 16 32: where speculation stops "
                             "paying, and max_drafting_sequences)")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                        help="the served rows' kinds (e.g. K=0 alone, for a profile of target-only serving)")
    parser.add_argument("--no-one-stream", action="store_true",
                        help="only the many-stream rows (their x column then blank)")
    parser.add_argument("--no-stream", action="store_true",
                        help="the 1-stream rows unstreamed, one response per request (no TTFT or ITL): how "
                             "the first GPU figures in docs/results/ were measured")
    parser.add_argument("--drafts", nargs="+", default=[], metavar="NAME[:BRANCHES]",
                        help="more 1-stream rows, K fixed and adaptive, with this served draft (e.g. a head given "
                             "by --launcher-arg=--draft-head=NAME=DIR, a skip draft; BRANCHES > 1: its trees)")
    parser.add_argument("--warm-passes", type=int, default=0,
                        help="untimed passes over the prompts before each --drafts row (a searching skip draft)")
    parser.add_argument("--traces", metavar="DIR",
                        help="after the served rows, profile one stream at K=0 and K on the server: the models' "
                             "traces into DIR, their summaries after the table")
    parser.add_argument("--launcher-arg", action="append", default=[],
                        help="more launcher arguments, e.g. --launcher-arg=--set "
                             "--launcher-arg=speculative_decoding.verify_gather_ms=10")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.small
    device, kind = ("cuda", "gpu") if gpu else ("cpu", "cpu")
    dtype_name = args.dtype or ("bfloat16" if gpu else "float32")
    dtype = getattr(torch, dtype_name)
    every_prompt = [json.loads(line)["prompt"] for line in (HERE / "prompts_open.jsonl").read_text().splitlines()
                    if line.strip()]
    prompts, warm_prompts = every_prompt[:args.prompts], every_prompt[args.prompts:]
    if args.target:
        target_path, draft_path = Path(args.target), Path(args.draft or args.target)
    else:
        target_path, draft_path = synthetic_pair(args.small, dtype_name, device, args.residual_scale)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_path)  # the long prompts' and transformers' rows
    widths = [1, args.k + 1]
    all_k = sorted({args.k, *args.extra_k})
    reps = 20 if gpu else 5
    if gpu:
        torch.cuda.empty_cache()  # building the pair left its memory in this process's cache

    cache = pairs.cache_dir()
    # The synthetic pair's draft agrees with its target by construction (α ~0.77) but, its weights random, is
    # confident of nothing: the confidence stop, which reads the draft's own probability, would end nearly
    # every proposal after one token (measured on an H100: 0.99 tokens drafted per K=4 round). Its rows are
    # about costs at a given α: the draft drafts what K asks. A pair given with --target keeps the default.
    stop = [] if args.target else ["--set", "draft_model.draft_stop_below=0"]
    launcher_args = ["--target", str(target_path), "--draft", str(draft_path), "--device", kind, "--dtype", dtype_name,
                     "--max-num-draft-tokens", str(max(*all_k, 1)), *stop, *args.launcher_arg]
    if args.traces:
        launcher_args += ["--torch-profiler-dir", str(Path(args.traces).resolve())]
    log("starting the server")
    own = server.start(cache / "run" / "bench-gpu", cache / "bench-gpu-server.log", launcher_args)
    try:
        one = {} if args.no_one_stream else served_one_stream(own.grpc_url, prompts, args.max_tokens, args.k,
                                                              args.extra_k, args.settings, not args.no_stream,
                                                              parse_draft_rows(args.drafts), args.warm_passes,
                                                              warm_prompts)
        first_token = None if args.no_one_stream else served_first_token(own.grpc_url, prompts)
        long_first = {}  # prompt length asked -> (the prompts' token counts, mean seconds to the first token)
        if not args.no_one_stream and args.long_prompts:
            for tokens in args.long_prompts:
                texts = long_prompts(tokenizer, prompts, tokens, len(prompts))
                lengths = [len(tokenizer(text)["input_ids"]) for text in texts]
                long_first[tokens] = (lengths, served_first_token(own.grpc_url, texts))
        many = {}
        for streams in args.streams:
            # Fixed K beside adaptive: whether speculation pays under load, apart from what the policy picks.
            for name, params, kind in (("K=0", GenerationParams(num_draft_tokens=0), "K=0"),
                                       (f"K={args.k}", GenerationParams(num_draft_tokens=args.k, adaptive_draft=False), "K"),
                                       (f"adaptive K<={args.k}", GenerationParams(num_draft_tokens=args.k), "adaptive")):
                if kind not in args.settings:
                    continue
                before = {model: model_batches(own, model) for model in ("target_model", "draft_model")}
                started = time.perf_counter()
                result = asyncio.run(served_streams(own.grpc_url, prompts, args.max_tokens, params, streams))
                wall = time.perf_counter() - started
                time.sleep(0.6)  # the models add to their forward-seconds counters at most twice a second
                after = {model: model_batches(own, model) for model in ("target_model", "draft_model")}
                # How well the streams share forwards: a model's requests per execution (Triton's counters),
                # and the share of the wall time it spent in forwards.
                many[streams, name] = (result, before, after, wall)
        traces = served_traces(own, prompts, args.max_tokens, args.k) if args.traces else []
    finally:
        own.stop(120)

    rows = []
    c = v = None  # the draft's step and the verify's cost in target steps (in process)
    if not args.served_only:
        # In process after the server has stopped: this process would otherwise hold GPU memory (the compiled
        # reference keeps its weights and graphs alive) that the server's KV pools size themselves from.
        target, draft = load(target_path, dtype, device), load(draft_path, dtype, device)
        weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
        bytes_per_s = bandwidth(device)
        log("timing the compiled reference")
        reference = reference_steps(target, device, args.context, widths, args.compile, reps)
        log("timing the executor")
        executor = executor_steps(target, args.context, sorted({1, *(k + 1 for k in all_k)}), reps)
        draft_step = executor_steps(draft, args.context, [1], reps)[1]
        log("transformers generate")
        peer = transformers_peer(target, draft, tokenizer, prompts, args.max_tokens, args.k, device)
        del target, draft
        if gpu:
            torch.cuda.empty_cache()

        step, c = executor[1], draft_step / executor[1]
        v = executor[args.k + 1] / step
        rows += [["weight-streaming bound", f"{weight_bytes / bytes_per_s * 1e3:.2f} ms/token",
                  f"{bytes_per_s / weight_bytes:.1f}", "", "", "", "", "", "", "",
                  f"{weight_bytes / 1e9:.2f} GB at {bytes_per_s / 1e9:.0f} GB/s"],
                 ["plain PyTorch, static cache, compile=" + args.compile,
                  f"{reference[1] * 1e3:.2f} / {reference[args.k + 1] * 1e3:.2f} ms", f"{1 / reference[1]:.1f}",
                  "", "", "", "", "", "", "", f"1 / {args.k + 1} tokens per step"],
                 ["project executor (what target_model runs)",
                  f"{executor[1] * 1e3:.2f} / {executor[args.k + 1] * 1e3:.2f} ms",
                  f"{1 / executor[1]:.1f}", "", "", "", "", "", "", "", f"c = {c:.3f}, v({args.k}) = {v:.2f}"]]
    base = one["K=0"]["tokens"] / one["K=0"]["s"] if "K=0" in one else None

    def versus(tps: float) -> str:
        return f"{tps / base:.2f}x" if base else ""
    for name, row in one.items():
        tps = row["tokens"] / row["s"]
        alpha = row["accepted"] / row["drafted"] if row["drafted"] else 0.0
        per_round = row["tokens"] / row["rounds"] if row["rounds"] else 0.0
        k = row["k"] if row["drafted"] else 0
        # The bound takes the layer-skip draft's c measured in process: not another draft's rows
        bound = (expected_tokens(alpha, k) / (k * c + (executor[k + 1] / step if k else 1.0))
                 if c is not None and not row["draft"] else None)
        rows.append([f"served, 1 stream, {name}", f"{1e3 / tps:.2f} ms/token", f"{tps:.1f}", versus(tps),
                     f"{alpha:.2f}", f"{per_round:.2f}", median_ms(row["ttft"]), median_ms(row["itl"]),
                     f"{bound:.2f}" if bound else "",
                     f"{tps / base / bound:.2f}" if bound and base else "",
                     f"equal text {row['equal']:.0%}"
                     + (f"; {row['drafted'] / row['rounds']:.2f} drafted per round" if row["rounds"] and k else "")])
    if first_token is not None:
        rows.append(["served, 1 stream, first token alone", f"{first_token * 1e3:.2f} ms", *[""] * 8,
                     "max_tokens=1: the prompt's forward and one round"])
    for tokens, (lengths, seconds) in long_first.items():
        rows.append([f"served, 1 stream, first token alone, {tokens}-token prompts", f"{seconds * 1e3:.2f} ms",
                     *[""] * 8, f"max_tokens=1; {len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens"])
    for (streams, name), (result, before, after, wall) in many.items():
        tps = result["tps"]
        note = batching_note(before, after, wall)
        if c is not None:  # in-process costs: a verify of (drafted per round + 1) rows, a draft step per token
            drafted = result["drafted"] / max(result["rounds"], 1)
            verify = executor[1] + (executor[args.k + 1] - executor[1]) * drafted / args.k
            note += "; " + sharing_note(before, after, wall, {"target_model": verify,
                                                              "draft_model": drafted * draft_step})
        alpha = f"{result['accepted'] / result['drafted']:.2f}" if result["drafted"] else ""
        rows.append([f"served, {streams} streams, {name}", "", f"{tps:.1f}", versus(tps), alpha,
                     f"{result['tokens'] / max(result['rounds'], 1):.2f}", median_ms(result["ttft"]),
                     median_ms(result["itl"]), "", "",
                     f"{result['drafted'] / max(result['rounds'], 1):.2f} drafted per round; {note}"])
    if not args.served_only:
        rows.append(["transformers generate, plain", "", f"{peer['plain']:.1f}", versus(peer["plain"]),
                     "", "", "", "", "", "", ""])
        rows.append([f"transformers generate, assisted K={args.k}", "", f"{peer['assisted']:.1f}",
                     versus(peer["assisted"]), "", "", "", "", "", "", f"equal text {peer['equal']:.0%}"])
    machine = torch.cuda.get_device_name() if gpu else f"{platform.machine()} CPU"
    header = (f"{machine}, torch {torch.__version__}, {dtype_name}, {target_path.parent.name}/{target_path.name}, "
              f"{len(prompts)} prompts x {args.max_tokens} tokens, greedy"
              + (", 1-stream rows unstreamed" if args.no_stream else "")
              + (f", launcher {' '.join(args.launcher_arg)}" if args.launcher_arg else ""))
    text = print_table(header, rows, ["", "time", "tokens/s", "vs served K=0", "α", "tokens/round", "TTFT p50 (ms)",
                               "ITL p50 (ms)", "bound", "efficiency", "notes"], args.out)
    if traces:
        from specdec.triton import live_profile

        summaries = "\n".join(["", f"## Traces: one stream at K=0 and K={args.k} ({args.traces})", "",
                                *(live_profile.summary(path) for path in traces)])
        print(summaries)
        if args.out:
            with open(args.out, "a") as out:
                out.write(summaries + "\n")
        text += "\n" + summaries
    if args.results:
        report.write_results(args.results, "The 8B-shaped pair on a GPU: `make bench-gpu`", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
