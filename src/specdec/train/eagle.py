"""Training EAGLE-1 and EAGLE-3 heads with their training-time test: the head unrolled on its own outputs.

Entry i of a sample pairs the target's feature at position i with token i + 1 and predicts token i + 2
(EAGLE-3's feature: fc over the target's auxiliary states; EAGLE-1's: the target's last hidden state after
its final norm). Step 0 runs every entry from the target's features (causal attention over the entries).
Step j runs entry i + j of the chain started at i on the head's own output of step j - 1 (as drafting does
after its first token), attending to step 0's entries up to i and to the chain's own rows of steps 1..j: the
diagonal mask of EAGLE-3's training (HASS and EAGLE-3 train EAGLE-1's recurrence the same way). Loss:
cross-entropy against the target's distribution over the draft vocabulary (its logits there: the lm_head
rows of those tokens times its final hidden state), on positions whose target argmax the draft vocabulary
holds; EAGLE-1 adds its feature regression (smooth L1 between the head's output and the target's feature
at the next position, the cross-entropy weighted 0.1, as EAGLE's paper trains it). Step j weighted 0.8^j.

Samples train in batches padded on the right (trainer.Batch); padded rows are computed and left out.

Shapes: B samples, E entries (the batch's padded length - 1), h hidden, H heads x D, F the features' width,
V_d the draft vocabulary.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from specdec.engine.draft_heads import EAGLE3, EagleHead
from specdec.engine.llama_model import rotate
from specdec.train.trainer import Batch, DraftVocabulary, StepLosses, answer_hits

EAGLE1_LOGITS_WEIGHT = 0.1  # EAGLE's w_cls: its loss is mostly the feature regression


def _attend(attn, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Step j's attention for every chain. q (B, H, E, D); keys[0]/values[0] (B, KV, E, D) are step 0's
    entries (chain i sees columns <= i), keys[s] the chains' own rows of step s (chain i sees row i).
    -> (B, E, H x D)."""
    groups = attn.heads // attn.kv_heads
    expand = [k.repeat_interleave(groups, 1) for k in keys]
    expand_v = [v.repeat_interleave(groups, 1) for v in values]
    scale = 1.0 / math.sqrt(attn.head_dim)
    entries = q.shape[2]
    scores = [q @ expand[0].transpose(-1, -2) * scale]  # (B, H, E, E)
    causal = torch.ones(entries, entries, dtype=torch.bool, device=q.device).tril()
    scores[0] = scores[0].masked_fill(~causal, float("-inf"))
    scores += [(q * k).sum(-1, keepdim=True) * scale for k in expand[1:]]  # (B, H, E, 1) each
    weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = weights[..., :entries] @ expand_v[0]
    for s, v in enumerate(expand_v[1:], start=1):
        out = out + weights[..., entries + s - 1:entries + s] * v
    return out.transpose(1, 2).reshape(q.shape[0], entries, -1)


def unrolled(head: EagleHead, batch: Batch, steps: int, device) -> list[torch.Tensor]:
    """Per step j, the head's output hidden states (B, E - j, h) of entries j.. E - 1 (chains 0.. E - 1 - j)
    of every sample of the batch (E: its padded length - 1; rows past a sample's own length are padding):
    EAGLE-3's pre-norm g (its logits: lm_head(norm(g))), EAGLE-1's feature (its logits: the target's lm_head
    times it)."""
    eagle3 = head.config.kind == EAGLE3
    layers = head.decoder_layers()
    first = layers[0]
    tokens = batch.tokens.to(device)
    entries = tokens.shape[1] - 1
    features = batch.features if eagle3 else batch.final
    hidden = head.from_target(features[:, :entries].to(device))  # EAGLE-1: the target's final states as they are
    keys, values = [[] for _ in layers], [[] for _ in layers]  # per layer, per step
    out = []
    for j in range(steps):
        count = entries - j  # chains whose step-j row exists
        if count <= 0:
            break
        ids = tokens[:, j + 1:j + 1 + count]  # entry i + j reads token i + j + 1
        embeds = nn.functional.embedding(ids, head.embed).to(hidden.dtype)
        if eagle3:
            normed = first.hidden_norm(hidden[:, :count])
            x = torch.cat([first.input_layernorm(embeds), normed], dim=-1)
            residual = head.residual(hidden[:, :count], normed)
        else:  # EAGLE-1: fc over [embed ‖ feature], no input norm
            x = residual = head.fc(torch.cat([embeds, hidden[:, :count]], dim=-1))
        positions = torch.arange(j, j + count, device=device)
        cos, sin = head.rotary(hidden, positions[None])
        for index, layer in enumerate(layers):
            if index:  # a plain layer over the previous one's output
                x, residual = layer.input_layernorm(hidden), hidden
            attn = layer.self_attn
            q, k, v = attn.project(x)  # (B, H or KV, count, D)
            q, k = rotate(q, k, cos, sin)
            keys[index] = [key[:, :, :count] for key in keys[index]] + [k]
            values[index] = [value[:, :, :count] for value in values[index]] + [v]
            x1 = residual + attn.o_proj(_attend(attn, q, keys[index], values[index]))
            hidden = x1 + layer.mlp(layer.post_attention_layernorm(x1))  # the next layer's or step's input
        out.append(hidden)
    return out


