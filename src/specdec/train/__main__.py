"""Train a draft head for a target: `python -m specdec.train --target DIR --out DIR [--kind eagle3|eagle|medusa]`.

The target answers the shipped prompts itself (self-distillation, its chat template on), its features are
computed in process, the draft vocabulary is the answers' most frequent tokens, and the head trains
(EAGLE-1 and EAGLE-3 with their training-time test, train/eagle.py; Medusa's heads, train/medusa.py),
showing the held-out loss and greedy agreement per drafted position after every epoch. The run checkpoints
into --out (data.pt: the answered samples; answers.jsonl.gz: their conversations without features, which
--answers trains on anywhere; features-*.pt: the features computed over each --answers file;
checkpoint.pt: the head and the optimizer, at least every minute) and resumes from there when started
again with the same --out. The result is written in the kind's
published layout (config.json and model.safetensors or medusa_lm_head.safetensors), which
`--draft-head DIR` serves and vLLM and SGLang load.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import time
from pathlib import Path

import torch


ANSWERS = "answers.jsonl.gz"  # every answering run's conversations, for --answers


def log(message: str) -> None:
    print(f"[train] {message}", file=sys.stderr, flush=True)


def parse_args(argv):
    from specdec.engine.draft_heads import EAGLE3, LAYOUTS, PUBLISHED, TRAINED
    from specdec.train.data import PROMPTS
    from specdec.train.writer import ENGINES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="the target: a transformers directory in safetensors")
    parser.add_argument("--out", required=True, help="where the head, its data and checkpoints go")
    parser.add_argument("--kind", choices=TRAINED, default=EAGLE3, help="the head's kind (default: eagle3)")
    parser.add_argument("--layout", choices=LAYOUTS, default=PUBLISHED,
                        help="the files written: EAGLE's authors' layout (default; vLLM, SGLang and this server "
                             "read it) or the speculators library's (an EAGLE head: vLLM serves it as it is, "
                             "the layer ids read as meant)")
    parser.add_argument("--medusa-heads", type=int, default=4, help="Medusa: heads (tokens drafted per round)")
    parser.add_argument("--prompts", action="append", default=[],
                        help="prompts: JSON lines or a JSON array of strings, {\"prompt\"}, OpenAI {\"messages\"} or "
                             "ShareGPT {\"conversations\"} records (their first user turn); given several times, "
                             f"every file's; default: the shipped set ({PROMPTS.name})")
    parser.add_argument("--self-prompts", type=int, default=0,
                        help="also N requests the target writes itself (Magpie: specdec.train.self_prompts), kept in "
                             "OUT/self_prompts.jsonl and held out in the same share")
    parser.add_argument("--exclude", action="append", default=[],
                        help="a prompt file (a benchmark's) whose runs of five words no self-written request may share")
    parser.add_argument("--data", action="append", default=[],
                        help="answered samples to train on (another run's data.pt; given several times, every set's; "
                             "default: OUT/data.pt, made when missing)")
    parser.add_argument("--answers", action="append", default=[],
                        help="answered conversations without features (another run's OUT/answers.jsonl.gz, or the "
                             "default pair's shipped sets, src/specdec/train/answers/): the target's features are "
                             "computed over them, nothing is answered; given several times, every file's; with "
                             "--data, both")
    parser.add_argument("--answers-only", action="store_true",
                        help="answer, write OUT/answers.jsonl.gz and stop: no features (about half the time on a CPU), no "
                             "data.pt, no training (train later with --answers)")
    parser.add_argument("--max-prompts", type=int, default=0, help="use the first N prompts (0: all)")
    parser.add_argument("--held-out", type=float, default=0.1, help="the share of prompts kept for evaluation")
    parser.add_argument("--answer-tokens", type=int, default=128, help="tokens of each answer the target writes")
    parser.add_argument("--sampled-answers", type=int, default=0,
                        help="answers per training prompt drawn at --temperature besides the greedy one")
    parser.add_argument("--temperature", type=float, default=0.8, help="of the sampled answers")
    parser.add_argument("--no-greedy-answers", action="store_true",
                        help="training prompts get their sampled answers only (a set to add with --data to one "
                             "that has the greedy ones)")
    parser.add_argument("--answer-batch", type=int, default=32, help="answers generated together")
    parser.add_argument("--answer-dtype", choices=("same", "bfloat16"), default="same",
                        help="the precision the answers are written in (bfloat16: several times faster on a CPU with "
                             "AMX); features and target distributions stay the served model's")
    parser.add_argument("--answer-engine", choices=ENGINES, default="auto",
                        help="what runs the target while it answers: the served executor (auto takes it where the "
                             "project's CPU kernels serve the model in --answer-dtype: float32 on a CPU) or "
                             "transformers' generate")
    parser.add_argument("--grounded", type=int, default=0,
                        help="grounded prompts made from the target's own answers (an instruction over one answer's "
                             "text: summarise, rewrite, answer from it), answered too; held out in the same share")
    parser.add_argument("--autocast", choices=("none", "bfloat16"), default="none",
                        help="train under autocast (bfloat16: ~1.5x faster on a CPU with AMX; the head is kept and "
                             "written in float32)")
    parser.add_argument("--batch", type=int, default=1,
                        help="samples per training step (of similar length, padded to one)")
    parser.add_argument("--store-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="what the answered features are kept in (data.pt; bfloat16 halves it)")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="the head's vocabulary (most frequent tokens)")
    parser.add_argument("--init", default="",
                        help="start from this trained head of the same kind (its weights and, EAGLE-3, its draft "
                             "vocabulary) instead of a fresh one: to train it on more text")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4, help="EAGLE's training-time test: unrolled draft steps")
    parser.add_argument("--head-layers", type=int, default=None,
                        help="EAGLE-3: the head's decoder layers (the first over 2h, plain ones after it), as the "
                             "speculators library's --num-layers; each costs a draft step about one more layer. "
                             "Default 1, or --init's; more than --init's adds layers that start as the identity")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--aux-layers", default="",
                        help="EAGLE-3: target layers read (comma-separated, the output of each); "
                             "default: 2, N/2, N-3 entering")
    parser.add_argument("--no-chat-template", action="store_true")
    parser.add_argument("--chat-template", default="", metavar="FILE_OR_TEMPLATE",
                        help="the chat template the server renders chats with (its --chat-template), replacing the "
                             "tokenizer's: the head learns the prompts as they will be served")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.decoding.text import read_chat_template

    from specdec.engine.draft_heads import EAGLE3, MEDUSA, SPECULATORS, HeadConfig, check_fits, load_head, save_head
    from specdec.train import data, trainer
    from specdec.train.eagle import grown
    from specdec.train.writer import choose as choose_writer

    if args.layout == SPECULATORS and args.kind == MEDUSA:
        raise SystemExit("--layout speculators holds EAGLE heads; a Medusa head is written as its authors do")
    if args.head_layers is not None and (args.head_layers < 1 or (args.head_layers > 1 and args.kind != EAGLE3)):
        raise SystemExit(f"--head-layers {args.head_layers}: EAGLE-3 heads have one or more decoder layers, "
                         f"{args.kind} heads one")
    try:  # before anything loads: a template that is not there fails at once
        template = read_chat_template(args.chat_template, "--chat-template") if args.chat_template else None
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    # The target in float32 (bfloat16 on a GPU): features and distributions are the served model's
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    if template:
        tokenizer.chat_template = template
    aux = tuple(int(x) for x in args.aux_layers.split(",") if x.strip())
    text = model.config.get_text_config()
    # EAGLE-1 and Medusa read the target's last hidden state (every sample's `final`); the features kept are
    # EAGLE-3's, so one answered set (data.pt) trains every kind
    layers = HeadConfig(EAGLE3, text.hidden_size, text.vocab_size, aux_layers=aux).feature_layers(text.num_hidden_layers)
    cached = out / "data.pt"
    if args.answers_only and (args.data or args.answers or cached.exists()):
        raise SystemExit(f"--answers-only answers prompts; it takes no --data, --answers or {cached}")
    if args.data or args.answers:
        samples, held_out = _load_sets([Path(path) for path in args.data], layers if args.kind == EAGLE3 else None)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        for path in args.answers:  # conversations without features: one forward over each, kept in OUT
            kept = _features_file(out, Path(path), layers, args.store_dtype, args.target)
            if kept.exists():  # a run started again (resumed): the features are already computed
                more, more_held = _load_sets([kept], None)
                log(f"{path}: {len(more)} + {len(more_held)} conversations, their features from {kept}")
            else:
                train_part, held_part = data.load_answers(path, tokenizer)
                log(f"{path}: {len(train_part)} + {len(held_part)} conversations; the target's features over them")
                more = data.featurize(model, train_part, layers, pad, getattr(torch, args.store_dtype), log)
                more_held = data.featurize(model, held_part, layers, pad, getattr(torch, args.store_dtype), log)
                partial = kept.with_suffix(".partial")
                torch.save({"train": more, "held_out": more_held, "layers": list(layers)}, partial)
                partial.replace(kept)  # whole or absent: a run cut off while writing computes them again
            samples += more
            held_out += more_held
        held_out = list({tuple(s.tokens.tolist()): s for s in held_out}.values())  # two sets' shared one once
        log(f"{len(samples)} + {len(held_out)} answered samples from {', '.join(args.data + args.answers)}")
    elif cached.exists():
        samples, held_out = _load_sets([cached], layers if args.kind == EAGLE3 else None)
        log(f"{len(samples)} + {len(held_out)} answered samples from {cached}")
    else:
        prompts = [p for path in args.prompts or [data.PROMPTS] for p in data.load_prompts(path)]
        if args.max_prompts:
            prompts = prompts[:args.max_prompts]
        writer = model if args.answer_dtype == "same" else copy.deepcopy(model).to(getattr(torch, args.answer_dtype))
        answering = choose_writer(args.answer_engine, args.target, writer.dtype, writer, log=log)
        # Each set keeps its own held-out share (its last prompts), so held-out figures cover both kinds
        sets = [prompts] + ([_self_prompts(args, writer, answering, tokenizer, out)] if args.self_prompts else [])
        held = [max(1, round(len(s) * args.held_out)) for s in sets]
        training_prompts = [p for s, k in zip(sets, held) for p in s[:-k]]
        held_prompts = [p for s, k in zip(sets, held) for p in s[-k:]]
        prompts, kept = training_prompts + held_prompts, len(held_prompts)
        answers = args.sampled_answers + (0 if args.no_greedy_answers else 1)
        log(f"the target answers {len(prompts)} prompts ({kept} held out; {answers} answers to each other), up to "
            f"{args.answer_tokens} tokens each; "
            f"features of layers {list(layers)}")
        # Held-out prompts get their greedy answer only: acceptance is measured on what greedy serving sees
        answer = lambda some, sampled, greedy: data.answer_and_featurize(  # noqa: E731
            model, tokenizer, some, layers, args.answer_tokens, chat_template=not args.no_chat_template,
            batch=args.answer_batch, sampled=sampled, temperature=args.temperature, seed=args.seed, log=log,
            writer=answering, store_dtype=getattr(torch, args.store_dtype), greedy=greedy,
            features=not args.answers_only)
        if args.no_greedy_answers and not args.sampled_answers:
            raise SystemExit("--no-greedy-answers needs --sampled-answers N (N >= 1)")
        samples = answer(prompts[:-kept], args.sampled_answers, not args.no_greedy_answers)
        held_out = answer(prompts[-kept:], 0, True)
        if args.grounded:
            kept_grounded = round(args.grounded * kept / len(prompts))
            log(f"the target answers {args.grounded} grounded prompts over its own answers ({kept_grounded} held out)")
            samples += answer(data.grounded_prompts(tokenizer, samples, args.grounded - kept_grounded, args.seed), 0, True)
            held_out += answer(data.grounded_prompts(tokenizer, held_out, kept_grounded, args.seed), 0, True)
        data.save_answers(out / ANSWERS, samples, held_out, tokenizer)
        if args.answers_only:
            log(f"answered in {time.monotonic() - started:.0f} s; the conversations are in {out / ANSWERS}")
            return 0
        torch.save({"train": samples, "held_out": held_out, "layers": list(layers)}, cached)
        log(f"answered in {time.monotonic() - started:.0f} s")
    vocab_size = model.config.get_text_config().vocab_size
    init = None
    if args.init:
        init = load_head(args.init)
        check_fits(init, model.config, args.init, args.target)
        if init.config.kind != args.kind or (args.kind == EAGLE3 and init.config.feature_layers(
                text.num_hidden_layers) != layers):
            raise SystemExit(f"--init {args.init}: a {init.config.kind} head reading layers "
                             f"{list(init.config.feature_layers(text.num_hidden_layers))}; this run trains a "
                             f"{args.kind} head reading {list(layers)} (--kind, --aux-layers)")
        log(f"starting from the {init.config.kind} head in {args.init}")
        if args.head_layers is not None and args.head_layers != init.config.num_layers:
            if args.head_layers < init.config.num_layers:
                raise SystemExit(f"--head-layers {args.head_layers}: the head in --init {args.init} has "
                                 f"{init.config.num_layers}; layers are added, not taken away")
            init = grown(init, args.head_layers)
            log(f"its decoder layers grown to {args.head_layers}: the new ones start as the identity")
    if init is not None and args.kind == EAGLE3:  # its reduced head predicts these
        draft_ids = init.draft_target_ids()
    else:
        draft_ids = data.draft_vocabulary(samples, vocab_size, args.draft_vocab)
    objective = _objective(args, model, draft_ids, aux, device, init)
    figures = trainer.train(objective, samples, held_out, epochs=args.epochs, lr=args.lr, out=out, device=device,
                            batch_size=args.batch, log=log, autocast=None if args.autocast == "none" else getattr(torch, args.autocast))
    save_head(objective.finish(), out, layout=args.layout, verifier=str(Path(args.target).resolve()),
              speculative_tokens=args.steps)
    (out / "training.json").write_text(json.dumps({
        "target": str(Path(args.target).resolve()), "samples": len(samples), "held_out": len(held_out),
        "kind": args.kind, "tokens": sum(len(s.tokens) for s in samples), "epochs": args.epochs,
        "batch": args.batch, "init": str(Path(args.init).resolve()) if args.init else None,
        "steps": args.medusa_heads if args.kind == MEDUSA else args.steps,
        "head_layers": None if args.kind == MEDUSA else objective.finish().config.num_layers,
        "draft_vocab": len(draft_ids), "device": str(device), "seconds": round(time.monotonic() - started, 1),
        "held_out_loss_before": figures["loss_before"], "held_out_loss": figures["loss"],
        "held_out_alpha": figures["alpha"]}, indent=2) + "\n")
    log(f"wrote the {args.kind} head to {out} in {time.monotonic() - started:.0f} s: held-out α per drafted position "
        + " ".join(f"{a:.2f}" for a in figures["alpha"]))
    return 0


def _self_prompts(args, model, writer, tokenizer, out: Path) -> list[str]:
    """--self-prompts N: the requests the target writes itself (OUT/self_prompts.jsonl, drawn once)."""
    from specdec.train import data, self_prompts

    path = out / "self_prompts.jsonl"
    if not path.exists():
        log(f"the target writes {args.self_prompts} requests of its own")
        selection = self_prompts.selection_for(tokenizer, args.exclude)
        drawn = self_prompts.draw(model, tokenizer, args.self_prompts, selection, seed=args.seed,
                                  batch=args.answer_batch, log=log, writer=writer)
        path.write_text("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in drawn))
    return data.load_prompts(path)


def _features_file(out: Path, answers: Path, layers: tuple[int, ...], store_dtype: str, target: str) -> Path:
    """Where a run keeps the features it computed over an answers file (`--answers`), so that starting it
    again (after an interruption: about an hour of this for the default pair's shipped answers on a 2-core
    CPU) reads them instead: named by what they depend on, the file's bytes, the layers, the precision kept
    and the target."""
    key = hashlib.sha256(answers.read_bytes())
    key.update(f"{list(layers)} {store_dtype} {Path(target).resolve()}".encode())
    return out / f"features-{answers.name.split('.')[0]}-{key.hexdigest()[:16]}.pt"


def _load_sets(paths: list[Path], layers: tuple[int, ...] | None) -> tuple[list, list]:
    """The training and held-out samples of every answered set (data.pt) in `paths`, together; a held-out
    conversation that two sets hold counts once. `layers`: the features an EAGLE-3 head reads, which each set
    must hold (None: any)."""
    samples, held_out, seen = [], [], set()
    for path in paths:
        saved = torch.load(path, weights_only=False)
        if layers is not None and saved.get("layers", list(layers)) != list(layers):
            raise SystemExit(f"{path} holds the features of layers {saved['layers']}; this EAGLE-3 head reads "
                             f"{list(layers)} (--aux-layers)")
        samples += saved["train"]
        for sample in saved["held_out"]:
            key = tuple(sample.tokens.tolist())
            if key not in seen:
                seen.add(key)
                held_out.append(sample)
    return samples, held_out


def _objective(args, model, draft_ids: torch.Tensor, aux: tuple[int, ...], device, init=None):
    """The trainer.Objective of `init` (a trained head of args.kind), or of a fresh head of args.kind for
    `model`, warm-started where its kind allows."""
    from specdec.engine.draft_heads import EAGLE3, MEDUSA, own_embedding, random_head
    from specdec.train import eagle, medusa

    embed = model.get_input_embeddings().weight.detach().float()
    target_head = model.get_output_embeddings().weight.detach().float()
    if args.kind == MEDUSA:
        if init is None:
            init = random_head(MEDUSA, model.config, seed=args.seed, medusa_heads=args.medusa_heads)
            medusa.start_from_target(init, target_head.cpu())
        head = init.to(device)
        return medusa.MedusaObjective(head, target_head, draft_ids, device)
    head = init
    if head is None:
        head = random_head(args.kind, model.config, seed=args.seed, draft_vocab_size=len(draft_ids), aux_layers=aux,
                           num_layers=args.head_layers or 1)
        if args.kind == EAGLE3:
            with torch.no_grad():
                head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
                head.t2d.zero_()
                head.t2d[draft_ids] = True
                # A warm start: the head's output is read like the target's final hidden state
                head.lm_head.weight.copy_(target_head[draft_ids].cpu())
                head.norm.weight.copy_(model.model.norm.weight.detach().float().cpu())
    head = head.to(device)
    # the embedding an --init head's file carries where it trained its own (as it drafts: own_embedding)
    head.attach(own_embedding(head, embed.to(device)), None if args.kind == EAGLE3 else target_head)
    return eagle.EagleObjective(head, args.steps, target_head, draft_ids, device)


if __name__ == "__main__":
    sys.exit(main())
