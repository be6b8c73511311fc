"""The adaptive draft-length policy: the expected-speedup rule, measured costs, acceptance tracking."""

import pytest

from specdec.decoding.interfaces import ForwardStats

from specdec.decoding.draft_length import (CostModel, DraftLengthPolicy, best_draft_length, expected_tokens,
                                        speedup)


def linear(slope, draft_cost=0.0):
    """round_cost(k) of a draft costing `draft_cost` per token and a verify growing by `slope` per token."""
    return lambda k: 1.0 + slope * k + draft_cost * k


def test_expected_tokens_closed_form_and_limits():
    assert expected_tokens(0.0, 5) == 1.0  # nothing accepted: the target's own token
    assert expected_tokens(1.0, 5) == 6.0  # everything accepted: K + 1
    assert expected_tokens(0.5, 0) == 1.0
    # The series 1 + α + ... + α^K.
    assert expected_tokens(0.6, 4) == pytest.approx(sum(0.6 ** i for i in range(5)))


def test_speedup_is_the_leviathan_bound():
    # α = 0.8, K = 4, d(4) = 4 · 0.05, v = 1.2: (1 - 0.8^5) / (0.2 · (4 · 0.05 + 1.2))
    assert speedup(0.8, 4, 4 * 0.05 + 1.2) == pytest.approx((1 - 0.8 ** 5) / 0.2 / 1.4)


def test_no_speculation_when_it_cannot_pay():
    # Low acceptance and a costly draft: target-only (k = 0) is best.
    assert best_draft_length(0.1, 8, linear(0.1, 0.3)) == (0, 1.0)
    # A free draft but verification that costs as much as a step per extra token: never pays either.
    assert best_draft_length(0.5, 8, linear(1.0))[0] == 0


def test_longer_drafts_as_acceptance_rises():
    ks = [best_draft_length(alpha, 16, linear(0.05, 0.05))[0] for alpha in (0.3, 0.6, 0.8, 0.95)]
    assert ks == sorted(ks) and ks[0] < ks[-1]
    assert ks[-1] >= 8


def test_best_length_follows_a_non_linear_verify_table():
    # The CPU shape measured on SmolLM2: verifying 2-3 positions costs more than 5.
    table = {1: 1.63, 2: 2.07, 3: 1.57, 4: 1.44, 5: 1.44, 6: 1.77, 7: 1.5, 8: 1.78}
    k, value = best_draft_length(0.6, 8, table.__getitem__)
    assert k in (4, 5) and value == pytest.approx(max(expected_tokens(0.6, j) / table[j] for j in table))


def test_cost_model_measures_ratios_and_interpolates():
    costs = CostModel(decay=0.0)  # no smoothing: the last sample is the value
    assert costs.verify_cost(4) == pytest.approx(1.4)  # prior before any measurement
    costs.observe_verify(1, 0.040)
    costs.observe_verify(5, 0.060)
    costs.observe_verify(9, 0.080)
    assert costs.verify_cost(0) == 1.0
    assert costs.verify_cost(4) == pytest.approx(1.5)  # 5 positions: 60 / 40 ms
    assert costs.verify_cost(6) == pytest.approx(1.75)  # 7 positions: between 60 and 80 ms
    assert costs.verify_cost(12) == pytest.approx(1.0 + 0.1 * 12)  # beyond what was measured: the prior
    costs.observe_draft("model", 4, 0.032)  # one size measured: 8 ms per drafted token
    assert costs.draft_cost("model", 4) == pytest.approx(0.8)
    assert costs.draft_cost("model", 2) == pytest.approx(0.4)
    assert costs.draft_cost("model", 0) == 0.0
    assert costs.draft_cost("never_seen", 3) == pytest.approx(3 * costs.prior_draft_cost)
    assert costs.round_cost("model", 4) == pytest.approx(0.8 + 1.5)
    assert costs.round_cost("model", 0) == 1.0


