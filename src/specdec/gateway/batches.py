"""OpenAI's Batch API: `/v1/files` keeps a JSONL file of requests (`purpose: batch`), `/v1/batches` answers
each of its requests with the endpoint it names, as that endpoint answers one (`answer`), and keeps the
answers as an output file (status 200) and an error file (the others), in the input's order, each line
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}` as OpenAI writes them.

Files and batches are kept in stores of the response stores' kind (response_store.py: in memory, or in `files`
and `batches` directories beside the stored responses that replicas share), each within the same budget,
least recently used out first (a batch's output is a file like any: read it before it ages out). A batch runs
where it was created, CONCURRENCY of its requests at a time (the server batches them with everything else it
serves); its request_counts are stored as it goes (at most every PROGRESS_S); a cancel made on any replica
stops it within WATCH_S (the requests in flight are cancelled, the answered ones kept); with a shared store it
beats while it runs, and a batch whose replica died (no beat for background.ORPHAN_S) is failed by the first
replica that reads it. A stop fails the batches still running (their answers so far kept). docs/openai.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Awaitable, Callable

from specdec.decoding import json_text
from specdec.gateway.background import ORPHAN_S, WATCH_S, drain
from specdec.gateway.protocol import ApiError, invalid, json_line
from specdec.gateway.response_store import NotStored, in_store

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")  # what a batch's requests may call
COMPLETION_WINDOW = "24h"  # the one window OpenAI's API takes
CONCURRENCY = 32  # a batch's requests in flight at a time
MAX_REQUESTS = 50_000  # a batch's, as OpenAI's API allows
MAX_FILE_BYTES = 200 << 20  # an uploaded file's, as OpenAI's API allows for a batch's input
PROGRESS_S = 1.0  # a running batch's request_counts are stored at most this often
PURPOSES = ("batch", "batch_output")  # a file's: the input a client uploads, the output a batch writes
PENDING = ("validating", "in_progress", "finalizing", "cancelling")

# answer(url, body): one request answered whole as its endpoint answers it: (HTTP status, the JSON body)
Answer = Callable[[str, dict], Awaitable[tuple[int, dict]]]


def _now() -> int:
    return int(time.time())


EXPIRY_S = (3600, 30 * 24 * 3600)  # what OpenAI's expires_after takes: an hour to 30 days after creation


def expiry(value, field: str) -> int | None:
    """Seconds after creation from an `expires_after` object ({"anchor": "created_at", "seconds": N}); None
    for none; ApiError naming `field`."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"anchor", "seconds"} or value["anchor"] != "created_at":
        raise invalid(field, 'must be {"anchor": "created_at", "seconds": N}')
    seconds = value["seconds"]
    if isinstance(seconds, str) and seconds.isdigit():  # a multipart form's field is text
        seconds = int(seconds)
    if not isinstance(seconds, int) or isinstance(seconds, bool) or not EXPIRY_S[0] <= seconds <= EXPIRY_S[1]:
        raise invalid(field, f"seconds must be an integer within [{EXPIRY_S[0]}, {EXPIRY_S[1]}], got {seconds!r}")
    return seconds


