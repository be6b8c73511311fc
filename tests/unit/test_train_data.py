"""The training command's data (specdec.train.data): the target's own answers, greedy and sampled,
generated in batches of similar lengths, and its features over each prompt + answer."""

import torch

from specdec.train.data import answer_and_featurize


class CharTokenizer:
    """Characters as token ids of the tiny target's vocabulary (no chat template): a stand-in for a
    tokenizer, which this code only asks to encode and for its end and padding ids."""
    eos_token_id, pad_token_id = 2, None

    def encode(self, text, add_special_tokens=True):
        return [1] + [3 + ord(c) % 90 for c in text]


PROMPTS = ["a short one", "a much longer prompt than the others", "mid length one", "x"]


def test_each_prompt_gets_its_greedy_answer_then_seeded_sampled_ones_in_prompt_order(tiny_lm):
    tokenizer = CharTokenizer()
    samples = answer_and_featurize(tiny_lm, tokenizer, PROMPTS, (0, 1, 1), 10, chat_template=False, batch=3,
                                   sampled=2, temperature=1.0, seed=3, log=lambda message: None)
    assert len(samples) == 3 * len(PROMPTS)
    for p, prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(prompt)
        greedy, *drawn = samples[3 * p:3 * p + 3]
        assert all(s.prompt_length == len(ids) and s.tokens[:len(ids)].tolist() == ids for s in (greedy, *drawn))
        # Batched with other lengths (left-padded), the greedy answer is the prompt's own greedy answer
        alone = tiny_lm.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=2)
        answer = alone[0, len(ids):].tolist()
        assert greedy.tokens[len(ids):].tolist() == (answer[:answer.index(2) + 1] if 2 in answer else answer)
        for s in (greedy, *drawn):
            assert s.features.shape == (len(s.tokens), 3 * 32) and s.final.shape == (len(s.tokens), 32)
            assert torch.equal(s.greedy, tiny_lm(s.tokens[None]).logits[0].argmax(-1))
    assert any(not torch.equal(samples[3 * p].tokens, samples[3 * p + 1].tokens) for p in range(len(PROMPTS)))
    again = answer_and_featurize(tiny_lm, tokenizer, PROMPTS, (0, 1, 1), 10, chat_template=False, batch=3,
                                 sampled=2, temperature=1.0, seed=3, log=lambda message: None)
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(samples, again))  # the seed fixes the draws


def test_prompt_files_of_every_common_shape_give_their_first_user_turn(tmp_path):
    import json

    import pytest

    from specdec.train.data import PROMPTS, load_prompts

    records = [{"prompt": "one"}, "two",
               {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "three"},
                             {"role": "assistant", "content": "not the target's"}, {"role": "user", "content": "no"}]},
               {"conversations": [{"from": "human", "value": "four"}, {"from": "gpt", "value": "x"}]},
               {"conversations": [{"from": "gpt", "value": "no user turn: skipped"}]}]
    lines = tmp_path / "prompts.jsonl"
    lines.write_text("\n".join(json.dumps(r) if isinstance(r, dict) else r for r in records) + "\n\n")
    array = tmp_path / "sharegpt.json"
    array.write_text(json.dumps(records))
    assert load_prompts(lines) == load_prompts(array) == ["one", "two", "three", "four"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"question": "what shape is this"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a prompt record"):
        load_prompts(bad)
    assert len(load_prompts(PROMPTS)) == 1800  # the shipped set


def test_the_shipped_set_is_what_the_composer_writes():
    """prompts.jsonl is compose_prompts' output (regenerated, not edited by hand), every prompt distinct."""
    from specdec.train.compose_prompts import COUNT, compose
    from specdec.train.data import load_prompts

    shipped = load_prompts()
    assert shipped == compose() and len(set(shipped)) == len(shipped) == COUNT


def test_the_shipped_training_prompts_share_no_prompt_and_no_phrase_with_the_benchmarks():
    """Held-out figures and bench rows are of text the heads never trained on: no benchmark prompt is a
    training one, and none shares a run of 5 words with one or with a grounded instruction."""
    from bench.speculative_bench import load_prompts as bench_prompts
    from specdec.train.data import GROUNDED_INSTRUCTIONS, SELF_PROMPTS, load_prompts
    from specdec.train.self_prompts import word_runs as runs

    training = load_prompts() + load_prompts(SELF_PROMPTS)
    trained_runs = set().union(*(runs(p) for p in training + list(GROUNDED_INSTRUCTIONS)))
    for kind in ("grounded", "open"):
        for prompt in bench_prompts(kind, None):
            assert prompt not in training and not runs(prompt) & trained_runs, (kind, prompt[:80])


def test_the_shipped_self_written_requests_are_what_the_selection_keeps():
    """prompts_self.jsonl: the default pair's target's own requests, as self_prompts keeps them (distinct,
    4-120 words, no chat markup)."""
    from specdec.train.data import SELF_PROMPTS, load_prompts
    from specdec.train.self_prompts import Selection

    shipped = load_prompts(SELF_PROMPTS)
    selection = Selection(markup=("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    assert len(shipped) == 4799 and all(selection.offer(p, ended=True) for p in shipped)  # offer: distinct too


class TextTokenizer(CharTokenizer):
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + (i - 3) % 26) for i in ids if not (skip_special_tokens and i < 3))


def test_grounded_prompts_put_an_instruction_over_one_long_enough_answer_each():
    from specdec.train.data import GROUNDED_INSTRUCTIONS, Sample, grounded_prompts

    def sample(answer):
        tokens = torch.tensor([1, 5, 6] + answer)
        return Sample(tokens, torch.zeros(len(tokens), 2), torch.zeros(len(tokens), 2), tokens, prompt_length=3)

    tokenizer = TextTokenizer()
    samples = [sample([3] * 6 + [2]), sample([4] * 5), sample([10, 11, 12, 13, 14, 15]), sample([7] * 3)]
    made = grounded_prompts(tokenizer, samples, 5, seed=1, min_tokens=6)
    # The end token does not count nor show; answers shorter than min_tokens are not used
    assert sorted(prompt.split("\n\n", 1)[1] for prompt in made) == ["aaaaaa", "hijklm"]
    assert all(prompt.split("\n\n", 1)[0] in GROUNDED_INSTRUCTIONS for prompt in made)
    assert grounded_prompts(tokenizer, samples, 5, seed=1, min_tokens=6) == made  # seeded
    assert len(grounded_prompts(tokenizer, samples, 1, seed=1, min_tokens=6)) == 1


def test_another_copy_of_the_target_can_write_the_answers_while_features_stay_the_targets(tiny_lm):
    """`writer` generates (e.g. the target in bfloat16); the features, final states and greedy tokens are
    still the model's over what the writer wrote."""
    import copy

    writer = copy.deepcopy(tiny_lm)
    with torch.no_grad():
        for parameter in writer.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)  # a different model: different answers
    tokenizer = CharTokenizer()
    by_writer = answer_and_featurize(tiny_lm, tokenizer, PROMPTS, (0, 1, 1), 10, chat_template=False, batch=2,
                                     log=lambda message: None, writer=writer)
    by_model = answer_and_featurize(tiny_lm, tokenizer, PROMPTS, (0, 1, 1), 10, chat_template=False, batch=2,
                                    log=lambda message: None)
    assert any(not torch.equal(a.tokens, b.tokens) for a, b in zip(by_writer, by_model))
    for p, s in enumerate(by_writer):
        ids = tokenizer.encode(PROMPTS[p])
        alone = writer.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=2)[0, len(ids):]
        answer = alone.tolist()
        assert s.tokens[len(ids):].tolist() == (answer[:answer.index(2) + 1] if 2 in answer else answer)
        with torch.no_grad():
            out = tiny_lm(s.tokens[None], output_hidden_states=True)
        assert torch.equal(s.greedy, out.logits[0].argmax(-1))
        torch.testing.assert_close(s.final, out.hidden_states[-1][0].float())


