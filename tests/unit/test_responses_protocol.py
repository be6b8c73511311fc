"""The Responses API's mapping onto the chat path (gateway/responses.py): input items, instructions, tools,
text formats, refusals naming the Responses API's own fields; the response object and its events."""

import json

import pytest

from specdec import tensor_names as tn
from specdec.gateway.protocol import ApiError, parse_chat
from specdec.gateway.response_store import LOW_WATER, NotStored, ResponseStore, SharedResponseStore
from specdec.gateway.responses import (chat_body, ending_event, event, input_items, input_messages, output_items,
                                       output_messages, renamed, response_object, sse, status_of, turn_cuts, usage)

SERVED = ("m",)


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    chat = chat_body({"model": "m", "input": "Hi", "instructions": "Be terse.", "max_output_tokens": 7,
                      "temperature": 0, "num_draft_tokens": 3})
    assert chat["messages"] == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert chat["max_tokens"] == 7 and chat["temperature"] == 0 and chat["num_draft_tokens"] == 3
    gen = parse_chat(chat, SERVED)  # the chat path takes it as it is
    assert json.loads(gen.choices[0][tn.MESSAGES][0, 0])[1]["content"] == "Hi" and gen.n == 1


def test_input_items_become_messages_calls_and_tool_results():
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
             {"type": "message", "role": "user", "content": "Weather in Oslo?"},
             {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\": \"Oslo\"}"},
             {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{\"city\": \"Bergen\"}"},
             {"type": "function_call_output", "call_id": "c1", "output": "rain"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Rain."}]}]
    messages = chat_body({"input": items})["messages"]
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool", "assistant"]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]  # parallel calls: one turn
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "rain"} and messages[4]["content"] == "Rain."


def test_flat_function_tools_and_a_named_choice_take_the_chats_form():
    tool = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}
    chat = chat_body({"input": "x", "tools": [tool], "tool_choice": {"type": "function", "name": "weather"}})
    assert chat["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": tool["parameters"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    gen = parse_chat(chat, SERVED)
    assert gen.tools is not None and gen.tools.names == ("weather",)


def test_what_agent_sdks_send_unset_is_taken():
    chat = chat_body({"input": "x", "tools": [], "tool_choice": "auto", "reasoning": {"effort": None}, "include": [],
                      "stream_options": {"include_obfuscation": False}, "truncation": "auto", "store": False,
                      "parallel_tool_calls": True})
    assert "tool_choice" not in chat and "stream_options" not in chat
    assert parse_chat(chat, SERVED).tools is None


def test_text_formats_become_structured_output():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = chat_body({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    assert chat_body({"input": "x", "text": {"format": {"type": "text"}}})["response_format"] == {"type": "text"}
    assert "verbosity" not in chat_body({"input": "x", "text": {"verbosity": "medium"}})  # OpenAI's default


@pytest.mark.parametrize("body,param", [
    ({}, "input"), ({"input": []}, "input"), ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
    ({"input": "x", "previous_response_id": 7}, "previous_response_id"), ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary"), ({"input": "x", "reasoning": "high"}, "reasoning"),
    ({"input": "x", "reasoning_effort": "high"}, "reasoning_effort"), ({"input": "x", "messages": []}, "messages"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"input": "x", "instructions": 3}, "instructions"), ({"input": "x", "truncation": "middle"}, "truncation"),
    ({"input": "x", "background": "yes"}, "background"), ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "max_tool_calls": 3}, "max_tool_calls"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "verbosity": "medium"}, "verbosity")])
def test_refusals_name_the_responses_field(body, param):
    with pytest.raises(ApiError) as caught:
        chat_body(body)
    assert caught.value.param == param


