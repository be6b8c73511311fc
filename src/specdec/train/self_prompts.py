"""The target's own requests (Magpie): `python -m specdec.train.self_prompts --target DIR --count N > FILE`.

An instruct model given its chat template's opening of a user turn, and nothing after it, writes what a user
would ask it (Magpie, Xu et al. 2024: "Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing"). Sampled, these are requests of the kinds the model was tuned on, in its users' words: far more
varied than composed templates, and made by the target alone (no dataset, no network). A head trained on the
target's answers to them learns what the target says to the requests it is likely to get.

Kept: requests the model ends itself (its end-of-turn token within --max-tokens), of --min-words to
--max-words words, distinct (case and spacing folded), without template markup, and sharing no run of five
words with any prompt of the --exclude files (the benchmark's: its figures stay of text no head trained on).
JSON lines {"prompt": ...} on stdout, in the order drawn; the same --seed draws the same requests.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import torch

RUN = 5  # words in a run two prompts must not share (the benchmark's disjointness, tests/unit/test_train_data.py)
MARK = "\x00REQUEST\x00"  # stands for the user's words while the chat template is rendered


def word_runs(text: str, n: int = RUN) -> set[tuple[str, ...]]:
    """Every run of `n` consecutive words of `text` (lower case, letters, digits and apostrophes)."""
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def opening(tokenizer) -> list[int]:
    """The token ids of the chat template up to where a user's request begins (its system turn, if the
    template adds one, and the user turn's header)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target's tokenizer has no chat template: it has no user turn to open")
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False)
    if MARK not in text:
        raise ValueError("the chat template does not show the user's words")
    return tokenizer.encode(text[:text.index(MARK)], add_special_tokens=False)


class Selection:
    """What is kept of the drawn requests: ended, of a sensible length, distinct, no markup, and disjoint
    from `excluded` (prompts whose runs of RUN words no kept request may share)."""

    def __init__(self, excluded: list[str] = (), min_words: int = 4, max_words: int = 120,
                 markup: tuple[str, ...] = ()):
        self.excluded = set().union(*(word_runs(p) for p in excluded)) if excluded else set()
        self.min_words, self.max_words = min_words, max_words
        self.markup = tuple(m for m in markup if m)
        self.kept: list[str] = []
        self._seen: set[str] = set()

    def offer(self, text: str, ended: bool) -> bool:
        text = text.strip()
        folded = " ".join(text.lower().split())
        words = len(folded.split())
        if (not ended or not self.min_words <= words <= self.max_words or folded in self._seen
                or any(m in text for m in self.markup) or word_runs(text) & self.excluded):
            return False
        self._seen.add(folded)
        self.kept.append(text)
        return True


def selection_for(tokenizer, exclude: list[str] = (), min_words: int = 4, max_words: int = 120) -> Selection:
    """A Selection disjoint from the prompts of the `exclude` files, refusing the tokenizer's special tokens."""
    from specdec.train.data import load_prompts

    excluded = [p for path in exclude for p in load_prompts(path)]
    markup = tuple(getattr(tokenizer, "all_special_tokens", ())) + tuple(
        str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values())
    return Selection(excluded, min_words, max_words, markup)


@torch.no_grad()
def draw(model, tokenizer, count: int, selection: Selection, seed: int = 0, batch: int = 64,
         max_tokens: int = 96, temperature: float = 1.0, top_p: float = 0.95, log=print,
         max_batches: int | None = None, writer=None) -> list[str]:
    """Sample user turns from the opening until `selection` keeps `count` (or `max_batches` batches ran:
    fewer then). Batch b draws under seed + b, so a run is reproducible at the same batch size and writer
    (train/writer.py; default: transformers' generate over `model`)."""
    from specdec.train.writer import GenerateWriter

    writer = GenerateWriter(model) if writer is None else writer
    prefix = opening(tokenizer)
    ends = _end_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ends[0]
    drawn = 0
    while len(selection.kept) < count and (max_batches is None or drawn < max_batches):
        for row in writer.write([prefix] * batch, max_tokens, ends, pad, seed + drawn, temperature, top_p):
            ended = bool(row) and row[-1] in ends
            selection.offer(tokenizer.decode(row[:-1] if ended else row, skip_special_tokens=False), ended)
            if len(selection.kept) >= count:
                break
        drawn += 1
        log(f"[self_prompts] batch {drawn}: {len(selection.kept)} of {count} kept")
    return selection.kept[:count]


def _end_ids(model, tokenizer) -> list[int]:
    """The tokens that end a turn: the generation config's end ids and the tokenizer's."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ends = list(configured) if isinstance(configured, (list, tuple)) else [configured]
    ends.append(tokenizer.eos_token_id)
    return sorted({int(e) for e in ends if e is not None})


def main(argv=None) -> int:
    from specdec.train.writer import ENGINES, choose

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="the target: a transformers directory")
    parser.add_argument("--count", type=int, required=True, help="requests to keep")
    parser.add_argument("--exclude", action="append", default=[],
                        help="a prompt file (any shape train --prompts reads) whose five-word runs no request "
                             "may share")
    parser.add_argument("--min-words", type=int, default=4)
    parser.add_argument("--max-words", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=96, help="a request not ended by then is dropped")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--batch", type=int, default=64, help="requests drawn together")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the target's precision while it writes (float32: the served executor with "
                             "--engine auto; bfloat16: transformers' generate, several times its float32 speed on "
                             "a CPU with AMX, not measured against the executor there)")
    parser.add_argument("--engine", choices=ENGINES, default="auto",
                        help="what runs the target while it writes (train/writer.py; auto: the served executor "
                             "where the project's CPU kernels serve it in --dtype, i.e. float32)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype)).eval()
    selection = selection_for(tokenizer, args.exclude, args.min_words, args.max_words)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    writer = choose(args.engine, args.target, model.dtype, model, log=log)
    for prompt in draw(model, tokenizer, args.count, selection, args.seed, args.batch, args.max_tokens,
                       args.temperature, args.top_p, log=log, writer=writer):
        print(json.dumps({"prompt": prompt}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
