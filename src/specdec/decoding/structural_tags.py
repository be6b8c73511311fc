"""Structural tags: text whose tagged parts follow structures, compiled to a Lark grammar for llguidance.

Two forms, as the peers take them (docs/api.md#structural-tags):
- vLLM's and SGLang's `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`: free text in which a
  trigger opens one of the structures beginning with it (the rest of its begin, JSON following its schema, its
  end), then free text again;
- xgrammar's `{"format": {...}}`: a tree of formats (`const_string`, `json_schema` in JSON or a model's XML
  parameter style, `grammar`, `regex`, `any_text`; `sequence`, `or`, `optional`, `plus`, `star`, `repeat`;
  `tag`, `triggered_tags`, `tags_with_separator`, `dispatch`; the token-level `token`, `exclude_token`,
  `any_tokens`, `token_triggered_tags`, `token_dispatch`).

A special token of the tokenizer written in a string of either form (a trigger, a begin or end, a constant) is
matched as the token, as a model writes it, not as its text. Free text (an `any_text`, the text between
triggered tags) ends where what encloses it goes on: at the enclosing tag's end, or the constant or tag
begin that follows it in a sequence, its first occurrence (a lazy lexeme); elsewhere it runs to the end of
the output. It may hold the tokenizer's special tokens other than the triggers, the ends and the end of
sequence (a model's own markers inside an answer), unless a character budget (`max_chars`) holds it.
"""

from __future__ import annotations

import json
import re

from specdec.decoding import json_text

# Each choice is one alternative of a rule: llguidance's parser refuses a row of more than 2000 items at the
# first token (seen with 2000 choices), so longer lists (choices, structures, tags) are refused when they compile.
MAX_CHOICES = 1024
MAX_NODES = 4096  # formats in one guide (a guide's text is bounded too: max_guide_chars)
MAX_DEPTH = 32  # formats nested in one another
ANY = "/(.|\\n)*/"
XML_STYLES = ("qwen_xml", "glm_xml", "minimax_xml", "deepseek_xml")
_DSML = "｜DSML｜"  # DeepSeek-V3.2's tag prefix
NL, NEWLINE = "\n", '"\\n"?'  # a newline; an optional one, in Lark (GLM-4.5 writes them, 4.7 not)
# Formats that take what follows them as their end: free text (or tokens) until it
_UNLIMITED = ("any_text", "triggered_tags", "dispatch", "any_tokens", "token_triggered_tags", "token_dispatch")
_KEYS = {  # each format's keys besides "type" (required ones first, by _REQUIRED)
    "const_string": ("value",), "json_schema": ("json_schema", "style", "any_order"), "grammar": ("grammar",),
    "regex": ("pattern",), "any_text": ("excludes", "max_tokens", "max_chars"), "sequence": ("elements",),
    "or": ("elements",), "optional": ("content",), "plus": ("content",), "star": ("content",),
    "repeat": ("min", "max", "content"), "tag": ("begin", "content", "end"),
    "triggered_tags": ("triggers", "tags", "at_least_one", "stop_after_first", "excludes"),
    "tags_with_separator": ("tags", "separator", "at_least_one", "stop_after_first"),
    "dispatch": ("rules", "loop", "excludes"), "token": ("token",), "exclude_token": ("exclude_tokens",),
    "any_tokens": ("exclude_tokens", "max_tokens"),
    "token_triggered_tags": ("trigger_tokens", "tags", "exclude_tokens", "at_least_one", "stop_after_first"),
    "token_dispatch": ("rules", "loop", "exclude_tokens")}
_REQUIRED = {"const_string": 1, "json_schema": 1, "grammar": 1, "regex": 1, "sequence": 1, "or": 1, "optional": 1,
             "plus": 1, "star": 1, "repeat": 3, "tag": 3, "triggered_tags": 2, "tags_with_separator": 2,
             "dispatch": 1, "token": 1, "token_triggered_tags": 2, "token_dispatch": 1}


class StructuralTagError(ValueError):
    """A structural tag guide that does not compile (grammar.GuideError wraps it)."""