def test_answered_conversations_saved_without_features_give_the_same_samples_again(tiny_lm, tmp_path):
    """save_answers keeps tokens and prompt lengths (gzipped JSON lines); load_answers + featurize give back
    the samples answer_and_featurize made, features and all; a file of another tokenizer is refused by name."""
    import pytest

    from specdec.train.data import featurize, load_answers, save_answers

    class Tokenizer(CharTokenizer):
        name_or_path = "chars"

        def __len__(self):
            return 97

    tokenizer = Tokenizer()
    samples = answer_and_featurize(tiny_lm, tokenizer, PROMPTS, (0, 1, 1), 10, chat_template=False, batch=3,
                                   log=lambda message: None)
    path = tmp_path / "answers.jsonl.gz"
    assert save_answers(path, samples[:3], samples[3:], tokenizer) == sum(len(s.tokens) for s in samples)
    train, held_out = load_answers(path, tokenizer)
    assert [t for t, _ in train + held_out] == [s.tokens.tolist() for s in samples]
    again = featurize(tiny_lm, train + held_out, (0, 1, 1), 2, log=lambda message: None)
    for a, b in zip(again, samples, strict=True):
        assert a.prompt_length == b.prompt_length and torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.features, b.features) and torch.equal(a.final, b.final) and torch.equal(a.greedy, b.greedy)

    class Other(Tokenizer):
        def __len__(self):
            return 98

    with pytest.raises(ValueError, match="answers.jsonl.gz: written with a tokenizer of vocab_size 97"):
        load_answers(path, Other())
    (tmp_path / "x.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="x.gz: not an answers file"):
        load_answers(tmp_path / "x.gz", tokenizer)


def test_the_default_pairs_shipped_answers_are_whole_answers_files():
    """src/specdec/train/answers/smollm2-135m-instruct: every file its README names loads (the default pair's
    vocabulary and end token), conversations with a prompt and an answer, a tenth of each set held out."""
    from pathlib import Path

    from specdec.train.data import load_answers

    class Vocabulary:  # the default pair's tokenizer as load_answers checks it
        eos_token_id = 2

        def __len__(self):
            return 49152

    folder = Path(__file__).resolve().parents[2] / "src/specdec/train/answers/smollm2-135m-instruct"
    files = sorted(folder.glob("*.jsonl.gz"))
    readme = (folder / "README.md").read_text()
    assert len(files) == 3 and all(f"`{f.name}`" in readme for f in files)
    for path in files:
        train, held_out = load_answers(path, Vocabulary())
        assert 0.08 < len(held_out) / (len(train) + len(held_out)) < 0.12, path.name
        for tokens, prompt_length in train + held_out:
            assert 0 < prompt_length < len(tokens) <= prompt_length + 128 and max(tokens) < 49152
