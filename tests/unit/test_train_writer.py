"""Who writes a head's training answers (specdec.train.writer): the served executor writes what transformers'
generate writes, greedy, continuously batched; its sampled answers are draws from the target's distribution."""

import pytest
import torch

from specdec.train.data import answer_and_featurize
from specdec.train.writer import ExecutorWriter, GenerateWriter, choose

EOS = 82  # a token the tiny model writes at different steps of different answers: they end apart
PROMPTS = [[1, 5, 9, 14], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39], [1, 7], [1, 50, 60, 70, 80, 90, 11],
           [1, 4, 4, 4, 4], [1, 88, 12, 3]]


def _alone(model, row, max_new):
    """transformers' greedy answer to one prompt, unbatched (the reference)."""
    out = model.generate(torch.tensor([row]), max_new_tokens=max_new, do_sample=False, pad_token_id=EOS)[0, len(row):]
    answer = out.tolist()
    return answer[:answer.index(EOS) + 1] if EOS in answer else answer


def test_the_executor_writes_each_prompts_greedy_answer_with_rows_freed_and_refilled(tiny_lm):
    """Six prompts through two rows: each answer is the prompt's own greedy answer (float64: exact), up to
    max_new tokens or its end token, whatever answers it was decoded beside."""
    with torch.no_grad():
        wanted = [_alone(tiny_lm, row, 24) for row in PROMPTS]
    assert len({len(answer) for answer in wanted}) > 1  # answers end at different steps: rows are refilled
    writer = ExecutorWriter(tiny_lm, width=2)
    assert writer.write(PROMPTS, 24, EOS, EOS) == wanted
    assert not writer.lm.sequences  # every answer's sequence released
    assert writer.write(PROMPTS[:3], 5, EOS, EOS) == [answer[:5] for answer in wanted[:3]]
    assert GenerateWriter(tiny_lm).write(PROMPTS, 24, EOS, EOS) == wanted


def test_a_longer_set_rebuilds_the_pool_larger(tiny_lm):
    writer = ExecutorWriter(tiny_lm, width=3)
    writer.CONTEXT_STEP = 16
    writer.write(PROMPTS[:2], 4, EOS, EOS)
    assert writer.max_context == 16
    long_prompt = [1] + [5 + i % 80 for i in range(29)]
    with torch.no_grad():
        assert writer.write([long_prompt], 3, EOS, EOS) == [_alone(tiny_lm, long_prompt, 3)]
    assert writer.max_context == 48


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs renormalised over the smallest set of most likely tokens whose mass reaches top_p."""
    ordered, order = probs.sort(descending=True)
    keep = (ordered.cumsum(0) - ordered) < top_p
    out = torch.zeros_like(probs)
    out[order[keep]] = ordered[keep]
    return out / out.sum()


@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_sampled_answers_follow_the_targets_distribution_at_the_temperature(tiny_lm, top_p):
    """First tokens drawn at T = 0.7 (within the top-p nucleus) from one prompt, 6,000 times: their
    frequencies within sampling noise of the exact distribution (total variation), far from T = 1's and from
    the whole vocabulary's; the seed fixes the draws."""
    prompt, temperature, draws = PROMPTS[0], 0.7, 6000
    writer = ExecutorWriter(tiny_lm, width=1000)  # few forwards
    answers = writer.write([prompt] * draws, 1, EOS, EOS, seed=5, temperature=temperature, top_p=top_p)
    counts = torch.bincount(torch.tensor([a[0] for a in answers]), minlength=97).double() / draws
    with torch.no_grad():
        logits = tiny_lm(torch.tensor([prompt])).logits[0, -1].double()
    exact = _nucleus(torch.softmax(logits / temperature, -1), top_p)
    assert 0.5 * (counts - exact).abs().sum() < 0.04
    # the test would see a temperature left out, or the nucleus
    assert 0.5 * (exact - _nucleus(torch.softmax(logits, -1), top_p)).abs().sum() > 0.1
    if top_p < 1:
        assert 0.5 * (exact - torch.softmax(logits / temperature, -1)).abs().sum() > 0.1
    assert writer.write([prompt] * 50, 3, EOS, EOS, seed=5, temperature=temperature) == \
        writer.write([prompt] * 50, 3, EOS, EOS, seed=5, temperature=temperature)


def test_answer_and_featurize_takes_a_writer_and_keeps_the_models_features(tiny_lm):
    """The executor as the writer: the same samples as transformers' generate writes (greedy)."""
    from tests.unit.test_train_data import PROMPTS as TEXTS, CharTokenizer

    quiet = dict(chat_template=False, batch=3, log=lambda message: None)
    by_executor = answer_and_featurize(tiny_lm, CharTokenizer(), TEXTS, (0, 1, 1), 12,
                                       writer=ExecutorWriter(tiny_lm, width=2), **quiet)
    by_generate = answer_and_featurize(tiny_lm, CharTokenizer(), TEXTS, (0, 1, 1), 12, **quiet)
    for a, b in zip(by_executor, by_generate, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.features, b.features)


def test_auto_takes_the_executor_on_the_cpu_kernels_and_generate_elsewhere(tmp_path, tiny_lm, fp32_llama):
    """A float32 llama on the CPU: `choose` loads it as a server does (its kernels where they build) and its
    answers are generate's; float64, where the kernels do not serve, stays with generate."""
    from specdec.engine import kernels

    assert isinstance(choose("auto", "unused", torch.float64, tiny_lm), GenerateWriter)
    with pytest.raises(ValueError, match="answer engine"):
        choose("fast", "unused", torch.float32, fp32_llama)
    fp32_llama.save_pretrained(tmp_path)
    chosen = choose("auto", str(tmp_path), torch.float32, fp32_llama, log=lambda message: None)
    cpu_kernels = kernels.cpu(torch.device("cpu"), torch.float32) is not None
    assert isinstance(chosen, ExecutorWriter if cpu_kernels else GenerateWriter)
    with torch.no_grad():
        wanted = [_alone(fp32_llama, row, 16) for row in PROMPTS]
    assert chosen.write(PROMPTS, 16, EOS, EOS) == wanted
