"""Self-distillation data for a draft head: prompts answered by the target itself, and the target's
features over each prompt + answer (a head must learn the target's own distribution, so the answers are
the target's, not a dataset's).

A `Sample` holds one conversation's tokens and, per position, what training reads: the features the head
is served (the target's `hidden_layers` states, concatenated), the target's last hidden state after its
final norm (its logits over any vocabulary subset are `lm_head` rows times it) and the target's greedy
next token.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

PROMPTS = Path(__file__).with_name("prompts.jsonl")  # shipped; disjoint from bench/'s (a unit test says so)
# Shipped: 4,799 requests the default pair's target wrote itself (self_prompts.py: 2,400 drawn at seed 0, then
# 2,400 at seed 100000 less the one the first draw already had); disjoint from bench/'s too
SELF_PROMPTS = Path(__file__).with_name("prompts_self.jsonl")


@dataclass
class Sample:
    tokens: torch.Tensor  # (L,) int64: prompt + answer
    features: torch.Tensor  # (L, F): the head's input at each position
    final: torch.Tensor  # (L, h): the target's last hidden state after its final norm
    greedy: torch.Tensor  # (L,) int64: the target's argmax next token at each position
    prompt_length: int


def load_prompts(path: str | Path = PROMPTS) -> list[str]:
    """The first user turn of each record of a prompt file: JSON lines, or one JSON array (ShareGPT's own
    files). A record is a string, {"prompt": ...}, OpenAI's {"messages": [{"role": "user", "content": ...}]}
    or ShareGPT's {"conversations": [{"from": "human", "value": ...}]}; plain lines of text are prompts as they
    are. Only the first user turn is kept: the target answers it itself (a dataset's answers are not the
    target's). Records without one are skipped; a record of another shape is an error naming its place."""
    path = Path(path)
    raw = path.read_text()
    if raw.lstrip().startswith("["):
        records = [(f"{path}: item {i}", record) for i, record in enumerate(json.loads(raw))]
    else:
        records = [(f"{path}:{n}", json.loads(line) if line.startswith("{") else line)
                   for n, line in enumerate((line.strip() for line in raw.splitlines()), start=1) if line]
    out = []
    for where, record in records:
        prompt = _first_user_turn(record, where)
        if prompt:
            out.append(prompt)
    return out


def _first_user_turn(record, where: str) -> str | None:
    if isinstance(record, str):
        return record
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return record["prompt"]
    turns = record.get("messages") or record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        raise ValueError(f"{where}: a prompt record is a string or has \"prompt\", \"messages\" (OpenAI) or "
                         f"\"conversations\" (ShareGPT)")
    for turn in turns:
        if isinstance(turn, dict) and (turn.get("role") or turn.get("from")) in ("user", "human"):
            text = turn.get("content", turn.get("value"))
            return text if isinstance(text, str) and text.strip() else None
    return None


def encode(tokenizer, prompt: str, chat_template: bool) -> list[int]:
    if chat_template and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False,
                                                  tokenize=True))
    return tokenizer.encode(prompt, add_special_tokens=True)


@torch.no_grad()  # not inference_mode: training reads these tensors under autograd
def answer_and_featurize(model, tokenizer, prompts: list[str], layers: tuple[int, ...], answer_tokens: int,
                         chat_template: bool = True, batch: int = 32, sampled: int = 0, temperature: float = 0.8,
                         seed: int = 0, log=print, writer=None, store_dtype: torch.dtype = torch.float32,
                         greedy: bool = True) -> list[Sample]:
    """The target's greedy answer to each prompt (up to answer_tokens, ending at its end token) and, when
    `sampled` > 0, that many more drawn at `temperature` (seeded): more text of the target's own making from
    the same prompts (training reads the target's distribution at every position, so any of its answers
    teaches). Then one forward over each prompt + answer for the features of `layers` (executor convention:
    the output of layer l, transformers' hidden_states[l + 1]; the last layer's after the final norm).
    Samples come back in prompt order, each prompt's greedy answer first (`greedy=False`: the sampled ones
    only, e.g. to add to a set that has the greedy ones).

    Answers are generated `batch` at a time, left-padded, prompts of similar length together (less padding
    to compute): on 2 CPU cores a batch of 32 answers ~3x the tokens per second of 8. `writer`, when given,
    is another copy of the target that writes the answers (e.g. in bfloat16, which a CPU with AMX generates
    several times faster); the features and the greedy tokens are still `model`'s, read over what it wrote.
    `store_dtype`: what the features and final states are kept in (bfloat16 halves the memory and data.pt;
    training reads them in the head's precision)."""
    device = model.device
    writer = model if writer is None else writer
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    encoded = [encode(tokenizer, prompt, chat_template) for prompt in prompts]
    jobs = [(i, draw) for i in range(len(prompts)) for draw in range(0 if greedy else 1, 1 + sampled)]  # 0: greedy
    jobs.sort(key=lambda job: (job[1] > 0, len(encoded[job[0]])))
    generator_seed = torch.Generator().manual_seed(seed)
    answers: dict[tuple[int, int], Sample] = {}
    tokens_done = 0
    for start in range(0, len(jobs), batch):
        chunk = jobs[start:start + batch]
        rows = [encoded[i] for i, _ in chunk]
        width = max(len(row) for row in rows)
        ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows], device=device)
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], device=device)
        drawn = chunk[0][1] > 0  # batches hold greedy or sampled jobs only (sorted so)
        options = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if drawn else dict(do_sample=False)
        if drawn:
            torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator_seed)))
        out = writer.generate(ids, attention_mask=mask, max_new_tokens=answer_tokens, pad_token_id=pad, **options)
        written = []
        for row, (i, draw) in zip(out[:, width:].tolist(), chunk):
            answer = row[:row.index(eos) + 1] if eos in row else row  # the end token kept, padding dropped
            written.append(((i, draw), encoded[i] + answer, len(encoded[i])))
        for done in _featurize(model, written, layers, pad, store_dtype):
            answers[done[0]] = done[1]
            tokens_done += len(done[1].tokens)
        log(f"answered {len(answers)}/{len(jobs)} ({tokens_done} tokens)")
    return [answers[job] for job in sorted(answers)]


