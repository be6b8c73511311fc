"""Tool calls in the OpenAI API: pure functions, no network.

The chat template renders the request's tools into the prompt (the server's `tools` input); what comes back
is text, which becomes `tool_calls` here in one of three ways, by `tool_choice`:

- a named function: the output is constrained (structured output) to a JSON object of the function's
  parameters schema, which is the call's `arguments`; any model calls it, and the call streams as it comes;
- "required": constrained to a JSON list of one or more {"name", "arguments"} objects of the tools'
  schemas (at most one with `parallel_tool_calls: false`); the calls go out when the output ends;
- "auto": the model chooses, in its own format, which a parser reads (`--tool-call-parser`): `hermes`
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks: Qwen2.5, Hermes, SmolLM3) or
  `llama3_json` (Llama 3.1-3.3's `{"name": ..., "parameters": {...}}`, calls separated by `;`) or `pythonic`
  (Llama 3.2 and 4's `[get_weather(city="Oslo"), get_time()]`: a Python list of calls whose arguments are
  keywords of literal values, read with `ast`, never run) or `mistral` (Mistral's special token
  `[TOOL_CALLS]` before a JSON list of {"name", "arguments"} (Mistral 7B v0.3, Mixtral, Nemo), or before each
  call as `name[ARGS]{...}` (tokenizers v11 and later: Mistral Small 3.2, Magistral, Devstral); the server is
  asked to keep special tokens in the text for it, and calls get Mistral's 9-character ids, to which the ids
  of calls sent back are shortened too: its chat templates refuse any other) or `qwen3_coder` (Qwen3-Coder's
  `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`, each value raw
  text turned into the type the tool's schema gives that parameter; vLLM's `qwen3_xml` is the same) or `openai`
  (gpt-oss's harmony messages to `functions.NAME`, as the reasoning parser `openai_gptoss` passes them on,
  which it implies; special tokens kept, as for mistral) or `deepseek_v3` / `deepseek_v31` (DeepSeek's calls
  between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`, V3's fenced JSON or V3.1's bare JSON, either name
  reading both) or `kimi_k2` (`<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}`, the
  model's id kept: its template renders it back) or `glm45` / `glm47` (GLM-4.5's `<tool_call>NAME` and
  `<arg_key>`/`<arg_value>` pairs, typed as qwen3_coder's or read as JSON) or `minimax_m2` (MiniMax-M2's
  `<minimax:tool_call>` section of `<invoke name="NAME">` calls of `<parameter name="KEY">` values, typed as
  GLM's) or `deepseek_v32` (DeepSeek-V3.2's DSML: `<｜DSML｜invoke name="NAME">` calls of
  `<｜DSML｜parameter name="KEY" string="true|false">` values, raw text or JSON); these six keep special tokens. Text
  before the first call is the message's content and streams as content; text that does not parse as a call
  stays content. With a `strict` tool, structural tags hold each call the model opens to the request's
  tools, in the parser's format (strict_call_tags): JSON after an opening (hermes, llama3_json, mistral,
  deepseek_v3/v31, kimi_k2), XML parameters (qwen3_coder, glm45/47, minimax_m2, deepseek_v32), or a Python list
  of calls (pythonic).
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field

from specdec import tensor_names as tn
from specdec.decoding import json_text
from specdec.gateway import harmony

PARSERS = ("deepseek_v3", "deepseek_v31", "deepseek_v32", "glm45", "glm47", "hermes", "kimi_k2", "llama3_json",
           "minimax_m2", "mistral", "openai", "pythonic", "qwen3_coder", "qwen3_xml")
HARMONY_PARSER = "openai"  # gpt-oss's calls, from what the reasoning parser openai_gptoss passes on (harmony.py)
HARMONY_REASONING = tn.HARMONY_REASONING  # that reasoning parser (reasoning.HARMONY)
_QWEN3_CODER = ("qwen3_coder", "qwen3_xml")  # one format, vLLM's two names for it
_DEEPSEEK = ("deepseek_v3", "deepseek_v31")  # V3's calls and V3.1's, each read in either form
_GLM = ("glm45", "glm47")  # GLM-4.5's calls and 4.7's (the same, fewer newlines)
# Parsers whose calls open with special tokens: the server is asked to keep those in the text (vLLM does too)
SPECIAL_TOKEN_PARSERS = ("mistral", *_DEEPSEEK, "deepseek_v32", "kimi_k2", *_GLM, "minimax_m2")
NAMED, REQUIRED, AUTO = "named", "required", "auto"
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's around pythonic calls
# Mistral's special tokens, kept in the text for this parser (skip_special_tokens false)
_MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
# Where a call opens anywhere in the answer (after content), by parser; the others' calls are the whole answer
# DeepSeek's (V3, R1-0528, V3.1), Kimi K2's (its ids "functions.NAME:INDEX", which its template renders back) and
# GLM-4.5's markers
_DEEPSEEK_CALLS, _DEEPSEEK_CALL = "<｜tool▁calls▁begin｜>", re.compile(
    r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)(?:<｜tool▁call▁end｜>|<｜tool▁calls▁end｜>|$)", re.DOTALL)
_DEEPSEEK_FENCED = re.compile(r"\s*([^\n`]*?)\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)  # V3's name, args
_KIMI_CALLS, _KIMI_CALL = "<|tool_calls_section_begin|>", re.compile(
    r"<\|tool_call_begin\|>\s*([^<]*?)\s*<\|tool_call_argument_begin\|>(.*?)(?:<\|tool_call_end\|>|"
    r"<\|tool_calls_section_end\|>|$)", re.DOTALL)
_GLM_CALL = re.compile(r"([^<]*?)\s*((?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*)", re.DOTALL)
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
# MiniMax-M2's (M2.1, M2.5): a section of <invoke name="NAME"> calls, each of <parameter name="KEY"> values
_MINIMAX_OPEN = "<minimax:tool_call>"
_MINIMAX_SECTION = re.compile(r"<minimax:tool_call>(.*?)(?:</minimax:tool_call>|$)", re.DOTALL)
_MINIMAX_INVOKE = re.compile(r"<invoke name=([^>\n]*)>(.*?)</invoke>", re.DOTALL)  # a call cut short is none
_MINIMAX_PARAMETER = re.compile(r"<parameter name=([^>\n]*)>(.*?)</parameter>", re.DOTALL)
# DeepSeek-V3.2's DSML: a section of <｜DSML｜invoke name="NAME"> calls, each of <｜DSML｜parameter name="KEY"
# string="true|false"> values (a string's raw text, or JSON) or one JSON object
_DSML_OPEN = "<｜DSML｜function_calls>"
_DSML_SECTION = re.compile(r"<｜DSML｜function_calls>(.*?)(?:</｜DSML｜function_calls>|$)", re.DOTALL)
_DSML_INVOKE = re.compile(r'<｜DSML｜invoke\s+name="([^"\n]*)"\s*>(.*?)</｜DSML｜invoke>', re.DOTALL)
_DSML_PARAMETER = re.compile(r'<｜DSML｜parameter\s+name="([^"\n]*)"\s+string="(true|false)"\s*>(.*?)'
                             r"</｜DSML｜parameter>", re.DOTALL)
_OPENINGS = {"minimax_m2": _MINIMAX_OPEN, "deepseek_v32": _DSML_OPEN, "hermes": _HERMES_OPEN, "mistral": _MISTRAL_CALLS,
             "qwen3_coder": _HERMES_OPEN, "qwen3_xml": _HERMES_OPEN, HARMONY_PARSER: harmony.START,
             "deepseek_v3": _DEEPSEEK_CALLS, "deepseek_v31": _DEEPSEEK_CALLS, "kimi_k2": _KIMI_CALLS,
             "glm45": _HERMES_OPEN, "glm47": _HERMES_OPEN}
_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>\s*", re.DOTALL)  # a call cut short is none
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a function's name: a request's tools', a parsed call's
_ALNUM = string.ascii_letters + string.digits
MISTRAL_ID_LENGTH = 9  # Mistral's chat templates refuse a tool call id of other length or characters


# A call in a parser's format as structural tags (the guide type): its trigger, and for each way the model may
# write a call, the text before the function's name, between the name and the arguments, and after them; the
# JSON written with the separators the models' templates write (json.dumps' and Jinja's tojson: ", " and ": ").
# Special tokens among them are matched as the tokens where the tokenizer has them (grammar.py).
_DEEPSEEK_BEGIN, _DEEPSEEK_SEP, _DEEPSEEK_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_CALL_TAGS = {
    "hermes": (_HERMES_OPEN, ((_HERMES_OPEN + '\n{"name": "', '", "arguments": ', "}\n" + _HERMES_CLOSE),)),
    "llama3_json": ('{"name": "', (('{"name": "', '", "parameters": ', "}"),)),
    # Mistral's tokenizers v11 on: [TOOL_CALLS]NAME[ARGS]{...}; its older JSON list after [TOOL_CALLS] is a
    # structure of its own (strict_call_tags)
    "mistral": (_MISTRAL_CALLS, ((_MISTRAL_CALLS, _MISTRAL_ARGS, ""),)),
    # DeepSeek V3.1's bare JSON and V3's fenced (either parser reads both), inside the calls section the model
    # opens and closes itself
    **{name: (_DEEPSEEK_BEGIN, ((_DEEPSEEK_BEGIN, _DEEPSEEK_SEP, _DEEPSEEK_END),
                                (_DEEPSEEK_BEGIN + "function" + _DEEPSEEK_SEP, "\n```json\n", "\n```" + _DEEPSEEK_END)))
       for name in _DEEPSEEK}}
# Qwen3-Coder's calls (<function=NAME> and its <parameter=KEY> lines), GLM-4.5's and 4.7's (NAME then
# <arg_key>/<arg_value> pairs), MiniMax-M2's and DeepSeek-V3.2's (<invoke name="NAME"> calls inside the section
# the model opens)
# as xgrammar's structural tags: trigger, (begin, end) of a call, the XML style of its arguments
_XML_CALLS = {**{name: (_HERMES_OPEN, (_HERMES_OPEN + "\n<function={name}>\n", "</function>\n" + _HERMES_CLOSE),
                        "qwen_xml") for name in _QWEN3_CODER},
              "minimax_m2": ("<invoke name=", ('<invoke name="{name}">\n', "</invoke>\n"), "minimax_xml"),
              "deepseek_v32": ("<｜DSML｜invoke name=", ('<｜DSML｜invoke name="{name}">\n', "</｜DSML｜invoke>\n"),
                               "deepseek_xml"),
              **{name: (_HERMES_OPEN, (_HERMES_OPEN + "{name}", _HERMES_CLOSE), "glm_xml") for name in _GLM}}
_KIMI_BEGIN, _KIMI_ARGUMENTS, _KIMI_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_TEMPLATE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCalling:
    """How a request's output becomes tool calls: `mode` NAMED (`names[0]`), REQUIRED (any of `names`) or
    AUTO (read by `parser`, one of PARSERS)."""

    mode: str
    names: tuple[str, ...]
    parser: str | None = None
    parallel: bool = True  # parallel_tool_calls: more than one call per answer
    # each tool's parameters schema (a JSON schema object), for parsers whose values are text (qwen3_coder)
    schemas: dict = field(default_factory=dict, compare=False)

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish reason of an answer that called, from the server's (`reason`): a named function's
        answer keeps it ("stop", or "length" for arguments cut short); a complete answer that called is
        "tool_calls"."""
        return reason if self.mode == NAMED or reason != "stop" else "tool_calls"


