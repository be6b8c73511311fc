"""Structured output: each verify position's mask against a matcher that never saw the drafts, the end of a
grammar, and the decode loop with real tiny models over SmolLM2's tokenizer (greedy speculative output
equals constrained greedy target-only decoding; sampled output follows the constrained target exactly)."""

import asyncio
import json
import math

import llguidance
import numpy as np
import pytest
import torch
from specdec.decoding.grammar import MAX_CHOICES, GuideCompiler, GuideError
from specdec.decoding.interfaces import Proposal
from specdec.decoding.logit_bias import TokenBias
from specdec.decoding.loop import GenerationRequest, _within_grammar
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.text import load_tokenizer
from specdec.decoding.token_mask import allowed_greedy, mask_disallowed, unpack_allowed
from specdec.engine.build import dynamic_executor
from specdec.engine.local import LocalProposer, LocalScorer
from specdec.serving.pairs import smollm2_tokenizer_dir

from .conftest import noisy_copy, run_fixed_k, run_fixed_k_many, tiny_llama

EOS = 2  # SmolLM2's <|im_end|>
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(smollm2_tokenizer_dir()))


@pytest.fixture(scope="module")
def guides(tokenizer):
    return GuideCompiler(tokenizer)


@pytest.fixture(scope="module")
def lm():
    """A tiny llama over SmolLM2's whole vocabulary, so that grammars over its tokenizer apply."""
    return tiny_llama(49152, seed=0, initializer_range=0.5, max_positions=512)


def _reference_allowed(guides, grammar, prefix):
    """The set of tokens allowed after `prefix`, from a fresh matcher that consumed it one token at a time."""
    matcher = llguidance.LLMatcher(guides.tokenizer, grammar.definition, log_level=0)
    assert matcher.consume_tokens(prefix)
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:guides.tokenizer.vocab_size]).tolist())


