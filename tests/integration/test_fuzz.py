"""Malformed requests at every HTTP front door of the session's server (`make fuzz`'s tool, loadtest/fuzz.py,
seeded): each is answered or refused with a message, none is a 500, a hang or a cut stream, the server stays
ready, and every generation the requests started is freed."""

import asyncio
import importlib.util
import sys
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("fuzz", Path(__file__).resolve().parents[2] / "loadtest" / "fuzz.py")
fuzz = sys.modules["fuzz"] = importlib.util.module_from_spec(SPEC)  # (its dataclasses look it up)
SPEC.loader.exec_module(fuzz)


def test_malformed_requests_are_refused_with_a_message_and_the_server_keeps_serving(server):
    # (no "grpc": Triton 24.10's ensemble keeps some tensor refusals live until the server stops; loadtest/fuzz.py)
    base = {"openai": f"http://localhost:{server.openai_port}", "http": server.http_url}
    tallies = asyncio.run(fuzz.fuzz(base, f"http://{server.metrics_url}/metrics", requests=80, seed=1,
                                    concurrency=4, timeout_s=60, log=lambda _line: None))
    table, findings = fuzz.report(tallies)
    assert not findings, table + "".join(f"\n[{f.endpoint}] {f.what}\n  {f.request}\n  {f.answer}" for f in findings)
    endpoints = {name: t for name, t in tallies.items() if name != "server"}
    assert len(endpoints) == len([e for e in fuzz.endpoints("m") if e.port != "grpc"])
    assert sum(t.answered for t in endpoints.values()) > 10 and sum(t.refused for t in endpoints.values()) > 20, table
