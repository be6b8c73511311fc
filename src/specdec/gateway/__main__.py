"""`python -m specdec.gateway`: serve the OpenAI API for the ensemble of a running tritonserver.

Environment: OPENAI_PORT (9000), OPENAI_HOST (the address to listen on; unset: every interface), GRPC_PORT
(8001, the server's), SPECDEC_API_KEY (an API key clients must send as `Authorization: Bearer <key>`; none: no
check), SPECDEC_STREAM_KEEPALIVE (--stream-keepalive's seconds), VLLM_ALLOW_RUNTIME_LORA_UPDATING (True:
--allow-runtime-lora-updating), SPECDEC_INCREMENTAL_STREAMING_OUTPUT, SPECDEC_CACHE_RESET_FILE,
SPECDEC_PROFILE_CONTROL_FILE and SPECDEC_TORCH_PROFILER_DIR (the flags of those names). SIGTERM stops taking
connections and lets the answers in flight finish (at most --drain-timeout), as the launcher's drain expects.
"""

from __future__ import annotations

import argparse
import os
import sys

from aiohttp import web

from specdec import tensor_names as tn
from specdec.decoding.generation_config import AUTO, api_defaults
from specdec.decoding.text import CONTENT_FORMATS
from specdec.gateway import protocol
from specdec.gateway.adapters import RUNTIME_ENV, allowed_by_environment
from specdec.gateway.app import KEEPALIVE_S, Gateway
from specdec.gateway import cors, limits, sglang_native, tls
from specdec.gateway.reasoning import PARSERS as REASONING_PARSERS
from specdec.gateway.response_store import (DEFAULT_MB as DEFAULT_RESPONSES_STORE_MB, MIB, ResponseStore,
                                            SharedResponseStore)
from specdec.gateway.tools import PARSERS
from specdec.gateway.upstream import Upstream
from specdec.triton import cache_reset, live_profile

DEFAULT_PORT = 9000  # Triton's own OpenAI frontend's port: its clients' configurations work unchanged
API_KEY_ENV = "SPECDEC_API_KEY"
KEEPALIVE_ENV = "SPECDEC_STREAM_KEEPALIVE"  # --stream-keepalive's default (the launcher passes its environment on)


