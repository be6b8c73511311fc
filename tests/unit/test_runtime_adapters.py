"""vLLM's runtime LoRA endpoints (gateway/adapters.py): a load is a link in the target's directory of adapters
(a model of its name from then on), checked for its fields and files first; load_inplace points the link
elsewhere; an adapter the server does not read is refused and the link undone; an unload removes the link and
nothing else. The endpoints over a real server: tests/integration/test_lora.py."""

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from specdec.engine.lora_config import CONFIG, WEIGHTS, directory_adapters
from specdec.gateway import __main__ as gateway_main
from specdec.gateway.adapters import LOADED, RUNTIME_ENV, UNLOADED, RuntimeAdapters, allowed_by_environment
from specdec.gateway.app import Gateway
from specdec.gateway.protocol import ApiError, Served
from specdec.gateway.upstream import Piece


def adapter(path, weights: bool = True):
    path.mkdir(parents=True)
    (path / CONFIG).write_text('{"r": 2, "lora_alpha": 4}')
    if weights:
        (path / WEIGHTS[0]).write_bytes(b"")
    return path


@pytest.fixture
def setting(tmp_path):
    """A directory of adapters holding one of its own ("own"), two adapters elsewhere, the runtime adapters."""
    directory = tmp_path / "library"
    adapter(directory / "own")
    first, second = adapter(tmp_path / "sql"), adapter(tmp_path / "chat")
    served = Served(["base"], ["pinned"], str(directory))
    return served, RuntimeAdapters(served), first, second


def test_a_load_is_a_link_that_makes_a_model_of_its_name_and_an_unload_removes_only_the_link(setting):
    served, runtime, first, second = setting
    load = runtime.load_request({"lora_name": "sql", "lora_path": str(first)})
    assert runtime.link(load) is None
    assert "sql" in served and served.is_adapter("sql") and served.listed() == ("base", "pinned", "own", "sql")
    with pytest.raises(ApiError, match="'sql' has already been loaded") as error:
        runtime.link(load)
    assert error.value.status == 400
    # load_inplace points it at another adapter; undone, at the first again
    again = runtime.load_request({"lora_name": "sql", "lora_path": str(second), "load_inplace": True})
    before = runtime.link(again)
    assert (runtime.directory / "sql").resolve() == second and before == str(first)
    runtime.restore(again, before)
    assert (runtime.directory / "sql").resolve() == first
    # an owner's name: a folder made for it, gone with its last adapter
    owned = runtime.load_request({"lora_name": "team/chat", "lora_path": str(second)})
    runtime.link(owned)
    assert served.is_adapter("team/chat")
    runtime.unlink("team/chat")
    assert not (runtime.directory / "team").exists() and not served.is_adapter("team/chat")
    runtime.unlink(runtime.unload_request({"lora_name": "sql"}))
    assert "sql" not in served and first.is_dir() and (first / CONFIG).is_file()  # the adapter itself untouched
    with pytest.raises(ApiError, match="'sql' cannot be found") as error:
        runtime.unlink("sql")
    assert error.value.status == 404
    # the directory's own adapters are not the endpoints' to replace or remove
    with pytest.raises(ApiError, match="'own' is a directory of lora_directory .*remove or replace it there"):
        runtime.link(runtime.load_request({"lora_name": "own", "lora_path": str(first), "load_inplace": True}))
    with pytest.raises(ApiError, match="'own' is a directory of lora_directory .*remove it there"):
        runtime.unlink("own")
    assert directory_adapters(runtime.directory) == ["own"]
    # a failed first load undone: no link left
    new = runtime.load_request({"lora_name": "chat", "lora_path": str(second)})
    runtime.link(new)
    runtime.restore(new, None)
    assert directory_adapters(runtime.directory) == ["own"]


