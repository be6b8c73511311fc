"""The training loop every head kind shares: AdamW with a cosine decay over the whole run, gradient clipping,
held-out figures after every epoch, checkpoints at least every minute and a resumed run picking up where it
stopped (epoch, sample, optimizer state, the schedule's place).

What a kind trains is an `Objective`: the module whose parameters train, and per sample the loss and, per
drafted position j, (hits, positions): how often the head's j-th drafted token would be the target's greedy
one, the earlier ones having been (α per position, on the sample's answer).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from specdec.train.data import Sample


STEP_WEIGHT = 0.8  # drafted position j's loss weighs 0.8^j (EAGLE-3's training-time test)


class Objective(Protocol):
    module: nn.Module  # its parameters train; its state is what a checkpoint holds

    def loss_and_hits(self, sample: Sample, evaluating: bool) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """(the sample's loss, per position (hits, positions)); `evaluating`: the hits as served (e.g. over
        the whole vocabulary where training reads the draft vocabulary only)."""
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

    def cross_entropy(self, logits: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
        """logits (m, V_d) against the target's distribution over the draft vocabulary at the positions whose
        final hidden states are `final` (m, h) -> (m,)."""
        target = torch.softmax(final @ self.rows.T, dim=-1)
        return -(target * torch.log_softmax(logits, dim=-1)).sum(-1)


class StepLosses:
    """A sample's loss: each drafted position's mean loss weighted STEP_WEIGHT^j, over the positions that
    had any."""

    def __init__(self):
        self.total, self.weight = 0.0, 0.0

    def add(self, j: int, losses: torch.Tensor) -> None:
        if losses.numel():
            self.total = self.total + STEP_WEIGHT ** j * losses.mean()
            self.weight += STEP_WEIGHT ** j

    def value(self):
        return self.total / max(self.weight, 1e-9)


def answer_hits(picked: torch.Tensor, greedy: torch.Tensor, where: torch.Tensor, prompt_length: int
                ) -> tuple[int, int]:
    """(hits, positions) over the answer: `picked` (m,) target ids drafted for the tokens following
    positions `where` (m,), against the target's greedy tokens there."""
    answer = where >= prompt_length - 1
    return int(((picked == greedy[where]) & answer).sum()), int(answer.sum())


def train(objective: Objective, samples: list[Sample], held_out: list[Sample], *, epochs: int, lr: float, out: Path,
          device, log=print, checkpoint_every_s: float = 60.0, autocast: torch.dtype | None = None) -> dict:
    """Train `objective.module` in place (resuming from out/checkpoint.pt when it is there); returns the last
    held-out figures {"loss", "alpha": [per position], "loss_before": the held-out loss at the start}.
    `autocast`: the forward and backward under torch.autocast to that dtype (parameters, optimizer and the
    held-out figures stay in the module's precision)."""
    module = objective.module
    trainable = [p for name, p in module.named_parameters() if p.requires_grad and "rotary." not in name]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    checkpoint = out / "checkpoint.pt"
    epoch, index = 0, 0
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=device, weights_only=True)
        module.load_state_dict(state["head"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        epoch, index = state["epoch"], state["index"]
        log(f"resuming at epoch {epoch + 1}, sample {index}")
    total_steps, start = max(epochs * len(samples), 1), epoch * len(samples) + index
    # Cosine decay over the whole run (a resumed run picks the curve up where it was)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda done: 0.5 * (1 + math.cos(math.pi * min((start + done) / total_steps, 1.0))))

    def save():
        torch.save({"head": module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "index": index},
                   checkpoint)

    figures = before = evaluate(objective, held_out)
    log(f"before training: held-out loss {figures['loss']:.3f}, α per position {_alphas(figures)}")
    last_save = time.monotonic()
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0))
    while epoch < epochs:
        module.train()
        running = 0.0
        started = time.monotonic()
        while index < len(samples):
            with torch.autocast(torch.device(device).type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss, _ = objective.loss_and_hits(samples[int(order[index])], evaluating=False)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 0.5)
            optimizer.step()
            schedule.step()
            running += float(loss.detach())
            index += 1
            if time.monotonic() - last_save > checkpoint_every_s:
                save()
                last_save = time.monotonic()
        figures = evaluate(objective, held_out)
        log(f"epoch {epoch + 1}/{epochs}: train loss {running / max(len(samples), 1):.3f}, held-out loss "
            f"{figures['loss']:.3f}, α per position {_alphas(figures)} ({time.monotonic() - started:.1f} s)")
        epoch, index = epoch + 1, 0
        save()
    return {**figures, "loss_before": before["loss"]}


def _alphas(figures: dict) -> str:
    return " ".join(f"{alpha:.2f}" for alpha in figures["alpha"])


@torch.no_grad()
def evaluate(objective: Objective, samples: list[Sample]) -> dict:
    """Held-out loss and α per drafted position (hits over positions, summed over the samples)."""
    objective.module.eval()
    losses, hits, counts = [], [], []
    for sample in samples:
        loss, per_position = objective.loss_and_hits(sample, evaluating=True)
        losses.append(float(loss))
        for j, (hit, count) in enumerate(per_position):
            if j == len(hits):
                hits.append(0)
                counts.append(0)
            hits[j] += hit
            counts[j] += count
    return {"loss": sum(losses) / max(len(losses), 1),
            "alpha": [hit / count if count else 0.0 for hit, count in zip(hits, counts)]}
