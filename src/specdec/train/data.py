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
import time
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
    # None in a conversation answered without features (answer_and_featurize(features=False))
    features: torch.Tensor | None  # (L, F): the head's input at each position
    final: torch.Tensor | None  # (L, h): the target's last hidden state after its final norm
    greedy: torch.Tensor | None  # (L,) int64: the target's argmax next token at each position
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
                         greedy: bool = True, features: bool = True) -> list[Sample]:
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
    several times faster), or a writer of train/writer.py (e.g. the served executor); the features and the
    greedy tokens are still `model`'s, read over what it wrote.
    `store_dtype`: what the features and final states are kept in (bfloat16 halves the memory and data.pt;
    training reads them in the head's precision). features=False: the conversations only (the samples'
    features, final and greedy None), for `save_answers`."""
    from specdec.train.writer import GenerateWriter

    writer = GenerateWriter(model if writer is None else writer) if not hasattr(writer, "write") else writer
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    encoded = [encode(tokenizer, prompt, chat_template) for prompt in prompts]
    jobs = [(i, draw) for i in range(len(prompts)) for draw in range(0 if greedy else 1, 1 + sampled)]  # 0: greedy
    jobs.sort(key=lambda job: (job[1] > 0, len(encoded[job[0]])))
    generator_seed = torch.Generator().manual_seed(seed)
    answers: dict[tuple[int, int], Sample] = {}
    tokens_done, seconds = 0, [0.0, 0.0]  # writing, features
    for start in range(0, len(jobs), batch):
        chunk = jobs[start:start + batch]
        drawn = chunk[0][1] > 0  # batches hold greedy or sampled jobs only (sorted so)
        draw_seed = int(torch.randint(0, 2**31, (1,), generator=generator_seed)) if drawn else None
        began = time.monotonic()
        written = [((i, draw), encoded[i] + answer, len(encoded[i])) for (i, draw), answer in zip(
            chunk, writer.write([encoded[i] for i, _ in chunk], answer_tokens, eos, pad, draw_seed, temperature))]
        wrote = time.monotonic()
        seconds[0] += wrote - began
        computed = _featurize(model, written, layers, pad, store_dtype) if features else (
            (key, Sample(torch.tensor(tokens), None, None, None, length)) for key, tokens, length in written)
        for done in computed:
            answers[done[0]] = done[1]
            tokens_done += len(done[1].tokens)
        seconds[1] += time.monotonic() - wrote
        log(f"answered {len(answers)}/{len(jobs)} ({tokens_done} tokens; {seconds[0]:.0f} s writing, "
            f"{seconds[1]:.0f} s features)")
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


ANSWERS_FORMAT = "specdec-answers/1"


def save_answers(path: str | Path, train: list[Sample], held_out: list[Sample], tokenizer) -> int:
    """Write the conversations (token ids and prompt lengths, no features) of an answered set as gzipped
    JSON lines: a header naming the tokenizer, then one {"split", "prompt_length", "tokens"} per sample.
    Answering is most of what a head's data costs; the features are one forward over these tokens
    (`load_answers` + `featurize`), so a set kept this way trains again anywhere the same target runs.
    Returns the tokens written."""
    import gzip

    header = {"format": ANSWERS_FORMAT, "tokenizer": getattr(tokenizer, "name_or_path", ""),
              "vocab_size": len(tokenizer) if hasattr(tokenizer, "__len__") else None,
              "eos_token_id": tokenizer.eos_token_id}
    tokens = 0
    with gzip.open(path, "wt", encoding="utf-8") as out:
        out.write(json.dumps(header) + "\n")
        for split, samples in (("train", train), ("held_out", held_out)):
            for sample in samples:
                out.write(json.dumps({"split": split, "prompt_length": sample.prompt_length,
                                      "tokens": sample.tokens.tolist()}, separators=(",", ":")) + "\n")
                tokens += len(sample.tokens)
    return tokens


def load_answers(path: str | Path, tokenizer) -> tuple[list[tuple[list[int], int]], list[tuple[list[int], int]]]:
    """The (tokens, prompt_length) of a `save_answers` file's training and held-out conversations.
    ValueError naming the file where it is not one, or was written with another tokenizer (its vocabulary
    size or end token differ from `tokenizer`'s)."""
    import gzip

    with gzip.open(path, "rt", encoding="utf-8") as lines:
        try:
            header = json.loads(next(lines))
        except (StopIteration, json.JSONDecodeError, OSError) as e:
            raise ValueError(f"{path}: not an answers file ({e})") from e
        if not isinstance(header, dict) or header.get("format") != ANSWERS_FORMAT:
            raise ValueError(f"{path}: not an answers file of {ANSWERS_FORMAT}")
        mine = {"vocab_size": len(tokenizer) if hasattr(tokenizer, "__len__") else None,
                "eos_token_id": tokenizer.eos_token_id}
        for key, value in mine.items():
            if header.get(key) != value:
                raise ValueError(f"{path}: written with a tokenizer of {key} {header.get(key)} "
                                 f"({header.get('tokenizer')}); this target's is {value}")
        train, held_out = [], []
        for n, line in enumerate(lines, start=2):
            record = json.loads(line)
            if record.get("split") not in ("train", "held_out") or not 0 < record.get("prompt_length", 0) \
                    <= len(record.get("tokens", ())):
                raise ValueError(f"{path}:{n}: a conversation needs split train|held_out, tokens and a "
                                 f"prompt_length within them")
            (train if record["split"] == "train" else held_out).append((record["tokens"], record["prompt_length"]))
    return train, held_out


def featurize(model, conversations: list[tuple[list[int], int]], layers: tuple[int, ...], pad: int,
              store_dtype: torch.dtype = torch.float32, log=print) -> list[Sample]:
    """The Samples of (tokens, prompt_length) conversations (`load_answers`): the model's features over each,
    as `answer_and_featurize` computes them after answering."""
    samples = []
    with torch.no_grad():
        for start in range(0, len(conversations), 256):
            part = [(i, tokens, length) for i, (tokens, length) in enumerate(conversations[start:start + 256], start)]
            samples += [sample for _, sample in _featurize(model, part, layers, pad, store_dtype)]
            log(f"features of {len(samples)}/{len(conversations)} conversations")
    return samples


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
