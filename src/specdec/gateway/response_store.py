"""The Responses API's stored responses: what `store` keeps, `previous_response_id` continues and
`GET`/`DELETE /v1/responses/{id}` read and remove, within a byte budget, least recently used out first. Two
stores answer the same calls: ResponseStore holds them in the gateway's memory (a restart forgets them, each
replica has its own); SharedResponseStore in a directory that every replica mounts (a ReadWriteMany volume), so
that any replica continues a conversation another began, and a restart forgets nothing. docs/openai.md.

Each response keeps only its own turn (its input's messages and its output's) and the id of the response it
continued: a conversation is its chain, read back oldest first, so a long conversation costs its text once, not
once per turn. Continuing a response (or reading it) marks its whole chain used. A turn is held as its JSON's
bytes, so what the budget counts is what it takes (Python's dicts of the same would take several times more).

A background response also keeps its stream's events (`add_events`, `read_events`: JSON lines, in the budget), so
that `GET /v1/responses/{id}?stream=true` replays and follows them from any replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MIB = 1 << 20
# What the stored responses may take of the gateway's memory by default (`--responses-store-mb`): thousands of
# conversations' text, as a stored response is its own turn's text, not its conversation's
DEFAULT_MB = 256


async def in_store(store, call: Callable, *args):
    """A call of a store's from the event loop: off it for a store on a file system, whose calls wait on it."""
    return await asyncio.to_thread(call, *args) if store.blocking else call(*args)


class NotStored(KeyError):
    """A response this store does not hold (never stored, deleted or let go): `missing` names it, which
    is an earlier one of the chain when a conversation is asked for."""

    def __init__(self, missing: str):
        super().__init__(missing)
        self.missing = missing


@dataclass(frozen=True)
class _Turn:
    # JSON of {"response": the object as answered, "messages": the chat messages this turn adds (its input's,
    # then its output's), "items": its request's input items (GET /v1/responses/{id}/input_items)}
    blob: bytes
    previous: str | None   # the response it continued

    def read(self, key: str):
        return json.loads(self.blob)[key]


def _line(event: dict) -> bytes:
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n"


def _blob(response: dict, messages: list[dict], items: list[dict] | None, **more) -> bytes:
    return json.dumps({"response": response, "messages": messages, "items": items or [], **more},
                      separators=(",", ":"), ensure_ascii=False).encode("utf-8")


class ResponseStore:
    blocking = False  # its calls take microseconds: made on the event loop
    shared = False  # this process's alone

    def __init__(self, max_bytes: int):
        """max_bytes: what the stored responses may take, their JSON counted (0: nothing is stored)."""
        self.max_bytes = max_bytes
        self._turns: OrderedDict[str, _Turn] = OrderedDict()
        self._events: dict[str, list[bytes]] = {}  # a background response's stream: its events' JSON lines
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._turns)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._turns

    def sibling(self, name: str) -> "ResponseStore":
        """A store of the same kind and budget for other records (conversations.py)."""
        return ResponseStore(self.max_bytes)

    def usage(self) -> tuple[int, int]:
        """(responses kept, their bytes)."""
        return len(self._turns), self.bytes

    def ids(self) -> list[str]:
        """Every held record's id (a list endpoint's: files, batches)."""
        return list(self._turns)

    def put(self, response: dict, messages: list[dict], previous: str | None, items: list[dict] | None = None) -> bool:
        """Keep a finished response (its object, the messages its turn adds, the response it continued, its
        input items); the least recently used go until it fits. False: not kept (the store is off, or it alone
        is over the budget)."""
        blob = _blob(response, messages, items)
        if len(blob) > self.max_bytes:
            return False
        held = self._turns.pop(response["id"], None)  # replaced: its events stay
        self.bytes -= len(held.blob) if held is not None else 0
        self._turns[response["id"]] = _Turn(blob, previous)
        self.bytes += len(blob)
        self._fit()
        return True

    def add_events(self, response_id: str, events: list[dict]) -> bool:
        """Append events to a held response's stream (False: it is not held, and they are not kept)."""
        if response_id not in self._turns:
            return False
        lines = [_line(event) for event in events]
        self._events.setdefault(response_id, []).extend(lines)
        self.bytes += sum(len(line) for line in lines)
        self._fit()
        return True

    def beat(self, response_id: str) -> None:
        """The response's generator is alive (SharedResponseStore: for the other replicas to see)."""

    def end_beats(self, response_id: str) -> None:
        """The response's generator has stored its end."""

    def beat_age(self, response_id: str) -> float | None:
        """Seconds since the response's generator last beat (0: one process's store, its generator is here)."""
        return 0.0

    def read_events(self, response_id: str, start: int = 0) -> tuple[list[dict], int]:
        """A held response's events from position `start` (0: its first), and the position after them, to
        read on from (NotStored if the response is not held)."""
        self._touch(response_id)
        lines = self._events.get(response_id, [])[start:]
        return [json.loads(line) for line in lines], start + len(lines)

    def _fit(self) -> None:
        while self.bytes > self.max_bytes and self._turns:
            oldest, turn = self._turns.popitem(last=False)
            self.bytes -= len(turn.blob) + sum(len(line) for line in self._events.pop(oldest, []))

    def get(self, response_id: str) -> dict:
        """The response object (NotStored if it is not held)."""
        return self._touch(response_id).read("response")

    def replace(self, response: dict, messages: list[dict] | None = None) -> bool:
        """A held response's object anew (a background response's progress), and the messages its turn adds
        when given (its answer's, once done); False when it is not held (deleted meanwhile: not kept again)."""
        turn = self._turns.get(response["id"])
        if turn is None:
            return False
        held = json.loads(turn.blob)
        return self.put(response, held["messages"] if messages is None else messages, turn.previous, held["items"])

    def input_items(self, response_id: str) -> list[dict]:
        """Its request's input items, in the order sent (NotStored if it is not held)."""
        return self._touch(response_id).read("items")

    def delete(self, response_id: str) -> bool:
        turn = self._turns.pop(response_id, None)
        if turn is not None:
            self.bytes -= len(turn.blob) + sum(len(line) for line in self._events.pop(response_id, []))
        return turn is not None

    def conversation(self, response_id: str) -> list[dict]:
        """The chat messages of the conversation up to and including this response's answer, oldest first
        (NotStored naming the first of the chain that is no longer held)."""
        chain, current = [], response_id
        while current is not None:
            turn = self._touch(current)
            chain.append(turn.read("messages"))
            current = turn.previous
        return [message for messages in reversed(chain) for message in messages]

    def _touch(self, response_id: str) -> _Turn:
        turn = self._turns.get(response_id)
        if turn is None:
            raise NotStored(response_id)
        self._turns.move_to_end(response_id)
        return turn


