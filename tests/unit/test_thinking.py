"""Structured output after a reasoning model's thinking (decoding/thinking.py): each verify position's mask
against the grammar's own masks over the answer alone, the tags in token ids as each parser reads them, and
the decode loop with real tiny models (greedy speculative output equals target-only decoding under the same
gate: unconstrained until the thinking closes, the grammar's after)."""

import json
import math

import llguidance
import numpy as np
import pytest
import torch
from specdec.decoding.loop import GenerationRequest
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.decoding.thinking import ANSWER, EITHER, THINKING, AnswerMatcher, ThinkingTags
from specdec.decoding.token_mask import unpack_allowed
from specdec.engine.build import dynamic_executor
from specdec.engine.local import LocalProposer, LocalScorer

from .conftest import noisy_copy, run_fixed_k
# (the fixtures too: SmolLM2's tokenizer, its guide compiler, a tiny llama over its vocabulary)
from .test_grammar import SCHEMA, constrained_greedy, guides, lm, tokenizer  # noqa: F401

EOS = 2  # SmolLM2's <|im_end|>
VOCAB = 49152


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def grammar_allows(guides, grammar, answer) -> set[int]:
    """The tokens the grammar allows after `answer`, from a fresh matcher that never saw a thinking."""
    matcher = llguidance.LLMatcher(guides.tokenizer, grammar.definition, log_level=0)
    assert matcher.consume_tokens(answer)
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:VOCAB]).tolist())


def rows(bits) -> list[set[int]]:
    return [set(row.nonzero().flatten().tolist()) for row in unpack_allowed(bits, VOCAB)]


def test_each_parser_reads_its_tags_in_token_ids(tokenizer):
    r1 = ThinkingTags.of("deepseek_r1", lambda text: encode(tokenizer, text))
    assert r1.close == tuple(encode(tokenizer, "</think>")) and len(r1.close) == 3 and r1.start == THINKING
    # qwen3 thinks only in a block the answer opens: with <think> spelled by 3 tokens here (one in Qwen3's
    # vocabulary) that is not one token to allow beside the grammar's, so the grammar holds from the start.
    assert ThinkingTags.of("qwen3", lambda text: encode(tokenizer, text)).start == ANSWER
    assert ThinkingTags.of("qwen3", lambda text: [7] if text == "<think>" else [8]).start == EITHER
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'"):
        ThinkingTags.of("o1", lambda text: [1])


def test_the_thinking_is_unconstrained_and_the_answer_follows_the_grammar(guides, tokenizer):
    grammar = guides.compile("json_schema", json.dumps(SCHEMA))
    tags = ThinkingTags.of("deepseek_r1", lambda text: encode(tokenizer, text))
    gated = grammar.after_thinking(tags)
    assert gated.start is grammar.start and grammar.after is None  # the compiled guide shared, not changed
    matcher = gated.matcher()
    assert isinstance(matcher, AnswerMatcher)
    thinking = encode(tokenizer, "<think>\nThe user wants JSON. Bob is 42.\n")
    close, answer = list(tags.close), encode(tokenizer, '{"name":"Bob","age":42}')
    assert matcher.forced(5) == []  # nothing is forced while it thinks ...
    closed = gated.matcher()
    assert closed.advance(thinking + close) is None
    assert closed.forced(5) == grammar.matcher().forced(5) != []  # ... and the answer's start is
    assert matcher.valid_prefix(thinking + close + answer) == len(thinking + close + answer)
    refused = encode(tokenizer, "Sure")  # not JSON: refused in the answer, fine in the thinking
    assert matcher.valid_prefix(refused) == len(refused)
    assert matcher.valid_prefix(close + refused + answer) == len(close)
    # A round that drafts the thinking's end and the answer's start: every position follows the drafts
    # before it; the grammar's masks start right after the tag's last token.
    draft = thinking[-2:] + close + answer[:4]
    assert matcher.advance(thinking[:-2]) is None
    got = rows(matcher.allowed(draft, len(draft) + 1))
    start = len(thinking[-2:] + close)
    assert all(row == set(range(VOCAB)) for row in got[:start])
    for j in range(start, len(draft) + 1):
        assert got[j] == grammar_allows(guides, grammar, answer[:j - start])
    # A tag's beginning does not open the answer: the tail is matched whole.
    assert matcher.valid_prefix(close[:2] + refused) == len(close[:2] + refused)
    # The round taken: the grammar ends at the answer's "}"; the index counts the round's tokens.
    assert matcher.advance(draft) is None
    rest = answer[4:] + [EOS]
    assert matcher.advance(rest) == len(answer) - 4


