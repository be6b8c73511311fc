"""What FP8 weights change (`weights_dtype: fp8`, src/specdec/engine/fp8_linear.py), against bfloat16 and
float32, on the same text: held-out log-likelihood, next-token agreement and greedy text.

The held-out prompts (bench/prompts_grounded.jsonl, bench/prompts_open.jsonl, chat template on) and the
float32 model's own greedy answers are the text. Per setting: the mean negative log-likelihood per token of
the prompts and of the answers (teacher-forced), how often its next token (argmax) is bfloat16's and
float32's at the answers' positions, and, run free, how many of its greedy answers equal bfloat16's and how
many tokens they share from the start. Speculation is exact with respect to the served model whatever its
weights: this measures how far the served model is from the unquantized one, not speculation.

    python -m bench.fp8_quality                      # the default pair's target, 16 prompts, 64 tokens
    python -m bench.fp8_quality --pair tiny --prompts 2 --max-tokens 8   # checks the script
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.report import emit, machine, table, write_results
from bench.speculative_bench import load_prompts
from specdec.engine import fp8_linear
from specdec.engine.loading import load_causal_lm
from specdec.serving import pairs
from specdec.train.data import encode

# (label, compute dtype, weights_dtype)
SETTINGS = [("float32", "float32", "same"), ("bfloat16", "bfloat16", "same"),
            ("fp8 weights, bfloat16 compute", "bfloat16", "fp8"), ("fp8 weights, float32 compute", "float32", "fp8")]


@torch.no_grad()
def dense_equivalent(model):
    """`model` with every Fp8Linear replaced by a dense layer holding its dequantized weight: the numbers the
    served model computes on CPU (fp8_linear dequantizes each product's weight the same way), without
    dequantizing every weight at every step."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, fp8_linear.Fp8Linear):
                dense = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                dense.weight = torch.nn.Parameter(fp8_linear.dequantize(child.weight, child.weight_scale,
                                                                        model.dtype), requires_grad=False)
                if child.bias is not None:
                    dense.bias = torch.nn.Parameter(child.bias, requires_grad=False)
                setattr(parent, name, dense)
    return model


@torch.inference_mode()
def greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@torch.inference_mode()
def log_probs(model, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1, V) float32 log-probabilities of each next token."""
    logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="default", choices=sorted(pairs.PAIRS))
    parser.add_argument("--prompts", type=int, default=8, help="per set (grounded, open)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", help="also write the table (Markdown) here")
    parser.add_argument("--results", metavar="NAME", help="also write it as docs/results/<date>-NAME.md")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    pair = pairs.prepare_pair(args.pair)
    tokenizer = AutoTokenizer.from_pretrained(pair.tokenizer_path)
    prompts = [encode(tokenizer, p, chat_template=True) for kind in ("grounded", "open") for p in load_prompts(kind, args.prompts)]
    models = {label: dense_equivalent(load_causal_lm(pair.target_path, dtype=dtype, weights_dtype=weights,
                                                     linear_kernels="torch"))
              for label, dtype, weights in SETTINGS}
    reference = models["float32"]
    answers = [greedy(reference, ids, args.max_tokens) for ids in prompts]
    scored = {label: [log_probs(model, ids + answer) for ids, answer in zip(prompts, answers)]
              for label, model in models.items()}
    free = {label: [greedy(model, ids, args.max_tokens) for ids in prompts] for label, model in models.items()}

    rows = []
    for label in models:
        prompt_nll, answer_nll, prompt_n, answer_n, same_bf16, same_fp32 = 0.0, 0.0, 0, 0, 0, 0
        for i, (ids, answer) in enumerate(zip(prompts, answers)):
            lp = scored[label][i]
            targets = torch.tensor(ids[1:] + answer)
            nll = -lp.gather(1, targets[:, None])[:, 0]
            cut = len(ids) - 1  # rows before it predict prompt tokens, from it the answer's
            prompt_nll, prompt_n = prompt_nll + nll[:cut].sum().item(), prompt_n + cut
            answer_nll, answer_n = answer_nll + nll[cut:].sum().item(), answer_n + len(answer)
            top = lp[cut:].argmax(-1)
            same_bf16 += (top == scored["bfloat16"][i][cut:].argmax(-1)).sum().item()
            same_fp32 += (top == scored["float32"][i][cut:].argmax(-1)).sum().item()
        equal = sum(a == b for a, b in zip(free[label], free["bfloat16"]))
        shared = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                  for a, b in zip(free[label], free["bfloat16"])]
        rows.append([label, f"{prompt_nll / prompt_n:.4f}", f"{answer_nll / answer_n:.4f}",
                     f"{same_bf16 / answer_n:.3f}", f"{same_fp32 / answer_n:.3f}", f"{equal}/{len(prompts)}",
                     f"{sum(shared) / len(shared):.1f}"])
    columns = ["weights and compute", "NLL per prompt token", "NLL per answer token", "next token = bf16's",
               "next token = fp32's", "greedy text = bf16's", "tokens shared with bf16's"]
    text = (f"{machine()}; {pair.target_path}; {len(prompts)} held-out prompts (chat template), the float32 "
            f"model's greedy answers of {args.max_tokens} tokens as the answer text\n\n" + table(rows, columns))
    emit(text, args.out)
    if args.results:
        write_results(args.results, "What FP8 weights change against bfloat16 and float32", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
