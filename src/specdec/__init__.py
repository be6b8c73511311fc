"""specdec: speculative decoding served by NVIDIA Triton Inference Server.

A draft proposes K tokens, the target model verifies them in one forward pass and an accept/reject rule
keeps exactly the target's output distribution (Leviathan et al. 2023, https://arxiv.org/abs/2211.17192;
Chen et al. 2023, https://arxiv.org/abs/2302.01318).

One subpackage per layer; imports point down only (each folder's docstring lists its modules):

  serving/    launcher, model pairs, repository rendering, health check    (may import every layer below)
  gateway/    the OpenAI-compatible API, a process beside tritonserver       (decoding.text)
  train/      training draft heads (EAGLE-3) on a target's own answers: python -m specdec.train
                                                                            (engine, decoding)
  triton/     the Python-backend adapters behind model_repository/*/model.py, BLS proposer and scorer,
              request parsing, metrics, cancellation                        (decoding, engine)
  engine/     the model executor: per-sequence KV cache, packed forwards, kernels       (decoding.sampling)
  decoding/   the pure algorithm: loop, rejection sampler, sampling, draft length, prompt lookup,
              detokenization; no Triton, no model weights                  (nothing of ours)

  tensor_names  the public tensor names, method names and defaults; every layer and the client read it
"""
