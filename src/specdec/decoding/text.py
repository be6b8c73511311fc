"""Tokenizer loading and incremental detokenization.

Streaming sends token ids round by round, and postprocessing turns each chunk into text given a few
preceding tokens as context. A chunk whose text would end inside a multi-byte character (an emoji or
CJK character split over byte-level tokens decodes to U+FFFD) is held back until the character is
complete, so concatenated stream deltas equal the non-streamed text exactly. Stop words are matched on
text, across rounds, by the same emitter.

Why not `tokenizers.decoders.DecodeStream`: it holds back incomplete characters too, but it is a state
machine stepped token by token inside one process, while here the orchestrator decides what to send and
the stateless postprocessing model decodes it from ids plus a few context tokens; and stop words need
to hold back text that is complete but may begin a stop word, which it does not do.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from specdec import tensor_names as tn
from specdec.decoding import json_text

REPLACEMENT_CHAR = "\ufffd"
WORD_MARK = "\u2581"  # SentencePiece's space, which begins a word's token
CONTEXT_TOKENS = 6  # preceding tokens sent with a chunk: enough for byte-level and SentencePiece merges


def load_tokenizer(path: str, chat_template: str | None = None):
    """A Hugging Face tokenizer from a model/tokenizer directory or a GGUF file; `chat_template` (Jinja text,
    see `read_chat_template`) replaces the tokenizer's own template where given.

    A directory whose tokenizer_config.json names `TokenizersBackend` and no code of its own (what
    transformers 5 writes for a tokenizer.json tokenizer: both pairs here) is loaded with that class:
    AutoTokenizer returns the same class for it, but first imports the model-configuration machinery and
    with it torch, which stubs that need text only (preprocessing, postprocessing) would then load and hold
    for nothing (hundreds of MB and seconds at load). Anything else goes through AutoTokenizer."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer_path {path!r} does not exist")
    if p.is_dir() and _names_tokenizers_backend(p / "tokenizer_config.json"):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        tokenizer = TokenizersBackend.from_pretrained(str(p))
    else:
        from transformers import AutoTokenizer

        tokenizer = (AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name) if p.is_file()
                     else AutoTokenizer.from_pretrained(str(p)))
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


_JINJA_MARKS = ("{%", "{{")  # what any chat template contains and no file name does


def read_chat_template(value: str, field: str) -> str:
    """A chat template given as vLLM's `--chat-template` takes it: the path of a Jinja file (its text), or the
    template itself (text with Jinja's `{%` or `{{`). ValueError naming `field` for a path that is no file
    or a file that is no template."""
    try:
        is_file = Path(value).is_file()
    except OSError:  # a template longer than a path may be
        is_file = False
    if is_file:
        try:
            text = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{field}: cannot read {value!r} ({exc})") from None
        if not any(mark in text for mark in _JINJA_MARKS):
            raise ValueError(f"{field}: {value!r} holds no Jinja template (no '{{%' or '{{{{')")
        return text
    if any(mark in value for mark in _JINJA_MARKS):
        return value
    raise ValueError(f"{field}: {value!r} is neither a file nor a Jinja template")


MAX_REQUEST_TEMPLATE_CHARS = 1 << 20  # a request's own template: more is no template anyone writes


def request_template(text: str, field: str) -> str:
    """A request's own chat template (vLLM's `chat_template` field), checked to be Jinja text of sane size
    (ValueError naming `field`); whether it renders is found when it does."""
    if len(text) > MAX_REQUEST_TEMPLATE_CHARS:
        raise ValueError(f"{field} has {len(text)} characters, more than {MAX_REQUEST_TEMPLATE_CHARS}")
    if not any(mark in text for mark in _JINJA_MARKS):
        raise ValueError(f"{field} is no Jinja template (no '{{%' or '{{{{')")
    return text


