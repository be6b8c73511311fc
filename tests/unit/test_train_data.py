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