def test_draft_call_cost_keeps_its_fixed_part():
    """A served draft call = a fixed part (BLS round trip, request handling) + a cost per step: measured by
    k, d(k) is interpolated between sizes and extrapolated along the lines through the nearest two, never
    below proportional."""
    costs = CostModel(decay=0.0)
    costs.observe_verify(1, 0.010)
    for k in (2, 4):
        costs.observe_draft("model", k, 0.002 + 0.0013 * k)  # 2 ms fixed + 1.3 ms per token
    assert costs.draft_cost("model", 3) == pytest.approx(0.59)  # between: (2 + 3.9) / 10
    assert costs.draft_cost("model", 6) == pytest.approx(0.98)  # past 4: along the line
    assert costs.draft_cost("model", 1) == pytest.approx(0.33)  # below 2: the fixed part stays
    steep = CostModel(decay=0.0)
    steep.observe_verify(1, 0.010)
    steep.observe_draft("model", 2, 0.002)
    steep.observe_draft("model", 3, 0.006)  # noise: the line below would cross zero; proportional instead
    assert steep.draft_cost("model", 1) == pytest.approx(0.1)
    steep.observe_draft("model", 3, 0.001)  # a line falling with k: flat below
    assert steep.draft_cost("model", 1) == pytest.approx(0.2)


def test_a_fixed_draft_call_cost_does_not_pull_k_down():
    """The served GPU shape (8B-shaped target, 4-layer draft): a 9.7 ms verify, draft calls of 2 ms + 1.3 ms
    per token, α = 0.78. Drafting 4 pays most; a short draft's call, dearer per token, must not make the
    policy believe every drafted token costs that much (per-token costs from the last k ran gave K = 2)."""
    costs = CostModel(decay=0.0)
    costs.observe_verify(1, 0.0097)
    costs.observe_verify(5, 0.0101)
    policy = DraftLengthPolicy(4, costs, "model")
    policy.successes, policy.failures, policy.prior_weight = 0.78, 0.22, 0.0
    for k in (4, 1):  # K=4 rounds ran, then a short one (a probe, or a dip in α)
        costs.observe_draft("model", k, 0.002 + 0.0013 * k)
    assert policy.next_k() == 4


def test_policy_stops_drafting_on_rejections_and_resumes_on_acceptance():
    costs = CostModel(decay=0.0)
    for positions in range(1, 10):
        costs.observe_verify(positions, 0.04 * (1 + 0.05 * (positions - 1)))
    costs.observe_draft("model", 1, 0.008)  # c = 0.2
    policy = DraftLengthPolicy(8, costs, "model")
    first = policy.next_k()
    assert first > 0  # prior α = 0.5 pays with c = 0.2 and cheap verification
    for _ in range(6):
        policy.update(4, 0)  # every first draft token rejected
    assert policy.alpha < 0.2 and policy.next_k() == 0
    for _ in range(8):
        policy.update(4, 4)
    assert policy.alpha > 0.8 and policy.next_k() > first


def test_paused_costly_policy_probes_with_one_token_and_backs_off():
    costs = CostModel(decay=0.0)
    costs.observe_verify(1, 0.04)
    costs.observe_draft("model", 1, 0.02)  # c = 0.5: needs high acceptance
    policy = DraftLengthPolicy(8, costs, "model", probe_every=4)
    for _ in range(10):
        policy.update(4, 0)
    probes = []
    for round_ in range(60):
        k = policy.next_k()
        if k:
            probes.append(round_)
            assert k == 1
            policy.update(1, 0)  # the probe is rejected
    # Waits of 4, 8, 16, 32 rounds between probes: each rejected probe doubles the next wait.
    assert probes == [3, 11, 27, 59]


def test_free_proposer_pauses_into_shadow_checks_and_resumes_on_a_match():
    """A free proposer whose proposals keep failing stops being verified (k = 0) but keeps proposing in
    the shadow; shadow matches (fed to update like a one-token round) turn drafting back on."""
    costs = CostModel(decay=0.0)
    costs.observe_verify(1, 0.04)
    costs.observe_verify(9, 0.08)
    policy = DraftLengthPolicy(8, costs, "ngram", free=True)
    for _ in range(10):
        policy.update(8, 0)
    assert policy.alpha < 0.15
    assert policy.next_k() == 0 and policy.shadow  # not verified, still checked
    for _ in range(3):
        policy.update(1, 1)  # the shadow's first token was the target's
    assert policy.next_k() > 0 and not policy.shadow


def test_costly_proposer_never_shadows():
    costs = CostModel(decay=0.0)
    costs.observe_verify(1, 0.04)
    costs.observe_verify(2, 0.08)
    costs.observe_draft("model", 1, 0.004)
    policy = DraftLengthPolicy(1, costs, "model")
    for _ in range(10):
        policy.update(1, 0)
    assert policy.next_k() == 0 and not policy.shadow


