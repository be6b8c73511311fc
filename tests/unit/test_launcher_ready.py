"""The launcher's wait for a server: HTTP readiness alone is not enough, the metrics endpoint must listen
too (Triton opens it some tens of milliseconds after HTTP, and the first scrape of a test or of the
drain would be refused). And its readiness endpoint (GET /ready), against a stand-in for Triton's."""

import http.server
import socket
import threading

import pytest

from tests.http_get import get as _get
from tests.polling import wait_for
from specdec.serving import healthcheck, launcher
from specdec.serving.server import free_ports

pytestmark = pytest.mark.usefixtures("server_ports_free")


class _Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the stdlib's name)
        self.send_response(200 if self.path == "/v2/health/ready" else 404)
        self.end_headers()

    def log_message(self, *_args):
        pass


class _Running:
    """Stands in for the tritonserver process: still running."""

    def poll(self):
        return None


@pytest.fixture
def ready_http():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_ready_waits_for_the_metrics_endpoint(ready_http):
    (metrics_port,) = free_ports(1)
    with pytest.raises(TimeoutError):
        launcher.wait_ready(ready_http, _Running(), timeout_s=1.2, metrics_port=metrics_port)
    launcher.wait_ready(ready_http, _Running(), timeout_s=1.2)  # without a metrics port: HTTP suffices
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", metrics_port))
        listener.listen()
        launcher.wait_ready(ready_http, _Running(), timeout_s=5, metrics_port=metrics_port)


def test_the_readiness_endpoint_answers_for_the_server_and_its_drain(ready_http):
    endpoint = healthcheck.ReadinessEndpoint(0, ready_http, host="127.0.0.1")
    url = f"http://127.0.0.1:{endpoint.port}"
    marker = healthcheck.drain_marker(ready_http)
    try:
        assert _get(url + "/ready") == (200, "ready\n")
        marker.touch()  # what the launcher does on SIGTERM
        status, text = _get(url + "/ready")
        assert status == 503 and "draining" in text
        marker.unlink()
        assert _get(url + "/ready?verbose=1")[0] == 200
        status, text = _get(url + "/v2/health/ready")
        assert status == 404 and "GET /ready" in text
    finally:
        marker.unlink(missing_ok=True)
        endpoint.close()
    (nothing_there,) = free_ports(1)
    endpoint = healthcheck.ReadinessEndpoint(0, nothing_there, host="127.0.0.1")
    try:
        status, text = _get(f"http://127.0.0.1:{endpoint.port}/ready")
        assert status == 503 and f"127.0.0.1:{nothing_there}/v2/health/ready" in text and "draining" not in text
    finally:
        endpoint.close()


def test_a_taken_health_port_stops_the_launcher_before_tritonserver_starts(monkeypatch, tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("HEALTH_PORT", str(port))
        started = []
        monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: started.append(a))
        monkeypatch.setattr(launcher, "triton_layout", lambda *a, **k: launcher.ServerLayout(tmp_path, tmp_path, ""))
        (repo := tmp_path / "repo").mkdir()
        assert launcher.main(["--model-repository", str(repo), "--run-dir", str(tmp_path)]) == 1
    assert not started
    assert f"HEALTH_PORT {port}: the port is taken (another server listens there" in capsys.readouterr().err


class _Health(http.server.BaseHTTPRequestHandler):
    """Stands in for the OpenAI API's GET /health."""

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *_args):
        pass


def test_readiness_covers_the_openai_api(ready_http):
    gateway = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    (nothing_there,) = free_ports(1)
    up = healthcheck.ReadinessEndpoint(0, ready_http, host="127.0.0.1", openai_port=gateway.server_address[1])
    down = healthcheck.ReadinessEndpoint(0, ready_http, host="127.0.0.1", openai_port=nothing_there)
    try:
        assert _get(f"http://127.0.0.1:{up.port}/ready") == (200, "ready\n")
        status, text = _get(f"http://127.0.0.1:{down.port}/ready")
        assert status == 503 and f"the OpenAI API at http://127.0.0.1:{nothing_there}/health" in text
    finally:
        up.close()
        down.close()
        gateway.shutdown()
        gateway.server_close()


