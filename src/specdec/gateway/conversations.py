"""OpenAI's Conversations API (`/v1/conversations`, and `conversation` on a Responses request): a conversation
is a list of items (the Responses API's: messages, function calls and their outputs, reasoning) that
responses read as their history and add their input and output to. Kept in a store of the response stores'
kind of its own (response_store.py: in memory, or in a `conversations` directory beside the stored responses
that replicas share), within the same budget, least recently used out first. docs/openai.md.

Each change reads the conversation, changes it and writes it back whole: one process's changes to a
conversation are made one at a time (a lock per conversation); two replicas changing one conversation at the
same moment may lose one's change (a plain file system has no compare-and-set).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from specdec.gateway import responses
from specdec.gateway.protocol import ApiError, invalid
from specdec.gateway.response_store import NotStored, in_store

MAX_ITEMS = 20  # items a create or an add may carry, as OpenAI's API allows
MAX_METADATA = 16  # metadata's keys, as OpenAI's objects allow


def checked_items(given, where: str = "items") -> list[dict]:
    """A request's items (ApiError naming the field) as the conversation keeps them: with ids and statuses."""
    if given is None:
        return []
    if not isinstance(given, list):
        raise invalid(where, "must be a list of items")
    if len(given) > MAX_ITEMS:
        raise invalid(where, f"at most {MAX_ITEMS} items at a time")
    if not given:
        return []
    try:
        responses.input_messages({"input": given})
    except ApiError as exc:
        raise ApiError(exc.status, exc.message.replace("input", where, 1), (exc.param or "").replace(
            "input", where, 1), exc.code) from None
    return responses.input_items({"input": given})


def checked_metadata(metadata) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise invalid("metadata", f"must be an object of at most {MAX_METADATA} string keys and values")
    return metadata


def conversation_id(value) -> str | None:
    """A Responses request's `conversation`: its id (a string, or {"id": ...}); None when it has none."""
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str):
        raise invalid("conversation", "must be a conversation's id, or {\"id\": ...}")
    return value


class Conversations:
    def __init__(self, store):
        """store: a ResponseStore or SharedResponseStore of their own: a conversation is kept as a stored
        record whose object is the conversation and whose items are its items."""
        self.store = store
        # of the conversations being changed now: [their lock, the changes holding or waiting for it]
        self._locks: dict[str, list] = {}

    @contextlib.asynccontextmanager
    async def _changing(self, conversation_id: str):
        """One change at a time to a conversation (its lock let go once no change holds or waits for it)."""
        entry = self._locks.setdefault(conversation_id, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[conversation_id]

    @property
    def enabled(self) -> bool:
        return self.store.enabled

    async def create(self, items: list[dict], metadata: dict) -> dict:
        conversation = {"id": "conv_" + uuid.uuid4().hex, "object": "conversation", "created_at": int(time.time()),
                        "metadata": metadata}
        if not await in_store(self.store, self.store.put, conversation, [], None, items):
            raise ApiError(400, "the conversation is over what this server keeps (--responses-store-mb)", "items")
        return conversation

    async def get(self, conversation_id: str) -> dict:
        """The conversation object (NotStored if it is not held)."""
        return await in_store(self.store, self.store.get, conversation_id)

    async def items(self, conversation_id: str) -> list[dict]:
        """Its items, oldest first (NotStored if it is not held)."""
        return await in_store(self.store, self.store.input_items, conversation_id)

    async def delete(self, conversation_id: str) -> bool:
        return await in_store(self.store, self.store.delete, conversation_id)

    async def update(self, conversation_id: str, metadata: dict) -> dict:
        async with self._changing(conversation_id):
            conversation = {**await self.get(conversation_id), "metadata": metadata}
            await self._put(conversation, await self.items(conversation_id))
        return conversation

    async def add(self, conversation_id: str, items: list[dict]) -> list[dict]:
        """Append items (already with ids); those items."""
        async with self._changing(conversation_id):
            conversation = await self.get(conversation_id)
            await self._put(conversation, await self.items(conversation_id) + items)
        return items

    async def remove(self, conversation_id: str, item_id: str) -> dict:
        """Remove one item (NotStored naming the item if the conversation has none of that id); the
        conversation."""
        async with self._changing(conversation_id):
            conversation = await self.get(conversation_id)
            items = await self.items(conversation_id)
            kept = [item for item in items if item.get("id") != item_id]
            if len(kept) == len(items):
                raise NotStored(item_id)
            await self._put(conversation, kept)
        return conversation

    async def _put(self, conversation: dict, items: list[dict]) -> None:
        if not await in_store(self.store, self.store.put, conversation, [], None, items):
            raise ApiError(400, "the conversation would be over what this server keeps (--responses-store-mb)",
                           "items")


def history(items: list[dict]) -> list[dict]:
    """A conversation's items as the chat's messages (a response's output items included: its message's text
    as the assistant's, its function calls as the assistant's tool calls; reasoning left out)."""
    return responses.input_messages({"input": items}) if items else []


def answer_items(body: dict, answer: dict) -> list[dict]:
    """What a response adds to its conversation: its request's input items, then its output items."""
    return responses.input_items(body) + [dict(item) for item in answer["output"]]
