"""OpenAI's Batch API (gateway/batches.py): a file's requests checked line by line, answered CONCURRENCY at a
time, counted, written as output and error files in the input's order; cancelled (here or by another replica
sharing the store), failed when the replica running it is gone or stops. The answers are a stand-in (the
served tests: tests/integration/test_openai_api.py)."""

import asyncio
import json

import pytest

from specdec.gateway import batches
from specdec.gateway.batches import Batches, Files, parse_requests
from specdec.gateway.protocol import ApiError
from specdec.gateway.response_store import ResponseStore, SharedResponseStore

URL = "/v1/chat/completions"


def line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": URL,
            "body": {"model": "m", "messages": [{"role": "user", "content": custom_id}], **body}}


def jsonl(lines) -> bytes:
    return "\n".join(item if isinstance(item, str) else json.dumps(item) for item in lines).encode()


class Answers:
    """Answers each request with its custom text (a body asking `"fail": true` gets a 400); with `hold`, each
    waits until the test releases it. Counts the requests in flight."""

    def __init__(self, hold: bool = False):
        self.gate = asyncio.Semaphore(0) if hold else None
        self.in_flight = self.most = self.started = 0

    async def __call__(self, url: str, body: dict) -> tuple[int, dict]:
        self.in_flight += 1
        self.started += 1
        self.most = max(self.most, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.acquire()
            await asyncio.sleep(0)
            if body.get("fail"):
                return 400, ApiError(400, "fail: refused", "fail").body()
            text = body["messages"][0]["content"]
            return 200, {"choices": [{"message": {"content": text}}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                   "prompt_tokens_details": {"cached_tokens": 1}}}
        finally:
            self.in_flight -= 1


async def until(jobs: Batches, batch_id: str, statuses=("completed", "failed", "cancelled")) -> dict:
    for _ in range(2000):
        batch = await jobs.get(batch_id)
        if batch["status"] in statuses:
            return batch
        await asyncio.sleep(0.01)
    raise AssertionError(f"batch {batch_id} still {batch['status']}")


async def lines_of(files: Files, file_id: str) -> list[dict]:
    return [json.loads(text) for text in (await files.content(file_id)).splitlines()]


def test_a_files_lines_are_checked_and_each_error_names_its_line():
    text = jsonl([line("a"), "not json", line("a"), {**line("b"), "url": "/v1/embeddings"},
                  {**line("c"), "method": "GET"}, line("d", stream=True), "", {"custom_id": "e", "method": "POST",
                                                                                 "url": URL, "body": []}, [1]])
    requests, errors = parse_requests(text.decode(), URL)
    assert [(e["line"], e["code"], e["param"]) for e in errors] == [
        (2, "invalid_json_line", None), (3, "duplicate_custom_id", "custom_id"), (4, "mismatched_endpoint", "url"),
        (5, "invalid_method", "method"), (6, "invalid_request", "body.stream"), (8, "invalid_request", "body"),
        (9, "invalid_request", None)]
    assert parse_requests("", URL)[1][0]["code"] == "empty_file"
    good, none = parse_requests(jsonl([line("a"), line("b")]).decode(), URL)
    assert [r["custom_id"] for r in good] == ["a", "b"] and none == []


def test_a_line_holding_line_separators_raw_is_one_request_and_its_answer_one_line():
    """JSON may hold U+2028, U+2029 and U+0085 raw in a string; str.splitlines() ends lines there. A file's line
    holding them is one request, and its output line stays one line for a reader that splits so."""
    odd = "a\u2028b\x85c\u2029d"
    text = "\n".join(json.dumps(item, ensure_ascii=False) for item in (line(odd), line("e"))) + "\r\n"
    requests, errors = parse_requests(text, URL)
    assert errors == [] and [r["custom_id"] for r in requests] == [odd, "e"]

    async def main():
        store = ResponseStore(1 << 22)
        files = Files(store.sibling("files"))
        jobs = Batches(store.sibling("batches"), files, Answers(), drain_timeout_s=1)
        upload = await files.create(text.encode(), "in.jsonl", "batch")
        done = await until(jobs, (await jobs.create({"input_file_id": upload["id"], "endpoint": URL,
                                                     "completion_window": "24h"}))["id"])
        out = await lines_of(files, done["output_file_id"])  # splitlines(): one line each
        assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == [odd, "e"]
        assert "\\u2028" in await files.content(done["output_file_id"])  # escaped: the same JSON string
    asyncio.run(main())


def test_a_batch_answers_every_request_in_order_within_its_concurrency():
    async def main():
        store = ResponseStore(1 << 22)
        files, answers = Files(store.sibling("files")), Answers()
        jobs = Batches(store.sibling("batches"), files, answers, drain_timeout_s=1)
        n = batches.CONCURRENCY * 2 + 3
        requests = [line(f"r{i}", **({"fail": True} if i % 10 == 4 else {})) for i in range(n)]
        upload = await files.create(jsonl(requests), "in.jsonl", "batch")
        started = await jobs.create({"input_file_id": upload["id"], "endpoint": URL, "completion_window": "24h",
                                     "metadata": {"job": "nightly"}})
        assert started["status"] == "in_progress" and started["request_counts"]["total"] == n
        assert started["model"] == "m" and started["metadata"] == {"job": "nightly"}
        done = await until(jobs, started["id"])
        failed = [i for i in range(n) if i % 10 == 4]
        assert done["status"] == "completed" and answers.most == batches.CONCURRENCY
        assert done["request_counts"] == {"total": n, "completed": n - len(failed), "failed": len(failed)}
        out, err = await lines_of(files, done["output_file_id"]), await lines_of(files, done["error_file_id"])
        assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(n) if i not in failed]
        assert all(o["response"]["body"]["choices"][0]["message"]["content"] == o["custom_id"] for o in out)
        assert [e["custom_id"] for e in err] == [f"r{i}" for i in failed]
        assert {e["response"]["status_code"] for e in err} == {400} and err[0]["response"]["body"]["error"]["param"] == "fail"
        assert done["usage"] == {"input_tokens": 3 * len(out), "input_tokens_details": {"cached_tokens": len(out)},
                                 "output_tokens": 2 * len(out), "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": 5 * len(out)}
        assert (await files.get(done["output_file_id"]))["purpose"] == "batch_output"
        assert [b["id"] for b in await jobs.all()] == [started["id"]]
        assert [f["id"] for f in await files.all("batch")] == [upload["id"]]
    asyncio.run(main())


