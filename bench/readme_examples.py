"""Regenerate the README's "real output" examples from a running default-pair server (`make readme-examples`).

Each example sits between `<!-- example:NAME -->` and `<!-- /example:NAME -->` in README.md: the request
(a curl command, or the command line client's invocation) and the output it really printed. This script
sends those requests and rewrites the blocks, so the examples always show what the current code does;
tests/integration/test_default_pair.py checks that the README's outputs still match the server's.

    python -m bench.readme_examples [--url localhost:8000]   # without --url it starts its own server
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from specdec.serving import server

HERE = Path(__file__).resolve().parent
README = HERE.parent / "README.md"

# The examples: name -> (kind, what is sent). Greedy, so the text is deterministic.
HTTP_BODY = {"text_input": "What is the capital of France? Answer in one sentence.", "max_tokens": 40}
CLI_ARGS = ["Write one sentence about the sea.", "--stream", "--max-tokens", "40"]
OPENAI_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def _post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def _example(url_shown: str, body: dict, answer: dict, sort_keys: bool) -> str:
    """A README example: the curl command and the answer it got."""
    command = f"curl -s {url_shown} \\\n  -d '{json.dumps(body)}'"
    return f"```bash\n{command}\n```\n```json\n{json.dumps(answer, separators=(',', ':'), sort_keys=sort_keys)}\n```"


def http_example(base_url: str) -> tuple[str, dict]:
    answer = _post_json(f"{base_url}/v2/models/ensemble/generate", HTTP_BODY)
    return _example("localhost:8000/v2/models/ensemble/generate", HTTP_BODY, answer, sort_keys=True), answer


def openai_example(openai_url: str) -> tuple[str, dict]:
    """A chat completion through the OpenAI API (openai_url: its base URL, http://host:port/v1)."""
    with urllib.request.urlopen(f"{openai_url}/models", timeout=60) as response:
        model = json.loads(response.read())["data"][0]["id"]
    body = {"model": model, "messages": OPENAI_MESSAGES, "max_tokens": 40, "temperature": 0}
    answer = _post_json(f"{openai_url}/chat/completions", body)
    return _example("localhost:9000/v1/chat/completions", body, answer, sort_keys=False), answer


def readme_openai_answer() -> dict:
    return json.loads(last_fence(readme_block("openai")))


def cli_example(grpc_url: str) -> str:
    result = subprocess.run([sys.executable, "-m", "client", *CLI_ARGS, "--url", grpc_url], capture_output=True,
                            text=True, timeout=300, cwd=HERE.parent, check=True)
    shown = " ".join(f'"{a}"' if " " in a else a for a in CLI_ARGS)
    return (f"```bash\n.venv/bin/python -m client {shown} --url localhost:8001\n```\n"
            f"```\n{result.stdout.strip()}\n{result.stderr.strip().splitlines()[-1]}\n```")


def replace_block(text: str, name: str, block: str) -> str:
    pattern = re.compile(rf"<!-- example:{name} -->\n.*?<!-- /example:{name} -->", re.S)
    if not pattern.search(text):
        raise ValueError(f"README.md has no <!-- example:{name} --> block")
    return pattern.sub(lambda m: f"<!-- example:{name} -->\n{block}\n<!-- /example:{name} -->", text)


def readme_block(name: str) -> str:
    match = re.search(rf"<!-- example:{name} -->\n(.*?)\n<!-- /example:{name} -->", README.read_text(), re.S)
    if not match:
        raise ValueError(f"README.md has no <!-- example:{name} --> block")
    return match.group(1)


def last_fence(block: str) -> str:
    """The content of a block's last fenced code section (an example's output)."""
    return re.findall(r"```[a-z]*\n(.*?)\n```", block, re.S)[-1]


def readme_http_answer() -> dict:
    """The JSON answer the README shows for the HTTP example."""
    return json.loads(last_fence(readme_block("http")))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--http-url", help="http://host:port of a running default-pair server")
    parser.add_argument("--grpc-url", help="host:port of its gRPC endpoint")
    parser.add_argument("--openai-url", help="its OpenAI API's base URL (http://host:9000/v1)")
    args = parser.parse_args(argv)
    own = None
    if not args.http_url:
        cache = HERE.parent / ".cache"
        own = server.start(cache / "run" / "readme", cache / "readme-server.log", ["--pair", "default"])
        args.http_url, args.grpc_url, args.openai_url = own.http_url, own.grpc_url, own.openai_url
    try:
        http_block, _ = http_example(args.http_url)
        cli_block = cli_example(args.grpc_url)
        openai_block, _ = openai_example(args.openai_url)
    finally:
        if own is not None:
            own.stop()
    text = replace_block(README.read_text(), "http", http_block)
    text = replace_block(text, "openai", openai_block)
    README.write_text(replace_block(text, "cli", cli_block))
    print(http_block, cli_block, openai_block, sep="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