def test_a_taken_openai_port_stops_the_launcher_before_tritonserver_starts(monkeypatch, tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("OPENAI_PORT", str(port))
        monkeypatch.setenv("HEALTH_PORT", "0")
        started = []
        monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: started.append(a))
        monkeypatch.setattr(launcher, "triton_layout", lambda *a, **k: launcher.ServerLayout(tmp_path, tmp_path, ""))
        (repo := tmp_path / "repo").mkdir()
        assert launcher.main(["--model-repository", str(repo), "--run-dir", str(tmp_path)]) == 1
    assert not started
    assert f"OPENAI_PORT {port}: the port is taken" in capsys.readouterr().err


def test_a_taken_server_port_stops_the_launcher_before_it_renders_or_starts_anything(monkeypatch, tmp_path, capsys):
    """A second launcher on a first one's ports: its tritonserver failed to bind, it took the first server's
    readiness for its own (READY) and restarted its own for ever, re-rendering the repository the first served."""
    monkeypatch.setenv("OPENAI_PORT", "0")
    monkeypatch.setenv("HEALTH_PORT", "0")
    monkeypatch.setattr(launcher.pairs, "prepare_pair", lambda *a, **k: pytest.fail("the pair was prepared"))
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for name in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT"):
            with monkeypatch.context() as env:
                env.setenv(name, str(port))
                assert launcher.main(["--pair", "tiny", "--run-dir", str(tmp_path / "run")]) == 1
                assert f"{name} {port}: the port is taken (another server listens there" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_served_model_name_defaults_to_the_tokenizers_directory(tmp_path):
    from specdec.serving.gateway_process import default_model_name, repository_tokenizer

    (tmp_path / "preprocessing").mkdir()
    (tmp_path / "preprocessing" / "config.pbtxt").write_text(
        'parameters { key: "tokenizer_path", value: { string_value: "/models/smollm2-135m-instruct" } }\n')
    assert repository_tokenizer(tmp_path) == "/models/smollm2-135m-instruct"
    assert default_model_name(repository_tokenizer(tmp_path)) == "smollm2-135m-instruct"
    assert default_model_name("/w/llama-3.1-8b-q4.gguf") == "llama-3.1-8b-q4" and repository_tokenizer(tmp_path / "x") == ""


def test_the_gateway_learns_the_context_and_the_default_answer_length_from_the_repository(tmp_path):
    """What truncation: auto leaves room for: the orchestrator's context and default max_tokens, as the
    committed repository's config spells them and the repository renderer writes them."""
    from pathlib import Path

    from specdec.serving.gateway_process import repository_limits
    from specdec.serving.pairs import PairSpec
    from specdec.serving.repository import render

    assert repository_limits(Path(__file__).parents[2] / "model_repository") == (8192, 64)
    pair = PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/tok", max_context_tokens=512,
                    default_max_tokens=48)
    assert repository_limits(render(pair, tmp_path / "repo")) == (512, 48)
    assert repository_limits(tmp_path / "none") == (0, 0)


def test_the_gateways_command_carries_the_launchers_openai_settings():
    """What the launcher starts beside the server takes the parsers it was given, as the gateway reads them."""
    from specdec.gateway.__main__ import parse_args
    from specdec.gateway.response_store import DEFAULT_MB as RESPONSES_STORE_MB
    from specdec.serving.gateway_process import GatewayProcess

    process = GatewayProcess(9000, 8001, ["a", "b"], "/models/tok", 30.0, {}, "hermes", 4096, "deepseek_r1", 0.5, 96,
                             "/data/responses")
    assert process.command[1:3] == ["-m", "specdec.gateway"]
    args = parse_args(process.command[3:])
    assert (args.served_model_name, args.tokenizer, args.max_model_len) == (["a", "b"], "/models/tok", 4096)
    assert (args.default_max_tokens, args.responses_store_dir) == (96, "/data/responses")
    assert (args.tool_call_parser, args.reasoning_parser, args.responses_store_mb) == ("hermes", "deepseek_r1", 0.5)
    plain = parse_args(GatewayProcess(9000, 8001, ["a"], "", 30.0, {}).command[3:])
    assert plain.tool_call_parser is None and plain.reasoning_parser is None and plain.default_max_tokens == 0
    assert plain.responses_store_dir == ""
    assert plain.responses_store_mb == RESPONSES_STORE_MB
    # the launcher's gateway calls preprocessing and speculative_decoding itself unless told to call the ensemble
    assert (args.upstream, plain.upstream) == ("direct", "direct")
    assert parse_args(GatewayProcess(9000, 8001, ["a"], "", 30.0, {}, upstream="ensemble").command[3:]).upstream \
        == "ensemble"
    assert parse_args(["--served-model-name", "a"]).upstream == "ensemble"  # the command's own default