def test_a_batchs_usage_sums_the_chats_and_the_responses_apis_alike():
    chat = {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4},
            "completion_tokens_details": {"reasoning_tokens": 1}}
    response = {"input_tokens": 7, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 2}}
    assert batches._usage([chat, response, {}]) == {
        "input_tokens": 12, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 3}, "total_tokens": 17}


@pytest.mark.parametrize("body, param", [
    ({"endpoint": "/v1/embeddings"}, "endpoint"), ({"completion_window": "1h"}, "completion_window"),
    ({"input_file_id": "file-none"}, "input_file_id"), ({"metadata": {"a": 1}}, "metadata"), ({"extra": 1}, "extra")])
def test_a_batch_request_is_refused_naming_its_field(body, param):
    async def main():
        store = ResponseStore(1 << 20)
        files = Files(store.sibling("files"))
        jobs = Batches(store.sibling("batches"), files, Answers(), drain_timeout_s=1)
        upload = await files.create(jsonl([line("a")]), "in.jsonl", "batch")
        with pytest.raises(ApiError) as caught:
            await jobs.create({"input_file_id": upload["id"], "endpoint": URL, "completion_window": "24h", **body})
        assert caught.value.param == param or caught.value.param == "file_id"
        # a file whose lines are not requests: the batch fails at once, its errors naming the lines
        bad = await files.create(jsonl([line("a"), "{"]), "bad.jsonl", "batch")
        failed = await jobs.create({"input_file_id": bad["id"], "endpoint": URL, "completion_window": "24h"})
        assert failed["status"] == "failed" and failed["errors"]["data"][0]["line"] == 2
    asyncio.run(main())


def test_files_are_refused_by_purpose_encoding_and_a_store_that_keeps_none():
    async def main():
        files = Files(ResponseStore(1 << 20))
        for args, param in (((b"x", "a", "fine-tune"), "purpose"), ((b"\xff", "a", "batch"), "file")):
            with pytest.raises(ApiError) as caught:
                await files.create(*args)
            assert caught.value.param == param
        with pytest.raises(ApiError) as caught:
            await Files(ResponseStore(0)).create(b"x", "a", "batch")
        assert "keeps no files" in caught.value.message
        with pytest.raises(ApiError) as caught:
            await Files(ResponseStore(100)).create(b"x" * 200, "a", "batch")
        assert caught.value.status == 413
        kept = await files.create(b"{}", "a.jsonl", "batch")
        assert await files.delete(kept["id"]) == {"id": kept["id"], "object": "file", "deleted": True}
        with pytest.raises(ApiError) as caught:
            await files.get(kept["id"])
        assert caught.value.status == 404
    asyncio.run(main())


def test_a_cancel_stops_the_requests_in_flight_and_keeps_the_answered():
    async def main():
        store = ResponseStore(1 << 22)
        files, answers = Files(store.sibling("files")), Answers(hold=True)
        jobs = Batches(store.sibling("batches"), files, answers, drain_timeout_s=1)
        upload = await files.create(jsonl([line(f"r{i}") for i in range(10)]), "in.jsonl", "batch")
        started = await jobs.create({"input_file_id": upload["id"], "endpoint": URL, "completion_window": "24h"})
        for _ in range(3):
            answers.gate.release()
        while answers.started < 10:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        cancelling = await jobs.cancel(started["id"])
        assert cancelling["status"] in ("cancelling", "cancelled")
        done = await until(jobs, started["id"])
        assert done["status"] == "cancelled" and done["cancelled_at"] and answers.in_flight == 0
        assert done["request_counts"] == {"total": 10, "completed": 3, "failed": 0}
        assert [o["custom_id"] for o in await lines_of(files, done["output_file_id"])] == ["r0", "r1", "r2"]
        assert await jobs.cancel(started["id"]) == done  # ended: as it is
    asyncio.run(main())


