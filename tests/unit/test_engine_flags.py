"""vLLM's and SGLang's server flags read by the launcher as what they stand for here (serving/engine_flags.py):
its parsed arguments, no server."""

import dataclasses

import pytest

from specdec.serving import engine_flags, pairs, repository
from specdec.serving.launcher import parse_args


def test_vllms_server_flags_stand_for_the_launchers_settings():
    args = parse_args(["--target", "/m", "--port", "8000", "--host", "0.0.0.0", "--api-key", "k",
                       "--max-num-seqs", "8", "--no-enable-prefix-caching", "--enforce-eager",
                       "--tensor-parallel-size", "1", "--max-num-batched-tokens", "512", "--quantization", "fp8",
                       "--trust-remote-code", "--gpu-memory-utilization", "0.9", "--disable-log-requests"])
    engine = args.engine
    assert engine.env == {"OPENAI_PORT": "8000", "OPENAI_HOST": "0.0.0.0", "SPECDEC_API_KEY": "k"}
    assert (engine.max_live_sequences, engine.prefix_caching) == (8, False)
    assert (args.compile, args.weights_dtype) == ("off", "fp8")
    assert args.set[0] == "speculative_decoding.prefill_chunk_tokens=512"
    assert any(note.startswith("--trust-remote-code") for note in engine.notes)
    assert "--gpu-memory-utilization, --disable-log-requests tune vLLM's or SGLang's engine, nothing here" in \
        engine.notes


def test_sglangs_server_flags_stand_for_the_same():
    args = parse_args(["--model-path", "/m", "--port", "30000", "--max-running-requests", "4",
                       "--disable-radix-cache", "--disable-cuda-graph", "--tp-size", "1", "--chunked-prefill-size",
                       "-1", "--mem-fraction-static", "0.8", "--enable-metrics", "--log-level", "info"])
    engine = args.engine
    assert engine.env == {"OPENAI_PORT": "30000"} and args.target == "/m"
    assert (engine.max_live_sequences, engine.prefix_caching, args.compile) == (4, False, "off")
    assert args.set[0] == "speculative_decoding.prefill_chunk_tokens=0"  # -1: prompts whole
    assert "--mem-fraction-static, --log-level, --enable-metrics tune vLLM's or SGLang's engine, nothing here" in \
        engine.notes
    on = parse_args(["--target", "/m", "--enable-prefix-caching"]).engine
    assert on.prefix_caching is True
    incremental = parse_args(["--model-path", "/m", "--incremental-streaming-output"]).engine  # the API's own flag
    assert incremental.env == {"SPECDEC_INCREMENTAL_STREAMING_OUTPUT": "1"} and not incremental.changes_repository
    plain = parse_args(["--target", "/m"]).engine
    assert plain == engine_flags.Engine() and not plain.changes_repository
    # SGLang's --stream-interval: a streamed answer's responses at least that many tokens apart
    spaced = parse_args(["--model-path", "/m", "--stream-interval", "8"])
    assert spaced.set == ["speculative_decoding.stream_interval=8"] and spaced.engine.changes_repository
    assert not any("--stream-interval" in note for note in spaced.engine.notes)


def test_the_rendered_repository_holds_what_they_stand_for(tmp_path):
    args = parse_args(["--target", "/m", "--max-num-seqs", "8", "--no-enable-prefix-caching"])
    pair = pairs.tiny_pair()
    pair = dataclasses.replace(pair, max_live_sequences=args.engine.max_live_sequences,
                               prefix_caching=args.engine.prefix_caching)
    repo = repository.render(pair, tmp_path / "repo")
    assert 'key: "max_live_sequences", value: { string_value: "8" }' in \
        (repo / "speculative_decoding" / "config.pbtxt").read_text()
    assert 'key: "prefix_caching", value: { string_value: "false" }' in \
        (repo / "target_model" / "config.pbtxt").read_text()