@pytest.mark.parametrize("body, message", [
    ({"lora_path": "x"}, "lora_name: must be a non-empty string"),
    ({"lora_name": "../escape", "lora_path": "x"}, "lora_name: '../escape'"),
    ({"lora_name": "a//b", "lora_path": "x"}, "lora_name: 'a//b'"),
    ({"lora_name": ".hidden", "lora_path": "x"}, "lora_name: '.hidden'"),
    ({"lora_name": "new"}, "lora_path: must be a non-empty string"),
    ({"lora_name": "new", "lora_path": "{tmp}/missing"}, f"lora_path: .*/missing: no {CONFIG} there"),
    ({"lora_name": "new", "lora_path": "{tmp}/unweighted"}, f"lora_path: .*unweighted: no {WEIGHTS[0]}"),
    ({"lora_name": "new", "lora_path": "{tmp}/sql", "load_inplace": "yes"}, "load_inplace: must be a boolean"),
    ({"lora_name": "base", "lora_path": "{tmp}/sql"}, "lora_name: 'base' is the base model"),
    ({"lora_name": "pinned", "lora_path": "{tmp}/sql"}, r"lora_name: 'pinned' is a LoRA adapter served for good"),
    ([], "the request body must be a JSON object"),
])
def test_a_bad_load_is_refused_naming_the_field(setting, tmp_path, body, message):
    _, runtime, _, _ = setting
    adapter(tmp_path / "unweighted", weights=False)
    if isinstance(body, dict):
        body = {key: value.replace("{tmp}", str(tmp_path)) if isinstance(value, str) else value
                for key, value in body.items()}
    with pytest.raises(ApiError, match=message) as error:
        runtime.load_request(body)
    assert error.value.status == 400
    assert directory_adapters(runtime.directory) == ["own"]


class Refusing:
    """The server's stand-in: refuses the adapter (as the target refuses one that does not fit), or answers."""

    def __init__(self, error: ApiError | None):
        self.error, self.calls = error, []

    async def generate(self, arrays, log_probs, top=False, request_id=""):
        self.calls.append(arrays)
        if self.error is not None:
            raise self.error
        yield Piece(text="x", ids=[5], finish_reason="length")

    async def close(self):
        pass


def call(served, upstream, requests, runtime_lora=True, log=None):
    async def main():
        gateway = Gateway(upstream, served, runtime_lora=runtime_lora, log=log or (lambda message: None))
        async with TestClient(TestServer(gateway.app())) as client:
            out = []
            for path, body in requests:
                response = await client.post(path, json=body)
                out.append((response.status, await response.text()))
            return out
    return asyncio.run(main())


def test_the_endpoints_answer_as_vllms_and_undo_a_load_the_server_refuses(setting):
    served, runtime, first, _ = setting
    refused = Refusing(ApiError(400, "LoRA adapter 'sql' (x) has rank 64; max_lora_rank is 16"))
    ((status, text),) = call(served, refused, [("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(first)})])
    assert status == 400 and "'sql'" in text and "not loaded: LoRA adapter" in text and "max_lora_rank" in text
    assert "sql" not in served and len(refused.calls) == 1  # the link undone
    answered, logged = Refusing(None), []
    out = call(served, answered, [("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(first)}),
                                  ("/v1/unload_lora_adapter", {"lora_name": "sql"}),
                                  ("/v1/unload_lora_adapter", {"lora_name": "sql"})], log=logged.append)
    assert out[:2] == [(200, LOADED.format("sql")), (200, UNLOADED.format("sql"))] and out[2][0] == 404
    assert logged == [f"LoRA adapter 'sql' loaded from {first}", "LoRA adapter 'sql' unloaded"]
    # the load ran one token of the adapter's model (what makes the target read it)
    (inputs,) = answered.calls
    assert inputs["lora_name"].tolist() == [[b"sql"]]
    # not allowed: not there
    off = call(served, answered, [("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(first)})],
               runtime_lora=False)
    assert off[0][0] == 404 and "sql" not in served


def test_runtime_updating_is_off_unless_asked_and_needs_a_directory(monkeypatch):
    assert not allowed_by_environment({}) and not allowed_by_environment({RUNTIME_ENV: "0"})
    assert allowed_by_environment({RUNTIME_ENV: "True"}) and allowed_by_environment({RUNTIME_ENV: "1"})
    with pytest.raises(ValueError, match="needs --lora-directory"):
        RuntimeAdapters(Served(["base"]))
    assert gateway_main.main(["--served-model-name", "m", "--allow-runtime-lora-updating"]) == 2
    monkeypatch.setenv(RUNTIME_ENV, "True")
    assert gateway_main.parse_args(["--served-model-name", "m"]).allow_runtime_lora_updating