def test_replicas_sharing_a_store_cancel_and_fail_each_others_batches(tmp_path, monkeypatch):
    """Another replica's cancel stops a batch within WATCH_S; a batch whose replica is gone (its beats
    stopped) is failed by the first replica that reads it; a stop fails the batches still running."""
    monkeypatch.setattr(batches, "WATCH_S", 0.05)

    async def main():
        def replica(answers):
            store = SharedResponseStore(tmp_path, 1 << 22)
            files = Files(store.sibling("files"))
            return Batches(store.sibling("batches"), files, answers, drain_timeout_s=0.1), files

        answers = Answers(hold=True)
        (a, files), (b, _) = replica(answers), replica(Answers())
        upload = await files.create(jsonl([line(f"r{i}") for i in range(4)]), "in.jsonl", "batch")
        body = {"input_file_id": upload["id"], "endpoint": URL, "completion_window": "24h"}
        started = await a.create(body)
        answers.gate.release()
        while answers.started < 4:
            await asyncio.sleep(0.01)
        assert (await b.get(started["id"]))["status"] == "in_progress"  # a beats: alive
        assert (await b.cancel(started["id"]))["status"] == "cancelling"
        done = await until(a, started["id"])
        assert done["status"] == "cancelled" and done["request_counts"]["completed"] == 1
        assert (await b.get(started["id"]))["status"] == "cancelled"
        # a replica gone: its batch pending, no beats (never beaten here) -> failed when read
        orphan = {**done, "id": "batch_gone", "status": "in_progress"}
        await b._store(orphan)
        assert (await b.get("batch_gone"))["status"] == "failed"
        # a stop: the batch still running fails, its answers so far kept
        running = await a.create(body)
        await a.finish()
        stopped = await a.get(running["id"])
        assert stopped["status"] == "failed" and stopped["errors"]["data"][0]["code"] == "server_shutdown"
    asyncio.run(main())


def test_a_file_past_its_expiry_is_gone_and_a_batch_gives_its_output_files_one(monkeypatch):
    """expires_after / output_expires_after ({"anchor": "created_at", "seconds": N}, N within an hour and 30
    days): the file's expires_at; past it the file is not read, listed nor its text kept. Bad values are
    refused naming the field."""
    clock = [1_000_000]
    monkeypatch.setattr(batches, "_now", lambda: clock[0])

    async def main():
        store = ResponseStore(1 << 20)
        files = Files(store)
        kept = await files.create(b"{}", "a.jsonl", "batch", batches.expiry({"anchor": "created_at", "seconds": "3600"},
                                                                             "expires_after"))
        forever = await files.create(b"{}", "b.jsonl", "batch")
        assert (kept["expires_at"], forever["expires_at"]) == (1_000_000 + 3600, None)
        clock[0] += 3599
        assert (await files.get(kept["id"]))["id"] == kept["id"] and await files.content(kept["id"]) == "{}"
        clock[0] += 1
        for read in (files.get, files.content):
            with pytest.raises(ApiError) as caught:
                await read(kept["id"])
            assert caught.value.status == 404
        assert [file["id"] for file in await files.all()] == [forever["id"]]
        for value, message in (({"anchor": "last_active_at", "seconds": 3600}, "anchor"),
                               ({"anchor": "created_at", "seconds": 60}, r"within \[3600, 2592000\]"),
                               ({"anchor": "created_at"}, "anchor"), ("3600", "anchor")):
            with pytest.raises(ApiError, match=message) as caught:
                batches.expiry(value, "expires_after")
            assert caught.value.param == "expires_after"

        jobs = Batches(store, files, Answers(), 5.0)
        source = await files.create(jsonl([line("a"), line("b", fail=True)]), "in.jsonl", "batch")
        body = {"input_file_id": source["id"], "endpoint": URL, "completion_window": "24h"}
        with pytest.raises(ApiError) as caught:
            await jobs.create({**body, "output_expires_after": {"anchor": "created_at", "seconds": 10}})
        assert caught.value.param == "output_expires_after"
        batch = await jobs.create({**body, "output_expires_after": {"anchor": "created_at", "seconds": 7200}})
        done = await until(jobs, batch["id"])
        for name in ("output_file_id", "error_file_id"):
            assert (await files.get(done[name]))["expires_at"] == clock[0] + 7200
    asyncio.run(main())
