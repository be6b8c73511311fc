"""Token trees against chains, side by side in one process (`make bench-trees`): the real decode loop over
the default pair's target (or the tiny one), prompt lookup drafting chains (one continuation) and trees
(`lookup_branches` continuations merged), greedy; with --draft-head, a trained head's chains against its
EAGLE-2 dynamic trees (`draft_branches` wide) too.

Every prompt runs target-only, then each setting, one after the other in the same process, so each
speedup is a ratio measured side by side (tokens/s over the same prompts' target-only tokens/s). Printed
per prompt set: tokens/s, speedup, tokens per round, rounds that verified a tree, and whether the text
equals target-only (it must: greedy trees are exact). In process, not served: the served machinery costs
chains and trees the same per round; its share is in `make bench`.

    python -m bench.tree_bench                   # default pair, 8 prompts per set, 96 tokens
    python -m bench.tree_bench --pair tiny --prompts 2 --max-tokens 16     # checks the script
    python -m bench.tree_bench --draft-head HEAD --head-only     # a head's chains and trees (python -m specdec.train)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass


from bench.report import emit, machine, table, write_results
from bench.speculative_bench import load_prompts
from specdec import tensor_names as tn
from specdec.decoding.draft_length import CostModel, DraftLengthPolicy, PartPolicies
from specdec.decoding.lookup_first import LOOKUP, MODEL, LookupFirstProposer
from specdec.decoding.loop import GenerationRequest, Stats, generate
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.engine.build import ExecutorConfig, build_executor
from specdec.engine.loading import load_causal_lm
from specdec.engine.local import LocalProposer, LocalScorer
from specdec.serving import pairs


@dataclass(frozen=True)
class Setting:
    label: str
    k: int  # tokens (nodes) a round may draft
    branches: int  # 1: a chain
    adaptive: bool = False
    head: bool = False  # the trained head drafts (else prompt lookup)
    lookup_first: int = 0  # with head: prompt lookup drafts first where it matches this many tokens (0: never)


SETTINGS = [Setting("target-only", 0, 1), Setting("chain, K=4", 4, 1), Setting("chain, K=8", 8, 1),
            Setting("tree of 2, K=4", 4, 2), Setting("tree of 3, K=6", 6, 3), Setting("tree of 3, K=8", 8, 3),
            Setting("chain, adaptive K<=8", 8, 1, True), Setting("tree of 3, adaptive K<=8", 8, 3, True)]
HEAD_SETTINGS = [Setting("head chain, K=3", 3, 1, head=True), Setting("head chain, K=5", 5, 1, head=True),
                 Setting("head tree of 2, K=6", 6, 2, head=True), Setting("head tree of 3, K=8", 8, 3, head=True),
                 Setting("head tree of 4, K=12", 12, 4, head=True), Setting("head tree of 4, K=16", 16, 4, head=True),
                 Setting("head chain, adaptive K<=6", 6, 1, True, head=True),
                 Setting("head tree of 3, adaptive K<=12", 12, 3, True, head=True),
                 Setting("lookup chain, adaptive K<=16", 16, 1, True),
                 *(Setting(f"lookup (n>={n}) first, else head, adaptive K<=16", 16, 1, True, head=True, lookup_first=n)
                   for n in (2, 3, 4)),
                 Setting("lookup (n>=2) first, else head tree of 3, adaptive K<=16", 16, 3, True, head=True,
                         lookup_first=2)]


def load_head_executor(head_dir: str, target_path: str, dtype: str = "float32",
                       stop_below: float = tn.DEFAULT_DRAFT_STOP_BELOW):
    """A trained head as draft_model serves it: the target's embedding (and lm_head) borrowed, its
    confidence stop (draft_stop_below; served by default: tn.DEFAULT_DRAFT_STOP_BELOW)."""
    import torch

    from specdec.engine.draft_heads import load_head_for
    from specdec.engine.head_executor import HeadExecutor

    executor = HeadExecutor(load_head_for(head_dir, target_path, dtype=getattr(torch, dtype))[0])
    executor.stop_below = stop_below
    return executor


def run(lm, prompt_ids: list[int], setting: Setting, max_tokens: int, seq_id: int, head=None,
        costs: CostModel | None = None) -> tuple[list[int], float, Stats, int]:
    """(tokens, seconds, stats, tree rounds) of one greedy generation. costs: the cost model the setting's
    requests share, as a server's do (the orchestrator's: its measured costs and running acceptance are
    every request's prior); a new one when not given (a server's first request)."""
    stats, trees = Stats(), 0
    costs = CostModel() if costs is None else costs
    # As the orchestrator builds it: prompt lookup a free draft, a head a priced one
    method = (f"{tn.NGRAM}+head" if setting.lookup_first else "head") if setting.head else tn.NGRAM
    policy = DraftLengthPolicy(setting.k, costs, method, adaptive=setting.adaptive,
                               free=not setting.head, branches=setting.branches)
    req = GenerationRequest(seq_id, prompt_ids, max_tokens)
    proposer = (LocalProposer(head, branches=setting.branches) if setting.head
                else NgramProposer(branches=setting.branches))
    if setting.lookup_first:  # as the orchestrator builds it: each part's own policy
        proposer = LookupFirstProposer(NgramProposer(), proposer, min_ngram=setting.lookup_first)
        policy = PartPolicies({LOOKUP: DraftLengthPolicy(setting.k, costs, method, free=True),
                               MODEL: DraftLengthPolicy(setting.k, costs, "head", branches=setting.branches)})

    async def main():
        nonlocal trees
        out = []
        async for rnd in generate(req, proposer, LocalScorer(lm), policy, stats):
            out += rnd.new_tokens
            trees += rnd.depth is not None
        return out

    started = time.perf_counter()
    tokens = asyncio.run(main())
    return tokens, time.perf_counter() - started, stats, trees


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=("default", "tiny"), default="default")
    parser.add_argument("--prompts", type=int, default=8, help="per prompt set")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", help="also write the report (markdown) here")
    parser.add_argument("--results", metavar="NAME", help="also write it as docs/results/<date>-NAME.md")
    parser.add_argument("--draft-head", metavar="DIR", help="also a trained head's chains and trees")
    parser.add_argument("--head-only", action="store_true", help="with --draft-head: target-only and the head's rows")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the target's and the head's (bfloat16: AMX on CPUs that have it; greedy text may "
                             "then differ from target-only's by the kernels' rounding)")
    parser.add_argument("--stop-below", type=float, default=tn.DEFAULT_DRAFT_STOP_BELOW,
                        help="the head's confidence stop, as draft_model's draft_stop_below (0: off)")
    parser.add_argument("--only", metavar="TEXT,...", default="",
                        help="the settings whose label contains one of these (target-only always runs)")
    args = parser.parse_args(argv)
    spec = pairs.prepare_pair(args.pair)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path)
    model = load_causal_lm(spec.target_path, dtype=args.dtype)
    head, layers = None, ()
    settings = SETTINGS
    if args.draft_head:
        head = load_head_executor(args.draft_head, spec.target_path, args.dtype, args.stop_below)
        layers = head.config.feature_layers(model.config.get_text_config().num_hidden_layers)
        settings = ([SETTINGS[0]] if args.head_only else SETTINGS) + HEAD_SETTINGS
    wanted = [text for text in args.only.split(",") if text]
    if wanted:
        settings = [settings[0]] + [s for s in settings[1:] if any(text in s.label for text in wanted)]
    # The executor target_model builds (`executor: auto`: the static one on the CPU's kernels where they serve
    # the model); with a head the target returns its features (hidden_layers), as when a head is served; rows
    # for the largest setting's verify; one sequence at a time (a small pool)
    lm = build_executor(model, ExecutorConfig(hidden_layers=tuple(layers), max_rows=max(s.k for s in settings) + 1,
                                              max_sequences=4, max_context=2048))
    executor = "static" if type(lm.forward).__name__ == "StaticForward" else "dynamic"
    sections = []
    for kind in ("grounded", "open"):
        prompts = []
        for text in load_prompts(kind, args.prompts):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        # One cost model per setting across its prompts, as a server's requests share the orchestrator's
        costs = {s.label: CostModel() for s in settings}
        for setting in settings[1:]:  # warm-up (and the setting's first costs)
            run(lm, prompts[0], setting, 8, 0, head, costs[setting.label])
        totals = {s.label: [0, 0.0, 0, 0, 0, 0] for s in settings}  # tokens, seconds, rounds, accepted, trees, equal
        for i, ids in enumerate(prompts):
            reference = None
            for setting in settings:
                tokens, seconds, stats, trees = run(lm, ids, setting, args.max_tokens, i + 1, head,
                                                    costs[setting.label])
                reference = tokens if reference is None else reference
                total = totals[setting.label]
                total[0] += len(tokens)
                total[1] += seconds
                total[2] += stats.rounds
                total[3] += stats.accepted
                total[4] += trees
                total[5] += tokens == reference
                print(f"[bench-trees] {kind} {i + 1}/{len(prompts)} {setting.label}: {len(tokens) / seconds:.1f} "
                      f"tokens/s", file=sys.stderr, flush=True)
        base = totals[SETTINGS[0].label][0] / totals[SETTINGS[0].label][1]
        rows = []
        for setting in settings:
            tokens, seconds, rounds, accepted, trees, equal = totals[setting.label]
            rows.append([setting.label, f"{tokens / seconds:.1f}", f"{tokens / seconds / base:.2f}x",
                         f"{tokens / rounds:.2f}", f"{trees / rounds:.0%}", f"{equal}/{len(prompts)}"])
        sections.append(f"**{kind} prompts** ({len(prompts)}, {args.max_tokens} tokens each, greedy)\n\n" +
                        table(rows, ["setting", "tokens/s", "speedup", "tokens per round", "tree rounds",
                                     "text = target-only"]))
    text = (f"{machine()}; the {args.pair} pair's target, in process ({executor} executor, {args.dtype}), prompt lookup "
            f"(max n-gram 4, min 2)"
            + (f"; the head's confidence stop below {args.stop_below}" if args.draft_head else "")
            + "\n\n" + "\n\n".join(sections))
    emit(text, args.out)
    if args.results:
        write_results(args.results, "Token trees against chains: `make bench-trees`", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
