"""specdec: speculative decoding served by NVIDIA Triton Inference Server.

A draft model proposes K tokens, the target model verifies them in one forward pass and an
accept/reject rule keeps exactly the target's output distribution (Leviathan et al. 2023,
https://arxiv.org/abs/2211.17192; Chen et al. 2023, https://arxiv.org/abs/2302.01318).

Modules by role:
  tensor_names       public tensor names and defaults shared by models, clients and tests
  sampling           logits -> probabilities (temperature, top-k, top-p), sampling
  rejection_sampler  the accept/reject rule, pure tensor functions
  causal_lm          a Hugging Face causal LM with per-sequence KV caches and rollback
  orchestrator       the propose -> verify -> accept loop (no Triton import)
  bls                the loop's proposer/scorer over Triton BLS calls
  pairs              building / converting the tiny and default model pairs
  repository         rendering model_repository/ for a chosen pair
  launcher           finding and starting tritonserver (``python -m specdec.launcher``)
"""
