"""OpenAI's conversations (gateway/conversations.py): items checked and given ids, kept in either store (a
shared one in a subdirectory of its own), changed one at a time, read back as a response's history. The
served API: tests/integration/test_openai_api.py."""

import asyncio

import pytest

from specdec.gateway import conversations
from specdec.gateway.protocol import ApiError
from specdec.gateway.response_store import NotStored, ResponseStore, SharedResponseStore

NOTE = {"type": "message", "role": "user", "content": "My name is Ada."}


def test_items_are_checked_and_given_ids_metadata_and_ids_too():
    items = conversations.checked_items([NOTE, {"type": "function_call_output", "call_id": "c1", "output": "7"}])
    assert [item["id"][:4] for item in items] == ["msg_", "fco_"] and items[0]["content"][0]["type"] == "input_text"
    assert conversations.checked_items(None) == [] and conversations.checked_items([]) == []
    for bad, param in (([{"type": "web_search_call"}], "items[0].type"), ([NOTE] * 21, "items"), ("x", "items"),
                       ([{"type": "message", "role": "robot", "content": "x"}], "items[0].role")):
        with pytest.raises(ApiError) as caught:
            conversations.checked_items(bad)
        assert caught.value.param == param and caught.value.message.startswith(param)
    assert conversations.checked_metadata({"a": "b"}) == {"a": "b"} and conversations.checked_metadata(None) == {}
    with pytest.raises(ApiError):
        conversations.checked_metadata({"a": 1})
    assert conversations.conversation_id({"id": "conv_1"}) == conversations.conversation_id("conv_1") == "conv_1"
    assert conversations.conversation_id(None) is None
    with pytest.raises(ApiError):
        conversations.conversation_id(7)


@pytest.mark.parametrize("shared", [False, True])
def test_a_conversation_is_kept_changed_and_read_back_as_history(tmp_path, shared):
    async def main():
        responses_store = SharedResponseStore(tmp_path, 1 << 20) if shared else ResponseStore(1 << 20)
        store = conversations.Conversations(responses_store.sibling("conversations"))
        created = await store.create(conversations.checked_items([NOTE]), {"topic": "names"})
        assert created["object"] == "conversation" and created["metadata"] == {"topic": "names"}
        answer = {"output": [{"type": "message", "id": "msg_a", "role": "assistant", "status": "completed",
                              "content": [{"type": "output_text", "text": "Hello Ada.", "annotations": []}]},
                             {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}",
                              "status": "completed"}]}
        # many changes at once from one process: each made whole (one at a time)
        await asyncio.gather(*(store.add(created["id"], conversations.answer_items({"input": f"q{i}"}, answer))
                               for i in range(5)))
        items = await store.items(created["id"])
        assert len(items) == 1 + 5 * 3 and not store._locks  # no lock kept once nothing changes it
        history = conversations.history(items)
        assert history[0] == {"role": "user", "content": "My name is Ada."}
        assert history[2] == {"role": "assistant", "content": "Hello Ada."}
        assert history[3]["tool_calls"][0]["function"]["name"] == "f"
        assert (await store.update(created["id"], {"topic": "ada"}))["metadata"] == {"topic": "ada"}
        await store.remove(created["id"], "msg_a")
        assert all(item["id"] != "msg_a" for item in await store.items(created["id"]))
        with pytest.raises(NotStored):
            await store.remove(created["id"], "msg_none")
        if shared:  # in a directory of its own, beside the responses; another process reads it
            assert (tmp_path / "conversations" / f"{created['id']}.json").exists()
            other = conversations.Conversations(SharedResponseStore(tmp_path, 1 << 20).sibling("conversations"))
            assert (await other.get(created["id"]))["metadata"] == {"topic": "ada"}
            assert created["id"] not in responses_store
        assert await store.delete(created["id"])
        with pytest.raises(NotStored):
            await store.get(created["id"])
    asyncio.run(main())