class Files:
    """Uploaded and written files: a file object kept as a stored record, its text as the one item of a record
    of the same id in a store of its own (`contents`), so that reading or listing files reads no file's text.
    A file past its `expires_at` is gone: deleted by the first read or listing that finds it so."""

    def __init__(self, store):
        self.store, self.contents = store, store.sibling("contents")

    async def create(self, content: bytes, filename: str, purpose: str, expires_after_s: int | None = None) -> dict:
        if not self.store.enabled:
            raise invalid("file", "cannot be kept: this server keeps no files (its --responses-store-mb is 0)")
        if purpose not in PURPOSES:
            raise invalid("purpose", f"must be one of {', '.join(PURPOSES)} (this server keeps files for batches)")
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError:
            raise invalid("file", "must be UTF-8 text (JSON lines)") from None
        now = _now()
        file = {"id": "file-" + uuid.uuid4().hex, "object": "file", "bytes": len(content), "created_at": now,
                "filename": filename, "purpose": purpose, "status": "processed",
                "expires_at": None if expires_after_s is None else now + expires_after_s, "status_details": None}
        if not await in_store(self.contents, self.contents.put, {"id": file["id"]}, [], None, [{"content": text}]):
            raise ApiError(413, f"the file ({len(content)} bytes) is larger than this server's store for files "
                                "(--responses-store-mb)", "file")
        await in_store(self.store, self.store.put, file, [], None)
        return file

    async def get(self, file_id: str) -> dict:
        try:
            file = await in_store(self.store, self.store.get, file_id)
        except NotStored:
            file = None
        if file is None or await self._expired(file):
            raise ApiError(404, f"No such File object: {file_id}", "file_id", "file_not_found")
        return file

    async def _expired(self, file: dict) -> bool:
        """Whether `file` is past its expires_at (then deleted, text and object)."""
        if file.get("expires_at") is None or _now() < file["expires_at"]:
            return False
        await in_store(self.contents, self.contents.delete, file["id"])
        await in_store(self.store, self.store.delete, file["id"])
        return True

    async def content(self, file_id: str) -> str:
        await self.get(file_id)  # not one past its expiry
        try:
            return (await in_store(self.contents, self.contents.input_items, file_id))[0]["content"]
        except NotStored:
            raise ApiError(404, f"No such File object: {file_id}", "file_id", "file_not_found") from None

    async def delete(self, file_id: str) -> dict:
        await in_store(self.contents, self.contents.delete, file_id)
        if not await in_store(self.store, self.store.delete, file_id):
            raise ApiError(404, f"No such File object: {file_id}", "file_id", "file_not_found")
        return {"id": file_id, "object": "file", "deleted": True}

    async def all(self, purpose: str | None = None) -> list[dict]:
        """Every file (of that purpose), oldest first."""
        return [file for file in await _all(self.store) if (purpose is None or file["purpose"] == purpose)
                and not await self._expired(file)]


