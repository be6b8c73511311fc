"""Benchmarks: scripts that print tables (and write them as dated result pages), never timed assertions.

  speculative_bench  the served default pair, speculative against target-only, against the bound and transformers
  gpu_bench          the 8B-shaped pair on a GPU (small shapes on CPU): bound, compiled reference, served rows
  executor_bench     in-process forward costs of the executors
  round_overhead     where a served round's time goes: forwards, adapters, Triton, the orchestrator
  structured_bench   structured output's forced text, in process and served
  prefix_bench       prefix caching; long prompts beside short streams (--stall)
  suffix_bench       the `suffix` draft against prompt lookup on repetitive workloads
  mixed_load         8 streams of mixed kinds against a running server
  readme_examples    rewrites the README's real-output examples from a running server
  beside             plain streams beside a load, and the gaps between their responses
  stream_interval    a whole answer sent at the end, a response per round, or at an interval: the cost
  batch_bench        the Batch API against one request at a time and many clients, the same chat requests
  lora_bench         what LoRA adapters cost a forward, in process: none, base rows, one adapter, mixed
  report             what every script shares: the machine's description, tables, result pages
"""