# A response id as this API makes them (resp_ and hex) or a client may ask for: a file name, never a path
_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")
# Scanned, the directory is trimmed to this share of its budget: the next scan is due after that much is added
LOW_WATER = 0.9
EVENTS = ".events"  # a background response's stream: `<id>.events`, JSON lines
ALIVE = ".alive"  # touched by the replica generating a background response while it does: `<id>.alive`
# A half-written file older than this is a writer's that died: removed at the next scan
STALE_S = 3600.0


class SharedResponseStore:
    """Stored responses as files in a directory several gateway processes share: one file per response
    (`<id>.json`: its turn, as ResponseStore keeps it, and the id it continued), written whole under a
    temporary name and renamed into place (a reader never sees half of one, a rename being atomic on POSIX
    and NFS file systems). A file's modification time is its last use (reading or continuing it sets it), and
    the budget holds for the directory: a process that has added enough since it last looked lists the
    directory and removes the least recently used files down to LOW_WATER of the budget. With R processes
    sharing it the directory may overshoot by up to R x (1 - LOW_WATER) of the budget between their scans."""

    blocking = True  # file system calls (a network file system's round trips): made off the event loop
    shared = True  # other processes read, change and delete what this one keeps

    def __init__(self, directory: str | Path, max_bytes: int):
        self.directory, self.max_bytes = Path(directory), max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self.bytes = self._trim()  # as last scanned, plus what this process added since

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return sum(1 for entry in os.scandir(self.directory) if entry.name.endswith(".json"))

    def __contains__(self, response_id: str) -> bool:
        return _ID.fullmatch(response_id) is not None and self._path(response_id).is_file()

    def sibling(self, name: str) -> "SharedResponseStore":
        """A store of the same kind and budget for other records, in the subdirectory `name`."""
        return SharedResponseStore(self.directory / name, self.max_bytes)

    def usage(self) -> tuple[int, int]:
        """(responses in the directory, their bytes with their events'), every process's: the directory listed."""
        count = size = 0
        for entry in os.scandir(self.directory):
            if entry.name.endswith((".json", EVENTS)):
                try:
                    size += entry.stat().st_size
                except FileNotFoundError:  # another process removed it meanwhile
                    continue
                count += entry.name.endswith(".json")
        return count, size

    def ids(self) -> list[str]:
        """Every record's id in the directory, every process's."""
        return [entry.name.removesuffix(".json") for entry in os.scandir(self.directory)
                if entry.name.endswith(".json") and not entry.name.startswith(".")]

    def put(self, response: dict, messages: list[dict], previous: str | None, items: list[dict] | None = None) -> bool:
        """As ResponseStore.put; the file replaces one of the same id."""
        blob = _blob(response, messages, items, previous=previous)
        if len(blob) > self.max_bytes or _ID.fullmatch(response["id"]) is None:
            return False
        staged = self.directory / f".{response['id']}.{uuid.uuid4().hex}.tmp"
        staged.write_bytes(blob)
        os.replace(staged, self._path(response["id"]))
        self.bytes += len(blob)
        if self.bytes > self.max_bytes:
            self.bytes = self._trim()
        return True

    def get(self, response_id: str) -> dict:
        return self._read(response_id)["response"]

    def add_events(self, response_id: str, events: list[dict]) -> bool:
        """As ResponseStore.add_events: appended to `<id>.events` in one write (one process, the one generating
        the response, writes a response's events; readers take whole lines only)."""
        if response_id not in self:
            return False
        blob = b"".join(_line(event) for event in events)
        with open(self._events_path(response_id), "ab") as log:
            log.write(blob)
        self.bytes += len(blob)
        if self.bytes > self.max_bytes:
            self.bytes = self._trim()
        return True

    def beat(self, response_id: str) -> None:
        """`<id>.alive` touched: the replica generating the response is alive."""
        if _ID.fullmatch(response_id) is not None:
            self._alive_path(response_id).touch()

    def end_beats(self, response_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._alive_path(response_id).unlink()

    def beat_age(self, response_id: str) -> float | None:
        """Seconds since `<id>.alive` was last touched (None: it is not there: no replica generates it)."""
        try:
            return time.time() - self._alive_path(response_id).stat().st_mtime
        except (FileNotFoundError, ValueError):
            return None

    def read_events(self, response_id: str, start: int = 0) -> tuple[list[dict], int]:
        """As ResponseStore.read_events; a position is a byte offset into the events' file (a line still
        being written is left for the next read)."""
        self._read(response_id)  # held (NotStored if not), and used now
        try:
            with open(self._events_path(response_id), "rb") as log:
                log.seek(start)
                blob = log.read()
        except FileNotFoundError:  # none yet
            return [], start
        whole = blob[:blob.rfind(b"\n") + 1]
        return [json.loads(line) for line in whole.splitlines()], start + len(whole)

    def replace(self, response: dict, messages: list[dict] | None = None) -> bool:
        """As ResponseStore.replace."""
        try:
            held = self._read(response["id"])
        except NotStored:
            return False
        return self.put(response, held["messages"] if messages is None else messages, held["previous"], held["items"])

    def input_items(self, response_id: str) -> list[dict]:
        return self._read(response_id)["items"]

    def delete(self, response_id: str) -> bool:
        if _ID.fullmatch(response_id) is None:
            return False
        try:
            self._path(response_id).unlink()
        except FileNotFoundError:
            return False
        for extra in (self._events_path(response_id), self._alive_path(response_id)):
            with contextlib.suppress(FileNotFoundError):
                extra.unlink()
        return True

    def conversation(self, response_id: str) -> list[dict]:
        """As ResponseStore.conversation (each file of the chain marked used)."""
        chain, current = [], response_id
        while current is not None:
            turn = self._read(current)
            chain.append(turn["messages"])
            current = turn["previous"]
        return [message for messages in reversed(chain) for message in messages]

    def _path(self, response_id: str) -> Path:
        return self.directory / f"{response_id}.json"

    def _events_path(self, response_id: str) -> Path:
        return self.directory / f"{response_id}{EVENTS}"

    def _alive_path(self, response_id: str) -> Path:
        return self.directory / f"{response_id}{ALIVE}"

    def _read(self, response_id: str) -> dict:
        if _ID.fullmatch(response_id) is None:
            raise NotStored(response_id)
        path = self._path(response_id)
        try:
            turn = json.loads(path.read_bytes())
            os.utime(path)  # used now: the last to go
        except FileNotFoundError:  # never stored, deleted, or let go (by any process)
            raise NotStored(response_id) from None
        return turn

    def _trim(self) -> int:
        """List the directory, remove the least recently used files down to LOW_WATER of the budget (and
        writers' stale leftovers); what remains, in bytes."""
        files, events, now = [], {}, time.time()
        for entry in os.scandir(self.directory):
            try:
                stat = entry.stat()
                if entry.name.endswith(".tmp"):
                    if now - stat.st_mtime > STALE_S:
                        os.unlink(entry.path)
                elif entry.name.endswith(".json"):
                    files.append((stat.st_mtime, stat.st_size, entry.path))
                elif entry.name.endswith(ALIVE):  # a generator's beats: left by one that died with its response gone
                    if now - stat.st_mtime > STALE_S and not os.path.exists(entry.path.removesuffix(ALIVE) + ".json"):
                        os.unlink(entry.path)
                elif entry.name.endswith(EVENTS):
                    events[entry.name.removesuffix(EVENTS)] = stat.st_size
                    if now - stat.st_mtime > STALE_S and not os.path.exists(entry.path.removesuffix(EVENTS) + ".json"):
                        os.unlink(entry.path)  # its response went (an append raced its removal)
                        events.pop(entry.name.removesuffix(EVENTS))
            except FileNotFoundError:  # another process removed it meanwhile
                continue
        total = sum(size for _, size, _ in files) + sum(events.values())
        if total > self.max_bytes:
            for _, size, path in sorted(files):  # a response goes with its events
                if total <= LOW_WATER * self.max_bytes:
                    break
                stem = os.path.basename(path).removesuffix(".json")
                for gone in (path, os.path.join(self.directory, stem + EVENTS)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(gone)
                total -= size + events.get(stem, 0)
        return total
