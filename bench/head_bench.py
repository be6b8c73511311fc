"""What a trained head's draft step costs against the target's step, in process (the head's c).

On a GPU: the 8B-shaped bf16 pair of gpu_bench.py (its target's step on the static executor with CUDA
graphs, its 4-layer layer-skip draft's) against EAGLE-1, EAGLE-3 (32000-token draft vocabulary, as the
published Llama-3.1-8B head; of one decoder layer, as published, and of two and three, as the speculators
library trains with --num-layers), Medusa (4 heads) heads, an MLP speculator (4 stages, IBM's) and an MTP
layer (MiMo's: one Qwen2 decoder layer) of its shape. On CPU: the default pair (SmolLM2-135M, float32)
likewise, with `--default-pair`, and its shipped
EAGLE-3 head as served (float32) and in bfloat16 (half the bytes a step streams). The other heads have random weights: a step costs the same
whatever they learned. Per draft: ms per drafted token (K=4 proposals, after the head read one round's
features) and c = that / the target's one-token step.

    python -m bench.head_bench                      # GPU, the 8B-shaped pair
    python -m bench.head_bench --default-pair        # CPU, the default pair
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import report
from bench.report import print_table
from specdec.decoding.sampling import SamplingParams
from specdec.engine.build import dynamic_executor, static_executor
from specdec.engine.draft_heads import (EAGLE, EAGLE3, MEDUSA, MLP, MTP, load_head_for, random_head,
                                        read_target_tensors)
from specdec.engine.head_executor import HeadExecutor
from specdec.engine.head_kernels import HeadKernels

K = 4
CONTEXT = 256


def median_ms(fn, device, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def target_step_ms(lm, device, reps: int) -> float:
    prompt = list(range(1, CONTEXT + 1))
    lm.extend(1, 0, prompt, 1)
    return median_ms(lambda: lm.extend(1, CONTEXT, [5], 1), device, reps)


def draft_step_ms(lm, device, reps: int) -> float:
    """A draft model's ms per drafted token (K tokens after one new token)."""
    prompt = list(range(1, CONTEXT + 1))
    lm.propose(2, 0, prompt, 1, SamplingParams())
    return median_ms(lambda: lm.propose(2, CONTEXT, [5], K, SamplingParams()), device, reps) / K


def head_step_ms(head, device, reps: int, graphs: bool = False) -> float:
    """A head's ms per drafted token: a round's call reads 2 new features (one accepted token) and drafts K."""
    executor = HeadExecutor(head, graphs=graphs, max_context=1024)
    executor.warm_up()
    width = head.config.feature_width
    dtype = next(head.parameters()).dtype
    prompt = list(range(1, CONTEXT + 1))
    executor.propose(1, 0, prompt, 0, SamplingParams(), features=torch.zeros(CONTEXT - 1, width, device=device, dtype=dtype))
    features = torch.zeros(2, width, device=device, dtype=dtype)
    return median_ms(lambda: executor.propose(1, CONTEXT - 1, [5, 6, 7], K, SamplingParams(), features=features),
                     device, reps) / K


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--default-pair", action="store_true", help="the default pair on CPU")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=None)
    parser.add_argument("--results", default="", help="also write docs/results/DATE-NAME.md")
    args = parser.parse_args(argv)
    if args.default_pair:
        from specdec.engine.loading import load_causal_lm
        from specdec.serving import pairs
        pair = pairs.default_pair()
        target_path = pair.target_path
        device, dtype = torch.device("cpu"), torch.float32
        target_model = load_causal_lm(pair.target_path, "cpu", "float32")
        draft_model = load_causal_lm(pair.draft_paths["draft_model"], "cpu", "float32")
        target, draft = dynamic_executor(target_model), dynamic_executor(draft_model)
        what = "the default pair (SmolLM2-135M-Instruct, float32) and its 10-layer layer-skip draft"
    else:
        from bench.gpu_bench import load, synthetic_pair
        device, dtype = torch.device("cuda"), torch.bfloat16
        target_path, draft_path = synthetic_pair(False, "bfloat16", "cuda")
        target_model, draft_model = load(target_path, dtype, "cuda"), load(draft_path, dtype, "cuda")
        settings = dict(kv_pool_tokens=8192, max_context=1024, max_batch=1, max_rows=5, compile="graphs")
        target, draft = static_executor(target_model, **settings), static_executor(draft_model, **settings)
        target.warm_up(300)
        draft.warm_up(300)
        what = "the 8B-shaped bf16 pair (random weights) and its 4-layer layer-skip draft, static executor, CUDA graphs"
    target_ms = target_step_ms(target, device, args.reps)
    rows = [["target (1 token)", f"{target_ms:.2f}", "1.00"]]
    draft_ms = draft_step_ms(draft, device, args.reps)
    rows.append(["layer-skip draft model", f"{draft_ms:.2f}", f"{draft_ms / target_ms:.3f}"])
    # The target's tensors as a served head reads them (CPU models' lm_head is repacked for oneDNN)
    _, embed, lm_head = read_target_tensors(target_path, device, dtype)
    for kind, layers in ((EAGLE, 1), (EAGLE3, 1), (EAGLE3, 2), (EAGLE3, 3), (MEDUSA, 1), (MLP, 1), (MTP, 1)):
        head = random_head(kind, target_model.config, draft_vocab_size=32000 if kind == EAGLE3 else 0,
                           num_layers=layers)
        head = head.to(device=device, dtype=dtype)
        if hasattr(head, "attach"):  # (Medusa and MLP speculators read neither)
            head.attach(embed, lm_head)
        shape = f", {layers} layers" if layers > 1 else ""
        # on a CPU an EAGLE head or MTP layer steps on the layer kernels where they are built (head_kernels.py)
        eager = "CPU kernels" if HeadKernels.serving(head) is not None else "eager"
        for graphs in ((False, True) if device.type == "cuda" and kind in (EAGLE, EAGLE3, MTP) else (False,)):
            ms = head_step_ms(head, device, args.reps, graphs)
            rows.append([f"{kind} head{shape} ({'CUDA graphs' if graphs else eager})", f"{ms:.2f}",
                         f"{ms / target_ms:.3f}"])
        del head
    if args.default_pair:  # the shipped head as served (the pair's float32), and in bfloat16: half the bytes
        for head_dtype in (torch.float32, torch.bfloat16):
            head, _ = load_head_for(pairs.DEFAULT_PAIR_HEAD, target_path, device, head_dtype)
            ms = head_step_ms(head, device, args.reps)
            name = str(head_dtype).removeprefix("torch.")
            rows.append([f"the shipped EAGLE-3 head ({pairs.DEFAULT_PAIR_HEAD_NAME}), {name}", f"{ms:.2f}",
                         f"{ms / target_ms:.3f}"])
    text = print_table(f"Draft step against the target's step, in process: {what}; {report.machine()}. "
                       f"Drafts: ms per drafted token at K={K} after {CONTEXT} tokens of context.",
                       rows, ["draft", "ms per token", "c (of a target step)"], args.out)
    if args.results:
        report.write_results(args.results, "A trained head's draft step against the target's", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
