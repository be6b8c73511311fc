"""Train an EAGLE-3 draft head for a target: `python -m specdec.train --target DIR --out DIR`.

The target answers the shipped prompts itself (self-distillation, its chat template on), its features are
computed in process, the draft vocabulary is the answers' most frequent tokens, and the head trains with
its training-time test (train/eagle3.py), showing the held-out loss and greedy agreement per drafted
position after every epoch. The run checkpoints into --out (data.pt: the answered samples;
checkpoint.pt: the head and the optimizer, at least every minute) and resumes from there when started
again with the same --out. The result is written in the published EAGLE-3 layout (config.json,
model.safetensors), which `--draft-head DIR` serves and vLLM and SGLang load.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def log(message: str) -> None:
    print(f"[train] {message}", file=sys.stderr, flush=True)


def parse_args(argv):
    from specdec.train.data import PROMPTS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="the target: a transformers directory in safetensors")
    parser.add_argument("--out", required=True, help="where the head, its data and checkpoints go")
    parser.add_argument("--prompts", default=str(PROMPTS), help="prompts, JSON lines with a \"prompt\" field")
    parser.add_argument("--max-prompts", type=int, default=0, help="use the first N prompts (0: all)")
    parser.add_argument("--held-out", type=float, default=0.1, help="the share of prompts kept for evaluation")
    parser.add_argument("--answer-tokens", type=int, default=128, help="tokens of each answer the target writes")
    parser.add_argument("--sampled-answers", type=int, default=0,
                        help="answers per training prompt drawn at --temperature besides the greedy one")
    parser.add_argument("--temperature", type=float, default=0.8, help="of the sampled answers")
    parser.add_argument("--answer-batch", type=int, default=32, help="answers generated together")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="the head's vocabulary (most frequent tokens)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4, help="training-time test: unrolled draft steps")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--aux-layers", default="",
                        help="target layers read (comma-separated, the output of each); default: 2, N/2, N-3 entering")
    parser.add_argument("--no-chat-template", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.engine.draft_heads import EAGLE3, HeadConfig, random_head, save_head
    from specdec.train import data, eagle3

    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    # The target in float32 (bfloat16 on a GPU): features and distributions are the served model's
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    aux = tuple(int(x) for x in args.aux_layers.split(",") if x.strip())
    text = model.config.get_text_config()
    layers = HeadConfig(EAGLE3, text.hidden_size, text.vocab_size, aux_layers=aux).feature_layers(text.num_hidden_layers)
    cached = out / "data.pt"
    if cached.exists():
        saved = torch.load(cached, weights_only=False)
        samples, held_out = saved["train"], saved["held_out"]
        log(f"{len(samples)} + {len(held_out)} answered samples from {cached}")
    else:
        prompts = data.load_prompts(args.prompts)
        if args.max_prompts:
            prompts = prompts[:args.max_prompts]
        kept = max(1, round(len(prompts) * args.held_out))
        log(f"the target answers {len(prompts)} prompts ({kept} held out; {1 + args.sampled_answers} answers to each "
            f"other), up to {args.answer_tokens} tokens each; "
            f"features of layers {list(layers)}")
        # Held-out prompts get their greedy answer only: acceptance is measured on what greedy serving sees
        answer = lambda some, sampled: data.answer_and_featurize(  # noqa: E731
            model, tokenizer, some, layers, args.answer_tokens, chat_template=not args.no_chat_template,
            batch=args.answer_batch, sampled=sampled, temperature=args.temperature, seed=args.seed, log=log)
        samples = answer(prompts[:-kept], args.sampled_answers)
        held_out = answer(prompts[-kept:], 0)
        torch.save({"train": samples, "held_out": held_out}, cached)
        log(f"answered in {time.monotonic() - started:.0f} s")
    vocab_size = model.config.get_text_config().vocab_size
    draft_ids = data.draft_vocabulary(samples, vocab_size, args.draft_vocab)
    embed, target_head = model.get_input_embeddings().weight.detach().float(), model.get_output_embeddings().weight.detach().float()
    head = random_head(EAGLE3, model.config, seed=args.seed, draft_vocab_size=len(draft_ids), aux_layers=aux)
    with torch.no_grad():
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
        # A warm start: the head's output is read like the target's final hidden state
        head.lm_head.weight.copy_(target_head[draft_ids].cpu())
        head.norm.weight.copy_(model.model.norm.weight.detach().float().cpu())
    head = head.to(device)
    head.attach(embed, None)
    figures = eagle3.train(head, samples, held_out, target_head, epochs=args.epochs, steps=args.steps, lr=args.lr,
                           out=out, device=device, log=log)
    save_head(head, out)
    (out / "training.json").write_text(json.dumps({
        "target": str(Path(args.target).resolve()), "samples": len(samples), "held_out": len(held_out),
        "tokens": sum(len(s.tokens) for s in samples), "epochs": args.epochs, "steps": args.steps,
        "draft_vocab": len(draft_ids), "device": str(device), "seconds": round(time.monotonic() - started, 1),
        "held_out_loss_before": figures["loss_before"], "held_out_loss": figures["loss"],
        "held_out_alpha": figures["alpha"]}, indent=2) + "\n")
    log(f"wrote the EAGLE-3 head to {out} in {time.monotonic() - started:.0f} s: held-out α per drafted position "
        + " ".join(f"{a:.2f}" for a in figures["alpha"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