def check_chat_template(tokenizer, field: str, content_format: str = "auto") -> None:
    """The tokenizer's chat template renders a one-message conversation with the assistant's turn opened
    (what every chat request asks of it): a template that does not compile, or fails on the plainest
    conversation, is refused at load (ValueError naming `field`) rather than at every request."""
    try:
        hello = formatted(tokenizer, [{"role": "user", "content": "Hello"}], None, content_format)
        tokenizer.apply_chat_template(hello, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - jinja2's TemplateSyntaxError, or whatever the template raises
        raise ValueError(f"{field}: the chat template fails on a one-message conversation "
                         f"({type(exc).__name__}: {exc})") from None


def _names_tokenizers_backend(config: Path) -> bool:
    try:
        settings = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return settings.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in settings


def vocabulary_mismatch(draft_tokenizer, target_tokenizer) -> str | None:
    """What differs between two tokenizers' vocabularies (None when they map every token to the same id).

    Speculative decoding compares the two models' distributions id by id: a draft that numbers tokens
    differently proposes ids that mean something else to the target."""
    draft, target = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft == target:
        return None
    differ = sorted(token for token in draft.keys() | target.keys() if draft.get(token) != target.get(token))
    example = differ[0]
    return (f"{len(draft)} vs {len(target)} tokens, {len(differ)} mapped differently "
            f"(e.g. {example!r}: id {draft.get(example)} in the draft, {target.get(example)} in the target)")


# Every file a Hugging Face tokenizer's vocabulary is read from (fast, slow and sentencepiece ones, and the
# added and special tokens the configs add).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model")


def same_tokenizer_files(a: str | Path, b: str | Path) -> bool:
    """Whether two model directories hold the same tokenizer files, byte for byte (each of TOKENIZER_FILES
    in both or in neither): then they number tokens alike, and `vocabulary_mismatch` need not load either
    (a draft copied beside its target, as every pair here is; loading two tokenizers costs a model process
    seconds at every start and restart)."""
    a, b = Path(a), Path(b)
    if not (a.is_dir() and b.is_dir() and (a / "tokenizer_config.json").is_file()):
        return False
    for name in TOKENIZER_FILES:
        here, there = a / name, b / name
        if here.is_file() != there.is_file():
            return False
        if here.is_file() and (here.stat().st_size != there.stat().st_size or here.read_bytes() != there.read_bytes()):
            return False
    return True


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 bytes (GPT-2's alphabet, which its tokens are written
    in): the printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


def token_bytes(tokenizer):
    """token id -> the bytes it stands for, as OpenAI's log-probabilities give them: a character split over
    several tokens (an emoji in byte-level BPE, SentencePiece's byte-fallback <0xNN> tokens) joins from its
    tokens' bytes, where each token's text alone is U+FFFD. Byte-level tokens are read through GPT-2's
    alphabet; SentencePiece's byte-fallback ones as their byte, its others with their word marks as spaces
    (decoded alone, a token's leading space is stripped); any other token (added ones, or another
    tokenizer's) is its text alone as UTF-8."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:  # the decoder's JSON (a Sequence lists its steps): which kinds of tokens it reads
        kinds = bytes(decoder.__getstate__()).decode() if decoder is not None else ""
    except (AttributeError, TypeError, ValueError):
        kinds = ""
    byte_level = '"ByteLevel"' in kinds
    pieces = not byte_level and ('"ByteFallback"' in kinds or '"Metaspace"' in kinds)  # SentencePiece's
    alphabet = _byte_level_alphabet() if byte_level else {}
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})

    def of(token: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token) if token not in added else None
        if isinstance(piece, str):
            if byte_level and piece and all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            if pieces:
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    return bytes([int(piece[3:5], 16)])
                return piece.replace(WORD_MARK, " ").encode("utf-8")
        return tokenizer.decode([token]).encode("utf-8")
    return functools.lru_cache(maxsize=1 << 17)(of)


def token_text(tokenizer, of_bytes=None):
    """token id -> its text as OpenAI's log-probabilities name it: the bytes it stands for (`token_bytes`, or
    `of_bytes`, that function already made) as UTF-8, a byte that completes no character U+FFFD (as decoding
    it alone gives). A SentencePiece token keeps its word mark's space, which decoding it alone strips: a text's
    tokens join to it."""
    of = of_bytes if of_bytes is not None else token_bytes(tokenizer)
    return functools.lru_cache(maxsize=1 << 17)(lambda token: of(token).decode("utf-8", "replace"))


def decode(tokenizer, ids: list[int], skip_special: bool = True) -> str:
    """The text of `ids`; special tokens left out unless `skip_special` is false (vLLM's skip_special_tokens:
    a tool-call parser reading a model's [TOOL_CALLS] needs them)."""
    return tokenizer.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)