class Batches:
    def __init__(self, store, files: Files, answer: Answer, drain_timeout_s: float):
        self.store, self.files, self.answer, self.drain_timeout_s = store, files, answer, drain_timeout_s
        self._tasks: dict[str, asyncio.Task] = {}  # the batches this process runs, by id
        self._cancelled: set[str] = set()  # of those, the ones a cancel stopped

    def __len__(self) -> int:
        return len(self._tasks)

    async def create(self, body) -> dict:
        """A batch of an uploaded file's requests, started (or failed at once: a file whose lines are not
        requests to the endpoint, each error naming its line)."""
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata",
                                      "output_expires_after"})
        if unknown:
            raise invalid(unknown[0], "unrecognized request argument (not supported by this server)")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise invalid("endpoint", f"must be one of {', '.join(ENDPOINTS)} (this server's), got "
                                      f"{json.dumps(endpoint)[:60]}")
        if body.get("completion_window") != COMPLETION_WINDOW:
            raise invalid("completion_window", f"must be {COMPLETION_WINDOW!r}")
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise invalid("metadata", "must be an object of at most 16 string keys and values")
        output_expiry = expiry(body.get("output_expires_after"), "output_expires_after")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise invalid("input_file_id", "must be the id of an uploaded file")
        file = await self.files.get(file_id)
        if file["purpose"] != "batch":
            raise invalid("input_file_id", f"{file_id} is a {file['purpose']} file, not a batch's input (purpose batch)")
        requests, errors = parse_requests(await self.files.content(file_id), endpoint)
        now = _now()
        batch = {"id": "batch_" + uuid.uuid4().hex, "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": file_id, "completion_window": COMPLETION_WINDOW, "status": "in_progress",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": now,
                 "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": len(requests), "completed": 0, "failed": 0}, "metadata": metadata,
                 "model": next((r["body"].get("model") for r in requests if isinstance(r["body"].get("model"), str)),
                               None), "usage": _usage([])}
        if errors:
            batch.update(status="failed", failed_at=now, in_progress_at=None,
                         errors={"object": "list", "data": errors[:100]},
                         request_counts={"total": 0, "completed": 0, "failed": 0})
            await self._store(batch)
            return batch
        await in_store(self.store, self.store.beat, batch["id"])  # before it is stored: never pending unbeaten
        await self._store(batch)
        task = asyncio.create_task(self._run(batch, requests, output_expiry))
        self._tasks[batch["id"]] = task
        task.add_done_callback(lambda _task: self._tasks.pop(batch["id"], None))
        return batch

    async def get(self, batch_id: str) -> dict:
        """A batch as it stands (one whose replica died, failed: `current`)."""
        try:
            return await self._current(await in_store(self.store, self.store.get, batch_id))
        except NotStored:
            raise ApiError(404, f"No such Batch object: {batch_id}", "batch_id", "batch_not_found") from None

    async def all(self) -> list[dict]:
        """Every batch, oldest first."""
        return [await self._current(batch) for batch in await _all(self.store)]

    async def cancel(self, batch_id: str) -> dict:
        """A running batch cancelled: `cancelling` until its requests in flight stop, then `cancelled` (its
        answers so far in its files); an ended one as it is."""
        batch = await self.get(batch_id)
        if batch["status"] not in PENDING or batch["status"] == "cancelling":
            return batch
        batch = {**batch, "status": "cancelling", "cancelling_at": _now()}
        await self._store(batch)
        task = self._tasks.get(batch_id)
        if task is not None:
            self._cancelled.add(batch_id)
            task.cancel()
        return batch

    async def finish(self, _app=None) -> None:
        """At a stop: the batches running get the drain's time, then fail with what they answered kept."""
        await drain(list(self._tasks.values()), self.drain_timeout_s)

    async def _current(self, batch: dict) -> dict:
        if batch["status"] not in PENDING or batch["id"] in self._tasks:
            return batch
        age = await in_store(self.store, self.store.beat_age, batch["id"])
        if age is not None and age <= ORPHAN_S:
            return batch
        failed = {**batch, "status": "failed", "failed_at": _now(), "errors": {"object": "list", "data": [
            {"code": "server_error", "message": "the server running this batch stopped before it was done",
             "param": None, "line": None}]}}
        await self._store(failed)
        await in_store(self.store, self.store.end_beats, batch["id"])
        return failed

    async def _store(self, batch: dict) -> None:
        if not await in_store(self.store, self.store.put, batch, [], None):
            raise ApiError(507, "this server's store for batches is full (--responses-store-mb)")

    async def _run(self, batch: dict, requests: list[dict], output_expiry: int | None = None) -> None:
        """Answer the requests, CONCURRENCY at a time, counting as they end; then the files and the end."""
        results: list[dict | None] = [None] * len(requests)
        counts, answered = batch["request_counts"], []
        stored_at = time.monotonic()
        watch = asyncio.create_task(self._watch(batch["id"]))
        pending = iter(enumerate(requests))  # shared by the workers: each request taken once

        async def worker() -> None:
            for index, request in pending:
                await one(index, request)

        async def one(index: int, request: dict) -> None:
            nonlocal stored_at
            status, body = await self.answer(request["url"], request["body"])
            results[index] = {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": request["custom_id"],
                              "response": {"status_code": status, "request_id": "req_" + uuid.uuid4().hex,
                                           "body": body}, "error": None}
            counts["completed" if status == 200 else "failed"] += 1
            if status == 200:
                answered.append(body.get("usage") or {})
            if time.monotonic() - stored_at >= PROGRESS_S:  # progress, unless another replica's cancel came
                stored_at = time.monotonic()
                with contextlib.suppress(NotStored):
                    if (await in_store(self.store, self.store.get, batch["id"]))["status"] == "in_progress":
                        await self._store({**batch, "request_counts": dict(counts), "usage": _usage(answered)})

        end: dict = {}
        try:
            await asyncio.gather(*(worker() for _ in range(min(CONCURRENCY, len(requests)))))
            end = {"status": "completed", "completed_at": _now()}
        except asyncio.CancelledError:
            end = ({"status": "cancelled", "cancelled_at": _now()} if batch["id"] in self._cancelled else
                   {"status": "failed", "failed_at": _now(), "errors": {"object": "list", "data": [
                       {"code": "server_shutdown", "message": "the server stopped before this batch was done",
                        "param": None, "line": None}]}})
        except Exception as exc:  # noqa: BLE001 - whatever broke, the batch says so rather than stay in progress
            end = {"status": "failed", "failed_at": _now(), "errors": {"object": "list", "data": [
                {"code": "server_error", "message": f"{type(exc).__name__}: {exc}", "param": None, "line": None}]}}
        finally:
            watch.cancel()
        self._cancelled.discard(batch["id"])
        with contextlib.suppress(NotStored):  # another replica's cancel since the last look
            if end["status"] == "completed" and (await in_store(self.store, self.store.get, batch["id"]))[
                    "status"] == "cancelling":
                end = {"status": "cancelled", "cancelled_at": _now()}
        files = {}
        for name, lines in (("output_file_id", [r for r in results if r and r["response"]["status_code"] == 200]),
                            ("error_file_id", [r for r in results if r and r["response"]["status_code"] != 200])):
            if lines:
                text = "".join(json_line(line) + "\n" for line in lines)
                try:
                    files[name] = (await self.files.create(text.encode("utf-8"), f"{batch['id']}_{name[:-8]}.jsonl",
                                                           "batch_output", output_expiry))["id"]
                except ApiError as exc:  # too large for the store: the batch says so
                    end = {"status": "failed", "failed_at": _now(), "errors": {"object": "list", "data": [
                        {"code": "output_too_large", "message": exc.message, "param": None, "line": None}]}}
        final = {**batch, **files, **end, "request_counts": dict(counts), "usage": _usage(answered),
                 "finalizing_at": _now()}
        with contextlib.suppress(ApiError):
            await self._store(final)
        await in_store(self.store, self.store.end_beats, batch["id"])

    async def _watch(self, batch_id: str) -> None:
        """Another replica's cancel of a batch this process runs; the beats that say this one runs it."""
        while True:
            await asyncio.sleep(WATCH_S)
            await in_store(self.store, self.store.beat, batch_id)
            if not self.store.shared:
                continue
            try:
                status = (await in_store(self.store, self.store.get, batch_id))["status"]
            except NotStored:
                status = "cancelling"
            if status == "cancelling":
                task = self._tasks.get(batch_id)
                if task is not None:
                    self._cancelled.add(batch_id)
                    task.cancel()
                return


