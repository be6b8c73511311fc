"""Training an EAGLE-3 head with its training-time test: the head unrolled on its own outputs.

Entry i of a sample pairs the target's features at position i with token i + 1 and predicts token i + 2.
Step 0 runs every entry from the target's features (causal attention over the entries). Step j runs
entry i + j of the chain started at i on the head's own output of step j - 1 (as drafting does after its
first token), attending to step 0's entries up to i and to the chain's own rows of steps 1..j: the
diagonal mask of EAGLE-3's training. Loss: cross-entropy against the target's distribution over the draft
vocabulary (its logits there: the lm_head rows of those tokens times its final hidden state), step j
weighted 0.8^j, on positions whose target argmax the draft vocabulary holds.

Shapes: E entries (the sample's length - 1), h hidden, H heads x D, F the features' width.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specdec.engine.draft_heads import EagleHead
from specdec.train.data import Sample

STEP_WEIGHT = 0.8


def _attend(attn, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Step j's attention for every chain. q (H, E, D); keys[0]/values[0] (KV, E, D) are step 0's entries
    (chain i sees columns <= i), keys[s] the chains' own rows of step s (chain i sees row i). -> (E, H x D)."""
    groups = attn.heads // attn.kv_heads
    expand = [k.repeat_interleave(groups, 0) for k in keys]
    expand_v = [v.repeat_interleave(groups, 0) for v in values]
    scale = 1.0 / math.sqrt(attn.head_dim)
    entries = q.shape[1]
    scores = [q @ expand[0].transpose(1, 2) * scale]  # (H, E, E)
    causal = torch.ones(entries, entries, dtype=torch.bool, device=q.device).tril()
    scores[0] = scores[0].masked_fill(~causal, float("-inf"))
    scores += [(q * k).sum(-1, keepdim=True) * scale for k in expand[1:]]  # (H, E, 1) each
    weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = weights[..., :entries] @ expand_v[0]
    for s, v in enumerate(expand_v[1:], start=1):
        out = out + weights[..., entries + s - 1:entries + s] * v
    return out.transpose(0, 1).reshape(entries, -1)


def unrolled(head: EagleHead, sample: Sample, steps: int, device) -> list[torch.Tensor]:
    """Per step j, the head's logits over its draft vocabulary (E - j, V_draft) of entries j.. E - 1
    (chains 0.. E - 1 - j)."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    tokens = sample.tokens.to(device)
    features = sample.features.to(device)
    entries = len(tokens) - 1
    hidden = head.fc(features[:entries])  # (E, h)
    keys, values, out = [], [], []
    for j in range(steps):
        count = entries - j  # chains whose step-j row exists
        if count <= 0:
            break
        ids = tokens[j + 1:j + 1 + count]  # entry i + j reads token i + j + 1
        embeds = nn.functional.embedding(ids, head.embed).to(hidden.dtype)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden[:count])], dim=-1)
        positions = torch.arange(j, j + count, device=device)
        cos, sin = head.rotary(hidden, positions[None])
        q = attn.q_proj(x).view(count, attn.heads, attn.head_dim).transpose(0, 1)
        k = attn.k_proj(x).view(count, attn.kv_heads, attn.head_dim).transpose(0, 1)
        v = attn.v_proj(x).view(count, attn.kv_heads, attn.head_dim).transpose(0, 1)
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        q, k = q[0], k[0]
        keys = [key[:, :count] for key in keys] + [k]
        values = [value[:, :count] for value in values] + [v]
        h = attn.o_proj(_attend(attn, q, keys, values))
        x1 = hidden[:count] + h
        hidden = x1 + layer.mlp(layer.post_attention_layernorm(x1))  # the next step's input (pre-norm)
        out.append(head.lm_head(head.norm(hidden)))
    return out


def loss_and_hits(head: EagleHead, sample: Sample, steps: int, target_rows: torch.Tensor, draft_ids: torch.Tensor,
                  in_draft: torch.Tensor, device) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The weighted loss of one sample, and per step (hits, positions) of greedy agreement on its answer
    (the head's argmax, in target ids, against the target's greedy token)."""
    logits = unrolled(head, sample, steps, device)
    final = sample.final.to(device)
    greedy = sample.greedy.to(device)
    total, weight_sum, hits = 0.0, 0.0, []
    for j, step_logits in enumerate(logits):
        count = step_logits.shape[0]
        # step j's row of chain i is entry i + j: it predicts token i + j + 2, the target's at position i + j + 1
        where = torch.arange(j + 1, j + 1 + count, device=device)
        target = torch.softmax(final[where] @ target_rows.T, dim=-1)  # (count, V_draft)
        mask = in_draft[greedy[where]]
        step_loss = -(target * torch.log_softmax(step_logits, dim=-1)).sum(-1)
        if mask.any():
            total = total + STEP_WEIGHT ** j * step_loss[mask].mean()
            weight_sum += STEP_WEIGHT ** j
        answer = where >= sample.prompt_length - 1
        picked = draft_ids[step_logits.argmax(-1)]
        hits.append((int(((picked == greedy[where]) & answer).sum()), int(answer.sum())))
    return total / max(weight_sum, 1e-9), hits


