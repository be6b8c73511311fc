"""Self-speculation as SWIFT does it, in one process (`make bench-swift`): the target drafting for itself
with layers left out, the layers searched on the fly, against the default pair's fixed early-exit draft
(its first 10 layers and a head of their own), each with the confidence stop off and on; greedy.

The search first runs over its own prompts (specdec/train/prompts.jsonl, none of the held-out ones): it
measures one layer set after each drafting round of those generations (`SkipTuner`, as the served draft does
after each batch), and a few after each generation (as the served one does on idle seconds), until its
warm trials are done; the set it found then drafts the held-out prompts
(bench/prompts_grounded.jsonl, bench/prompts_open.jsonl). Every held-out prompt runs target-only and each
setting one after the other, so each speedup is a ratio measured side by side; the text must equal
target-only's (greedy is exact). A setting's requests share their measured costs and acceptance, as an
orchestrator's do. The skip draft shares the target's weights here (one process); served,
draft_model holds a copy.

    python -m bench.swift_bench                        # default pair, 8 prompts per set, 96 tokens
    python -m bench.swift_bench --stops 0,0.1,0.2,0.3,0.5   # the confidence threshold's sweep
    python -m bench.swift_bench --pair tiny-deep --prompts 1 --max-tokens 16 --search-prompts 1   # checks the script
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.report import emit, machine, table, write_results
from bench.speculative_bench import load_prompts
from specdec import tensor_names as tn
from specdec.decoding.draft_length import CostModel, DraftLengthPolicy
from specdec.decoding.loop import GenerationRequest, Stats, generate
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.engine.build import ExecutorConfig, build_executor
from specdec.engine.loading import load_causal_lm
from specdec.engine.local import LocalProposer, LocalScorer
from specdec.engine.skip_layers import SkipTuner
from specdec.serving import pairs

SEARCH_PROMPTS = Path(pairs.REPO_ROOT) / "src" / "specdec" / "train" / "prompts.jsonl"
K = 4  # adaptive up to 4: the default pair's drafts pay for little more on CPU


@dataclass(frozen=True)
class Setting:
    label: str
    draft: str  # "none", "early-exit" (draft_model), "skip" (searched)
    stop_below: float = 0.0


class TuningProposer(LocalProposer):
    """A LocalProposer that lets the search measure a set after each proposal (while it wants trials)."""

    def __init__(self, lm, tuner: SkipTuner):
        super().__init__(lm)
        self.tuner = tuner

    async def propose(self, *args, **kwargs):
        proposal = await super().propose(*args, **kwargs)
        if self.tuner.search.trials < self.tuner.warm_trials:
            self.tuner.trial()
        return proposal


def run(target, proposer, prompt_ids: list[int], k: int, max_tokens: int, seq_id: int,
        method: str = "draft_model", costs: CostModel | None = None) -> tuple[list[int], float, Stats]:
    """One greedy generation; `costs`: the measured costs and acceptance a setting's requests share (as an
    orchestrator's do), so the adaptive K knows the draft from the earlier prompts."""
    stats = Stats()
    policy = DraftLengthPolicy(k, costs or CostModel(), method, adaptive=k > 0)

    async def main():
        return [t async for rnd in generate(GenerationRequest(seq_id, prompt_ids, max_tokens), proposer,
                                            LocalScorer(target), policy, stats) for t in rnd.new_tokens]

    started = time.perf_counter()
    tokens = asyncio.run(main())
    return tokens, time.perf_counter() - started, stats


