"""Training draft heads for a target, on CPU or a GPU: `python -m specdec.train` (docs/drafts.md).

  data      self-distillation: the shipped prompts (prompts.jsonl) answered by the target, its features
  eagle3    EAGLE-3's training-time test (the head unrolled on its own outputs), evaluation, resumable runs
  __main__  the command: answer, train, write the head in the published layout

May import: torch, transformers, `specdec.engine` (the heads), `specdec.decoding`. Never Triton.
"""
