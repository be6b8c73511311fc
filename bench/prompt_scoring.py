"""What scoring a prompt costs, and whether its scores are the target's: the OpenAI API's `echo` with
`logprobs` (the ensemble's return_prompt_log_probs) against the same request without, on a running server.

For prompts of several lengths (the bench's grounded prompts joined and cut; each request's own first token,
so no prefix cache serves one), sends lm-eval's log-likelihood request (token ids, `echo`, `logprobs: 1`,
`max_tokens: 1`, temperature 0) and the plain request (`max_tokens: 1`), interleaved, and prints the wall time
of each and their ratio; with --target, every prompt's scores against a float32 transformers forward of the
target (the largest difference, and whether the greedy flags lm-eval reads agree).

    make serve &   # the default pair; the OpenAI API at localhost:9000
    python -m bench.prompt_scoring --target .cache/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import openai

from bench import report

HERE = Path(__file__).resolve().parent


def base_ids(tokenizer, length: int) -> list[int]:
    text = "\n\n".join(json.loads(line)["prompt"] for line in (HERE / "prompts_grounded.jsonl").read_text().splitlines()
                       if line.strip())
    ids = tokenizer(text).input_ids
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def reference(model, ids: list[int]):
    """The target's log-probability of each prompt token after the first, and each position's top token."""
    import torch

    with torch.no_grad():
        rows = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
    return rows[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist(), rows.argmax(-1).tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://localhost:9000/v1", help="the OpenAI API")
    parser.add_argument("--tokenizer", default=".cache/models/smollm2-135m-instruct")
    parser.add_argument("--target", default="", help="the target's directory: check the scores against it")
    parser.add_argument("--lengths", default="32,128,512,1024")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", default=None, help="also write the tables to this file")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    model = None
    if args.target:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    api = openai.OpenAI(base_url=args.url, api_key="unused", max_retries=0, timeout=600)
    name = api.models.list().data[0].id
    rng = random.Random(0)
    rows, checks = [], []
    for length in (int(n) for n in args.lengths.split(",")):
        base = base_ids(tokenizer, length - 1)
        times: dict[str, list[float]] = {"plain": [], "scored": []}
        for repeat in range(args.repeats):
            for kind in ("plain", "scored") if repeat % 2 == 0 else ("scored", "plain"):
                ids = [rng.randrange(1000, 20000)] + base  # its own first token: nothing cached
                extra = {"echo": True, "logprobs": 1} if kind == "scored" else {}
                started = time.perf_counter()
                out = api.completions.create(model=name, prompt=ids, max_tokens=1, temperature=0, seed=1234, **extra)
                times[kind].append(time.perf_counter() - started)
                if kind == "scored" and model is not None and repeat == 0:
                    lp = out.choices[0].logprobs
                    values, best = reference(model, ids)
                    served = lp.token_logprobs[1:len(ids)]
                    greedy_served = [v == max(top.values()) for v, top in zip(served, lp.top_logprobs[1:len(ids)])]
                    greedy_reference = [b == t for b, t in zip(best, ids[1:])]
                    checks.append([length, f"{max(abs(a - b) for a, b in zip(served, values)):.2e}",
                                   f"{sum(served):.3f}", f"{sum(values):.3f}",
                                   f"{sum(a == b for a, b in zip(greedy_served, greedy_reference))}/{len(ids) - 1}"])
        plain, scored = statistics.median(times["plain"]), statistics.median(times["scored"])
        rows.append([length, f"{plain * 1000:.0f}", f"{scored * 1000:.0f}", f"{scored / plain:.2f}",
                     f"{length / scored:.0f}"])
    text = report.print_table(
        f"lm-eval's log-likelihood request (echo, logprobs 1, max_tokens 1) against the plain request, median of "
        f"{args.repeats}, one at a time ({report.machine()})", rows,
        ["prompt tokens", "plain ms", "scored ms", "scored / plain", "prompt tokens scored per s"])
    if checks:
        text += "\n\n" + report.print_table(
            "The served scores against a float32 transformers forward of the target (the first request of each length)",
            checks, ["prompt tokens", "largest difference", "sum served", "sum transformers", "greedy flags equal"])
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