def test_verify_cost_from_batched_forwards_grows_with_load():
    """v(k) = T(n(k+1)) / T(n) over measured target forwards: cheap alone, costly when n sequences
    already fill each forward; interpolated between row counts and extrapolated past the largest."""
    costs = CostModel(decay=0.0)
    for rows, seconds in ((1, 0.030), (5, 0.033), (8, 0.050), (40, 0.085)):
        costs.observe_forward(ForwardStats(rows, 1, seconds))
    assert abs(costs.verify_cost(4) - 0.033 / 0.030) < 1e-9  # alone: T(5) / T(1)
    assert abs(costs.verify_cost(2) - (0.030 + 0.003 * 2 / 4) / 0.030) < 1e-9  # T(3) between T(1) and T(5)
    for _ in range(50):
        costs.observe_forward(ForwardStats(8, 8, 0.050))  # now steps share forwards with 7 others
    assert round(costs.sequences.value) == 8
    assert abs(costs.verify_cost(4) - 0.085 / 0.050) < 1e-9  # T(40) / T(8)
    extrapolated = 0.085 + (0.085 - 0.050) / 32 * 32  # T(72) along the line through T(8) and T(40)
    assert abs(costs.verify_cost(8) - extrapolated / 0.050) < 1e-9
    # At 8 sequences a 36% acceptance no longer pays for K=4; alone it does.
    policy = DraftLengthPolicy(4, costs, "ngram", free=True)
    policy.successes, policy.failures, policy.prior_weight = 0.36, 0.64, 0.0
    assert policy.next_k() == 0 and policy.shadow
    alone = CostModel(decay=0.0)
    for rows, seconds in ((1, 0.030), (5, 0.033)):
        alone.observe_forward(ForwardStats(rows, 1, seconds))
    policy = DraftLengthPolicy(4, alone, "ngram", free=True)
    policy.successes, policy.failures, policy.prior_weight = 0.36, 0.64, 0.0
    assert policy.next_k() > 0


def test_fixed_length_when_not_adaptive_and_zero_means_target_only():
    costs = CostModel()
    assert DraftLengthPolicy(5, costs, "model", adaptive=False).next_k() == 5
    assert DraftLengthPolicy(0, costs, "model").next_k() == 0
    assert DraftLengthPolicy(0, costs, "ngram", free=True).next_k() == 0


def test_a_busy_server_makes_every_round_target_only_and_leaves_the_estimate_alone():
    """max_drafting_sequences: while `busy` says True, fixed and adaptive policies draft nothing, a free
    proposer does not even shadow, and a paused costly one neither probes nor counts the round."""
    load = {"busy": True}
    busy = lambda: load["busy"]  # noqa: E731
    costs = CostModel(decay=0.0)
    costs.observe_verify(1, 0.04)
    costs.observe_draft("model", 1, 0.02)
    fixed = DraftLengthPolicy(5, costs, "model", adaptive=False, busy=busy)
    free = DraftLengthPolicy(8, costs, "ngram", free=True, busy=busy)
    for _ in range(10):
        free.update(8, 0)  # paused: idle, it would shadow
    costly = DraftLengthPolicy(8, costs, "model", probe_every=2, busy=busy)
    for _ in range(10):
        costly.update(4, 0)  # paused: idle, it would probe every other round
    alpha = costly.alpha
    for _ in range(6):
        assert fixed.next_k() == 0
        assert free.next_k() == 0 and not free.shadow
        assert costly.next_k() == 0 and not costly.probing
    assert costly.paused_rounds == 0 and costly.alpha == alpha
    load["busy"] = False
    assert fixed.next_k() == 5
    assert free.next_k() == 0 and free.shadow
    assert [costly.next_k() for _ in range(2)] == [0, 1]  # the probe schedule went on from where it was


def test_new_requests_start_from_the_servers_running_acceptance():
    costs = CostModel()
    first = DraftLengthPolicy(8, costs, "model")
    for _ in range(200):
        first.update(4, 4)
    assert costs.prior_alpha("model") > 0.9
    assert DraftLengthPolicy(8, costs, "model").alpha > 0.9
    assert DraftLengthPolicy(8, costs, "ngram").alpha == 0.5  # other methods keep their own prior
    # The server's α is on the requests' scale: accepted tokens over accepted plus rejections (2 of 4
    # accepted every round is α = 2/3, a per-token rate, where accepted over drafted would say 1/2).
    half = CostModel()
    for _ in range(200):
        DraftLengthPolicy(8, half, "model").update(4, 2)
    assert half.prior_alpha("model") == pytest.approx(2 / 3)