def test_a_thinking_across_rounds_closes_where_its_tags_tokens_end(guides, tokenizer):
    grammar = guides.compile("regex", "[0-9]+")
    tags = ThinkingTags.of("deepseek_r1", lambda text: encode(tokenizer, text))
    matcher = grammar.after_thinking(tags).matcher()
    close = list(tags.close)
    four = tokenizer.convert_tokens_to_ids("4")
    assert matcher.advance(encode(tokenizer, "hmm") + close[:1]) is None
    assert matcher.advance(close[1:2]) is None
    got = rows(matcher.allowed(close[2:] + [four], 3))
    assert got[0] == set(range(VOCAB))
    assert got[1] == grammar_allows(guides, grammar, []) and got[2] == grammar_allows(guides, grammar, [four])
    assert matcher.advance(close[2:] + [four, EOS]) == 2


def test_an_answer_that_may_open_a_block_allows_the_grammar_and_the_open_tag(guides, tokenizer):
    """qwen3: the first position allows <think> beside the grammar's tokens; taken, the output thinks until
    </think>, else the grammar holds from its first token. Tags of one token each, as in Qwen3's vocabulary
    (two tokens of this one stand in for them)."""
    grammar = guides.compile("regex", "[0-9]+")
    open_id, close_id = tokenizer.convert_tokens_to_ids("<"), tokenizer.convert_tokens_to_ids(">")
    tags = ThinkingTags.of("qwen3", lambda text: [open_id] if text == "<think>" else [close_id])
    four = tokenizer.convert_tokens_to_ids("4")
    digits = grammar_allows(guides, grammar, [])
    assert open_id not in digits and four in digits
    # Opened: thinking until the close tag, then the grammar.
    matcher = grammar.after_thinking(tags).matcher()
    draft = [open_id] + encode(tokenizer, "hmm") + [close_id, four]
    got = rows(matcher.allowed(draft, len(draft) + 1))
    assert got[0] == digits | {open_id}
    assert all(row == set(range(VOCAB)) for row in got[1:len(draft) - 1])
    assert got[-2] == digits and got[-1] == grammar_allows(guides, grammar, [four])
    assert matcher.valid_prefix(draft) == len(draft)
    assert matcher.advance(draft + [EOS]) == len(draft)
    # Not opened: the first token is the answer's.
    matcher = grammar.after_thinking(tags).matcher()
    got = rows(matcher.allowed([four, four], 3))
    assert got[0] == digits | {open_id} and got[1] == got[2] == grammar_allows(guides, grammar, [four])
    assert matcher.valid_prefix(encode(tokenizer, "hmm")) == 0
    assert matcher.advance([four]) is None
    assert rows(matcher.allowed([], 1))[0] == grammar_allows(guides, grammar, [four])  # <think> no more


@pytest.mark.parametrize("draft,k", [("none", 0), ("draft_model", 3), ("ngram", 4)])
def test_greedy_speculation_thinks_freely_then_answers_in_the_grammar(lm, guides, tokenizer, draft, k):
    """The tiny model's own greedy text closes a 'thinking' whose end tag is two of its tokens: speculative
    output equals target-only greedy decoding that is unconstrained up to the tag and constrained after."""
    prompt = encode(tokenizer, 'Answer in JSON, e.g. {"name":"Ann","age":7}: ')
    plain = run_fixed_k(GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=12), NgramProposer(),
                        LocalScorer(dynamic_executor(lm)), 0)
    close = tuple(plain[5:7])
    assert all(tuple(plain[i:i + 2]) != close for i in range(5))  # the tag first ends at the 7th token
    tags = ThinkingTags(open=(plain[0],), close=close, start=THINKING)
    grammar = guides.compile("json_schema", json.dumps(SCHEMA))
    proposer = NgramProposer(min_ngram=1) if draft == "ngram" else LocalProposer(dynamic_executor(noisy_copy(lm)))
    output = run_fixed_k(GenerationRequest(seq_id=2, prompt_ids=prompt, max_tokens=48,
                                           grammar=grammar.after_thinking(tags), end_ids=frozenset([EOS])),
                         proposer, LocalScorer(dynamic_executor(lm)), k)
    answer = constrained_greedy(lm, guides, grammar, prompt + plain[:7], 48 - 7)
    assert output == plain[:7] + answer
    value = json.loads(tokenizer.decode(answer))
    assert set(value) == {"name", "age"}
    # Constrained from the first token instead, the output differs: the gate moved where the grammar starts.
    assert output != run_fixed_k(GenerationRequest(seq_id=3, prompt_ids=prompt, max_tokens=48, grammar=grammar,
                                                   end_ids=frozenset([EOS])), NgramProposer(),
                                 LocalScorer(dynamic_executor(lm)), 0)


