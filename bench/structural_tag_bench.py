"""What structural tags cost, in process, no model: for each tool-call parser's strict tags (tools.strict_call_tags,
N strict tools of three parameters each) and a few of xgrammar's format trees, over SmolLM2's tokenizer:

  compile     ms to compile the guide (best of --repeats, nothing cached: a guide new to the server)
  mask        µs per verify position in free text: a round's masks for 5 positions (output + 4 drafts) then
              the round's 5 tokens consumed, over 200 tokens of text (what a structured request pays each round)

against a JSON schema guide and a `(.|\\n)*` regex beside them. A target step of the default pair on the
2-core CPU machine is ~12 ms, so a mask is what it costs next to that.

    python -m bench.structural_tag_bench
    python -m bench.structural_tag_bench --tools 10 100 --results cpu-structural-tags
"""

from __future__ import annotations

import argparse
import json
import time

from bench.report import machine, print_table, write_results
from specdec.decoding.grammar import GuideCompiler
from specdec.decoding.text import load_tokenizer
from specdec.gateway import tools
from specdec.serving.pairs import smollm2_tokenizer_dir

PARSERS = ("hermes", "llama3_json", "mistral", "deepseek_v31", "deepseek_v32", "kimi_k2", "qwen3_coder", "glm45",
           "minimax_m2", "pythonic")
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                              "unit": {"enum": ["C", "F"]}}, "required": ["city"]}
ANY = {"type": "any_text"}
FORMATS = {  # xgrammar's format trees (and the text that opens each one's free text)
    "think then calls": ("<think>", {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<think>", "content": ANY, "end": "</think>"},
        {"type": "triggered_tags", "triggers": ["<function="], "tags": [
            {"type": "tag", "begin": "<function=get_weather>", "end": "</function>",
             "content": {"type": "json_schema", "json_schema": PARAMETERS}}]}]}),
    "text excluding words": ("", {"type": "any_text", "excludes": ["secret", "password", "token"]}),
    "dispatch": ("", {"type": "dispatch", "rules": [["<n>", {"type": "json_schema",
                                                            "json_schema": {"type": "integer"}}]]}),
}
TEXT = "Let me look that up for you, and then I will answer. " * 20


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "strict": True, "parameters": PARAMETERS}}
            for i in range(n)]


def _compile_ms(guides: GuideCompiler, guide_type: str, guide: str, repeats: int):
    best, grammar = float("inf"), None
    for _ in range(repeats):
        guides._seen.clear()  # (nothing kept: each compile is a guide's first)
        started = time.perf_counter()
        grammar = guides.compile(guide_type, guide)
        best = min(best, time.perf_counter() - started)
    return best * 1e3, grammar


def _mask_us(grammar, ids: list[int], repeats: int, opening: list[int] = ()) -> float:
    best = float("inf")
    for _ in range(repeats):
        matcher, positions = grammar.matcher(), 0
        matcher.advance(list(opening))
        started = time.perf_counter()
        for at in range(0, len(ids) - 5, 5):
            matcher.allowed(ids[at:at + 4], 5)
            matcher.advance(ids[at:at + 5])
            positions += 5
        best = min(best, (time.perf_counter() - started) / positions)
    return best * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", type=int, nargs="+", default=[10, 100], help="strict tools per guide")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--results", metavar="NAME", help="also write it as docs/results/<date>-NAME.md")
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(str(smollm2_tokenizer_dir()))
    guides = GuideCompiler(tokenizer, cached=0)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:200]
    rows = []
    for parser in PARSERS:
        row, grammar = [f"strict tools, {parser}"], None
        for n in args.tools:
            ms, grammar = _compile_ms(guides, "structural_tag", json.dumps(tools.strict_call_tags(_tools(n), parser)),
                                      args.repeats)
            row.append(f"{ms:.1f}")
        rows.append(row + [f"{_mask_us(grammar, ids, args.repeats):.1f}"])
    others = [(f"format: {name}", "structural_tag", json.dumps({"format": fmt}), opening)
              for name, (opening, fmt) in FORMATS.items()]
    others += [("json_schema (3 fields)", "json_schema", json.dumps(PARAMETERS), ""),
               ("regex (.|\\n)*", "regex", "(.|\\n)*", "")]
    for name, guide_type, guide, opening in others:
        ms, grammar = _compile_ms(guides, guide_type, guide, args.repeats)
        mask = _mask_us(grammar, ids, args.repeats, tokenizer.encode(opening, add_special_tokens=False)) if (
            guide_type != "json_schema") else float("nan")
        rows.append([name, f"{ms:.1f}"] + [""] * (len(args.tools) - 1) + [f"{mask:.1f}" if mask == mask else "-"])
    columns = ["guide"] + [f"compile ms ({n} tools)" for n in args.tools] + ["mask µs / position (free text)"]
    text = print_table(f"Structural tags' cost, SmolLM2's tokenizer ({machine()})", rows, columns)
    if args.results:
        write_results(args.results, "Structural tags: what compiling and masking cost", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