@pytest.mark.parametrize("argv, named", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
    (["--tp", "4"], "--tp-size"),
    (["--quantization", "awq"], "--quantization awq"),
    (["--port", "70000"], "--port 70000"),
    (["--api-key", ""], "--api-key"),
    (["--host", " "], "--host"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
    (["--stream-interval", "0"], "--stream-interval 0"),
    (["--enforce-eager", "--compile", "graphs"], "--compile graphs"),
    (["--quantization", "fp8", "--weights-dtype", "q8"], "--weights-dtype q8"),
])
def test_values_nothing_here_stands_for_are_refused_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--target", "/m", *argv])
    assert named in capsys.readouterr().err


def test_a_repository_served_as_is_refuses_the_flags_that_would_change_it(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model-repository", str(tmp_path), "--max-num-seqs", "8"])
    assert "--max-num-seqs set a rendered repository's parameters" in capsys.readouterr().err
    assert parse_args(["--model-repository", str(tmp_path), "--port", "8000"]).engine.env == {"OPENAI_PORT": "8000"}


def test_a_vllm_serve_command_line_model_first_and_unnamed_is_the_target():
    args = parse_args(["/models/llama", "--port", "8000", "--max-num-seqs", "16"])
    assert args.target == "/models/llama" and args.engine.max_live_sequences == 16
    assert "--log-verbose=1" in parse_args(["--pair", "tiny", "--", "--log-verbose=1"]).server_args


def test_vllms_dtype_names_and_auto(tmp_path):
    assert parse_args(["--target", "/m", "--dtype", "half"]).dtype == "float16"
    assert parse_args(["--target", "/m", "--dtype", "float"]).dtype == "float32"
    assert parse_args(["--target", "/m", "--dtype", "auto"]).dtype == "float32"  # the CPU: float32's kernels
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    on_gpu = ["--target", str(tmp_path), "--device", "gpu", "--dtype", "auto"]
    assert parse_args(on_gpu).dtype == "bfloat16"  # the checkpoint's
    (tmp_path / "config.json").write_text('{"dtype": "float32"}')
    assert parse_args(on_gpu).dtype == "float16"  # vLLM's: a float32 checkpoint in half precision
    assert engine_flags.dtype("auto", "gpu", str(tmp_path / "none")) == "float16"
    assert parse_args(["--target", "/m", "--dtype", "bfloat16"]).dtype == "bfloat16"


def test_more_of_their_flags_parallelism_sampling_defaults_and_switches():
    args = parse_args(["--model-path", "/m", "--tokenizer-path", "/t", "--sampling-defaults", "openai",
                       "--enable-lora", "--enable-reasoning", "--grammar-backend", "xgrammar", "--dp-size", "1",
                       "--pp-size", "1", "--enable-torch-compile"])
    assert (args.tokenizer, args.generation_config) == ("/t", "vllm")
    assert "--grammar-backend, --enable-torch-compile, --enable-lora, --enable-reasoning tune vLLM's or SGLang's " \
           "engine, nothing here" in args.engine.notes
    assert parse_args(["--target", "/m", "--sampling-defaults", "model"]).generation_config == "auto"


@pytest.mark.parametrize("argv, named", [
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size / -pp / --pp-size 2"),
    (["--dp", "2"], "--data-parallel-size / -dp / --dp-size / --dp 2"),
    (["--sampling-defaults", "openai", "--generation-config", "/g"], "--sampling-defaults and --generation-config"),
])
def test_more_refusals_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--target", "/m", *argv])
    assert named in capsys.readouterr().err


def test_host_is_where_the_api_listens_and_where_the_launcher_asks_it(monkeypatch):
    """--host: the API's address (OPENAI_HOST), which the launcher's health checks ask; every interface or
    localhost: asked over the loopback; an IPv6 address bracketed."""
    from specdec.serving.healthcheck import api_host, gateway_url

    assert parse_args(["--model-path", "/m", "--host", "127.0.0.1"]).engine.env == {"OPENAI_HOST": "127.0.0.1"}
    for given, asked in (("", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"), ("localhost", "127.0.0.1"),
                         ("10.1.2.3", "10.1.2.3"), ("::1", "[::1]")):
        monkeypatch.setenv("OPENAI_HOST", given)
        assert api_host() == asked and gateway_url(9000).endswith(f"//{asked}:9000/health"), given
    assert api_host({}) == "127.0.0.1"
