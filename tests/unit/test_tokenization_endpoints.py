"""vLLM's tokenizer endpoints (gateway/tokenization.py) over the real SmolLM2 tokenizer: what lm-eval's remote
tokenizer and benchmark clients read; refusals naming the field."""

import json

import pytest

from specdec.decoding.text import chat_ids, chat_template_kwargs, load_tokenizer
from specdec.gateway.protocol import ApiError
from specdec.gateway.tokenization import detokenize, tokenize, tokenizer_info
from specdec.serving.pairs import smollm2_tokenizer_dir

CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(smollm2_tokenizer_dir()))


def test_a_prompt_and_a_chat_are_tokenized_as_the_server_reads_them(tokenizer):
    out = tokenize(tokenizer, {"prompt": "Hello there", "return_token_strs": True}, 8192)
    assert out["tokens"] == tokenizer.encode("Hello there") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 8192 and out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    assert tokenize(tokenizer, {"prompt": "x"}, 0)["token_strs"] is None
    chat = tokenize(tokenizer, {"messages": CHAT}, 8192)
    assert chat["tokens"] == chat_ids(tokenizer, CHAT, None, "messages")  # preprocessing's rendering: usage's count
    assert detokenize(tokenizer, {"tokens": out["tokens"]}) == {"prompt": "Hello there"}


# A template with a variable of its own, as Qwen3's `enable_thinking` (SmolLM2's uses none)
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
                     "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_chat_template_kwargs_are_the_templates_variables(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", THINKING_TEMPLATE)
    plain = chat_ids(tokenizer, CHAT, None, "messages")
    off = chat_ids(tokenizer, CHAT, None, "messages", chat_template_kwargs('{"enable_thinking": false}', "k"))
    assert tokenizer.decode(off[len(plain):]) == "<think>\n\n</think>\n\n" and off[:len(plain)] == plain
    assert chat_ids(tokenizer, CHAT, None, "messages", {"enable_thinking": True}) == plain
    # /tokenize renders the same prompt: usage's count stays the chat endpoint's
    assert tokenize(tokenizer, {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}, 0)["tokens"] == off
    for raw, message in (('["x"]', "must be a JSON object"), ('{"add_generation_prompt": false}', "'add_generation_prompt' is set by the server"),
                         ('{"tools": []}', "'tools' is set by the server"), ("{", "is not JSON")):
        with pytest.raises(ValueError, match=message):
            chat_template_kwargs(raw, "chat_template_kwargs")
    with pytest.raises(ApiError) as caught:
        tokenize(tokenizer, {"messages": CHAT, "chat_template_kwargs": {"tokenize": False}}, 0)
    assert caught.value.param == "chat_template_kwargs"


