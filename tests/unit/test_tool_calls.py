"""Tool calls in the OpenAI API (gateway/tools.py, the protocol's tools and tool messages, the server's chat
rendering with tools): pure functions, no server (served: tests/integration/test_openai_api.py)."""

import json

import pytest
from specdec import tensor_names as tn
from specdec.decoding.text import chat_ids, chat_messages, chat_tools
from specdec.gateway import tools
from specdec.gateway.protocol import ApiError, parse_chat
from specdec.gateway.tools import AUTO, NAMED, REQUIRED, ToolCalling, ToolStream

SERVED = ("m",)


@pytest.fixture
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from specdec.serving.pairs import smollm2_tokenizer_dir
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())

CHAT = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def guide(gen) -> dict:
    return json.loads(gen.choices[0][tn.SAMPLING_PARAMETERS][0, 0])["structured_outputs"]


def test_a_named_function_or_required_constrains_the_output_to_its_schema():
    named = parse_chat({"messages": CHAT, "tools": [WEATHER, TIME],
                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, SERVED)
    assert named.tools == ToolCalling(NAMED, ("get_weather",), parallel=False)
    assert guide(named) == {"json": WEATHER["function"]["parameters"], "disable_any_whitespace": True}
    assert named.tools.finish_reason("stop") == "stop" and named.tools.finish_reason("length") == "length"
    assert json.loads(named.choices[0][tn.TOOLS][0, 0]) == [WEATHER, TIME]  # rendered by the chat template
    required = parse_chat({"messages": CHAT, "tools": [WEATHER, TIME], "tool_choice": "required",
                           "parallel_tool_calls": False}, SERVED)
    schema = guide(required)["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [item["properties"]["name"] for item in schema["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                                {"const": "get_time"}]
    assert schema["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object"}  # no parameters given
    none = parse_chat({"messages": CHAT, "tools": [WEATHER], "tool_choice": "none"}, SERVED)
    assert none.tools is None and tn.TOOLS in none.choices[0] and "structured_outputs" not in json.loads(
        none.choices[0][tn.SAMPLING_PARAMETERS][0, 0])
    assert required.tools.finish_reason("stop") == "tool_calls" and required.tools.finish_reason("length") == "length"
    auto = parse_chat({"messages": CHAT, "tools": [WEATHER]}, SERVED, tool_parser="hermes")
    assert auto.tools == ToolCalling(AUTO, ("get_weather",), "hermes", True)


STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True, "parameters": {
    **WEATHER["function"]["parameters"], "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}


def test_auto_calls_to_strict_tools_are_held_to_their_schemas_in_the_parsers_format_where_it_has_one():
    """OpenAI's `strict: true`: with tool_choice auto and a parser whose calls are JSON (hermes, llama3_json),
    structural tags hold each call the model opens to a tool of the request and a strict tool's arguments to
    its schema; without a strict tool, with another parser, or with a guide of the request's own: none."""
    body = {"messages": CHAT, "tools": [STRICT_WEATHER, TIME]}
    tags = guide(parse_chat(body, SERVED, tool_parser="hermes"))["structural_tag"]
    spaced = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    assert tags == {"triggers": ["<tool_call>"], "structures": [
        {"begin": '<tool_call>\n{"name": "get_weather", "arguments": ', "end": "}\n</tool_call>",
         "schema": {**STRICT_WEATHER["function"]["parameters"], "x-guidance": spaced}},
        {"begin": '<tool_call>\n{"name": "get_time", "arguments": ', "end": "}\n</tool_call>",
         "schema": {"type": "object", "x-guidance": spaced}}]}  # not strict: any object
    llama = guide(parse_chat(body, SERVED, tool_parser="llama3_json"))["structural_tag"]
    assert llama["triggers"] == ['{"name": "'] and llama["structures"][0]["begin"] == (
        '{"name": "get_weather", "parameters": ') and llama["structures"][0]["end"] == "}"

    def sampling(gen) -> dict:
        return json.loads(gen.choices[0][tn.SAMPLING_PARAMETERS][0, 0])
    assert "structured_outputs" not in sampling(parse_chat({**body, "tools": [WEATHER, TIME]}, SERVED,
                                                           tool_parser="hermes"))
    assert "structured_outputs" not in sampling(parse_chat(body, SERVED, tool_parser="openai"))
    qwen = guide(parse_chat(body, SERVED, tool_parser="qwen3_coder"))["structural_tag"]  # xgrammar's form
    assert qwen["format"]["tags"][0]["content"]["style"] == "qwen_xml"
    own = parse_chat({**body, "response_format": {"type": "json_object"}}, SERVED, tool_parser="hermes")
    assert guide(own) == {"json_object": True}


def test_strict_tags_admit_the_calls_the_parser_reads_and_refuse_calls_off_their_schemas(smollm2_tokenizer):
    from specdec.decoding.grammar import GuideCompiler

    grammar = GuideCompiler(smollm2_tokenizer).compile(
        "structural_tag", json.dumps(tools.strict_call_tags([STRICT_WEATHER, TIME], "hermes")))

    def admitted(text: str) -> str:
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        return smollm2_tokenizer.decode(ids[:grammar.matcher().valid_prefix(ids)])

    call = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    assert admitted(call + " Done.") == call + " Done."
    content, calls = tools.split_output(call, ToolCalling(AUTO, ("get_weather", "get_time"), "hermes"))
    assert (content, calls) == ("Let me check.", [{"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}])
    for wrong in ('<tool_call>\n{"name": "get_wind", ', '<tool_call>\n{"name": "get_weather", "arguments": {"town"',
                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}',  # days is required
                  '<tool_call>{"name"'):  # the format's own newline
        assert admitted(wrong) != wrong
    anything = '<tool_call>\n{"name": "get_time", "arguments": {"any": [1]}}\n</tool_call>'  # not strict
    assert admitted(anything) == anything


def test_strict_mistral_calls_take_its_special_tokens_in_either_of_its_formats(smollm2_tokenizer):
    """Mistral's [TOOL_CALLS] and [ARGS] are special tokens (added here to SmolLM2's tokenizer): the tags take
    them as tokens, and admit both its formats: NAME[ARGS]{...} (tokenizers v11 on) and a JSON list; the
    mistral parser reads both calls."""
    from specdec.decoding.grammar import GuideCompiler

    smollm2_tokenizer.add_tokens(["[TOOL_CALLS]", "[ARGS]"], special_tokens=True)
    calls, args = smollm2_tokenizer.convert_tokens_to_ids(["[TOOL_CALLS]", "[ARGS]"])
    grammar = GuideCompiler(smollm2_tokenizer).compile(
        "structural_tag", json.dumps(tools.strict_call_tags([STRICT_WEATHER, TIME], "mistral")))
    encode = lambda text: smollm2_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    reading = ToolCalling(AUTO, ("get_weather", "get_time"), "mistral")
    v11 = encode("Sure.") + [calls] + encode("get_weather") + [args] + encode('{"city": "Paris", "days": 2}')
    listed = encode("Sure.") + [calls] + encode(' [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}]')
    for ids in (v11, listed):
        assert grammar.matcher().valid_prefix(ids) == len(ids)
        text = smollm2_tokenizer.decode(ids, skip_special_tokens=False)
        assert [call["name"] for call in tools.split_output(text, reading)[1]] == ["get_weather"]
    text_args = encode("Sure.") + [calls] + encode("get_weather") + encode("[") + encode("ARGS")
    assert grammar.matcher().valid_prefix(text_args) < len(text_args)  # [ARGS] is the token, not its text
    off_schema = encode("Sure.") + [calls] + encode("get_weather") + [args] + encode('{"town": "Paris"}')
    assert grammar.matcher().valid_prefix(off_schema) < len(off_schema)


@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31"])
def test_strict_deepseek_calls_take_its_special_tokens_inside_the_section_it_opens(smollm2_tokenizer, parser):
    """DeepSeek's markers are special tokens (added here): each call its model opens is held, in V3.1's bare
    form or V3's fenced one, while the section's own markers stay free special tokens; the parser reads both."""
    from specdec.decoding.grammar import GuideCompiler

    marks = ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
             "<｜tool▁calls▁end｜>"]
    smollm2_tokenizer.add_tokens(marks, special_tokens=True)
    section, begin, sep, end, close = smollm2_tokenizer.convert_tokens_to_ids(marks)
    grammar = GuideCompiler(smollm2_tokenizer).compile(
        "structural_tag", json.dumps(tools.strict_call_tags([STRICT_WEATHER, TIME], parser)))
    encode = lambda text: smollm2_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    bare = [begin] + encode("get_weather") + [sep] + encode('{"city": "Paris", "days": 2}') + [end]
    fenced = ([begin] + encode("function") + [sep] + encode('get_time\n```json\n{"tz": "UTC"}\n```') + [end])
    answer = encode("Sure.") + [section] + bare + fenced + [close]
    assert grammar.matcher().valid_prefix(answer) == len(answer)
    text = smollm2_tokenizer.decode(answer, skip_special_tokens=False)
    calls = tools.split_output(text, ToolCalling(AUTO, ("get_weather", "get_time"), parser))[1]
    assert [(call["name"], json.loads(call["arguments"])) for call in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "UTC"})]
    off_schema = encode("Sure.") + [section, begin] + encode("get_weather") + [sep] + encode('{"town"')
    assert grammar.matcher().valid_prefix(off_schema) < len(off_schema)


def _glm_written(newline: str) -> tuple[str, str, list[str]]:
    return ((f"<tool_call>get_weather{newline}<arg_key>city</arg_key>{newline}<arg_value>Paris</arg_value>{newline}"
             f"<arg_key>days</arg_key>{newline}<arg_value>2</arg_value>{newline}</tool_call>"),
            (f"<tool_call>get_time{newline}<arg_key>tz</arg_key>{newline}<arg_value>UTC</arg_value>{newline}"
             "</tool_call>"),
            ["<tool_call>get_wind", "<tool_call>get_weather<arg_key>days",
             "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
             "<arg_value>x"])


# Per XML parser: a call to get_weather and one to get_time as its template writes them, and openings off the
# strict tool's schema (an unknown function, a required key left out, a value of the wrong type)
_XML_WRITTEN = {
    "qwen3_coder": (("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                     "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"),
                    "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>",
                    ["<tool_call>\n<function=get_wind>", "<tool_call>\n<function=get_weather>\n<parameter=days>",
                     "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                     "<parameter=days>\nx"]),
    "minimax_m2": (('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                    '<parameter name="days">2</parameter>\n</invoke>\n'),
                   '<invoke name="get_time">\n<parameter name="tz">UTC</parameter>\n</invoke>\n</minimax:tool_call>',
                   ['<invoke name="get_wind"', '<invoke name="get_weather">\n<parameter name="days"',
                    '<invoke name="get_weather">\n<parameter name="city">P</parameter>\n<parameter name="days">x']),
    "deepseek_v32": (('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
                      '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
                      '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'),
                     ('<｜DSML｜invoke name="get_time">\n<｜DSML｜parameter name="tz" string="true">UTC'
                      '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>'),
                     ['<｜DSML｜invoke name="get_wind"',
                      '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="days"',
                      '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="false"']),
    "glm45": _glm_written("\n"), "glm47": _glm_written("")}


@pytest.mark.parametrize("parser,special", [("qwen3_coder", False), ("glm45", False), ("glm47", True),
                                            ("minimax_m2", False), ("deepseek_v32", False)])
def test_strict_xml_calls_hold_each_parameter_to_its_type_and_the_parser_reads_them(smollm2_tokenizer, parser,
                                                                                    special):
    """Qwen3-Coder's <parameter=KEY> lines and GLM's <arg_key>/<arg_value> pairs (its markers special tokens in
    one case, added here): xgrammar's structural tags in the model's XML style hold each call the model opens to
    a tool of the request and a strict tool's parameters to their schema; the parser reads the typed values."""
    from specdec.decoding.grammar import GuideCompiler

    if special:
        smollm2_tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                      "</arg_value>"], special_tokens=True)
    tags = tools.strict_call_tags([STRICT_WEATHER, TIME], parser)
    assert tags["format"]["triggers"] == [{"minimax_m2": "<invoke name=", "deepseek_v32": "<｜DSML｜invoke name="}.get(
        parser, "<tool_call>")]
    grammar = GuideCompiler(smollm2_tokenizer).compile("structural_tag", json.dumps(tags))
    encode = lambda text: smollm2_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    call, other, wrong = _XML_WRITTEN[parser]
    answer = encode("Sure. " + call + " and " + other + " done")
    assert grammar.matcher().valid_prefix(answer) == len(answer)
    text = smollm2_tokenizer.decode(answer, skip_special_tokens=False)
    schemas = {"get_weather": STRICT_WEATHER["function"]["parameters"]}
    calls = tools.split_output(text, ToolCalling(AUTO, ("get_weather", "get_time"), parser, schemas=schemas))[1]
    assert [(call["name"], json.loads(call["arguments"])) for call in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "UTC"})]
    for off in wrong:
        ids = encode("Sure. " + off)
        assert grammar.matcher().valid_prefix(ids) < len(ids), off


def test_strict_pythonic_calls_are_a_list_of_calls_to_the_tools_with_literals_of_their_types(smollm2_tokenizer):
    """Llama 3.2's and 4's Python list of calls (4's between its special tokens, added here): an answer that opens
    with "[" is calls to the request's tools, a strict tool's keywords in its order with literals of their
    types (either quote), the required ones present; any other answer is free; the parser reads the calls."""
    from specdec.decoding.grammar import GuideCompiler

    smollm2_tokenizer.add_tokens(["<|python_start|>", "<|python_end|>"], special_tokens=True)
    start, end = smollm2_tokenizer.convert_tokens_to_ids(["<|python_start|>", "<|python_end|>"])
    unit = {"type": "function", "function": {"name": "set_unit", "strict": True, "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "on": {"type": "boolean"}}}}}
    grammar = GuideCompiler(smollm2_tokenizer).compile(
        "structural_tag", json.dumps(tools.strict_call_tags([STRICT_WEATHER, TIME, unit], "pythonic")))
    encode = lambda text: smollm2_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    reading = ToolCalling(AUTO, ("get_weather", "get_time", "set_unit"), "pythonic")
    for answer, calls in [
            ("[get_weather(city=\"Paris\", days=2), get_time(tz='UTC'), set_unit(on=True)]",
             [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "UTC"}), ("set_unit", {"on": True})]),
            ("[set_unit(unit='F',on=False), set_unit()]", [("set_unit", {"unit": "F", "on": False}), ("set_unit", {})]),
            ("It is sunny [as always].", []), ("", [])]:
        for ids in (encode(answer), [start] + encode(answer) + [end]) if calls else (encode(answer),):
            assert grammar.matcher().valid_prefix(ids + [2]) == len(ids) + 1, answer
            text = smollm2_tokenizer.decode(ids, skip_special_tokens=False)
            assert [(c["name"], json.loads(c["arguments"])) for c in tools.split_output(text, reading)[1]] == calls
    for off in ("[get_wind()]", "[get_weather(days=2)]",  # city is required
                "[get_weather(city='P', days='2')]", "[get_weather(days=2, city='P')]",  # its type; its order
                "[set_unit(unit='K')]", "[get_weather(city='P', days=2, town='Q')]", " [get_time()]"):
        ids = encode(off) + [2]
        assert grammar.matcher().valid_prefix(ids) < len(ids), off


def test_strict_kimi_calls_take_its_markers_and_any_index(smollm2_tokenizer):
    """Kimi K2's functions.NAME:INDEX (the index the model counts) between its special tokens (added here)."""
    from specdec.decoding.grammar import GuideCompiler

    marks = ["<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
             "<|tool_call_end|>", "<|tool_calls_section_end|>"]
    smollm2_tokenizer.add_tokens(marks, special_tokens=True)
    section, begin, arguments, end, close = smollm2_tokenizer.convert_tokens_to_ids(marks)
    grammar = GuideCompiler(smollm2_tokenizer).compile(
        "structural_tag", json.dumps(tools.strict_call_tags([STRICT_WEATHER, TIME], "kimi_k2")))
    encode = lambda text: smollm2_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    answer = (encode("Sure.") + [section, begin] + encode("functions.get_weather:0") + [arguments]
              + encode('{"city": "Paris", "days": 2}') + [end, begin] + encode("functions.get_time:12") + [arguments]
              + encode('{"tz": "UTC"}') + [end, close])
    assert grammar.matcher().valid_prefix(answer) == len(answer)
    text = smollm2_tokenizer.decode(answer, skip_special_tokens=False)
    calls = tools.split_output(text, ToolCalling(AUTO, ("get_weather", "get_time"), "kimi_k2"))[1]
    assert [(call["id"], json.loads(call["arguments"])) for call in calls] == [
        ("functions.get_weather:0", {"city": "Paris", "days": 2}), ("functions.get_time:12", {"tz": "UTC"})]
    for off in ([begin] + encode("functions.get_wind:0"), [begin] + encode("functions.get_weather:x"),
                [begin] + encode("functions.get_weather:0") + [arguments] + encode('{"town"')):
        ids = encode("Sure.") + [section] + off
        assert grammar.matcher().valid_prefix(ids) < len(ids)


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER]}, "tool_choice"),  # auto (the default with tools) needs a parser
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}], "tool_choice": "required"},
     "tools[0].function.strict"),
    ({"messages": [{"role": "tool", "content": "20 C"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
     "messages[0].tool_calls[0]"),
])
def test_tool_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as caught:
        parse_chat({"messages": CHAT, **body}, SERVED)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def test_a_conversation_with_calls_and_their_results_reaches_the_template():
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}]
    gen = parse_chat({"messages": history, "tools": [WEATHER], "tool_choice": "none"}, SERVED)
    sent = gen.choices[0][tn.MESSAGES][0, 0].decode()
    # the server's side: arguments become the object they encode, for templates that render calls
    messages = chat_messages(sent, tn.MESSAGES)
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert messages[2] == {"role": "tool", "content": "20 C", "tool_call_id": "call_1"}
    with pytest.raises(ValueError, match=r"messages'\[0\] has fields"):
        chat_messages(json.dumps([{"role": "user", "content": "x", "tool_call_id": "1"}]), tn.MESSAGES)
    with pytest.raises(ValueError, match="tools'\\[0\\]"):
        chat_tools(json.dumps([{"type": "function", "function": {}}]), tn.TOOLS)


