"""The model executor: runs a causal LM step by step for many sequences at once.

  executor       `Executor`: a KV store plus a forward; sequences with rollback, admission, prefix
                 caching's bookkeeping, packed batched forwards, drafting
  run_ahead      a greedy step run before its request asks for it (the device busy through the host's work)
  interfaces     Step, Drafted, and the KVStore and Forward protocols the executor is composed of
  build          `build_executor(model, ExecutorConfig)`: which store and forward serve a model
  kv_cache       the contiguous KV store: per-sequence buffers and the attention that reads them in place
  paged_kv       the paged KV store: one block pool per layer allocated at load, within a budget
  prefix_cache   prefix caching's index: full KV blocks found again by the prompt tokens they hold;
                 the state every store keeps of a sequence
  transformers_forward  the eager forward: transformers' own, over packed rows (any architecture)
  static_forward the static forward: bucketed shapes over the paged pool, replayed as CUDA graphs
  llama_forward  the Llama-family forward the static one runs, written over the model's modules
  llama_model    the Llama family's modules built from a model directory without transformers' model
                 classes (what the static executor reads: weights and config), and their plain forward
  paged_attention  its attention on CUDA: a Triton kernel reading the paged pool in place
  draft_heads    trained draft heads (EAGLE-1, EAGLE-3, Medusa, MLP speculators, a model's MTP layer): the
                 modules, read and written in the layouts their authors publish (and vLLM's), refused when made
                 for another target
  skip_layers    the layer-skip self-draft (SWIFT): the target with some layers left out, per sequence,
                 and the search of which over the live text
  lora           LoRA adapters (PEFT's layout) served over one model, each sequence running its own
  lora_config    adapter lists as configs and command lines spell them (no torch)
  head_executor  drafting with a head over the target's features, per-sequence KV with rollback
  head_graphs    a head's one-token draft step replayed as CUDA graphs over a pool of sequences' KV
  hosted_heads   heads drafting in the target's process, in its verify call: one call a round
  head_kernels   a head's step on the CPU's layer kernels (csrc/cpu_layer.cpp), its draft vocabulary's
                 logits kept unscattered for a greedy pick
  cuda_graphs    pinned input staging and one bucket's forward captured as a CUDA graph
  kernels        a Llama layer's pointwise math as pure functions, and their compiled (fused) form
  gguf_checkpoint  a Llama GGUF file read into config.json's fields and float32 weights (transformers' names)
                 without transformers' loader: served GGUF targets, the default pair's conversion
  loading        loads a model (Hugging Face directory, GGUF file, FP8 checkpoint) on a device, in a dtype
  onednn_linear  CPU linear layers with weights reordered once for oneDNN; which kernels a model's
                 linears run on (`linear_kernels`, timed at load)
  panel_linear   the project's own float32 CPU linear kernel (csrc/panel_linear.cpp, compiled on first
                 use): weights in column panels, 1-6 rows for about the cost of one
  fp8_linear     linear layers with FP8 weights and a scale per output channel, and their weight-only kernel
  errors         CacheError, CapacityError
  host_memory    gives freed host memory back to the OS (glibc malloc_trim, TCMalloc's release)
  machine_lock   one process at a time on the machine (an advisory file lock): kernel timing and builds
  threads        the CPUs this process may use
  local          the loop's Proposer and Scorer over in-process executors (tests, benchmarks)

May import: torch, transformers, `specdec.tensor_names`, `specdec.decoding` (sampling, the interfaces, skip_search).
Never Triton's server (triton_python_backend_utils); the Triton language compiler (`triton`, a torch
dependency on CUDA) only in paged_attention and fp8_linear, on first use.
"""