def parse_requests(text: str, endpoint: str) -> tuple[list[dict], list[dict]]:
    """A batch input file's requests, and its errors (each naming its line, 1-based, as OpenAI's do): a line is
    a JSON object {"custom_id": a string unique in the file, "method": "POST", "url": the batch's endpoint,
    "body": an object}; a whole answer only (no stream)."""
    requests, errors, seen = [], [], set()

    def error(line: int | None, code: str, message: str, param: str | None = None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": line})

    # JSONL's lines end at "\n" alone: a JSON string may hold U+2028 and the like raw, where splitlines() would cut
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            request = json_text.parse(line)  # (a lone surrogate too: json_text)
        except ValueError:
            error(number, "invalid_json_line", "This line is not parseable as valid JSON.")
            continue
        if not isinstance(request, dict):
            error(number, "invalid_request", "A line must be a JSON object.")
            continue
        custom_id = request.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            error(number, "missing_required_parameter", "The request is missing custom_id.", "custom_id")
        elif custom_id in seen:
            error(number, "duplicate_custom_id", f"The custom_id {custom_id!r} is not unique in the file.",
                  "custom_id")
        seen.add(custom_id)
        if request.get("method") != "POST":
            error(number, "invalid_method", "The method must be POST.", "method")
        if request.get("url") != endpoint:
            error(number, "mismatched_endpoint", f"The url must be the batch's endpoint, {endpoint}.", "url")
        body = request.get("body")
        if not isinstance(body, dict):
            error(number, "invalid_request", "The body must be a JSON object.", "body")
        elif body.get("stream"):
            error(number, "invalid_request", "A batch's request cannot stream.", "body.stream")
        requests.append(request)
    if not requests and not errors:
        error(None, "empty_file", "The file holds no requests.")
    if len(requests) > MAX_REQUESTS:
        error(None, "too_many_requests", f"A batch holds at most {MAX_REQUESTS} requests, the file {len(requests)}.")
    return requests, errors


def _usage(answers: list[dict]) -> dict:
    """A batch's usage, as OpenAI reports it: its answered requests' tokens summed (the chat's and completions'
    usage, or the Responses API's, in the Responses API's names)."""
    def total(*paths) -> int:
        out = 0
        for usage in answers:
            for path in paths:  # the first naming that the answer has
                value = usage
                for key in path:
                    value = value.get(key) if isinstance(value, dict) else None
                if isinstance(value, int):
                    out += value
                    break
        return out
    prompt, completion = total(("prompt_tokens",), ("input_tokens",)), total(("completion_tokens",), ("output_tokens",))
    cached = total(("prompt_tokens_details", "cached_tokens"), ("input_tokens_details", "cached_tokens"))
    reasoning = total(("completion_tokens_details", "reasoning_tokens"), ("output_tokens_details", "reasoning_tokens"))
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": prompt + completion}


async def _all(store) -> list[dict]:
    """Every record of a store (files, batches), oldest first."""
    records = []
    for record_id in await in_store(store, store.ids):
        with contextlib.suppress(NotStored):
            records.append(await in_store(store, store.get, record_id))
    return sorted(records, key=lambda record: (record["created_at"], record["id"]))
