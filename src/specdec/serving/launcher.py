"""Start a real tritonserver on our model repository: `python -m specdec.serving.launcher` (what `make serve` runs).

It finds the server binary (the one shipped in the `nvidia-pytriton` wheel, or an installed Triton given
by --triton-root, e.g. /opt/tritonserver in NVIDIA's image), assembles a backend directory with the
Python-backend stub built for the running interpreter, sets the library path the stub needs (the
interpreter's libpython first, then the wheel's bundled libraries), renders the model repository and runs
tritonserver in the foreground. SIGTERM/SIGINT drain first (readiness drops, the requests in flight finish,
at most --drain-timeout), then stop the server, which stops every stub process; a second signal stops at once.
A watchdog (watchdog.py) brings back a model whose stub process died: reloaded in place through the
model repository API (explicit model control, with a key of the launcher's own unless the flags after
`--` choose otherwise), or by restarting tritonserver; and a server that crashed while serving is started
again (server_process.py says when it counts as crashed; its output passes through the launcher).

The repository comes from one of: a named pair (--pair / PAIR: tiny | default), a pair given by paths
(--target PATH [--draft PATH | --draft ngram] with placement and request defaults), or an already
rendered repository (--model-repository, as the Helm chart mounts it). Arguments after `--` go to
tritonserver unchanged.

Environment: PAIR, HTTP_PORT, GRPC_PORT, METRICS_PORT (8000/8001/8002), HEALTH_PORT (8003; 0: none):
the launcher's own endpoint, GET /ready (ready, no model down, not draining; healthcheck.py), GET /live
and GET /metrics (the watchdog's), and OPENAI_PORT
(9000; 0: none): the OpenAI-compatible API (`specdec.gateway`), a process the launcher runs beside the
server, restarts if it dies and drains first (SPECDEC_API_KEY: the key its clients must send).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specdec import tensor_names as tn
from specdec.decoding.generation_config import AUTO, VLLM, api_defaults
from specdec.decoding.text import CONTENT_FORMATS, read_chat_template
from specdec.engine.lora_config import CONFIG, FIRST_LAYERS, NAME, format_adapters
from specdec.serving import allocator, engine_flags, mps, pairs, repository, speculative_config
from specdec.gateway.adapters import RUNTIME_ENV, allowed_by_environment
from specdec.gateway import cors, limits, tls
from specdec.gateway.reasoning import PARSERS as REASONING_PARSERS
from specdec.gateway.response_store import DEFAULT_MB as RESPONSES_STORE_MB
from specdec.gateway.tools import PARSERS as TOOL_CALL_PARSERS, reasoning_for
from specdec.serving.gateway_process import (GatewayProcess, default_model_name, repository_chat_template,
                                             repository_content_format, repository_generation_config,
                                             repository_limits, repository_max_loras, repository_tokenizer,
                                             repository_trusts_request_templates)
from specdec.serving.healthcheck import (
    READY_PATH, ReadinessEndpoint, answers, drain_marker, gateway_url, health_port, is_ready, openai_port, ready_url,
)
from specdec.serving.metrics_text import samples, scrape, sum_samples
from specdec.serving.pairs import log
from specdec.serving.server_process import ENDPOINTS_STALL_S, ServerProcess
from specdec.serving.watchdog import (DEFAULT_HANG_TIMEOUT_S, ModelControl, Watchdog, control_mode,
                                      restricted_header, stubs_of)
from specdec.triton import cache_reset, execute_clock, live_profile, loopback
from specdec.triton.admission import cancellation, kv_room, sequence_slots

START_ATTEMPTS = 3  # starts of a server that stalls (come_up), before the launcher gives up on it


APPLY_CHAT_TEMPLATE = ""  # --chat-template given no value: the boolean it was before it took vLLM's template
LAUNCHER_KEY_HEADER = "specdec-launcher-key"  # the header of the repository API key the launcher makes up


@dataclass(frozen=True)
class ServerLayout:
    binary: Path
    backend_dir: Path
    ld_library_path: str


def triton_layout(work_dir: Path, triton_root: Path | None = None) -> ServerLayout:
    """Server binary and a backend directory whose Python stub matches the running interpreter.

    The Python backend, its library and the stub for this interpreter, always comes from the
    nvidia-pytriton wheel (Triton 2.51, stubs for Python 3.8-3.13): library and stub of one build. Only
    the server binary comes from triton_root when given (an NGC image of the same release, which the
    image test checks), else from the same wheel.
    """
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("nvidia-pytriton is not installed (run `make setup`)")
    pkg = Path(spec.origin).parent
    wheel_server = pkg / "tritonserver"
    server = triton_root or wheel_server
    binary = server / "bin" / "tritonserver"
    if not binary.exists():
        raise FileNotFoundError(f"no tritonserver binary at {binary}")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = wheel_server / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise FileNotFoundError(f"no Python backend stub for Python {version} in {stub.parent.parent}")
    backend = work_dir / "backends" / "python"
    backend.mkdir(parents=True, exist_ok=True)
    for src in (wheel_server / "backends" / "python" / "libtriton_python.so",
                wheel_server / "backends" / "python" / "triton_python_backend_utils.py", stub):
        # Copy then rename: replacing a stub binary that an older server still runs is allowed,
        # overwriting it in place is not ("Text file busy").
        staging = backend / f".{src.name}.new"
        shutil.copy2(src, staging)
        os.replace(staging, backend / src.name)
    libs = [sysconfig.get_config_var("LIBDIR") or "", str(pkg.parent / "nvidia_pytriton.libs")]
    existing = os.environ.get("LD_LIBRARY_PATH", "")
    return ServerLayout(binary, backend.parent, ":".join(p for p in libs + [existing] if p))


def server_command(layout: ServerLayout, repo: Path, http: int, grpc: int, metrics: int,
                   extra: list[str] | None = None) -> list[str]:
    return [
        str(layout.binary),
        f"--model-repository={repo}",
        f"--backend-directory={layout.backend_dir}",
        f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
        "--strict-readiness=true",
        "--exit-on-error=true",
        "--log-verbose=0",
        # Every config.pbtxt here is complete. With auto-completion on, the Python backend starts one more
        # stub per model just to ask it for a config, importing torch and transformers once more: on a
        # 2-core CPU machine the tiny pair's server took 31-32 s to get ready instead of 20-21 s.
        "--disable-auto-complete-config",
        # Every model loads at once: with Triton's 4 at a time, target_model (last by name, the slowest to
        # load) waited for the light ones; the tiny pair with three drafts got ready in 21-22 s, not 27.
        "--model-load-thread-count=16",
        # Without an NVIDIA device, DCGM's start (for GPU metrics) can only fail: it is where a restarted
        # server's start stalled once (server_process.py). Flags after `--` come later and win.
        *([] if nvidia_device() else ["--allow-gpu-metrics=false"]),
        *(extra or []),
    ]


def nvidia_device(dev: Path = Path("/dev")) -> bool:
    """True where the NVIDIA driver's control device exists (a GPU machine, or a container given its GPUs)."""
    return (dev / "nvidiactl").exists()


