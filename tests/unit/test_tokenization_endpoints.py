"""vLLM's tokenizer endpoints (gateway/tokenization.py) over the real SmolLM2 tokenizer: what lm-eval's remote
tokenizer and benchmark clients read; refusals naming the field."""

import pytest

from specdec.decoding.text import chat_ids, load_tokenizer
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


def test_tokenizer_info_names_the_special_tokens_and_the_chat_template(tokenizer):
    info = tokenizer_info(tokenizer, 8192)
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == 8192 and tokenizer_info(tokenizer, 0)["model_max_length"] is None
    assert tokenize(tokenizer, {"prompt": info["eos_token"], "add_special_tokens": False}, 0)["tokens"] == \
        [tokenizer.eos_token_id]  # lm-eval reads the end token's id this way


@pytest.mark.parametrize("body,param", [
    ({}, "prompt"), ({"prompt": "a", "messages": CHAT}, "prompt"), ({"prompt": 3}, "prompt"),
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"messages": "hi"}, "messages"), ({"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt")])
def test_a_bad_tokenize_request_names_its_field(tokenizer, body, param):
    with pytest.raises(ApiError) as caught:
        tokenize(tokenizer, body, 0)
    assert caught.value.status == 400 and caught.value.param == param


@pytest.mark.parametrize("tokens", [None, [1, "2"], [-1], [10**9], [True]])
def test_a_bad_detokenize_request_names_tokens(tokenizer, tokens):
    with pytest.raises(ApiError) as caught:
        detokenize(tokenizer, {"tokens": tokens})
    assert caught.value.param == "tokens"
