"""Command line: stream generated text to the terminal, then a stats line.

    python -m client "Write a haiku about GPUs" --stream --protocol grpc --url localhost:8001 --max-tokens 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from client.core import ClientError, GenerationParams
from client.sync import Client
from specdec import tensor_names as tn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--url", default=None, help="host:port (default localhost:8001 for grpc, localhost:8000 for http)")
    p.add_argument("--model", default="ensemble")
    p.add_argument("--stream", action="store_true", help="print text as it is accepted")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--num-draft-tokens", type=int, help="K; 0 = target-only")
    p.add_argument("--num-draft-branches", type=int,
                   help="a draft model's trees at most this wide (1: chains; server default: its draft_branches)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float, help="keep tokens at least this x the most likely one's probability")
    p.add_argument("--seed", type=int)
    p.add_argument("--repetition-penalty", type=float, help="> 0; 1 = off (tokens of prompt and output)")
    p.add_argument("--presence-penalty", type=float, help="[-2, 2]; 0 = off (tokens already in the output)")
    p.add_argument("--frequency-penalty", type=float, help="[-2, 2]; 0 = off (per occurrence in the output)")
    p.add_argument("--end-id", type=int)
    p.add_argument("--min-length", type=int, help="no end token ends generation before this many tokens")
    p.add_argument("--ignore-eos", action="store_true", default=None, help="generate to --max-tokens")
    p.add_argument("--stop", action="append", default=[], help="stop word (repeatable)")
    p.add_argument("--bad-word", action="append", default=[],
                   help="a word the output never contains, as tokens (repeatable; mid-text words need their space)")
    p.add_argument("--draft-model")
    p.add_argument("--lora-name", help="the LoRA adapter the target runs (one the server serves)")
    p.add_argument("--cache-salt", help="share prefix-cache blocks only with requests of this salt (a tenant's secret)")
    p.add_argument("--adaptive-draft", dest="adaptive_draft", action=argparse.BooleanOptionalAction, default=None,
                   help="adapt K per round (server default: on); --no-adaptive-draft drafts exactly --num-draft-tokens")
    p.add_argument("--chat-template", dest="apply_chat_template", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--log-probs", dest="return_log_probs", action="store_true", default=None,
                   help="print each output token's log-probability under the target (and their sum)")
    p.add_argument("--top-log-probs", dest="num_top_log_probs", type=int, default=None, metavar="N",
                   help="with --log-probs: also each position's N most likely tokens (ids) and theirs, N <= 20")
    p.add_argument("--prompt-log-probs", dest="return_prompt_log_probs", action="store_true", default=None,
                   help="print each prompt token's log-probability given those before it (and their sum)")
    p.add_argument("--guide-type", choices=tn.GUIDE_TYPES,
                   help="structured output: the text follows --guide (json: any JSON object, no --guide needed)")
    p.add_argument("--guide", help="a JSON schema, regex, GBNF/Lark grammar or JSON list of choices; @FILE reads a file")
    p.add_argument("--reasoning-parser", choices=tn.REASONING_PARSERS,
                   help="a reasoning model's: the guide holds for the answer after its thinking")
    p.add_argument("--thinking-token-budget", type=int,
                   help="with --reasoning-parser: the thinking ends after at most this many tokens")
    p.add_argument("--priority", type=int,
                   help="while the server is full, requests with a lower value are admitted first (default 0)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--require-output", action="store_true",
                   help="exit 2 unless the answer has text and finished by length or stop (a smoke test)")
    args = p.parse_args(argv)
    params = GenerationParams(
        max_tokens=args.max_tokens, num_draft_tokens=args.num_draft_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed, end_id=args.end_id, stop_words=tuple(args.stop),
        bad_words=tuple(args.bad_word), repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        draft_model=args.draft_model, lora_name=args.lora_name, cache_salt=args.cache_salt,
        apply_chat_template=args.apply_chat_template,
        adaptive_draft=args.adaptive_draft, num_draft_branches=args.num_draft_branches,
        min_length=args.min_length, ignore_eos=args.ignore_eos,
        return_log_probs=args.return_log_probs, num_top_log_probs=args.num_top_log_probs,
        return_prompt_log_probs=args.return_prompt_log_probs, guide_type=args.guide_type, priority=args.priority,
        reasoning_parser=args.reasoning_parser, thinking_token_budget=args.thinking_token_budget,
        guide=Path(args.guide[1:]).read_text() if args.guide and args.guide.startswith("@") else args.guide)
    client = Client(args.url, args.protocol, args.model, args.timeout)

    def show(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    try:
        result = client.generate(args.prompt, params, stream=args.stream, on_text=show if args.stream else None)
    except ClientError as exc:
        print(f"error ({type(exc).__name__}): {exc}", file=sys.stderr)
        return 1
    if not args.stream:
        sys.stdout.write(result.text)
    print()
    print(result.stats_line(), file=sys.stderr)
    if args.return_log_probs:
        print(f"log-probabilities: {' '.join(f'{v:.4f}' for v in result.log_probs)} "
              f"(sum {result.cum_log_probs:.4f})", file=sys.stderr)
        for i, (ids, values) in enumerate(zip(result.top_ids, result.top_log_probs)):
            print(f"  token {i}: " + " ".join(f"{t}:{v:.4f}" for t, v in zip(ids, values)), file=sys.stderr)
    if args.return_prompt_log_probs:
        print(f"prompt: {len(result.prompt_ids)} tokens, log-probabilities of the {len(result.prompt_log_probs)} after "
              f"the first: {' '.join(f'{v:.4f}' for v in result.prompt_log_probs)} "
              f"(sum {sum(result.prompt_log_probs):.4f})", file=sys.stderr)
    if args.require_output and (not result.text.strip() or result.finish_reason not in ("length", "stop")):
        print(f"error: expected generated text, got {result.text!r} (finish_reason {result.finish_reason!r})",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
