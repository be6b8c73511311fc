"""The training loop every head kind shares: AdamW with a cosine decay over the whole run, gradient clipping,
held-out figures after every epoch, checkpoints at least every minute and a resumed run picking up where it
stopped (epoch, batch, optimizer state, the schedule's place).

Samples train in batches: samples of similar length (sorted, then cut into groups of `batch_size`) padded
on the right to one length. Padding changes nothing a real position computes (attention is causal, and the
padded positions come after every real one); the objectives leave the padded positions out of the loss and
the counts (`Batch.rows`). The loss of a batch is the mean over its positions, so a batch of one is the
unbatched loss.

What a kind trains is an `Objective`: the module whose parameters train, and per batch the loss and, per
drafted position j, (hits, positions): how often the head's j-th drafted token would be the target's greedy
one, the earlier ones having been (α per position, on the samples' answers).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from specdec.train.data import Sample


STEP_WEIGHT = 0.8  # drafted position j's loss weighs 0.8^j (EAGLE-3's training-time test)


@dataclass
class Batch:
    """Samples padded on the right to length L (B samples, F the features' width, h hidden)."""
    tokens: torch.Tensor  # (B, L) int64
    features: torch.Tensor  # (B, L, F)
    final: torch.Tensor  # (B, L, h)
    greedy: torch.Tensor  # (B, L) int64
    lengths: torch.Tensor  # (B,) each sample's own length
    prompt_lengths: torch.Tensor  # (B,)

    def rows(self, where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For target positions `where` (m,): which (B, m) are real (inside their sample), and which of those
        are on the answer (the position of a token the target wrote, or the prompt's last, which predicts the
        answer's first)."""
        real = where[None] < self.lengths[:, None]
        return real, real & (where[None] >= self.prompt_lengths[:, None] - 1)


def collate(samples: list[Sample], device, dtype: torch.dtype) -> Batch:
    """One Batch of `samples`, on `device`, features and final states in `dtype` (the head's precision)."""
    length = max(len(sample.tokens) for sample in samples)

    def pad(tensors, fill_dtype):
        out = torch.zeros((len(tensors), length) + tuple(tensors[0].shape[1:]), dtype=fill_dtype)
        for row, tensor in enumerate(tensors):
            out[row, :len(tensor)] = tensor
        return out.to(device)

    return Batch(tokens=pad([s.tokens for s in samples], torch.int64),
                 features=pad([s.features for s in samples], dtype),
                 final=pad([s.final for s in samples], dtype),
                 greedy=pad([s.greedy for s in samples], torch.int64),
                 lengths=torch.tensor([len(s.tokens) for s in samples], device=device),
                 prompt_lengths=torch.tensor([s.prompt_length for s in samples], device=device))


def length_groups(samples: list[Sample], size: int) -> list[list[int]]:
    """The samples' indices in groups of at most `size`, samples of similar length together (less padding)."""
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i].tokens), i))
    size = max(1, size)
    return [order[start:start + size] for start in range(0, len(order), size)]


class Objective(Protocol):
    module: nn.Module  # its parameters train; its state is what a checkpoint holds

    def loss_and_hits(self, batch: Batch, evaluating: bool) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """(the batch's loss, per position (hits, positions)); `evaluating`: with the hits, as served (e.g.
        over the whole vocabulary where training reads the draft vocabulary only); training gets none."""
        ...

    def finish(self) -> nn.Module:
        """The trained head, ready for save_head."""
        ...


class DraftVocabulary:
    """What training reads of the target over the draft vocabulary: its ids (V_d,) ascending, the target's
    lm_head rows of them (V_d, h) in the head's precision, and which target ids it holds (V,) bool."""

    def __init__(self, target_head: torch.Tensor, draft_ids: torch.Tensor, device, dtype: torch.dtype):
        self.ids = draft_ids.to(device)
        self.rows = target_head.to(device=device, dtype=dtype)[self.ids]
        self.holds = torch.zeros(len(target_head), dtype=torch.bool, device=device)
        self.holds[self.ids] = True

    @torch.no_grad()
    def target(self, final: torch.Tensor) -> torch.Tensor:
        """The target's distribution over the draft vocabulary at the positions whose final hidden states are
        `final` (..., h) -> (..., V_d)."""
        return torch.softmax(final @ self.rows.T, dim=-1)

    @staticmethod
    def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """logits (m, V_d) against the target's distributions `target` (m, V_d) -> (m,)."""
        return -(target * torch.log_softmax(logits, dim=-1)).sum(-1)


class StepLosses:
    """A batch's loss: each drafted position's mean loss (over the batch's positions) weighted STEP_WEIGHT^j,
    over the positions that had any."""

    def __init__(self):
        self.total, self.weight = 0.0, 0.0

    def add(self, j: int, losses: torch.Tensor) -> None:
        if losses.numel():
            self.total = self.total + STEP_WEIGHT ** j * losses.mean()
            self.weight += STEP_WEIGHT ** j

    def value(self):
        return self.total / max(self.weight, 1e-9)


