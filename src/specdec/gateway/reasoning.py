"""A reasoning model's thinking apart from its answer (`--reasoning-parser`, as vLLM and SGLang name it).

Reasoning models (DeepSeek-R1, QwQ, Qwen3) write their thinking between `<think>` and `</think>` before the
answer. With a parser the chat API returns the thinking in the message's (or delta's) `reasoning_content`
(SGLang's and DeepSeek's name) and `reasoning` (vLLM's current name), and only the answer in `content`; tool
calls are read from the answer alone. Completions are never split (as in vLLM).

- `deepseek_r1`: everything before `</think>` is thinking (a leading `<think>` dropped): the model's chat
  template may have opened the block itself (DeepSeek-R1, QwQ, Qwen3-Thinking-2507). No `</think>`: all of
  it is thinking (an answer cut short while it thought).
- `qwen3`: thinking only when the answer opens with `<think>` (Qwen3's hybrid models; with
  `chat_template_kwargs: {"enable_thinking": false}` the template closes an empty block in the prompt and
  the answer is all content).
- `openai_gptoss`: gpt-oss's harmony channels (harmony.py): the `analysis` channel is thinking, the `final`
  channel (and commentary to the user) content; its messages to functions go on to the `openai` tool-call
  parser.
- `glm45`: GLM-4.5's (to 4.7's) thinking, read as `qwen3`'s: a block the answer opens with `<think>` (its
  template closes an empty one in the prompt when thinking is off).
- `deepseek_v3`: DeepSeek-V3.1's and V3.2's, whose template opens the thinking in the prompt only when the
  request's `chat_template_kwargs` say `thinking` (its variable): read as `deepseek_r1`'s then, and as no
  thinking otherwise (vLLM's reading).

The text between the tags is kept as written (newlines included), as vLLM keeps it. Pure: text in, parts out.
"""

from __future__ import annotations

from specdec import tensor_names as tn
from specdec.gateway import harmony
from specdec.gateway.tools import HARMONY_REASONING

# The same tags gate a structured output's grammar in the orchestrator (decoding/thinking.py)
OPEN, CLOSE = tn.THINK_OPEN, tn.THINK_CLOSE
HARMONY = HARMONY_REASONING  # (tools.py's openai parser implies it)
ALIASES = {"glm45": "qwen3"}  # vLLM's names of a format another parser reads
PER_REQUEST = "deepseek_v3"  # deepseek_r1's where the request asks for thinking, else none
PARSERS = (*tn.REASONING_PARSERS, *ALIASES, PER_REQUEST)


def for_request(parser: str | None, template_kwargs) -> str | None:
    """The parser (one of tn.REASONING_PARSERS, the server's) that reads a request's answer, given the server's
    `--reasoning-parser` and the request's chat_template_kwargs; None: the answer has no thinking."""
    if parser == PER_REQUEST:
        kwargs = template_kwargs if isinstance(template_kwargs, dict) else {}
        return "deepseek_r1" if kwargs.get("thinking") else None  # (what DeepSeek's template reads)
    return ALIASES.get(parser, parser)


def split(text: str, parser: str) -> tuple[str | None, str | None]:
    """A whole answer's (thinking, content); None for a part it has none of."""
    stream = ReasoningStream(parser)
    thinking, content = stream.feed(text)
    more_thinking, more_content = stream.finish()
    return (thinking + more_thinking) or None, (content + more_content) or None


def ReasoningStream(parser: str):  # noqa: N802 (what callers construct: a stream of the parser's kind)
    """Splits an answer's text deltas as they come: `feed(delta)` -> (thinking delta, content delta);
    `finish()` after the last one. A tag split across deltas is held back until it is whole (a delta may
    then give nothing of either part); the parts streamed add up to `split`'s."""
    if parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r} (one of {', '.join(PARSERS)})")
    return harmony.HarmonyStream() if parser == HARMONY else _TagStream(parser)


class _TagStream:
    """The thinking between <think> and </think> (deepseek_r1, qwen3)."""

    def __init__(self, parser: str):
        self.parser = parser
        self._state = "start"  # start (is the text opened with <think>?), thinking, answer
        self._held = ""  # text not yet given out: a possible start of the next tag

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        thinking = content = ""
        if self._state == "start":
            if OPEN.startswith(text):  # "", "<", "<th" ...: cannot tell yet
                self._held = text
                return "", ""
            if text.startswith(OPEN):
                text, self._state = text[len(OPEN):], "thinking"
            else:
                self._state = "thinking" if self.parser == "deepseek_r1" else "answer"
        if self._state == "thinking":
            end = text.find(CLOSE)
            if end < 0:
                keep = harmony.held_back(text, CLOSE)
                thinking, self._held = text[:len(text) - keep], text[len(text) - keep:]
                return thinking, ""
            thinking, text, self._state = text[:end], text[end + len(CLOSE):], "answer"
        content = text
        return thinking, content

    def finish(self) -> tuple[str, str]:
        """What was held back: the end of an answer never closes a tag it began."""
        held, self._held = self._held, ""
        if self._state == "start":  # the whole answer was a beginning of <think> (or empty)
            return ("", held) if self.parser == "qwen3" else (held, "")
        return (held, "") if self._state == "thinking" else ("", held)


def thinking_end(text: str, parser: str) -> int:
    """Where a whole answer's thinking block ends in its text (past its `</think>`; the text's end when it
    never closes; 0 when it has none), as `split` reads it."""
    if parser == HARMONY:
        return harmony.thinking_end(text)
    if parser == "qwen3" and not text.startswith(OPEN):
        return 0
    end = text.find(CLOSE)
    return len(text) if end < 0 else end + len(CLOSE)


def thinking_tokens(ids: list[int], decode, parser: str) -> int:
    """How many of an answer's tokens `ids` are its thinking block, tags included (`usage`'s reasoning_tokens):
    the fewest leading tokens whose text (`decode(ids) -> str`, as the server decodes them) reaches the block's
    end. Read from the text, so a tag the model spells with other tokens than the tokenizer would counts alike."""
    text = decode(ids)
    end = thinking_end(text, parser)
    if end == 0 or end >= len(text):  # no thinking, or all of it (never closed)
        return 0 if end == 0 else len(ids)
    low, high = 1, len(ids)  # the text of ids[:high] reaches the end; find the fewest tokens that do
    while low < high:
        middle = (low + high) // 2
        if len(decode(ids[:middle])) >= end:
            high = middle
        else:
            low = middle + 1
    return high