def structural_tag_grammar(guide: str, special_tokens: dict[str, int], ends: frozenset[int] = frozenset(),
                           vocab_size: int = 0) -> str:
    """A structural_tag guide (its JSON text, either form) -> llguidance's grammar definition (a Lark grammar,
    or a JSON list of grammars where a `grammar` format nests one). `special_tokens`: text -> id of the
    tokenizer's special tokens; `ends`: its end-of-sequence ids (which end the output, never free text);
    `vocab_size`: its ids' bound (token-level formats' sets). Raises StructuralTagError naming the place."""
    try:
        spec = json_text.parse(guide)
    except ValueError as exc:
        raise StructuralTagError(f"a structural_tag guide is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise StructuralTagError("a structural_tag guide must be a JSON object with 'structures' and 'triggers' "
                                 "(or xgrammar's 'format')")
    if spec.get("type", "structural_tag") != "structural_tag":
        raise StructuralTagError(f"a structural_tag guide's 'type' must be \"structural_tag\", got "
                                 f"{json.dumps(spec.get('type'))[:80]}")
    builder = _Builder(special_tokens, ends, vocab_size)
    if "format" in spec:
        unknown = sorted(set(spec) - {"format", "type"})
        if unknown:
            raise StructuralTagError(f"a structural_tag guide with 'format' has no other keys, got {unknown}")
        start, _ = builder.format(spec["format"], "format", None, 0)
    else:
        start = builder.legacy(spec)
    return builder.definition(start)


# A Lark rule's lexeme options that llguidance cannot roll back (its error: "rollback not supported with
# max_tokens=... or stop=... lexemes"); every verify round rolls the grammar back over its drafts
_UNROLLABLE = re.compile(r"^[ \t]*[A-Za-z_][\w-]*\[[^\]\n]*\b(max_tokens|stop)\s*=", re.MULTILINE)


def refuse_unrollable(lark: str, where: str) -> None:
    """StructuralTagError where a Lark grammar gives a rule `max_tokens=` or `stop=` (a token budget, a hidden
    stop): speculation rolls the grammar back each round, which llguidance refuses for such a lexeme."""
    found = _UNROLLABLE.search(lark)
    if found:
        raise StructuralTagError(f"{where}: a rule's {found.group(1)}= is not supported (speculation rolls the "
                                 "grammar back each round, which llguidance refuses for such a lexeme); "
                                 "suffix= and lazy are")


def _ids_text(ids) -> str:
    """Sorted token ids as llguidance's token set: runs of consecutive ids as first-last (Llama 3's 256 reserved
    special tokens are one run)."""
    runs: list[list[int]] = []
    for token in sorted(ids):
        if runs and token == runs[-1][1] + 1:
            runs[-1][1] = token
        else:
            runs.append([token, token])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class _Ends:
    """What closes free text: text ends (no special token in them) and token ends (special tokens' ids)."""

    def __init__(self, texts: tuple[str, ...] = (), tokens: tuple[int, ...] = ()):
        self.texts, self.tokens = texts, tokens