def test_sampled_speculation_follows_the_target_that_may_open_a_thinking(lm, guides, tokenizer):
    """qwen3's gate under sampling: the first token is either the open tag (a token the grammar refuses,
    chosen so the target gives it about half the mass at that position) or a colour's first token; what comes
    out is compared with the exact distribution of sampling the target under the same gate (the open tag's
    probability against the allowed tokens', then the constrained walk of test_grammar). A draft model
    proposes freely (the tag, refused tokens, the thinking's continuation); 1500 seeded requests."""
    from .test_grammar import COLOURS, _exact_choice_distribution, _reference_allowed
    from specdec.decoding.sampling import SamplingParams
    from .conftest import run_fixed_k_many

    grammar = guides.compile("choice", json.dumps(COLOURS))
    prompt = encode(tokenizer, "Pick one: red, green, blue, purple. purple? purple")
    allowed = sorted(_reference_allowed(guides, grammar, []))
    with torch.no_grad():
        logits = lm(torch.tensor([prompt])).logits[0, -1].double()
    mass = torch.logsumexp(logits[allowed], 0)
    refused = torch.ones_like(logits, dtype=torch.bool)
    refused[allowed], refused[EOS] = False, False
    open_id = int(torch.where(refused, -(logits - mass).abs(), torch.tensor(float("-inf"))).argmax())
    p_think = float(torch.sigmoid(logits[open_id] - mass))
    assert 0.3 < p_think < 0.7
    exact = {text: (1 - p_think) * p for text, p in
             _exact_choice_distribution(lm, guides, grammar, tokenizer, prompt).items()}
    exact["(thinks)"] = p_think
    tags = ThinkingTags(open=(open_id,), close=(EOS,), start=EITHER)
    # 3 tokens: the longest tokenization of a colour (a thinking is told by its first token)
    n = 1500
    requests = [GenerationRequest(seq_id=20 + seed, prompt_ids=prompt, max_tokens=3,
                                  grammar=grammar.after_thinking(tags), sampling=SamplingParams(temperature=1.0, seed=seed))
                for seed in range(n)]
    seen: dict[str, int] = {}
    outputs = run_fixed_k_many(requests, LocalProposer(dynamic_executor(noisy_copy(lm))),
                               LocalScorer(dynamic_executor(lm)), 2)
    for out in outputs:
        text = "(thinks)" if out[0] == open_id else tokenizer.decode(out)
        seen[text] = seen.get(text, 0) + 1
    assert set(seen) <= set(exact), seen
    tv = 0.5 * sum(abs(seen.get(c, 0) / n - p) for c, p in exact.items())
    noise = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in exact.values())
    assert tv < 2 * noise + 0.01, (tv, noise, seen, exact)
    # The test can tell: the grammar alone (no tag) or the tag never taken is far from it.
    assert p_think > 3 * (2 * noise + 0.01)


def test_a_thinking_budget_forces_the_close_tag_once_spent(guides, tokenizer):
    """ThinkingBudget: free thinking up to the budget, then only the close tag's next token at each position
    (a tag begun by the thinking itself is finished, not started again); the grammar after it, or a free
    answer without one."""
    from specdec.decoding.thinking import ThinkingBudget

    tags = ThinkingTags.of("deepseek_r1", lambda text: encode(tokenizer, text))
    close = list(tags.close)
    thinking = encode(tokenizer, "Bob is 42 and lives in Oslo.")
    assert len(thinking) > 4 and not set(thinking) & set(close)
    free = ThinkingBudget(tags, 4, VOCAB).matcher()
    assert free.forced(8) == [] and free.words == VOCAB // 32
    draft = thinking[:4] + close + thinking[:2]
    got = rows(free.allowed(draft, len(draft) + 1))
    everything = set(range(VOCAB))
    assert got[:4] == [everything] * 4 and got[4:7] == [{t} for t in close] and got[7:] == [everything] * 3
    assert free.valid_prefix(draft) == len(draft) and free.valid_prefix(thinking) == 4  # the 5th is over
    assert free.valid_prefix(thinking[:4] + close[:1] + thinking[:1]) == 5
    got = rows(free.allowed(thinking[:5], 6))  # a refused 5th token: the rows after it are never read
    assert got[4] == {close[0]} and got[5] == everything
    assert free.advance(thinking[:4]) is None and free.forced(8) == close and free.forced(2) == close[:2]
    assert free.advance(close[:1]) is None and free.forced(8) == close[1:]  # under way: the rest of the tag
    assert free.advance(close[1:] + thinking) is None and free.forced(8) == []  # answering: free
    # A tag the thinking began on its own at the budget is finished: its next token, not its first.
    begun = ThinkingBudget(tags, 5, VOCAB).matcher()
    begun.advance(thinking[:4] + close[:1])
    assert begun.forced(8) == close[1:]
    # Budget 0: the tag first. A grammar after the thinking holds from the tag's end.
    grammar = guides.compile("regex", "[0-9]+")
    four = tokenizer.convert_tokens_to_ids("4")
    gated = ThinkingBudget(tags, 0, VOCAB, grammar).matcher()
    assert gated.forced(8) == close
    got = rows(gated.allowed(close + [four], len(close) + 2))
    assert got[:3] == [{t} for t in close] and got[3] == grammar_allows(guides, grammar, [])
    assert got[4] == grammar_allows(guides, grammar, [four])
    assert gated.advance(close + [four, EOS]) == len(close) + 1


