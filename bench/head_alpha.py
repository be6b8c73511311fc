"""What a trained EAGLE head accepts on the benchmark's prompts, teacher-forced, in process.

The target answers each prompt set (bench/prompts_open.jsonl, bench/prompts_grounded.jsonl) greedily, its
chat template on; then every head given is unrolled over those answers as training evaluates it
(specdec.train.eagle: the head's j-th drafted token against the target's greedy one, the earlier ones having
matched). Per head and set: α at each drafted position (conditional on the earlier ones), the drafted
tokens a K-token chain would get accepted per round (α_1 + α_1·α_2 + ...), the held-out figure training
printed (training.json) for comparison, and the share of the answers' tokens the head's vocabulary holds
(an EAGLE-3 head's reduced one: no position whose token it lacks can be accepted). No server and no timing:
acceptance only, the same text for every head, so heads compare side by side.

    python -m bench.head_alpha --head OLD=HEAD_DIR --head NEW=HEAD_DIR2 [--max-tokens 96] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench import report
from bench.speculative_bench import load_prompts


def accepted_per_round(alphas: list[float]) -> float:
    """Expected accepted drafted tokens of a chain as long as `alphas` (conditional α per position)."""
    total, reach = 0.0, 1.0
    for alpha in alphas:
        reach *= alpha
        total += reach
    return total


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.engine.draft_heads import EAGLE3, MEDUSA, load_head
    from specdec.serving import pairs
    from specdec.train import data, eagle, trainer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="", help="default: the default pair's target")
    parser.add_argument("--head", action="append", required=True, metavar="NAME=DIR", help="an EAGLE-1/EAGLE-3 head")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=None, help="per set (default: all)")
    parser.add_argument("--steps", type=int, default=4, help="drafted positions evaluated")
    parser.add_argument("--out", default="", help="also write the table (markdown) here")
    args = parser.parse_args(argv)

    target = args.target or pairs.prepare_pair("default").target_path
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    embed = model.get_input_embeddings().weight.detach().float()
    target_head = model.get_output_embeddings().weight.detach().float()
    text = model.config.get_text_config()
    heads = []
    for spec in args.head:
        name, _, path = spec.rpartition("=")
        head = load_head(path)
        if head.config.kind == MEDUSA:
            raise SystemExit(f"--head {spec}: Medusa heads are not unrolled; give EAGLE-1 or EAGLE-3 heads")
        eagle3 = head.config.kind == EAGLE3
        head.attach(embed, None if eagle3 else target_head)
        ids = head.draft_target_ids() if eagle3 else torch.arange(text.vocab_size)
        layers = head.config.feature_layers(text.num_hidden_layers)
        record = Path(path) / "training.json"
        held = json.loads(record.read_text()).get("held_out_alpha") if record.exists() else None
        heads.append((name or Path(path).name, eagle.EagleObjective(head, args.steps, target_head, ids, "cpu"),
                      layers, held))

    rows = []
    for kind in ("open", "grounded"):
        prompts = load_prompts(kind, args.prompts)
        answered: dict[tuple[int, ...], list] = {}
        for name, objective, layers, held in heads:
            if layers not in answered:  # one answer per prompt; features per layer set
                answered[layers] = data.answer_and_featurize(model, tokenizer, prompts, layers, args.max_tokens,
                                                             batch=len(prompts), log=lambda message: None)
            alphas = trainer.evaluate(objective, answered[layers])["alpha"]
            # The answers are the target's greedy tokens: an EAGLE-3 head proposes only those of its reduced
            # vocabulary, so the share it holds caps its α at every position
            written = torch.cat([sample.tokens[sample.prompt_length:] for sample in answered[layers]])
            in_vocabulary = float(objective.module.t2d[written].float().mean()) if objective.eagle3 else 1.0
            rows.append([f"{kind} ({len(prompts)})", name, " ".join(f"{a:.2f}" for a in alphas),
                         f"{accepted_per_round(alphas[:4]):.2f}",
                         " ".join(f"{a:.2f}" for a in held[:args.steps]) if held else "-", f"{in_vocabulary:.1%}"])
    columns = ["prompts", "head", "α per drafted position", "accepted per round, K=4", "held-out α (training)",
               "answer tokens in its vocabulary"]
    report.print_table(f"Teacher-forced acceptance on the benchmark's prompts ({args.max_tokens}-token greedy answers, "
                       f"{report.machine()})", rows, columns, args.out or None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
