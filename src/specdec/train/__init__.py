"""Training draft heads for a target, on CPU or a GPU: `python -m specdec.train` (docs/drafts.md).

  data      self-distillation: the shipped prompts (prompts.jsonl) answered by the target, its features;
            grounded prompts made from its own answers
  compose_prompts  writes the shipped prompts: request templates crossed with subjects, a seeded draw
  writer    who runs the target while it answers: the served executor (continuously batched) or generate
  self_prompts  requests the target writes itself (Magpie), kept if ended, sized, distinct and disjoint
  trainer   the loop every kind shares: AdamW, cosine decay, held-out figures per epoch, resumable checkpoints
  eagle     EAGLE-1's and EAGLE-3's objective: the training-time test (the head unrolled on its own outputs)
  medusa    Medusa's objective: heads started as the target's lm_head, the draft vocabulary's rows trained
  __main__  the command: answer, train a head of --kind, write it in its published layout

May import: torch, transformers, `specdec.engine` (the heads), `specdec.decoding`. Never Triton.
"""