def test_a_stop_past_its_timeout_signals_again_before_killing(tmp_path):
    """A launcher still draining when the caller's patience ends gets the second signal (which stops
    tritonserver and its stubs at once), not SIGKILL (which would orphan them)."""
    import subprocess
    import sys
    from pathlib import Path

    from specdec.serving.server import ServerProcess

    script = ("import signal, sys, time\n"
              "seen = []\n"
              "def on_term(*_):\n"
              "    seen.append(1)\n"
              "    if len(seen) == 2:\n"
              "        sys.exit(7)\n"  # the second signal: stop now, with a code the test can tell apart
              "signal.signal(signal.SIGTERM, on_term)\n"
              "print('up', flush=True)\n"
              "while True:\n"
              "    time.sleep(0.05)\n")
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "up"
    server = ServerProcess(0, 0, 0, 0, 0, tmp_path, Path(tmp_path, "log"), process)
    assert server.stop(timeout_s=0.5) == 7


@pytest.fixture
def own_signal_handlers():
    """The launcher's handlers installed by a test go again afterwards."""
    import signal

    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def test_a_signal_is_served_while_the_main_thread_holds_the_stop_events_lock(own_signal_handlers):
    """Python runs a signal handler in the main thread between two bytecodes, at moments inside
    `stopping.wait()` with the event's lock held: a handler that set the event itself never returned (a
    launcher's stop hung until it was killed). The handler only hands the signal on; its thread acts."""
    import signal

    stopping = threading.Event()
    served = []

    def stop(signum):
        served.append(signum)
        stopping.set()

    launcher.on_signals(stop)
    handler = signal.getsignal(signal.SIGTERM)
    with stopping._cond:  # what the main thread holds at those moments
        returned = threading.Event()
        caller = threading.Thread(target=lambda: (handler(signal.SIGTERM, None), returned.set()), daemon=True)
        caller.start()
        assert returned.wait(5), "the signal handler waited for the lock the main thread holds"
    assert stopping.wait(5) and served == [signal.SIGTERM]


def test_signals_are_served_in_order_and_a_failing_stop_serves_the_next(own_signal_handlers, capsys):
    import os
    import signal

    served = []
    both = threading.Event()

    def stop(signum):
        served.append(signum)
        if len(served) == 1:
            raise OSError("the server's port is gone")
        both.set()

    launcher.on_signals(stop)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)
    assert both.wait(5) and served == [signal.SIGTERM, signal.SIGINT]
    assert "signal 15: OSError: the server's port is gone" in capsys.readouterr().err


def test_the_watchdogs_reads_of_one_look_share_a_scrape():
    scrapes = []

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            scrapes.append(self.path)
            body = (f'specdec_model_call_timeouts_total{{model="target_model"}} {len(scrapes)}\n'
                    f'specdec_orchestrator_heartbeats_total{{instance="speculative_decoding_0_0"}} 7\n'
                    f'specdec_live_sequences{{instance="speculative_decoding_0_0"}} 2\n').encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    now = [100.0]
    try:
        metrics = launcher.RecentScrape(server.server_address[1], max_age_s=1.0, clock=lambda: now[0])
        assert launcher.unanswered_calls(metrics.text()) == {"target_model": 1.0}
        assert launcher.orchestrator_heartbeats(metrics.text()) == {"speculative_decoding_0_0": (7.0, 2.0)}
        assert scrapes == ["/metrics"]  # one look, one scrape
        now[0] += 1.0
        assert launcher.unanswered_calls(metrics.text()) == {"target_model": 2.0}  # the next look scrapes again
    finally:
        server.shutdown()
        server.server_close()
    now[0] += 1.0
    with pytest.raises(OSError):  # a server that does not answer is not answered for by an old scrape
        metrics.text()


