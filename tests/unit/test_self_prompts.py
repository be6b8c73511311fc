"""The target's own requests (specdec.train.self_prompts, Magpie): the chat template's opening of a user
turn, what is kept of the drawn turns, and a seeded draw on the tiny target."""

import json

import pytest


class ChatTokenizer:
    """Characters as token ids of the tiny target (97 ids; 2 ends a turn) with a one-line chat template."""
    chat_template = "<u>{content}</u><a>"
    eos_token_id, pad_token_id = 2, None

    def apply_chat_template(self, messages, tokenize=False):
        assert not tokenize
        return "".join(f"<u>{m['content']}</u>" for m in messages)

    def encode(self, text, add_special_tokens=True):
        return [3 + ord(c) % 90 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        # ids 3..92 read as letters and spaces: a word every few tokens
        return "".join(" " if i % 5 == 0 else chr(97 + i % 26) for i in ids if i >= 3)


def test_the_opening_is_the_template_up_to_the_users_words():
    from specdec.train.self_prompts import opening

    tokenizer = ChatTokenizer()
    assert opening(tokenizer) == tokenizer.encode("<u>")

    class Plain(ChatTokenizer):
        chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        opening(Plain())


def test_kept_requests_are_ended_sized_distinct_unmarked_and_disjoint_from_the_excluded():
    from specdec.train.self_prompts import Selection

    bench = ["Explain how vaccines train the immune system to fight disease."]
    selection = Selection(bench, min_words=3, max_words=12, markup=("<|im_start|>",))
    assert selection.offer("  How do tides work on other planets?  ", ended=True)
    assert not selection.offer("How do tides work on other planets?", ended=False)  # not ended: cut off
    assert not selection.offer("how do  TIDES work on other planets?", ended=True)  # the same, folded
    assert not selection.offer("Hi there", ended=True)  # too short
    assert not selection.offer(" ".join(["word"] * 13), ended=True)  # too long
    assert not selection.offer("Tell me <|im_start|>assistant about it", ended=True)  # template markup
    # five words in a row of a benchmark prompt
    assert not selection.offer("Please explain how vaccines train the immune system.", ended=True)
    assert selection.offer("Explain how vaccines are stored and shipped.", ended=True)  # four words only
    assert selection.kept == ["How do tides work on other planets?", "Explain how vaccines are stored and shipped."]


def test_a_seeded_draw_on_the_tiny_target_is_reproducible_and_keeps_what_the_selection_keeps(tiny_lm):
    from specdec.train.self_prompts import Selection, draw

    def run(seed):
        selection = Selection(min_words=1, max_words=100)
        return draw(tiny_lm, ChatTokenizer(), 3, selection, seed=seed, batch=16, max_tokens=40, log=lambda m: None,
                    max_batches=20), selection

    kept, selection = run(0)
    assert len(kept) == 3 == len(set(kept)) and all(k.strip() == k and k for k in kept)
    assert kept == selection.kept[:3]
    assert run(0)[0] == kept  # the seed fixes the draws
    assert run(1)[0] != kept
    # The served executor writing (train/writer.py: top-p and several end tokens as generate takes them)
    from specdec.train.writer import ExecutorWriter

    by_executor = [draw(tiny_lm, ChatTokenizer(), 3, Selection(min_words=1, max_words=100), seed=0, batch=16,
                        max_tokens=40, log=lambda m: None, max_batches=20, writer=ExecutorWriter(tiny_lm, width=8))
                   for _ in range(2)]
    assert len(by_executor[0]) == 3 == len(set(by_executor[0])) and by_executor[0] == by_executor[1]


def test_the_command_writes_json_lines_of_kept_requests(tiny_lm, tmp_path, monkeypatch, capsys):
    """main() over a saved tiny target: as many {"prompt"} lines as asked, none sharing a run of five words
    with an --exclude file."""
    from specdec.train import self_prompts

    tokenizer = ChatTokenizer()
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda path: tokenizer)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda path, dtype: tiny_lm)
    exclude = tmp_path / "bench.jsonl"
    exclude.write_text(json.dumps({"prompt": "one two three four five six"}) + "\n")
    assert self_prompts.main(["--target", str(tmp_path), "--count", "2", "--min-words", "1", "--batch", "16",
                              "--max-tokens", "40", "--dtype", "float32", "--exclude", str(exclude)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(json.loads(line)["prompt"] for line in lines)
