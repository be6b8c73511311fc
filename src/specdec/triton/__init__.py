"""The Triton Python-backend layer: what each model_repository/*/1/model.py subclasses, and its plumbing.

  adapter          the base adapter: config validated in `initialize`, before any request
  orchestrator     speculative_decoding: the decoupled BLS model running `decoding.loop.generate`
  request          ParsedRequest: one request's inputs validated (no pb_utils; unit-tested)
  bls              the loop's Proposer and Scorer as BLS calls into draft_model / target_model
  fallback         a failing draft model is bypassed (target-only rounds) and retried after a wait
  language_models  draft_model and target_model over `engine.executor.CausalLM`
  responder        pipelined_execute: a model's responses sent from a thread of its own
  text_models      preprocessing (text -> ids) and postprocessing (ids -> text)
  config           typed, validated config.pbtxt parameters
  metrics          every Prometheus metric the models define
  cancellation     cancellation flags shared by the server's processes
  slots            the live-sequence cap shared by the orchestrator's instances (file locks)
  room             waiting for room in target_model's KV cache, first come first served
  line             the server-wide first-come-first-served line of those waits (file locks)
  verify_gate      concurrent requests' verify calls lined up (verify_gather_ms)

May import: `specdec.decoding`, `specdec.engine`, `specdec.tensor_names`; `triton_python_backend_utils`
only at load, inside a stub (adapter.py).
"""
