"""The OpenAI-compatible API: a small process of its own in front of tritonserver (`python -m specdec.gateway`),
talking to the ensemble over gRPC; the launcher runs it beside the server (OPENAI_PORT). docs/openai.md.

  protocol   OpenAI requests checked and mapped onto the ensemble's inputs; response objects, errors (pure)
  tools      tool calls: the schemas that force them, the parsers that read them, their streaming (pure)
  reasoning  a reasoning model's thinking apart from its answer (`--reasoning-parser`), whole and streamed (pure)
  harmony    gpt-oss's harmony channels: thinking, answer and function calls apart, whole and streamed (pure)
  responses  OpenAI's Responses API on the chat path: the request mapped, the response object, its events (pure)
  messages   Anthropic's Messages API on the chat path: the request mapped, the message, its events, its
             errors (pure)
  sglang_native  SGLang's native API (/generate, /get_server_info, /get_model_info, /health_generate) on the
             completions path: the request mapped, its outputs' meta_info, the server's accept length (pure)
  response_store  the Responses API's stored responses (`store`, `previous_response_id`): in memory, or in a
             directory replicas share
  conversations  OpenAI's Conversations API: items that responses naming a conversation read and add to
  background  the Responses API's background responses: generated here, their states and streams stored,
             streams followed from any event, cancelled
  batches    OpenAI's Batch API: files of requests, batches answered here, their output files
  adapters   vLLM's runtime LoRA endpoints (load_lora_adapter, unload_lora_adapter): links in the target's
             directory of adapters
  tokenization  vLLM's tokenizer endpoints: /tokenize, /detokenize, /tokenizer_info (pure)
  upstream   one ensemble gRPC stream per request (tritonclient asyncio), cancelled when the caller leaves
             before its final response
  cors       which browser pages may call it (vLLM's --allowed-origins): preflights, the headers of answers
  limits     the open-files limit raised at start (a descriptor per client connection)
  tls        serving over TLS (vLLM's --ssl-* flags, OPENAI_SSL_* in the environment), and the context the
             launcher's own checks ask it with
  metrics    the API's own Prometheus metrics (GET /metrics): requests by route and status, time to first
             token, tokens, stored and background responses
  vllm_metrics  the server's metrics under vLLM's names on /metrics (dashboards, autoscalers, inference
             gateways) (pure)
  app        the HTTP endpoints (aiohttp): chat, completions, responses (and stored ones), models, health, the
             tokenizer's;
             streaming, API keys
  __main__   the command line

May import: `specdec.tensor_names`, `specdec.decoding.text` (the tokenizer: log-probabilities' tokens, echoed
prompts, the tokenizer endpoints), `specdec.decoding.generation_config` (the model's sampling defaults), `specdec.triton.metrics`' buckets (the server's, so that quantiles compare)
and `specdec.engine.lora_config` (a directory's LoRA adapters, torch-free).
"""