def test_model_queues_reads_tritons_pending_requests_and_executions():
    text = ("# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.\n"
            "# TYPE nv_inference_pending_request_count gauge\n"
            'nv_inference_pending_request_count{model="preprocessing",version="1"} 2\n'
            'nv_inference_pending_request_count{model="target_model",version="1"} 0\n'
            "# HELP nv_inference_exec_count Number of model executions performed (does not include cached requests)\n"
            "# TYPE nv_inference_exec_count counter\n"
            'nv_inference_exec_count{model="preprocessing",version="1"} 41\n'
            'nv_inference_exec_count{model="preprocessing",version="2"} 1\n'
            'nv_inference_exec_count{model="target_model",version="1"} 900\n')
    assert launcher.model_queues(text) == {"preprocessing": (2.0, 42.0), "target_model": (0.0, 900.0)}


def test_runtime_lora_updating_without_a_directory_of_adapters_stops_the_launcher_before_tritonserver_starts(
        monkeypatch, tmp_path, capsys):
    (port,) = free_ports(1)
    monkeypatch.setenv("OPENAI_PORT", str(port))
    monkeypatch.setenv("HEALTH_PORT", "0")
    started = []
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: started.append(a))
    monkeypatch.setattr(launcher, "triton_layout", lambda *a, **k: launcher.ServerLayout(tmp_path, tmp_path, ""))
    monkeypatch.setattr(launcher, "repository_tokenizer", lambda repo: str(tmp_path / "tokenizer"))
    monkeypatch.setattr(launcher, "repository_limits", lambda repo: (1024, 64))
    monkeypatch.setattr(launcher.repository, "served_adapters", lambda repo: ([], ""))
    (repo := tmp_path / "repo").mkdir()
    assert launcher.main(["--model-repository", str(repo), "--run-dir", str(tmp_path),
                          "--allow-runtime-lora-updating"]) == 2
    assert not started
    assert "--allow-runtime-lora-updating needs --lora-directory" in capsys.readouterr().err