def reasoning_for(tool_parser: str | None, reasoning_parser: str | None) -> str | None:
    """The reasoning parser the API runs with: the `openai` tool-call parser reads what `openai_gptoss` passes on,
    so it implies that one (vLLM reads gpt-oss's channels whatever is named); ValueError for another beside it."""
    if tool_parser != HARMONY_PARSER:
        return reasoning_parser
    if reasoning_parser not in (None, HARMONY_REASONING):
        raise ValueError(f"--tool-call-parser {HARMONY_PARSER} reads gpt-oss's harmony channels: --reasoning-parser "
                         f"must be {HARMONY_REASONING} (or none), got {reasoning_parser}")
    return HARMONY_REASONING


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(MISTRAL_ID_LENGTH))


def mistral_id(given: str) -> str:
    """A call's id as Mistral's templates take it (9 letters or digits): its last 9 such characters (vLLM's
    way with ids sent back), or a digest of it where it has fewer; the same id always maps to the same one,
    so an assistant's call and the tool result answering it still match."""
    alnum = "".join(ch for ch in given if ch.isascii() and ch.isalnum())
    if len(alnum) >= MISTRAL_ID_LENGTH:
        return alnum[-MISTRAL_ID_LENGTH:]
    return hashlib.sha256(given.encode()).hexdigest()[:MISTRAL_ID_LENGTH]