def grown(head: EagleHead, layers: int) -> EagleHead:
    """An EAGLE-3 head with plain decoder layers added after its own up to `layers`, each starting as the identity
    (its attention's and MLP's output projections zero, the rest drawn as a fresh head's): it drafts exactly as
    `head` until training moves them."""
    if head.config.kind != EAGLE3 or layers < head.config.num_layers:
        raise ValueError(f"an EAGLE-3 head grows plain layers: a {head.config.kind} head of "
                         f"{head.config.num_layers} to {layers}")
    parameter = next(head.parameters())
    bigger = EagleHead(dataclasses.replace(head.config, num_layers=layers)).to(device=parameter.device,
                                                                              dtype=parameter.dtype)
    missing, unexpected = bigger.load_state_dict(head.state_dict(), strict=False)
    assert not unexpected and all(key.startswith("layers.") for key in missing), (missing, unexpected)
    with torch.no_grad():
        for index in range(head.config.num_layers, layers):
            for name, weight in bigger.layers[str(index)].named_parameters():
                if "norm" in name:
                    continue
                weight.normal_(0.0, 0.5 / weight.shape[-1] ** 0.5)  # as random_head draws them
                if name in ("self_attn.o_proj.weight", "mlp.down_proj.weight") or name.endswith(".bias"):
                    weight.zero_()
    bigger.file_embed = head.file_embed
    if head.embed is not None:
        bigger.attach(head.embed, head.target_head)
    return bigger.train(head.training)


class EagleObjective:
    """What an EAGLE-1 or EAGLE-3 head trains on (trainer.Objective). `target_head` (V, h): the target's
    lm_head; `draft_ids` (V_d,) ascending target ids: the draft vocabulary (EAGLE-3's own head predicts
    these; EAGLE-1's loss reads the target's rows of them, its served logits every row)."""

    def __init__(self, head: EagleHead, steps: int, target_head: torch.Tensor, draft_ids: torch.Tensor, device):
        self.module, self.steps, self.device = head, steps, device
        self.eagle3 = head.config.kind == EAGLE3
        self.target_head = target_head.to(device=device, dtype=head.fc.weight.dtype)  # the head's precision
        self.vocab = DraftVocabulary(target_head, draft_ids, device, head.fc.weight.dtype)

    def finish(self) -> EagleHead:
        return self.module

    def loss_and_hits(self, batch: Batch, evaluating: bool) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The weighted loss of a batch, and when evaluating per step (hits, positions) of greedy agreement on
        its answers (the head's argmax as served, in target ids, against the target's greedy token)."""
        head = self.module
        target = self.vocab.target(batch.final)  # (B, L, V_d): once for every step
        losses, hits = StepLosses(), []
        for j, hidden in enumerate(unrolled(head, batch, self.steps, self.device)):
            # step j's row of chain i is entry i + j: it predicts token i + j + 2, the target's at position i + j + 1
            where = torch.arange(j + 1, j + 1 + hidden.shape[1], device=self.device)
            real, on_answer = batch.rows(where)
            hidden = hidden[real]  # (n, h): the real rows only
            greedy = batch.greedy[:, where][real]
            logits = head.lm_head(head.norm(hidden)) if self.eagle3 else hidden @ self.vocab.rows.T  # (n, V_d)
            step_loss = self.vocab.cross_entropy(logits, target[:, where][real])
            if self.eagle3:
                losses.add(j, step_loss[self.vocab.holds[greedy]])
            else:  # the feature is learnt at every position
                regression = nn.functional.smooth_l1_loss(hidden, batch.final[:, where][real], reduction="none")
                losses.add(j, EAGLE1_LOGITS_WEIGHT * step_loss + regression.mean(-1))
            if evaluating:  # served, EAGLE-1's logits are over the whole vocabulary
                picked = self.vocab.ids[logits.argmax(-1)] if self.eagle3 else (hidden @ self.target_head.T).argmax(-1)
                hits.append(answer_hits(picked, greedy, on_answer[real]))
        return losses.value(), hits