def decode_delta(tokenizer, prefix_ids: list[int], ids: list[int], skip_special: bool = True) -> str:
    """Text that `ids` add after `prefix_ids` (the context changes how a token's leading space decodes)."""
    if not prefix_ids:
        return decode(tokenizer, ids, skip_special)
    before = decode(tokenizer, prefix_ids, skip_special)
    after = decode(tokenizer, prefix_ids + ids, skip_special)
    if after.startswith(before):
        return after[len(before):]
    return decode(tokenizer, ids, skip_special)  # a normalizer rewrote the prefix: fall back to the chunk alone


def with_prompt(tokenizer, prompt_ids: list[int], ids: list[int], length: int,
                skip_special: bool = True) -> tuple[list[int], int]:
    """A whole answer's tokens with the prompt's before them (TensorRT-LLM's exclude_input_in_output false),
    and the characters of their text to keep (`length`: of `ids`' own text; -1 all): what a stop word cut
    from the end stays cut."""
    if length < 0:
        return prompt_ids + ids, -1
    cut = len(decode(tokenizer, ids, skip_special)) - length  # characters dropped at the end
    return prompt_ids + ids, len(decode(tokenizer, prompt_ids + ids, skip_special)) - cut


@dataclass(frozen=True)
class Emission:
    ids: list[int]  # tokens to send now
    prefix_ids: list[int]  # tokens sent before them: the decoding context
    text: str  # the text they add, already cut at a stop word
    text_length: int  # characters of decode_delta(prefix_ids, ids) to keep; -1 = all
    stopped: bool  # a stop word was found: generation ends here


def joined(first: Emission | None, then: Emission | None) -> Emission | None:
    """Two consecutive emissions as one response sends them (a streamed response held back to be sent with
    the next): the tokens of both after the first's context, the text of both, cut where the second is cut
    (an emission before the last is never cut: a cut ends the generation)."""
    if first is None or then is None:
        return first or then
    length = -1 if then.text_length < 0 else len(first.text) + then.text_length
    return Emission(first.ids + then.ids, first.prefix_ids, first.text + then.text, length, then.stopped)


class TextEmitter:
    """Decides which generated tokens may be sent, and where a stop word ends the text.

    Held back: a trailing incomplete character, and trailing text that could be the start of a stop
    word (it may complete in the next round). A stop word found across rounds cuts the text at its
    first character (with `include_stop`, after its last); the tokens it spans are sent with a text_length
    so nothing past the cut shows. The text leaves special tokens out unless `skip_special` is false (then a
    stop word may be one's text).
    """

    def __init__(self, tokenizer, stop_words: tuple[str, ...] = (), include_stop: bool = False,
                 skip_special: bool = True):
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.skip_special = skip_special
        self.stop_words = tuple(w for w in stop_words if w)
        self.longest_stop = max((len(w) for w in self.stop_words), default=0)
        self.emitted: list[int] = []  # tokens already sent
        self.pending: list[int] = []  # tokens held back
        self.text = ""  # text already sent

    def push(self, new_ids: list[int], final: bool) -> Emission | None:
        """Add a round's tokens; returns what to send now, or None to wait for more."""
        self.pending += new_ids
        if not self.pending:
            return None
        prefix = self.emitted[-CONTEXT_TOKENS:]
        pending_text = decode_delta(self.tokenizer, prefix, self.pending, self.skip_special)
        stop_at = self._find_stop(pending_text)
        if stop_at is not None:
            return self._emit(len(self.pending), prefix, pending_text[:stop_at], stop_at, stopped=True)
        if final:
            return self._emit(len(self.pending), prefix, pending_text, -1, stopped=False)
        safe = len(pending_text) - self._held_chars(pending_text)
        for count in range(len(self.pending), 0, -1):
            text = pending_text if count == len(self.pending) else decode_delta(
                self.tokenizer, prefix, self.pending[:count], self.skip_special)
            if len(text) <= safe and not text.endswith(REPLACEMENT_CHAR) and pending_text.startswith(text):
                return self._emit(count, prefix, text, -1, stopped=False)
        return None

    def _find_stop(self, pending_text: str) -> int | None:
        """Index in pending_text where the text ends at the first stop word: where it starts (it may begin in
        sent text's tail), or with include_stop where it ends (of the words starting there, the first listed)."""
        if not self.stop_words:
            return None
        tail = self.text[-(self.longest_stop - 1):] if self.longest_stop > 1 else ""
        window = tail + pending_text
        hits = [(pos, word) for word in self.stop_words if (pos := window.find(word)) >= 0]
        if not hits:
            return None
        start = min(pos for pos, _ in hits)
        if self.include_stop:
            return start + len(next(word for pos, word in hits if pos == start)) - len(tail)
        return max(0, start - len(tail))

    def _held_chars(self, pending_text: str) -> int:
        """Length of the longest tail of pending_text that is a proper prefix of a stop word."""
        for length in range(min(self.longest_stop - 1, len(pending_text)), 0, -1):
            tail = pending_text[-length:]
            if any(w.startswith(tail) for w in self.stop_words):
                return length
        return 0

    def _emit(self, count, prefix, text, text_length, stopped) -> Emission:
        ids, self.pending = self.pending[:count], self.pending[count:]
        self.emitted += ids
        self.text += text
        return Emission(ids, prefix, text, text_length, stopped)


