"""gpt-oss's answers in OpenAI's harmony format, read apart: its thinking (the `analysis` channel), its answer
(the `final` channel, and `commentary` it addresses to the user) and its function calls (a message to
`functions.NAME`), as vLLM's `openai_gptoss` reasoning parser and `openai` tool-call parser read them.

An answer is a run of messages, each a header and a body:

    <|channel|>analysis<|message|>The user asks for the weather...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>

(the chat template's generation prompt opened the first with `<|start|>assistant`; `<|call|>` and `<|return|>`
are end tokens of the model's generation_config.json, so the server stops there and leaves them out of the
text). The markers are special tokens: the API asks the server to keep them in the text (skip_special_tokens
false), as it does for Mistral's calls. The recipient (`to=...`) may stand before or after the channel.

`HarmonyStream` is the reasoning parser's half: thinking apart, answers' bodies as content, and a message to a
recipient passed on whole in one form (`<|start|>assistant` + its header + `<|message|>` + its body + its end
marker), which `calls` (the tool-call parser's half) reads. Text with no harmony markup is all content (an
answer a structured output held from its first token, where the vocabulary has no harmony markers). Pure: text
in, parts out.
"""

from __future__ import annotations

import json
import re

from specdec import tensor_names as tn
from specdec.decoding import json_text

START, CHANNEL, MESSAGE, END = tn.HARMONY_START, tn.HARMONY_CHANNEL, tn.HARMONY_MESSAGE, tn.HARMONY_END
CALL, RETURN = "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN)  # what closes a message's body
MARKERS = (START, CHANNEL, MESSAGE, *ENDS)
ROLE = tn.HARMONY_ROLE
ANALYSIS = "analysis"  # the thinking's channel
FUNCTIONS = "functions."  # a recipient that is one of the request's tools

_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z0-9_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_HEADER = re.compile(r"((?:" + re.escape(START) + r")?[^<]*(?:<\|(?!message\|)[^<]*)*?)" + re.escape(MESSAGE))
_MESSAGE = re.compile(re.escape(START) + r"(.*?)" + re.escape(MESSAGE) + r"(.*?)(?:" +
                      "|".join(re.escape(end) for end in ENDS) + r"|(?=" + re.escape(START) + r")|$)", re.DOTALL)


def header_fields(header: str) -> tuple[str | None, str | None]:
    """A message header's (channel, recipient); None for what it does not name. Of two channels the last (a
    header a thinking budget cut short: `<|channel|>analysis<|end|><|start|>assistant<|channel|>final`)."""
    channels, recipient = _CHANNEL.findall(header), _RECIPIENT.search(header)
    return channels[-1] if channels else None, recipient.group(1) if recipient else None


class HarmonyStream:
    """One answer's text deltas -> (thinking delta, content delta) as they come, `finish()` after the last: a
    marker split across deltas is held back until it is whole."""

    def __init__(self):
        self._state = "start"  # start (harmony or plain text?), header, body, plain
        self._held = ""  # text not yet read: a header so far, or a possible start of a marker
        self._kind = ""  # the open message's: thinking, content or call

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        thinking, content = [], []
        while text:
            if self._state == "start":
                if any(mark.startswith(text.lstrip()) for mark in (START, CHANNEL, "to=")):
                    self._held = text  # "<|" ...: cannot tell yet
                    break
                self._state = "header" if text.lstrip().startswith((START, CHANNEL, "to=")) else "plain"
            if self._state == "plain":
                content.append(text)
                break
            if self._state == "header":
                at = text.find(MESSAGE)
                if at < 0:
                    self._held = text
                    break
                header, text = text[:at], text[at + len(MESSAGE):]
                channel, recipient = header_fields(header)
                self._kind = "call" if recipient else "thinking" if channel == ANALYSIS else "content"
                if self._kind == "call":  # one form for the tool-call parser, whichever way it was written
                    rest = header[len(START):] if header.startswith(START) else header
                    rest = rest[len(ROLE):] if rest.startswith(ROLE) else rest
                    content.append(START + ROLE + rest + MESSAGE)
                self._state = "body"
            if self._state == "body":
                ends = [(text.find(end), end) for end in ENDS if end in text]
                if not ends:
                    keep = max(held_back(text, end) for end in ENDS)
                    body, self._held = text[:len(text) - keep], text[len(text) - keep:]
                    (thinking if self._kind == "thinking" else content).append(body)
                    break
                at, end = min(ends)
                (thinking if self._kind == "thinking" else content).append(text[:at])
                if self._kind == "call":
                    content.append(end)
                text, self._state = text[at + len(end):], "header"
        return "".join(thinking), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back: a body cut short ends there; a header with no body is dropped (plain text, never
        a header, is content)."""
        held, self._held = self._held, ""
        if self._state in ("start", "plain"):
            return "", held
        if self._state == "body":
            return (held, "") if self._kind == "thinking" else ("", held)
        return "", ""


def split(text: str) -> tuple[str, str]:
    """A whole answer's (thinking, content), as HarmonyStream gives them."""
    stream = HarmonyStream()
    thinking, content = stream.feed(text)
    more_thinking, more_content = stream.finish()
    return thinking + more_thinking, content + more_content


def thinking_end(text: str) -> int:
    """Where the thinking ends in an answer's text: past the end marker of its last analysis message before any
    other (0 when it opens with none; the text's end when one is cut short)."""
    at = 0
    while True:
        match = _HEADER.match(text, at)
        if match is None:
            return at
        channel, recipient = header_fields(match.group(1))
        if channel != ANALYSIS or recipient:
            return at
        closes = [(i, marker) for i, marker in ((text.find(marker, match.end()), marker) for marker in ENDS) if i >= 0]
        if not closes:
            return len(text)
        i, marker = min(closes)
        at = i + len(marker)


def calls(text: str) -> tuple[str | None, list[dict]]:
    """The tool-call parser's half: a content's (text before the first message to a recipient, calls), each call
    {"name", "arguments"} of a message to `functions.NAME` (its body, JSON re-encoded when it is JSON); messages
    to other recipients (gpt-oss's built-in browser or python) are no calls of the request's tools."""
    start = text.find(START)
    if start < 0:
        return text, []
    found = []
    for header, body in _MESSAGE.findall(text[start:]):
        _, recipient = header_fields(header)
        if not recipient or not recipient.startswith(FUNCTIONS):
            continue
        try:
            arguments = json.dumps(json_text.parse(body), ensure_ascii=False)
        except ValueError:  # not JSON (cut short, or a constraint of another kind): as written
            arguments = body.strip()
        found.append({"name": recipient[len(FUNCTIONS):], "arguments": arguments})
    return text[:start].strip() or None, found


def held_back(text: str, marker: str) -> int:
    """How many of text's last characters could begin `marker` (0 when none): what a stream holds back until the
    next delta tells (this parser's markers, the reasoning parsers' tags, the tool-call parsers' openings)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