def answer_hits(picked: torch.Tensor, expected: torch.Tensor, on_answer: torch.Tensor) -> tuple[int, int]:
    """(hits, positions) over the answer: `picked` (n,) target ids drafted, `expected` (n,) the target's
    greedy tokens there, `on_answer` (n,) which positions count."""
    return int(((picked == expected) & on_answer).sum()), int(on_answer.sum())


EVAL_BATCH = 8  # samples per held-out batch, whatever the training's (the held-out loss is a mean over batches)


def train(objective: Objective, samples: list[Sample], held_out: list[Sample], *, epochs: int, lr: float, out: Path,
          device, batch_size: int = 1, log=print, checkpoint_every_s: float = 60.0,
          autocast: torch.dtype | None = None) -> dict:
    """Train `objective.module` in place, `batch_size` samples per step (resuming from out/checkpoint.pt when
    it is there); returns the last held-out figures {"loss", "alpha": [per position], "loss_before": the
    held-out loss at the start}. `autocast`: the forward and backward under torch.autocast to that dtype
    (parameters, optimizer and the held-out figures stay in the module's precision)."""
    module = objective.module
    dtype = _precision(module)
    trainable = [p for name, p in module.named_parameters() if p.requires_grad and "rotary." not in name]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    groups = length_groups(samples, batch_size)
    checkpoint = out / "checkpoint.pt"
    epoch, index = 0, 0
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=device, weights_only=True)
        if state.get("batch_size", 1) != batch_size:
            raise SystemExit(f"{checkpoint} was written training {state.get('batch_size', 1)} samples per step; "
                             f"resume it with --batch {state.get('batch_size', 1)} (or start in another --out)")
        module.load_state_dict(state["head"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        epoch, index = state["epoch"], state["index"]
        log(f"resuming at epoch {epoch + 1}, batch {index}")
    total_steps, start = max(epochs * len(groups), 1), epoch * len(groups) + index
    # Cosine decay over the whole run (a resumed run picks the curve up where it was)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda done: 0.5 * (1 + math.cos(math.pi * min((start + done) / total_steps, 1.0))))

    def save():
        torch.save({"head": module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "index": index,
                    "batch_size": batch_size}, checkpoint)

    figures = before = evaluate(objective, held_out, device)
    log(f"before training: held-out loss {figures['loss']:.3f}, α per position {_alphas(figures)}")
    last_save = time.monotonic()
    while epoch < epochs:
        module.train()
        running, trained = 0.0, 0
        started = time.monotonic()
        order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(epoch))  # so a resume sees it
        tokens_now = 0  # trained in this run of the epoch (a resumed one counts from where it resumed)
        while index < len(groups):
            batch = collate([samples[i] for i in groups[int(order[index])]], device, dtype)
            tokens_now += sum(len(samples[i].tokens) for i in groups[int(order[index])])
            with torch.autocast(torch.device(device).type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss, _ = objective.loss_and_hits(batch, evaluating=False)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 0.5)
            optimizer.step()
            schedule.step()
            running += float(loss.detach())
            trained += 1
            index += 1
            if time.monotonic() - last_save > checkpoint_every_s:
                save()
                last_save = time.monotonic()
                log(f"epoch {epoch + 1}/{epochs}: {index}/{len(groups)} steps, train loss "
                    f"{running / max(trained, 1):.3f}, {tokens_now / max(last_save - started, 1e-9):.0f} tokens/s")
        seconds = time.monotonic() - started
        figures = evaluate(objective, held_out, device)
        tokens = sum(len(samples[i].tokens) for group in groups for i in group)
        log(f"epoch {epoch + 1}/{epochs}: train loss {running / max(trained, 1):.3f}, held-out loss "
            f"{figures['loss']:.3f}, α per position {_alphas(figures)} ({seconds:.1f} s, "
            f"{tokens / max(seconds, 1e-9):.0f} tokens/s)")
        epoch, index = epoch + 1, 0
        save()
    return {**figures, "loss_before": before["loss"]}


def _precision(module: nn.Module) -> torch.dtype:
    return next(p.dtype for p in module.parameters() if p.is_floating_point())


def _alphas(figures: dict) -> str:
    return " ".join(f"{alpha:.2f}" for alpha in figures["alpha"])


@torch.no_grad()
def evaluate(objective: Objective, samples: list[Sample], device="cpu") -> dict:
    """Held-out loss (the mean of its batches') and α per drafted position (hits over positions, summed over
    the samples)."""
    objective.module.eval()
    dtype = _precision(objective.module)
    losses, hits, counts = [], [], []
    for group in length_groups(samples, EVAL_BATCH):
        loss, per_position = objective.loss_and_hits(collate([samples[i] for i in group], device, dtype),
                                                     evaluating=True)
        losses.append(float(loss))
        for j, (hit, count) in enumerate(per_position):
            if j == len(hits):
                hits.append(0)
                counts.append(0)
            hits[j] += hit
            counts[j] += count
    return {"loss": sum(losses) / max(len(losses), 1),
            "alpha": [hit / count if count else 0.0 for hit, count in zip(hits, counts)]}
