"""The model executor: runs a Hugging Face causal LM step by step for many sequences at once.

  executor       `CausalLM`: per-sequence caches with rollback, packed batched forwards, drafting
  kv_cache       per-sequence KV buffers and the attention that appends to and reads them in place
  static_executor  `StaticCausalLM`: a preallocated paged KV pool, forwards captured as CUDA graphs
  prefix_cache   prefix caching's index: full KV blocks found again by the prompt tokens they hold;
                 the state both executors keep of a sequence
  kernels        a Llama layer's pointwise math as pure functions, and their compiled (fused) form
  onednn_linear  CPU linear layers with weights reordered once for oneDNN
  host_memory    gives freed host memory back to the OS (glibc malloc_trim)
  local          the loop's Proposer and Scorer over in-process CausalLMs (tests, benchmarks)

May import: torch, transformers, `specdec.tensor_names`, `specdec.decoding` (sampling, the interfaces).
Never Triton.
"""