def test_the_chats_errors_are_renamed_to_the_fields_they_came_from():
    with pytest.raises(ApiError) as caught:
        parse_chat(chat_body({"input": "x", "max_output_tokens": "many"}), SERVED)
    assert renamed(caught.value).param == "max_output_tokens"
    assert renamed(ApiError(400, "m", "messages[2].content")).param == "input[2].content"
    assert renamed(ApiError(400, "m", "response_format.type")).param == "text.format.type"
    assert renamed(ApiError(400, "m", "temperature")).param == "temperature"


def test_the_response_object_and_its_events():
    gen = parse_chat(chat_body({"input": "x", "max_output_tokens": 5}), SERVED)
    items = output_items("Hello", [])
    body = response_object(gen, {"input": "x", "max_output_tokens": 5}, status_of("length"), items, usage(3, 5))
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"} and body["usage"]["total_tokens"] == 8
    assert body["output"][0]["content"][0] == {"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}
    called = output_items(None, [{"name": "f", "arguments": "{}"}])
    assert [item["type"] for item in called] == ["function_call"] and called[0]["call_id"].startswith("call_")
    raw = sse(event("response.output_text.delta", 4, delta="Hi")).decode()
    head, data = raw.split("\n")[:2]
    assert head == "event: response.output_text.delta" and raw.endswith("\n\n")
    assert json.loads(data.removeprefix("data: ")) == {"type": "response.output_text.delta", "sequence_number": 4,
                                                       "delta": "Hi"}


def test_a_reasoning_models_thinking_is_a_reasoning_item_and_comes_back_dropped():
    """With --reasoning-parser the thinking is the output's first item (type reasoning, its text a
    reasoning_text part, as OpenAI's SDK types it), before the message and any call; a reasoning item sent
    back in `input` (as clients replay the output) leaves the conversation as the chat template would."""
    from openai.types.responses import Response

    gen = parse_chat(chat_body({"input": "x"}), SERVED, reasoning_parser="deepseek_r1")
    items = output_items("Blue.", [{"name": "f", "arguments": "{}"}], "The sky is blue.")
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "The sky is blue."}] and items[0]["summary"] == []
    typed = Response.model_validate(response_object(gen, {"input": "x"}, "completed", items, usage(1, 2)))
    assert typed.output[0].content[0].text == "The sky is blue." and typed.output_text == "Blue."
    assert [item["type"] for item in output_items("Blue.", [], "")] == ["message"]  # no thinking, no item
    replay = [{"role": "user", "content": "Sky?"}, {"type": "reasoning", "id": "rs_1", "summary": [],
                                                   "content": [{"type": "reasoning_text", "text": "hmm"}]},
              {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Grass?"}]
    assert [m["role"] for m in chat_body({"input": replay})["messages"]] == ["user", "assistant", "user"]


def test_a_reasoning_effort_reaches_the_chat_template_and_is_echoed():
    body = {"input": "x", "reasoning": {"effort": "medium", "summary": None}}
    gen = parse_chat(chat_body(body), SERVED)
    assert json.loads(gen.choices[0][tn.CHAT_TEMPLATE_KWARGS][0, 0]) == {"reasoning_effort": "medium"}
    assert response_object(gen, body, "completed", [])["reasoning"] == {"effort": "medium", "summary": None}
    with pytest.raises(ApiError) as caught:
        parse_chat(chat_body({"input": "x", "reasoning": {"effort": "huge"}}), SERVED)
    assert renamed(caught.value).param == "reasoning.effort"


def test_include_output_text_logprobs_asks_for_each_tokens_log_probability():
    """include: ["message.output_text.logprobs"] (with top_logprobs: alternatives per position) is the chat's
    logprobs; top_logprobs alone, or another include, is refused naming it; the encrypted reasoning agent
    clients ask for is none here, and accepted."""
    from openai.types.responses import Response

    gen = parse_chat(chat_body({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 2}), SERVED)
    assert gen.logprobs and gen.top_logprobs == 2
    assert gen.choices[0][tn.RETURN_LOG_PROBS][0, 0] and gen.choices[0][tn.NUM_TOP_LOG_PROBS][0, 0] == 2
    assert not parse_chat(chat_body({"input": "x", "include": ["reasoning.encrypted_content"]}), SERVED).logprobs
    for body, param in (({"input": "x", "top_logprobs": 2}, "top_logprobs"),
                        ({"input": "x", "include": ["file_search_call.results"]}, "include"),
                        ({"input": "x", "include": "message.output_text.logprobs"}, "include")):
        with pytest.raises(ApiError) as caught:
            chat_body(body)
        assert caught.value.param == param
    with pytest.raises(ApiError) as caught:  # the chat's range, named as the Responses field
        parse_chat(chat_body({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 21}), SERVED)
    assert renamed(caught.value).param == "top_logprobs"
    entry = {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": [
        {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}]}
    items = output_items("Hi", [], logprobs=[entry])
    typed = Response.model_validate(response_object(gen, {"input": "x"}, "completed", items, usage(1, 1)))
    assert typed.output[0].content[0].logprobs[0].top_logprobs[0].logprob == -0.5


def test_a_stored_conversation_comes_before_the_input_after_this_requests_instructions():
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    chat = chat_body({"input": "And you?", "instructions": "Be terse.", "previous_response_id": "resp_1"}, history)
    assert chat["messages"] == [{"role": "system", "content": "Be terse."}, *history,
                                {"role": "user", "content": "And you?"}]
    assert "previous_response_id" not in chat  # the Responses API's own, not the chat's
    body = {"input": "x", "previous_response_id": "resp_1", "store": False}
    answer = response_object(parse_chat(chat_body(body, history), SERVED), body, "completed", [], stored=False)
    assert (answer["previous_response_id"], answer["store"]) == ("resp_1", False)


def test_an_answers_output_is_kept_as_the_chats_assistant_turn():
    thinking_and_text = output_items("It rains.", [], thinking="Look it up.")
    assert output_messages(thinking_and_text) == [{"role": "assistant", "content": "It rains."}]
    called = output_items("", [{"name": "weather", "arguments": "{}"}, {"name": "time", "arguments": "{}"}])
    (turn,) = output_messages(called)
    assert turn["content"] is None and [call["function"]["name"] for call in turn["tool_calls"]] == ["weather", "time"]
    assert [call["id"] for call in turn["tool_calls"]] == [item["call_id"] for item in called]
    # the calls' results, sent next as input, answer the calls by their ids on the chat path
    results = {"input": [{"type": "function_call_output", "call_id": item["call_id"], "output": output}
                         for item, output in zip(called, ("rain", "noon"))]}
    assert input_messages(results)[0] == {"role": "tool", "tool_call_id": called[0]["call_id"], "content": "rain"}
    parse_chat(chat_body(results, output_messages(called)), SERVED)  # the chat path takes the conversation
    assert output_messages(output_items("", [])) == [{"role": "assistant", "content": ""}]


def test_a_requests_input_is_listed_back_as_items_with_ids():
    assert input_items({"input": "Hi"})[0]["content"] == [{"type": "input_text", "text": "Hi"}]
    given = [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
             {"type": "message", "role": "assistant", "content": "c", "id": "msg_mine"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"},
             {"type": "reasoning", "id": "rs_1", "summary": []}]
    items = input_items({"input": given})
    assert [item["type"] for item in items] == ["message", "message", "function_call", "function_call_output",
                                                "reasoning"]
    assert [part["text"] for part in items[0]["content"]] == ["a", "b"] and items[1]["id"] == "msg_mine"
    assert items[1]["content"] == [{"type": "output_text", "text": "c", "annotations": []}]
    assert items[3]["output"] == "ok" and items[4]["id"] == "rs_1"
    assert len({item["id"] for item in items}) == 5 and all(item["id"] for item in items)


def _turn(response_id: str, text: str, previous: str | None = None) -> tuple[dict, list[dict], str | None]:
    return ({"id": response_id, "object": "response", "output": []},
            [{"role": "user", "content": text}, {"role": "assistant", "content": text.upper()}], previous)


def test_the_store_reads_a_conversation_back_along_its_chain():
    store = ResponseStore(1 << 20)
    store.put(*_turn("resp_a", "one"), items=[{"id": "msg_1"}])
    assert store.input_items("resp_a") == [{"id": "msg_1"}]
    store.put(*_turn("resp_b", "two", "resp_a"))
    store.put(*_turn("resp_c", "three", "resp_b"))
    store.put(*_turn("resp_x", "branch", "resp_a"))  # a second continuation of the same response
    assert [m["content"] for m in store.conversation("resp_c")] == ["one", "ONE", "two", "TWO", "three", "THREE"]
    assert [m["content"] for m in store.conversation("resp_x")] == ["one", "ONE", "branch", "BRANCH"]
    assert store.get("resp_b")["id"] == "resp_b" and "resp_b" in store
    size = store.bytes
    store.put(*_turn("resp_u", "čaj 茶", "resp_c"))  # held as UTF-8 JSON, counted in its bytes
    assert store.conversation("resp_u")[-2:] == [{"role": "user", "content": "čaj 茶"},
                                                 {"role": "assistant", "content": "ČAJ 茶"}]
    response, messages, _ = _turn("resp_u", "čaj 茶")
    held = json.dumps({"response": response, "messages": messages, "items": []}, separators=(",", ":"),
                      ensure_ascii=False)
    assert store.bytes - size == len(held.encode()) > len(held)
    store.delete("resp_u")
    assert store.delete("resp_b") and not store.delete("resp_b")
    with pytest.raises(NotStored) as caught:  # the chain is broken: the earlier response is named
        store.conversation("resp_c")
    assert caught.value.missing == "resp_b"
    with pytest.raises(NotStored):
        store.get("resp_b")
    assert [m["content"] for m in store.conversation("resp_x")] == ["one", "ONE", "branch", "BRANCH"]


def test_the_store_lets_the_least_recently_used_go_to_keep_within_its_budget():
    response, messages, _ = _turn("resp_0", "t")
    one = len(json.dumps({"response": response, "messages": messages, "items": []}, separators=(",", ":")).encode())
    store = ResponseStore(3 * one)  # three turns of this size
    for i in range(3):
        store.put(*_turn(f"resp_{i}", "t"))
    store.get("resp_0")  # used: resp_1 is now the least recently used
    store.put(*_turn("resp_3", "t"))
    assert len(store) == 3 and store.bytes == 3 * one
    with pytest.raises(NotStored):
        store.get("resp_1")
    assert {store.get(f"resp_{i}")["id"] for i in (0, 2, 3)} == {"resp_0", "resp_2", "resp_3"}
    # a turn alone over the budget is not kept (and lets nothing go); a store of 0 bytes keeps nothing
    assert not store.put({"id": "resp_big", "output": ["x" * 4 * one]}, [], None) and len(store) == 3
    off = ResponseStore(0)
    assert not off.enabled and not off.put(*_turn("resp_0", "t")) and len(off) == 0


def test_a_shared_store_is_one_store_for_every_process_that_mounts_it(tmp_path):
    """Two stores over one directory (two replicas on one volume): what one keeps the other continues, reads
    and deletes; a store opened later (a restart) finds them all; ids that are no file name are never looked
    up as paths; no half-written file is left."""
    a, b = SharedResponseStore(tmp_path / "store", 1 << 20), SharedResponseStore(tmp_path / "store", 1 << 20)
    assert a.blocking and not ResponseStore(1).blocking
    assert a.put(*_turn("resp_a", "one"), items=[{"id": "msg_1"}])
    assert b.put(*_turn("resp_b", "two", "resp_a")) and a.put(*_turn("resp_c", "čaj 茶", "resp_b"))
    assert [m["content"] for m in b.conversation("resp_c")] == ["one", "ONE", "two", "TWO", "čaj 茶", "ČAJ 茶"]
    assert b.input_items("resp_a") == [{"id": "msg_1"}] and b.get("resp_c")["id"] == "resp_c" and "resp_c" in b
    assert len(a) == len(b) == 3
    restarted = SharedResponseStore(tmp_path / "store", 1 << 20)
    assert restarted.get("resp_a")["id"] == "resp_a"
    assert restarted.bytes == sum(path.stat().st_size for path in (tmp_path / "store").iterdir()) > a.bytes > 0
    assert a.delete("resp_b") and not b.delete("resp_b")
    with pytest.raises(NotStored) as caught:
        b.conversation("resp_c")
    assert caught.value.missing == "resp_b"
    (tmp_path / "secret.json").write_text("{}")
    for bad in ("../secret", "a/b", ".resp_a", "", "x" * 300):
        assert bad not in a and not a.delete(bad)
        with pytest.raises(NotStored):
            a.get(bad)
    assert not a.put({"id": "../escape", "output": []}, [], None) and (tmp_path / "secret.json").exists()
    assert sorted(path.name for path in (tmp_path / "store").iterdir()) == ["resp_a.json", "resp_c.json"]


def test_a_shared_store_lets_the_least_recently_used_go_whichever_process_used_it(tmp_path):
    """The directory's budget: the process whose additions take it over lists it and removes the least
    recently used files (a read by another process counts as a use) down to LOW_WATER of the budget; a
    writer's stale leftover goes at the next scan."""
    import os
    import time

    response, messages, previous = _turn("resp_00", "t")
    one = len(json.dumps({"response": response, "messages": messages, "items": [], "previous": previous},
                         separators=(",", ":")).encode())
    directory = tmp_path / "store"
    a = SharedResponseStore(directory, 10 * one)
    now = time.time()
    for i in range(10):
        a.put(*_turn(f"resp_{i:02d}", "t"))
        os.utime(directory / f"resp_{i:02d}.json", (now - 100 + i, now - 100 + i))  # written in this order
    assert a.bytes == 10 * one and len(a) == 10
    SharedResponseStore(directory, 10 * one).get("resp_00")  # another process reads the oldest: used now
    a.put(*_turn("resp_10", "t"))  # 11 turns: down to 9 (LOW_WATER)
    assert LOW_WATER == 0.9 and a.bytes == 9 * one
    assert sorted(p.stem for p in directory.iterdir()) == ["resp_00", *(f"resp_{i:02d}" for i in range(3, 11))]
    stale, fresh = directory / ".resp_x.1.tmp", directory / ".resp_y.2.tmp"
    stale.write_text("{")
    fresh.write_text("{")
    os.utime(stale, (now - 7200, now - 7200))
    SharedResponseStore(directory, 10 * one)
    assert not stale.exists() and fresh.exists()
    assert not a.put({"id": "resp_big", "output": ["x" * 11 * one]}, [], None)  # alone over the budget


@pytest.mark.parametrize("shared", [False, True])
def test_a_held_response_is_replaced_as_a_background_response_progresses(tmp_path, shared):
    """replace(): a held response's object anew (its status), its turn's messages when given (its answer's),
    its continued-from id and input items kept; a response not held (deleted meanwhile) is not kept again."""
    store = SharedResponseStore(tmp_path, 1 << 20) if shared else ResponseStore(1 << 20)
    store.put(*_turn("resp_a", "one"))
    store.put({"id": "resp_b", "status": "queued"}, [{"role": "user", "content": "two"}], "resp_a", [{"id": "msg_2"}])
    assert store.replace({"id": "resp_b", "status": "in_progress"})
    assert store.get("resp_b")["status"] == "in_progress"
    assert [m["content"] for m in store.conversation("resp_b")] == ["one", "ONE", "two"]
    assert store.replace({"id": "resp_b", "status": "completed"}, [{"role": "user", "content": "two"},
                                                                   {"role": "assistant", "content": "TWO"}])
    assert [m["content"] for m in store.conversation("resp_b")] == ["one", "ONE", "two", "TWO"]
    assert store.input_items("resp_b") == [{"id": "msg_2"}] and store.get("resp_b")["status"] == "completed"
    store.delete("resp_b")
    assert not store.replace({"id": "resp_b", "status": "cancelled"}) and "resp_b" not in store


@pytest.mark.parametrize("shared", [False, True])
def test_a_background_responses_events_are_kept_with_it_and_read_on_from_a_position(tmp_path, shared):
    """add_events / read_events: appended in order, read from a position on (the next read's start), kept when
    the response is replaced, counted in the budget, gone with the response (deleted or let go); a response not
    held keeps none."""
    store = SharedResponseStore(tmp_path, 1 << 20) if shared else ResponseStore(1 << 20)
    store.put(*_turn("resp_a", "one"))
    before = store.usage()[1]
    created = [event("response.created", 0, response={"id": "resp_a"}), event("response.in_progress", 1)]
    assert store.add_events("resp_a", created)
    assert store.usage()[1] > before
    events, position = store.read_events("resp_a")
    assert events == created
    assert store.read_events("resp_a", position) == ([], position)
    delta = event("response.output_text.delta", 2, delta="Hé")
    store.add_events("resp_a", [delta])
    assert store.read_events("resp_a", position) == ([delta], store.read_events("resp_a")[1])
    store.replace({"id": "resp_a", "status": "completed"})
    assert store.read_events("resp_a")[0] == created + [delta]
    assert not store.add_events("resp_unknown", [delta])
    with pytest.raises(NotStored):
        store.read_events("resp_unknown")
    if shared:  # a line still being written is left for the next read
        with open(tmp_path / "resp_a.events", "ab") as log:
            log.write(b'{"type":"response.output_text.delta","sequence_number":3,"del')
        assert store.read_events("resp_a", position) == ([delta], position + len(json.dumps(
            delta, separators=(",", ":"), ensure_ascii=False).encode()) + 1)
    store.delete("resp_a")
    assert store.usage() == (0, 0)
    # let go with its events: the budget counts them
    small = SharedResponseStore(tmp_path / "small", 2000) if shared else ResponseStore(2000)
    small.put(*_turn("resp_x", "x"))
    small.add_events("resp_x", [event("response.output_text.delta", i, delta="y" * 100) for i in range(8)])
    small.put(*_turn("resp_y", "y"))
    small.add_events("resp_y", [event("response.output_text.delta", i, delta="z" * 100) for i in range(8)])
    assert "resp_x" not in small and small.usage()[1] <= 2000
    assert small.read_events("resp_y")[0][-1]["sequence_number"] == 7


def test_a_streams_ending_event_follows_the_responses_status():
    assert [ending_event({"status": s}) for s in ("completed", "incomplete", "failed")] == [
        "response.completed", "response.incomplete", "response.failed"]


# An agent's conversation: a system message, then turns (a user message and what follows it up to the next)
AGENT = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Weather in Oslo?"},
         {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                 "function": {"name": "w", "arguments": "{}"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "rain"}, {"role": "assistant", "content": "Rain."},
         {"role": "user", "content": "And Bergen?"}, {"role": "assistant", "content": "Rain too."},
         {"role": "user", "content": "Thanks."}]


def test_truncation_drops_whole_oldest_turns_and_keeps_the_system_messages_and_the_last_turn():
    """truncation: auto's choices cut between turns only (a tool call keeps its output), never the leading
    system or developer messages, never the last turn; the request's instructions stay first."""
    assert turn_cuts(AGENT) == [0, 4, 6]
    assert turn_cuts(AGENT[1:]) == [0, 4, 6] and turn_cuts(AGENT[:2]) == [0] and turn_cuts([]) == [0]
    assert turn_cuts([{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Hi"}]) == [0, 1]
    history, last = AGENT[:5], AGENT[5:]
    body = {"input": [{"role": m["role"], "content": m["content"]} for m in last], "instructions": "Answer.",
            "truncation": "auto"}
    for dropped, kept in ((0, AGENT), (4, [AGENT[0], *AGENT[5:]]), (6, [AGENT[0], AGENT[7]])):
        assert chat_body(body, history, dropped)["messages"] == [{"role": "system", "content": "Answer."}, *kept]
    gen = parse_chat(chat_body(body, history, 4), SERVED)
    assert response_object(gen, body, "completed", [])["truncation"] == "auto"
    assert response_object(gen, {"input": "x"}, "completed", [])["truncation"] == "disabled"


@pytest.fixture(scope="module")
def tokenizer():
    from specdec.decoding.text import load_tokenizer
    from specdec.serving.pairs import smollm2_tokenizer_dir

    return load_tokenizer(str(smollm2_tokenizer_dir()))


def test_truncation_auto_keeps_the_most_of_the_conversation_that_fits_the_context(tokenizer):
    """The gateway's truncation over the real SmolLM2 template: as few turns dropped as make the prompt and
    the answer's room fit (the server's default max_tokens when the request does not say), counted as the
    server's preprocessing renders the request; a last turn too long alone is refused naming input; without
    `truncation: auto`, or without the tokenizer, nothing is dropped (the server refuses what does not fit)."""
    import asyncio

    from specdec.decoding.text import chat_ids
    from specdec.gateway.app import Gateway

    turns = [[{"role": "user", "content": f"Fact {i}: " + "the sky is blue. " * 20},
              {"role": "assistant", "content": "Noted."}] for i in range(4)]
    history = [{"role": "system", "content": "Remember facts."}] + [m for turn in turns for m in turn]
    body = {"input": "Which facts do you remember?", "truncation": "auto", "max_output_tokens": 16}
    def length(messages):
        return len(chat_ids(tokenizer, messages, None, "messages"))

    def sent(gateway, request):
        gen = asyncio.run(gateway._response_chat(request, history))
        return json.loads(gen.choices[0][tn.MESSAGES].reshape(-1)[0].decode())

    whole = length(chat_body(body, history)["messages"])
    for context, kept_turns in ((whole + 16, 4), (whole + 15, 3), (whole - 200, 2), (length(
            chat_body(body, history, 8)["messages"]) + 16, 0)):
        gateway = Gateway(None, SERVED, tokenizer, max_model_len=context, default_max_tokens=64)
        messages = sent(gateway, body)
        assert messages == [history[0], *history[1 + 2 * (4 - kept_turns):], {"role": "user", "content": body["input"]}]
        assert length(messages) + 16 <= context
        if kept_turns < 4:  # the next longer choice would not have fit: as few dropped as could be
            longer = [history[0], *history[1 + 2 * (3 - kept_turns):], {"role": "user", "content": body["input"]}]
            assert length(longer) + 16 > context
    gateway = Gateway(None, SERVED, tokenizer, max_model_len=whole + 16, default_max_tokens=64)
    unsized = sent(gateway, {k: v for k, v in body.items() if k != "max_output_tokens"})  # the server's 64
    assert length(unsized) + 64 <= whole + 16 and len(unsized) == 8  # one turn (two messages) dropped
    with pytest.raises(ApiError) as caught:
        sent(Gateway(None, SERVED, tokenizer, max_model_len=length(chat_body(body, history, 8)["messages"]) + 15), body)
    assert caught.value.param == "input" and "context" in caught.value.message
    small = whole // 2
    assert len(sent(Gateway(None, SERVED, tokenizer, max_model_len=small), {**body, "truncation": "disabled"})) == 10
    assert len(sent(Gateway(None, SERVED, None, max_model_len=small), body)) == 10