def test_each_position_allows_what_follows_the_output_and_the_drafts_before_it(guides, tokenizer):
    grammar = guides.compile("json_schema", json.dumps(SCHEMA))
    matcher = grammar.matcher()
    output = tokenizer.encode('{"name":"Bo', add_special_tokens=False)
    assert matcher.advance(output) is None
    draft = tokenizer.encode('b","age":4', add_special_tokens=False)
    width = 49200  # a padded head: the columns past the tokenizer's vocabulary are never allowed
    bits = matcher.allowed(draft, len(draft) + 1)
    assert bits.shape == (len(draft) + 1, 49152 // 32) and bits.dtype == torch.int32
    allowed = unpack_allowed(bits, width)
    assert allowed.shape == (len(draft) + 1, width) and not allowed[:, 49152:].any()
    assert torch.equal(unpack_allowed(bits, 49000), allowed[:, :49000])  # a narrower head: cut
    logits = torch.randn(len(draft) + 1, width, dtype=torch.float64)
    masked = mask_disallowed(logits, bits)
    assert torch.equal(masked[allowed], logits[allowed]) and torch.isneginf(masked[~allowed]).all()
    for j in range(len(draft) + 1):
        assert set(allowed[j].nonzero().flatten().tolist()) == _reference_allowed(guides, grammar, output + draft[:j])
    # Position 1 of a draft whose first token the grammar refuses follows that token: it allows everything
    # (the verdict never reads it); the matcher is where it was.
    refused = tokenizer.encode("\n", add_special_tokens=False)  # no raw newline inside a JSON string
    assert matcher.valid_prefix(refused + draft) == 0
    again = unpack_allowed(matcher.allowed(refused + draft, 3), 49152)
    assert again[1:].all() and torch.equal(again[0], allowed[0, :49152])
    assert matcher.valid_prefix(draft) == len(draft)


def test_a_bitmask_unpacks_the_same_on_the_host_and_on_a_device():
    """The GPU's unpacking (tensor ops on the logits' device) against the host's (numpy), run here on CPU."""
    from specdec.decoding.token_mask import _unpack_on_device, _unpack_on_host

    bits = torch.randint(-2**31, 2**31 - 1, (5, 1536), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    bits[0] = -1  # every bit, the sign bit included
    bits[1] = 0
    host, device = _unpack_on_host(bits), _unpack_on_device(bits)
    assert host.shape == (5, 49152) and torch.equal(host, device) and host[0].all() and not host[1].any()
    assert host[2, 32 * 7 + 5] == bool((int(bits[2, 7]) >> 5) & 1)


def test_the_output_ends_where_the_grammar_ends(guides, tokenizer):
    grammar = guides.compile("json_schema", json.dumps(SCHEMA))
    complete = tokenizer.encode('{"name":"Bob","age":42}', add_special_tokens=False)
    matcher = grammar.matcher()
    assert matcher.advance(complete[:3]) is None
    assert matcher.advance(complete[3:] + [EOS]) == len(complete) - 3  # nothing may follow "}": it ends there
    # A grammar that may go on or end: its end-of-sequence token ends it and is dropped.
    digits = guides.compile("regex", "[0-9]+").matcher()
    assert digits.advance([tokenizer.convert_tokens_to_ids("4"), EOS]) == 1


@pytest.mark.parametrize("guide_type,guide,message", [
    ("regex", "[0-9", "unclosed character class"), ("json_schema", "{", "expected"),
    ("json_schema", '{"type": "foo"}', "foo"), ("choice", "[]", "JSON list of non-empty strings"),
    ("choice", '["a", 3]', "JSON list"), ("ebnf_grammar", "root ::= (", "Expected"), ("regex", "", "empty"),
    ("xml", "<a/>", "unknown guide type"), ("choice", "[" * 5000, "nested too deeply"),  # nested past the decoder's depth
    ("ebnf_grammar", 'start: t\nt[max_tokens=3]: /[a-z]+/', "the grammar: a rule's max_tokens= is not supported"),
    ("choice", json.dumps([f"option {i}" for i in range(MAX_CHOICES + 1)]), f"at most {MAX_CHOICES} choices"),
    ("structural_tag", "{", "not JSON"), ("structural_tag", "[]", "JSON object with 'structures' and 'triggers'"),
    ("structural_tag", '{"structures": [{"begin": "<f>", "end": ""}], "triggers": []}', "'triggers' must be a list"),
    ("structural_tag", '{"structures": [], "triggers": ["<f>"]}', "'structures' must be a non-empty list"),
    ("structural_tag", '{"structures": [{"begin": "<f>", "end": ""}], "triggers": ["<g>"]}',
     r"structures\[0\]: 'begin' '<f>' starts with none of the triggers \['<g>'\]"),
    ("structural_tag", '{"structures": [{"begin": "<f>", "end": 1}], "triggers": ["<f>"]}',
     r"structures\[0\]: 'begin'"),
    ("structural_tag", '{"structures": [{"begin": "<f>", "end": "", "schema": []}], "triggers": ["<f>"]}',
     r"structures\[0\]: 'schema' must be a JSON schema object"),
    ("structural_tag", '{"structures": [{"begin": "<f>", "end": "", "args": {}}], "triggers": ["<f>"]}',
     r"structures\[0\] must be an object of 'begin', 'schema' and 'end'"),
    ("structural_tag", '{"structures": [{"begin": "<f>", "end": "", "schema": {"type": "foo"}}], "triggers": ["<f>"]}',
     "foo"),
    ("structural_tag", '{"type": "structural_tag", "format": {"type": "triggered_tags"}}',
     r"format: a triggered_tags format has no \['triggers', 'tags'\]"),
    ("structural_tag", '{"structures": [{"begin": "a<|im_start|>", "end": ""}], "triggers": ["a<|im_start|>"]}',
     "is text with a special token in it")])
def test_a_guide_that_does_not_compile_says_why(guides, guide_type, guide, message):
    with pytest.raises(GuideError, match=message):
        guides.compile(guide_type, guide)


def _allows(matcher, tokens: list[int]) -> list[bool]:
    allowed = unpack_allowed(matcher.allowed([], 1), 49152)[0]
    return [bool(allowed[token]) for token in tokens]


@pytest.mark.parametrize("trigger,special", [("<call", False), ("<|im_start|>", True)])
def test_a_structural_tag_holds_the_text_after_its_trigger_to_its_begin_schema_and_end(guides, tokenizer, trigger,
                                                                                      special):
    """Free text until a trigger; then the rest of the structure's begin, JSON following its schema and its end
    are the only text allowed, and free text again after it. A trigger that is a special token is that token (a
    model writes it as one), any other its text."""
    begin = trigger + ("=weather>" if not special else "weather")
    grammar = guides.compile("structural_tag", json.dumps({"type": "structural_tag", "structures": [
        {"begin": begin, "schema": SCHEMA, "end": "</call>"}], "triggers": [trigger]}))
    matcher = grammar.matcher()
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    free = encode("Sure, 42 {x} ") + [EOS, tokenizer.convert_tokens_to_ids("<reponame>")]
    assert all(_allows(matcher, free))  # anything before the trigger, its end and other special tokens included
    assert matcher.advance(encode("Let me") + free[-1:] + encode(" look: ")) is None
    assert matcher.advance(encode(trigger) if not special else [tokenizer.convert_tokens_to_ids(trigger)]) is None
    rest = begin[len(trigger):]
    assert tokenizer.decode(matcher.forced(20)) == rest + '{"name":"'  # the begin, then the schema's compact start
    assert matcher.advance(encode(rest + '{"name":"Ann","age":')) is None
    assert _allows(matcher, encode("7") + encode('"') + [EOS]) == [True, False, False]  # JSON, then the end
    assert matcher.advance(encode("7}")) is None
    assert tokenizer.decode(matcher.forced(20)) == "</call>"
    assert matcher.advance(encode("</call>")) is None
    assert all(_allows(matcher, free))  # free text again
    assert matcher.advance(encode(" Done.") + [EOS]) == len(encode(" Done."))  # ends at the end of sequence
    if not special:  # the trigger's text inside free text opens the structure wherever it is written
        other = grammar.matcher()
        assert other.advance(encode("a<call")) is None and tokenizer.decode(other.forced(20)).startswith("=weather>")


def test_special_tokens_in_a_structural_tags_begin_and_end_are_the_tokens_and_triggers_may_mix(guides, tokenizer):
    """A begin or end that writes a special token takes that token; text triggers and special-token triggers
    in one guide (as Mistral's [TOOL_CALLS]NAME[ARGS]{...} is written: special tokens inside the begin)."""
    grammar = guides.compile("structural_tag", json.dumps({"structures": [
        {"begin": "<|im_start|>call<file_sep>", "schema": SCHEMA, "end": "<file_sep>"},
        {"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}], "triggers": ["<|im_start|>", "<f>"]}))
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<file_sep>"))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    matcher = grammar.matcher()
    assert matcher.advance(encode("hi ") + [start] + encode("call")) is None
    assert _allows(matcher, [end] + encode("<")) == [True, False]  # the token, not its text
    assert matcher.advance([end] + encode('{"name":"Al","age":3}')) is None
    assert _allows(matcher, [end] + encode(" ") + encode("<")) == [True, False, False]  # the end: its token
    assert matcher.advance([end] + encode(" and <f>7</f> done")) is None  # then the text trigger's structure
    assert matcher.valid_prefix(encode(" <f>x")) == len(encode(" <f>"))


def test_a_guide_compiles_once_and_each_request_gets_its_own_matcher(tokenizer):
    guides = GuideCompiler(tokenizer, cached=2)
    once = guides.compile("json_schema", json.dumps(SCHEMA))
    grammar = guides.compile("json_schema", json.dumps(SCHEMA))  # its second time: compiled again and kept
    assert grammar is not once and guides.compile("json_schema", json.dumps(SCHEMA)) is grammar
    first, second = grammar.matcher(), grammar.matcher()
    head = tokenizer.encode('{"name":"Bo', add_special_tokens=False)
    assert first.advance(head) is None
    assert second.valid_prefix(head) == len(head) and first.valid_prefix(head) < len(head)  # independent
    assert grammar.matcher().valid_prefix(head) == len(head)  # the cached start did not move
    for _ in range(2):
        guides.compile("regex", "[0-9]+")
        guides.compile("regex", "[a-z]+")  # kept: the least recently used (the schema) leaves the cache
    assert guides.compile("regex", "[a-z]+") is guides.compile("regex", "[a-z]+")
    assert guides.compile("json_schema", json.dumps(SCHEMA)) is not grammar
    with pytest.raises(GuideError):  # a failure is not cached: it fails again
        guides.compile("regex", "[0-9")
    with pytest.raises(GuideError):
        guides.compile("regex", "[0-9")


def test_the_longest_choice_list_matches_past_its_first_token(guides, tokenizer):
    """llguidance's parser refuses a row of over 2000 items only when matching starts (2000 choices failed
    at the first token): the limit is refused at compile time, and a list at the limit matches."""
    choices = [f"option number {i}" for i in range(MAX_CHOICES)]
    matcher = guides.compile("choice", json.dumps(choices)).matcher()
    tokens = tokenizer.encode(choices[-1], add_special_tokens=False)
    forced = matcher.forced(8)
    assert tokenizer.decode(forced) == "option number " and matcher.advance(forced) is None
    rest = tokens[len(forced):]
    assert unpack_allowed(matcher.allowed(rest, len(rest) + 1), 49152)[0, rest[0]]
    assert matcher.advance(rest) == len(rest)  # the grammar is complete after the choice


def constrained_greedy(model, guides, grammar, prompt, n):
    """Target-only greedy decoding one token at a time under the grammar, ending where the grammar ends."""
    tokens, output = list(prompt), []
    matcher = llguidance.LLMatcher(guides.tokenizer, grammar.definition, log_level=0)
    with torch.no_grad():
        while len(output) < n and not matcher.is_stopped():
            logits = model(torch.tensor([tokens])).logits[0, -1]
            allowed = torch.zeros_like(logits, dtype=torch.bool)
            allowed[list(_reference_allowed(guides, grammar, output))] = True
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            assert matcher.consume_token(token)
            if matcher.stop_reason() == "EndOfSentence":
                break
            tokens.append(token)
            output.append(token)
    return output


@pytest.mark.parametrize("draft,k", [("none", 0), ("draft_model", 3), ("ngram", 4)])
def test_greedy_speculation_under_a_schema_is_constrained_greedy_target_decoding(lm, guides, tokenizer, draft, k):
    grammar = guides.compile("json_schema", json.dumps(SCHEMA))
    prompt = tokenizer.encode('Answer in JSON, e.g. {"name":"Ann","age":7}: ', add_special_tokens=False)
    proposer = NgramProposer(min_ngram=1) if draft == "ngram" else LocalProposer(dynamic_executor(noisy_copy(lm)))
    output = run_fixed_k(GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=40, grammar=grammar,
                                           end_ids=frozenset([EOS])), proposer, LocalScorer(dynamic_executor(lm)), k)
    assert output == constrained_greedy(lm, guides, grammar, prompt, 40)
    value = json.loads(tokenizer.decode(output))
    assert set(value) == {"name", "age"} and len(value["name"]) <= 6 and 0 <= value["age"] <= 99
    plain = run_fixed_k(GenerationRequest(seq_id=2, prompt_ids=prompt, max_tokens=len(output)), NgramProposer(),
                        LocalScorer(dynamic_executor(lm)), 0)
    assert plain != output  # the random model left to itself writes no JSON


class RecordingScorer(LocalScorer):
    """The in-process scorer, noting of every verify whether it shipped logits and sent a bitmask."""

    def __init__(self, lm):
        super().__init__(lm)
        self.calls = []

    async def score(self, call):
        self.calls.append((call.want_logits, call.allowed is not None))
        return await super().score(call)


@pytest.mark.parametrize("k", [0, 3])
def test_a_greedy_grammar_alone_is_picked_by_the_target_with_no_logits_shipped(lm, guides, tokenizer, k):
    """A greedy request whose only edit is its grammar sends each verify the grammar's bitmask and gets the
    best allowed tokens back, no logits; with another edit (a zero logit bias: it changes nothing) the logits
    come to the loop, which masks them. Same tokens, same log-probabilities (the raw distribution's)."""
    from specdec.decoding.draft_length import DraftLengthPolicy
    from specdec.decoding.loop import generate

    grammar = guides.compile("json_schema", json.dumps(SCHEMA))
    prompt = tokenizer.encode("JSON please: ", add_special_tokens=False)

    async def run(scorer, **edits):
        req = GenerationRequest(seq_id=3, prompt_ids=prompt, max_tokens=30, grammar=grammar, log_probs=True,
                                end_ids=frozenset([EOS]), **edits)
        rounds = [rnd async for rnd in generate(req, LocalProposer(dynamic_executor(noisy_copy(lm))), scorer,
                                                DraftLengthPolicy.fixed(k))]
        return [t for rnd in rounds for t in rnd.new_tokens], [p for rnd in rounds for p in rnd.log_probs]

    picked_by_target, shipped = RecordingScorer(dynamic_executor(lm)), RecordingScorer(dynamic_executor(lm))
    tokens, log_probs = asyncio.run(run(picked_by_target))
    edited, edited_log_probs = asyncio.run(run(shipped, token_bias=TokenBias(bias=((5, 0.0),))))
    assert set(picked_by_target.calls) == {(False, True)} and set(shipped.calls) == {(True, False)}
    assert tokens == edited == constrained_greedy(lm, guides, grammar, prompt, 30)
    assert log_probs == pytest.approx(edited_log_probs, abs=1e-6)
    json.loads(tokenizer.decode(tokens))
    # asked for the logits themselves (TensorRT-LLM's return_generation_logits), the target sends them: the loop
    # masks them, the same tokens; each token's row the raw one
    logged = RecordingScorer(dynamic_executor(lm))

    async def with_logits():
        req = GenerationRequest(seq_id=4, prompt_ids=prompt, max_tokens=30, grammar=grammar, end_ids=frozenset([EOS]),
                                generation_logits=True)
        return [rnd async for rnd in generate(req, LocalProposer(dynamic_executor(noisy_copy(lm))), logged,
                                              DraftLengthPolicy.fixed(k))]
    rounds = asyncio.run(with_logits())
    assert set(logged.calls) == {(True, False)} and [t for rnd in rounds for t in rnd.new_tokens] == tokens
    with torch.no_grad():
        reference = lm(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    assert torch.allclose(torch.cat([rnd.logits for rnd in rounds]), reference, atol=1e-4)


def test_the_best_allowed_token_is_the_masked_argmax(guides, tokenizer):
    matcher = guides.compile("regex", "[0-9]+").matcher()
    digit = tokenizer.convert_tokens_to_ids("4")
    bits = matcher.allowed([digit, digit], 3)  # each row after the digits before it
    logits = torch.randn(3, 49152, dtype=torch.float64)
    picked = allowed_greedy(logits, bits)
    assert picked.tolist() == mask_disallowed(logits, bits).argmax(-1).tolist()
    assert all(tokenizer.decode([t]).isdigit() for t in picked.tolist())
    assert picked.tolist() != logits.argmax(-1).tolist()


def test_greedy_and_deterministic_proposals_are_cut_before_a_refused_token_sampled_ones_are_not(guides, tokenizer):
    matcher = guides.compile("regex", "[0-9]+").matcher()
    digit, letter = tokenizer.convert_tokens_to_ids("4"), tokenizer.convert_tokens_to_ids("a")
    cut = _within_grammar(Proposal([digit, digit, letter, digit], None, 10), matcher)
    assert cut.tokens == [digit, digit] and cut.probs is None and cut.cached_length == 10
    probs = torch.rand(4, 49152)
    cut = _within_grammar(Proposal([digit, letter, digit, digit], probs, 10), matcher)
    assert cut.tokens == [digit] and torch.equal(cut.probs, probs[:1])
    # In the loop, a sampled draft model's proposal stays whole (grammar.py): counted in the round's drafts.


class CountingProposer(NgramProposer):
    """Prompt lookup that counts its calls."""

    calls = 0

    async def propose(self, *args, **kwargs):
        self.calls += 1
        return await super().propose(*args, **kwargs)


def test_text_the_grammar_forces_is_proposed_without_the_draft(lm, guides, tokenizer):
    """A compact JSON schema forces its keys and their punctuation: those rounds propose that text's tokens
    and call no proposer; the output is target-only decoding's, in fewer rounds."""
    from specdec.decoding.draft_length import DraftLengthPolicy
    from specdec.decoding.loop import Stats, generate

    grammar = guides.compile("json_schema", json.dumps(SCHEMA))
    matcher = grammar.matcher()
    assert tokenizer.decode(matcher.forced(8)) == '{"name":"' and matcher.forced(1) == matcher.forced(8)[:1]
    assert matcher.forced(0) == []
    prompt = tokenizer.encode("JSON please: ", add_special_tokens=False)

    async def run(k, proposer):
        stats = Stats()
        rounds = generate(GenerationRequest(seq_id=5, prompt_ids=prompt, max_tokens=40, grammar=grammar),
                          proposer, LocalScorer(dynamic_executor(lm)), DraftLengthPolicy.fixed(k), stats)
        return [t async for rnd in rounds for t in rnd.new_tokens], stats

    plain, plain_stats = asyncio.run(run(0, NgramProposer()))  # K = 0: target-only, nothing forced
    assert plain_stats.rounds == len(plain)  # one token a round; the grammar ends at "}"
    proposer = CountingProposer()
    output, stats = asyncio.run(run(4, proposer))
    assert output == plain and stats.rounds < plain_stats.rounds and stats.accepted >= 5
    assert proposer.calls < stats.rounds  # the forced rounds did not ask it


COLOURS = ["red", "green", "blue", "purple"]
PREFIXED = ["colour: red", "colour: green", "colour: blue"]  # "colour: " is forced: proposed free


def _exact_choice_distribution(model, guides, grammar, tokenizer, prompt):
    """P(text) of sampling the constrained target token by token (temperature 1), every tokenization of
    every choice enumerated."""
    result: dict[str, float] = {}

    def walk(output, probability):
        matcher = llguidance.LLMatcher(guides.tokenizer, grammar.definition, log_level=0)
        assert matcher.consume_tokens(output)
        if matcher.is_stopped():
            text = tokenizer.decode(output)
            result[text] = result.get(text, 0.0) + probability
            return
        allowed = sorted(_reference_allowed(guides, grammar, output))
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1]
        probs = torch.softmax(logits[allowed], -1)
        for token, p in zip(allowed, probs.tolist()):
            assert token != EOS  # no choice is a prefix of another: the grammar ends after each
            walk(output + [token], probability * p)

    walk([], 1.0)
    return result


class MixedProposer:
    """A sampled draft whose every token comes from one fixed distribution: mostly tokens of the choices,
    often one the grammar refuses. Cutting such a proposal at that token would bias the output: a test
    that this draft passes tells a kept proposal from a cut one."""

    def __init__(self, tokenizer):
        words = ["gr", "purple", "p", "red", "blue"]  # "gr": the target's likeliest first token
        ids = [tokenizer.convert_tokens_to_ids(w) for w in words] + [tokenizer.convert_tokens_to_ids("x")]
        assert all(isinstance(i, int) and i > EOS for i in ids)
        self.probs = torch.zeros(49152)
        self.probs[ids] = torch.tensor([0.35, 0.05, 0.05, 0.05, 0.05, 0.45])

    async def propose(self, seq_id, keep, new_ids, k, params, round_seed, reserve=0):
        generator = torch.Generator().manual_seed(round_seed)
        tokens = torch.multinomial(self.probs, k, replacement=True, generator=generator).tolist()
        return Proposal(tokens, self.probs.expand(k, -1).clone(), keep + len(new_ids) + k - 1)

    async def release(self, seq_id):
        pass


@pytest.mark.parametrize("choices,draft,k", [(COLOURS, "mixed", 2), (COLOURS, "draft_model", 2), (COLOURS, "ngram", 3),
                                             (PREFIXED, "draft_model", 2)])
def test_sampled_speculation_follows_the_constrained_target(lm, guides, tokenizer, choices, draft, k):
    """Which colour comes out, against the exact distribution of sampling the constrained target. Sampled
    proposals are kept whole (a draft model's, and one that often proposes a refused token), prompt lookup's
    are cut at a refused token."""
    grammar = guides.compile("choice", json.dumps(choices))
    prompt = tokenizer.encode("Pick one: red, green, blue, purple. purple? purple", add_special_tokens=False)
    exact = _exact_choice_distribution(lm, guides, grammar, tokenizer, prompt)
    assert set(exact) == set(choices) and math.isclose(sum(exact.values()), 1.0, rel_tol=1e-9)
    target = dynamic_executor(lm)
    proposer = {"mixed": lambda: MixedProposer(tokenizer), "draft_model": lambda: LocalProposer(dynamic_executor(noisy_copy(lm))),
                "ngram": lambda: NgramProposer(min_ngram=1)}[draft]()
    n = 1500
    seen: dict[str, int] = {}
    requests = [GenerationRequest(seq_id=10 + seed, prompt_ids=prompt, max_tokens=8, grammar=grammar,
                                  sampling=SamplingParams(temperature=1.0, seed=seed)) for seed in range(n)]
    for out in run_fixed_k_many(requests, proposer, LocalScorer(target), k):
        text = tokenizer.decode(out)
        seen[text] = seen.get(text, 0) + 1
    assert set(seen) <= set(choices)
    tv = 0.5 * sum(abs(seen.get(c, 0) / n - p) for c, p in exact.items())
    noise = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in exact.values())
    assert tv < 2 * noise + 0.01, (tv, noise, seen, exact)
    # The test can tell: the uniform choice is far from the exact distribution.
    assert 0.5 * sum(abs(1 / len(choices) - p) for p in exact.values()) > 3 * (2 * noise + 0.01), exact