def log(message: str) -> None:
    print(f"[specdec.gateway] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpc-url", default=f"127.0.0.1:{os.environ.get('GRPC_PORT', 8001)}",
                        help="the tritonserver's gRPC endpoint")
    parser.add_argument("--upstream", choices=tn.UPSTREAMS, default="ensemble",
                        help="what a request calls: the server's ensemble, or (direct, the launcher's) preprocessing "
                             "and then speculative_decoding itself, without the ensemble's postprocessing step for "
                             "every streamed response (docs/openai.md)")
    parser.add_argument("--host", default=os.environ.get(tls.HOST_ENV) or "0.0.0.0",
                        help=f"the address to listen on (default: ${tls.HOST_ENV}, else every interface)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("OPENAI_PORT", DEFAULT_PORT)))
    parser.add_argument("--lora-module", action="append", default=[], metavar="NAME",
                        help="a LoRA adapter the server serves (its lora_name): a model of that name to clients, "
                             "the served model its parent (vLLM's; repeatable)")
    parser.add_argument("--lora-directory", default="", metavar="DIR",
                        help="a directory of LoRA adapters the server reads on demand (target_model's "
                             "lora_directory): each DIR/NAME a model of that name to clients")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true", default=allowed_by_environment(),
                        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), which add and "
                             "remove adapters as links in --lora-directory (default: vLLM's "
                             f"{RUNTIME_ENV}=True in the environment)")
    parser.add_argument("--served-model-name", action="append", default=[],
                        help="the model name clients send (repeatable: aliases); the first is listed first")
    parser.add_argument("--tokenizer", default="", help="the target's tokenizer (the text of log-probabilities' tokens and of echoed token-id prompts; "
                             "the tokenizer endpoints)")
    parser.add_argument("--chat-template", default="", metavar="FILE_OR_TEMPLATE",
                        help="a chat template replacing the tokenizer's (vLLM's flag; the one the server's "
                             "preprocessing uses), for /tokenize and counting a chat's prompt tokens")
    parser.add_argument("--generation-config", default=AUTO, metavar="auto|vllm|DIR",
                        help="the sampling defaults of a request that leaves them out (vLLM's flag): auto, the "
                             "model's generation_config.json (--tokenizer's directory: temperature, top_p, top_k, "
                             "min_p, repetition_penalty, max_new_tokens); vllm, OpenAI's; or a directory's file")
    parser.add_argument("--override-generation-config", default="", metavar="JSON",
                        help='sampling defaults over those (vLLM\'s flag), e.g. \'{"temperature": 0.5}\'; null '
                             "removes one")
    cors.add_flags(parser)
    tls.add_flags(parser)
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="pass a request's own chat_template on (vLLM's flag; the server's preprocessing must "
                             "take it too); without it such a request is refused")
    parser.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                        help="how the server hands a message's content to the chat template (vLLM's flag; the "
                             "server's preprocessing must say the same), for counting prompts as it renders them")
    parser.add_argument("--server-metrics-url", default="", metavar="HOST:PORT",
                        help="the server's metrics port: /metrics also restates its figures under vLLM's names "
                             "(vllm:num_requests_waiting, vllm:kv_cache_usage_perc, vllm:spec_decode_*)")
    parser.add_argument("--max-loras", type=int, default=0,
                        help="the target's adapter slots (its max_loras; 0: its default), as vllm:lora_requests_info "
                             "reports them")
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="the server's context in tokens, as model cards and /tokenize report it (0: not known)")
    parser.add_argument("--default-max-tokens", type=int, default=0,
                        help="what the server generates for a request that does not say (the room the Responses "
                             "API's truncation: auto leaves for the answer; 0: not known)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV, ""),
                        help=f"require this key (default: ${API_KEY_ENV}; none: no check)")
    parser.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                        help="how the model writes tool calls: tool_choice \"auto\" reads them (none: auto refused)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's flag, taken so that its command lines serve unchanged: tool_choice \"auto\" is on "
                             "wherever --tool-call-parser names the model's format (which it needs)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="a reasoning model's thinking apart from its answer (the chat API's reasoning_content, "
                             "the Responses API's reasoning item; a structured output constrains the answer only): "
                             "deepseek_r1 (DeepSeek-R1, QwQ, Qwen3-Thinking-2507) or qwen3 (Qwen3's hybrid models)")
    parser.add_argument("--responses-store-mb", type=float, default=DEFAULT_RESPONSES_STORE_MB,
                        help="memory for the Responses API's stored responses (store: true, the default), which "
                             "previous_response_id continues and GET /v1/responses/{id} reads (with background "
                             "responses' streams), and as much again for the Conversations API's conversations; "
                             "least recently used out first; in this process only, unless --responses-store-dir (0: "
                             "none stored)")
    parser.add_argument("--responses-store-dir", default="",
                        help="keep the stored responses (and conversations, in its conversations/) as files in this "
                             "directory instead of in memory (within --responses-store-mb): replicas that share it (a "
                             "ReadWriteMany volume) continue each other's conversations, and a restart forgets none")
    parser.add_argument("--stream-keepalive", type=float,
                        default=float(os.environ.get(KEEPALIVE_ENV, KEEPALIVE_S)),
                        help="seconds a streamed answer may be silent (waiting for its first token while the server "
                             "is full, a background response's next event) before a comment line keeps the "
                             "connection, and again each as long after: proxies and load balancers close idle "
                             f"connections (often after 60 s); 0: never (default: ${KEEPALIVE_ENV}, else "
                             f"{KEEPALIVE_S:g})")
    parser.add_argument("--incremental-streaming-output", action="store_true",
                        default=os.environ.get(sglang_native.INCREMENTAL_ENV) == "1",
                        help="SGLang's flag: a streamed /generate event holds the text, tokens and log-probabilities "
                             "it adds, not everything so far (default: "
                             f"${sglang_native.INCREMENTAL_ENV}=1, which the launcher sets for the flag)")
    parser.add_argument("--cache-reset-file", default=cache_reset.path_from_env(), metavar="PATH",
                        help="the marker file through which POST /reset_prefix_cache (vLLM's) and /flush_cache "
                             "(SGLang's) reset the server's caches (default: "
                             f"${cache_reset.ENV}, which the launcher sets; none: those endpoints answer 501)")
    parser.add_argument("--profile-control-file", default=os.environ.get(live_profile.CONTROL_ENV, ""), metavar="PATH",
                        help="the file through which POST /start_profile and /stop_profile (vLLM's and SGLang's) "
                             "start and stop the models' torch profiles (default: "
                             f"${live_profile.CONTROL_ENV}, which the launcher sets with --torch-profiler-dir; "
                             "none: those endpoints answer 501)")
    parser.add_argument("--torch-profiler-dir", default=live_profile.directory_from_env(os.environ), metavar="DIR",
                        help="where a profile's traces go unless its start names an output_dir (default: "
                             f"${live_profile.DIR_ENV}, which the launcher sets)")
    parser.add_argument("--drain-timeout", type=float, default=60.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    before, after = limits.raise_open_files()
    if after != before:
        log(f"open files: soft limit raised from {before} to {after} (one per client connection)")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        log("--enable-auto-tool-choice needs --tool-call-parser (how the model writes its calls)")
        return 2
    if not args.served_model_name:
        log("--served-model-name is required (the name clients send as `model`)")
        return 2
    tokenizer = None
    if args.chat_template and not args.tokenizer:
        log("--chat-template needs --tokenizer (the template replaces the tokenizer's)")
        return 2
    if args.tokenizer:
        from specdec.decoding.text import check_chat_template, load_tokenizer, read_chat_template

        try:
            template = read_chat_template(args.chat_template, "--chat-template") if args.chat_template else None
            tokenizer = load_tokenizer(args.tokenizer, template)
            if template:
                check_chat_template(tokenizer, "--chat-template", args.chat_template_content_format)
        except ValueError as exc:
            log(str(exc))
            return 2
    try:
        defaults = api_defaults(args.generation_config, args.tokenizer, args.override_generation_config)
        policy = cors.from_args(args)
        secure = tls.server_context(tls.from_args(args))
    except ValueError as exc:
        log(str(exc))
        return 2
    if defaults:  # as vLLM says it: a client's unchanged request samples otherwise than on OpenAI's defaults
        log(f"sampling defaults of a request that leaves them out: {defaults} (the model's generation config "
            "and --override-generation-config; --generation-config vllm for OpenAI's)")
    budget = int(max(args.responses_store_mb, 0.0) * MIB)
    store = SharedResponseStore(args.responses_store_dir, budget) if args.responses_store_dir and budget \
        else ResponseStore(budget)
    served = protocol.Served(args.served_model_name, args.lora_module, args.lora_directory)
    if args.allow_runtime_lora_updating and not args.lora_directory:
        log("--allow-runtime-lora-updating needs --lora-directory (the adapters it loads are links there)")
        return 2
    try:
        upstream = Upstream(args.grpc_url, direct=args.upstream == "direct")
        gateway = Gateway(upstream, served, tokenizer, args.api_key or None,
                          args.tool_call_parser, args.max_model_len, args.reasoning_parser, store,
                          args.default_max_tokens, args.drain_timeout, args.stream_keepalive,
                          args.allow_runtime_lora_updating, log, trust_templates=args.trust_request_chat_template,
                          sampling_defaults=defaults, cors=policy,
                          content_format=args.chat_template_content_format,
                          server_metrics_url=args.server_metrics_url, max_loras=args.max_loras,
                          cache_reset_file=args.cache_reset_file,
                          profile=(args.profile_control_file, os.path.abspath(args.torch_profiler_dir)
                                   if args.torch_profiler_dir else ""),
                          incremental_streaming=args.incremental_streaming_output)
    except ValueError as exc:
        log(str(exc))
        return 2
    scheme, models = "https" if secure else "http", ", ".join(args.served_model_name + args.lora_module)
    log(f"OpenAI API: {scheme}://{args.host}:{args.port}/v1 (models {models}"
        f"{', those of ' + args.lora_directory if args.lora_directory else ''}"
        f"{', loaded and unloaded at run time' if args.allow_runtime_lora_updating else ''}; "
        f"server {args.grpc_url} ({args.upstream}); "
        f"API key {'required' if args.api_key else 'not required'}; browser pages of "
        f"{'any origin' if '*' in policy.origins else ', '.join(policy.origins) or 'no origin'}; stored responses "
        f"{'in ' + args.responses_store_dir if isinstance(store, SharedResponseStore) else 'in memory'})")
    web.run_app(gateway.app(), host=args.host, port=args.port, print=None, access_log=None,
                shutdown_timeout=args.drain_timeout, handler_cancellation=True, ssl_context=secure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
