"""The Responses API's stored responses: what `store` keeps, `previous_response_id` continues and
`GET`/`DELETE /v1/responses/{id}` read and remove. Held in the gateway's memory (a restart forgets them), within
a byte budget, least recently used out first. Pure. docs/openai.md.

Each response keeps only its own turn (its input's messages and its output's) and the id of the response it
continued: a conversation is its chain, read back oldest first, so a long conversation costs its text once, not
once per turn. Continuing a response (or reading it) marks its whole chain used. A turn is held as its JSON's
bytes, so what the budget counts is what it takes (Python's dicts of the same would take several times more).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

MIB = 1 << 20
# What the stored responses may take of the gateway's memory by default (`--responses-store-mb`): thousands of
# conversations' text, as a stored response is its own turn's text, not its conversation's
DEFAULT_MB = 256


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


class ResponseStore:
    def __init__(self, max_bytes: int):
        """max_bytes: what the stored responses may take, their JSON counted (0: nothing is stored)."""
        self.max_bytes = max_bytes
        self._turns: OrderedDict[str, _Turn] = OrderedDict()
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._turns)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._turns

    def put(self, response: dict, messages: list[dict], previous: str | None, items: list[dict] | None = None) -> bool:
        """Keep a finished response (its object, the messages its turn adds, the response it continued, its
        input items); the least recently used go until it fits. False: not kept (the store is off, or it alone
        is over the budget)."""
        blob = json.dumps({"response": response, "messages": messages, "items": items or []},
                          separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(blob) > self.max_bytes:
            return False
        self.delete(response["id"])
        self._turns[response["id"]] = _Turn(blob, previous)
        self.bytes += len(blob)
        while self.bytes > self.max_bytes:
            _, oldest = self._turns.popitem(last=False)
            self.bytes -= len(oldest.blob)
        return True

    def get(self, response_id: str) -> dict:
        """The response object (NotStored if it is not held)."""
        return self._touch(response_id).read("response")

    def input_items(self, response_id: str) -> list[dict]:
        """Its request's input items, in the order sent (NotStored if it is not held)."""
        return self._touch(response_id).read("items")

    def delete(self, response_id: str) -> bool:
        turn = self._turns.pop(response_id, None)
        if turn is not None:
            self.bytes -= len(turn.blob)
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
