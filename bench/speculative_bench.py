"""Speculative vs target-only on the real default pair, served by Triton, against the theoretical bound
and against transformers' assisted generation in-process (`make bench`).

For each prompt set (bench/prompts_grounded.jsonl, bench/prompts_open.jsonl) and each draft setting, every
prompt runs target-only (num_draft_tokens=0) and then speculative, side by side in the same run, greedy,
through the served `ensemble` (gRPC). Then, with the server idle, the same models are timed in-process
for the cost ratios: v(K) = verify K+1 positions / one target step, c = one draft token / one target
step (prompt lookup: the lookup itself). Bound = E / (K·c + v(K)) with E = (1 - α^(K+1)) / (1 - α) at the
measured α, taken over the rounds as they ran: the server's per-position counters give how many rounds
drafted exactly j tokens (a prompt-lookup miss or an adaptive k = 0 drafts none, costing one step for one
token), so bound = Σ_rounds E(α, j) / Σ_rounds (j·c + v(j)); efficiency = measured speedup / bound. The peer is transformers' `generate` on the same
models and prompts: plain, `prompt_lookup_num_tokens=K`, `assistant_model=<draft>` (num_assistant_tokens=K,
constant schedule).

    python -m bench.speculative_bench [--url localhost:8001 --metrics-url localhost:8002] [--max-tokens 96] [--quick]

Without --url it starts its own server (PAIR=default) on free ports and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tabulate import tabulate

from bench.report import emit, write_results
from client import Client, GenerationParams
from specdec import tensor_names as tn
from specdec.decoding.draft_length import expected_tokens
from specdec.decoding.ngram_proposer import NgramIndex
from specdec.serving import pairs, server
from specdec.serving.metrics_text import samples, scrape

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Setting:
    label: str
    method: str  # draft_model input: "ngram" or "draft_model"
    k: int
    adaptive: bool
    branches: int | None = None  # num_draft_branches (a draft model's trees; 1: chains); None: the server's


SETTINGS = [
    Setting("ngram, adaptive K<=16 (the default pair's default)", tn.NGRAM, 16, True),
    Setting("ngram, adaptive K<=8", tn.NGRAM, 8, True),
    Setting("ngram, K=4", tn.NGRAM, 4, False),
    Setting("ngram, K=16", tn.NGRAM, 16, False),
    Setting("layer-skip draft, K=2", "draft_model", 2, False, 1),
    Setting("layer-skip draft, adaptive K<=4", "draft_model", 4, True, 1),
]
SKIP = tn.DEFAULT_SKIP_DRAFT_NAME  # the layer-skip self-draft, its layers searched (--skip-draft auto)
SETTINGS.append(Setting("layer-skip self-draft (searched), adaptive K<=4", SKIP, 4, True, 1))
QUICK = [SETTINGS[0], SETTINGS[3], SETTINGS[5], SETTINGS[6]]
SEARCH_PROMPTS = HERE.parent / "src" / "specdec" / "train" / "prompts.jsonl"  # none of the held-out ones
HEAD = tn.DEFAULT_HEAD_NAME  # with --draft-head: the trained head's rows (else the default pair's own head's)


def head_settings(name: str) -> list[Setting]:
    """A trained head's rows, served as the draft model `name`."""
    wide = pairs.DEFAULT_PAIR_DRAFT_BRANCHES
    return [Setting("EAGLE-3 head, K=3", name, 3, False, 1), Setting("EAGLE-3 head, K=5", name, 5, False, 1),
            Setting(f"EAGLE-3 head, tree of {wide}, K=8", name, 8, False, wide),
            Setting("EAGLE-3 head, adaptive K<=6", name, 6, True, 1),
            Setting("ngram first, else the EAGLE-3 head's chains, adaptive K<=16", f"{tn.NGRAM}+{name}", 16, True, 1),
            Setting(f"ngram first, else the EAGLE-3 head's trees of {wide} or chains, adaptive K<=16",
                    f"{tn.NGRAM}+{name}", 16, True)]


def pair_layers(pair) -> int:
    return json.loads((Path(pair.target_path) / "config.json").read_text())["num_hidden_layers"]


