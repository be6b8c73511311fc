"""loadtest/fuzz.py's own parts: its mutations are seeded and stay JSON, and it reports what a faulty server does
(a 500, an error without a message, a stream cut short, a hang) while a correct one's refusals pass."""

import asyncio
import importlib.util
import json
import random
import sys
from pathlib import Path

from aiohttp import web

SPEC = importlib.util.spec_from_file_location("fuzz", Path(__file__).resolve().parents[2] / "loadtest" / "fuzz.py")
fuzz = sys.modules["fuzz"] = importlib.util.module_from_spec(SPEC)  # (its dataclasses look it up)
SPEC.loader.exec_module(fuzz)


def test_mutations_are_seeded_change_the_body_and_stay_json():
    seeds = [seed for endpoint in fuzz.endpoints("m") for seed in endpoint.seeds]
    first = [fuzz.mutate(seed, random.Random(7)) for seed in seeds]
    assert first == [fuzz.mutate(seed, random.Random(7)) for seed in seeds]
    rng = random.Random(0)
    changed = 0
    for i in range(300):
        seed = seeds[i % len(seeds)]
        tree, what = fuzz.mutate(seed, rng)
        assert what
        changed += tree != seed
        json.dumps(tree).encode("utf-8", errors="surrogatepass")  # what fuzz() sends
    assert changed > 250  # (a value may be replaced by an equal one)
    assert seeds == [seed for endpoint in fuzz.endpoints("m") for seed in endpoint.seeds]  # copies were mutated


def test_combined_settings_are_the_endpoints_own_valid_keys_set_where_they_belong():
    chat = fuzz.endpoints("m")[0]
    rng = random.Random(3)
    for _ in range(50):
        seed = rng.choice(chat.seeds)
        tree, what = fuzz.combine(seed, chat.features, rng)
        for setting in what.split("; "):
            key = setting.split(" = ")[0]
            *parents, last = key.split(".")
            node = tree
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            assert json.dumps(node[last])[:37] in setting  # set where its key says
        assert set(tree) - set(seed) <= set(k.split(".")[0] for k in chat.features)
    sglang = next(e for e in fuzz.endpoints("m") if e.name == "sglang generate")
    tree, what = fuzz.combine(sglang.seeds[0], {"sampling_params.top_k": [7]}, rng)
    assert tree["sampling_params"]["top_k"] == 7 and what == "sampling_params.top_k = 7"


def _faulty_app() -> web.Application:
    async def refused(_request):
        return web.json_response({"error": {"message": "max_tokens must be positive"}}, status=400)

    async def bare_refusal(_request):
        return web.Response(text="bad", status=400)

    async def crashed(_request):
        raise ValueError("unexpected")

    async def stream(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": []}\n\n')
        if request.query.get("whole"):
            await response.write(b"data: [DONE]\n\n")
        return response

    async def hang(_request):
        await asyncio.sleep(2)

    app = web.Application()
    for path, handler in (("/refused", refused), ("/bare", bare_refusal), ("/crash", crashed), ("/stream", stream),
                          ("/hang", hang)):
        app.router.add_post(path, handler)
    return app


def test_a_faulty_servers_answers_are_findings_and_a_good_refusal_is_not():
    async def run():
        runner = web.AppRunner(_faulty_app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        base = {"openai": f"http://127.0.0.1:{port}"}
        try:
            async with fuzz.aiohttp.ClientSession() as session:
                return {path: await fuzz.send(session, base, fuzz.Endpoint(path, "openai", path, []), b"{}", 1.0)
                        for path in ("/refused", "/bare", "/crash", "/stream", "/stream?whole=1", "/hang")}
        finally:
            await runner.cleanup()

    outcomes = asyncio.run(run())
    assert outcomes["/refused"][0] == "refused"
    assert outcomes["/stream?whole=1"][0] == "answered"
    for path, problem in (("/bare", "without a JSON error message"), ("/crash", "HTTP 500"),
                          ("/stream", "ended without [DONE]"), ("/hang", "no answer within 1 s")):
        assert outcomes[path][0] == "finding" and problem in outcomes[path][1], (path, outcomes[path])


def test_tensor_requests_are_seeded_and_keep_a_prompt_of_the_inputs_types():
    spec = [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
            {"name": "max_tokens", "data_type": "TYPE_INT32", "dims": [1]},
            {"name": "prompt_token_ids", "data_type": "TYPE_INT32", "dims": [-1]},
            {"name": "temperature", "data_type": "TYPE_FP32", "dims": [1]},
            {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1]}]
    first = [fuzz.tensor_request(spec, random.Random(i)) for i in range(40)]
    again = [fuzz.tensor_request(spec, random.Random(i)) for i in range(40)]
    assert [w for _, w in first] == [w for _, w in again]
    assert all(all((a == b).all() or a.dtype.kind == "f" for a, b in zip(x.values(), y.values()))
               for (x, _), (y, _) in zip(first, again))
    kinds = {name: arrays[name].dtype for arrays, _ in first for name in arrays}
    assert kinds["text_input"] == object and len(kinds) == 5
    assert any("batch of two" in what for _, what in (fuzz.tensor_request(spec, random.Random(i)) for i in range(200)))
