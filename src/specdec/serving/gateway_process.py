"""The OpenAI API's process (`python -m specdec.gateway`) as the launcher runs it beside tritonserver:
started with the server, restarted if it dies or hangs (its health check unanswered for the launcher's
--hang-timeout), drained first on SIGTERM (it stops taking connections and finishes the answers in flight
while tritonserver, still up, serves them), and sent SIGTERM by the kernel if the launcher dies
(`server_process.die_with_launcher`)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from specdec.decoding.generation_config import VLLM
from specdec.gateway import tls
from specdec.gateway.cors import ANY_JSON as CORS_ANY
from specdec.serving.healthcheck import answers, api_host, gateway_url
from specdec.serving.pairs import log
from specdec.serving.server_process import die_with_launcher

def _parameter(repo: Path, model: str, key: str) -> str:
    try:
        config = (repo / model / "config.pbtxt").read_text()
    except OSError:
        return ""
    match = re.search(r'key: "%s", value: \{ string_value: "([^"]*)" \}' % key, config)
    return match.group(1) if match else ""


def _preprocessing_parameter(repo: Path, key: str) -> str:
    return _parameter(repo, "preprocessing", key)


def repository_generation_config(repo: Path) -> str:
    """Where the rendered repository's orchestrator reads the model's generation_config.json (its end tokens), so
    that the OpenAI API takes its sampling defaults from the same file; "" for none."""
    return _parameter(repo, "speculative_decoding", "generation_config")


def repository_tokenizer(repo: Path) -> str:
    """The tokenizer the rendered repository's preprocessing model loads ("" when it names none)."""
    return _preprocessing_parameter(repo, "tokenizer_path")


def repository_chat_template(repo: Path) -> str:
    """The chat template file preprocessing reads instead of the tokenizer's (its `chat_template` parameter,
    relative to its directory), so that the OpenAI API's /tokenize renders chats as the server does; "" for none."""
    name = _preprocessing_parameter(repo, "chat_template")
    return str(repo / "preprocessing" / name) if name else ""


def repository_trusts_request_templates(repo: Path) -> bool:
    """Whether the rendered repository's preprocessing takes a request's own chat template, so that the OpenAI
    API passes one on (and counts its prompt tokens with it) rather than refusing it."""
    return _preprocessing_parameter(repo, "trust_request_chat_template") == "true"


def repository_content_format(repo: Path) -> str:
    """How the rendered repository's preprocessing hands a message's content to the chat template (its
    `chat_template_content_format` parameter; "auto" where it names none)."""
    return _preprocessing_parameter(repo, "chat_template_content_format") or "auto"


def repository_max_loras(repo: Path) -> int:
    """The rendered repository's target_model's max_loras (0: its default)."""
    value = _parameter(repo, "target_model", "max_loras")
    return int(value) if value.isdigit() else 0


def repository_device(repo: Path) -> str:
    """The device the rendered repository's target_model runs on (its `device` parameter: "cpu", "cuda"), or ""."""
    return _parameter(repo, "target_model", "device")


def repository_limits(repo: Path) -> tuple[int, int]:
    """The context (tokens) the rendered repository's orchestrator admits requests within and what it generates
    for a request that does not say (its default_max_tokens); 0 for either not found."""
    found = [_parameter(repo, "speculative_decoding", key) for key in ("max_context_tokens", "default_max_tokens")]
    return tuple(int(value) if value.isdigit() else 0 for value in found)


def default_model_name(tokenizer_path: str) -> str:
    """The name clients send as `model` unless --served-model-name says otherwise: the target's directory
    (or GGUF file) name, as vLLM names a model by its path."""
    path = Path(tokenizer_path)
    return (path.stem if path.suffix == ".gguf" else path.name) or "specdec"


HEALTH_LOOK_S = 5.0  # how often a running OpenAI API's health check is asked (with hang_timeout_s)
HEALTH_PROBE_TIMEOUT_S = 2.0  # its answer to GET /health comes from its event loop: milliseconds when it turns