def accepts(port: int, timeout_s: float = 1.0) -> bool:
    """True when something listens on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def on_signals(act, signums=(signal.SIGTERM, signal.SIGINT)) -> None:
    """Run act(signum) for every signal of `signums`, one at a time and in order, on a thread of its own.

    Not in the handler itself: Python runs a handler in the main thread between two bytecodes, possibly
    while that thread holds a lock (an Event's, inside `Event.wait`; stderr's, inside a `print`), and
    whatever the handler does that takes the same lock never returns. Seen once: the handler's
    `Event.set()` hung a stop until the test's teardown killed the launcher, its server and stubs
    orphaned. The handler only puts the signal on a SimpleQueue, whose put is reentrant (documented)."""
    received: queue.SimpleQueue = queue.SimpleQueue()

    def serve() -> None:
        while True:
            signum = received.get()
            try:
                act(signum)
            except Exception as exc:  # noqa: BLE001 (the next signal must still be served)
                log(f"signal {signum}: {type(exc).__name__}: {exc}")

    threading.Thread(target=serve, name="signals", daemon=True).start()
    for signum in signums:
        signal.signal(signum, lambda signum, _frame: received.put(signum))


class StartStalled(RuntimeError):
    """The server loaded its models and did not open its endpoints (server_process.py)."""


def wait_ready(http_port: int, process: subprocess.Popen, timeout_s: float,
               stop: threading.Event | None = None, metrics_port: int | None = None,
               stalled: Callable[[], str | None] | None = None) -> None:
    """Return once tritonserver is ready and, given metrics_port, its metrics endpoint listens (Triton opens
    it after the HTTP endpoint, so "ready" alone leaves a moment where a scrape is refused); or as soon as
    `stop` is set (a signal arrived). Raises StartStalled once `stalled()` says why."""
    deadline = time.monotonic() + timeout_s
    last_note = 0.0
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            return
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {process.returncode} before it was ready")
        # Triton's own readiness: the launcher's (is_ready) also says no while the watchdog restarts it.
        if answers(ready_url(http_port), 2.0) and (metrics_port is None or accepts(metrics_port)):
            return
        if stalled is not None and (why := stalled()) is not None:
            raise StartStalled(f"tritonserver {why}")
        if time.monotonic() - last_note > 10:
            log("models loading ...")
            last_note = time.monotonic()
        time.sleep(0.5)
    raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f} s")


def come_up(current: list[ServerProcess], start_server: Callable[[], ServerProcess], http_port: int,
            metrics_port: int, timeout_s: float, stop: threading.Event) -> None:
    """wait_ready for the server in current[0]; one whose start stalls is killed with its stubs and started
    again in its place, at most START_ATTEMPTS times in all."""
    for start in range(1, START_ATTEMPTS + 1):
        try:
            wait_ready(http_port, current[0].process, timeout_s, stop, metrics_port, stalled=current[0].stalled)
            return
        except StartStalled as exc:
            if start == START_ATTEMPTS:
                raise
            log(f"{exc}; starting it again (start {start + 1} of at most {START_ATTEMPTS})")
        # its stubs' regions found from their arguments, before the kill
        retire(current[0], {stub.shm for stub in stubs_of(current[0].pid)})
        current[0] = start_server()


def wait_gateway(gateway: GatewayProcess, stop: threading.Event, timeout_s: float = 60.0) -> None:
    """Wait until the OpenAI API answers its health check (it starts in about a second, beside models that
    take far longer; a gateway that does not come up is logged, and readiness keeps saying not ready)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        if gateway.probe():
            return
        gateway.keep_alive()
        time.sleep(0.25)
    log(f"the OpenAI API does not answer at {gateway_url(gateway.port)}")


def in_flight(metrics_port: int) -> float:
    """Requests the server still works on: generations, requests waiting for a generation slot, and
    requests queued at any model (each BLS step of a stream is one)."""
    text = scrape(f"127.0.0.1:{metrics_port}")
    return sum(sum_samples(text, name) for name in
               ("specdec_live_sequences", "specdec_queued_requests", "nv_inference_pending_request_count"))


def drain(http_port: int, metrics_port: int, process: subprocess.Popen, timeout_s: float) -> None:
    """Let the requests in flight finish before tritonserver stops: readiness drops at once (the marker),
    then wait until nothing has been in flight for a second, or timeout_s.

    Triton's own shutdown cannot do this for us: from SIGTERM on it refuses new inference requests, and
    every round of a stream is a new BLS request to draft_model and target_model, so a stream in flight
    would stall until --exit-timeout-secs and be cut."""
    marker = drain_marker(http_port)
    marker.touch()
    deadline = time.monotonic() + timeout_s
    idle_since = None
    try:
        while time.monotonic() < deadline and process.poll() is None:
            try:
                busy = in_flight(metrics_port)
            except OSError:  # no metrics to read (a server still loading, as after a restart): nothing to wait for
                log("drain: the server's metrics do not answer; stopping")
                return
            now = time.monotonic()
            idle_since = (idle_since or now) if busy == 0 else None
            if idle_since is not None and now - idle_since >= 1.0:
                log("drained: no request in flight")
                return
            time.sleep(0.25)
        log(f"drain: requests still in flight after {timeout_s:.0f} s; stopping anyway")
    finally:
        marker.unlink(missing_ok=True)


# Defaults for the stubs' environment; a value already in the environment wins. GOMP_SPINCOUNT: after
# each parallel region torch's OpenMP workers (libgomp) spin this many iterations before they sleep;
# libgomp's default, 300000, lasts milliseconds, so a model that has just answered keeps a core
# busy through the next model's forward (a round is draft, then orchestrator, then target, each in its
# own stub). 30000 is libgomp's own choice when threads outnumber cores, which across our stubs they
# do (a 2-core machine's K=4 round took half as long with it).
STUB_ENV_DEFAULTS = {"GOMP_SPINCOUNT": "30000"}