def test_the_chat_template_renders_the_tools(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    tokenizer.chat_template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
                               "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                               "{% for c in m.tool_calls or [] %}[{{ c.function.name }}({{ c.function.arguments.city }})]"
                               "{% endfor %}{% endfor %}<assistant>")
    messages = chat_messages(json.dumps([*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]}]),
        tn.MESSAGES)
    text = tokenizer.decode(chat_ids(tokenizer, messages, [WEATHER, TIME], tn.MESSAGES))
    assert text == "TOOLS:get_weather;get_time;<user>Weather in Paris?<assistant>[get_weather(Oslo)]<assistant>"
    assert "TOOLS" not in tokenizer.decode(chat_ids(tokenizer, messages, None, tn.MESSAGES))


def test_answers_become_calls_by_mode_and_parser():
    named = ToolCalling(NAMED, ("get_weather",))
    assert tools.split_output('{"city": "Paris"}', named) == (None, [{"name": "get_weather", "arguments": '{"city": "Paris"}'}])
    required = ToolCalling(REQUIRED, ("get_weather", "get_time"))
    assert tools.split_output('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": '
                              '{"city": "Oslo"}}]', required)[1] == [
        {"name": "get_time", "arguments": "{}"}, {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert tools.split_output('[{"name": "get_ti', required) == ('[{"name": "get_ti', [])  # cut short: text
    hermes = ToolCalling(AUTO, ("get_weather",), "hermes")
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    content, calls = tools.split_output(text, hermes)
    assert content == "Let me check." and [c["arguments"] for c in calls] == ['{"city": "Paris"}', '{"city": "Rome"}']
    assert len(tools.split_output(text, ToolCalling(AUTO, ("get_weather",), "hermes", parallel=False))[1]) == 1
    assert tools.split_output("No call here.", hermes) == ("No call here.", [])
    assert tools.split_output("<tool_call>not json</tool_call>", hermes) == ("<tool_call>not json</tool_call>", [])
    llama = ToolCalling(AUTO, ("get_weather", "get_time"), "llama3_json")
    assert tools.split_output('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                              '{"name": "get_time", "parameters": {}}', llama)[1] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}, {"name": "get_time", "arguments": "{}"}]
    assert tools.split_output("Oslo is cold.", llama) == ("Oslo is cold.", [])
    assert tools.split_output('{"name": "get_weather", "parameters": {"ci', llama)[1] == []
    pythonic = ToolCalling(AUTO, ("get_weather", "get_time"), "pythonic")
    assert tools.split_output('[get_weather(city="Oslo", days=3, metric=True, hours=[1, 2.5], where=None), '
                              'get_time()]', pythonic) == (None, [
        {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3, "metric": true, "hours": [1, 2.5], '
                                             '"where": null}'}, {"name": "get_time", "arguments": "{}"}])
    assert tools.split_output('<|python_start|>[get_time(zone={"name": "CET"})]<|python_end|>', pythonic)[1] == [
        {"name": "get_time", "arguments": '{"zone": {"name": "CET"}}'}]
    # what is no list of calls with literal keyword arguments stays text (and nothing is ever run)
    for text in ("Oslo is cold.", "[1] A note.", "[get_weather(city=", "[get_weather('Oslo')]", "[f(**kw)]",
                 "[f(x=open('/etc/passwd'))]", "[f(x=y)]", "[obj.method(a=1)]", "[]", "[f(x={1, 2})]", DEEP):
        assert tools.split_output(text, pythonic) == (text, []), text


def _stream(calling, pieces):
    stream, content, deltas = ToolStream(calling), "", []
    for piece in pieces:
        text, more = stream.feed(piece)
        content, deltas = content + text, deltas + more
    text, more, called = stream.finish()
    return content + text, deltas + more, called


def test_streamed_answers_send_content_and_calls_as_they_can():
    # named: the arguments stream as they come, the first delta with the call's id and name
    content, deltas, called = _stream(ToolCalling(NAMED, ("f",)), ['{"ci', 'ty": "Pa', 'ris"}'])
    assert content == "" and called and deltas[0]["function"] == {"name": "f", "arguments": '{"ci'}
    assert deltas[0]["id"].startswith("call_") and all("id" not in d for d in deltas[1:])
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
    # hermes: content until the opening (a tail that may begin it held back), the calls at the end
    stream = ToolStream(ToolCalling(AUTO, ("f",), "hermes"))
    assert stream.feed("Sure. <tool") == ("Sure. ", [])
    assert stream.feed('_call>{"name": "f", "arguments": {"a": 1}}') == ("", [])
    rest, deltas, called = stream.finish()
    assert rest == "" and called and deltas[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert _stream(ToolCalling(AUTO, ("f",), "hermes"), ["a <", "b"]) == ("a <b", [], False)  # no call: all text
    # llama3_json: the answer's start decides
    content, deltas, called = _stream(ToolCalling(AUTO, ("f",), "llama3_json"), [" {\"name\": \"f\",", ' "parameters": {}}'])
    assert content == "" and called and deltas[0]["function"]["arguments"] == "{}"
    assert _stream(ToolCalling(AUTO, ("f",), "llama3_json"), ["It is", " sunny."]) == ("It is sunny.", [], False)
    # pythonic: likewise, its list's bracket
    content, deltas, called = _stream(ToolCalling(AUTO, ("f",), "pythonic"), [" [f(a=", '"x")]'])
    assert content == "" and called and deltas[0]["function"] == {"name": "f", "arguments": '{"a": "x"}'}
    assert _stream(ToolCalling(AUTO, ("f",), "pythonic"), ["[1] is", " a footnote."]) == ("[1] is a footnote.", [],
                                                                                          False)
    assert _stream(ToolCalling(AUTO, ("f",), "pythonic"), ["It is", " sunny."]) == ("It is sunny.", [], False)
    # required: the calls at the end, whole
    content, deltas, called = _stream(ToolCalling(REQUIRED, ("f",)), ['[{"name": "f", ', '"arguments": {}}]'])
    assert content == "" and called and [d["index"] for d in deltas] == [0]


DEEP = "[" * 5000 + "]" * 5000  # nested past the interpreter's recursion limit: json.loads raises RecursionError


def test_json_nested_too_deeply_is_text_or_a_refusal_never_an_escaping_error():
    """A model's answer, or a client's tool-call arguments, nested past the JSON decoder's depth: the answer
    stays text (as any other answer that is no call), the client's message is refused by name."""
    from specdec.decoding import json_text

    with pytest.raises(ValueError, match="nested too deeply"):
        json_text.parse(DEEP)
    with pytest.raises(ValueError, match="nested too deeply"):
        json_text.parse_at("x" + DEEP, 1)
    assert json_text.parse_at('{"a": 1}; {"b": 2}', 10) == ({"b": 2}, 18)
    hermes = ToolCalling(AUTO, ("get_weather",), "hermes")
    answer = f"<tool_call>{DEEP}</tool_call>"
    assert tools.split_output(answer, hermes) == (answer, [])
    llama = ToolCalling(AUTO, ("get_weather",), "llama3_json")
    answer = '{"name": "get_weather", "parameters": ' + DEEP + "}"
    assert tools.split_output(answer, llama) == (answer, [])
    required = ToolCalling(REQUIRED, ("get_weather",))
    assert tools.split_output(DEEP, required) == (DEEP, [])
    messages = [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": DEEP}}]}]
    with pytest.raises(ValueError, match=r"input 'm'\[0\]\.tool_calls\[0\]\.function\.arguments is not JSON"):
        chat_messages(json.dumps(messages), "m")


def test_mistral_calls_are_read_in_both_of_its_formats_with_its_ids():
    mistral = ToolCalling(AUTO, ("get_weather", "get_time"), "mistral")
    # Mistral 7B v0.3, Mixtral, Nemo: [TOOL_CALLS] then a JSON list
    content, calls = tools.split_output('Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": '
                                        '{"city": "Paris"}}, {"name": "get_time", "arguments": {}}]', mistral)
    assert content == "Let me check."
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert all(len(c["id"]) == tools.MISTRAL_ID_LENGTH and c["id"].isalnum() for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # tokenizers v11+ (Mistral Small 3.2, Magistral, Devstral): [TOOL_CALLS]name[ARGS]{...} per call, its own id
    # where the model wrote one ([CALL_ID])
    content, calls = tools.split_output('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time'
                                        '[CALL_ID]a1B2c3D4e[ARGS]{"zone": "CET"}', mistral)
    assert content is None and [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "CET"}')]
    assert calls[1]["id"] == "a1B2c3D4e" and len(calls[0]["id"]) == 9
    assert len(tools.split_output('[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_time[ARGS]{}',
                                  ToolCalling(AUTO, ("get_time",), "mistral", parallel=False))[1]) == 1
    # what does not read as calls stays text
    for text in ("No call.", "[TOOL_CALLS]", "[TOOL_CALLS] [not json", "[TOOL_CALLS] []", '[TOOL_CALLS] [{"x": 1}]',
                 "[TOOL_CALLS]get_weather", '[TOOL_CALLS]bad name[ARGS]{}', "[TOOL_CALLS]f[ARGS][1]",
                 '[TOOL_CALLS]f[ARGS]{"a": ', "[TOOL_CALLS]" + DEEP):
        assert tools.split_output(text, mistral) == (text, []), text
    # the whole answer's calls as a message's and as stream deltas keep those ids
    (message_call,) = tools.message_calls(calls[1:])
    assert message_call["id"] == "a1B2c3D4e"
    assert tools.call_deltas(calls)[1]["id"] == "a1B2c3D4e"


def test_mistral_streams_content_until_its_calls_open():
    stream = ToolStream(ToolCalling(AUTO, ("f",), "mistral"))
    assert stream.feed("Sure. [TOOL_") == ("Sure. ", [])  # a tail that may open the calls is held
    assert stream.feed('CALLS]f[ARGS]{"a": 1}') == ("", [])
    rest, deltas, called = stream.finish()
    assert rest == "" and called and deltas[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert len(deltas[0]["id"]) == 9
    assert _stream(ToolCalling(AUTO, ("f",), "mistral"), ["See [TOOL", " docs]."]) == ("See [TOOL docs].", [], False)


def test_ids_sent_back_take_mistrals_form_and_still_pair_calls_with_results():
    chat = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_0123456789abcdef01234567", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{}"}},
                {"id": "x", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "sunny"},
            {"role": "tool", "tool_call_id": "x", "content": "noon"}]
    shortened = tools.mistral_messages(chat)
    ids = [call["id"] for call in shortened[1]["tool_calls"]]
    assert ids[0] == "f01234567" and len(ids[1]) == 9 and ids[1].isalnum()
    assert [m["tool_call_id"] for m in shortened[2:]] == ids
    assert chat[1]["tool_calls"][0]["id"].startswith("call_")  # the request's own messages are left as they were
    assert tools.mistral_id("a1B2c3D4e") == "a1B2c3D4e"


EDIT = {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "ratio": {"type": "number"}, "dry": {"type": "boolean"},
    "options": {"type": "object"}, "lines": {"type": "array"}, "note": {"type": ["string", "null"]},
    "limit": {"type": ["integer", "null"]}}}


@pytest.mark.parametrize("parser", ["qwen3_coder", "qwen3_xml"])
def test_qwen3_coder_calls_take_their_values_types_from_the_tools_schemas(parser):
    calling = ToolCalling(AUTO, ("edit", "run"), parser, schemas={"edit": EDIT, "run": {}})
    text = ("I will edit it.\n<tool_call>\n<function=edit>\n<parameter=path>\n/tmp/a b.py\n</parameter>\n"
            "<parameter=line>\n12\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=dry>\nTrue\n"
            "</parameter>\n<parameter=options>\n{\"x\": [1, 2]}\n</parameter>\n<parameter=lines>\n[3, 4]\n</parameter>\n"
            "<parameter=note>\nnull\n</parameter>\n<parameter=limit>\nnull\n</parameter>\n"
            "<parameter=code>\ndef f():\n    return \"\\\\n\"\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=run>\n</function>\n</tool_call>")
    content, calls = tools.split_output(text, calling)
    assert content == "I will edit it." and [c["name"] for c in calls] == ["edit", "run"]
    assert json.loads(calls[0]["arguments"]) == {
        "path": "/tmp/a b.py", "line": 12, "ratio": 0.5, "dry": True, "options": {"x": [1, 2]}, "lines": [3, 4],
        "note": "null", "limit": None,  # a string's "null" is the word; elsewhere JSON's null
        "code": 'def f():\n    return "\\\\n"'}  # a parameter the schema does not name: its text, as it is
    assert calls[1]["arguments"] == "{}"
    # a value that is not of its type stays text; a call cut short, or a block that is no call, leaves text
    (odd,) = tools.split_output("<tool_call><function=edit><parameter=line>twelve</parameter></function></tool_call>",
                                calling)[1]
    assert json.loads(odd["arguments"]) == {"line": "twelve"}
    for text in ("No call.", "<tool_call>\n<function=edit>\n<parameter=path>\n/tmp/a", "<tool_call>{\"a\": 1}</tool_call>",
                 "<tool_call><function=bad name></function></tool_call>"):
        assert tools.split_output(text, calling) == (text, []), text
    stream = ToolStream(calling)
    assert stream.feed("Sure.\n<tool") == ("Sure.\n", [])
    assert stream.feed("_call>\n<function=run>\n</function>\n</tool_call>") == ("", [])
    rest, deltas, called = stream.finish()
    assert rest == "" and called and deltas[0]["function"] == {"name": "run", "arguments": "{}"}


def test_auto_tool_calling_carries_each_tools_parameters_schema():
    tools_given = [{"type": "function", "function": {"name": "edit", "parameters": EDIT}},
                   {"type": "function", "function": {"name": "run"}}]
    gen = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools_given}, ("m",),
                     tool_parser="qwen3_coder")
    assert gen.tools.schemas == {"edit": EDIT, "run": {}} and gen.tools.parser == "qwen3_coder"


@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31"])
def test_deepseek_calls_are_read_in_v3s_and_v31s_forms(parser):
    """DeepSeek-V3 (and R1-0528): `function<｜tool▁sep｜>NAME` then the arguments fenced as ```json; V3.1 and
    V3.2: `NAME<｜tool▁sep｜>ARGUMENTS`; either parser name reads both."""
    calling = ToolCalling(AUTO, ("get_weather", "get_time"), parser)
    v3 = ('Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
          '{"city": "Oslo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n'
          '```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    v31 = ('Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}'
           '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    for text in (v3, v31):
        content, calls = tools.split_output(text, calling)
        assert content == "Let me look." and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Oslo"}), ("get_time", {})], text
    for text in ("No call.", "<｜tool▁calls▁begin｜>", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather'
                 '<｜tool▁sep｜>{"city": "Os', "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bad name<｜tool▁sep｜>{}"
                 "<｜tool▁call▁end｜>", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜>"):
        assert tools.split_output(text, calling) == (text, []), text
    content, deltas, called = _stream(calling, ["Sure.<｜tool▁", v31[len("Let me look.<｜tool▁"):]])
    assert content == "Sure." and called and [d["function"]["name"] for d in deltas] == ["get_weather", "get_time"]


def test_kimi_k2_calls_keep_the_models_ids():
    calling = ToolCalling(AUTO, ("get_weather",), "kimi_k2")
    text = ('Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
            '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1'
            '<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>')
    content, calls = tools.split_output(text, calling)
    assert content == "Checking." and [(c["name"], c["id"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", "functions.get_weather:0", {"city": "Oslo"}),
        ("get_weather", "functions.get_weather:1", {"city": "Rome"})]
    assert [m["id"] for m in tools.message_calls(calls)] == ["functions.get_weather:0", "functions.get_weather:1"]
    for text in ("No call.", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                 '<|tool_call_argument_begin|>{"city": "Os'):
        assert tools.split_output(text, calling) == (text, []), text
    content, deltas, called = _stream(calling, ["Ok <|tool_calls", "_section_begin|><|tool_call_begin|>functions."
                                                "get_weather:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
                                                "<|tool_calls_section_end|>"])
    assert content == "Ok " and called and deltas[0]["id"] == "functions.get_weather:0"


_GLM_TYPED = ("On it.\n<tool_call>edit\n<arg_key>path</arg_key>\n<arg_value>/tmp/a b.py</arg_value>\n"
              "<arg_key>line</arg_key>\n<arg_value>12</arg_value>\n<arg_key>options</arg_key>\n"
              "<arg_value>{\"x\": [1, 2]}</arg_value>\n<arg_key>extra</arg_key>\n<arg_value>[3, 4]</arg_value>\n"
              "<arg_key>word</arg_key>\n<arg_value>plain text</arg_value>\n</tool_call>\n<tool_call>run</tool_call>",
              ("<tool_call>edit\n<arg_key>path</arg_key>\n<arg_value>/tmp/a", "<tool_call>edi",
               '<tool_call>{"name": "run"}</tool_call>', "<tool_call>bad name</tool_call>"),
              ["Sure.\n<tool", "_call>run</tool_call>"])
# Per parser whose values are text: an answer calling edit (values of several types) and run as the model writes
# it, texts that are no call, and a streamed answer calling run
_TYPED_CALLS = {
    "glm45": _GLM_TYPED, "glm47": _GLM_TYPED,
    "minimax_m2": (('On it.\n<minimax:tool_call>\n<invoke name="edit">\n'
                    '<parameter name="path">/tmp/a b.py</parameter>\n<parameter name="line">12</parameter>\n'
                    '<parameter name="options">{"x": [1, 2]}</parameter>\n'
                    '<parameter name="extra">[3, 4]</parameter>\n<parameter name="word">\nplain text\n</parameter>\n'
                    "</invoke>\n<invoke name=run>\n</invoke>\n</minimax:tool_call>"),  # (a name quoted or not)
                   ('<minimax:tool_call>\n<invoke name="edit">\n<parameter name="path">/tmp/a',
                    '<minimax:tool_call>\n<invoke name="bad name">\n</invoke>', "<minimax:tool_call>\n"),
                   ["Sure.\n<minimax:tool", '_call>\n<invoke name="run">\n</invoke>\n</minimax:tool_call>']),
    # DeepSeek-V3.2's: each parameter's string flag says raw text ("true") or JSON; an invoke's body may be JSON
    "deepseek_v32": (('On it.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="edit">\n'
                      '<｜DSML｜parameter name="path" string="true">/tmp/a b.py</｜DSML｜parameter>\n'
                      '<｜DSML｜parameter name="line" string="false">12</｜DSML｜parameter>\n'
                      '<｜DSML｜parameter name="options" string="false">{"x": [1, 2]}</｜DSML｜parameter>\n'
                      '<｜DSML｜parameter name="extra" string="false">[3, 4]</｜DSML｜parameter>\n'
                      '<｜DSML｜parameter name="word" string="true">plain text</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
                      '<｜DSML｜invoke name="run">\n{}\n</｜DSML｜invoke>\n</｜DSML｜function_calls>'),
                     ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="edit">\n<｜DSML｜parameter name="p" str',
                      '<｜DSML｜function_calls>\n<｜DSML｜invoke name="bad name">\n</｜DSML｜invoke>',
                      '<｜DSML｜function_calls>\n<｜DSML｜invoke name="run">\n{"fast": </｜DSML｜invoke>'),
                     ["Sure.\n<｜DSML｜function", '_calls>\n<｜DSML｜invoke name="run">\n</｜DSML｜invoke>\n'
                                                 "</｜DSML｜function_calls>"])}


@pytest.mark.parametrize("parser", list(_TYPED_CALLS))
def test_text_valued_calls_take_their_values_types_from_the_schemas_or_json(parser):
    """GLM-4.5's and 4.7's <arg_key>/<arg_value> pairs and MiniMax-M2's <invoke> calls of <parameter name=...>
    values (less one newline at each end): each typed by the tool's schema, else JSON where it reads as JSON;
    DeepSeek-V3.2's DSML parameters by their string flag."""
    text, no_calls, streamed = _TYPED_CALLS[parser]
    calling = ToolCalling(AUTO, ("edit", "run"), parser, schemas={"edit": EDIT, "run": {}})
    content, calls = tools.split_output(text, calling)
    assert content == "On it." and [c["name"] for c in calls] == ["edit", "run"]
    assert json.loads(calls[0]["arguments"]) == {"path": "/tmp/a b.py", "line": 12, "options": {"x": [1, 2]},
                                                 "extra": [3, 4], "word": "plain text"}
    assert calls[1]["arguments"] == "{}"
    for text in ("No call.", *no_calls):
        assert tools.split_output(text, calling) == (text, []), text
    content, deltas, called = _stream(calling, streamed)
    assert content == "Sure.\n" and called and deltas[0]["function"] == {"name": "run", "arguments": "{}"}


@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v32", "kimi_k2", "glm45", "mistral", "minimax_m2"])
def test_parsers_whose_calls_are_special_tokens_keep_them_in_the_text(parser):
    body = {"model": "m", "messages": CHAT, "tools": [WEATHER]}
    assert json.loads(parse_chat(body, SERVED, tool_parser=parser).choices[0][tn.SAMPLING_PARAMETERS][0, 0])[
        "skip_special_tokens"] is False
    assert "skip_special_tokens" not in json.loads(parse_chat(body, SERVED, tool_parser="hermes").choices[0][
        tn.SAMPLING_PARAMETERS][0, 0])


@pytest.mark.parametrize("text, where", [
    ('{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages.0.content"),
    (b'{"prompt": ["ok", "\\uDFFF"]}', "prompt.1"), ('{"a": {"\\udc00": 1}}', "a key of a"),
    ('"\\ud83d"', "the value")])
def test_json_with_a_lone_surrogate_is_refused_naming_where(text, where):
    """json.loads reads an escaped lone surrogate into a str no tokenizer or encoder takes (the API answered 500
    to one in a prompt, found by loadtest/fuzz.py); a pair is one character, and is read."""
    from specdec.decoding import json_text

    with pytest.raises(ValueError, match=f"^{where} holds a lone UTF-16 surrogate"):
        json_text.parse(text)
    assert json_text.parse('{"a": "\\ud83d\\ude00 \\u00e9"}') == {"a": "\U0001F600 é"}
    assert json_text.parse(b'"\\\\ud800"') == "\\ud800"  # an escaped backslash: text, not a surrogate