class GatewayProcess:
    def __init__(self, port: int, grpc_port: int, names: list[str], tokenizer: str, drain_timeout_s: float,
                 env: dict[str, str], tool_call_parser: str | None = None, max_model_len: int = 0,
                 reasoning_parser: str | None = None, responses_store_mb: float | None = None,
                 default_max_tokens: int = 0, responses_store_dir: str | None = None,
                 lora: tuple[list[str], str] = ([], ""), runtime_lora: bool = False, chat_template: str = "",
                 trust_request_templates: bool = False, generation_config: tuple[str, str] = ("", ""),
                 cors: tuple[str, str, str, bool] = (CORS_ANY, CORS_ANY, CORS_ANY, False),
                 content_format: str = "auto", metrics_port: int = 0, max_loras: int = 0, hang_timeout_s: float = 0.0,
                 upstream: str = "direct"):
        """hang_timeout_s: a process whose health check has not answered this long is hung, killed and started
        again (0: never; readiness says not ready meanwhile, and before this nothing brought it back); upstream:
        its --upstream (tn.UPSTREAMS; direct: the repository it serves has preprocessing and speculative_decoding)."""
        self.port = port
        self.command = [sys.executable, "-m", "specdec.gateway", "--port", str(port), "--upstream", upstream,
                        "--grpc-url", f"127.0.0.1:{grpc_port}", "--drain-timeout", str(drain_timeout_s),
                        *[arg for name in names for arg in ("--served-model-name", name)]]
        if tokenizer:
            self.command += ["--tokenizer", tokenizer]
        if chat_template:
            self.command += ["--chat-template", chat_template]
        if trust_request_templates:
            self.command += ["--trust-request-chat-template"]
        if content_format != "auto":
            self.command += ["--chat-template-content-format", content_format]
        if metrics_port:  # the server's figures under vLLM's names on the API's /metrics
            self.command += ["--server-metrics-url", f"127.0.0.1:{metrics_port}"]
        if max_loras:
            self.command += ["--max-loras", str(max_loras)]
        config, override = generation_config  # (vllm, or the file the server reads; "": none) and the overrides
        self.command += ["--generation-config", config or VLLM]  # no file: no defaults of the model's
        if override:
            self.command += ["--override-generation-config", override]
        origins, methods, headers, credentials = cors  # vLLM's CORS flags (JSON lists), passed on as given
        for flag, value in (("--allowed-origins", origins), ("--allowed-methods", methods),
                            ("--allowed-headers", headers)):
            if value != CORS_ANY:
                self.command += [flag, value]
        if credentials:
            self.command += ["--allow-credentials"]
        if tool_call_parser:
            self.command += ["--tool-call-parser", tool_call_parser]
        if max_model_len:
            self.command += ["--max-model-len", str(max_model_len)]
        if default_max_tokens:
            self.command += ["--default-max-tokens", str(default_max_tokens)]
        if reasoning_parser:
            self.command += ["--reasoning-parser", reasoning_parser]
        if responses_store_mb is not None:
            self.command += ["--responses-store-mb", f"{responses_store_mb:g}"]
        if responses_store_dir:
            self.command += ["--responses-store-dir", responses_store_dir]
        names, directory = lora  # repository.served_adapters: models of their own names to its clients
        for name in names:
            self.command += ["--lora-module", name]
        if directory:  # and those of the directory the target reads on demand
            self.command += ["--lora-directory", directory]
        if runtime_lora:  # (an environment's VLLM_ALLOW_RUNTIME_LORA_UPDATING also reaches it)
            self.command += ["--allow-runtime-lora-updating"]
        self.env, self.drain_timeout_s = env, drain_timeout_s
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.hang_timeout_s, self.look_s, self.clock = hang_timeout_s, HEALTH_LOOK_S, time.monotonic
        self.probe = lambda: answers(gateway_url(self.port, api_host(self.env)), HEALTH_PROBE_TIMEOUT_S)
        self._answered = self._looked = 0.0  # when its health check last answered, and was last asked

    @property
    def url(self) -> str:
        host = api_host(self.env)
        return f"{tls.from_env(self.env).scheme}://{'localhost' if host == '127.0.0.1' else host}:{self.port}/v1"

    def start(self) -> None:
        self.process = subprocess.Popen(self.command, env=self.env, preexec_fn=die_with_launcher())
        self._answered = self._looked = self.clock()  # its start (about a second) counts as answered

    def keep_alive(self) -> None:
        """Start it again if it died, or if its health check has not answered for hang_timeout_s (asked every
        look_s; readiness says not ready meanwhile, as that check fails)."""
        if self.process is None:
            return
        if self.process.poll() is not None:
            self._again(f"exited with code {self.process.returncode}")
            return
        now = self.clock()
        if not self.hang_timeout_s or now - self._looked < self.look_s:
            return
        self._looked = now
        if self.probe():
            self._answered = now
        elif now - self._answered >= self.hang_timeout_s:
            self.process.kill()
            self.process.wait()
            self._again(f"has not answered its health check for {now - self._answered:.0f} s (hung); killed it")

    def _again(self, why: str) -> None:
        self.restarts += 1
        log(f"the OpenAI API {why}; starting it again (restart {self.restarts})")
        time.sleep(min(5.0, 0.5 * self.restarts))  # a gateway that cannot start must not spin
        self.start()

    def drain(self) -> None:
        """SIGTERM: it stops accepting connections; the answers in flight run on (wait with `wait`)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()

    def wait(self, timeout_s: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log(f"the OpenAI API still answering after {timeout_s:.0f} s; stopping it")
            self.process.kill()
            self.process.wait()

    def health_url(self) -> str:
        return gateway_url(self.port, api_host(self.env))