def server_env(layout: ServerLayout, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment tritonserver and its stubs need (`extra`: e.g. the MPS daemon's directories)."""
    # The stub's embedded interpreter finds its prefix through the first `python3` on PATH: put the
    # running (venv) interpreter's directory first so the stubs import the venv's packages.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**STUB_ENV_DEFAULTS, **os.environ, "LD_LIBRARY_PATH": layout.ld_library_path, "PATH": path,
            **(extra or {})}


def redact(arg: str) -> str:
    """Hide the header value of a restricted-API flag (the model repository API key) in logs."""
    if arg.startswith(("--http-restricted-api=", "--grpc-restricted-protocol=")) and "=" in arg.split(":", 1)[-1]:
        return arg[:arg.rindex("=") + 1] + "***"
    return arg


def ports() -> tuple[int, int, int]:
    return (int(os.environ.get("HTTP_PORT", 8000)), int(os.environ.get("GRPC_PORT", 8001)),
            int(os.environ.get("METRICS_PORT", 8002)))


def taken_ports() -> str:
    """What of the ports this launcher serves on something already listens on ("HTTP_PORT 8000: the port is
    taken; ..."), or "". Checked before anything is rendered or started: a second launcher on a first one's
    ports had its tritonserver fail to bind, took the first server's answers for its own readiness (READY) and
    restarted its own for ever, rendering the model repository again under the first one's models."""
    http, grpc, metrics = ports()
    named = (("HTTP_PORT", http), ("GRPC_PORT", grpc), ("METRICS_PORT", metrics), ("OPENAI_PORT", openai_port()),
             ("HEALTH_PORT", health_port()))
    return "; ".join(f"{name} {port}: the port is taken" for name, port in named if port and accepts(port))


def with_heads(pair: pairs.PairSpec, heads: list[str], default_draft: str = "") -> pairs.PairSpec:
    """The pair with --draft-head's heads ([NAME=]DIR each) and --default-draft applied."""
    named, given = dict(pair.draft_heads), []
    for spec in heads:
        name, sep, path = spec.rpartition("=")
        name = name if sep else tn.DEFAULT_HEAD_NAME
        if name in named or name in pair.draft_paths or name in pair.skip_drafts or name in tn.BUILTIN_DRAFTS \
                or name in pair.hosted_heads \
                or not name.replace("_", "").isalnum():
            raise ValueError(f"--draft-head {spec!r}: {name!r} is taken or not a model name (letters, digits, _)")
        if not (Path(path) / "config.json").exists():
            raise ValueError(f"--draft-head {spec!r}: {path} holds no config.json (a head directory)")
        named[name] = str(Path(path).resolve())
        given.append(name)
    # The first head given is the default draft (not a head the pair itself serves, e.g. the default pair's)
    default = default_draft or (given[0] if given else pair.default_draft)
    served = dataclasses.replace(pair, draft_heads=named, default_draft=default)
    offered = (set(pair.draft_paths) | set(named) | set(pair.hosted_heads) | set(pair.skip_drafts)
               | set(pair.builtin_drafts)
               | set(pairs.combined_drafts(served)))
    if default and default not in offered:
        raise ValueError(f"--default-draft {default!r} is not among the drafts served: {sorted(offered)}")
    return served


def with_skip_drafts(pair: pairs.PairSpec, specs: list[str]) -> pairs.PairSpec:
    """The pair with --skip-draft's layer-skip self-drafts ([NAME=]LAYERS each, LAYERS "auto" or a list)."""
    named = dict(pair.skip_drafts)
    for spec in specs:
        name, sep, layers = spec.rpartition("=")
        name = name if sep else tn.DEFAULT_SKIP_DRAFT_NAME
        taken = (set(named) | set(pair.draft_paths) | set(pair.draft_heads) | set(pair.hosted_heads)
                 | set(tn.BUILTIN_DRAFTS))
        if name in taken or not name.replace("_", "").isalnum():
            raise ValueError(f"--skip-draft {spec!r}: {name!r} is taken or not a model name (letters, digits, _)")
        if layers != tn.SKIP_SEARCH and not all(part.strip().replace("-", "").isdigit()
                                                for part in layers.split(",") if part.strip()):
            raise ValueError(f"--skip-draft {spec!r}: {layers!r} is neither {tn.SKIP_SEARCH!r} nor a list of "
                             "layers like 3,5,7-9")
        named[name] = layers or tn.SKIP_SEARCH
    return dataclasses.replace(pair, skip_drafts=named)


def with_lora_adapters(pair: pairs.PairSpec, specs: list[str], directory: str = "", slots: int = 0,
                       rank: int = 0) -> pairs.PairSpec:
    """The pair with --lora-modules' adapters (NAME=DIR each, PEFT's layout), checked for their files here, and
    --lora-directory's, --max-loras and --max-lora-rank."""
    if directory:
        if not Path(directory).is_dir():
            raise ValueError(f"--lora-directory {directory}: not a directory")
        if '"' in directory or "\\" in directory:
            raise ValueError(f"--lora-directory {directory}: may not hold a quote or a backslash")
        pair = dataclasses.replace(pair, lora_directory=str(Path(directory).resolve()))
    if slots < 0 or rank < 0:
        raise ValueError(f"--max-loras and --max-lora-rank are counts (> 0), got {slots} and {rank}")
    if slots and slots < len(pair.lora_adapters) + len(specs) + bool(pair.lora_directory):
        raise ValueError(f"--max-loras {slots} holds {'no adapter of --lora-directory beside ' if directory else ''}"
                         f"the {len(pair.lora_adapters) + len(specs)} of --lora-modules")
    pair = dataclasses.replace(pair, max_loras=slots or pair.max_loras, max_lora_rank=rank or pair.max_lora_rank)
    named = dict(pair.lora_adapters)
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not NAME.match(name):
            raise ValueError(f"--lora-modules {spec!r}: NAME=DIR, NAME letters, digits and . _ : / - (at most 128)")
        if name in named:
            raise ValueError(f"--lora-modules {spec!r}: {name!r} is given twice")
        if not (Path(path) / CONFIG).is_file():
            raise ValueError(f"--lora-modules {spec!r}: {path} holds no {CONFIG} (a PEFT LoRA adapter)")
        named[name] = str(Path(path).resolve())
    served = dataclasses.replace(pair, lora_adapters=named)
    format_adapters(named)  # a directory its config value cannot spell is refused now, not at load
    return served


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default=os.environ.get("PAIR", "default"), choices=sorted(pairs.PAIRS))
    custom = parser.add_argument_group("a pair given by paths (instead of --pair)")
    custom.add_argument("--target", "--model-path", help="target model: HF directory or .gguf file (--model-path: "
                                                        "SGLang's name)")
    custom.add_argument("--draft", default=tn.NGRAM,
                        help=f'draft model path, or "{tn.NGRAM}" for prompt lookup, or "{tn.SUFFIX}" for prompt '
                             "lookup also over earlier requests' text")
    custom.add_argument("--tokenizer", "--tokenizer-path", default="",
                        help="tokenizer directory (default: the target's; --tokenizer-path: SGLang's name)")
    custom.add_argument("--dtype", default="float32", choices=(*tn.DTYPE_NAMES, *engine_flags.DTYPE_ALIASES),
                        help="the models' dtype; vLLM's and SGLang's auto, half, float: engine_flags.DTYPE_ALIASES")
    custom.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    custom.add_argument("--target-gpu", type=int, default=0)
    custom.add_argument("--spread-target", action="store_true",
                        help="spread the target over every visible GPU (transformers device_map=auto)")
    custom.add_argument("--draft-gpu", type=int, default=0)
    custom.add_argument("--num-draft-tokens", type=int, default=tn.DEFAULT_NUM_DRAFT_TOKENS, help="default draft length per request")
    custom.add_argument("--max-num-draft-tokens", type=int, default=tn.DEFAULT_MAX_NUM_DRAFT_TOKENS)
    custom.add_argument("--max-context-tokens", "--max-model-len", "--context-length", type=int,
                        default=tn.DEFAULT_MAX_CONTEXT_TOKENS,
                        help="prompt and output tokens per sequence (--max-model-len: vLLM's name; --context-length: "
                             "SGLang's)")
    custom.add_argument(speculative_config.FLAG, default=None, metavar="JSON",
                        help="vLLM's speculative config, e.g. '{\"method\": \"eagle3\", \"model\": \"DIR\", "
                             "\"num_speculative_tokens\": 3}' (ngram, suffix, eagle, eagle3, medusa, mlp_speculator, "
                             "mtp, draft_model): the --draft, --draft-head and --num-draft-tokens it stands for")
    sglang = parser.add_argument_group("SGLang's speculative flags, read as the --draft, --draft-head, "
                                       "--num-draft-tokens and draft_branches they stand for (docs/configuration.md)")
    sglang.add_argument(speculative_config.SGLANG_ALGORITHM, default=None,
                        metavar="|".join(speculative_config.SGLANG_ALGORITHMS))
    sglang.add_argument(speculative_config.SGLANG_PATH, "--speculative-draft", default=None, metavar="DIR")
    sglang.add_argument(speculative_config.SGLANG_STEPS, type=int, default=None, metavar="N",
                        help="a chain's depth (topk 1)")
    sglang.add_argument(speculative_config.SGLANG_TOPK, type=int, default=None, metavar="B",
                        help=f"trees B wide (at most {tn.MAX_DRAFT_BRANCHES}); 1: chains")
    sglang.add_argument(speculative_config.SGLANG_TOKENS, type=int, default=None, metavar="T",
                        help="a tree's T - 1 nodes (a verify's tokens but the root)")
    for flag in speculative_config.SGLANG_THRESHOLDS:
        sglang.add_argument(flag, type=float, default=None, help="1.0 only (exact acceptance)")
    for flag in speculative_config.SGLANG_NGRAM_WINDOW:
        sglang.add_argument(flag, type=int, default=None, metavar="N", help="NGRAM's: prompt lookup's n-grams")
    for flag in speculative_config.SGLANG_ENGINE_FLAGS:
        sglang.add_argument(flag, default=None, help=argparse.SUPPRESS)
    engine_flags.add_arguments(parser)
    custom.add_argument("--draft-lora-layers", default="", metavar="first|LAYERS",
                        help="the draft model is made of some of the target's layers (a layer-skip draft: first, "
                             "its first N; or a list, 0-9): it runs a request's LoRA adapter on them too, so that "
                             "an adapter's requests draft as the adapted target writes (the static executor)")
    parser.add_argument("--skip-draft-lora", action="store_true",
                        help="every --skip-draft drafts with a request's LoRA adapter too (it is the target, some "
                             "layers left out); on a CPU an adapter's rows cost the draft 1.2-1.5x")
    custom.add_argument("--apply-chat-template", action="store_true",
                        help="wrap a plain prompt (text_input) in the chat template unless the request's "
                             "apply_chat_template says otherwise (chats, and the OpenAI API's chat endpoint, always are)")
    parser.add_argument("--chat-template", nargs="?", const=APPLY_CHAT_TEMPLATE, default=None,
                        metavar="FILE_OR_TEMPLATE",
                        help="the chat template, replacing the tokenizer's: a Jinja file or the template itself "
                             "(vLLM's flag); for a model whose tokenizer has none, or a template of your own. "
                             "Without a value: --apply-chat-template (this flag's meaning before)")
    parser.add_argument("--generation-config", default=AUTO, metavar="auto|vllm|DIR",
                        help="the model's generation_config.json (vLLM's flag): its end tokens end every request "
                             "and its sampling fields (temperature, top_p, top_k, min_p, repetition_penalty, "
                             "max_new_tokens) are the OpenAI API's defaults; auto: the target's; vllm: end tokens "
                             "only, OpenAI's defaults; DIR: another directory's file")
    parser.add_argument("--override-generation-config", default="", metavar="JSON",
                        help='the OpenAI API\'s sampling defaults over the file\'s (vLLM\'s flag), e.g. '
                             '\'{"temperature": 0.5}\'; null removes one')
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="take a request's own chat template (vLLM's chat_template field and flag): a template is "
                             "code the server runs, so only where the clients are trusted")
    parser.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                        help="how a message's content reaches the chat template (vLLM's flag): string, its text; "
                             "openai, OpenAI's list of parts (for templates that loop over them); auto, openai "
                             "where the template loops over a message's content")
    parser.add_argument("--draft-head", action="append", default=[], metavar="[NAME=]DIR",
                        help="serve a trained draft head (EAGLE-1, EAGLE-3, Medusa or an MLP speculator, in its "
                             "published layout; a MiMo model's directory for its MTP layer) over the target as "
                             "draft model NAME "
                             f"(default {tn.DEFAULT_HEAD_NAME}); repeatable. "
                             "The first becomes the default draft unless --default-draft names another")
    parser.add_argument("--heads-in-target", action="store_true",
                        help="host the trained heads (the pair's and --draft-head's) in target_model's process "
                             "instead of as draft models of their own: each round is one call, the head drafting "
                             "first from features that stay in the process (docs/drafts.md)")
    parser.add_argument("--skip-draft", action="append", default=[], metavar="[NAME=]LAYERS",
                        help="serve the target drafting for itself with intermediate layers left out (SWIFT) as "
                             f"draft model NAME (default {tn.DEFAULT_SKIP_DRAFT_NAME}): LAYERS '{tn.SKIP_SEARCH}' "
                             "searches them over the traffic (eager executor), or lists them (3,5,7-9); "
                             "it holds a copy of the target's weights. Repeatable")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=DIR",
                        help="LoRA adapters (PEFT's layout) the target serves besides its own weights: a request "
                             "names one as lora_name, an OpenAI client as its model (vLLM's flag)")
    parser.add_argument("--lora-directory", default="", metavar="DIR",
                        help="a directory of LoRA adapters (DIR/NAME, PEFT's layout) the target reads when a request "
                             "first names one, keeping --max-loras in memory and replacing the least recently used "
                             "(vLLM's LoRA resolver; docs/configuration.md)")
    parser.add_argument("--max-loras", type=int, default=0, metavar="N",
                        help="LoRA adapters held in memory at once, --lora-modules' included (default: theirs, and 4 "
                             "more with --lora-directory)")
    parser.add_argument("--max-lora-rank", type=int, default=0, metavar="R",
                        help="the largest rank of an adapter read from --lora-directory (default: 16, or "
                             "--lora-modules' largest)")
    parser.add_argument("--default-draft", default="",
                        help="the draft a request that names none gets (a draft model, a head, ngram or suffix)")
    parser.add_argument("--weights-dtype", default="same", choices=tn.WEIGHTS_DTYPES,
                        help="the models' linear weights: in --dtype (same), FP8 with a scale per output channel "
                             "(fp8: a weight-only FP8 kernel on GPUs, dequantized on CPU), or rounded to 8-bit "
                             "blocks (q8: the CPU's panel kernel, float32; weights already in 4- or 8-bit blocks "
                             "stay); docs/configuration.md")
    parser.add_argument("--compile", default="auto", choices=tn.COMPILE_MODES,
                        help="CUDA graphs of the static executor: auto = on GPUs (every decode/verify shape "
                             "captured at load), eager on CPU; off = eager everywhere; graphs = required")
    parser.add_argument("--executor", default=None, choices=tn.EXECUTORS,
                        help="each language model's executor: auto = the static one (this project's forward over "
                             "a paged KV pool) on GPUs and for float32 Llama-family models on CPU, else the dynamic "
                             "one (transformers' forward); default: the pair's (auto; the tiny pair: static)")
    parser.add_argument("--orchestrator-instances", type=int, default=None,
                        help="speculative_decoding processes (concurrent streams' rounds run in parallel); default "
                             f"{tn.DEFAULT_ORCHESTRATOR_INSTANCES['gpu']} with --device gpu, "
                             f"{tn.DEFAULT_ORCHESTRATOR_INSTANCES['cpu']} on CPU")
    parser.add_argument("--allocator", default=allocator.AUTO, choices=allocator.CHOICES,
                        help="the C allocator of tritonserver and its stubs: auto = TCMalloc when the models run on "
                             "CPU and it is installed (LD_PRELOAD; faster CPU forwards), else glibc's malloc")
    parser.add_argument("--mps", action="store_true",
                        help="run the server's processes under a CUDA MPS daemon of its own: the draft's and the "
                             "target's kernels side by side on a shared GPU instead of time-sliced")
    parser.add_argument("--set", action="append", default=[], metavar="MODEL.PARAMETER=VALUE",
                        help="override a config.pbtxt parameter of the rendered repository (repeatable), "
                             "e.g. target_model.batched_forward=false")
    parser.add_argument("--served-model-name", action="append", default=[],
                        help="the model name OpenAI clients send (repeatable: aliases); default: the target's "
                             "directory name")
    parser.add_argument("--openai-upstream", choices=tn.UPSTREAMS, default="direct",
                        help="what the OpenAI API calls: direct = preprocessing, then speculative_decoding itself "
                             "(no postprocessing step for each streamed response); ensemble = the ensemble, as a "
                             "Triton client does")
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="how the target writes tool calls, so that the OpenAI API takes tool_choice \"auto\" "
                             "(hermes: Qwen2.5, Hermes, SmolLM3; llama3_json: Llama 3.1-3.3; mistral: Mistral's "
                             "[TOOL_CALLS]; pythonic: Llama 3.2 and 4's [f(a=1)]; qwen3_coder or qwen3_xml: Qwen3-Coder's "
                             "<function=f><parameter=a>; openai: gpt-oss's; deepseek_v3, deepseek_v31, deepseek_v32: "
                             "DeepSeek's; "
                             "kimi_k2: Kimi K2's; glm45, glm47: GLM-4.5's; minimax_m2: MiniMax-M2's <invoke>); "
                             "without it a request's tools are "
                             "called only by name or with tool_choice \"required\"")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's flag, taken so that its command lines serve unchanged: tool_choice \"auto\" is on "
                             "wherever --tool-call-parser names the model's format (which it needs)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="how the target writes its thinking, so that the OpenAI API's chat answers carry it "
                             "apart (reasoning_content; the Responses API's reasoning item) and a structured output "
                             "constrains only the answer: deepseek_r1 (DeepSeek-R1, QwQ, Qwen3-Thinking-2507: all "
                             "before </think>) or qwen3 (Qwen3's hybrid models: a block the answer opens)")
    parser.add_argument("--responses-store-mb", type=float, default=None,
                        help="memory the OpenAI API keeps the Responses API's stored responses in (which "
                             "previous_response_id continues; as much again for conversations; least recently used "
                             "out first; 0: none stored; "
                             f"default {RESPONSES_STORE_MB:g}). Each replica keeps its own, unless "
                             "--responses-store-dir")
    parser.add_argument("--responses-store-dir", default=None,
                        help="keep the Responses API's stored responses and conversations as files in this "
                             "directory (within --responses-store-mb): replicas that mount the same one (a "
                             "ReadWriteMany volume) continue each other's conversations, and a restart forgets none")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true", default=allowed_by_environment(),
                        help="the OpenAI API serves POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), "
                             "adding and removing adapters as links in --lora-directory, which the API's process "
                             f"must be able to write (default: vLLM's {RUNTIME_ENV}=True in the environment)")
    parser.add_argument("--torch-profiler-dir", default=live_profile.directory_from_env(os.environ), metavar="DIR",
                        help="clients may start and stop torch profiles of the models' executions (POST "
                             "/start_profile and /stop_profile on the OpenAI API's port, vLLM's and SGLang's), "
                             "traced into this directory (default: $" + live_profile.DIR_ENV + ", else vLLM's "
                             "and SGLang's variables; none: not served)")
    cors.add_flags(parser)
    parser.add_argument("--model-repository", help="serve this already rendered repository as is")
    parser.add_argument("--triton-root", default=os.environ.get("TRITON_ROOT"),
                        help="an installed Triton (e.g. /opt/tritonserver) instead of the wheel's server")
    parser.add_argument("--run-dir", default=None, help="where the rendered repository and backends go")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--stall-timeout", type=float, default=ENDPOINTS_STALL_S,
                        help="a server whose endpoints are not up this long after it loaded its models is "
                             f"stalled: it is killed and started again (at most {START_ATTEMPTS} starts)")
    parser.add_argument("--drain-timeout", type=float, default=60.0,
                        help="after SIGTERM: readiness drops, requests in flight may finish for this long")
    parser.add_argument("--heal-timeout", type=float, default=300.0,
                        help="a model whose stub died is brought back (watchdog.py); down longer than this, "
                             "liveness (GET /live on HEALTH_PORT) fails")
    parser.add_argument("--hang-timeout", type=float, default=DEFAULT_HANG_TIMEOUT_S,
                        help="an orchestrator instance whose event loop has not turned for this long while it had "
                             "requests generating is hung: its stub is killed and the server restarted; a text "
                             "model's instance in one execute this long likewise, reloaded in place; the OpenAI API "
                             "not answering its health check this long is killed and started again (0: never)")
    parser.add_argument("--no-heal", dest="heal", action="store_false",
                        help="no watchdog: a dead stub stays dead (and readiness does not notice)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):  # `vllm serve MODEL ...`'s model, first and unnamed: the target
        argv = ["--target", *argv]
    args, extra = parser.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    if args.set and args.model_repository:
        parser.error("--set edits a rendered repository; --model-repository is served as is")
    if (args.chat_template not in (None, APPLY_CHAT_TEMPLATE) or args.trust_request_chat_template
            or args.chat_template_content_format != "auto") and args.model_repository:
        parser.error("--chat-template, --trust-request-chat-template and --chat-template-content-format are set in "
                     "a rendered repository; --model-repository is served as is (preprocessing's chat_template, "
                     "trust_request_chat_template and chat_template_content_format parameters)")
    if args.generation_config not in (AUTO, VLLM) and args.model_repository:
        parser.error("--generation-config DIR is set in a rendered repository; --model-repository is served as is "
                     "(the speculative_decoding model's generation_config parameter); auto and vllm are the API's")
    try:  # the OpenAI API's settings, refused before anything starts
        api_defaults(VLLM, "", args.override_generation_config)
        cors.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.executor and args.model_repository:
        parser.error("--executor is set in a rendered repository; --model-repository is served as is (its "
                     "models' executor parameter)")
    try:
        reasoning_for(args.tool_call_parser, args.reasoning_parser)
    except ValueError as exc:
        parser.error(str(exc))
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (how the model writes its calls)")
    if args.orchestrator_instances is not None and args.orchestrator_instances < 1:
        parser.error(f"--orchestrator-instances must be at least 1, got {args.orchestrator_instances}")
    if any(not arg.startswith("--") for arg in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)} (server flags go after `--`)")
    args.speculative_ignored = ()
    try:
        args.engine = engine_flags.read(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.engine.changes_repository and args.model_repository:
        parser.error(f"{', '.join(args.engine.given)} set a rendered repository's parameters; --model-repository is "
                     "served as is (--set after rendering, or its config.pbtxt)")
    if args.engine.generation_config is not None:
        if args.generation_config not in (AUTO, args.engine.generation_config):
            parser.error(f"--sampling-defaults and --generation-config {args.generation_config} disagree")
        args.generation_config = args.engine.generation_config
    args.dtype = engine_flags.dtype(args.dtype, args.device, args.target)
    if args.engine.compile_off:
        if args.compile not in ("auto", "off"):
            parser.error(f"--enforce-eager / --disable-cuda-graph and --compile {args.compile} disagree")
        args.compile = "off"
    if args.engine.fp8:
        if args.weights_dtype not in ("same", engine_flags.FP8):
            parser.error(f"--quantization fp8 and --weights-dtype {args.weights_dtype} disagree")
        args.weights_dtype = engine_flags.FP8
    args.set = [*args.engine.settings, *args.set]  # (an explicit --set of the same parameter wins)
    args.model_name = ""  # the OpenAI API's default model name where not the tokenizer's directory's
    sglang = _sglang_flags(args)
    if args.speculative_config is not None or sglang:
        _apply_speculative_config(parser, args, sglang)
    if args.target and Path(args.target).is_dir():
        _apply_speculator(parser, args)
    if not any(arg.startswith("--model-control-mode=") for arg in extra):
        # Explicit model control lets the watchdog reload one model in place (`--load-model=*`: all of
        # them at start, as in the default mode). The repository API it opens answers only this launcher:
        # a key of its own, new at every start (the chart passes its own mode and key).
        extra = ["--model-control-mode=explicit", "--load-model=*", *extra]
        if not any(arg.startswith(("--http-restricted-api=", "--grpc-restricted-protocol=")) for arg in extra):
            key = secrets.token_hex(16)
            extra += [f"--http-restricted-api=model-repository:{LAUNCHER_KEY_HEADER}={key}",
                      f"--grpc-restricted-protocol=model-repository:{LAUNCHER_KEY_HEADER}={key}"]
    args.server_args = extra
    return args


def _sglang_flags(args: argparse.Namespace) -> list[str]:
    """SGLang's speculative flags given on the command line (speculative_config.from_sglang reads them)."""
    return [flag for flag in (speculative_config.SGLANG_ALGORITHM, speculative_config.SGLANG_PATH,
                              speculative_config.SGLANG_STEPS, speculative_config.SGLANG_TOPK,
                              speculative_config.SGLANG_TOKENS, *speculative_config.SGLANG_THRESHOLDS,
                              *speculative_config.SGLANG_NGRAM_WINDOW, *speculative_config.SGLANG_ENGINE_FLAGS)
            if getattr(args, flag.removeprefix("--").replace("-", "_")) is not None]


def _apply_speculative_config(parser: argparse.ArgumentParser, args: argparse.Namespace,
                              sglang: list[str]) -> None:
    """--speculative-config (vLLM's) or SGLang's speculative flags (`sglang`: those given) as the flags they stand
    for (speculative_config.py); refused beside them and beside each other."""
    given = speculative_config.FLAG if args.speculative_config is not None else "SGLang's " + ", ".join(sglang)
    if not args.target:
        parser.error(f"{given} needs --target (the model it drafts for)")
    if args.draft != tn.NGRAM or args.draft_head or args.num_draft_tokens != tn.DEFAULT_NUM_DRAFT_TOKENS:
        parser.error(f"{given} and --draft, --draft-head or --num-draft-tokens both say how to draft: give one")
    if args.speculative_config is not None and sglang:
        parser.error(f"{speculative_config.FLAG} (vLLM's) and {', '.join(sglang)} (SGLang's) both say how to draft: "
                     "give one")
    try:
        if args.speculative_config is not None:
            spec = speculative_config.read(args.speculative_config)
        else:
            if args.speculative_algorithm is None:
                raise ValueError(f"{', '.join(sglang)} need {speculative_config.SGLANG_ALGORITHM} (SGLang's)")
            engine = tuple(flag for flag in sglang if flag in speculative_config.SGLANG_ENGINE_FLAGS)
            spec = speculative_config.from_sglang(
                args.speculative_algorithm, args.speculative_draft_model_path, args.speculative_num_steps,
                args.speculative_eagle_topk, args.speculative_num_draft_tokens,
                (args.speculative_accept_threshold_single, args.speculative_accept_threshold_acc), engine,
                (args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size))
    except ValueError as exc:
        parser.error(str(exc))
    if spec.draft:
        args.draft = spec.draft
    if spec.head or spec.mtp:  # (MTP: the target's own layer, unless the config names where it is)
        args.draft_head = [spec.head or args.target]
    if spec.num_draft_tokens:
        args.num_draft_tokens = spec.num_draft_tokens
        args.max_num_draft_tokens = max(args.max_num_draft_tokens, spec.num_draft_tokens)
    args.set = [*spec.settings, *args.set]  # (an explicit --set of the same parameter wins)
    args.speculative_ignored = spec.ignored


def _apply_speculator(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--target a head in the speculators library's layout: served as vLLM serves it, its verifier the target
    and itself the head (speculative_config.speculator); refused beside flags that draft otherwise."""
    try:
        found = speculative_config.speculator(args.target)
    except ValueError as exc:
        parser.error(str(exc))
    if found is None:
        return
    if args.draft != tn.NGRAM or args.draft_head or args.speculative_config is not None:
        parser.error(f"--target {args.target} is a draft head with its verifier; --draft, --draft-head and "
                     f"{speculative_config.FLAG} draft otherwise: give the verifier as --target to choose")
    # named as the head's directory, as vLLM names the model it was given (`vllm serve .../speculator.eagle3`)
    args.model_name = default_model_name(args.target)
    args.target, args.draft_head = found.target, [found.head]
    if found.num_draft_tokens and args.num_draft_tokens == tn.DEFAULT_NUM_DRAFT_TOKENS:
        args.num_draft_tokens = found.num_draft_tokens
        args.max_num_draft_tokens = max(args.max_num_draft_tokens, found.num_draft_tokens)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(args.engine.env)  # --port, --api-key: read where the API's port and key are read
    for note in args.engine.notes:
        log(note)
    label = "custom" if args.target else ("repository" if args.model_repository else args.pair)
    run_dir = Path(args.run_dir or pairs.cache_dir() / "run" / label).resolve()
    limits.raise_open_files()  # tritonserver and the OpenAI API inherit it: a descriptor per client connection
    taken = taken_ports()
    if taken:
        log(f"{taken} (another server listens there: stop it, or set the variable to a free port; OPENAI_PORT and "
            "HEALTH_PORT 0: none)")
        return 1
    if openai_port():
        try:  # the OpenAI API's TLS files (OPENAI_SSL_*), checked before anything is prepared or started
            files = tls.from_env()
            tls.server_context(files)
            tls.check_probe(files)
        except ValueError as exc:
            log(f"the OpenAI API: {exc}")
            return 1
    # --apply-chat-template, or --chat-template alone (its meaning before it took vLLM's template)
    applied = args.apply_chat_template or args.chat_template == APPLY_CHAT_TEMPLATE
    if args.model_repository:
        repo = Path(args.model_repository).resolve()
    else:
        if args.target:
            pair = pairs.custom_pair(
                args.target, args.draft, args.tokenizer, dtype=args.dtype, device=args.device,
                target_gpu=args.target_gpu, spread_target=args.spread_target, draft_gpu=args.draft_gpu,
                default_num_draft_tokens=args.num_draft_tokens, max_num_draft_tokens=args.max_num_draft_tokens,
                max_context_tokens=args.max_context_tokens, apply_chat_template=applied,
                draft_lora_layers={tn.DRAFT_MODEL_NAME: args.draft_lora_layers} if args.draft_lora_layers else {})
            if args.draft_lora_layers and not pair.draft_paths:
                log(f"--draft-lora-layers is a draft model's; --draft {args.draft} is none")
                return 2
        else:
            pair = pairs.prepare_pair(args.pair)
        try:
            template = (read_chat_template(args.chat_template, "--chat-template")
                        if args.chat_template not in (None, APPLY_CHAT_TEMPLATE) else "")
        except ValueError as exc:
            log(str(exc))
            return 2
        if args.generation_config not in (AUTO, VLLM):
            pair = dataclasses.replace(pair, generation_config=str(Path(args.generation_config).resolve()))
        # The file's sampling fields checked before anything starts (a DIR that is not there too; a target that is
        # not there fails its load, naming it); the orchestrator reads the end tokens again at load
        source = pair.generation_config or pair.target_path
        try:
            api_defaults(args.generation_config if args.generation_config != AUTO or Path(source).exists() else VLLM,
                         source, args.override_generation_config)
        except ValueError as exc:
            log(str(exc))
            return 2
        pair = dataclasses.replace(pair, chat_template=template or pair.chat_template,
                                   apply_chat_template=pair.apply_chat_template or applied,
                                   trust_request_chat_template=args.trust_request_chat_template,
                                   chat_template_content_format=args.chat_template_content_format)
        pair = dataclasses.replace(pair, compile=args.compile, orchestrator_instances=args.orchestrator_instances,
                                   weights_dtype=args.weights_dtype, executor=args.executor or pair.executor)
        if args.engine.max_live_sequences is not None:
            pair = dataclasses.replace(pair, max_live_sequences=args.engine.max_live_sequences)
        if args.engine.prefix_caching is not None:
            pair = dataclasses.replace(pair, prefix_caching=args.engine.prefix_caching)
        if args.draft_head or args.default_draft or args.skip_draft or args.skip_draft_lora or args.lora_modules \
                or args.lora_directory or args.max_loras or args.max_lora_rank:
            try:
                pair = with_heads(with_skip_drafts(pair, args.skip_draft), args.draft_head, args.default_draft)
                if args.skip_draft_lora:
                    if not pair.skip_drafts:
                        raise ValueError("--skip-draft-lora needs a layer-skip self-draft (--skip-draft)")
                    pair = dataclasses.replace(pair, draft_lora_layers={
                        **pair.draft_lora_layers, **{name: FIRST_LAYERS for name in pair.skip_drafts}})
                pair = with_lora_adapters(pair, args.lora_modules, args.lora_directory, args.max_loras,
                                          args.max_lora_rank)
            except ValueError as exc:
                log(str(exc))
                return 2
        if args.heads_in_target:  # every head hosted in target_model's process
            pair = dataclasses.replace(pair, hosted_heads={**pair.hosted_heads, **pair.draft_heads}, draft_heads={})
        repo = repository.render(pair, run_dir / "model_repository")
        for setting in args.set:
            repository.override(repo, setting)
        if args.speculative_ignored:
            vllm = args.speculative_config is not None
            log(f"{speculative_config.FLAG + ': ' if vllm else ''}{', '.join(args.speculative_ignored)} tune "
                f"{'vLLM' if vllm else 'SGLang'}'s engine, nothing here")
    orphaned = remove_ended_servers_scratch(run_dir)
    if orphaned:
        log(f"removed {orphaned} scratch directories of this run directory's last server, which ended without "
            f"its launcher ({cancellation.scratch_base()})")
    layout = triton_layout(run_dir, Path(args.triton_root) if args.triton_root else None)
    http_port, grpc_port, metrics_port = ports()
    # The marker through which the API resets the models' caches (cache_reset.py): in the environment of
    # tritonserver's stubs and of the API alike
    os.environ[cache_reset.ENV] = str(cache_reset.marker(http_port))
    os.environ[loopback.URL_ENV] = f"127.0.0.1:{grpc_port}"  # where vllm_compatible reaches the ensemble
    if args.torch_profiler_dir:  # clients' torch profiles of the models (live_profile.py), the same way
        os.environ[live_profile.DIR_ENV] = os.path.abspath(args.torch_profiler_dir)
        control = live_profile.control_file(http_port)
        control.unlink(missing_ok=True)  # an earlier server's on this port
        os.environ[live_profile.CONTROL_ENV] = str(control)
        log(f"profiling on request: POST /start_profile and /stop_profile; traces into {args.torch_profiler_dir}")
    else:
        os.environ.pop(live_profile.CONTROL_ENV, None)
    try:
        allocator_env, allocator_line = allocator.environment(args.allocator, allocator.models_on_cpu(repo))
    except ValueError as exc:
        log(str(exc))
        return 2
    log(allocator_line)
    command = server_command(layout, repo, http_port, grpc_port, metrics_port, extra=args.server_args)
    log(f"starting tritonserver ({label}): {' '.join(redact(arg) for arg in command)}")
    drain_marker(http_port).unlink(missing_ok=True)  # left by an earlier server on this port
    gateway = None
    if openai_port():
        tokenizer = repository_tokenizer(repo)
        context, default_max_tokens = repository_limits(repo)
        lora = repository.served_adapters(repo)
        if args.allow_runtime_lora_updating and not lora[1]:
            log("--allow-runtime-lora-updating needs --lora-directory (the adapters it loads are links there; in "
                f"the chart models.loraClaim), or {RUNTIME_ENV} unset")
            return 2
        names = args.served_model_name or [args.model_name or default_model_name(tokenizer)]
        gateway = GatewayProcess(openai_port(), grpc_port, names,
                                 tokenizer, args.drain_timeout, dict(os.environ), args.tool_call_parser,
                                 context, args.reasoning_parser, args.responses_store_mb, default_max_tokens,
                                 args.responses_store_dir, lora, args.allow_runtime_lora_updating,
                                 repository_chat_template(repo), repository_trusts_request_templates(repo),
                                 (VLLM if args.generation_config == VLLM else repository_generation_config(repo),
                                  args.override_generation_config),
                                 (args.allowed_origins, args.allowed_methods, args.allowed_headers,
                                  args.allow_credentials), repository_content_format(repo), metrics_port,
                                 repository_max_loras(repo), hang_timeout_s=args.hang_timeout if args.heal else 0.0,
                                 upstream=args.openai_upstream)
    watchdog = None
    if args.heal:
        # Reloading one model in place needs explicit model control; without it the watchdog heals by
        # restarting the server.
        control = (ModelControl(http_port, restricted_header(args.server_args), args.ready_timeout)
                   if control_mode(args.server_args) == "explicit" else None)
        server_metrics = RecentScrape(metrics_port)  # one scrape for both reads of a look
        watchdog = Watchdog(http_port, control, heal_timeout_s=args.heal_timeout, log=log,
                            stalls=lambda: unanswered_calls(server_metrics.text()),
                            heartbeats=lambda: orchestrator_heartbeats(server_metrics.text()),
                            hang_timeout_s=args.hang_timeout,
                            stamps=lambda pid: execute_clock.stamps(execute_clock.default_directory(pid)),
                            queues=lambda: model_queues(server_metrics.text()))
    endpoint = None
    if health_port():
        try:
            endpoint = ReadinessEndpoint(health_port(), http_port, openai_port=gateway.port if gateway else 0,
                                         live_problem=watchdog.live_problem if watchdog else lambda: None,
                                         metrics=watchdog.metrics_text if watchdog else lambda: "")
        except OSError as exc:
            log(f"HEALTH_PORT {health_port()}: cannot serve the readiness endpoint ({exc}); "
                "set HEALTH_PORT to a free port, or to 0 for none")
            return 1
        log(f"readiness: http://localhost:{endpoint.port}{READY_PATH}")
    mps_daemon = None
    if args.mps:
        mps_daemon = mps.MpsDaemon()
        try:
            mps_daemon.start()
        except mps.MpsError as exc:
            log(str(exc))
            mps_daemon.stop()
            if endpoint is not None:
                endpoint.close()
            return 1
        log(f"CUDA MPS: a daemon of this server's own ({mps_daemon.env['CUDA_MPS_PIPE_DIRECTORY']})")

    def start_server() -> ServerProcess:
        # Its own process group, which its stubs join: whatever outlives it is found and stopped below.
        extra = {**allocator_env, **(mps_daemon.env if mps_daemon else {})}
        server = ServerProcess(command, env=server_env(layout, extra), stall_s=args.stall_timeout)
        (run_dir / SERVER_PID_FILE).write_text(f"{server.pid}\n")  # for the next launcher, if this one is killed
        return server

    current = [start_server()]  # the server process (a restart replaces it; the signal handler reads it)
    if gateway is not None:
        gateway.start()
    stopping = threading.Event()
    serving = threading.Event()

    def stop(signum: int) -> None:
        # The first signal drains (see `drain`); a second one, or one before the models are up, stops now.
        # "Up" is asked of Triton itself: the wait below notices readiness only at its next look, and a
        # client that saw the server ready first may already be streaming.
        process = current[0].process
        if not (stopping.is_set() or serving.is_set()) and process.poll() is None and is_ready(http_port, 1.0):
            serving.set()
        again = stopping.is_set()
        stopping.set()  # before the server is stopped: the main loop must not take that exit for a crash
        if again or not serving.is_set():
            log(f"signal {signum}: stopping tritonserver")
            if process.poll() is None:
                process.terminate()
            if gateway is not None and again:
                gateway.kill()  # a second signal waits for no answer in flight, the OpenAI API's included
        else:
            drain_marker(http_port).touch()  # readiness drops now, not at the main loop's next look
            log(f"signal {signum}: draining (a second signal stops at once)")

    on_signals(stop)
    try:
        come_up(current, start_server, http_port, metrics_port, args.ready_timeout, stopping)
        if not stopping.is_set():
            serving.set()
            if watchdog is not None:
                watchdog.arm(current[0].pid)
                watchdog.start()
            openai = ""
            if gateway is not None:
                wait_gateway(gateway, stopping)
                openai = f" OpenAI API {gateway.url}"
            log(f"READY: http://localhost:{http_port} grpc localhost:{grpc_port} "
                f"metrics http://localhost:{metrics_port}/metrics{openai} ({label})")
    except (RuntimeError, TimeoutError) as exc:
        log(str(exc))
        if current[0].process.poll() is None:
            current[0].process.terminate()
    while not stopping.wait(0.5):
        if gateway is not None:
            gateway.keep_alive()
        crash = current[0].crash()
        if crash is not None:
            if not serving.is_set() or stopping.is_set():
                break  # it never served (logged above), or a signal stops it
            if watchdog is None:
                log(f"tritonserver {crash}; stopping (--no-heal)")
                if current[0].process.poll() is None:
                    current[0].process.kill()
                    current[0].process.wait()
                break
            if not restart_server(current, start_server, watchdog, http_port, metrics_port, args, stopping, crash):
                break
        elif watchdog is not None and watchdog.restart_wanted.is_set():
            if not restart_server(current, start_server, watchdog, http_port, metrics_port, args, stopping):
                break
    if watchdog is not None:
        watchdog.close()  # a stopping server's models unload: nothing to heal from here on
    if gateway is not None:
        gateway.drain()  # it takes no new connection; its answers in flight are served below
    process = current[0].process
    if process.poll() is None and serving.is_set():
        # One budget for both waits: a stuck OpenAI answer must not add a second --drain-timeout to the
        # stop that a supervisor (Kubernetes' grace period, a test's timeout) has sized for one.
        deadline = time.monotonic() + args.drain_timeout
        drain(http_port, metrics_port, process, args.drain_timeout)
        if gateway is not None:
            gateway.wait(max(1.0, deadline - time.monotonic()))
        if process.poll() is None:
            if watchdog is not None:  # what its stop cannot unload: no reason to wait its exit timeout for them
                current[0].stranded_models = watchdog.stranded_versions()
            process.terminate()
    if gateway is not None:
        gateway.wait(10)
    code = current[0].stopped(log)  # killed where its stop hangs (server_process.py)
    if endpoint is not None:
        endpoint.close()
    stop_group(process, watchdog.regions if watchdog is not None else set())
    current[0].flushed()
    if mps_daemon is not None:  # its clients are gone
        mps_daemon.stop()
    return code


def retire(server: ServerProcess, regions: set[str]) -> None:
    """Kill a server that is to be replaced (if it still runs), stop what outlives it (`stop_group`), and
    copy its last lines (a crash's stack trace) before the new server's."""
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait()
    stop_group(server.process, regions)
    server.flushed()


# The last tritonserver's PID, in the run directory: a launcher killed outright (SIGKILL, the OOM killer) cannot
# remove its stubs' scratch directories (`stop_group`), so the next launcher of that run directory does.
SERVER_PID_FILE = "tritonserver.pid"


def scratch_directories(server_pid: int) -> list[Path]:
    """The directories a server's stubs share (named after its PID): cancellation flags, live-sequence slots,
    the KV-room line, the execute clocks."""
    return [cancellation.default_directory(server_pid), kv_room.default_directory(server_pid),
            execute_clock.default_directory(server_pid), *sequence_slots.server_directories(server_pid)]


def remove_ended_servers_scratch(run_dir: Path) -> int:
    """Remove the scratch directories of the run directory's last server if it no longer runs, and say how
    many there were. Only that server's: /dev/shm may be shared with other PID namespaces (containers with
    `--ipc=host`), whose servers' PIDs this process cannot see, so a PID that is not running here says nothing
    of a directory it did not start."""
    try:
        pid = int((run_dir / SERVER_PID_FILE).read_text())
    except (OSError, ValueError):
        return 0
    if process_exists(pid):  # still running (a process that took the PID since: its directories are kept)
        return 0
    found = [path for path in scratch_directories(pid) if path.is_dir()]
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    (run_dir / SERVER_PID_FILE).unlink(missing_ok=True)
    return len(found)


def process_exists(pid: int) -> bool:
    """Whether the process runs: a zombie does not (a killed launcher's server may wait a long while for a
    reaper that never comes)."""
    if Path("/proc/self/stat").exists():
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def stop_group(process: subprocess.Popen, regions: set[str] = frozenset()) -> None:
    """Stop whatever of a (stopped) server outlives it and remove what its stubs shared: the scratch
    directories and the stubs' shared-memory `regions` (Triton removes them when a model unloads, not when
    a stub or the server is killed)."""
    # Nothing of the server may outlive it: an orphaned stub would hold its memory (on a GPU, device
    # memory) for good. One was seen once, half an hour after its server stopped.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    for scratch in scratch_directories(process.pid):
        shutil.rmtree(scratch, ignore_errors=True)
    for region in regions:
        if region and "/" not in region:
            Path("/dev/shm", region).unlink(missing_ok=True)


class RecentScrape:
    """The server's metrics text, scraped at most once per `max_age_s`: the watchdog reads two families
    in each look (every 5 s), and Triton renders the whole text (~25 kB) for each scrape."""

    def __init__(self, metrics_port: int, max_age_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.url, self.max_age_s, self.clock = f"127.0.0.1:{metrics_port}", max_age_s, clock
        self._text, self._at = "", -float("inf")

    def text(self) -> str:
        if self.clock() - self._at >= self.max_age_s:
            self._text = scrape(self.url)  # raises OSError where the server does not answer: nothing kept
            self._at = self.clock()
        return self._text


def sample_lines(text: str, *names: str) -> str:
    """The lines of the server's metrics text that hold samples of `names` (with labels): parsing the whole
    text (Triton's metrics, ~25 kB) took ~10 ms of CPU a read."""
    prefixes = tuple(name + "{" for name in names)
    return "\n".join(line for line in text.splitlines() if line.startswith(prefixes)) + "\n"


def unanswered_calls(text: str) -> dict[str, float]:
    """Per model, the calls the orchestrator's instances gave up waiting for (tn.MODEL_CALL_TIMEOUTS), from
    the server's metrics text."""
    counts: dict[str, float] = {}
    for labels, value in samples(sample_lines(text, tn.MODEL_CALL_TIMEOUTS), tn.MODEL_CALL_TIMEOUTS):
        counts[labels.get("model", "")] = counts.get(labels.get("model", ""), 0.0) + value
    return counts


def orchestrator_heartbeats(text: str) -> dict[str, tuple[float, float]]:
    """Per orchestrator instance that has served: its event loop's turns and its requests generating
    (tn.ORCHESTRATOR_HEARTBEATS, tn.LIVE_SEQUENCES), from the server's metrics text."""
    text = sample_lines(text, tn.ORCHESTRATOR_HEARTBEATS, tn.LIVE_SEQUENCES)
    live = {labels.get("instance", ""): value for labels, value in samples(text, tn.LIVE_SEQUENCES)}
    return {labels.get("instance", ""): (value, live.get(labels.get("instance", ""), 0.0))
            for labels, value in samples(text, tn.ORCHESTRATOR_HEARTBEATS)}


def model_queues(text: str) -> dict[str, tuple[float, float]]:
    """Per model, Triton's requests pending (waiting to execute) and executions done, from the server's
    metrics text (every version summed)."""
    names = ("nv_inference_pending_request_count", "nv_inference_exec_count")
    text = sample_lines(text, *names)
    found: dict[str, list[float]] = {}
    for column, name in enumerate(names):
        for labels, value in samples(text, name):
            found.setdefault(labels.get("model", ""), [0.0, 0.0])[column] += value
    return {model: (pending, executions) for model, (pending, executions) in found.items()}


def healthy_in_flight(metrics_port: int, dead_instances: set[str]) -> float:
    """Requests the server's healthy orchestrator instances still generate (a dead instance's gauge is
    stale: its streams hang until the server stops)."""
    text = scrape(f"127.0.0.1:{metrics_port}")
    return sum(value for labels, value in samples(text, tn.LIVE_SEQUENCES)
               if labels.get("instance") not in dead_instances)


def restart_server(current: list[ServerProcess], start_server, watchdog: Watchdog, http_port: int, metrics_port: int,
                   args: argparse.Namespace, stopping: threading.Event, crash: str | None = None) -> bool:
    """Heal by restarting tritonserver: to bring back a model that cannot be reloaded (watchdog.py says
    when), the healthy instances' streams finish first (at most --drain-timeout); after the server's own
    `crash`, at once, after the backoff of a server that keeps crashing. Then the old server stops and a new
    one loads every model. False when it did not come back (the launcher then exits with the server's code)
    or a signal came meanwhile."""
    server = current[0]
    old = server.process
    wait_s = 0.0
    if crash is not None:
        wait_s = watchdog.server_down(crash)
        log(f"watchdog: tritonserver {crash}; restarting it" + (f" in {wait_s:.0f} s" if wait_s else ""))
    deadline = time.monotonic() + (0.0 if crash else args.drain_timeout)
    dead = watchdog.dead_instances()
    busy = None
    while time.monotonic() < deadline and not stopping.is_set() and old.poll() is None:
        try:
            busy = healthy_in_flight(metrics_port, dead)
        except OSError:
            break
        if busy == 0:
            break
        time.sleep(0.25)
    if stopping.is_set() and crash is None:
        return False  # the launcher stops: the server is drained and stopped as at any stop
    if crash is None:
        log(f"watchdog: restarting tritonserver ({'no' if not busy else int(busy)} healthy streams left)")
    # Not SIGTERM: the dead instance's streams would hold a graceful exit for its whole exit timeout.
    retire(server, watchdog.regions)
    watchdog.regions.clear()
    if stopping.wait(wait_s):
        return False
    current[0] = start_server()
    try:
        come_up(current, start_server, http_port, metrics_port, args.ready_timeout, stopping)
    except (RuntimeError, TimeoutError) as exc:
        log(f"watchdog: the restarted server did not come up: {exc}")
        if current[0].process.poll() is None:
            current[0].process.terminate()
        return False
    if stopping.is_set():
        return False
    watchdog.arm(current[0].pid)
    log(f"watchdog: tritonserver restarted and ready (server restart {watchdog.server_restarts})")
    return True


if __name__ == "__main__":
    sys.exit(main())