def mistral_messages(messages: list[dict]) -> list[dict]:
    """A chat whose tool call ids (assistants' calls, tool results) are Mistral's 9-character form."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [{**call, "id": mistral_id(call["id"])} if isinstance(call.get("id"), str) else call
                     for call in message["tool_calls"]]
            message = {**message, "tool_calls": calls}
        if isinstance(message.get("tool_call_id"), str):
            message = {**message, "tool_call_id": mistral_id(message["tool_call_id"])}
        out.append(message)
    return out


def forced_schema(tools: list[dict], calling: ToolCalling) -> dict:
    """The JSON schema a NAMED or REQUIRED answer is constrained to (structured output)."""
    parameters = {tool["function"]["name"]: tool["function"].get("parameters") or {"type": "object"} for tool in tools}
    if calling.mode == NAMED:
        return parameters[calling.names[0]]
    schema = _calls_list_schema({name: parameters[name] for name in calling.names})
    if not calling.parallel:
        schema["maxItems"] = 1
    return schema


def _calls_list_schema(arguments: dict[str, dict]) -> dict:
    """A JSON list of one or more {"name", "arguments"} calls, each function's arguments to its schema
    (`arguments`: name -> schema)."""
    items = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
              "required": ["name", "arguments"], "additionalProperties": False} for name, schema in arguments.items()]
    return {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}


def strict_call_tags(tools: list[dict], parser: str) -> dict | None:
    """With tool_choice auto: where a tool says `strict: true` and the parser's format is one of _CALL_TAGS or
    _XML_CALLS, Kimi K2's or pythonic, the structural tags that hold every call the model opens to a tool of the
    request, a strict tool's arguments to its parameters schema (another's to any object); the text around
    the calls stays free (pythonic: an answer is a list of calls or text). None otherwise (the openai parser:
    the calls are read as the model writes them)."""
    if parser not in (*_CALL_TAGS, *_XML_CALLS, "kimi_k2", "pythonic") or not any(
            tool["function"].get("strict") is True for tool in tools):
        return None
    arguments = {tool["function"]["name"]: (tool["function"].get("parameters") or {"type": "object"})
                 if tool["function"].get("strict") is True else {"type": "object"} for tool in tools}
    if parser in _XML_CALLS:  # xgrammar's form: the arguments as the model's XML parameters
        trigger, (before, after), style = _XML_CALLS[parser]
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [trigger], "tags": [
            {"type": "tag", "begin": before.format(name=name), "end": after,
             "content": {"type": "json_schema", "json_schema": _as_written(schema), "style": style}}
            for name, schema in arguments.items()]}}
    if parser == "pythonic":  # an answer that opens with "[" is a list of calls (its parser reads none else)
        calls = {"type": "grammar", "grammar": _python_calls_grammar(arguments)}
        return {"type": "structural_tag", "format": {"type": "or", "elements": [
            calls, {"type": "sequence", "elements": [{"type": "const_string", "value": _PYTHON_START}, calls, {
                "type": "optional", "content": {"type": "const_string", "value": _PYTHON_END}}]},
            {"type": "const_string", "value": ""}, {"type": "regex", "pattern": "[^\\[\\s](.|\\n)*"}]}}
    if parser == "kimi_k2":  # functions.NAME:INDEX, the index the model counts
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [_KIMI_BEGIN], "tags": [
            {"type": "tag", "begin": f"{_KIMI_BEGIN}functions.{name}:", "end": _KIMI_END, "content": {
                "type": "sequence", "elements": [
                    {"type": "regex", "pattern": "[0-9]+"}, {"type": "const_string", "value": _KIMI_ARGUMENTS},
                    {"type": "json_schema", "json_schema": _as_written(schema)}]}}
            for name, schema in arguments.items()]}}
    trigger, forms = _CALL_TAGS[parser]
    structures = [{"begin": before + name + between, "end": after, "schema": _as_written(schema)}
                  for name, schema in arguments.items() for before, between, after in forms]
    if parser == "mistral":  # Mistral 7B v0.3's: [TOOL_CALLS] then a JSON list of {"name", "arguments"}
        listed = _as_written(_calls_list_schema(arguments))
        structures += [{"begin": _MISTRAL_CALLS + space, "end": "", "schema": listed} for space in ("", " ")]
    return {"structures": structures, "triggers": [trigger]}


# Python's literals, as the pythonic parser reads them (ast.literal_eval): a value of no schema'd type is any
_PYTHON_LITERALS = r"""
py: STR | NUM | "True" | "False" | "None" | "[" (py (SEP py)*)? "]" | "{" (STR ": " py (SEP STR ": " py)*)? "}"
STR: /"([^"\\\n]|\\.)*"/ | /'([^'\\\n]|\\.)*'/
INT: /-?[0-9]+/
NUM: /-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?/
SEP: /, ?/
"""
_PYTHON_TYPES = {"string": "STR", "integer": "INT", "number": "NUM", "boolean": '("True" | "False")', "null": '"None"'}


def _python_calls_grammar(arguments: dict[str, dict]) -> str:
    """A Lark grammar of a Python list of calls `[NAME(KEY=VALUE, ...), ...]` to the functions of `arguments`
    (name -> parameters schema) whose names are Python identifiers: each function's keywords in its schema's
    order, the required ones present, the others optional (no other keyword where it lists properties), each
    value a Python literal of its type (a string one of its enum where it has one)."""
    rules, calls = [], []
    for i, (name, schema) in enumerate(arguments.items()):
        if not name.isidentifier():
            continue  # (a name that is no identifier cannot be called in this form)
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = set(schema.get("required") or [])
        items = []
        for key, sub in properties.items():
            value = _python_value(sub if isinstance(sub, dict) else {})
            items.append((f"{json.dumps(key + '=')} {value}", key in required))
        if not properties:  # any keywords, any literals
            rules.append(f'f{i}_first0: (/[A-Za-z_][A-Za-z0-9_]*/ "=" py (SEP /[A-Za-z_][A-Za-z0-9_]*/ "=" py)*)?')
        else:  # the keywords, commas only between those written: first_k (none written yet), then_k (some were)
            end = len(items)
            rules += [f"f{i}_first{end}: ", f"f{i}_then{end}: "]
            for k in range(end - 1, -1, -1):
                item, needed = items[k]
                rules.append(f"f{i}_first{k}: {item} f{i}_then{k + 1}" + ("" if needed else f" | f{i}_first{k + 1}"))
                rules.append(f"f{i}_then{k}: SEP {item} f{i}_then{k + 1}" + ("" if needed else f" | f{i}_then{k + 1}"))
        rules.append(f'f{i}: {json.dumps(name + "(")} f{i}_first0 ")"')
        calls.append(f"f{i}")
    if not calls:
        return 'start: "[" "]"'  # (refused by its parser: no function can be called)
    return "\n".join(['start: "[" call (SEP call)* "]"', f"call: {' | '.join(calls)}", *rules]) + _PYTHON_LITERALS


def _python_value(schema: dict) -> str:
    """A keyword's value as Lark: a string's enum as Python literals, a type's literal, or any literal."""
    if isinstance(schema.get("enum"), list) and schema["enum"] and all(isinstance(v, str) for v in schema["enum"]):
        return "(" + " | ".join(f"{json.dumps(json.dumps(v))} | {json.dumps(repr(v))}" for v in schema["enum"]) + ")"
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    if kinds and all(kind in _PYTHON_TYPES for kind in kinds):
        return "(" + " | ".join(_PYTHON_TYPES[kind] for kind in kinds) + ")"
    return "py"


