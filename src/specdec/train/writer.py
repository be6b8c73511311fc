"""Who writes the target's answers for training: transformers' `generate`, or the project's own executor.

Answering is most of what training a head costs on a CPU (the target writes every token of its answers;
the features are one forward over the text after). `GenerateWriter` runs transformers' `generate` over a
left-padded batch: any model, any device and dtype. `ExecutorWriter` runs the served executor
(engine/build.py): on a CPU with the project's kernels (float32) every step is the server's own forward,
and answers are batched continuously (a finished answer's row goes to the next prompt at once, no padding).
`choose` picks it where those kernels serve the model.

Both write what the target writes: greedy answers are its argmax at every step, sampled ones draws from
softmax(logits / T) within the top-p nucleus (top-k off) from a generator seeded per batch (the decoding
layer's `logits_to_probs` and `sample` for the executor's).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

import torch

ENGINES = ("auto", "executor", "transformers")
# Answers decoded together: of 16, 32 and 64 rows the most tokens per second on a 2-core CPU
# (docs/results/2026-12-01-executor-answers.md)
EXECUTOR_WIDTH = 64


class GenerateWriter:
    """transformers' `generate` over batches of prompts, left-padded."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def write(self, rows: list[list[int]], max_new: int, ends: int | Collection[int], pad: int,
              seed: int | None = None, temperature: float = 1.0, top_p: float = 1.0) -> list[list[int]]:
        """Each row's answer: up to `max_new` tokens, through the first of `ends` (kept), padding dropped.
        seed None: greedy; else drawn at `temperature` within `top_p` after torch.manual_seed(seed)
        (generate draws from torch's global generator)."""
        ends = _ends(ends)
        device = self.model.device
        width = max(len(row) for row in rows)
        ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows], device=device)
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], device=device)
        options = dict(do_sample=False)
        if seed is not None:
            options = dict(do_sample=True, temperature=temperature, top_k=0, top_p=top_p)
            torch.manual_seed(seed)
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=pad,
                                  eos_token_id=sorted(ends), **options)
        return [_through_end(row, ends) for row in out[:, width:].tolist()]


def _ends(ends: int | Collection[int]) -> set[int]:
    return {int(ends)} if isinstance(ends, int) else {int(e) for e in ends}


def _through_end(row: list[int], ends: set[int]) -> list[int]:
    end = next((i for i, t in enumerate(row) if t in ends), None)
    return row if end is None else row[:end + 1]


class ExecutorWriter:
    """The served executor over `model` (as `load_causal_lm` loads it: its kernels chosen as a server's),
    `width` answers decoded together, each in its own KV sequence."""

    CONTEXT_STEP = 256  # the pool is sized for answers this much longer than needed, so few sets rebuild it

    def __init__(self, model, width: int = EXECUTOR_WIDTH):
        self.model, self.width = model, width
        self.lm, self.max_context = None, 0

    def _executor(self, context: int):
        """An executor whose pool holds `width` sequences of `context` positions (built again, larger, when
        a set needs more)."""
        from specdec.engine.build import ExecutorConfig, build_executor

        if context > self.max_context:
            self.lm = None  # the old pool goes before the new one is allocated
            self.max_context = -(-context // self.CONTEXT_STEP) * self.CONTEXT_STEP
            # One row per answer (no drafts), no prefix cache (a set's prompts rarely share whole blocks)
            self.lm = build_executor(self.model, ExecutorConfig(
                max_sequences=self.width, max_batch=self.width, max_rows=1, prefix_caching=False,
                max_context=self.max_context, kv_pool_tokens=self.width * self.max_context))
        return self.lm

    @torch.inference_mode()
    def write(self, rows: list[list[int]], max_new: int, ends: int | Collection[int], pad: int,
              seed: int | None = None, temperature: float = 1.0, top_p: float = 1.0) -> list[list[int]]:
        """GenerateWriter.write's answers (pad unused: nothing is padded). A new prompt joins the next
        step as soon as a row is free; its prefill runs in that step's forward."""
        from specdec.decoding.sampling import SamplingParams, greedy, logits_to_probs, sample
        from specdec.engine.interfaces import Step

        ends = _ends(ends)
        lm = self._executor(max(len(row) for row in rows) + max_new)
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        params = SamplingParams(temperature=temperature, top_k=0, top_p=top_p)
        answers: list[list[int]] = [[] for _ in rows]
        waiting, active = deque(range(len(rows))), []
        while waiting or active:
            while waiting and len(active) < self.width:
                active.append(waiting.popleft())
            steps = [Step(i, 0, rows[i], reserve=len(rows[i]) + max_new) if not answers[i] else
                     Step(i, len(rows[i]) + len(answers[i]) - 1, answers[i][-1:]) for i in active]
            outs = lm.extend_many(steps)
            for out in outs:
                if isinstance(out, Exception):
                    raise out
            last = torch.stack([out[-1] for out in outs])
            tokens = greedy(last) if generator is None else sample(logits_to_probs(last, params), generator)
            still = []
            for i, token in zip(active, tokens.tolist()):
                answers[i].append(token)
                if token in ends or len(answers[i]) == max_new:
                    lm.release(i)
                else:
                    still.append(i)
            active = still
        return answers


def choose(engine: str, target: str, dtype: torch.dtype, writer, log=print):
    """The writer `engine` names (ENGINES) for the target at path `target`: "auto" takes the executor
    where the project's CPU kernels serve the model in `dtype` (float32 on a CPU where they build), else
    `generate` over `writer` (the model the caller loaded). "executor" loads the target as a server does."""
    if engine not in ENGINES:
        raise ValueError(f"answer engine must be one of {ENGINES}, got {engine!r}")
    device = writer.device
    if engine == "auto":
        from specdec.engine import kernels

        engine = "executor" if device.type == "cpu" and kernels.cpu(device, dtype) is not None else "transformers"
    if engine == "transformers":
        return GenerateWriter(writer)
    from specdec.engine.loading import load_causal_lm

    model = load_causal_lm(target, device=str(device), dtype=str(dtype).removeprefix("torch."), log=log)
    log(f"answers written by the served executor, {EXECUTOR_WIDTH} at a time")
    return ExecutorWriter(model)