def train(head: EagleHead, samples: list[Sample], held_out: list[Sample], target_head: torch.Tensor, *,
          epochs: int, steps: int, lr: float, out: Path, device, log=print, checkpoint_every_s: float = 60.0) -> dict:
    """Train `head` in place (resuming from out/checkpoint.pt when it is there); returns the last
    held-out figures {"loss", "alpha": [per step], "loss_before": the held-out loss at the start}."""
    draft_ids = torch.arange(len(head.d2t), device=device) + head.d2t.to(device)  # draft id -> target id
    target_rows = target_head.to(device)[draft_ids].float()
    in_draft = head.t2d.to(device)
    trainable = [p for name, p in head.named_parameters() if not name.startswith("rotary.")]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    checkpoint = out / "checkpoint.pt"
    epoch, index = 0, 0
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=device, weights_only=True)
        head.load_state_dict(state["head"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        epoch, index = state["epoch"], state["index"]
        log(f"resuming at epoch {epoch + 1}, sample {index}")
    total_steps, start = max(epochs * len(samples), 1), epoch * len(samples) + index
    # Cosine decay over the whole run (a resumed run picks the curve up where it was)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda done: 0.5 * (1 + math.cos(math.pi * min((start + done) / total_steps, 1.0))))

    def save():
        torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "index": index},
                   checkpoint)

    figures = before = evaluate(head, held_out, steps, target_rows, draft_ids, in_draft, device)
    log(f"before training: held-out loss {figures['loss']:.3f}, α per step {_alphas(figures)}")
    last_save = time.monotonic()
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0))
    while epoch < epochs:
        head.train()
        running = 0.0
        started = time.monotonic()
        while index < len(samples):
            loss, _ = loss_and_hits(head, samples[int(order[index])], steps, target_rows, draft_ids, in_draft, device)
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
        head.eval()
        figures = evaluate(head, held_out, steps, target_rows, draft_ids, in_draft, device)
        log(f"epoch {epoch + 1}/{epochs}: train loss {running / max(len(samples), 1):.3f}, held-out loss "
            f"{figures['loss']:.3f}, α per step {_alphas(figures)} ({time.monotonic() - started:.1f} s)")
        epoch, index = epoch + 1, 0
        save()
    return {**figures, "loss_before": before["loss"]}


def _alphas(figures: dict) -> str:
    return " ".join(f"{alpha:.2f}" for alpha in figures["alpha"])


@torch.no_grad()
def evaluate(head: EagleHead, samples: list[Sample], steps: int, target_rows, draft_ids, in_draft, device) -> dict:
    """Held-out loss and greedy agreement per unrolled step (step j: the head's (j+1)-th drafted token
    agreeing with the target, the earlier ones having agreed: α per position)."""
    head.eval()
    losses, hits, counts = [], [0] * steps, [0] * steps
    for sample in samples:
        loss, per_step = loss_and_hits(head, sample, steps, target_rows, draft_ids, in_draft, device)
        losses.append(float(loss))
        for j, (hit, count) in enumerate(per_step):
            hits[j] += hit
            counts[j] += count
    return {"loss": sum(losses) / max(len(losses), 1),
            "alpha": [hit / count if count else 0.0 for hit, count in zip(hits, counts)]}