def test_round_costs_follow_new_measurements():
    """d(k) + v(k) is memoized (asked for every k every round) but follows what is measured: exact while
    observations are few, refreshed every `refresh` observations after."""
    costs = CostModel(decay=0.0)
    costs.observe_verify(1, 0.010)
    costs.observe_verify(5, 0.0105)
    policy = DraftLengthPolicy(4, costs, "model")
    policy.successes, policy.failures, policy.prior_weight = 0.7, 0.3, 0.0
    costs.observe_draft("model", 4, 0.004)  # cheap: draft all 4
    assert policy.next_k() == 4
    for _ in range(costs.refresh * 3):  # the draft turns dear (another model on its GPU, say)
        costs.observe_draft("model", 4, 0.040)
    assert costs.round_cost("model", 4) == pytest.approx(4.0 + 1.05)
    assert policy.next_k() == 0


# ---- trees: the rule weighs a tree of the proposer's width against a chain every round ----------------

def _measured(row_cost: float, tree_depth: dict[int, int], draft_step: float = 0.0) -> CostModel:
    """A cost model with its forwards measured at one sequence, T(rows) = 1 + row_cost·(rows - 1) (ms), a
    draft call of k tokens k·draft_step ms (a tree's: its depth's steps), and trees of n nodes `tree_depth[n]`
    deep."""
    costs = CostModel(decay=0.0)
    for rows in range(1, 18):
        costs.observe_forward(ForwardStats(rows, 1, (1.0 + row_cost * (rows - 1)) / 1e3))
    costs.observe_verify(1, 1e-3)
    for n, depth in tree_depth.items():
        costs.observe_tree("head", n, depth)
        if draft_step:
            costs.observe_draft("head", n, n * draft_step / 1e3)
            costs.observe_draft("head/tree", n, depth * draft_step / 1e3)
    return costs


def _policy(costs: CostModel, chain_alpha: float, tree_alpha: float, **kw) -> DraftLengthPolicy:
    policy = DraftLengthPolicy(8, costs, "head", branches=3, **kw)
    policy.successes, policy.failures, policy.prior_weight = chain_alpha, 1 - chain_alpha, 0.0
    policy.tree_successes, policy.tree_failures = tree_alpha, 1 - tree_alpha
    return policy


