"""Serving and deployment: a real tritonserver on our model repository, for a chosen model pair.

  launcher     find tritonserver, assemble the Python-backend stub, render, run (`python -m specdec.serving.launcher`)
  server       start the launcher as a child process and wait until ready (benchmarks, load tests, tests)
  pairs        the model pairs (tiny, default, custom paths) prepared into a local cache
  repository   render model_repository/ for a pair (config.pbtxt parameters, instance groups)
  speculative_config  vLLM's --speculative-config read as the launcher's draft settings
  engine_flags  vLLM's and SGLang's server flags (--port, --api-key, --max-num-seqs, --enforce-eager, ...) read as
             the launcher's settings they stand for (pure)
  healthcheck  exit 0 when the local server is ready (the image's HEALTHCHECK); the launcher's /ready, /live, /metrics
  watchdog     notice a model whose stub died and bring it back (reload in place, or restart the server)
  server_process  tritonserver as the launcher runs it: its output passed through, when it counts as crashed
  gateway_process  the OpenAI API's process as the launcher runs it (started, restarted, drained first)
  fetch        download the pair's weights into a volume once (the chart's init container)
  mps          a CUDA MPS control daemon of the launcher's own (`--mps`)
  allocator    the C allocator tritonserver and its stubs run with (`--allocator`: TCMalloc for CPU models)
  metrics_text reading a server's Prometheus text (the launcher's drain, benchmarks, tests)

May import: every layer below, though it only needs `specdec.tensor_names` (models load in the server).
"""
