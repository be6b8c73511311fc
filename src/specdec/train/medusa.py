"""Training Medusa heads by self-distillation: head j reads the target's last hidden state at position t (after
its final norm) and learns the target's distribution of token t + j + 2.

Each head starts as Medusa's authors start it: its residual blocks zero (the identity) and its output layer a
copy of the target's lm_head, so an untrained head j proposes the target's own next token. Training reads
the draft vocabulary only (the most frequent tokens, as EAGLE-3's does): the rows of those tokens train as
one (N, V_d, h) parameter and are written back into the full output layers at the end; every other row
stays the target's. Loss: cross-entropy against the target's distribution over the draft vocabulary, head j
weighted 0.8^j (trainer.STEP_WEIGHT), on positions whose target argmax the draft vocabulary holds.

Shapes: B samples, L the batch's padded length (trainer.Batch), h hidden, N heads, V the target's vocabulary,
V_d the draft vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.engine.draft_heads import MedusaHeads
from specdec.train.trainer import Batch, DraftVocabulary, StepLosses, answer_hits


def start_from_target(heads: MedusaHeads, target_head: torch.Tensor) -> None:
    """Medusa's initialisation: residual blocks zero, each output layer the target's lm_head (V, h)."""
    with torch.no_grad():
        for head in heads.heads:
            for block in head[:-1]:
                block.linear.weight.zero_()
                block.linear.bias.zero_()
            head[-1].weight.copy_(target_head)


class MedusaTraining(nn.Module):
    """The trainable part of `heads`: their residual blocks (shared, trained in place) and the draft
    vocabulary's rows of their output layers (a parameter of its own; `finish` writes it back)."""

    def __init__(self, heads: MedusaHeads, draft_ids: torch.Tensor):
        super().__init__()
        self.heads = [heads]  # a list: not a submodule, so the (N, V, h) output layers are not optimised
        self.blocks = nn.ModuleList([nn.Sequential(*head[:-1]) for head in heads.heads])
        self.register_buffer("draft_ids", draft_ids.clone())
        self.rows = nn.Parameter(torch.stack([head[-1].weight.detach()[draft_ids] for head in heads.heads]))

    @torch.no_grad()
    def finish(self) -> MedusaHeads:
        heads = self.heads[0]
        for j, head in enumerate(heads.heads):
            head[-1].weight[self.draft_ids] = self.rows[j].to(head[-1].weight.dtype)
        return heads


class MedusaObjective:
    """What Medusa heads train on (trainer.Objective). `target_head` (V, h): the target's lm_head."""

    def __init__(self, heads: MedusaHeads, target_head: torch.Tensor, draft_ids: torch.Tensor, device):
        self.module = MedusaTraining(heads, draft_ids).to(device)
        self.device = device
        self.vocab = DraftVocabulary(target_head, draft_ids, device, self.module.rows.dtype)

    def finish(self) -> MedusaHeads:
        return self.module.finish()

    def loss_and_hits(self, batch: Batch, evaluating: bool) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The weighted loss of a batch and when evaluating per head (hits, positions): head j's argmax as
        served (over the whole vocabulary) against the target's greedy token t + j + 2, over the answers'
        positions (every position, as the EAGLE objective's unrolled steps count them)."""
        final, length = batch.final, batch.final.shape[1]
        target = self.vocab.target(final)  # (B, L, V_d): once for every head
        losses, hits = StepLosses(), []
        for j, block in enumerate(self.module.blocks):
            count = length - 1 - j  # positions t whose token t + j + 2 the longest sample holds
            if count <= 0:
                break
            where = torch.arange(j + 1, j + 1 + count, device=self.device)  # the target's position t + j + 1
            real, on_answer = batch.rows(where)
            x = block(final[:, :count][real])  # (n, h)
            logits = x @ self.module.rows[j].T  # (n, V_d)
            greedy = batch.greedy[:, where][real]
            step_loss = self.vocab.cross_entropy(logits, target[:, where][real])
            losses.add(j, step_loss[self.vocab.holds[greedy]])
            if evaluating:  # served: every row of the output layer, the draft vocabulary's trained ones
                full = x @ self.module.heads[0].heads[j][-1].weight.T
                full[:, self.vocab.ids] = logits
                hits.append(answer_hits(full.argmax(-1), greedy, on_answer[real]))
        return losses.value(), hits
