"""What the Batch API gives (`python -m bench.batch_bench`): the same chat requests answered one at a time,
N at once by N clients, and as one batch (`/v1/files` + `/v1/batches`, polled until done), against one server,
side by side in one run; tokens/s and wall time of each, and whether every way gave the same answers (greedy).

    python -m bench.batch_bench                              # tiny pair, 32 requests
    python -m bench.batch_bench --pair default --requests 24 --results batch-api
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import openai

from bench import report
from bench.openai_gateway_bench import prompts
from specdec.gateway.batches import CONCURRENCY
from specdec.serving import server as serving


def request(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}


async def one_by_one(api, bodies: list[dict]) -> list[tuple[str, int]]:
    out = []
    for body in bodies:
        answer = await api.chat.completions.create(**body)
        out.append((answer.choices[0].message.content, answer.usage.completion_tokens))
    return out


async def at_once(api, bodies: list[dict], clients: int) -> list[tuple[str, int]]:
    gate = asyncio.Semaphore(clients)

    async def one(body):
        async with gate:
            answer = await api.chat.completions.create(**body)
            return answer.choices[0].message.content, answer.usage.completion_tokens
    return list(await asyncio.gather(*(one(body) for body in bodies)))


async def as_batch(api, bodies: list[dict]) -> list[tuple[str, int]]:
    lines = [{"custom_id": str(i), "method": "POST", "url": "/v1/chat/completions", "body": body}
             for i, body in enumerate(bodies)]
    upload = await api.files.create(file=("bench.jsonl", "\n".join(json.dumps(line) for line in lines).encode()),
                                    purpose="batch")
    batch = await api.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status not in ("completed", "failed", "cancelled"):
        await asyncio.sleep(0.1)
        batch = await api.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.failed == 0, batch
    answers = sorted((json.loads(line) for line in (await api.files.content(batch.output_file_id)).text.splitlines()),
                     key=lambda line: int(line["custom_id"]))
    return [(a["response"]["body"]["choices"][0]["message"]["content"],
             a["response"]["body"]["usage"]["completion_tokens"]) for a in answers]


async def run(srv, n: int, max_tokens: int) -> list[list]:
    api = openai.AsyncOpenAI(base_url=srv.openai_url, api_key="unused", max_retries=0, timeout=1200)
    model = (await api.models.list()).data[0].id
    bodies = [request(model, prompt, max_tokens) for prompt in prompts(n)]
    await api.chat.completions.create(**bodies[0])  # warm
    ways = {"one at a time (1 client)": lambda: one_by_one(api, bodies),
            f"{CONCURRENCY} clients at once": lambda: at_once(api, bodies, CONCURRENCY),
            f"one batch ({CONCURRENCY} at a time)": lambda: as_batch(api, bodies)}
    rows, reference, first = [], None, None
    for way, call in ways.items():
        started = time.perf_counter()
        answers = await call()
        wall = time.perf_counter() - started
        tokens = sum(count for _, count in answers)
        reference, first = reference or answers, first or wall  # one at a time's
        rows.append([way, n, tokens, f"{wall:.1f}", f"{tokens / wall:.1f}", f"{first / wall:.2f}x",
                     f"{sum(a == b for a, b in zip(answers, reference))}/{n}"])
    await api.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="tiny", choices=("tiny", "default"))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--results", metavar="NAME", help="also write it as docs/results/<date>-NAME.md")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    srv = serving.start(work / "run", work / "server.log", ["--pair", args.pair])
    try:
        rows = asyncio.run(run(srv, args.requests, args.max_tokens))
    finally:
        srv.stop()
    header = (f"The same chat requests three ways, {args.pair} pair, {args.requests} requests of at most "
              f"{args.max_tokens} tokens, greedy, the server's default draft ({report.machine()})")
    text = report.print_table(header, rows, ["way", "requests", "output tokens", "wall s", "tokens/s",
                                             "speedup over one at a time", "answers = one at a time's"], args.out)
    if args.results:
        report.write_results(args.results, "The Batch API against one request at a time and many clients", text)


if __name__ == "__main__":
    main()