DEPTHS = {n: max(1, n // 2) for n in range(2, 9)}  # trees about two candidates a level


def test_a_tree_is_drafted_when_its_levels_accept_enough_more_to_pay_for_their_rows():
    costs = _measured(row_cost=0.02, tree_depth=DEPTHS, draft_step=0.1)
    policy = _policy(costs, chain_alpha=0.4, tree_alpha=0.8)
    k = policy.next_k()
    assert policy.width == 3 and 2 <= k <= 8
    # The value it chose is the best over both shapes by the rule's own arithmetic.
    tree_value = expected_tokens(0.8, costs.depth("head", k, 3)) / costs.tree_round_cost("head", k, DEPTHS[k])
    chain_best = best_draft_length(0.4, 8, lambda j: costs.round_cost("head", j))[1]
    assert tree_value > chain_best
    # The same tree acceptance as the chain's: a tree's nodes buy less depth than a chain's, so chains.
    policy = _policy(costs, chain_alpha=0.6, tree_alpha=0.6)
    assert policy.next_k() > 0 and policy.width == 1


def test_trees_give_way_to_chains_and_then_to_nothing_as_rows_get_dear():
    shapes = []
    for row_cost in (0.02, 0.3, 1.0):  # alone; rows no longer free (load); every row a full step
        policy = _policy(_measured(row_cost, DEPTHS, draft_step=0.1), chain_alpha=0.5, tree_alpha=0.7)
        k = policy.next_k()
        shapes.append((policy.width if k else 0, k))
    assert shapes[0][0] == 3 and shapes[1] == (1, shapes[1][1]) and shapes[1][1] > 0 and shapes[2] == (0, 0)


def test_while_chains_win_a_tree_is_still_tried_every_explore_every_rounds():
    policy = _policy(_measured(0.02, DEPTHS, draft_step=0.1), chain_alpha=0.6, tree_alpha=0.6, explore_every=4)
    widths = []
    for _ in range(12):
        k = policy.next_k()
        assert k > 0
        widths.append(policy.width)
    assert widths == [1, 1, 1, 3] * 3


def test_tree_rounds_teach_both_estimates_and_chain_rounds_only_the_chains():
    costs = CostModel()
    policy = DraftLengthPolicy(8, costs, "head", branches=3)
    chain_before, tree_before = policy.alpha, policy.tree_alpha
    # Trees whose every level is taken, their first branch rejected at once: trees good, chains poor.
    for _ in range(6):
        policy.update(3, 3, first_branch=(3, 0))
    assert policy.tree_alpha > tree_before and policy.alpha < chain_before
    assert costs.prior_alpha("head/tree") > costs.prior_alpha("head")  # the server's running figures too
    tree_after = (policy.tree_successes, policy.tree_failures)
    policy.update(4, 4)  # a chain round
    assert (policy.tree_successes, policy.tree_failures) == tree_after
    # A tree's levels hold the chain's token: its estimate never falls below the chain's.
    for _ in range(10):
        policy.update(4, 4)
        policy.update(3, 0, first_branch=(3, 0))
    assert policy.tree_alpha >= policy.alpha


def test_tree_draft_calls_and_depths_are_measured_apart_from_chains():
    costs = CostModel(decay=0.0)
    policy = DraftLengthPolicy(8, costs, "head", branches=3)
    assert costs.depth("head", 6, 3) == 2.0  # before any tree: ceil(6 / 3)
    policy.observe_draft(6, 0.003, depth=4)
    policy.observe_draft(4, 0.004)
    assert costs.depth("head", 6, 3) == 4.0 and set(costs.draft_s) == {"head", "head/tree"}
    costs.observe_verify(1, 0.001)
    assert costs.draft_cost("head/tree", 6) == pytest.approx(3.0)


def test_fixed_trees_draft_their_width_every_round():
    policy = DraftLengthPolicy.fixed(6, branches=3)
    assert [(policy.next_k(), policy.width) for _ in range(3)] == [(6, 3)] * 3
    with pytest.raises(ValueError, match="branches"):
        DraftLengthPolicy(4, CostModel(), "head", branches=0)


# ---- under load: the draft's device time in the batch view, forwards at their quietest -----------------

def test_a_forward_costs_its_quietest_time_and_more_rows_never_cost_less():
    """On a device shared with the draft a forward's wall time carries the draft's work too: the table
    keeps each row count's lower envelope (down at once, up slowly), and T(rows) never decreases."""
    costs = CostModel()
    for seconds in (0.05, 0.15, 0.15, 0.15):  # quiet once, then beside the draft's calls
        costs.observe_forward(ForwardStats(4, 4, seconds))
    assert 0.05 < costs.forward_s[4].value < 0.07
    for _ in range(200):  # a real change (longer contexts) is followed
        costs.observe_forward(ForwardStats(4, 4, 0.08))
    assert costs.forward_s[4].value == pytest.approx(0.08, rel=1e-3)
    costs.observe_forward(ForwardStats(1, 1, 0.20))  # only ever measured under contention
    costs.observe_forward(ForwardStats(20, 4, 0.10))
    assert costs._forward_seconds(1) == pytest.approx(0.08, rel=1e-3)  # more rows never cost less: 4 rows' time
    assert costs._forward_seconds(12) == pytest.approx(0.09, rel=1e-3)  # between 4 and 20 rows


def test_under_load_a_draft_call_costs_every_sequences_share_of_the_device():
    """d(k) alone is the call's latency over a target step's; with n sequences per forward it is at least
    n·s(k) / T(n), s(k) the draft's batched execution's seconds per sequence: the drafts of every sequence
    take that from the device the target runs on, however short each call looks beside a full batch."""
    costs = CostModel(decay=0.0)
    costs.observe_verify(1, 0.100)  # a 1-position verify waits in a full batch: 100 ms
    costs.observe_draft("head", 4, 0.010, ForwardStats(4, 4, 0.016))  # 4 calls in one 16 ms execution
    costs.observe_forward(ForwardStats(1, 1, 0.030))
    assert costs.draft_cost("head", 4) == pytest.approx(0.1)  # alone: latency over latency
    for _ in range(60):
        costs.observe_forward(ForwardStats(8, 8, 0.040))  # 8 sequences per forward
    assert costs.draft_cost("head", 4) == pytest.approx(8 * 0.004 / 0.040)
    # The same draft without its device time reported: the request's view only
    blind = CostModel(decay=0.0, sequences=costs.sequences, forward_s=costs.forward_s)
    blind.observe_verify(1, 0.100)
    blind.observe_draft("head", 4, 0.010)
    assert blind.draft_cost("head", 4) == pytest.approx(0.1)
    # What that changes: a tree whose levels accept 0.4 pays alone and not under load
    for model in (costs, blind):
        for rows in (8, 40):
            model.observe_forward(ForwardStats(rows, 8, 0.040 + 0.0002 * (rows - 8)))
        model.observe_draft("head/tree", 4, 0.010, ForwardStats(4, 4, 0.016) if model is costs else None)
        model.observe_tree("head", 4, 2)
    loaded, unaware = (DraftLengthPolicy(4, model, "head", branches=3) for model in (costs, blind))
    for policy in (loaded, unaware):
        policy.successes, policy.failures, policy.prior_weight = 0.1, 0.9, 0.0
        policy.tree_successes, policy.tree_failures = 0.4, 0.6
    assert unaware.next_k() > 0 and unaware.width == 3
    assert loaded.next_k() == 0


def test_a_chain_never_measured_beside_trees_is_priced_from_their_calls():
    costs = CostModel(decay=0.0)
    costs.observe_verify(1, 0.010)
    assert costs.draft_cost("head", 3) == pytest.approx(0.9)  # the prior: 0.3 a token
    costs.observe_draft("head/tree", 3, 0.002)
    assert costs.draft_cost("head", 3) == pytest.approx(0.2)  # the tree call of as many nodes
    costs.observe_draft("head", 3, 0.004)
    assert costs.draft_cost("head", 3) == pytest.approx(0.4)  # measured: its own


def test_each_tree_size_has_its_own_acceptance_and_the_largest_is_explored():
    """A level of a larger tree holds more candidates: priced at one shared rate, the small tree the rule
    prefers would keep every tree looking poor. Per size, the wide tree that pays is found."""
    costs = _measured(row_cost=0.02, tree_depth={n: 1 for n in range(2, 9)}, draft_step=0.1)
    policy = _policy(costs, chain_alpha=0.3, tree_alpha=0.3, explore_every=2)
    policy.prior_weight = 1.0
    tried = []
    for _ in range(40):
        k = policy.next_k()
        tried.append((k, policy.width))
        if policy.width > 1:  # a level of k candidates holds the target's token in 3k rounds of 20
            policy.update(1, int(len(tried) % 20 < 3 * k), first_branch=(1, 0))
        else:
            policy.update(k, 0)
    assert (8, 3) in tried  # the largest was explored
    assert costs.tree_level_alpha("head/tree", 8) > costs.tree_level_alpha("head/tree", 2)
    assert tried[-1] == (8, 3)  # and is what the rule now drafts


def test_alone_every_round_pays_the_verify_calls_machinery():
    """At one sequence a round is the verify call, not only its forward: its time outside the forward
    (BLS, adapters, Triton) is paid by target-only rounds too, so v(k) = (T(k+1) + m) / (T(1) + m)."""
    costs = CostModel(decay=0.0)
    for rows, seconds in ((1, 0.048), (5, 0.064)):
        costs.observe_forward(ForwardStats(rows, 1, seconds))
    assert costs.verify_cost(4) == pytest.approx(0.064 / 0.048)
    costs.observe_verify(1, 0.058, ForwardStats(1, 1, 0.048))  # 10 ms of machinery
    costs._v_memo.clear()
    assert costs.verify_cost(4) == pytest.approx(0.074 / 0.058)
    loaded = CostModel(decay=0.0)  # under load the batch's view stays the forwards' (machinery overlaps)
    for rows, seconds in ((8, 0.050), (40, 0.085)):
        loaded.observe_forward(ForwardStats(rows, 8, seconds))
    loaded.sequences.value = 8
    loaded.observe_verify(1, 0.300, ForwardStats(8, 8, 0.050))
    assert loaded.machinery.value is None and loaded.verify_cost(4) == pytest.approx(0.085 / 0.050)


def test_a_draft_that_stops_early_is_priced_by_what_it_drafts():
    """A draft with a confidence stop asked for k drafts fewer: asking for more costs d(n) + v(n) over the n
    it drafts, and yields 1 + sum_i p_i α^i, so a cap above what it drafts is no longer priced as k steps."""
    costs = CostModel(decay=0.0)
    for positions in range(1, 10):
        costs.observe_verify(positions, 0.04 * (1 + 0.08 * (positions - 1)))
    for k in (1, 2):
        costs.observe_draft("head", k, 0.004 * k)  # c = 0.1
    assert costs.reach("head", 3) == [1.0, 1.0, 1.0]  # nothing measured: a draft drafts all it is asked
    for _ in range(50):  # asked 6: one token, or two when the first was sure, never a third
        costs.observe_proposal("head", 6, 1)
        costs.observe_proposal("head", 6, 2)
    reach = costs.reach("head", 6)
    assert reach[0] == 1.0 and reach[1] == pytest.approx(0.5, abs=0.02) and reach[2] < 0.02
    # The round asked for 6 costs what its one- and two-token drafts cost, half each
    expected = 0.5 * costs.round_cost("head", 1) + 0.5 * costs.round_cost("head", 2)
    assert costs.chain_round_cost("head", 6) == pytest.approx(expected, rel=0.02)
    assert costs.chain_round_cost("head", 6) < costs.round_cost("head", 3)
    assert expected_tokens(0.5, 6, reach) == pytest.approx(1 + 0.5 + 0.5 * 0.25, abs=0.01)
    # A position seen once is not taken as certain: one stop at 3 after a run that drafted all it was asked
    once = CostModel()
    once.observe_proposal("head", 3, 2)
    assert once.reach("head", 4)[2] == pytest.approx(0.5) and once.reach("head", 4)[3] == pytest.approx(0.25)


def test_a_model_draft_is_timed_before_the_rule_may_pause_it():
    """Priced by the prior until a steady round times it, a draft could be paused before it showed its cost
    (and a paused draft's probes catch up on missed rounds, so they never time it): one token until timed."""
    costs = CostModel(decay=0.0)
    costs.observe_verify(1, 0.04)
    costs.observe_verify(2, 0.045)
    policy = DraftLengthPolicy(6, costs, "head")
    for _ in range(10):
        policy.update(1, 0)
    assert policy.next_k() == 1
    costs.observe_draft("head", 1, 0.02)  # timed: half a target step, and it never agrees
    assert policy.next_k() == 0


def test_a_model_drafts_estimate_leans_on_the_servers_and_forgets_slowly():
    """Two early rejections leave a model draft's estimate near the server's running figure (a head that
    pays from α 0.15 on kept drafting), a run of them brings it down; a copying draft's follows its last
    rounds."""
    costs = CostModel()
    for _ in range(20):
        costs.observe_acceptance("head", 4, 1)
        costs.observe_acceptance("ngram", 4, 1)
    head, ngram = DraftLengthPolicy(6, costs, "head"), DraftLengthPolicy(6, costs, "ngram", free=True)
    for policy in (head, ngram):
        policy.update(1, 0)
        policy.update(1, 0)
    assert head.alpha > 0.25 > ngram.alpha
    for _ in range(10):
        head.update(1, 0)
    assert head.alpha < 0.15


def test_later_positions_are_valued_at_their_own_measured_acceptance():
    """A draft whose first token passes 40 % of the time but whose later ones (those its stop lets through)
    pass almost always: each position is valued at its own measured rate, and the whole cap pays."""
    costs = CostModel(decay=0.0)
    for positions in range(1, 10):
        costs.observe_verify(positions, 0.04 * (1 + 0.05 * (positions - 1)))
    for k in (1, 2, 3):
        costs.observe_draft("head", k, 0.004 * k)  # c = 0.1
    for _ in range(40):  # 40 % of rounds accept the whole chain of 4, the rest nothing
        costs.observe_acceptance("head", 4, 0)
        costs.observe_acceptance("head", 4, 0)
        costs.observe_acceptance("head", 4, 0)
        costs.observe_acceptance("head", 4, 4)
        costs.observe_acceptance("head", 4, 4)
    rates = costs.position_alpha("head", 6)
    assert rates[0] == pytest.approx(0.4, abs=0.03) and all(rate > 0.9 for rate in rates[1:])
    policy = DraftLengthPolicy(6, costs, "head")
    policy.successes, policy.failures, policy.prior_weight = 0.0, 0.0, 1.0  # this request: the server's so far
    assert policy.chain_alpha() == pytest.approx([min(rate, 0.99) for rate in rates])
    assert policy.next_k() == 6
    # What a round of 4 yields: 1 + 0.4 (1 + 0.99 + 0.99^2 + ...), as measured (1 + 0.4 * 4)
    assert expected_tokens(rates, 4) == pytest.approx(2.6, abs=0.1)
    # A request drafting worse than the server's figure scales every position down
    policy.successes, policy.failures = 0.0, 10.0
    assert all(a < b for a, b in zip(policy.chain_alpha(), rates))


def test_while_a_short_chain_wins_the_whole_cap_is_tried_every_explore_every_rounds():
    costs = CostModel(decay=0.0)
    for positions in range(1, 10):
        costs.observe_verify(positions, 0.04 * (1 + 0.05 * (positions - 1)))
    costs.observe_draft("head", 1, 0.004)
    costs.observe_draft("head", 2, 0.008)
    policy = DraftLengthPolicy(8, costs, "head", explore_every=5)
    policy.successes, policy.failures, policy.prior_weight = 3.0, 7.0, 0.0  # α 0.3: one token pays
    ks = [policy.next_k() for _ in range(20)]
    assert [i for i, k in enumerate(ks) if k == 8] == [4, 9, 14, 19]
    assert all(k == 1 for i, k in enumerate(ks) if i % 5 != 4)
    policy.successes, policy.failures = 0.0, 10.0  # drafting does not pay: nothing explored
    assert {policy.next_k() for _ in range(5)} == {0}


def test_a_draft_that_always_drafts_runs_a_target_only_round_to_price_a_step():
    """Every cost is in target-only steps; a draft that drafts every round never runs one, and its rounds
    were priced by the priors (a draft costing a whole step taken at 0.3 of one, drafted at 0.70-0.85x). One
    round runs target-only where no step was measured (not the first: it verifies the prompt), then one
    every price_every plain verifies; the claim is shared, so the requests beside it keep drafting."""
    step, draft = 0.015, 0.015  # a layer-skip draft: its step costs what the target's does
    costs = CostModel(decay=0.0, price_every=8)
    for _ in range(20):
        costs.observe_acceptance("skip", 4, 3)  # α 0.75: pays at the priors' price
    policy, other = DraftLengthPolicy(4, costs, "skip"), DraftLengthPolicy(4, costs, "skip")
    other.next_k()
    ks = []
    for round_ in range(6):
        k = policy.next_k()
        ks.append(k)
        if round_ == 1:  # the pricing round: the claim is the server's, a request beside it drafts
            assert k == 0 and other.next_k() > 0
        if round_:  # the first round's verify carries the prompt: not a plain one, not measured
            costs.observe_verify(k + 1, step * (1 + 0.2 * k))
            if k:
                costs.observe_draft("skip", k, draft * k)
    assert ks[0] > 0 and ks[1] == 0 and ks[2] > 0, ks  # drafted on the priors, then priced a step
    # Priced: a round drafting k costs k steps of the draft and a longer verify; α 0.75 cannot pay for it
    assert costs.draft_cost("skip", 1) == pytest.approx(1.0)
    assert ks[3:] == [0, 0, 0], ks


def test_a_measured_step_is_priced_again_every_price_every_plain_verifies():
    costs = CostModel(decay=0.0, price_every=8)
    costs.observe_verify(1, 0.01)
    costs.observe_draft("head", 1, 0.001)
    for _ in range(20):
        costs.observe_acceptance("head", 4, 3)
    policy = DraftLengthPolicy(4, costs, "head")
    ks = []
    for _ in range(40):
        k = policy.next_k()
        ks.append(k)
        costs.observe_verify(k + 1, 0.01 * (1 + 0.05 * k))
    zeros = [i for i, k in enumerate(ks) if k == 0]
    # Every ninth round: 8 plain verifies of more positions, then one of a single position
    assert zeros == [8, 17, 26, 35] and all(k > 0 for i, k in enumerate(ks) if i not in zeros), ks


def test_a_paused_draft_no_acceptance_could_pay_for_is_probed_rarely_by_the_server():
    """A probe tells the acceptance only, and costs more than its round (it catches the draft up on the rounds
    it missed): where even every token accepted would not pay for the measured costs, the server probes once
    in hopeless_probe_every such rounds of all its requests (each request's own schedule would start anew
    at 8); once a step costs more (a longer context) and a round could pay again, every due probe is made."""
    costs = CostModel(decay=0.0, price_every=10**6, hopeless_probe_every=50)
    costs.observe_verify(1, 0.010)
    costs.observe_verify(2, 0.015)
    costs.observe_draft("skip", 1, 0.012)  # d(1) = 1.2 steps, v(1) = 1.5: k = 1 yields at most 2 tokens
    probes = []
    for request in range(6):  # short requests, each with its own policy
        policy = DraftLengthPolicy(1, costs, "skip", probe_every=4)
        for _ in range(6):
            policy.update(1, 0)
        probes += [request * 30 + i for i in range(30) if policy.next_k()]
    # rounds past each request's first 3: 27 a request, the 50th, 100th and 150th probe
    assert len(probes) == 3, probes
    costs = CostModel(decay=0.0, price_every=10**6)
    costs.observe_verify(1, 0.020)  # the same draft beside a dearer step: d(1) = 0.6, v(1) = 1.0
    costs.observe_verify(2, 0.020)
    costs.observe_draft("skip", 1, 0.012)
    policy = DraftLengthPolicy(1, costs, "skip", probe_every=4)
    for _ in range(6):
        policy.update(1, 0)
    assert [i for i in range(40) if policy.next_k()] == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39]