def _as_written(schema: dict) -> dict:
    """`schema`, its JSON written as the models' templates write it (_TEMPLATE_JSON)."""
    return {**schema, "x-guidance": {**schema.get("x-guidance", {}), **_TEMPLATE_JSON}}


def split_output(text: str, calling: ToolCalling) -> tuple[str | None, list[dict]]:
    """(content, calls) of a whole answer: each call {"name", "arguments": a JSON string}."""
    if calling.mode == NAMED:
        return None, [{"name": calling.names[0], "arguments": text}]
    if calling.mode == REQUIRED:
        try:
            calls = json_text.parse(text)
        except ValueError:  # cut by max_tokens: the text is all there is
            return text, []
        return None, [{"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}
                      for call in calls]
    if calling.parser in _QWEN3_CODER:
        content, calls = _qwen3_coder(text, calling.schemas)
    elif calling.parser in _GLM:
        content, calls = _glm(text, calling.schemas)
    elif calling.parser in _DEEPSEEK:
        content, calls = _deepseek(text)
    elif calling.parser == "kimi_k2":
        content, calls = _kimi(text)
    elif calling.parser == "minimax_m2":
        content, calls = _minimax(text, calling.schemas)
    elif calling.parser == "deepseek_v32":
        content, calls = _dsml(text)
    elif calling.parser == HARMONY_PARSER:
        content, calls = harmony.calls(text)
        calls = [call for call in calls if FUNCTION_NAME.fullmatch(call["name"])]
    else:
        content, calls = {"hermes": _hermes, "pythonic": _pythonic, "mistral": _mistral}.get(calling.parser,
                                                                                             _llama3_json)(text)
    if calling.parser == "mistral":  # the model's own id ([CALL_ID]) or one of Mistral's form
        calls = [{**call, "id": call.get("id") or mistral_call_id()} for call in calls]
    return content, calls if calling.parallel else calls[:1]


def _hermes(text: str) -> tuple[str | None, list[dict]]:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in _HERMES.findall(text[start:]):
        call = _call(block, "arguments")
        if call is None:
            return text, []  # a block that is no call: the answer stays text
        calls.append(call)
    return text[:start].strip() or None, calls


def _llama3_json(text: str) -> tuple[str | None, list[dict]]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    at = 0
    while at < len(body):
        try:
            value, end = json_text.parse_at(body, at)
        except ValueError:
            return text, []
        call = _call(value, "parameters", "arguments")
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\n;":
            at += 1
    return None, calls


def _mistral(text: str) -> tuple[str | None, list[dict]]:
    start = text.find(_MISTRAL_CALLS)
    if start < 0:
        return text, []
    calls = []
    for part in text[start + len(_MISTRAL_CALLS):].split(_MISTRAL_CALLS):
        part = part.strip()
        if part.startswith("["):  # a JSON list of {"name", "arguments"} (Mistral 7B v0.3's format)
            try:
                listed = json_text.parse(part)
            except ValueError:
                return text, []
            found = [_call(item, "arguments", "parameters") for item in listed] if isinstance(listed, list) else []
            if not found or None in found:
                return text, []
            calls += found
            continue
        head, sep, arguments = part.partition(_MISTRAL_ARGS)  # name[ARGS]{...}, or name[CALL_ID]id[ARGS]{...}
        name, _, given = head.partition(_MISTRAL_CALL_ID)
        if not sep or not FUNCTION_NAME.fullmatch(name.strip()):
            return text, []
        try:
            value = json_text.parse(arguments.strip())
        except ValueError:
            return text, []
        if not isinstance(value, dict):
            return text, []
        call = {"name": name.strip(), "arguments": json.dumps(value, ensure_ascii=False)}
        calls.append({**call, "id": given.strip()} if given.strip() else call)
    return text[:start].strip() or None, calls


def _qwen3_coder(text: str, schemas: dict) -> tuple[str | None, list[dict]]:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in _HERMES.findall(text[start:]):
        found = _FUNCTION.fullmatch(block)
        name = found.group(1).strip() if found else ""
        if not FUNCTION_NAME.fullmatch(name):
            return text, []  # a block that is no call: the answer stays text
        properties = (schemas.get(name) or {}).get("properties") or {}
        arguments = {}
        for key, value in _PARAMETER.findall(found.group(2)):
            key = key.strip()
            arguments[key] = _typed_value(value.removeprefix("\n").removesuffix("\n"), properties.get(key))
        calls.append({"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)})
    return text[:start].strip() or None, calls


def _deepseek(text: str) -> tuple[str | None, list[dict]]:
    """V3's `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then its arguments fenced as ```json, or V3.1's
    `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS`, each closed by `<｜tool▁call▁end｜>`."""
    start = text.find(_DEEPSEEK_CALLS)
    if start < 0:
        return text, []
    calls = []
    for head, body in _DEEPSEEK_CALL.findall(text[start:]):
        fenced = _DEEPSEEK_FENCED.fullmatch(body)
        name, arguments = (fenced.group(1), fenced.group(2)) if fenced else (head, body)
        call = _named_call(name.strip(), arguments)
        if call is None:
            return text, []
        calls.append(call)
    return (text[:start].strip() or None, calls) if calls else (text, [])


def _kimi(text: str) -> tuple[str | None, list[dict]]:
    """`<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>` in a
    section; the model's id is the call's."""
    start = text.find(_KIMI_CALLS)
    if start < 0:
        return text, []
    calls = []
    for given, arguments in _KIMI_CALL.findall(text[start:]):
        call = _named_call(given.rpartition(":")[0].removeprefix("functions.") if ":" in given else given, arguments)
        if call is None:
            return text, []
        calls.append({**call, "id": given})
    return (text[:start].strip() or None, calls) if calls else (text, [])


def _glm(text: str, schemas: dict) -> tuple[str | None, list[dict]]:
    """`<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>` (newlines between them
    or not): a value is text, turned into the type the tool's schema gives it, or read as JSON where it gives
    none (as GLM's chat template writes values that are no strings)."""
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls, blocks = [], _HERMES.findall(text[start:])
    if text[start:].count(_HERMES_CLOSE) < len(blocks):
        return text, []  # a call cut short: the answer stays text
    for block in blocks:
        found = _GLM_CALL.fullmatch(block)
        name, pairs = (found.group(1).strip(), found.group(2)) if found else ("", "")
        if not FUNCTION_NAME.fullmatch(name):
            return text, []  # a block that is no call: the answer stays text
        properties = (schemas.get(name) or {}).get("properties") or {}
        arguments = {}
        for key, value in _GLM_ARGUMENT.findall(pairs):
            arguments[key.strip()] = _schema_value(value.strip(), properties.get(key.strip()))
        calls.append({"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)})
    return text[:start].strip() or None, calls


def _minimax(text: str, schemas: dict) -> tuple[str | None, list[dict]]:
    """`<minimax:tool_call>` then `<invoke name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke>`
    calls (names quoted or not): a value is its text less one newline at each end, turned into the type the
    tool's schema gives it, or read as JSON where it gives none (else the text)."""
    def read(quoted: str, body: str) -> dict | None:
        name = quoted.strip().strip("\"'")
        properties = (schemas.get(name) or {}).get("properties") or {}
        arguments = {}
        for key, value in _MINIMAX_PARAMETER.findall(body):
            key, value = key.strip().strip("\"'"), value.removeprefix("\n").removesuffix("\n")
            arguments[key] = _schema_value(value, properties.get(key))
        return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    return _sectioned(text, _MINIMAX_OPEN, _MINIMAX_SECTION, _MINIMAX_INVOKE, read)


def _dsml(text: str) -> tuple[str | None, list[dict]]:
    """DeepSeek-V3.2's `<｜DSML｜function_calls>` section of `<｜DSML｜invoke name="NAME">` calls: each one JSON
    object, or `<｜DSML｜parameter name="KEY" string="true|false">` values (a string's raw text; JSON, or the text
    where it reads as none)."""
    def read(name: str, body: str) -> dict | None:
        if body.strip().startswith("{"):
            return _named_call(name.strip(), body)
        arguments = {key: value if string == "true" else _schema_value(value, None)
                     for key, string, value in _DSML_PARAMETER.findall(body)}
        return {"name": name.strip(), "arguments": json.dumps(arguments, ensure_ascii=False)}
    return _sectioned(text, _DSML_OPEN, _DSML_SECTION, _DSML_INVOKE, read)


def _sectioned(text: str, opening: str, section: re.Pattern, invoke: re.Pattern, read) -> tuple[str | None, list]:
    """Calls inside the sections a model opens with `opening`: each `invoke` match (name, body) read as a call
    (`read`: None for no call); a name that is no function's, or a body that reads as none, leaves the whole
    answer text; content is the text before the first section."""
    start = text.find(opening)
    if start < 0:
        return text, []
    calls = []
    for inside in section.findall(text[start:]):
        for name, body in invoke.findall(inside):
            call = read(name, body)
            if call is None or not FUNCTION_NAME.fullmatch(call["name"]):
                return text, []  # a block that is no call: the answer stays text
            calls.append(call)
    return (text[:start].strip() or None, calls) if calls else (text, [])


def _schema_value(text: str, schema) -> object:
    """A value written as text: the type its schema names (_typed_value), else JSON where it reads as JSON,
    else the text (as GLM's and MiniMax's templates write values that are no strings as JSON)."""
    if isinstance(schema, dict) and schema.get("type"):
        return _typed_value(text, schema)
    try:
        return json_text.parse(text.strip())
    except ValueError:
        return text


def _named_call(name: str, arguments: str) -> dict | None:
    """A call of a name and its arguments' text (a JSON object), or None."""
    if not FUNCTION_NAME.fullmatch(name):
        return None
    try:
        value = json_text.parse(arguments.strip()) if arguments.strip() else {}
    except ValueError:
        return None
    return {"name": name, "arguments": json.dumps(value, ensure_ascii=False)} if isinstance(value, dict) else None


def _typed_value(text: str, schema) -> object:
    """A parameter's raw text as the type its schema names (a string where it names none, or the text does
    not read as that type): Qwen3-Coder writes every value as plain text."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else [k for k in kinds or [] if isinstance(k, str)]
    if text.strip() == "null" and "string" not in kinds:  # (a string's "null" is that word)
        return None
    for kind in [k for k in kinds if k != "string"] + (["string"] if "string" in kinds else []):
        if kind == "string":
            return text
        if kind == "integer":
            try:
                return int(text.strip())
            except ValueError:
                continue
        elif kind == "number":
            try:
                number = float(text.strip())
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
        elif kind == "boolean" and text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
        elif kind in ("object", "array"):
            try:
                value = json_text.parse(text.strip())
            except ValueError:
                continue
            if isinstance(value, dict if kind == "object" else list):
                return value
    return text


def _pythonic(text: str) -> tuple[str | None, list[dict]]:
    body = text.strip()
    if body.startswith(_PYTHON_START):
        body = body[len(_PYTHON_START):].removesuffix(_PYTHON_END).strip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and all(keyword.arg for keyword in node.keywords)):  # f(a=1), not f(1) or f(**kw)
                return text, []
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
            calls.append({"name": node.func.id, "arguments": json.dumps(arguments, ensure_ascii=False)})
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # no call (or not JSON's values)
        return text, []
    return None, calls


def _call(value, *keys: str) -> dict | None:
    """{"name", "arguments": JSON string} from a parsed (or JSON text) call object, or None."""
    if isinstance(value, str):
        try:
            value = json_text.parse(value)
        except ValueError:
            return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in keys if key in value), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        return {"name": value["name"], "arguments": arguments}
    return {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}


def call_deltas(calls: list[dict], first_index: int = 0) -> list[dict]:
    """Whole calls as a streamed chunk's `tool_calls` entries (index, id, type, function); a call's own id
    where the parser gave it one."""
    return [{"index": first_index + i, "id": call.get("id") or call_id(), "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}} for i, call in enumerate(calls)]


def message_calls(calls: list[dict]) -> list[dict]:
    """Calls as a message's `tool_calls`."""
    return [{"id": call.get("id") or call_id(), "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}} for call in calls]


@dataclass
class ToolStream:
    """One streamed choice's text turned into content and tool-call deltas as it comes: `feed` each text
    delta, `finish` at the end. NAMED streams the arguments as they are generated; REQUIRED sends its calls
    at the end; AUTO streams content until the parser's opening (text that may begin one is held back),
    then sends the calls at the end."""

    calling: ToolCalling
    text: str = ""  # everything fed
    sent: int = 0  # characters of it sent as content (AUTO) or arguments (NAMED)
    held: bool = False  # AUTO: a call began; nothing more goes out as content
    opened: bool = False  # NAMED: the call's first delta (its id and name) went out
    id: str = field(default_factory=call_id)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(content to send now, tool-call deltas to send now)."""
        self.text += delta
        if self.calling.mode == NAMED:
            return "", self._arguments()
        if self.calling.mode == REQUIRED or self.held:
            return "", []
        cut = self._content_end()
        out, self.sent = self.text[self.sent:cut], max(self.sent, cut)
        return out, []

    def finish(self) -> tuple[str, list[dict], bool]:
        """(content still to send, tool-call deltas still to send, whether the answer called a tool)."""
        if self.calling.mode == NAMED:
            return "", self._arguments(final=True), True
        _, calls = split_output(self.text, self.calling)
        if not calls:  # all of it is content
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, [], False
        opening = self.text.find(_OPENINGS[self.calling.parser]) if self.calling.parser in _OPENINGS else -1
        rest = self.text[self.sent:opening] if opening > self.sent else ""
        return rest, call_deltas(calls), True

    def _arguments(self, final: bool = False) -> list[dict]:
        new = self.text[self.sent:]
        if not new and (self.opened or not final):
            return []
        entry = {"index": 0, "function": {"arguments": new}}
        if not self.opened:
            entry = {"index": 0, "id": self.id, "type": "function",
                     "function": {"name": self.calling.names[0], "arguments": new}}
            self.opened = True
        self.sent = len(self.text)
        return [entry]

    def _content_end(self) -> int:
        """AUTO: how much of the text is surely content: up to the opening of a call, less a tail that may
        begin one."""
        if self.calling.parser in _OPENINGS:  # a call may open after content
            mark = _OPENINGS[self.calling.parser]
            opening = self.text.find(mark)
            if opening >= 0:
                self.held = True
                return opening
            return len(self.text) - harmony.held_back(self.text, mark)
        # llama3_json, pythonic: a call is the whole answer, so the answer's start decides
        opening, tag = ("[", _PYTHON_START) if self.calling.parser == "pythonic" else ("{", _PYTHON_TAG)
        body = self.text.lstrip()
        if not body:
            return self.sent
        if body.startswith(opening) or body.startswith(tag):
            self.held = True
            return self.sent
        if tag.startswith(body):
            return self.sent
        return len(self.text)