def chat_messages(raw: str, field: str) -> list[dict]:
    """A chat (the `messages` input): a JSON list of {"role": one of CHAT_ROLES, "content": text}, checked;
    ValueError names `field` and the message at fault. An assistant message may carry its thinking
    (`reasoning_content`, which the template also reads as `thinking`) and `tool_calls` (OpenAI's
    {"id", "type": "function", "function": {"name", "arguments"}}; its content then may be null), a tool
    message its `tool_call_id`; a call's arguments, a JSON string in OpenAI's form, reach the chat template
    as the object they encode (what templates that render calls read)."""
    messages = _json(raw, field)
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"input '{field}' must be a non-empty JSON list of {{\"role\", \"content\"}} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"input '{field}'[{i}] must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if role not in tn.CHAT_ROLES:
            raise ValueError(f"input '{field}'[{i}].role must be one of {list(tn.CHAT_ROLES)}, got {role!r}")
        calls = message.get("tool_calls")
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"input '{field}'[{i}].content must be a string, got {type(content).__name__}")
        allowed = {"role", "content", "name"} | ({"tool_calls", tn.REASONING_CONTENT} if role == "assistant"
                                                 else set()) | ({"tool_call_id"} if role == "tool" else set())
        unknown = sorted(set(message) - allowed)
        if unknown:
            raise ValueError(f"input '{field}'[{i}] has fields this server does not take: {unknown}")
        entry = {key: message[key] for key in ("role", "content", "name", "tool_call_id") if key in message}
        entry["content"] = content
        if calls:
            entry["tool_calls"] = _tool_calls(calls, f"input '{field}'[{i}].tool_calls")
        thinking = message.get(tn.REASONING_CONTENT)
        if thinking is not None:  # the template reads it under either name (Qwen3's, gpt-oss's)
            if not isinstance(thinking, str):
                raise ValueError(f"input '{field}'[{i}].{tn.REASONING_CONTENT} must be a string")
            entry[tn.REASONING_CONTENT] = entry[tn.TEMPLATE_THINKING] = thinking
        out.append(entry)
    return out