FEATURE_BATCH = 8  # conversations per features forward (its logits: 8 x length x vocabulary floats)


def _featurize(model, written: list, layers: tuple[int, ...], pad: int, store_dtype: torch.dtype):
    """(key, Sample) of each (key, tokens, prompt_length) in `written`: the model's forward over them,
    FEATURE_BATCH at a time, padded on the right (causal attention: no real position sees the padding)."""
    device = model.device
    for start in range(0, len(written), FEATURE_BATCH):
        group = written[start:start + FEATURE_BATCH]
        width = max(len(tokens) for _, tokens, _ in group)
        ids = torch.tensor([tokens + [pad] * (width - len(tokens)) for _, tokens, _ in group], device=device)
        mask = torch.tensor([[1] * len(tokens) + [0] * (width - len(tokens)) for _, tokens, _ in group], device=device)
        full = model(ids, attention_mask=mask, output_hidden_states=True)
        states = full.hidden_states
        for row, (key, tokens, prompt_length) in enumerate(group):
            n = len(tokens)
            yield key, Sample(
                tokens=torch.tensor(tokens),
                features=torch.cat([states[layer + 1][row, :n] for layer in layers], dim=-1).to(store_dtype).cpu(),
                final=states[-1][row, :n].to(store_dtype).cpu(),
                greedy=full.logits[row, :n].argmax(-1).cpu(),
                prompt_length=prompt_length)


def draft_vocabulary(samples: list[Sample], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` target tokens most frequent in the samples' answers (then the prompts'), ascending ids:
    EAGLE-3's reduced head predicts these only."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for sample in samples:
        counts.index_add_(0, sample.tokens[sample.prompt_length:], torch.ones(len(sample.tokens) - sample.prompt_length,
                                                                              dtype=torch.float64))
        counts.index_add_(0, sample.tokens[:sample.prompt_length], torch.full((sample.prompt_length,), 1e-3,
                                                                              dtype=torch.float64))
    counts += torch.arange(vocab_size, 0, -1, dtype=torch.float64) * 1e-12  # ties: lower ids first
    return counts.topk(min(size, vocab_size)).indices.sort().values


# Grounded requests over a text the target wrote: instructions that make it reuse the text (phrased apart from
# the benchmark's, which a unit test keeps disjoint)
GROUNDED_INSTRUCTIONS = (
    "Condense the passage below into two or three sentences.",
    "Make the passage below sound more professional without losing any detail.",
    "Turn the passage below into a bulleted list of its facts.",
    "Give the passage below a one-line headline, then a one-sentence summary.",
    "Which three words or phrases matter most in the passage below? Quote them and say why.",
    "Rewrite the passage below for a young child.",
    "Shorten the passage below to about half its length, keeping its wording where you can.",
    "Write one more paragraph that continues the passage below in the same style.",
    "Based only on the passage below, what is its main point, and what evidence does it give?",
    "Copy the passage below, fixing anything unclear, and keep everything else as it is.",
    "Write three quiz questions whose answers can be found in the passage below, with the answers.",
    "Turn the passage below into a short dialogue between two friends.",
)


def grounded_prompts(tokenizer, samples: list[Sample], count: int, seed: int = 0, min_tokens: int = 48) -> list[str]:
    """Up to `count` grounded prompts: an instruction (GROUNDED_INSTRUCTIONS, drawn with `seed`) over the text
    of one of `samples`' answers of at least `min_tokens` tokens (its end token dropped), one per answer."""
    eos = tokenizer.eos_token_id
    texts = []
    for sample in samples:
        answer = sample.tokens[sample.prompt_length:].tolist()
        if answer and answer[-1] == eos:
            answer = answer[:-1]
        if len(answer) >= min_tokens:
            texts.append(tokenizer.decode(answer, skip_special_tokens=True).strip())
    draw = random.Random(seed)
    chosen = draw.sample(texts, min(count, len(texts)))
    return [f"{draw.choice(GROUNDED_INSTRUCTIONS)}\n\n{text}" for text in chosen]
