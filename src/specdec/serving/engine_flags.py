"""vLLM's and SGLang's server flags read as what they stand for here, so that a `vllm serve` or
`sglang.launch_server` command line (with its speculative flags, speculative_config.py) starts this server
instead of stopping at the first flag the launcher does not know. docs/configuration.md.

The table (the user's view) is in docs/configuration.md, "vLLM's and SGLang's server flags": the API's port and
key, generation slots, prefix caching, chunked prefill, CUDA graphs off, FP8 weights, tensor parallelism 1 only,
--trust-remote-code accepted (no model's own code runs here).

Flags that tune the other engines' memory, scheduling or logging (`--gpu-memory-utilization`,
`--mem-fraction-static`, `--seed`, `--disable-log-requests`, ...: ENGINE_ONLY) are accepted and logged as
changing nothing. Pure: the parsed values in, what they stand for out (ValueError naming the flag).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from specdec import tensor_names as tn
from specdec.decoding.generation_config import AUTO, VLLM
from specdec.gateway.sglang_native import INCREMENTAL_ENV
from specdec.gateway.tls import HOST_ENV

PORT, HOST, API_KEY = ("--port",), ("--host",), ("--api-key",)
MAX_SEQS = ("--max-num-seqs", "--max-running-requests")
PREFIX_ON, PREFIX_OFF = ("--enable-prefix-caching",), ("--no-enable-prefix-caching", "--disable-radix-cache")
CHUNK = ("--max-num-batched-tokens", "--chunked-prefill-size")
EAGER = ("--enforce-eager", "--disable-cuda-graph")
QUANTIZATION = ("--quantization", "-q")
TENSOR_PARALLEL = ("--tensor-parallel-size", "-tp", "--tp-size", "--tp")
PIPELINE_PARALLEL = ("--pipeline-parallel-size", "-pp", "--pp-size")
DATA_PARALLEL = ("--data-parallel-size", "-dp", "--dp-size", "--dp")
SAMPLING_DEFAULTS = ("--sampling-defaults",)  # SGLang's: model (the checkpoint's generation config) or openai
SAMPLING_DEFAULT_CHOICES = {"model": AUTO, "openai": VLLM}  # -> --generation-config's
TRUST_REMOTE_CODE = ("--trust-remote-code",)
INCREMENTAL = ("--incremental-streaming-output",)  # SGLang's: its native stream's events hold what they add
# SGLang's: a streamed answer's responses at least this many tokens apart (fewer responses, more tokens a second
# where each response costs the server's processes CPU: docs/results/2026-12-06-cpu-llama-cpp.md)
STREAM_INTERVAL = ("--stream-interval",)
FP8 = "fp8"
# The other engines' own tuning: taken with their value, logged, nothing done
ENGINE_ONLY = ("--gpu-memory-utilization", "--mem-fraction-static", "--seed", "--random-seed", "--log-level",
               "--uvicorn-log-level", "--kv-cache-dtype", "--max-total-tokens", "--cuda-graph-max-bs",
               "--attention-backend", "--swap-space", "--max-prefill-tokens", "--schedule-policy",
               "--load-format", "--revision", "--download-dir")
ENGINE_ONLY += ("--guided-decoding-backend", "--grammar-backend", "--num-scheduler-steps",
                "--distributed-executor-backend", "--max-seq-len-to-capture", "--max-cpu-loras", "--lora-dtype",
                "--lora-extra-vocab-size", "--torch-compile-max-bs", "--page-size", "--watchdog-timeout")
ENGINE_ONLY_SWITCHES = ("--disable-log-requests", "--disable-log-stats", "--enable-metrics", "--enable-log-requests",
                        "--skip-server-warmup", "--disable-overlap-schedule", "--enable-chunked-prefill",
                        "--disable-custom-all-reduce", "--enable-sleep-mode", "--disable-frontend-multiprocessing",
                        "--enable-prompt-tokens-details", "--enable-torch-compile", "--enable-mixed-chunk",
                        # served whenever given here: vLLM's switches for LoRA adapters and reasoning parsers
                        "--enable-lora", "--enable-reasoning")
PREFIX_DEST = "engine_prefix_caching"
# vLLM's and SGLang's --dtype values besides the models' own names: auto (see dtype()), half, float
DTYPE_ALIASES = ("auto", "half", "float")
CHECKPOINT_DTYPES = ("bfloat16", "float16")  # a checkpoint's dtype `auto` keeps on a GPU


def _dest(flag: str) -> str:
    return "engine_" + flag.lstrip("-").replace("-", "_")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags above as an argument group of the launcher's (each None or False unless given)."""
    group = parser.add_argument_group("vLLM's and SGLang's server flags, read as what they stand for here "
                                      "(docs/configuration.md)")
    group.add_argument(*PORT, dest=_dest(PORT[0]), type=int, default=None, help="the OpenAI API's port (OPENAI_PORT)")
    group.add_argument(*HOST, dest=_dest(HOST[0]), default=None,
                       help=f"the address the OpenAI API listens on ({HOST_ENV}; default: every interface)")
    group.add_argument(*API_KEY, dest=_dest(API_KEY[0]), default=None, help="the OpenAI API's key (SPECDEC_API_KEY)")
    group.add_argument(*MAX_SEQS, dest=_dest(MAX_SEQS[0]), type=int, default=None, metavar="N",
                       help="generation slots (speculative_decoding's max_live_sequences)")
    group.add_argument(*PREFIX_ON, dest=PREFIX_DEST, action="store_const", const=True, default=None)
    group.add_argument(*PREFIX_OFF, dest=PREFIX_DEST, action="store_const", const=False,
                       help="prefix caching off (the models' prefix_caching)")
    group.add_argument(*CHUNK, dest=_dest(CHUNK[0]), type=int, default=None, metavar="TOKENS",
                       help="prompts in chunks of this many tokens (prefill_chunk_tokens)")
    group.add_argument(*EAGER, dest=_dest(EAGER[0]), action="store_true", help="no CUDA graphs (--compile off)")
    group.add_argument(*QUANTIZATION, dest=_dest(QUANTIZATION[0]), default=None, metavar=FP8,
                       help="fp8: --weights-dtype fp8")
    group.add_argument(*TENSOR_PARALLEL, dest=_dest(TENSOR_PARALLEL[0]), type=int, default=None, metavar="1")
    group.add_argument(*PIPELINE_PARALLEL, dest=_dest(PIPELINE_PARALLEL[0]), type=int, default=None, metavar="1")
    group.add_argument(*DATA_PARALLEL, dest=_dest(DATA_PARALLEL[0]), type=int, default=None, metavar="1",
                       help="1 only: replicas are separate servers here (the chart's replicaCount)")
    group.add_argument(*SAMPLING_DEFAULTS, dest=_dest(SAMPLING_DEFAULTS[0]), default=None,
                       choices=tuple(SAMPLING_DEFAULT_CHOICES),
                       help="--generation-config auto (model) or vllm (openai)")
    group.add_argument(*TRUST_REMOTE_CODE, dest=_dest(TRUST_REMOTE_CODE[0]), action="store_true",
                       help="accepted: no model's own code runs here")
    group.add_argument(*INCREMENTAL, dest=_dest(INCREMENTAL[0]), action="store_true",
                       help="SGLang's native /generate streams what each event adds (the API's flag)")
    group.add_argument(*STREAM_INTERVAL, dest=_dest(STREAM_INTERVAL[0]), type=int, default=None, metavar="TOKENS",
                       help="a streamed answer's responses at least this many tokens apart (speculative_decoding's "
                            "stream_interval; a request's sampling_parameters may ask otherwise)")
    for flag in ENGINE_ONLY:
        group.add_argument(flag, dest=_dest(flag), default=None, help=argparse.SUPPRESS)
    for flag in ENGINE_ONLY_SWITCHES:
        group.add_argument(flag, dest=_dest(flag), action="store_true", help=argparse.SUPPRESS)