def _json(raw: str, field: str):
    try:
        return json_text.parse(raw)
    except ValueError as exc:
        raise ValueError(f"input '{field}' is not JSON ({exc})") from None


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json_text.parse(arguments) if arguments.strip() else {}
            except ValueError:
                raise ValueError(f"{where}[{j}].function.arguments is not JSON") from None
        out.append({**call, "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return out


def chat_tools(raw: str, field: str) -> list[dict]:
    """The `tools` input: a JSON list of OpenAI's function tools, checked (ValueError naming `field`)."""
    tools = _json(raw, field)
    if not isinstance(tools, list):
        raise ValueError(f"input '{field}' must be a JSON list of tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(function, dict) or tool.get("type", "function") != "function"
                or not isinstance(function.get("name"), str) or not function["name"]):
            raise ValueError(f"input '{field}'[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
    return tools


def chat_template_kwargs(raw: str, field: str) -> dict:
    """The `chat_template_kwargs` input (vLLM's request field): a JSON object of more variables for the chat
    template (e.g. Qwen3's `enable_thinking`), checked (ValueError naming `field`). A name that is one of the
    template call's own settings (`add_generation_prompt`, `tools`, `tokenize` ...) is refused: the
    server sets those."""
    return template_variables(_json(raw, field), field)


def template_variables(settings, field: str) -> dict:
    """`chat_template_kwargs` as an object already parsed (the OpenAI API's /tokenize), checked as above."""
    if not isinstance(settings, dict):
        raise ValueError(f"input '{field}' must be a JSON object of the chat template's variables")
    own = sorted(set(settings) & (_TEMPLATE_CALL_SETTINGS | {"conversation", "messages"}))
    if own:
        raise ValueError(f"input '{field}': '{own[0]}' is set by the server, not by the chat template's variables")
    documents = settings.get("documents")
    if documents is not None and not (isinstance(documents, list) and all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents)):
        raise ValueError(f"input '{field}': 'documents' must be a list of objects of strings (a document's "
                         "'title', 'text' ...)")
    return settings


# apply_chat_template's own parameters (transformers 5): everything else it passes on to the template. Its
# `documents` (a RAG template's sources: vLLM's request field, which vLLM hands it the same way) is a variable
# of the request's like any other, checked in template_variables.
_TEMPLATE_CALL_SETTINGS = frozenset({
    "tools", "chat_template", "add_generation_prompt", "continue_final_message", "tokenize",
    "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


# How a message's content reaches the chat template (vLLM's --chat-template-content-format): `string`, the text;
# `openai`, OpenAI's list of parts ([{"type": "text", "text": ...}]), for templates that loop over a message's
# parts (with a string they would loop over its characters); `auto`: `openai` for a template that loops over one
CONTENT_FORMATS = ("auto", "string", "openai")


@functools.lru_cache(maxsize=16)
def template_content_format(template: str) -> str:
    """`openai` when the Jinja template loops over a message's content (`for part in message['content']`,
    `message.content`, a filter of it, or a name set to it), else `string` (as vLLM's `auto` reads templates)."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return "string"  # (rendering it will say what is wrong)

    def content(node) -> bool:
        while isinstance(node, nodes.Filter):
            node = node.node
        return (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content"
                or isinstance(node, nodes.Getattr) and node.attr == "content")

    names = {assign.target.name for assign in tree.find_all(nodes.Assign)
             if isinstance(assign.target, nodes.Name) and content(assign.node)}
    for loop in tree.find_all(nodes.For):
        looped = loop.iter
        while isinstance(looped, nodes.Filter):
            looped = looped.node
        if content(looped) or isinstance(looped, nodes.Name) and looped.name in names:
            return "openai"
    return "string"


def content_parts(messages: list[dict]) -> list[dict]:
    """Each message's text content as OpenAI's list of parts (the `openai` content format); "" as no parts."""
    return [{**message, "content": [{"type": "text", "text": message["content"]}] if message["content"] else []}
            if isinstance(message.get("content"), str) else message for message in messages]


def formatted(tokenizer, messages: list[dict], template: str | None, content_format: str) -> list[dict]:
    """The messages with their content as the template in use (`template`, else the tokenizer's) takes it."""
    if content_format == "auto":
        used = template if template is not None else tokenizer.chat_template
        texts = used.values() if isinstance(used, dict) else [used or ""]  # (named templates: any of them)
        content_format = "openai" if any(template_content_format(t) == "openai" for t in texts) else "string"
    return content_parts(messages) if content_format == "openai" else messages


def chat_ids(tokenizer, messages: list[dict], tools: list[dict] | None, field: str,
             template_kwargs: dict | None = None, template: str | None = None, content_format: str = "auto",
             continue_final: bool = False) -> list[int]:
    """A chat's prompt tokens: the tokenizer's chat template (or `template`, a request's own) over the messages
    (and the tools, which the template renders where it knows how), the assistant's turn opened (or, with
    `continue_final`, its last message, an assistant's, left open to be continued: tn.CONTINUE_FINAL_MESSAGE),
    with `template_kwargs` as more of the template's variables (`chat_template_kwargs`) and the messages'
    content in `content_format` (CONTENT_FORMATS); ValueError naming `field` (tn.CHAT_TEMPLATE for a request's
    own template) when the template refuses them."""
    if continue_final and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError(f"input '{tn.CONTINUE_FINAL_MESSAGE}': the chat's last message must be the assistant's "
                         "(the answer it continues)")
    own = {} if template is None else {"chat_template": template}
    messages = formatted(tokenizer, messages, template, content_format)
    try:
        return list(tokenizer.apply_chat_template(messages, tools=tools or None,
                                                  add_generation_prompt=not continue_final,
                                                  continue_final_message=continue_final, tokenize=True,
                                                  return_dict=False, **own, **(template_kwargs or {})))
    except Exception as exc:  # noqa: BLE001 - a template may raise anything (e.g. roles it refuses)
        name = tn.CHAT_TEMPLATE if template is not None else field
        raise ValueError(f"input '{name}': the chat template refused it ({type(exc).__name__}: {exc})") from None