def chat_ids(tokenizer, text: str, template: bool) -> list[int]:
    if not template:
        return tokenizer.encode(text)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def tiny_deep_pair() -> pairs.PairSpec:
    """A 4-layer tiny target (the script's check): the tiny pair's tokenizer, no early-exit draft's worth."""
    from transformers import AutoTokenizer

    tiny = pairs.tiny_pair()
    out = pairs.cache_dir() / "pairs" / "tiny-deep" / "target"
    pairs._build_tiny(out, 4, pairs.TINY_SEED + 7, AutoTokenizer.from_pretrained(tiny.tokenizer_path))
    pairs._mark_done(out)
    return pairs.PairSpec(name="tiny-deep", target_path=str(out), tokenizer_path=str(out),
                          draft_paths=dict(tiny.draft_paths), dtype="float64")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=("default", "tiny-deep"), default="default")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per set")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--search-prompts", type=int, default=6, help="prompts the search measures its sets on")
    parser.add_argument("--warm-trials", type=int, default=48)
    parser.add_argument("--stops", default=f"0,{tn.DEFAULT_DRAFT_STOP_BELOW}",
                        help="confidence thresholds to run each draft with (0: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the report (markdown) here")
    parser.add_argument("--results", metavar="NAME", help="also write it as docs/results/<date>-NAME.md")
    args = parser.parse_args(argv)
    spec = tiny_deep_pair() if args.pair == "tiny-deep" else pairs.prepare_pair(args.pair)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path)
    template = args.pair == "default"
    model = load_causal_lm(spec.target_path, dtype=spec.dtype)
    # The executors the server builds (executor auto: on the CPU's kernels the static forward eagerly, the
    # searched draft's set per sequence; elsewhere transformers' forward), the pools sized for the bench
    config = ExecutorConfig(max_sequences=16, max_context=2048, kv_pool_tokens=8192)
    target = build_executor(model, config)
    early = build_executor(load_causal_lm(spec.draft_paths["draft_model"], dtype=spec.dtype), config)
    layers = model.config.num_hidden_layers
    skip = build_executor(model, ExecutorConfig(max_sequences=16, max_context=2048, kv_pool_tokens=8192,
                                                skip_layers=tuple(range(layers // 4, layers - layers // 4, 2))))
    # its verify costs measured on a sequence id no prompt uses (the served tuner's: the warm-up's)
    tuner = SkipTuner(skip, skip.forward, k_max=K, seed=args.seed, warm_trials=args.warm_trials,
                      scratch_sequence=10**9)

    # The search, over prompts of its own
    started = time.perf_counter()
    search = [json.loads(line)["prompt"] for line in SEARCH_PROMPTS.read_text().splitlines() if line.strip()]
    proposer = TuningProposer(skip, tuner)
    for i, text in enumerate(search[:args.search_prompts]):
        run(target, proposer, chat_ids(tokenizer, text, template), K, args.max_tokens, 1000 + i)
        # and as the served tuner does between batches while its warm trials run: the adaptive rule pauses a
        # draft no set so far pays for, and a paused draft's rounds call it rarely
        for _ in range(tuner.trials_per_text):
            if tuner.warming:
                tuner.trial()
        if tuner.search.trials >= args.warm_trials:
            break
    search_s = time.perf_counter() - started
    found = tuner.search.best
    print(f"[bench-swift] search: {tuner.search.trials} sets in {search_s:.1f} s, skipping {list(found)} "
          f"(agreement {tuner.last_alpha:.2f}, estimated {tuner.search.best_score:.2f}x)", file=sys.stderr, flush=True)

    stops = [float(s) for s in args.stops.split(",")]
    settings = [Setting("target-only", "none")]
    for stop in stops:
        suffix = f", stop below {stop:g}" if stop else ", no stop"
        settings += [Setting(f"early exit (first {pairs.DEFAULT_DRAFT_LAYERS} layers){suffix}", "early-exit", stop),
                     Setting(f"layer-skip, searched{suffix}", "skip", stop)]
    sections = []
    for kind in ("grounded", "open"):
        prompts = [chat_ids(tokenizer, text, template) for text in load_prompts(kind, args.prompts)]
        run(target, LocalProposer(early), prompts[0], K, 8, 0)  # warm-up
        totals = {s.label: [0, 0.0, 0, 0, 0, 0] for s in settings}  # tokens, s, rounds, drafted, accepted, equal
        shared = {s.label: CostModel() for s in settings}
        for i, ids in enumerate(prompts):
            reference = None
            for setting in settings:
                lm = {"none": None, "early-exit": early, "skip": skip}[setting.draft]
                if lm is not None:
                    lm.stop_below = setting.stop_below
                proposer = NgramProposer() if lm is None else LocalProposer(lm)
                tokens, seconds, stats = run(target, proposer, ids, 0 if lm is None else K, args.max_tokens,
                                             i + 1, tn.NGRAM if lm is None else "draft_model", shared[setting.label])
                reference = tokens if reference is None else reference
                total = totals[setting.label]
                for j, value in enumerate((len(tokens), seconds, stats.rounds, stats.drafted, stats.accepted,
                                           tokens == reference)):
                    total[j] += value
                print(f"[bench-swift] {kind} {i + 1}/{len(prompts)} {setting.label}: {len(tokens) / seconds:.1f} "
                      f"tokens/s", file=sys.stderr, flush=True)
        base = totals[settings[0].label][0] / totals[settings[0].label][1]
        rows = []
        for setting in settings:
            tokens, seconds, rounds, drafted, accepted, equal = totals[setting.label]
            rows.append([setting.label, f"{tokens / seconds:.1f}", f"{tokens / seconds / base:.2f}x",
                         f"{accepted / drafted:.2f}" if drafted else "-", f"{drafted / rounds:.2f}",
                         f"{tokens / rounds:.2f}", f"{equal}/{len(prompts)}"])
        sections.append(f"**{kind} prompts** ({len(prompts)}, {args.max_tokens} tokens each, greedy, adaptive K<={K})"
                        "\n\n" + table(rows, ["setting", "tokens/s", "speedup", "α (accepted/drafted)",
                                              "drafted per round", "tokens per round", "text = target-only"]))
    text = (f"{machine()}; the {spec.name} pair, in process ({type(skip.forward.inner).__name__} "
            f"under the skip draft, {type(target.forward).__name__} for the target, {spec.dtype}). The search: "
            f"{tuner.search.trials} layer sets measured over {args.search_prompts} prompts of its own in "
            f"{search_s:.1f} s (those generations included); it skips {len(found)} of {layers} layers: "
            f"{list(found)} (agreement {tuner.last_alpha:.2f} with the whole model on its last text, estimated "
            f"speedup {tuner.search.best_score:.2f}x)\n\n" + "\n\n".join(sections))
    emit(text, args.out)
    if args.results:
        write_results(args.results, "SWIFT-style self-speculation: `make bench-swift`", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