def test_a_chat_template_reaches_preprocessing_and_the_openai_api_and_bare_means_apply_it(tmp_path, monkeypatch,
                                                                                          capsys):
    """--chat-template FILE_OR_TEMPLATE (vLLM's): written into the rendered repository beside preprocessing's
    config, which names it, and handed to the OpenAI API's process; alone it means --apply-chat-template."""
    from specdec.gateway.__main__ import parse_args as gateway_args
    from specdec.serving import repository
    from specdec.serving.gateway_process import (GatewayProcess, repository_chat_template, repository_content_format,
                                                 repository_trusts_request_templates)
    from specdec.serving.pairs import PairSpec

    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    repo = repository.render(PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/tok",
                                      chat_template=template), tmp_path / "repo")
    assert (repo / "preprocessing" / repository.CHAT_TEMPLATE_FILE).read_text() == template
    config = (repo / "preprocessing" / "config.pbtxt").read_text()
    assert f'key: "chat_template", value: {{ string_value: "{repository.CHAT_TEMPLATE_FILE}" }}' in config
    assert repository_chat_template(repo) == str(repo / "preprocessing" / repository.CHAT_TEMPLATE_FILE)
    process = GatewayProcess(9000, 8001, ["a"], "/w/tok", 30.0, {}, chat_template=repository_chat_template(repo))
    assert gateway_args(process.command[3:]).chat_template == str(repo / "preprocessing" / "chat_template.jinja")
    plain = repository.render(PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/tok"), tmp_path / "plain")
    assert repository_chat_template(plain) == "" and not (plain / "preprocessing" / "chat_template.jinja").exists()
    # --trust-request-chat-template: preprocessing's parameter, which the launcher hands the OpenAI API
    trusting = repository.render(PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/tok",
                                          trust_request_chat_template=True), tmp_path / "trusting")
    assert repository_trusts_request_templates(trusting) and not repository_trusts_request_templates(plain)
    process = GatewayProcess(9000, 8001, ["a"], "/w/tok", 30.0, {}, trust_request_templates=True)
    assert gateway_args(process.command[3:]).trust_request_chat_template
    assert "--chat-template" not in GatewayProcess(9000, 8001, ["a"], "/w/tok", 30.0, {}).command
    # --chat-template-content-format: preprocessing's parameter, which the OpenAI API counts prompts with
    parts = repository.render(PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/tok",
                                       chat_template_content_format="openai"), tmp_path / "parts")
    assert (repository_content_format(parts), repository_content_format(plain)) == ("openai", "auto")
    process = GatewayProcess(9000, 8001, ["a"], "/w/tok", 30.0, {}, content_format="openai")
    assert gateway_args(process.command[3:]).chat_template_content_format == "openai"
    assert "--chat-template-content-format" not in GatewayProcess(9000, 8001, ["a"], "/w/tok", 30.0, {}).command
    # the server's metrics port, whose figures the API's /metrics restates under vLLM's names
    assert gateway_args(GatewayProcess(9000, 8001, ["a"], "/w/tok", 30.0, {}, metrics_port=8002).command[3:]) \
        .server_metrics_url == "127.0.0.1:8002"
    assert gateway_args(GatewayProcess(9000, 8001, ["a"], "/w/tok", 30.0, {}, max_loras=6).command[3:]).max_loras == 6

    rendered = []
    monkeypatch.setattr(launcher.repository, "render", lambda pair, dest: rendered.append(pair) or dest)
    monkeypatch.setattr(launcher, "triton_layout", lambda *a, **k: (_ for _ in ()).throw(SystemExit(7)))
    file = tmp_path / "template.jinja"
    file.write_text(template)
    for flags, applied, text in ((["--chat-template", str(file)], False, template),
                                 (["--chat-template", template], False, template),
                                 (["--chat-template"], True, ""), (["--apply-chat-template"], True, ""), ([], False, "")):
        rendered.clear()
        with pytest.raises(SystemExit):
            launcher.main(["--target", "/w/target", "--run-dir", str(tmp_path), *flags])
        assert (rendered[0].apply_chat_template, rendered[0].chat_template) == (applied, text), flags
        assert not rendered[0].trust_request_chat_template
    rendered.clear()
    with pytest.raises(SystemExit):
        launcher.main(["--pair", "tiny", "--run-dir", str(tmp_path), "--trust-request-chat-template"])
    assert rendered[0].trust_request_chat_template and rendered[0].chat_template_content_format == "auto"
    rendered.clear()
    with pytest.raises(SystemExit):
        launcher.main(["--pair", "tiny", "--run-dir", str(tmp_path), "--chat-template-content-format", "string"])
    assert rendered[0].chat_template_content_format == "string"
    # a value that is neither a file nor a template: refused before anything starts
    rendered.clear()
    assert launcher.main(["--target", "/w/target", "--run-dir", str(tmp_path), "--chat-template", "/no/such.jinja"]) == 2
    assert not rendered and "--chat-template: '/no/such.jinja' is neither a file nor a Jinja template" in capsys.readouterr().err
    for flags in (["--chat-template", template], ["--trust-request-chat-template"],
                  ["--chat-template-content-format", "openai"]):
        with pytest.raises(SystemExit):
            launcher.parse_args(["--model-repository", str(tmp_path), *flags])
        assert "--model-repository is served as is" in capsys.readouterr().err