def test_a_budget_counts_only_a_thinking_the_answer_opens(guides, tokenizer):
    """qwen3 with a budget: the first position is free (no grammar) or the grammar's and <think>; opened,
    the thinking gets its budget, then the close tag."""
    from specdec.decoding.thinking import ThinkingBudget

    open_id, close_id = tokenizer.convert_tokens_to_ids("<"), tokenizer.convert_tokens_to_ids(">")
    tags = ThinkingTags.of("qwen3", lambda text: [open_id] if text == "<think>" else [close_id])
    words = encode(tokenizer, "hmm well")
    matcher = ThinkingBudget(tags, 2, VOCAB).matcher()
    draft = [open_id] + words[:2] + [close_id] + words
    got = rows(matcher.allowed(draft, len(draft) + 1))
    assert got[0] == got[1] == got[2] == set(range(VOCAB)) and got[3] == {close_id}
    assert all(row == set(range(VOCAB)) for row in got[4:])
    answered = ThinkingBudget(tags, 0, VOCAB).matcher()  # no block opened: the budget never applies
    assert answered.valid_prefix(words) == len(words) and answered.advance(words) is None
    assert answered.forced(4) == []
    digits = ThinkingBudget(tags, 1, VOCAB, guides.compile("regex", "[0-9]+")).matcher()
    assert open_id in rows(digits.allowed([], 1))[0]


@pytest.mark.parametrize("draft,k", [("none", 0), ("draft_model", 3), ("ngram", 4)])
def test_greedy_speculation_under_a_thinking_budget_equals_target_only(lm, guides, tokenizer, draft, k):
    """The tiny model thinks (deepseek_r1: from its first token) and never closes on its own: with a budget
    of 6 its output is its own first 6 tokens, the tag, then its free answer, each token the target's greedy
    choice under the rule; speculative decoding (drafts refused at the tag included) gives the same tokens."""
    from specdec.decoding.thinking import ThinkingBudget

    prompt = encode(tokenizer, "Think, then answer: what is 6 x 7?")
    tags = ThinkingTags.of("deepseek_r1", lambda text: encode(tokenizer, text))
    rule = ThinkingBudget(tags, 6, VOCAB)
    plain = run_fixed_k(GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=20), NgramProposer(),
                        LocalScorer(dynamic_executor(lm)), 0)
    reference = run_fixed_k(GenerationRequest(seq_id=2, prompt_ids=prompt, max_tokens=20, grammar=rule),
                            NgramProposer(), LocalScorer(dynamic_executor(lm)), 0)
    close = list(tags.close)
    assert reference[:6] == plain[:6] and reference[6:9] == close and plain[6:9] != close
    proposer = NgramProposer(min_ngram=1) if draft == "ngram" else LocalProposer(dynamic_executor(noisy_copy(lm)))
    output = run_fixed_k(GenerationRequest(seq_id=3, prompt_ids=prompt, max_tokens=20, grammar=rule), proposer,
                         LocalScorer(dynamic_executor(lm)), k)
    assert output == reference


# gpt-oss's harmony markers as single tokens (as in its vocabulary), the rest of the text SmolLM2's ids
HARMONY_IDS = {"<|channel|>": 900, "<|message|>": 901, "<|end|>": 902, "<|start|>": 903, "final": 904,
               "assistant": 905}


def harmony_encode(tokenizer):
    import re

    def encode_text(text):
        ids = []
        for part in re.split(r"(<\|[a-z]+\|>|final|assistant)", text):
            ids += [HARMONY_IDS[part]] if part in HARMONY_IDS else encode(tokenizer, part) if part else []
        return ids
    return encode_text


