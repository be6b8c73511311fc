"""The Triton Python-backend layer: what each model_repository/*/1/model.py subclasses, and its plumbing.

  adapter          the base adapter: config validated in `initialize`, before any request
  orchestrator     speculative_decoding: the decoupled BLS model running `decoding.loop.generate`
  request          ParsedRequest: one request's inputs validated (no pb_utils; unit-tested)
  inputs           typed access to a request's input arrays, errors naming the input
  vllm_parameters  vLLM's `sampling_parameters` JSON read into the inputs it stands for
  vllm_outputs     vLLM's backend's additional outputs (its `return_*` flags), by its names and meanings
  vllm_compatible  vllm_compatible: vLLM's backend's interface ([1]-shaped tensors) over the ensemble
  loopback         a model's gRPC stream into its own server (where 24.10's decoupled BLS is unsafe)
  wire             the BLS messages between the orchestrator and the models, encoded and decoded
  bls              the loop's Proposer and Scorer as BLS calls into draft_model / target_model
  fallback         a failing draft model is bypassed (target-only rounds) and retried after a wait
  language_models  draft_model and target_model over an `engine.executor.Executor`
  responder        pipelined_execute: a model's responses sent from a thread of its own
  text_models      preprocessing (text -> ids) and postprocessing (ids -> text)
  marker_file      a file through which one process tells every model instance something, each seeing it once
  cache_reset      a client's reset of the caches across requests, seen by every instance (a marker file)
  live_profile     torch profiler traces of the models' executions, started and stopped by a client
  execute_clock    since when a text model's current execute runs, for the launcher's watchdog
  config           typed, validated config.pbtxt parameters
  metrics          every Prometheus metric the models define
  profiling        cProfile over a model's execute calls (SPECDEC_PROFILE_DIR)
  admission/       which requests generate now and which wait: the live-sequence cap, the wait for KV
                   room, their server-wide line, the verify gate, the counts, cancellation flags

May import: `specdec.decoding`, `specdec.engine`, `specdec.tensor_names`; `triton_python_backend_utils`
only at load, inside a stub (adapter.py).
"""
