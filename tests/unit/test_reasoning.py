"""The reasoning parsers (`gateway/reasoning.py`): thinking apart from content, whole and in any deltas."""

import random

import pytest

from specdec.gateway.reasoning import ReasoningStream, split

CASES = [
    # (text, parser, (thinking, content))
    ("<think>\nLet me see.\n</think>\n\nIt is 4.", "qwen3", ("\nLet me see.\n", "\n\nIt is 4.")),
    ("<think>\nLet me see.\n</think>\n\nIt is 4.", "deepseek_r1", ("\nLet me see.\n", "\n\nIt is 4.")),
    ("Let me see.</think>It is 4.", "deepseek_r1", ("Let me see.", "It is 4.")),  # opened by the template
    ("Let me see.</think>It is 4.", "qwen3", (None, "Let me see.</think>It is 4.")),  # never opened: all content
    ("It is 4.", "qwen3", (None, "It is 4.")),  # enable_thinking false
    ("Still thinking when cut", "deepseek_r1", ("Still thinking when cut", None)),
    ("<think>still thinking when cut", "qwen3", ("still thinking when cut", None)),
    ("<think></think>4", "qwen3", (None, "4")),
    ("<thin", "qwen3", (None, "<thin")),  # a beginning of the tag that never became one
    ("<thin", "deepseek_r1", ("<thin", None)),
    ("<think>a </thin b</think>c </think> d", "qwen3", ("a </thin b", "c </think> d")),  # the first close ends it
    ("", "qwen3", (None, None)),
    ("x<think>y</think>z", "qwen3", (None, "x<think>y</think>z")),  # opened mid-answer: not a thinking block
]


@pytest.mark.parametrize("text, parser, expected", CASES)
def test_a_whole_answer_splits_into_thinking_and_content(text, parser, expected):
    assert split(text, parser) == expected


@pytest.mark.parametrize("text, parser, expected", CASES)
def test_deltas_add_up_to_the_whole_split_however_the_text_is_cut(text, parser, expected):
    rng = random.Random(7)
    for trial in range(200):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream, thinking, content = ReasoningStream(parser), "", ""
        for piece in pieces:
            t, c = stream.feed(piece)
            assert "<think>" not in t and "</think>" not in t
            thinking, content = thinking + t, content + c
        t, c = stream.finish()
        assert ((thinking + t) or None, (content + c) or None) == expected, pieces


def test_thinking_streams_as_it_comes_and_only_a_possible_tag_is_held():
    stream = ReasoningStream("deepseek_r1")
    assert stream.feed("<think>Hmm") == ("Hmm", "")
    assert stream.feed(", so </th") == (", so ", "")  # "</th" may close it: held
    assert stream.feed("ink>The") == ("", "The")
    assert stream.feed(" answer") == ("", " answer")
    assert stream.finish() == ("", "")


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'"):
        ReasoningStream("r2")


def test_the_thinking_blocks_tokens_are_counted_from_the_text():
    """usage's reasoning_tokens: the fewest leading tokens whose text reaches the end of the thinking block
    (tags included), over SmolLM2's tokenizer, which spells the tags with several tokens; a whole unclosed
    thinking is every token, an answer without one none; summed over choices in completion_tokens_details."""
    from specdec.decoding.text import load_tokenizer
    from specdec.gateway.protocol import combined_usage
    from specdec.gateway.reasoning import thinking_end, thinking_tokens
    from specdec.serving.pairs import smollm2_tokenizer_dir

    tokenizer = load_tokenizer(str(smollm2_tokenizer_dir()))

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    block, answer = encode("<think>\nRed is warm.\n</think>"), encode("\n\nRed.")
    assert len(block) > 5 and thinking_end("<think>a</think>b", "qwen3") == len("<think>a</think>")
    for parser in ("deepseek_r1", "qwen3"):
        assert thinking_tokens(block + answer, decode, parser) == len(block)
        assert thinking_tokens(block, decode, parser) == len(block)
    assert thinking_tokens(encode("Red is warm.</think>Red."), decode, "deepseek_r1") == len(encode("Red is warm.</think>"))
    assert thinking_tokens(answer, decode, "qwen3") == 0 and thinking_tokens([], decode, "deepseek_r1") == 0
    unclosed = encode("<think>Red is")
    assert thinking_tokens(unclosed, decode, "deepseek_r1") == thinking_tokens(unclosed, decode, "qwen3") == len(unclosed)
    usage = combined_usage([{}, {}], [9, 4], 2, [7, 0])
    assert usage["completion_tokens"] == 13 and usage["completion_tokens_details"] == {"reasoning_tokens": 7}
    assert "completion_tokens_details" not in combined_usage([{}], [3], 1)


def test_vllms_other_names_read_as_the_parser_of_their_format():
    """glm45 reads as qwen3; deepseek_v3 as deepseek_r1 where the request's chat_template_kwargs ask for thinking
    (DeepSeek-V3.1's `thinking`, what its template reads), as no thinking otherwise; the ensemble gets the parser
    that reads the answer (a guide after its thinking)."""
    from specdec import tensor_names as tn
    from specdec.gateway import protocol, reasoning

    assert reasoning.for_request("glm45", None) == "qwen3" and reasoning.for_request("qwen3", {}) == "qwen3"
    assert reasoning.for_request("deepseek_v3", {"thinking": True}) == "deepseek_r1"
    assert reasoning.for_request("deepseek_v3", {"enable_thinking": True}) is None  # (not DeepSeek's variable)
    assert reasoning.for_request("deepseek_v3", None) is None and reasoning.for_request(None, None) is None
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}
    assert protocol.parse_chat(chat, ("m",), reasoning_parser="glm45").reasoning == "qwen3"
    thinking = protocol.parse_chat({**chat, "chat_template_kwargs": {"thinking": True}}, ("m",),
                                   reasoning_parser="deepseek_v3")
    assert thinking.reasoning == "deepseek_r1"
    assert thinking.choices[0][tn.REASONING_PARSER].tolist() == [[b"deepseek_r1"]]
    plain = protocol.parse_chat(chat, ("m",), reasoning_parser="deepseek_v3")
    assert plain.reasoning is None and tn.REASONING_PARSER not in plain.choices[0]
    with pytest.raises(protocol.ApiError, match="a request thinks where its chat_template_kwargs say thinking"):
        protocol.parse_chat({**chat, "thinking_token_budget": 8}, ("m",), reasoning_parser="deepseek_v3")