def load_prompts(kind: str, limit: int | None) -> list[str]:
    lines = (HERE / f"prompts_{kind}.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()][:limit]


def drafted_at(metrics_url: str | None) -> dict[int, float]:
    """specdec_drafted_at_position_total by position: rounds that drafted at least that many tokens."""
    if not metrics_url:
        return {}
    out: dict[int, float] = {}
    for labels, value in samples(scrape(metrics_url), "specdec_drafted_at_position_total"):
        position = int(labels["position"])
        out[position] = out.get(position, 0.0) + value
    return out


def tree_rounds(metrics_url: str | None) -> float:
    """specdec_tree_rounds_total: rounds that verified a token tree."""
    if not metrics_url:
        return 0.0
    return sum(value for _, value in samples(scrape(metrics_url), "specdec_tree_rounds_total"))


# ---- served --------------------------------------------------------------------------------------
def served(url: str, metrics_url: str | None, prompts: dict[str, list[str]], settings: list[Setting],
           max_tokens: int) -> dict:
    client = Client(url, "grpc", timeout_s=600)
    warm = GenerationParams(max_tokens=8, num_draft_tokens=0)
    client.generate("Hello", warm)
    for s in settings:  # warm every path once (and the orchestrator's cost measurements)
        client.generate(prompts["grounded"][0], GenerationParams(max_tokens=16, num_draft_tokens=s.k,
                                                                 draft_model=s.method, adaptive_draft=s.adaptive,
                                                                 num_draft_branches=s.branches))
    for plist in prompts.values():  # every prompt once: target-only and speculative requests alike then find
        for prompt in plist:  # its blocks in the prefix cache (a head's included: prefix_cache.py)
            client.generate(prompt, GenerationParams(max_tokens=1, num_draft_tokens=0))
    results = {}
    for kind, plist in prompts.items():
        for s in settings:
            agg = dict(base_tokens=0, base_s=0.0, tokens=0, s=0.0, drafted=0, accepted=0, rounds=0)
            before, trees_before = drafted_at(metrics_url), tree_rounds(metrics_url)
            for prompt in plist:
                base = client.generate(prompt, GenerationParams(max_tokens=max_tokens, num_draft_tokens=0))
                spec = client.generate(prompt, GenerationParams(max_tokens=max_tokens, num_draft_tokens=s.k,
                                                                draft_model=s.method, adaptive_draft=s.adaptive,
                                                                num_draft_branches=s.branches))
                if spec.text != base.text:
                    raise AssertionError(f"greedy speculative output differs from target-only for {prompt[:40]!r}")
                agg["base_tokens"] += base.num_output_tokens
                agg["base_s"] += base.latency_s
                agg["tokens"] += spec.num_output_tokens
                agg["s"] += spec.latency_s
                agg["drafted"] += spec.total_draft_tokens
                agg["accepted"] += spec.total_accepted_draft_tokens
                agg["rounds"] += spec.num_rounds
            after = drafted_at(metrics_url)
            agg["tree_rounds"] = tree_rounds(metrics_url) - trees_before
            at_least = {j: after[j] - before.get(j, 0.0) for j in after}  # rounds drafting >= j tokens
            agg["rounds_by_k"] = {j: at_least[j] - at_least.get(j + 1, 0.0) for j in at_least
                                  if at_least[j] - at_least.get(j + 1, 0.0) > 0}
            results[(kind, s.label)] = agg
            print(f"  {kind:8s} {s.label:40s} {agg['tokens'] / agg['s']:6.1f} tok/s vs "
                  f"{agg['base_tokens'] / agg['base_s']:5.1f}", file=sys.stderr, flush=True)
    return results


# ---- in-process costs ----------------------------------------------------------------------------
def median_time(fn, reps: int = 9) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def head_cost_s(head_dir: str, target_path: str, prompt_ids: list[int]) -> float:
    """Seconds per token a head drafts (K=4 after a round's features), in process."""
    from specdec.decoding.sampling import SamplingParams
    from specdec.engine.draft_heads import load_head_for
    from specdec.engine.head_executor import HeadExecutor

    head, _ = load_head_for(head_dir, target_path)
    executor = HeadExecutor(head)
    n, width = len(prompt_ids), head.config.feature_width
    executor.propose(1, 0, prompt_ids, 0, SamplingParams(), features=torch.zeros(n - 1, width))
    features = torch.zeros(2, width)
    return median_time(lambda: executor.propose(1, n - 1, [100, 101, 102], 4, SamplingParams(),
                                                 features=features)) / 4


def search_skip_layers(url: str, metrics_url: str, max_tokens: int, trials: int = 48,
                       timeout_s: float = 900.0) -> tuple[int, ...]:
    """Let the served skip draft's search measure its warm sets on prompts of its own (it searches over the
    traffic), then return the set it drafts with (specdec_draft_layer_skipped)."""
    client = Client(url)
    prompts = [json.loads(line)["prompt"] for line in SEARCH_PROMPTS.read_text().splitlines() if line.strip()]
    deadline = time.monotonic() + timeout_s
    for prompt in prompts:
        done = sum(v for labels, v in samples(scrape(metrics_url), "specdec_draft_skip_trials_total")
                   if labels.get("model") == SKIP)
        if done >= trials or time.monotonic() > deadline:
            break
        client.generate(prompt, GenerationParams(max_tokens=max_tokens, num_draft_tokens=4, draft_model=SKIP))
    skipped = samples(scrape(metrics_url), "specdec_draft_layer_skipped")
    return tuple(sorted(int(labels["layer"]) for labels, v in skipped if v and labels.get("model") == SKIP))


def measure_costs(pair, prompt_ids: list[int], ks: list[int], head_dir: str | None = None, head_name: str = HEAD,
                  skip_layers: tuple[int, ...] | None = None) -> dict:
    from specdec.engine.build import dynamic_executor
    from specdec.engine.loading import load_causal_lm

    torch.set_num_threads(os.cpu_count() or 1)
    model = load_causal_lm(pair.target_path, dtype=pair.dtype)
    target = dynamic_executor(model)
    draft = dynamic_executor(load_causal_lm(pair.draft_paths["draft_model"], dtype=pair.dtype))
    target.extend(1, 0, prompt_ids, 1)
    draft.extend(1, 0, prompt_ids, 1)
    n = len(prompt_ids)

    def verify(positions):
        return lambda: target.extend(1, n, list(range(100, 100 + positions)), positions)

    step = median_time(verify(1))
    v = {k: median_time(verify(k + 1)) / step for k in ks}
    draft_token = median_time(lambda: draft.extend(1, n, [100], 1))
    index = NgramIndex(4, 2)
    index.extend(prompt_ids * 2)
    lookup_s = median_time(lambda: (index.extend([100]), index.lookup(8)), reps=200)  # a round's update + lookup
    c = {"draft_model": draft_token / step, tn.NGRAM: lookup_s / step}
    if head_dir:
        c[head_name] = head_cost_s(head_dir, pair.target_path, prompt_ids) / step
    if skip_layers is not None:  # the target's weights with the searched layers left out
        skip = dynamic_executor(model, skip_layers=skip_layers)
        skip.extend(1, 0, prompt_ids, 1)
        c[SKIP] = median_time(lambda: skip.extend(1, n, [100], 1)) / step
    return {"step_s": step, "v": v, "c": c}


# ---- transformers' assisted generation -------------------------------------------------------------
def transformers_peer(pair, prompts: dict[str, list[str]], max_tokens: int, k: int) -> dict:
    """tokens/s per prompt set, kernel setting ("stock": torch's linear kernels, as transformers runs by
    default; "onednn": the same prepacked linear layers our server uses) and variant."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.engine.onednn_linear import prepack_linears

    tok = AutoTokenizer.from_pretrained(pair.tokenizer_path)
    out = {}
    for kernels in ("stock", "onednn"):
        target = AutoModelForCausalLM.from_pretrained(pair.target_path, dtype=torch.float32).eval()
        draft = AutoModelForCausalLM.from_pretrained(pair.draft_paths["draft_model"], dtype=torch.float32).eval()
        if kernels == "onednn":
            prepack_linears(target)
            prepack_linears(draft)
        draft.generation_config.num_assistant_tokens = k
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        variants = {"plain": {}, "prompt_lookup": {"prompt_lookup_num_tokens": k},
                    "assistant_model": {"assistant_model": draft}}
        for kind, plist in prompts.items():
            totals = {name: [0, 0.0] for name in variants}
            for prompt in plist:
                ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"]
                for name, extra in variants.items():
                    started = time.perf_counter()
                    with torch.inference_mode():
                        gen = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                              do_sample=False, **extra)
                    totals[name][1] += time.perf_counter() - started
                    totals[name][0] += gen.shape[1] - ids.shape[1]
            out[(kind, kernels)] = {name: t / s for name, (t, s) in totals.items()}
    return out


# ---- report ---------------------------------------------------------------------------------------
def report(results, costs, peer, settings, max_tokens, n_prompts) -> str:
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
             f"{platform.python_implementation()} {platform.python_version()}; greedy, max_tokens={max_tokens}, "
             f"{n_prompts} prompts per set; one target step = {costs['step_s'] * 1000:.1f} ms in-process.", ""]
    rows = []
    for (kind, label), agg in results.items():
        s = next(x for x in settings if x.label == label)
        base = agg["base_tokens"] / agg["base_s"]
        spec = agg["tokens"] / agg["s"]
        alpha = agg["accepted"] / agg["drafted"] if agg["drafted"] else 0.0
        per_round = agg["tokens"] / agg["rounds"] if agg["rounds"] else 0.0
        c = costs["c"][s.method.rpartition("+")[2]]  # ngram+NAME: its draft model's (lookup rounds cost less)
        by_k = agg.get("rounds_by_k") or {s.k: agg["rounds"]}  # without metrics: every round drafted K
        plain_rounds = max(0.0, agg["rounds"] - sum(by_k.values()))
        gained = plain_rounds + sum(n * expected_tokens(alpha, j) for j, n in by_k.items())
        spent = plain_rounds + sum(n * (j * c + costs["v"][j]) for j, n in by_k.items())
        b = gained / spent
        k_mean = sum(j * n for j, n in by_k.items()) / max(1.0, sum(by_k.values()))
        v = sum(n * costs["v"][j] for j, n in by_k.items()) / max(1.0, sum(by_k.values()))
        # A row whose rounds may be trees (a draft model's, wider than 1): α counts every node drafted and K
        # is the depth, so the chain bound does not apply
        trees = s.method not in tn.BUILTIN_DRAFTS and s.branches != 1
        bound, efficiency = ("-", "-") if trees else (f"{b:.2f}", f"{spec / base / b:.2f}")
        tree_share = f"{agg.get('tree_rounds', 0.0) / agg['rounds']:.0%}" if trees and agg["rounds"] else "-"
        rows.append([kind, label, f"{base:.1f}", f"{spec:.1f}", f"**{spec / base:.2f}x**", f"{alpha:.2f}",
                     f"{per_round:.2f}", tree_share, f"{k_mean:.1f}", f"{c:.3f}", f"{v:.2f}", bound, efficiency])
    lines.append(tabulate(rows, ["prompts", "draft", "target-only tok/s", "speculative tok/s", "speedup", "α",
                                 "tokens/round", "tree rounds", "K (drafting rounds)", "c", "v", "bound",
                                 "efficiency"],
                          tablefmt="github", disable_numparse=True))
    lines.append("")
    lines.append("Rows that may draft trees (a draft model's, `num_draft_branches` above 1 or the server's): α is "
                 "per node drafted, K the depth, no chain bound; 'tree rounds' is their share of the row's rounds "
                 "(specdec_tree_rounds_total).")
    if not peer:
        lines.append("")
        lines.append(f"Measured verify cost ratios: {', '.join(f'v({k})={v:.2f}' for k, v in sorted(costs['v'].items()))}.")
        return "\n".join(lines)
    lines.append("")
    lines.append("transformers `generate` in-process, same models and prompts (tokens/s; speedup over its plain generate):")
    lines.append("")
    lines.append(tabulate(
        [[kind, kernels, f"{row['plain']:.1f}", f"{row['prompt_lookup']:.1f} ({row['prompt_lookup'] / row['plain']:.2f}x)",
          f"{row['assistant_model']:.1f} ({row['assistant_model'] / row['plain']:.2f}x)"]
         for (kind, kernels), row in peer.items()],
        ["prompts", "linear kernels", "plain", "prompt_lookup_num_tokens", "assistant_model (layer-skip draft)"],
        tablefmt="github", disable_numparse=True))
    v_table = ", ".join(f"v({k})={v:.2f}" for k, v in sorted(costs["v"].items()))
    lines.append("")
    lines.append(f"Measured verify cost ratios: {v_table}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="gRPC host:port of a running default-pair server (else one is started)")
    parser.add_argument("--metrics-url", help="host:port of that server's metrics (for the per-round K counts)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--quick", action="store_true", help="4 prompts per set, 3 settings")
    parser.add_argument("--peer-k", type=int, default=8, help="K for transformers' assisted generation")
    parser.add_argument("--out", help="also write the report (markdown) here")
    parser.add_argument("--results", metavar="NAME", help="also write it as docs/results/<date>-NAME.md")
    parser.add_argument("--draft-head", metavar="DIR", help="also serve this trained head (python -m specdec.train) "
                        "and give its rows (default: the rows of the default pair's own head, eagle3)")
    parser.add_argument("--head-only", action="store_true", help="the server's default and the head's rows only")
    parser.add_argument("--no-peer", action="store_true", help="leave out transformers' generate")
    parser.add_argument("--launcher-arg", action="append", default=[], help="more arguments for the server's "
                        "launcher, e.g. --launcher-arg=--set=target_model.linear_kernels=onednn")
    args = parser.parse_args(argv)
    limit = 4 if args.quick else None
    settings = QUICK if args.quick else SETTINGS
    prompts = {kind: load_prompts(kind, limit) for kind in ("grounded", "open")}
    pair = pairs.prepare_pair("default")
    # The head given, else the one the default pair serves
    served = {**pair.draft_heads, **pair.hosted_heads}  # hosted in target_model (the default pair's) or called
    head_name, head_dir = ((HEAD, args.draft_head) if args.draft_head else
                           (pairs.DEFAULT_PAIR_HEAD_NAME, served.get(pairs.DEFAULT_PAIR_HEAD_NAME)))
    if head_dir:
        settings = ([SETTINGS[0]] if args.head_only else settings) + head_settings(head_name)
    own = None
    url, metrics_url = args.url, args.metrics_url
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop our server
    if url is None:
        print("starting the default-pair server ...", file=sys.stderr, flush=True)
        cache = HERE.parent / ".cache"
        head = ["--draft-head", args.draft_head, "--default-draft", tn.NGRAM] if args.draft_head else []
        skip = ["--skip-draft", tn.SKIP_SEARCH] if any(s.method == SKIP for s in settings) else []
        own = server.start(cache / "run" / "bench", cache / "bench-server.log", ["--pair", "default", *head, *skip,
                                                                                       *args.launcher_arg])
        url, metrics_url = own.grpc_url, own.metrics_url
    skip_layers = None
    try:
        if any(s.method == SKIP for s in settings):
            print("the skip draft's search, over prompts of its own ...", file=sys.stderr, flush=True)
            skip_layers = search_skip_layers(url, metrics_url, args.max_tokens)
            print(f"it skips layers {list(skip_layers)}", file=sys.stderr, flush=True)
        results = served(url, metrics_url, prompts, settings, args.max_tokens)
    finally:
        if own is not None:
            own.stop(60)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pair.tokenizer_path)
    ids = tok.apply_chat_template([{"role": "user", "content": prompts["grounded"][0]}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    costs = measure_costs(pair, ids, list(range(1, max(s.k for s in settings) + 1)), head_dir, head_name, skip_layers)
    peer = {} if args.no_peer else transformers_peer(pair, prompts, args.max_tokens, args.peer_k)
    text = report(results, costs, peer, settings, args.max_tokens, len(prompts["grounded"]))
    if skip_layers is not None:
        text += (f"\n\nThe layer-skip self-draft's search (over prompts of its own, before the rows) settled on "
                 f"skipping layers {list(skip_layers)} of the target's {pair_layers(pair)}.")
    emit(text, args.out)
    if args.results:
        write_results(args.results, "The served default pair against target-only: `make bench`", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
