"""Token trees through the decode loop on real executors (the tiny float64 model): whatever the tree and
wherever the target's own continuation sits in it, greedy output equals target-only output; the target's
cache follows the accepted branch (the next rounds would differ otherwise); log-probabilities come from
the accepted path's rows; requests whose logits are edited verify the tree's first branch."""

import asyncio
import random

import pytest
import torch

from specdec import tensor_names as tn
from specdec.decoding.draft_length import CostModel, DraftLengthPolicy
from specdec.decoding.interfaces import Proposal
from specdec.decoding.loop import GenerationRequest, Stats, first_branch, generate
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.decoding.penalties import Penalties
from specdec.decoding.sampling import SamplingParams
from specdec.engine.build import dynamic_executor, static_executor
from specdec.engine.local import LocalScorer

PROMPT = [5, 17, 3, 88, 41, 60, 2, 44]


class OracleTreeProposer:
    """Trees of up to k nodes in which the target's own greedy continuation (known from the model: an
    oracle) sits on a random branch, corrupted at a random depth, among random decoys: every kind of
    acceptance (none, a branch that is not the first, a path cut short) happens."""

    def __init__(self, model, seed: int = 0):
        self.model, self.rng, self.tokens = model, random.Random(seed), {}
        self.trees = self.non_first = 0

    def _greedy(self, context: list[int], n: int) -> list[int]:
        out = []
        with torch.no_grad():
            for _ in range(n):
                out.append(int(self.model(torch.tensor([context + out])).logits[0, -1].argmax()))
        return out

    async def propose(self, seq_id, keep, new_ids, k, params, round_seed, reserve=0):
        tokens = self.tokens.setdefault(seq_id, [])
        del tokens[keep:]
        tokens += new_ids
        depth = max(1, k // 2)
        truth = self._greedy(tokens, depth)
        cut = self.rng.randrange(depth + 1)  # the truth holds up to here, then a wrong token
        branch = truth[:cut] + [(t + 1) % 97 for t in truth[cut:]]
        drafted, parents, parent = [], [], -1
        first_is_truth = self.rng.random() < 0.3
        for level, token in enumerate(branch):
            decoys = [self.rng.randrange(97) for _ in range(self.rng.randrange(2))]
            siblings = [token] + decoys if first_is_truth else decoys + [token]
            for sibling in siblings:
                if len(drafted) == k:
                    break
                drafted.append(sibling)
                parents.append(parent)
            if len(drafted) == k or drafted[-1] != token:
                break
            parent = len(drafted) - 1
        self.trees += 1
        self.non_first += not first_is_truth
        return Proposal(drafted, None, cached_length=len(tokens), parents=tuple(parents))

    async def release(self, seq_id):
        self.tokens.pop(seq_id, None)


def run(req, proposer, scorer, k, stats=None, policy=None):
    async def main():
        chosen = policy or DraftLengthPolicy.fixed(k, branches=getattr(proposer, "branches", 1))
        return [r async for r in generate(req, proposer, scorer, chosen, stats)]
    return asyncio.run(main())


def tokens_of(rounds):
    return [t for r in rounds for t in r.new_tokens]


def executor(model, kind):
    if kind == "dynamic":
        return dynamic_executor(model)
    return static_executor(model, kv_pool_tokens=1024, block_size=8, max_context=256, max_batch=2, max_rows=9,
                           min_window=16, compile="off")


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_greedy_trees_give_the_target_only_output(tiny_lm, kind):
    plain = tokens_of(run(GenerationRequest(1, PROMPT, 40), NgramProposer(), LocalScorer(executor(tiny_lm, kind)), 0))
    proposer, stats = OracleTreeProposer(tiny_lm), Stats()
    rounds = run(GenerationRequest(1, PROMPT, 40, log_probs=True), proposer, LocalScorer(executor(tiny_lm, kind)), 8,
                 stats)
    assert tokens_of(rounds) == plain
    assert stats.accepted > 0 and stats.rounds < 40 and proposer.non_first > 3
    # the log-probabilities of the accepted path's rows: the target-only run's
    plain_lp = [lp for r in run(GenerationRequest(2, PROMPT, 40, log_probs=True), NgramProposer(),
                                LocalScorer(executor(tiny_lm, kind)), 0) for lp in r.log_probs]
    assert torch.allclose(torch.tensor([lp for r in rounds for lp in r.log_probs]), torch.tensor(plain_lp), atol=1e-9)


LOOKUP_PROMPT = [3, 4, 5, 6, 3, 4, 7, 8, 3, 4, 5, 9, 3, 4]  # "3 4" continues three ways


def spied_lookup(asked: list) -> NgramProposer:
    """Prompt lookup 3 wide that records each call's (branches asked, the proposal's parents)."""
    proposer = NgramProposer(min_ngram=1, branches=3)
    original = proposer.propose

    async def spy(*args, **kwargs):
        proposal = await original(*args, **kwargs)
        asked.append((kwargs.get("branches"), proposal.parents))
        return proposal

    proposer.propose = spy
    return proposer


def test_prompt_lookup_trees_give_the_target_only_output(tiny_lm):
    plain = tokens_of(run(GenerationRequest(1, LOOKUP_PROMPT, 30), NgramProposer(),
                          LocalScorer(dynamic_executor(tiny_lm)), 0))
    seen = []
    out = run(GenerationRequest(1, LOOKUP_PROMPT, 30), spied_lookup(seen), LocalScorer(dynamic_executor(tiny_lm)), 6)
    assert tokens_of(out) == plain
    assert any(parents is not None for _, parents in seen)
    # A policy narrower than its proposer (a request's num_draft_branches = 1 on a server of wider trees):
    # every round asks for a chain and gets one
    seen.clear()
    out = run(GenerationRequest(1, LOOKUP_PROMPT, 30), spied_lookup(seen), LocalScorer(dynamic_executor(tiny_lm)), 6,
              policy=DraftLengthPolicy.fixed(6, branches=1))
    assert tokens_of(out) == plain
    assert seen and all(branches == 1 and parents is None for branches, parents in seen)


def test_the_adaptive_policy_picks_each_rounds_shape_and_the_output_stays_the_targets(tiny_lm):
    """A proposer 3 wide under the adaptive policy: rounds ask for trees or chains as the policy says
    (`branches`), the trees' depths and calls are measured apart, and greedy output is target-only's; with
    edited logits every round asks for a chain."""
    prompt = LOOKUP_PROMPT
    plain = tokens_of(run(GenerationRequest(1, prompt, 40), NgramProposer(), LocalScorer(dynamic_executor(tiny_lm)), 0))
    asked = []
    proposer = spied_lookup(asked)
    costs = CostModel()
    policy = DraftLengthPolicy(6, costs, tn.NGRAM, free=True, branches=3, explore_every=2)
    out = run(GenerationRequest(1, prompt, 40), proposer, LocalScorer(dynamic_executor(tiny_lm)), 6, policy=policy)
    assert tokens_of(out) == plain
    assert {width for width, _ in asked} == {1, 3}
    assert all(parents is None for width, parents in asked if width == 1)
    assert any(parents is not None for _, parents in asked) and costs.tree_depth[tn.NGRAM]
    assert tn.NGRAM + "/tree" in costs.draft_s
    asked.clear()
    penalties = Penalties(repetition=1.3)
    policy = DraftLengthPolicy(6, CostModel(), tn.NGRAM, free=True, branches=3, explore_every=1)
    run(GenerationRequest(2, prompt, 20, penalties=penalties), proposer, LocalScorer(dynamic_executor(tiny_lm)), 6,
        policy=policy)
    assert asked and all(width == 1 for width, _ in asked)


def test_edited_requests_verify_the_first_branch(tiny_lm):
    """Penalties edit the target's logits on the host: the loop verifies the tree's first branch as a chain,
    with the same output as target-only decoding under the same penalties."""
    penalties = Penalties(repetition=1.3, presence=0.4)
    plain = tokens_of(run(GenerationRequest(1, PROMPT, 30, penalties=penalties), NgramProposer(),
                          LocalScorer(dynamic_executor(tiny_lm)), 0))
    scorer = LocalScorer(dynamic_executor(tiny_lm))
    calls = []
    score = scorer.score

    async def spy(call):
        calls.append(call)
        return await score(call)

    scorer.score = spy
    out = tokens_of(run(GenerationRequest(1, PROMPT, 30, penalties=penalties), OracleTreeProposer(tiny_lm), scorer, 6))
    assert out == plain and all(call.tree is None for call in calls)


def test_sampled_tree_rounds_are_seeded():
    """A sampled request with tree proposals (point masses) gives the same tokens twice with one seed."""
    from tests.unit.conftest import tiny_llama

    model = tiny_llama(97, seed=0, initializer_range=0.5, max_positions=256)
    params = SamplingParams(temperature=0.8, seed=7)
    outs = [tokens_of(run(GenerationRequest(1, PROMPT, 20, sampling=params), OracleTreeProposer(model, seed=1),
                          LocalScorer(dynamic_executor(model)), 6)) for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) == 20


def test_first_branch_of_a_tree():
    probs = torch.eye(6)
    proposal = Proposal([1, 2, 3, 4], probs[:5], 9, parents=(-1, -1, 0, 2))
    branch = first_branch(proposal)
    assert branch.tokens == [1, 3, 4] and branch.parents is None and branch.cached_length == 9
    assert torch.equal(branch.probs, probs[[0, 1, 3]])  # each token's parent's row


def test_the_tree_bench_runs_and_its_trees_are_exact(tmp_path):
    """`make bench-trees` on the tiny pair: every setting's text equals target-only's."""
    from bench import tree_bench

    out = tmp_path / "trees.md"
    assert tree_bench.main(["--pair", "tiny", "--prompts", "1", "--max-tokens", "8", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "setting" not in line]
    assert len(rows) == 2 * len(tree_bench.SETTINGS) and all(row.rstrip(" |").endswith("1/1") for row in rows)
    # --draft-head: a (random) head's chains and EAGLE-2 trees beside target-only
    from transformers import AutoConfig

    from specdec.engine.draft_heads import EAGLE3, random_head, save_head
    from specdec.serving import pairs

    head = save_head(random_head(EAGLE3, AutoConfig.from_pretrained(pairs.tiny_pair().target_path), seed=1,
                                 aux_layers=(0, 1, 1), draft_vocab_size=4096), tmp_path / "head")
    assert tree_bench.main(["--pair", "tiny", "--prompts", "1", "--max-tokens", "8", "--out", str(out),
                            "--draft-head", str(head), "--head-only"]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "setting" not in line]
    assert len(rows) == 2 * (1 + len(tree_bench.HEAD_SETTINGS)) and all(row.rstrip(" |").endswith("1/1") for row in rows)
    assert any("head tree" in row and "| 0%" not in row for row in rows)  # the head's trees were verified
    # --only: target-only and the settings named
    assert tree_bench.main(["--pair", "tiny", "--prompts", "1", "--max-tokens", "8", "--out", str(out),
                            "--draft-head", str(head), "--head-only", "--only", "K<=6,K<=12"]) == 0
    labels = [line.split("|")[1].strip() for line in out.read_text().splitlines()
              if line.startswith("| ") and "setting" not in line]
    assert labels == 2 * ["target-only", "head chain, adaptive K<=6", "head tree of 3, adaptive K<=12"]


def test_a_proposer_keeps_what_follows_its_first_branch():
    """A proposer whose cache holds its trees' first branch (as a model draft's would): after a round that
    accepted another branch, it is asked to keep only the part of its cache the output agrees with; every
    cache it holds is a prefix of the output."""
    import random as rnd

    from specdec.decoding.interfaces import Scores
    from specdec.decoding.tree_sampler import path_to
    from tests.unit.test_loop import reference_greedy, true_next

    class TreeScorer:
        """test_loop's fake target language, scoring chains and trees from the cache it keeps."""

        def __init__(self):
            self.cache, self.tree = [], None

        async def score(self, call):
            if call.path is not None:  # the last call's tree: its accepted nodes where a chain's would be
                start, ids = self.tree
                self.cache[start:] = [ids[node] for node in call.path]
            assert call.keep <= len(self.cache)
            del self.cache[call.keep:]
            start, ids = len(self.cache), call.new_ids
            if call.tree is None:
                contexts = [self.cache + ids[:j + 1] for j in range(len(ids))]
            else:
                contexts = [self.cache + [ids[i] for i in path_to(call.tree, j)] for j in range(len(ids))]
            self.cache += ids
            self.tree = (start, ids) if call.tree is not None else None
            return Scores(torch.tensor([true_next(c) for c in contexts[-call.num_positions:]]), None)

        async def release(self, seq_id):
            pass

    class FirstBranchCache:
        def __init__(self):
            self.cache, self.snapshots, self.rng = [], [], rnd.Random(3)

        async def propose(self, seq_id, keep, new_ids, k, params, round_seed, reserve=0):
            assert keep <= len(self.cache)
            del self.cache[keep:]
            self.cache += new_ids
            self.snapshots.append(list(self.cache))
            context, tokens, parents, parent = list(self.cache), [], [], -1
            for _ in range(max(1, k // 2)):
                truth = true_next(context)
                wrong = (truth + 1 + self.rng.randrange(3)) % 50
                first, second = (truth, wrong) if self.rng.random() < 0.5 else (wrong, truth)
                tokens += [first, second]
                parents += [parent, parent]
                parent = len(tokens) - 2  # the cache follows the first child, right or wrong
                context.append(first)
            self.cache += [tokens[i] for i in range(0, len(tokens) - 2, 2)]  # its first branch but the last
            return Proposal(tokens, None, cached_length=len(self.cache), parents=tuple(parents))

        async def release(self, seq_id):
            pass

    proposer = FirstBranchCache()
    prompt = [3, 1, 4, 1, 5]
    out = tokens_of(run(GenerationRequest(1, prompt, 30), proposer, TreeScorer(), 8))
    assert out == reference_greedy(prompt, 30)
    full = prompt + out
    assert all(snapshot == full[:len(snapshot)] for snapshot in proposer.snapshots)