@dataclass
class Engine:
    """What the flags given stand for."""

    env: dict[str, str] = field(default_factory=dict)  # the launcher's environment (the API's port and key)
    max_live_sequences: int | None = None
    prefix_caching: bool | None = None
    settings: list[str] = field(default_factory=list)  # --set MODEL.PARAMETER=VALUE
    compile_off: bool = False
    fp8: bool = False
    generation_config: str | None = None  # SGLang's --sampling-defaults as --generation-config auto or vllm
    notes: list[str] = field(default_factory=list)  # logged at start: what was accepted without effect
    given: list[str] = field(default_factory=list)  # the flags that change the served repository

    @property
    def changes_repository(self) -> bool:
        return bool(self.given)


def read(args: argparse.Namespace) -> Engine:
    """The parsed flags -> what they stand for (ValueError naming the flag where nothing here stands for the
    value)."""
    out = Engine()
    port = getattr(args, _dest(PORT[0]))
    if port is not None:
        if not 0 <= port <= 65535:
            raise ValueError(f"--port {port}: not a port (0-65535; 0: no OpenAI API)")
        out.env["OPENAI_PORT"] = str(port)
    host = getattr(args, _dest(HOST[0]))
    if host is not None:
        if not host.strip():
            raise ValueError("--host: empty (leave it out for every interface)")
        out.env[HOST_ENV] = host.strip()
    key = getattr(args, _dest(API_KEY[0]))
    if key is not None:
        if not key:
            raise ValueError("--api-key: empty (leave it out for none)")
        out.env["SPECDEC_API_KEY"] = key
    seqs = getattr(args, _dest(MAX_SEQS[0]))
    if seqs is not None:
        if seqs < 1:
            raise ValueError(f"--max-num-seqs / --max-running-requests {seqs}: at least 1")
        out.max_live_sequences = seqs
        out.given.append("--max-num-seqs")
    prefix = getattr(args, PREFIX_DEST)
    if prefix is not None:
        out.prefix_caching = prefix
        out.given.append("--enable-prefix-caching" if prefix else "--no-enable-prefix-caching")
    chunk = getattr(args, _dest(CHUNK[0]))
    if chunk is not None:
        if chunk < -1 or chunk == 0:
            raise ValueError(f"--max-num-batched-tokens / --chunked-prefill-size {chunk}: tokens (> 0), or -1 "
                             "(SGLang's: prompts whole)")
        out.settings.append(f"speculative_decoding.prefill_chunk_tokens={max(chunk, 0)}")
        out.given.append("--max-num-batched-tokens")
    interval = getattr(args, _dest(STREAM_INTERVAL[0]))
    if interval is not None:
        if not 1 <= interval <= tn.MAX_STREAM_INTERVAL_TOKENS:
            raise ValueError(f"--stream-interval {interval}: tokens within [1, {tn.MAX_STREAM_INTERVAL_TOKENS}] "
                             "(1: a response per round)")
        out.settings.append(f"speculative_decoding.stream_interval={interval}")
        out.given.append("--stream-interval")
    if getattr(args, _dest(EAGER[0])):
        out.compile_off = True
        out.given.append("--enforce-eager")
    quantization = getattr(args, _dest(QUANTIZATION[0]))
    if quantization is not None:
        if quantization.lower() != FP8:
            raise ValueError(f"--quantization {quantization}: only {FP8} here (FP8 weights scaled per channel at "
                             "load; --weights-dtype q8: 8-bit blocks on the CPU)")
        out.fp8 = True
        out.given.append("--quantization")
    parallel = getattr(args, _dest(TENSOR_PARALLEL[0]))
    if parallel is not None and parallel != 1:
        raise ValueError(f"--tensor-parallel-size / --tp-size {parallel}: a model runs on one GPU here (1); "
                         "--spread-target spreads the target's layers over every visible GPU")
    for flags, what in ((PIPELINE_PARALLEL, "a model's layers on one GPU (--spread-target: over the visible ones)"),
                        (DATA_PARALLEL, "replicas are separate servers (the chart's replicaCount)")):
        value = getattr(args, _dest(flags[0]))
        if value is not None and value != 1:
            raise ValueError(f"{' / '.join(flags)} {value}: 1 only here ({what})")
    defaults = getattr(args, _dest(SAMPLING_DEFAULTS[0]))
    if defaults is not None:
        out.generation_config = SAMPLING_DEFAULT_CHOICES[defaults]
    if getattr(args, _dest(INCREMENTAL[0])):
        out.env[INCREMENTAL_ENV] = "1"
    if getattr(args, _dest(TRUST_REMOTE_CODE[0])):
        out.notes.append("--trust-remote-code: no model's own code runs here (the families served are the "
                         "project's modules or transformers')")
    ignored = [flag for flag in ENGINE_ONLY if getattr(args, _dest(flag)) is not None]
    ignored += [flag for flag in ENGINE_ONLY_SWITCHES if getattr(args, _dest(flag))]
    if ignored:
        out.notes.append(f"{', '.join(ignored)} tune vLLM's or SGLang's engine, nothing here")
    return out


def dtype(given: str, device: str, target: str | None) -> str:
    """--dtype as the models' dtype: half and float by their names; auto as vLLM reads it, the checkpoint's
    bfloat16 or float16 on a GPU (float16 for a float32 checkpoint), and float32 on the CPU, where this
    project's kernels serve float32 (a checkpoint's config unreadable: its GPU default, float16)."""
    if given not in DTYPE_ALIASES:
        return given
    if given != "auto":
        return {"half": "float16", "float": "float32"}[given]
    if device != "gpu":
        return "float32"
    try:
        config = json.loads((Path(target) / "config.json").read_text()) if target else {}
    except (OSError, ValueError):
        config = {}
    stored = config.get("torch_dtype") or config.get("dtype") or (config.get("text_config") or {}).get("dtype")
    return stored if stored in CHECKPOINT_DTYPES else "float16"