def test_harmony_thinks_until_the_final_channel_and_its_budget_closes_the_open_message(guides, tokenizer):
    """openai_gptoss: every message before `<|channel|>final<|message|>` is thinking (free), the grammar holds
    for the final message's body; a budget forces `<|end|><|start|>assistant<|channel|>final<|message|>` after
    a thinking under way (finishing what the thinking began of it), the header alone when nothing was thought.
    A vocabulary without harmony's markers as tokens does not gate: the grammar holds from the first token."""
    from specdec.decoding.thinking import ThinkingBudget

    tags = ThinkingTags.of("openai_gptoss", harmony_encode(tokenizer))
    header, closing = [900, 904, 901], [902, 903, 905, 900, 904, 901]
    assert (list(tags.close), list(tags.forced), tags.start, tags.open) == (header, closing, THINKING, ())
    assert ThinkingTags.of("openai_gptoss", lambda text: encode(tokenizer, text)).start == ANSWER
    grammar = guides.compile("regex", "[0-9]+")
    four = tokenizer.convert_tokens_to_ids("4")
    analysis = harmony_encode(tokenizer)("<|channel|>analysis<|message|>Six times seven.<|end|><|start|>assistant")
    draft = analysis + header + [four]
    got = rows(grammar.after_thinking(tags).matcher().allowed(draft, len(draft) + 1))
    everything = set(range(VOCAB))
    assert got[:len(analysis) + 3] == [everything] * (len(analysis) + 3)
    assert got[-2:] == [grammar_allows(guides, grammar, []), grammar_allows(guides, grammar, [four])]
    gated = grammar.after_thinking(tags).matcher()
    assert gated.advance(draft + [EOS]) == len(draft)  # the answer's end: the grammar's, after the header
    # The budget: a thinking under way gets the whole closing; nothing thought, the header alone
    words = encode(tokenizer, "Bob is 42 and lives in Oslo.")
    spent = ThinkingBudget(tags, 3, VOCAB, grammar).matcher()
    got = rows(spent.allowed(words[:3] + closing + [four], 3 + len(closing) + 2))
    assert got[:3] == [everything] * 3 and got[3:3 + len(closing)] == [{t} for t in closing]
    assert got[-2] == grammar_allows(guides, grammar, [])
    assert spent.advance(words[:3]) is None and spent.forced(16) == closing
    assert spent.advance(closing[:2]) is None and spent.forced(16) == closing[2:]
    assert ThinkingBudget(tags, 0, VOCAB, grammar).matcher().forced(16) == header
    begun = ThinkingBudget(tags, 3, VOCAB).matcher()  # the thinking ended its message itself: the rest
    begun.advance(words[:2] + [902])
    assert begun.forced(16) == closing[1:]
    header_begun = ThinkingBudget(tags, 3, VOCAB).matcher()  # it began the final header itself
    header_begun.advance(words[:2] + [900])
    assert header_begun.forced(16) == header[1:]


@pytest.mark.parametrize("draft,k", [("none", 0), ("draft_model", 3), ("ngram", 4)])
def test_greedy_speculation_under_a_harmony_budget_equals_target_only(lm, guides, tokenizer, draft, k):
    """The tiny model (no gpt-oss) thinks its own 5 tokens, the budget closes them with harmony's closing, and the
    final message follows the grammar; speculative decoding gives the same tokens as target-only."""
    from specdec.decoding.thinking import ThinkingBudget

    prompt = encode(tokenizer, "Think, then answer: what is 6 x 7?")
    tags = ThinkingTags.of("openai_gptoss", harmony_encode(tokenizer))
    rule = ThinkingBudget(tags, 5, VOCAB, guides.compile("regex", "[0-9]{3}"))
    plain = run_fixed_k(GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=20), NgramProposer(),
                        LocalScorer(dynamic_executor(lm)), 0)
    reference = run_fixed_k(GenerationRequest(seq_id=2, prompt_ids=prompt, max_tokens=20, grammar=rule),
                            NgramProposer(), LocalScorer(dynamic_executor(lm)), 0)
    closing = list(tags.forced)
    assert reference[:5] == plain[:5] and reference[5:11] == closing
    assert tokenizer.decode(reference[11:]).strip().isdigit()
    proposer = NgramProposer(min_ngram=1) if draft == "ngram" else LocalProposer(dynamic_executor(noisy_copy(lm)))
    output = run_fixed_k(GenerationRequest(seq_id=3, prompt_ids=prompt, max_tokens=20, grammar=rule), proposer,
                         LocalScorer(dynamic_executor(lm)), k)
    assert output == reference
