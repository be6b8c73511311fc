"""xgrammar's structural tag `format` form (decoding/structural_tags.py) compiled over SmolLM2's tokenizer: what
each format admits and refuses, free text ending where what encloses it goes on, token-level formats, the
XML parameter styles, and refusals naming the place. (vLLM's `structures` form: tests/unit/test_grammar.py.)"""

import json

import pytest
from specdec.decoding.grammar import GuideError

from .test_grammar import guides, tokenizer  # noqa: F401 (fixtures: SmolLM2's tokenizer and a compiler over it)

EOS = 2  # SmolLM2's <|im_end|>
START, FILE_SEP, FILENAME = 1, 5, 6  # special tokens of SmolLM2's: <|im_start|>, <file_sep>, <filename>
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"], "additionalProperties": False}


def _ids(tokenizer, output) -> list[int]:
    """Text, or a list of text pieces and token ids, as token ids."""
    pieces = [output] if isinstance(output, str) else output
    return [i for piece in pieces for i in (tokenizer.encode(piece, add_special_tokens=False)
                                           if isinstance(piece, str) else [piece])]


def _complete(guides, tokenizer, fmt: dict, output) -> bool:
    """Whether the format admits `output` whole, then the end of sequence."""
    grammar = guides.compile("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))
    ids = _ids(tokenizer, output) + [EOS]
    return grammar.matcher().valid_prefix(ids) == len(ids)


def _tag(begin, content, end) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


ANY = {"type": "any_text"}
NUMBER = {"type": "json_schema", "json_schema": {"type": "integer"}}
WEATHER = _tag("<function=get_weather>", {"type": "json_schema", "json_schema": CITY}, "</function>")
TIME = _tag("<function=get_time>", {"type": "json_schema", "json_schema": {"type": "object"}}, "</function>")
CALLS = {"type": "triggered_tags", "triggers": ["<function="], "tags": [WEATHER, TIME]}
CALL = '<function=get_weather>{"city": "Paris"}</function>'

CASES = [  # (format, admitted outputs, refused outputs)
    ({"type": "const_string", "value": "Hello!"}, ["Hello!"], ["Hello", "Hello!!"]),
    (NUMBER, ["42"], ["4.5", '"42"']),
    ({"type": "json_schema", "json_schema": CITY}, ['{"city": "Oslo", "days": 2}'], ['{"town": "Oslo"}']),
    ({"type": "regex", "pattern": "[A-Z]{3}-[0-9]{4}"}, ["ABC-1234"], ["AB-1234", "ABC-12345"]),
    ({"type": "regex", "pattern": "a/b"}, ["a/b"], ["ab"]),  # a slash in a pattern is the character
    ({"type": "grammar", "grammar": 'root ::= "yes" | "no"'}, ["yes", "no"], ["maybe"]),
    ({"type": "grammar", "grammar": 'start: "a"+'}, ["aaa"], ["b"]),  # Lark too
    (ANY, ["", "anything <f> at all", ["free ", FILE_SEP, " tokens"]], [[EOS, "x"]]),
    ({"type": "any_text", "excludes": ["bad"]}, ["a good one"], ["a bad one"]),
    ({"type": "any_text", "max_chars": 5}, ["abcde"], ["abcdef"]),
    ({"type": "sequence", "elements": [{"type": "const_string", "value": "A: "}, NUMBER]}, ["A: 7"], ["A:7", "7"]),
    ({"type": "or", "elements": [{"type": "const_string", "value": "yes"}, NUMBER]}, ["yes", "12"], ["no"]),
    ({"type": "optional", "content": {"type": "const_string", "value": "x"}}, ["", "x"], ["xx"]),
    ({"type": "plus", "content": {"type": "const_string", "value": "ab"}}, ["ab", "ababab"], ["", "aba"]),
    ({"type": "star", "content": {"type": "const_string", "value": "ab"}}, ["", "abab"], ["b"]),
    ({"type": "repeat", "min": 2, "max": 3, "content": {"type": "const_string", "value": "no"}},
     ["nono", "nonono"], ["no", "nononono"]),
    ({"type": "repeat", "min": 1, "max": -1, "content": {"type": "const_string", "value": "z"}}, ["z", "zzzzz"], [""]),
    (_tag("<think>", ANY, "</think>"), ["<think>a </thin k> b</think>"], ["<think>a</think>b", "<think>a"]),
    (_tag("<r>", NUMBER, ["</r>", "</answer>"]), ["<r>1</r>", "<r>2</answer>"], ["<r>3</x>"]),
    (_tag("<r>", ANY, ["</r>", "</answer>"]), ["<r>x</answer>"], ["<r>x</answer>y"]),
    (CALLS, ["plain text", f"I will. {CALL} done. {CALL}", '<function=get_time>{"tz": 1}</function>'],
     ['<function=get_wind>{}</function>', '<function=get_weather>{"town": "Oslo"}</function>']),
    ({**CALLS, "at_least_one": True}, [CALL, f"{CALL} then text"], ["text first " + CALL, "plain"]),
    ({**CALLS, "stop_after_first": True}, ["plain", f"text {CALL}"], [f"{CALL} more"]),
    ({**CALLS, "at_least_one": True, "stop_after_first": True}, [CALL], ["x" + CALL, CALL + CALL]),
    ({**CALLS, "excludes": ["secret"]}, ["open text"], ["a secret text"]),
    (_tag("<answer>", CALLS, "</answer>"), [f"<answer>x {CALL} y</answer>"], [f"<answer>x {CALL} y</answer> z"]),
    ({"type": "tags_with_separator", "tags": [_tag("<a>", NUMBER, "</a>")], "separator": ","},
     ["", "<a>1</a>", "<a>1</a>,<a>2</a>"], ["<a>1</a> <a>2</a>", "x<a>1</a>"]),
    ({"type": "tags_with_separator", "tags": [_tag("<a>", NUMBER, "</a>")], "separator": ",", "at_least_one": True,
      "stop_after_first": True}, ["<a>1</a>"], ["", "<a>1</a>,<a>2</a>"]),
    ({"type": "dispatch", "rules": [["<n>", NUMBER]]}, ["a <n>12 b <n>3"], ["a <n>x"]),
    ({"type": "dispatch", "rules": [["<n>", NUMBER]], "loop": False}, ["a <n>12", "a"], ["a <n>12 b"]),
    ({"type": "sequence", "elements": [{"type": "any_text", "excludes": ["</end>"]},
                                       {"type": "const_string", "value": "</end>"},
                                       {"type": "const_string", "value": "!"}]}, ["abc</end>!"], ["abc</end>x"]),
    ({"type": "sequence", "elements": [ANY, _tag("<n>", NUMBER, "</n>")]}, ["so: <n>5</n>"], ["so: <n>x</n>", "so"]),
    ({"type": "sequence", "elements": [_tag("<think>", ANY, "</think>"), CALLS]},
     [f"<think>hm</think>ok {CALL}"], ["no thinking"]),
    # token-level formats (SmolLM2's special tokens)
    ({"type": "token", "token": "<file_sep>"}, [[FILE_SEP]], [[FILENAME], "file"]),
    ({"type": "token", "token": FILE_SEP}, [[FILE_SEP]], [[FILENAME]]),
    ({"type": "exclude_token", "exclude_tokens": [FILE_SEP]}, [[FILENAME], "hello"], [[FILE_SEP]]),
    (_tag({"type": "token", "token": "<|im_start|>"}, {"type": "any_tokens"}, {"type": "token", "token": FILE_SEP}),
     [[START, "any text ", FILENAME, FILE_SEP]], [[START, "x", FILE_SEP, "y"], [START, "x"]]),
    ({"type": "any_tokens", "exclude_tokens": [FILE_SEP], "max_tokens": 2}, [["ab"], [FILENAME, FILENAME]],
     [[FILE_SEP], [FILENAME] * 3]),
    ({"type": "token_triggered_tags", "trigger_tokens": [START], "tags": [
        _tag({"type": "token", "token": START}, NUMBER, {"type": "token", "token": FILE_SEP})]},
     [["text ", START, "12", FILE_SEP, " more"], ["plain"]], [["x", START, "y"]]),
    ({"type": "token_triggered_tags", "trigger_tokens": [START], "at_least_one": True, "stop_after_first": True,
      "tags": [_tag({"type": "token", "token": START}, NUMBER, {"type": "token", "token": FILE_SEP})]},
     [[START, "12", FILE_SEP]], [["x", START, "1", FILE_SEP], [START, "1", FILE_SEP, "y"]]),
    ({"type": "token_dispatch", "rules": [[START, NUMBER]]}, [["a", START, "12", " b"]], [["a", START, "b"]]),
    # JSON in models' XML parameter styles
    ({"type": "json_schema", "json_schema": CITY, "style": "qwen_xml"},
     ["<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n",
      "<parameter=city>\nNew\nYork <b>\n</parameter>\n"],
     ["<parameter=days>\n3\n</parameter>\n",  # city is required
      "<parameter=city>\nParis\n</parameter>\n<parameter=days>\nthree\n</parameter>\n",  # days is an integer
      "<parameter=town>\nParis\n</parameter>\n"]),
    ({"type": "json_schema", "json_schema": CITY, "style": "glm_xml"},
     ["\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n",
      "<arg_key>city</arg_key><arg_value>Paris</arg_value>"],
     ["<arg_key>days</arg_key><arg_value>3</arg_value>", "<arg_key>city</arg_key><arg_value>Paris</arg_key>"]),
    ({"type": "json_schema", "json_schema": CITY, "style": "minimax_xml"},
     ['<parameter name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n',
      '<parameter name="city">Paris</parameter><parameter name="days">3</parameter>'],
     ['<parameter name="days">3</parameter>', '<parameter name=city>Paris</parameter>']),
    ({"type": "json_schema", "json_schema": CITY, "style": "deepseek_xml"},
     ['<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
      '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'],
     ['<｜DSML｜parameter name="city" string="false">Paris</｜DSML｜parameter>',  # a string's flag is "true"
      '<｜DSML｜parameter name="city" string="true">P</｜DSML｜parameter><｜DSML｜parameter name="days" '
      'string="false">x</｜DSML｜parameter>']),
    ({"type": "json_schema", "style": "qwen_xml", "json_schema": {"type": "object", "properties": {
        "on": {"type": "boolean"}, "unit": {"enum": ["C", "F"]}, "tags": {"type": "array"}}}},
     ["<parameter=on>\nTrue\n</parameter>\n<parameter=unit>\nF\n</parameter>\n"
      "<parameter=tags>\n[1, 2]\n</parameter>\n"],
     ["<parameter=unit>\nK\n</parameter>\n", "<parameter=on>\nyes\n</parameter>\n"]),
    ({"type": "json_schema", "json_schema": {"type": "object"}, "style": "qwen_xml"},
     ["", "<parameter=any>\nthing\n</parameter>\n<parameter=n>\n1\n</parameter>\n"], ["<parameter=x>1</parameter>"]),
]


@pytest.mark.parametrize("fmt,admitted,refused", CASES, ids=[f"{i}-{case[0]['type']}" for i, case in enumerate(CASES)])
def test_each_format_admits_its_outputs_and_refuses_others(guides, tokenizer, fmt, admitted, refused):
    for output in admitted:
        assert _complete(guides, tokenizer, fmt, output), output
    for output in refused:
        assert not _complete(guides, tokenizer, fmt, output), output


def test_a_character_budget_holds_free_text_inside_a_tag(guides, tokenizer):
    fmt = _tag("<think>", {"type": "any_text", "max_chars": 5}, "</think>")
    assert _complete(guides, tokenizer, fmt, "<think>ab</think>")
    assert _complete(guides, tokenizer, fmt, "<think>abcde</think>")
    assert not _complete(guides, tokenizer, fmt, "<think>abcdef</think>")


@pytest.mark.parametrize("guide,message", [
    ({"format": {"type": "nope"}}, "format: a format is an object whose 'type' is one of const_string"),
    ({"format": {"type": "tag", "begin": "<a>", "end": "</a>"}}, r"format: a tag format has no \['content'\]"),
    ({"format": {"type": "const_string", "value": "a", "extra": 1}}, r"unknown keys \['extra'\]"),
    ({"format": {"type": "sequence", "elements": [{"type": "regex", "pattern": ""}]}},
     r"format.elements\[0\].pattern must be a non-empty regular expression"),
    ({"format": {"type": "json_schema", "json_schema": {}, "style": "yaml"}}, "format.style must be one of json"),
    ({"format": {"type": "json_schema", "json_schema": {}, "any_order": True}}, "format.any_order: only false"),
    ({"format": {"type": "json_schema", "json_schema": {"type": "array"}, "style": "glm_xml"}},
     "the glm_xml style writes an object's properties"),
    ({"format": {**CALLS, "tags": [_tag("<call>", ANY, "</call>")]}},
     r"format.tags\[0\]: 'begin' '<call>' starts with none of the triggers"),
    ({"format": {"type": "token", "token": "<nope>"}}, "'<nope>' is not a special token of the served tokenizer"),
    ({"format": {"type": "token", "token": 10 ** 6}}, "outside the vocabulary"),
    ({"format": _tag("<a>", {"type": "any_tokens"}, "</a>")},
     "any_tokens ends at a token: it cannot be closed by text"),
    ({"format": {"type": "repeat", "min": 3, "max": 2, "content": ANY}}, "'max' -1 or at least 'min', got 3, 2"),
    ({"format": {"type": "any_text", "max_tokens": -1}}, "format.max_tokens must be a count"),
    ({"format": _tag("<a>", {"type": "any_text", "max_tokens": 4}, "</a>")},
     "format.content.max_tokens is not supported on free text .speculation rolls the grammar back"),
    ({"format": {"type": "grammar", "grammar": "root ::= ("}}, "format.grammar does not convert"),
    ({"format": {"type": "grammar", "grammar": 'start: t\nt[stop="x"]: /[a-z]+/'}},
     "format.grammar: a rule's stop= is not supported"),
    ({"format": {"type": "triggered_tags", "triggers": ["a<|im_start|>"], "tags": [_tag("a<|im_start|>", ANY, "")]}},
     "is text with a special token in it"),
    ({"format": _tag("<a>", ANY, "</a><file_sep>")}, "mixes text and a special token"),
    ({"format": {"type": "or", "elements": [ANY] * 1025}}, "at most 1024 items"),
    ({"format": ANY, "triggers": []}, r"with 'format' has no other keys, got \['triggers'\]"),
    # a tag inside another format is checked as any format is (it raised KeyError before)
    ({"format": {**CALLS, "tags": [{"begin": "<function=f>", "end": "</function>"}]}},
     r"format.tags\[0\]: a tag format has no \['content'\]"),
    ({"format": {**CALLS, "tags": [{**WEATHER, "args": 1}]}}, r"format.tags\[0\]: a tag format has unknown keys"),
    ({"format": {"type": "sequence", "elements": [ANY, {"type": "tag", "begin": "<a>", "end": "</a>"}]}},
     r"format.elements\[1\]: a tag format has no \['content'\]"),
    ({"format": {"type": "sequence", "elements": [ANY, {"type": "const_string", "value": "x", "v": 1}]}},
     r"format.elements\[1\]: a const_string format has unknown keys"),
    ({"format": {"type": "token_triggered_tags", "trigger_tokens": [START], "tags": [{"content": ANY, "end": "x"}]}},
     r"format.tags\[0\]: a tag format has no \['begin'\]"),
    ({"type": "json", "format": ANY}, "'type' must be \"structural_tag\""),
])
def test_a_format_that_does_not_compile_names_the_place(guides, guide, message):
    with pytest.raises(GuideError, match=message):
        guides.compile("structural_tag", json.dumps(guide))


def test_formats_nested_past_the_depth_bound_are_refused(guides):
    fmt = ANY
    for _ in range(40):
        fmt = {"type": "optional", "content": fmt}
    with pytest.raises(GuideError, match="nested at most 32 deep"):
        guides.compile("structural_tag", json.dumps({"format": fmt}))


@pytest.mark.parametrize("fmt,output,draft", [
    (CALLS, "Let me see. ", '<function=get_weather>{"city": "Par'),  # a draft crossing the trigger
    (_tag("<think>", ANY, "</think>"), "<think>so", " it is</think>"),  # a draft crossing the lazy end
    ({"type": "json_schema", "json_schema": CITY, "style": "qwen_xml"}, "<parameter=city>\nPa", "ris\n</parameter>\n"),
    ({"type": "token_triggered_tags", "trigger_tokens": [START], "tags": [
        _tag({"type": "token", "token": START}, NUMBER, {"type": "token", "token": FILE_SEP})]},
     ["hi "], [START, "12", FILE_SEP, " ok"])])
def test_a_verify_rounds_masks_follow_the_drafts_and_the_matcher_rolls_back(guides, tokenizer, fmt, output, draft):
    """Speculation's use of a format's grammar: the mask at each verify position follows the output and the
    drafts before it (against a fresh matcher that consumed them), and the request's matcher stays where it was."""
    import llguidance
    import numpy as np
    from specdec.decoding.token_mask import unpack_allowed

    grammar = guides.compile("structural_tag", json.dumps({"format": fmt}))
    output, draft = _ids(tokenizer, output), _ids(tokenizer, draft)
    matcher = grammar.matcher()
    assert matcher.advance(output) is None
    allowed = unpack_allowed(matcher.allowed(draft, len(draft) + 1), 49152)
    for j in range(len(draft) + 1):
        fresh = llguidance.LLMatcher(guides.tokenizer, grammar.definition, log_level=0)
        assert fresh.consume_tokens(output + draft[:j])
        bits = np.unpackbits(np.frombuffer(fresh.compute_bitmask(), dtype=np.uint8), bitorder="little")
        assert set(allowed[j].nonzero().flatten().tolist()) == set(np.flatnonzero(bits[:49152]).tolist())
        assert allowed[j, draft[j]] if j < len(draft) else True
    assert matcher.valid_prefix(draft) == len(draft)  # rolled back: the draft is still ahead of it


def test_the_structural_tag_bench_prints_every_parser_and_format(capsys):
    """`python -m bench.structural_tag_bench` (its page: docs/results/2026-12-05-cpu-structural-tags.md), small."""
    from bench import structural_tag_bench

    assert structural_tag_bench.main(["--tools", "2", "--repeats", "1"]) == 0
    table = capsys.readouterr().out
    for name in [*structural_tag_bench.PARSERS, *structural_tag_bench.FORMATS]:
        row = next(line for line in table.splitlines() if f" {name} " in line)
        assert float(row.split("|")[-2]) > 0, row  # the mask's µs per position


def test_any_malformed_tree_is_refused_by_name_never_a_crash():
    """Seeded random format trees (every type, keys left out or of the wrong kind, tags missing theirs): the
    builder refuses each bad one with its named error; nothing else escapes (a KeyError did, before)."""
    import random

    from specdec.decoding.structural_tags import _KEYS, StructuralTagError, structural_tag_grammar

    rng = random.Random(0)
    values = [None, True, 0, -1, 3, 1.5, "", "x", "<|im_start|>", "a<file_sep>", [], {}, ["a"], [1], [[]]]
    # keys whose plausible values get a tree further (a begin its trigger opens, a trigger token)
    pools = {"begin": ["<a>", {"type": "token", "token": START}, 3], "end": ["</a>", {"type": "token", "token": 5}],
             "triggers": [["<a"], []], "trigger_tokens": [[START]], "value": ["x", 1]}

    def node(depth: int, kind: str | None = None) -> dict:
        kind = kind or rng.choice([*_KEYS, "tag", "nope"])
        out = {"type": kind}
        for key in (*_KEYS.get(kind, ()), "extra"):
            if rng.random() < (0.8 if key != "extra" else 0.05):
                roll = rng.random()
                out[key] = ([node(depth + 1, "tag") for _ in range(2)] if key == "tags" and roll < 0.7 else
                            node(depth + 1) if depth < 4 and roll < 0.3 else
                            [node(depth + 1) for _ in range(rng.randint(0, 2))] if depth < 4 and roll < 0.5 else
                            [[rng.choice(values), node(depth + 1)]] if depth < 4 and roll < 0.55 else
                            rng.choice(pools.get(key, values)))
        return out
    refused = 0
    for _ in range(3000):
        try:
            structural_tag_grammar(json.dumps({"format": node(0)}), {"<|im_start|>": START, "<file_sep>": FILE_SEP},
                                   frozenset([EOS]), 49152)
        except StructuralTagError:
            refused += 1
    assert refused > 2500  # (most random trees are malformed: the test reaches the refusals)
