"""`make serve`'s launcher on a server of its own: ready and serving; then SIGTERM, as Kubernetes sends it on a
rollout or scale-down, drops readiness at once, lets the streams in flight finish (one over gRPC, one through
the OpenAI API) and stops the server, the OpenAI API's process, every stub and the stubs' shared scratch,
with exit code 0."""

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from client import Client, GenerationParams
from specdec import tensor_names as tn
from specdec.triton.admission import cancellation, kv_room, sequence_slots

from .helpers import GenerationError, grpc_stream, start_server, stop_server, stub_processes, stubs_left

pytestmark = pytest.mark.integration

TOKENS = 300  # the stream SIGTERM meets: seconds of generation


# A chat template of the user's own (vLLM's --chat-template FILE), not the tiny tokenizer's ChatML
TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lifecycle")
    (tmp / "template.jinja").write_text(TEMPLATE)
    server = start_server(tmp, launcher_args=("--chat-template", str(tmp / "template.jinja"),
                                              "--trust-request-chat-template"))
    yield server
    if server.process.poll() is None:  # a test failed before the SIGTERM test stopped it
        stop_server(server, require_clean_exit=False)


def _readiness(server) -> tuple[int, str]:
    """What the launcher's readiness endpoint answers."""
    try:
        with urllib.request.urlopen(server.readiness_url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _scratch(server) -> list:
    """The stubs' shared scratch (cancellation flags, live-sequence slots, the KV-room line), named after
    tritonserver."""
    stub_pid = stub_processes(server.run_dir)[0].split()[0]
    triton_pid = int(subprocess.run(["ps", "-o", "ppid=", "-p", stub_pid], capture_output=True, text=True).stdout)
    return [cancellation.default_directory(triton_pid), kv_room.default_directory(triton_pid),
            *sequence_slots.server_directories(triton_pid)]


def test_every_model_is_warmed_up_in_its_own_stub_before_ready(own):
    # Every Python model instance runs in its own stub: five models once (the tiny pair without its test
    # drafts, vllm_compatible), the orchestrator per instance.
    assert len(stub_processes(own.run_dir)) == 5 + tn.DEFAULT_ORCHESTRATOR_INSTANCES["cpu"]
    log = own.log_path.read_text(errors="replace")
    for model in ("target_model", "draft_model"):
        assert f"{model}: warmed up in" in log, model  # before READY: the first requests pay nothing
        assert re.search(rf"{model}: warmed up in [\d.]+ s on cpu, torch threads: [1-9]\d*", log), model
    result = grpc_stream(own.grpc_url, "Hello", max_tokens=8, num_draft_tokens=2, stream=True)
    assert result[tn.NUM_OUTPUT_TOKENS] == 8
    with pytest.raises(GenerationError, match="max_tokens"):
        grpc_stream(own.grpc_url, "Hello", max_tokens=0)
    scratch = _scratch(own)
    assert len(scratch) == 3 and all(path.is_dir() for path in scratch), scratch


def test_chats_are_rendered_with_the_launchers_chat_template_over_grpc_and_the_openai_api(own):
    """--chat-template FILE: preprocessing renders a chat with it (Triton's messages input, the OpenAI API's chat
    endpoint), and the OpenAI API's /tokenize and /tokenizer_info say so; greedy, each answers what the
    target answers to that template's prompt given as token ids. With --trust-request-chat-template a
    request's own template (vLLM's chat_template) renders its chat instead."""
    from specdec.decoding.text import load_tokenizer
    from specdec.serving import pairs

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    tokenizer = load_tokenizer(pairs.tiny_pair().tokenizer_path)
    prompt = "[SYSTEM] Be brief.\n[USER] Name a colour.\n[ASSISTANT]"
    expected = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.chat_template != TEMPLATE  # its own is another: what the server renders is the file's
    params = dict(max_tokens=12, temperature=0.0, num_draft_tokens=2, ignore_eos=True)
    reference = grpc_stream(own.grpc_url, None, prompt_token_ids=np.array([expected], dtype=np.int32), **params)
    served = grpc_stream(own.grpc_url, None, messages=json.dumps(chat), **params)
    assert served[tn.NUM_INPUT_TOKENS] == len(expected) and served[tn.TEXT_OUTPUT] == reference[tn.TEXT_OUTPUT]
    api = openai.OpenAI(base_url=own.openai_url, api_key="unused", max_retries=0, timeout=120)
    answer = api.chat.completions.create(model=api.models.list().data[0].id, messages=chat, max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True, "num_draft_tokens": 2})
    assert answer.usage.prompt_tokens == len(expected)
    assert answer.choices[0].message.content == reference[tn.TEXT_OUTPUT]
    root = own.openai_url.removesuffix("/v1")
    request = urllib.request.Request(f"{root}/tokenize", data=json.dumps({"messages": chat}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert json.loads(response.read())["tokens"] == expected
    with urllib.request.urlopen(f"{root}/tokenizer_info", timeout=30) as response:
        assert json.loads(response.read())["chat_template"] == TEMPLATE

    # --trust-request-chat-template: a request's own template (vLLM's chat_template field) renders its chat
    mine = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    expected = tokenizer.encode("<system>Be brief.<user>Name a colour.<assistant>", add_special_tokens=False)
    reference = grpc_stream(own.grpc_url, None, prompt_token_ids=np.array([expected], dtype=np.int32), **params)
    served = grpc_stream(own.grpc_url, None, messages=json.dumps(chat), chat_template=mine, **params)
    assert served[tn.NUM_INPUT_TOKENS] == len(expected) and served[tn.TEXT_OUTPUT] == reference[tn.TEXT_OUTPUT]
    answer = api.chat.completions.create(model=api.models.list().data[0].id, messages=chat, max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True, "num_draft_tokens": 2,
                                                                    "chat_template": mine})
    assert answer.usage.prompt_tokens == len(expected)
    assert answer.choices[0].message.content == reference[tn.TEXT_OUTPUT]
    # A template that loops over each message's parts (OpenAI's list, as multimodal templates read content)
    # gets them (vLLM's --chat-template-content-format auto): the same prompt, counted alike by the API
    parts = "{% for m in messages %}<{{ m['role'] }}>{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}<assistant>"
    served = grpc_stream(own.grpc_url, None, messages=json.dumps(chat), chat_template=parts, **params)
    assert served[tn.NUM_INPUT_TOKENS] == len(expected) and served[tn.TEXT_OUTPUT] == reference[tn.TEXT_OUTPUT]
    answer = api.chat.completions.create(model=api.models.list().data[0].id, messages=chat, max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True, "num_draft_tokens": 2,
                                                                    "chat_template": parts})
    assert answer.usage.prompt_tokens == len(expected)
    assert answer.choices[0].message.content == reference[tn.TEXT_OUTPUT]
    request = urllib.request.Request(f"{root}/tokenize", data=json.dumps({"messages": chat, "chat_template": parts}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert json.loads(response.read())["tokens"] == expected


def test_sigterm_during_a_long_stream_lets_it_finish_then_stops_everything(own):
    scratch = _scratch(own)
    results, failures = [], []
    first_text, first_chat = threading.Event(), threading.Event()

    def stream():
        try:
            params = GenerationParams(max_tokens=TOKENS, num_draft_tokens=2, ignore_eos=True)
            results.append(Client(own.grpc_url, timeout_s=300).generate(
                "Once upon a time", params, stream=True, on_text=lambda _delta: first_text.set()))
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
        first_text.set()

    def chat():
        try:
            api = openai.OpenAI(base_url=own.openai_url, api_key="unused", max_retries=0, timeout=300)
            chunks = []
            for chunk in api.chat.completions.create(
                    model=api.models.list().data[0].id, messages=[{"role": "user", "content": "Once upon a time"}],
                    max_tokens=TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True, "num_draft_tokens": 2}):
                chunks.append(chunk)
                first_chat.set()
            results.append(chunks)
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
        first_chat.set()

    worker = threading.Thread(target=stream)
    worker.start()
    chatter = threading.Thread(target=chat)
    chatter.start()
    gateway = subprocess.run(["pgrep", "-f", f"specdec.gateway --port {own.openai_port} "], capture_output=True,
                             text=True).stdout.split()
    assert len(gateway) == 1, gateway
    assert _readiness(own) == (200, "ready\n")  # the chart's readiness probe
    assert first_text.wait(timeout=120) and first_chat.wait(timeout=120)
    assert worker.is_alive() and chatter.is_alive(), (failures, results)  # still generating: 300 tokens take seconds
    # A client holding a gRPC stream open between its requests (tritonclient's start_stream, none sent): it held
    # Triton 2.51's stop for ever once the models had unloaded, and the launcher with it
    idle = grpcclient.InferenceServerClient(own.grpc_url)
    idle.start_stream(callback=lambda result, error: None)
    own.process.terminate()  # SIGTERM, as Kubernetes sends it
    deadline = time.monotonic() + 5
    while own.ready() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not own.ready()  # readiness drops at once: new requests go elsewhere
    probe = subprocess.run([sys.executable, "-m", "specdec.serving.healthcheck"], capture_output=True, text=True,
                           env={"HTTP_PORT": str(own.http_port), "PATH": ""})
    assert probe.returncode == 1 and "draining" in probe.stderr
    status, text = _readiness(own)
    assert status == 503 and "draining" in text
    worker.join(timeout=240)
    chatter.join(timeout=240)
    code = own.process.wait(timeout=120)  # drained, then stopped by itself
    idle.close()
    assert not failures, failures
    (result,) = [r for r in results if not isinstance(r, list)]
    assert result.finish_reason == "length" and result.num_output_tokens == TOKENS
    (chunks,) = [r for r in results if isinstance(r, list)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == TOKENS
    assert not Path(f"/proc/{gateway[0]}").exists()  # the OpenAI API's process stopped too
    assert code == 0
    assert "tritonserver unloaded its models and did not exit 5 s later" in own.log_tail(20000)
    assert not stubs_left(own.run_dir)
    assert not any(path.exists() for path in scratch), scratch  # the launcher removed it


def test_the_image_base_is_the_triton_release_the_tests_serve_with(server):
    """The Dockerfile's NGC base image must be the release of the tritonserver every test here runs (the
    one the nvidia-pytriton wheel ships), read from the running server itself."""
    import json
    import urllib.request

    from tests.deploy.test_docker import base_image_release, ngc_release

    with urllib.request.urlopen(f"{server.http_url}/v2", timeout=10) as response:
        version = json.loads(response.read())["version"]
    assert ngc_release(version) == base_image_release(), version


def test_the_stubs_run_with_the_launchers_openmp_spin_limit_and_allocator(server):
    """Every model's stub inherits GOMP_SPINCOUNT: with libgomp's default an idle model's workers keep a
    core busy for milliseconds after each forward, through the next model's. The CPU models run on TCMalloc
    where the machine has it (`--allocator auto`), on glibc's malloc where not."""
    import os

    from specdec.serving import allocator
    from specdec.serving.launcher import STUB_ENV_DEFAULTS

    tcmalloc = "" if allocator.preloads_an_allocator(os.environ.get("LD_PRELOAD", "")) else allocator.find_tcmalloc()

    expected = os.environ.get("GOMP_SPINCOUNT", STUB_ENV_DEFAULTS["GOMP_SPINCOUNT"])
    stubs = stub_processes(server.run_dir)
    assert stubs
    for line in stubs:
        pid = line.split()[0]
        with open(f"/proc/{pid}/environ", "rb") as env:
            variables = dict(item.split(b"=", 1) for item in env.read().split(b"\0") if b"=" in item)
        assert variables.get(b"GOMP_SPINCOUNT") == expected.encode(), line
        with open(f"/proc/{pid}/maps") as maps:
            mapped = {row.split()[-1] for row in maps if "malloc" in row}
        assert (os.path.realpath(tcmalloc) in {os.path.realpath(path) for path in mapped}) == bool(tcmalloc), \
            (line, mapped)