def test_the_models_generation_config_reaches_the_orchestrator_and_the_openai_api(tmp_path, monkeypatch, capsys):
    """--generation-config auto|vllm|DIR (vLLM's): the orchestrator reads the target's file (or DIR's) for its end
    tokens; the OpenAI API's process reads the same file for its sampling defaults, none of it with vllm; an
    --override-generation-config reaches it. A file or override it could not use stops the launcher first."""
    import json

    from specdec.gateway.__main__ import parse_args as gateway_args
    from specdec.serving import repository
    from specdec.serving.gateway_process import GatewayProcess, repository_generation_config
    from specdec.serving.pairs import PairSpec

    plain = repository.render(PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/tok"), tmp_path / "r1")
    assert repository_generation_config(plain) == "/w/target"  # the target's, not the tokenizer's
    other = repository.render(PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/tok",
                                       generation_config="/w/gen"), tmp_path / "r2")
    assert repository_generation_config(other) == "/w/gen"
    for given, expected in ((("/w/gen", '{"temperature": 0}'), ("/w/gen", '{"temperature": 0}')),
                            (("vllm", ""), ("vllm", "")), (("", ""), ("vllm", ""))):  # no file: no defaults
        args = gateway_args(GatewayProcess(9000, 8001, ["a"], "/w/tok", 30.0, {}, generation_config=given).command[3:])
        assert (args.generation_config, args.override_generation_config) == expected

    rendered = []
    monkeypatch.setattr(launcher.repository, "render", lambda pair, dest: rendered.append(pair) or dest)
    monkeypatch.setattr(launcher, "triton_layout", lambda *a, **k: (_ for _ in ()).throw(SystemExit(7)))
    (gen := tmp_path / "gen").mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3], "temperature": 0.6}))
    for flags, expected in (([], ""), (["--generation-config", "vllm"], ""), (["--generation-config", str(gen)], str(gen))):
        rendered.clear()
        with pytest.raises(SystemExit):
            launcher.main(["--pair", "tiny", "--run-dir", str(tmp_path), *flags])
        assert rendered[0].generation_config == expected, flags
    (gen / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    rendered.clear()
    assert launcher.main(["--pair", "tiny", "--run-dir", str(tmp_path), "--generation-config", str(gen)]) == 2
    assert not rendered and "--generation-config: temperature -1 is out of range" in capsys.readouterr().err
    assert launcher.main(["--pair", "tiny", "--run-dir", str(tmp_path), "--generation-config", str(tmp_path / "x")]) == 2
    assert "is neither a model directory nor a generation_config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launcher.parse_args(["--pair", "tiny", "--override-generation-config", '{"temp": 1}'])
    assert "'temp' is no sampling default" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launcher.parse_args(["--model-repository", str(tmp_path), "--generation-config", str(gen)])
    assert "--model-repository is served as is" in capsys.readouterr().err
    assert launcher.parse_args(["--model-repository", str(tmp_path), "--generation-config", "vllm"])


def test_the_openai_apis_process_refuses_a_chat_template_it_cannot_use(tmp_path, capsys):
    from specdec.gateway import __main__ as gateway_main
    from specdec.serving.pairs import smollm2_tokenizer_dir

    assert gateway_main.main(["--served-model-name", "m", "--chat-template", "{{ x }}"]) == 2
    assert "--chat-template needs --tokenizer" in capsys.readouterr().err
    tokenizer = str(smollm2_tokenizer_dir())
    assert gateway_main.main(["--served-model-name", "m", "--tokenizer", tokenizer, "--chat-template", "chatml"]) == 2
    assert "'chatml' is neither a file nor a Jinja template" in capsys.readouterr().err
    assert gateway_main.main(["--served-model-name", "m", "--tokenizer", tokenizer,
                              "--chat-template", "{% if %}"]) == 2
    assert "--chat-template: the chat template fails on a one-message conversation" in capsys.readouterr().err


def test_a_draft_made_of_the_targets_layers_is_told_so_and_drafts_with_the_requests_adapter(tmp_path, monkeypatch,
                                                                                             capsys):
    """--draft-lora-layers: the custom pair's draft model runs the target's adapters on the layers it names;
    refused without a draft model. --skip-draft-lora: every layer-skip self-draft does (all its layers are
    the target's). The renderer hands every draft the target's adapters, its lora_layers saying whether it
    runs them."""
    from specdec.serving import repository
    from specdec.serving.pairs import PairSpec

    rendered = []
    real = repository.render
    monkeypatch.setattr(launcher.repository, "render", lambda pair, dest: rendered.append(pair) or dest)
    monkeypatch.setattr(launcher, "triton_layout", lambda *a, **k: (_ for _ in ()).throw(SystemExit(7)))
    with pytest.raises(SystemExit):
        launcher.main(["--target", "/w/target", "--draft", "/w/draft", "--run-dir", str(tmp_path),
                       "--draft-lora-layers", "first"])
    assert rendered[0].draft_lora_layers == {"draft_model": "first"}
    assert launcher.main(["--target", "/w/target", "--run-dir", str(tmp_path), "--draft-lora-layers", "first"]) == 2
    assert "--draft-lora-layers is a draft model's" in capsys.readouterr().err
    rendered.clear()
    with pytest.raises(SystemExit):  # --skip-draft-lora: every layer-skip self-draft
        launcher.main(["--pair", "tiny", "--run-dir", str(tmp_path), "--skip-draft", "3,5", "--skip-draft-lora"])
    assert rendered[0].draft_lora_layers["draft_skip"] == "first"
    assert launcher.main(["--pair", "tiny", "--run-dir", str(tmp_path), "--skip-draft-lora"]) == 2
    assert "--skip-draft-lora needs a layer-skip self-draft" in capsys.readouterr().err
    pair = PairSpec(name="t", target_path="/w/target", tokenizer_path="/w/tok", draft_paths={"draft_model": "/w/d",
                    "other": "/w/o"}, lora_adapters={"sql": "/w/sql"},
                    draft_lora_layers={"draft_model": "0-9", "draft_skip": "first"},
                    skip_drafts={"draft_skip": "3,5", "plain_skip": "3"})
    repo = real(pair, tmp_path / "repo")
    config = {name: (repo / name / "config.pbtxt").read_text()
              for name in ("draft_model", "other", "draft_skip", "plain_skip")}
    for name, layers in (("draft_model", "0-9"), ("draft_skip", "first"), ("other", ""), ("plain_skip", "")):
        # (every draft takes the target's adapters; those with lora_layers "" never run one)
        assert f'key: "lora_layers", value: {{ string_value: "{layers}" }}' in config[name], name
        assert 'key: "lora_adapters", value: { string_value: "sql=/w/sql" }' in config[name], name


def test_vllms_enable_auto_tool_choice_is_taken_with_a_parser_and_refused_without_one(capsys):
    """vLLM's command lines pass --enable-auto-tool-choice with --tool-call-parser: both serve them unchanged (not a
    flag tritonserver would be handed and refuse); alone it is refused, as vLLM refuses it."""
    from specdec.gateway import __main__ as gateway_main

    args = launcher.parse_args(["--pair", "tiny", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.tool_call_parser == "hermes" and not any("auto-tool" in arg for arg in args.server_args)
    assert gateway_main.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]).enable_auto_tool_choice
    with pytest.raises(SystemExit):
        launcher.parse_args(["--pair", "tiny", "--enable-auto-tool-choice"])
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    assert gateway_main.main(["--served-model-name", "m", "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err


HEALTH_STAND_IN = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *_):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_an_openai_api_that_stops_answering_its_health_check_is_killed_and_started_again(capsys):
    """A hung OpenAI API (here SIGSTOPped) kept readiness at 503 for ever, liveness at 200: the pod out of
    rotation, Triton's endpoints with it, and nothing restarting it. It dying is tested served
    (tests/integration/test_openai_api.py); a stand-in answering GET /health takes its place here."""
    import os
    import re
    import signal
    import sys
    import time

    from specdec.serving.gateway_process import GatewayProcess

    (port,) = free_ports(1)
    gateway = GatewayProcess(port, 8001, ["a"], "", 30.0, dict(os.environ), hang_timeout_s=1.0)
    gateway.command, gateway.look_s = [sys.executable, "-c", HEALTH_STAND_IN, str(port)], 0.1
    gateway.start()
    first = gateway.process
    try:
        wait_for(gateway.probe, 10, "the stand-in's health check")
        until = time.monotonic() + 1.5
        while time.monotonic() < until:  # answering: left alone
            gateway.keep_alive()
            time.sleep(0.05)
        assert gateway.restarts == 0 and gateway.process is first
        os.kill(first.pid, signal.SIGSTOP)
        wait_for(lambda: gateway.keep_alive() or gateway.restarts, 10, "the hung process's restart", every_s=0.05)
        assert first.poll() == -signal.SIGKILL and gateway.process is not first
        wait_for(gateway.probe, 10, "the new process's health check")
        assert re.search(r"the OpenAI API has not answered its health check for \d+ s \(hung\); killed it; starting it "
                         r"again \(restart 1\)", capsys.readouterr().err)
    finally:
        for process in (first, gateway.process):
            if process.poll() is None:
                process.kill()
                process.wait()