class _Builder:
    def __init__(self, special_tokens: dict[str, int], ends: frozenset[int], vocab_size: int):
        self.special = {text: int(token) for text, token in special_tokens.items() if text}
        self.eos, self.vocab_size = frozenset(ends), vocab_size
        texts = sorted(self.special, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None
        self.rules: list[str] = []
        self.grammars: list[str] = []
        self.nodes = 0
        self.triggers: set[int] = set()  # special-token triggers: never free text

    # -- output ------------------------------------------------------------------------------------------------
    def definition(self, start: str) -> str:
        lark = "%llguidance {}\nstart: " + start + "\n" + "\n".join(self.rules) + "\n"
        if not self.grammars:
            return lark
        return json.dumps({"grammars": [{"lark_grammar": lark}] + [
            {"name": f"g{i}", "lark_grammar": text} for i, text in enumerate(self.grammars)]})

    def rule(self, body: str, attributes: str = "") -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{attributes}: {body}")
        return name

    def terminal(self, body: str) -> str:
        name = f"T{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def written(self, text: str) -> str:
        """`text` as Lark items: its special tokens by id, the rest as string literals ("" when empty)."""
        parts = self.split.split(text) if self.split else [text]
        items = [f"<[{self.special[part]}]>" if part in self.special else json.dumps(part) for part in parts if part]
        return " ".join(items) or '""'

    def has_special(self, text: str) -> bool:
        return bool(self.split and self.split.search(text))

    def token(self, value, where: str) -> int:
        """A token given by id or by a special token's text."""
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise StructuralTagError(f"{where}: a token is an id or a special token's text, got {json.dumps(value)}")
        if isinstance(value, str):
            if value not in self.special:
                raise StructuralTagError(f"{where}: {value!r} is not a special token of the served tokenizer "
                                         "(give its id)")
            return self.special[value]
        if not 0 <= value < self.vocab_size:
            raise StructuralTagError(f"{where}: token id {value} is outside the vocabulary [0, {self.vocab_size})")
        return value

    def tokens(self, values, where: str) -> set[int]:
        if not isinstance(values, list):
            raise StructuralTagError(f"{where} must be a list of tokens (ids or special tokens' text)")
        return {self.token(value, f"{where}[{i}]") for i, value in enumerate(values)}

    def any_token_but(self, excluded: set[int], where: str) -> str:
        allowed = set(range(self.vocab_size)) - excluded - self.eos
        if not allowed:
            raise StructuralTagError(f"{where}: every token is excluded")
        return f"<[{_ids_text(allowed)}]>"

    # -- free text ---------------------------------------------------------------------------------------------
    def text_terminal(self, excludes: list[str], max_chars: int | None) -> str:
        body = ANY if max_chars is None else f"/(.|\\n){{0,{max_chars}}}/"
        texts = [text for text in excludes if text not in self.special]
        if texts:
            body += " & ~(" + ANY + " (" + " | ".join(json.dumps(t) for t in texts) + ") " + ANY + ")"
        return self.terminal(body)

    def free_specials(self, excludes: list[str], ends: _Ends | None) -> set[int]:
        """Special tokens free text may hold: all but triggers, ends, excluded ones and the end of sequence."""
        closed = self.triggers | self.eos | {self.special[t] for t in excludes if t in self.special}
        return set(self.special.values()) - closed - set(ends.tokens if ends else ())

    def final_text(self, text: str, ends: _Ends | None) -> str:
        """Free text (its terminal `text`) and then one of `ends` (None: to the end of the output)."""
        if ends is None:
            return text
        options = []
        if ends.texts:  # lazy: the text ends at the first place one of them is written
            options.append(self.rule(f"{text} ({' | '.join(json.dumps(t) for t in ends.texts)})", "[lazy]"))
        if ends.tokens:  # (text never holds a special token: it ends where the token comes)
            options.append(f"{text} <[{_ids_text(ends.tokens)}]>")
        return self.rule(" | ".join(options))

    def free_then(self, segments: list[str], text: str, specials: set[int], ends: _Ends | None,
                  once: bool = False, first: str | None = None) -> str:
        """Free text with `segments` (each opens in free text: its own opening lexeme) and the free special
        tokens between them, then the final text and `ends`. once: after one segment the free text is over
        (its end follows at once); first: what must open it instead of free text (a segment without text)."""
        loose = self.rule(f"{text} <[{_ids_text(specials)}]>") if specials else None
        final = self.final_text(text, ends)
        closing = self.closing(ends)
        if once:
            if first is not None:
                return self.rule(f"{first} {closing}")
            chosen = self.rule(" | ".join(segments))
            return self.rule(f"{loose + '* ' if loose else ''}({final} | {chosen} {closing})")
        repeated = " | ".join(segments + ([loose] if loose else []))
        body = f"({repeated})* {final}" if repeated else final
        return self.rule(f"{first} {body}" if first is not None else body)

    def opening(self, text: str, trigger: str, where: str) -> str:
        """Free text (its terminal `text`) up to `trigger`: a special token is that token (kept out of free text
        from here on; the text ends where it comes), text a lazy lexeme (the text ends at its first occurrence)."""
        if trigger in self.special:
            self.triggers.add(self.special[trigger])
            return f"{text} <[{self.special[trigger]}]>"
        if self.has_special(trigger):
            raise StructuralTagError(f"{where}: the trigger {trigger!r} is text with a special token in it: a "
                                     "trigger is one special token or text")
        return self.rule(f"{text} {json.dumps(trigger)}", "[lazy]")

    def closing(self, ends: _Ends | None) -> str:
        """`ends` written, for where a structure that took them ends before free text reaches them."""
        if ends is None:
            return ""
        options = [json.dumps(t) for t in ends.texts] + [f"<[{_ids_text(ends.tokens)}]>"] * bool(ends.tokens)
        return "(" + " | ".join(options) + ")"

    def closes(self, node) -> bool:
        """Whether free text before `node` can end at its opening: a constant's text or a tag's begin that is
        text or one special token (or a token format)."""
        if not isinstance(node, dict):
            return False
        opening = node.get("value") if node.get("type") == "const_string" else (
            node.get("begin") if node.get("type") == "tag" else None)
        if isinstance(opening, dict):
            return opening.get("type") == "token"
        return isinstance(opening, str) and bool(opening) and (opening in self.special or
                                                               not self.has_special(opening))

    def ends_of(self, value, where: str) -> _Ends:
        """A tag's end (a string, a list of strings or a token format) as what closes free text."""
        if isinstance(value, dict):
            return _Ends(tokens=(self.token_format(value, where),))
        values = [value] if isinstance(value, str) else value
        if not (isinstance(values, list) and values and all(isinstance(v, str) for v in values)):
            raise StructuralTagError(f"{where} must be a string, a list of strings or a token format")
        texts, tokens = [], []
        for text in values:
            if text in self.special:
                tokens.append(self.special[text])
            elif self.has_special(text):
                raise StructuralTagError(f"{where}: {text!r} mixes text and a special token: an end that closes "
                                         "free text is text or one special token")
            else:
                texts.append(text)
        return _Ends(tuple(texts), tuple(tokens))

    def token_format(self, node, where: str) -> int:
        if not isinstance(node, dict) or node.get("type") != "token" or set(node) != {"type", "token"}:
            raise StructuralTagError(f"{where} must be a string or {{\"type\": \"token\", \"token\": ...}}")
        return self.token(node["token"], f"{where}.token")

    # -- formats -----------------------------------------------------------------------------------------------
    def format(self, node, where: str, ends: _Ends | None, depth: int) -> tuple[str, bool]:
        """A format node -> (its Lark expression, whether it took `ends`: free text that runs until one of
        them, which it then holds). Formats that do not take them leave them to the caller."""
        kind = self.checked(node, where, depth)
        return getattr(self, "_" + kind)(node, where, ends if kind in _UNLIMITED or kind in ("sequence", "or")
                                         else None, depth + 1)

    def checked(self, node, where: str, depth: int) -> str:
        """A format node's type, once its keys are checked (StructuralTagError naming the place otherwise)."""
        self.nodes += 1
        if self.nodes > MAX_NODES or depth > MAX_DEPTH:
            raise StructuralTagError(f"{where}: a structural tag may have at most {MAX_NODES} formats, nested at "
                                     f"most {MAX_DEPTH} deep")
        if not isinstance(node, dict) or node.get("type") not in _KEYS:
            kind = node.get("type") if isinstance(node, dict) else node
            raise StructuralTagError(f"{where}: a format is an object whose 'type' is one of {', '.join(_KEYS)}, "
                                     f"got {json.dumps(kind)[:80]}")
        kind, keys = node["type"], _KEYS[node["type"]]
        unknown = sorted(set(node) - {"type", *keys})
        missing = [key for key in keys[:_REQUIRED.get(kind, 0)] if key not in node]
        if unknown or missing:
            raise StructuralTagError(f"{where}: a {kind} format has {'unknown keys ' + str(unknown) if unknown else ''}"
                                     f"{' and ' if unknown and missing else ''}"
                                     f"{'no ' + str(missing) if missing else ''} (its keys: {', '.join(keys)})")
        return kind

    def sub(self, node, where: str, depth: int) -> str:
        return self.format(node, where, None, depth)[0]

    def _const_string(self, node, where, ends, depth):
        if not isinstance(node["value"], str):
            raise StructuralTagError(f"{where}.value must be a string")
        return self.written(node["value"]), False

    def _json_schema(self, node, where, ends, depth):
        schema, style = node["json_schema"], node.get("style", "json")
        if not isinstance(schema, dict):
            raise StructuralTagError(f"{where}.json_schema must be a JSON schema object")
        if node.get("any_order", False) is not False:
            raise StructuralTagError(f"{where}.any_order: only false (the properties in their order) is supported")
        if style == "json":
            return "%json " + json.dumps(schema), False
        if style not in XML_STYLES:
            raise StructuralTagError(f"{where}.style must be one of json, {', '.join(XML_STYLES)}, got "
                                     f"{json.dumps(style)[:80]}")
        return self.xml_object(schema, style, f"{where}.json_schema"), False

    def _grammar(self, node, where, ends, depth):
        from llguidance.gbnf_to_lark import any_to_lark

        if not isinstance(node["grammar"], str) or not node["grammar"].strip():
            raise StructuralTagError(f"{where}.grammar must be a non-empty grammar (EBNF/GBNF or Lark)")
        try:
            lark = any_to_lark(node["grammar"])
        except Exception as exc:  # (the converter raises what its parser meets)
            raise StructuralTagError(f"{where}.grammar does not convert: {exc}") from None
        refuse_unrollable(lark, f"{where}.grammar")
        self.grammars.append(lark)
        return f"@g{len(self.grammars) - 1}", False

    def _regex(self, node, where, ends, depth):
        if not isinstance(node["pattern"], str) or not node["pattern"]:
            raise StructuralTagError(f"{where}.pattern must be a non-empty regular expression")
        return self.rule(self.terminal("/" + node["pattern"].replace("/", "\\/") + "/")), False

    def _any_text(self, node, where, ends, depth):
        excludes = _strings(node.get("excludes", []), f"{where}.excludes")
        max_tokens = _count(node.get("max_tokens"), f"{where}.max_tokens")
        max_chars = _count(node.get("max_chars"), f"{where}.max_chars")
        text = self.text_terminal(excludes, max_chars)
        if max_tokens is not None:  # llguidance cannot roll a lexeme's token budget back, as a verify round does
            raise StructuralTagError(f"{where}.max_tokens is not supported on free text (speculation rolls the "
                                     "grammar back, which a token budget does not allow): give max_chars")
        if max_chars is not None:  # (a budget holds text alone: no special tokens in it)
            return self.final_text(text, ends), ends is not None
        return self.free_then([], text, self.free_specials(excludes, ends), ends), ends is not None

    def _sequence(self, node, where, ends, depth):
        elements = _list(node["elements"], f"{where}.elements")
        items, took, i = [], False, 0
        while i < len(elements):
            element, here = elements[i], f"{where}.elements[{i}]"
            after = elements[i + 1] if i + 1 < len(elements) else None
            if i == len(elements) - 1:
                expression, took = self.format(element, here, ends, depth)
            elif isinstance(element, dict) and element.get("type") in _UNLIMITED and self.closes(after):
                # free text ends at what follows: the constant, or the tag's begin (then the tag goes on)
                following = f"{where}.elements[{i + 1}]"
                self.checked(after, following, depth)
                opening = after["value"] if after["type"] == "const_string" else after["begin"]
                expression, _ = self.format(element, here, self.ends_of(opening, following), depth)
                if after["type"] == "tag":
                    expression += " " + self.tag_rest(after, following, depth + 1)
                took = False  # (where `after` was the last element, the sequence's ends stay the caller's)
                i += 1
            else:
                expression = self.sub(element, here, depth)
            items.append(expression)
            i += 1
        return (self.rule(" ".join(items)) if items else '""'), took

    def _or(self, node, where, ends, depth):
        elements = _list(node["elements"], f"{where}.elements")
        options = [self.format(element, f"{where}.elements[{i}]", ends, depth) for i, element in enumerate(elements)]
        if ends is not None and any(took for _, took in options):  # those that did not take them are followed
            options = [(e if took else f"{e} {self.closing(ends)}", True) for e, took in options]
        return self.rule(" | ".join(e for e, _ in options)), any(took for _, took in options)

    def _optional(self, node, where, ends, depth):
        return self.rule(f"({self.sub(node['content'], where + '.content', depth)})?"), False

    def _plus(self, node, where, ends, depth):
        return self.rule(f"({self.sub(node['content'], where + '.content', depth)})+"), False

    def _star(self, node, where, ends, depth):
        return self.rule(f"({self.sub(node['content'], where + '.content', depth)})*"), False

    def _repeat(self, node, where, ends, depth):
        low, high = node["min"], node["max"]
        if _count(low, f"{where}.min") is None or not (isinstance(high, int) and not isinstance(high, bool)
                                                       and (high == -1 or high >= low)):
            raise StructuralTagError(f"{where}: 'min' must be a count and 'max' -1 or at least 'min', got "
                                     f"{json.dumps(low)}, {json.dumps(high)}")
        body = self.sub(node["content"], where + ".content", depth)
        return self.rule(f"({body}){{{low},{'' if high == -1 else high}}}"), False

    def _tag(self, node, where, ends, depth):
        begin = node["begin"]
        if isinstance(begin, str):
            opening = self.written(begin)
        else:
            opening = f"<[{self.token_format(begin, where + '.begin')}]>"
        return self.rule(f"{opening} {self.tag_rest(node, where, depth)}"), False

    def tag_rest(self, node, where, depth) -> str:
        """A tag after its begin: its content and its end (its content may take the end: free text up to it)."""
        own = self.ends_of(node["end"], where + ".end")
        content, took = self.format(node["content"], where + ".content", own, depth)
        return content if took else f"{content} {self.closing(own)}"

    def tag_list(self, tags, where: str, text_begins: bool, depth: int) -> list[tuple[dict, str]]:
        """A list of tag formats ("type": "tag" may be left out), each checked, with its place."""
        out = []
        for i, tag in enumerate(_list(tags, where)):
            if not isinstance(tag, dict) or tag.get("type", "tag") != "tag":
                raise StructuralTagError(f"{where}[{i}] must be a tag format")
            tag = {"type": "tag", **tag}
            self.checked(tag, f"{where}[{i}]", depth)
            if text_begins and not isinstance(tag["begin"], str):
                raise StructuralTagError(f"{where}[{i}].begin must be a string")
            out.append((tag, f"{where}[{i}]"))
        return out

    def _triggered_tags(self, node, where, ends, depth):
        triggers = _strings(node["triggers"], f"{where}.triggers", nonempty=True)
        excludes = _strings(node.get("excludes", []), f"{where}.excludes")
        at_least_one = _flag(node, "at_least_one", where)
        once = _flag(node, "stop_after_first", where)
        tags = self.tag_list(node["tags"], f"{where}.tags", True, depth)
        text = self.text_terminal(excludes, None)
        openings = {trigger: self.opening(text, trigger, f"{where}.triggers") for trigger in triggers}
        segments, whole = [], []
        for tag, here in tags:
            begin = tag["begin"]
            trigger = next((t for t in triggers if begin.startswith(t)), None)
            if trigger is None:
                raise StructuralTagError(f"{here}: 'begin' {begin!r} starts with none of the triggers {triggers!r}")
            inside = self.tag_rest(tag, here, depth)
            after_trigger = self.written(begin[len(trigger):]) if begin != trigger else ""
            segments.append(self.rule(f"{openings[trigger]} {after_trigger} {inside}"))
            whole.append(self.rule(f"{self.written(begin)} {inside}"))
        first = self.rule(" | ".join(whole)) if at_least_one else None
        return self.free_then(segments, text, self.free_specials(excludes, ends), ends, once, first), True

    def _dispatch(self, node, where, ends, depth):
        rules = _list(node["rules"], f"{where}.rules")
        excludes = _strings(node.get("excludes", []), f"{where}.excludes")
        loop = node.get("loop", True)
        if not isinstance(loop, bool):
            raise StructuralTagError(f"{where}.loop must be true or false")
        text = self.text_terminal(excludes, None)
        segments = []
        for i, pair in enumerate(rules):
            here = f"{where}.rules[{i}]"
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and pair[0]):
                raise StructuralTagError(f"{here} must be [pattern string, format]")
            pattern, fmt = pair
            segments.append(self.rule(f"{self.opening(text, pattern, here)} {self.sub(fmt, here + '[1]', depth)}"))
        return self.free_then(segments, text, self.free_specials(excludes, ends), ends, not loop), True

    def _tags_with_separator(self, node, where, ends, depth):
        tags = self.tag_list(node["tags"], f"{where}.tags", False, depth)
        separator = node["separator"]
        if not isinstance(separator, str):
            raise StructuralTagError(f"{where}.separator must be a string")
        one = self.rule(" | ".join(self._tag(tag, here, None, depth + 1)[0] for tag, here in tags))
        more = "" if _flag(node, "stop_after_first", where) else f" ({self.written(separator)} {one})*"
        body = f"{one}{more}"
        return (self.rule(body) if _flag(node, "at_least_one", where) else self.rule(f"({body})?")), False

    def _token(self, node, where, ends, depth):
        return f"<[{self.token(node['token'], where + '.token')}]>", False

    def _exclude_token(self, node, where, ends, depth):
        excluded = self.tokens(node.get("exclude_tokens", []), f"{where}.exclude_tokens")
        return self.any_token_but(excluded, where), False

    def _any_tokens(self, node, where, ends, depth):
        excluded = self.tokens(node.get("exclude_tokens", []), f"{where}.exclude_tokens")
        max_tokens = _count(node.get("max_tokens"), f"{where}.max_tokens")
        if ends is not None and ends.texts:
            raise StructuralTagError(f"{where}: any_tokens ends at a token: it cannot be closed by text "
                                     f"{list(ends.texts)!r}")
        one = self.any_token_but(excluded | set(ends.tokens if ends else ()), where)
        repeat = "*" if max_tokens is None else f"{{0,{max_tokens}}}"
        return self.rule(f"{one}{repeat} {self.closing(ends)}".strip()), ends is not None

    def _token_segments(self, node, where, ends, pairs) -> tuple[str, list[str]]:
        """Token-level free content: (one free token, as a token set; each (opening token, what follows it) of
        `pairs` as free tokens then that token and its rest)."""
        excluded = self.tokens(node.get("exclude_tokens", []), f"{where}.exclude_tokens")
        if ends is not None and ends.texts:
            raise StructuralTagError(f"{where}: {node['type']} ends at a token: it cannot be closed by text "
                                     f"{list(ends.texts)!r}")
        openers = {token for token, _ in pairs}
        one = self.any_token_but(excluded | openers | set(ends.tokens if ends else ()), where)
        return one, [self.rule(f"{one}* <[{token}]> {rest}") for token, rest in pairs]

    def _token_triggered_tags(self, node, where, ends, depth):
        triggers = self.tokens(node["trigger_tokens"], f"{where}.trigger_tokens")
        if not triggers:
            raise StructuralTagError(f"{where}.trigger_tokens must not be empty")
        pairs, whole = [], []
        for tag, here in self.tag_list(node["tags"], f"{where}.tags", False, depth):
            token = self.token_format(tag["begin"], here + ".begin")
            if token not in triggers:
                raise StructuralTagError(f"{here}.begin: token {token} is none of the trigger tokens")
            rest = self.tag_rest(tag, here, depth)
            pairs.append((token, rest))
            whole.append(self.rule(f"<[{token}]> {rest}"))
        one, segments = self._token_segments(node, where, ends, pairs)
        final = self.rule(f"{one}* {self.closing(ends)}".strip())
        closing = self.closing(ends)
        first = self.rule(" | ".join(whole)) if _flag(node, "at_least_one", where) else None
        if _flag(node, "stop_after_first", where):
            body = f"{first} {closing}" if first else f"{final} | {self.rule(' | '.join(segments))} {closing}"
        else:
            body = f"{first + ' ' if first else ''}({' | '.join(segments)})* {final}"
        return self.rule(body.strip()), True

    def _token_dispatch(self, node, where, ends, depth):
        loop = node.get("loop", True)
        if not isinstance(loop, bool):
            raise StructuralTagError(f"{where}.loop must be true or false")
        pairs = []
        for i, pair in enumerate(_list(node["rules"], f"{where}.rules")):
            here = f"{where}.rules[{i}]"
            if not (isinstance(pair, list) and len(pair) == 2):
                raise StructuralTagError(f"{here} must be [token, format]")
            pairs.append((self.token(pair[0], here + "[0]"), self.sub(pair[1], here + "[1]", depth)))
        one, segments = self._token_segments(node, where, ends, pairs)
        final = self.rule(f"{one}* {self.closing(ends)}".strip())
        if loop:
            return self.rule(f"({' | '.join(segments)})* {final}"), True
        return self.rule(f"{final} | {self.rule(' | '.join(segments))} {self.closing(ends)}".strip()), True

    # -- JSON schemas in a model's XML parameter style -----------------------------------------------------------
    def xml_object(self, schema: dict, style: str, where: str) -> str:
        """An object's properties as Qwen3-Coder writes them (`<parameter=KEY>\\nVALUE\\n</parameter>\\n`, in
        its template's layout), GLM-4.5 and 4.7 (`<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`, a
        newline before each tag or none) or MiniMax-M2 (`<parameter name="KEY">VALUE</parameter>`, a newline
        after each or none): in the schema's order, the optional ones may be left out; a string
        value is its raw text (one of its enum or const where it has them), any other JSON; without
        properties, any keys with any values."""
        if schema.get("type", "object") != "object":
            raise StructuralTagError(f"{where}: the {style} style writes an object's properties, got type "
                                     f"{json.dumps(schema.get('type'))}")
        properties = schema.get("properties") or {}
        if not isinstance(properties, dict):
            raise StructuralTagError(f"{where}.properties must be an object")
        required = set(schema.get("required") or [])
        options = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
        close = {"qwen_xml": "\n</parameter>", "glm_xml": "</arg_value>", "minimax_xml": "</parameter>",
                 "deepseek_xml": f"</{_DSML}parameter>"}[style]

        def pair(key: str, value: str, sub=None) -> str:
            """One parameter: `key` its name's Lark items, `value` its value and closing (`sub`: its schema)."""
            if style == "qwen_xml":
                return f'{self.written("<parameter=")} {key} {self.written(">" + NL)} {value} {self.written(NL)}'
            if style == "minimax_xml":
                opening, closing = self.written('<parameter name="'), self.written('">')
                return f"{opening} {key} {closing} {value} {NEWLINE}"
            if style == "deepseek_xml":  # string="true": the value is raw text, "false": JSON
                opening = self.written(f'<{_DSML}parameter name="')
                flag = self.written('" string="true">' if _is_text(sub) else '" string="false">')
                return f"{opening} {key} {flag} {value} {NEWLINE}"
            return (f"{NEWLINE} {self.written('<arg_key>')} {key} {self.written('</arg_key>')} {NEWLINE} "
                    f"{self.written('<arg_value>')} {value}")
        items = []
        for key, sub in properties.items():
            value = self.xml_value(sub, close, options, f"{where}.properties.{key}", style)
            item = self.rule(pair(self.written(key), value, sub))
            items.append(item if key in required else f"{item}?")
        if not properties:  # any keys, any values
            value = self.xml_value({}, close, options, where, style)
            items.append(self.rule(pair(self.terminal('/[^<>"\\n]+/'), value, {"type": "string"})) + "*")
        if style == "glm_xml":
            items.append(NEWLINE)
        return self.rule(" ".join(items) or '""')

    def xml_value(self, schema, close: str, options: dict, where: str, style: str) -> str:
        """One value and its closing text: raw text for a string, JSON (with the object's JSON options) else."""
        if not isinstance(schema, dict):
            raise StructuralTagError(f"{where} must be a JSON schema object")
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
        closing = self.written(close)
        choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if choices is not None and all(isinstance(c, str) for c in choices) and choices and (
                not kinds or kinds == ["string"]):
            return self.rule(f"({' | '.join(self.written(c) for c in choices)}) {closing}")
        if kinds == ["boolean"] and style == "qwen_xml":  # (Qwen3-Coder's template writes Python's True and False)
            return self.rule(f'("true" | "false" | "True" | "False") {closing}')
        if "string" in kinds or not kinds:  # text up to its closing (any JSON is text too)
            return self.final_text(self.terminal(ANY), self.ends_of(close, where))
        sub = {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}} if options else schema
        return f"%json {json.dumps(sub)} {closing}"

    # -- vLLM's and SGLang's form --------------------------------------------------------------------------------
    def legacy(self, spec: dict) -> str:
        unknown = sorted(set(spec) - {"structures", "triggers", "type"})
        if unknown:
            raise StructuralTagError(f"a structural_tag guide has keys 'structures', 'triggers' (and 'type': "
                                     f"\"structural_tag\"), or xgrammar's 'format', got {unknown}")
        triggers, structures = spec.get("triggers"), spec.get("structures")
        if not (isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)):
            raise StructuralTagError("a structural_tag guide's 'triggers' must be a list of non-empty strings")
        if not (isinstance(structures, list) and structures):
            raise StructuralTagError("a structural_tag guide's 'structures' must be a non-empty list")
        if len(structures) > MAX_CHOICES:
            raise StructuralTagError(f"a structural_tag guide may have at most {MAX_CHOICES} structures, got "
                                     f"{len(structures)}")
        tags = []
        for i, structure in enumerate(structures):
            where = f"structures[{i}]"
            if not isinstance(structure, dict) or set(structure) - {"begin", "schema", "end"}:
                raise StructuralTagError(f"{where} must be an object of 'begin', 'schema' and 'end'")
            begin, schema, end = structure.get("begin"), structure.get("schema", {}), structure.get("end")
            if not isinstance(begin, str) or not isinstance(end, str):
                raise StructuralTagError(f"{where}: 'begin' and 'end' must be strings")
            if not isinstance(schema, dict):
                raise StructuralTagError(f"{where}: 'schema' must be a JSON schema object")
            tags.append((begin, schema, end))
        return self.structures(triggers, tags)

    def structures(self, triggers: list[str], tags: list[tuple[str, dict, str]]) -> str:
        """(begin, schema, end) structures as triggered tags; their ends written as given (text and special
        tokens mixed: an end here closes JSON, not free text)."""
        for trigger in triggers:
            if trigger in self.special:
                self.triggers.add(self.special[trigger])
        text = self.terminal(ANY)
        segments = []
        for i, (begin, schema, end) in enumerate(tags):
            where = f"structures[{i}]"
            trigger = next((t for t in triggers if begin.startswith(t)), None)
            if trigger is None:
                raise StructuralTagError(f"{where}: 'begin' {begin!r} starts with none of the triggers {triggers!r}")
            opens = self.opening(text, trigger, where)
            body = " ".join(item for item in (self.written(begin[len(trigger):]) if begin != trigger else "",
                                              "%json " + json.dumps(schema), self.written(end) if end else "")
                            if item)
            segments.append(self.rule(f"{opens} {body}"))
        return self.free_then(segments, text, self.free_specials([], None), None)


def _is_text(schema) -> bool:
    """Whether an XML style writes a value of this schema as raw text (a string, or any value where the schema
    names no type), else JSON."""
    if not isinstance(schema, dict):
        return True
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    return "string" in kinds or not kinds


def _list(value, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise StructuralTagError(f"{where} must be a non-empty list")
    if len(value) > MAX_CHOICES:
        raise StructuralTagError(f"{where} may have at most {MAX_CHOICES} items, got {len(value)}")
    return value


def _strings(value, where: str, nonempty: bool = False) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value) or (nonempty and not value):
        raise StructuralTagError(f"{where} must be a {'non-empty ' if nonempty else ''}list of non-empty strings")
    return value


def _count(value, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2_147_483_647:
        raise StructuralTagError(f"{where} must be a count (0 or more), got {json.dumps(value)[:40]}")
    return value


def _flag(node: dict, key: str, where: str) -> bool:
    value = node.get(key, False)
    if not isinstance(value, bool):
        raise StructuralTagError(f"{where}.{key} must be true or false")
    return value
