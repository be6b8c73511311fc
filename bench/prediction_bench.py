"""OpenAI's Predicted Outputs, served (`make bench-prediction`): code edits whose answer is mostly the code given,
asked through the OpenAI API with and without the code as the request's `prediction`, greedy, side by side on one
server (started here with --pair, or --url a running one's OpenAI API):

  target-only      num_draft_tokens 0
  prompt lookup    the server's prompt lookup (it sees the code in the prompt too), K fixed
  prediction       the code as `prediction` (the request's own draft), K fixed

It prints per task the output tokens, tokens/s (median of --repeats interleaved requests), the speedup over
target-only, the prediction's accepted and rejected tokens (usage.completion_tokens_details) and whether the
three answers are equal (they must be).

    python -m bench.prediction_bench                    # the default pair (SmolLM2-135M-Instruct)
    python -m bench.prediction_bench --pair tiny --repeats 1 --max-tokens 48
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

CODE = {
    "rename": ("def total(values):\n    result = 0\n    for value in values:\n        result += value\n"
               "    return result\n\n\ndef mean(values):\n    return total(values) / len(values)\n",
               "Rename the function total to sum_all everywhere. Answer with the whole code only."),
    "docstring": ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
                  "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
                  "Add a one-line docstring to the class. Answer with the whole code only."),
    "type hints": ("def greet(name, times):\n    for _ in range(times):\n        print('Hello, ' + name)\n"
                   "    return len(name) * times\n",
                   "Add type hints to greet. Answer with the whole code only."),
}
MODES = ("target-only", "prompt lookup", "prediction")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=("default", "tiny"), default="default")
    p.add_argument("--url", help="a running server's OpenAI API (http://host:9000/v1) instead of starting one")
    p.add_argument("--num-draft-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="also write the table here")
    args = p.parse_args(argv)
    server = None
    if args.url is None:
        from specdec.serving import server as serving_server

        run = Path(tempfile.mkdtemp(prefix="prediction-bench-"))
        server = serving_server.start(run / "run", run / "server.log", ["--pair", args.pair])
        args.url = server.openai_url
    try:
        rows = _measure(args)
    finally:
        if server is not None:
            server.stop(timeout_s=60)
    table = "\n".join([
        f"{args.pair} pair served, OpenAI chat API, greedy, K={args.num_draft_tokens} fixed, max_tokens="
        f"{args.max_tokens}, median of {args.repeats} interleaved requests, {platform.processor() or platform.machine()}",
        "", "| task | mode | tokens | tokens/s | vs target-only | prediction accepted/rejected | equal text |",
        "| --- | --- | --- | --- | --- | --- | --- |", *rows])
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0 if all(row.endswith("yes |") for row in rows) else 1


def _measure(args) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=args.url, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    rows = []
    for task, (code, ask) in CODE.items():
        messages = [{"role": "user", "content": f"{ask}\n\n```python\n{code}```"}]
        rates = {mode: [] for mode in MODES}
        answers = {}
        for _ in range(args.repeats):
            for mode in MODES:  # interleaved: this machine's speed drifts
                extra = {"num_draft_tokens": 0 if mode == "target-only" else args.num_draft_tokens,
                         "adaptive_draft": False, "draft_model": "ngram"}
                more = {"prediction": {"type": "content", "content": f"```python\n{code}```"}} \
                    if mode == "prediction" else {}
                started = time.perf_counter()
                answer = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens,
                                                        temperature=0, extra_body=extra, **more)
                rates[mode].append(answer.usage.completion_tokens / (time.perf_counter() - started))
                answers[mode] = answer
        base = statistics.median(rates["target-only"])
        equal = len({answers[mode].choices[0].message.content for mode in MODES}) == 1
        for mode in MODES:
            usage = answers[mode].usage
            details = usage.completion_tokens_details
            predicted = (f"{details.accepted_prediction_tokens}/{details.rejected_prediction_tokens}"
                         if mode == "prediction" and details is not None else "")
            rate = statistics.median(rates[mode])
            rows.append(f"| {task} | {mode} | {usage.completion_tokens} | {rate:.1f} | {rate / base:.2f}x | "
                        f"{predicted} | {'yes' if equal else 'NO'} |")
    return rows


if __name__ == "__main__":
    sys.exit(main())