RAG_TEMPLATE = ("{% for d in documents or [] %}<doc {{ d.title | default('?') }}>{{ d.text }}</doc>\n{% endfor %}"
                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


def test_documents_reach_a_rag_template_as_its_documents(tokenizer, monkeypatch):
    """A chat's `documents` (vLLM's field, sent as a variable of chat_template_kwargs) are the template call's
    `documents`, rendered where a RAG template puts them; refused unless a list of objects of strings."""
    monkeypatch.setattr(tokenizer, "chat_template", RAG_TEMPLATE)
    docs = [{"title": "A", "text": "alpha"}, {"text": "beta"}]
    ids = chat_ids(tokenizer, CHAT, None, "messages", chat_template_kwargs(json.dumps({"documents": docs}), "k"))
    assert tokenizer.decode(ids).startswith("<doc A>alpha</doc>\n<doc ?>beta</doc>\n")
    assert not tokenizer.decode(chat_ids(tokenizer, CHAT, None, "messages")).startswith("<doc")
    for bad in ('{"documents": {"text": "x"}}', '{"documents": [["x"]]}', '{"documents": [{"text": 3}]}'):
        with pytest.raises(ValueError, match="'documents' must be a list of objects of strings"):
            chat_template_kwargs(bad, "chat_template_kwargs")
    # /tokenize renders them as the chat endpoint does (its count is the chat's prompt_tokens), the tools too
    assert tokenize(tokenizer, {"messages": CHAT, "documents": docs}, 0)["tokens"] == ids
    with pytest.raises(ApiError) as caught:
        tokenize(tokenizer, {"messages": CHAT, "documents": [1]}, 0)
    assert caught.value.param == "documents[0]"


def test_tokenize_renders_a_chats_tools_as_the_chat_endpoint_does(tokenizer, monkeypatch):
    """A chat's `tools` reach the template on /tokenize as on the chat endpoint: its count is the chat's
    prompt_tokens; a tool that is no function tool is refused naming `tools`."""
    monkeypatch.setattr(tokenizer, "chat_template", "{% for t in tools or [] %}<tool {{ t.function.name }}>\n"
                        "{% endfor %}" + RAG_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = tokenize(tokenizer, {"messages": CHAT, "tools": tools}, 0)["tokens"]
    assert with_tools == chat_ids(tokenizer, CHAT, tools, "messages")
    assert len(with_tools) > len(tokenize(tokenizer, {"messages": CHAT}, 0)["tokens"])
    with pytest.raises(ApiError) as caught:
        tokenize(tokenizer, {"messages": CHAT, "tools": [{"type": "function"}]}, 0)
    assert caught.value.param == "tools"


def test_tokenizer_info_names_the_special_tokens_and_the_chat_template(tokenizer):
    info = tokenizer_info(tokenizer, 8192)
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == 8192 and tokenizer_info(tokenizer, 0)["model_max_length"] is None
    assert tokenize(tokenizer, {"prompt": info["eos_token"], "add_special_tokens": False}, 0)["tokens"] == \
        [tokenizer.eos_token_id]  # lm-eval reads the end token's id this way


@pytest.mark.parametrize("body,param", [
    ({}, "prompt"), ({"prompt": "a", "messages": CHAT}, "prompt"), ({"prompt": 3}, "prompt"),
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"messages": "hi"}, "messages"), ({"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt"),
    ({"messages": CHAT, "continue_final_message": True}, "continue_final_message")])
def test_a_bad_tokenize_request_names_its_field(tokenizer, body, param):
    with pytest.raises(ApiError) as caught:
        tokenize(tokenizer, body, 0)
    assert caught.value.status == 400 and caught.value.param == param


@pytest.mark.parametrize("tokens", [None, [1, "2"], [-1], [10**9], [True]])
def test_a_bad_detokenize_request_names_tokens(tokenizer, tokens):
    with pytest.raises(ApiError) as caught:
        detokenize(tokenizer, {"tokens": tokens})
    assert caught.value.param == "tokens"


OWN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}bot:{% endif %}"


def test_a_requests_own_chat_template_is_taken_only_where_trusted(tokenizer):
    """vLLM's chat_template request field (and --trust-request-chat-template): /tokenize and the chat endpoint
    render with it where the API trusts requests' templates, and refuse it by name elsewhere."""
    from specdec.gateway.protocol import parse_chat

    own = tokenize(tokenizer, {"messages": CHAT, "chat_template": OWN}, 0, trust_template=True)["tokens"]
    assert tokenizer.decode(own) == "system: Be terse.\nuser: Name a colour.\nbot:"
    gen = parse_chat({"model": "m", "messages": CHAT, "chat_template": OWN}, ("m",), trust_template=True)
    assert gen.choices[0]["chat_template"][0, 0].decode() == OWN
    for call in (lambda: tokenize(tokenizer, {"messages": CHAT, "chat_template": OWN}, 0),
                 lambda: parse_chat({"model": "m", "messages": CHAT, "chat_template": OWN}, ("m",))):
        with pytest.raises(ApiError, match="--trust-request-chat-template") as caught:
            call()
        assert (caught.value.status, caught.value.param) == (400, "chat_template")
    assert "chat_template" not in parse_chat({"model": "m", "messages": CHAT}, ("m",), trust_template=True).choices[0]
    for bad, message in ((3, "must be a string"), ("plain words", "is no Jinja template"),
                         ("{{ x " + "y" * (1 << 20), "more than")):
        with pytest.raises(ApiError, match=message) as caught:
            parse_chat({"model": "m", "messages": CHAT, "chat_template": bad}, ("m",), trust_template=True)
        assert caught.value.param == "chat_template"
    with pytest.raises(ApiError, match="TemplateSyntaxError") as caught:  # one that does not render: named too
        tokenize(tokenizer, {"messages": CHAT, "chat_template": "{% for %}"}, 0, trust_template=True)
    assert caught.value.param == "chat_template"


def test_a_chat_whose_last_message_is_continued_is_tokenized_without_a_new_turn(tokenizer):
    """vLLM's continue_final_message (add_generation_prompt false): the assistant's last message left open."""
    prefilled = [*CHAT, {"role": "assistant", "content": "Red, green"}]
    ids = tokenize(tokenizer, {"messages": prefilled, "continue_final_message": True,
                               "add_generation_prompt": False}, 0)["tokens"]
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nRed, green")
    answered = tokenize(tokenizer, {"messages": prefilled}, 0)["tokens"]
    assert tokenizer.decode(answered).endswith("Red, green<|im_end|>\n<|im_start|>assistant\n")
