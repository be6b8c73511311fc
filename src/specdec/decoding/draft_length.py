"""How many tokens to draft each round: the expected-speedup rule over measured costs.

With a per-token acceptance rate α (the i.i.d. approximation of Leviathan et al.), a round that drafts
k tokens produces E(k) = (1 - α^(k+1)) / (1 - α) tokens and costs d(k) + v(k) target steps, where d(k)
is the draft call's cost for k tokens and v(k) the cost of verifying k + 1 positions (v(0) = 1: a
target-only step). The policy drafts the k in [0, k_max] maximizing E(k) / (d(k) + v(k)); k = 0
(target-only) wins when no k beats 1, so speculation switches itself off where it does not pay.

The costs are measured, not assumed, shared by all requests of a server (`CostModel`): the target
reports every forward it ran (token rows, sequences, seconds), and with n sequences per forward
v(k) = T(n(k+1)) / T(n), the batch's view: drafting k for all n sequences multiplies a forward's rows
by k + 1. Alone that is the cost of verifying k + 1 positions; under load it grows as rows stop being
nearly free, so speculation backs off where it would cost throughput. (Without forward reports, the
request's own verify latency by positions is used.) T(rows) is each row count's quietest time, never
decreasing in rows (_Floor): where the draft shares the target's device its work inflates the forwards
that run beside it, and it is charged to the draft instead. d(k) is the draft call's time for k tokens
over the 1-position verify, measured by k: a served draft call has a fixed part (its BLS round trip, the
draft model's request handling) besides its steps, so d(k) is not k·d(1). Reading it as k·c with c from
whatever k ran made short drafts look cheap per token when long ones ran and dear once short ones did,
and K drifted down. Under load d(k) is at least n·s(k) / T(n), the device time the n sequences' draft
calls take (s(k): the draft's batched execution per sequence, as the draft reports it): a call's latency
hides it (a verify waiting in a full batch makes any call look short), and trees of a cheap-looking head
kept drafting at 8 streams on a 2-core CPU where every draft call slowed every forward.

α is estimated per request, starting from the server's running acceptance of the same draft method, both
as accepted tokens over accepted tokens plus rejections (the geometric estimate of a per-token rate); a
copying draft's with fast forgetting (acceptance comes in bursts: a copied span is accepted whole), a model
draft's slower and leaning on the server's figure (DraftLengthPolicy.MEMORY).

A draft may draft fewer tokens than asked (a model draft's confidence stop, a copied span's end, no match at
all): k is then a cap. The server measures, per position i, how often a chain that reached i - 1 goes on to
the i-th (CostModel.reach: p_i, the chance of drafting at least i), and the rule values a cap of k at
E = 1 + sum_i p_i α^i for the mean of d(n) + v(n) over the n it drafts. Priced as if it drafted all k, a
cap above what a stopping draft drafts looked dear and was never asked for. A draft's call is timed only in
a steady round (one after a round that called it): a sequence's first call prefills its prompt and one after
paused rounds catches up on them, and neither is what a round's draft costs. A model draft is drafted (one
token) until it has been timed once, so the prior's price cannot pause it before it shows its own.

Trees (a proposer `branches` wide, decoding/draft_tree.py) are one more shape the rule weighs every round:
a tree of n nodes yields E = (1 - α_t^(D+1)) / (1 - α_t) tokens, where α_t = α_t(n) is the acceptance per
level of trees of that size (some candidate of the level taken, measured per size on tree rounds like α on
chains, and never below the chain's: a level's candidates include the chain's token) and D(n) the depth
trees of n nodes reach (measured: a best-first tree's depth depends on how peaked the draft is); it costs
d_t(n) + v(n), the tree draft's call measured apart from the chain's and the verify of n + 1 rows from
the same forwards. So a tree is
drafted when its extra candidates buy more tokens than their rows and draft steps cost, a chain when they
do not (alone, or under load where rows stop being free), nothing when neither pays. A tree round also
tells the chain's acceptance (its first branch is the chain the draft would have proposed); a chain round
tells nothing of a tree's, so while drafting pays a shape the rule did not pick is tried every
`explore_every` rounds (a tree while chains win; the largest tree while a smaller one wins; a chain of the
whole cap while a shorter one wins, where the proposer drafts chains only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec.decoding.interfaces import ForwardStats

TREE = "/tree"  # a method's trees are measured under its name and this suffix (draft calls, acceptance)


def expected_tokens(alpha: float | Sequence[float], k: float, reach: Sequence[float] | None = None) -> float:
    """Tokens a round yields on average: accepted drafts plus the target's own token, k levels drafted (a
    measured mean depth may be fractional). E(0) = 1. alpha: one rate for every position, or [α_1..α_k],
    position i's given the ones before it were accepted; reach: [p_1..p_k], the chance a proposal asked for
    k tokens drafts at least i of them (a draft that may stop early): E = 1 + sum_i p_i α_1···α_i."""
    if reach is not None or not isinstance(alpha, (int, float)):
        total, run = 1.0, 1.0
        for i in range(int(k)):
            run *= alpha if isinstance(alpha, (int, float)) else alpha[i]
            total += run * (1.0 if reach is None else reach[i])
        return total
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup(alpha: float, k: int, round_cost: float) -> float:
    """E(k) / (d(k) + v(k)): the speedup over target-only of always drafting k (the bound), given the
    round's cost d(k) + v(k) in target-only steps."""
    return expected_tokens(alpha, k) / round_cost


def best_draft_length(alpha: float | Sequence[float] | Callable[[int], float], k_max: int,
                      round_cost: Callable[[int], float],
                      depth: Callable[[int], float] | None = None, k_min: int = 1, floor: float = 1.0,
                      reach: Sequence[float] | None = None) -> tuple[int, float]:
    """(k, value) maximizing speedup over k in [k_min, k_max]; (0, floor) when none beats `floor` (1:
    target-only). round_cost(k) gives d(k) + v(k) (for a draft that may stop early, its mean over what a
    proposal asked for k drafts); depth(k) the levels a proposal of k tokens reaches (a tree's; a chain's is
    k); alpha(k), where a callable, the acceptance per level of proposals of k (a tree's levels hold more
    candidates the more nodes it has), where a sequence a chain's per position; reach: a chain's
    [p_1..p_k_max] (expected_tokens)."""
    best_k, best = 0, floor
    for k in range(k_min, k_max + 1):
        rate = alpha(k) if callable(alpha) else alpha
        value = expected_tokens(rate, k if depth is None else depth(k), reach) / round_cost(k)
        if value > best + 1e-9:
            best_k, best = k, value
    return best_k, best


@dataclass
class _Ewma:
    decay: float
    value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.decay * self.value + (1 - self.decay) * sample


@dataclass
class _Floor:
    """A duration's lower envelope: down at once to a shorter sample, up by `rise` of the gap per longer
    one (so it follows a real change, e.g. longer contexts, within tens of samples). On a device the draft
    shares with the target (a GPU, a CPU's cores) a forward's wall time is its own work plus whatever else
    ran meanwhile; the rule charges that other work to whoever ran it (the draft's calls, draft_cost), so
    a forward's cost is its quietest time, not its mean."""
    rise: float
    value: float | None = None

    def add(self, sample: float) -> None:
        if self.value is None or sample <= self.value:
            self.value = sample
        else:
            self.value += self.rise * (sample - self.value)


@dataclass
class _Acceptance:
    """Decayed counts of accepted tokens and of rejections; value: their geometric estimate of α."""
    decay: float
    accepted: float = 0.0
    rejected: float = 0.0

    def add(self, accepted: int, rejected: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + rejected

    @property
    def value(self) -> float | None:
        seen = self.accepted + self.rejected
        return self.accepted / seen if seen > 0 else None


def _interpolate(table: dict[int, _Ewma | _Floor], x: int, extrapolate: bool, monotone: bool = False
                 ) -> float | None:
    """The table's value at x, linear between the nearest measured keys; beyond the largest key (when
    `extrapolate`) along the non-decreasing line through the two largest. None where unknown. monotone:
    of the non-decreasing envelope below the values (each key's the least at it or any larger key: more
    rows never cost less, so a key measured only under contention takes a larger key's quieter time)."""
    known = sorted((n, e.value) for n, e in table.items() if e.value is not None)
    if monotone:
        least = math.inf
        for i in range(len(known) - 1, -1, -1):
            least = min(least, known[i][1])
            known[i] = (known[i][0], least)
    below = [(n, t) for n, t in known if n <= x]
    above = [(n, t) for n, t in known if n >= x]
    if below and above:
        (lo, t_lo), (hi, t_hi) = below[-1], above[0]
        return t_lo if hi == lo else t_lo + (t_hi - t_lo) * (x - lo) / (hi - lo)
    if extrapolate and len(below) >= 2:
        (lo, t_lo), (hi, t_hi) = below[-2], below[-1]
        return t_hi + max(0.0, (t_hi - t_lo) / (hi - lo)) * (x - hi)
    return None


def _call_seconds(table: dict[int, _Ewma | _Floor], k: int) -> float | None:
    """A draft call's seconds for k tokens from the calls measured by k: linear between measured sizes,
    past the largest along the line through the two largest, below the smallest along the line through
    the two smallest (the call's fixed part stays) but never below proportional. One size measured:
    proportional (its fixed part is unknown). None before any."""
    known = sorted((n, e.value) for n, e in table.items() if e.value is not None)
    if not known:
        return None
    if len(known) == 1:
        n, t = known[0]
        return t * k / n
    between = _interpolate(table, k, extrapolate=True)
    if between is not None:
        return between
    (lo, t_lo), (hi, t_hi) = known[0], known[1]
    slope = max(0.0, (t_hi - t_lo) / (hi - lo))
    return max(t_lo - slope * (lo - k), t_lo * k / lo)


@dataclass
class CostModel:
    """Measured round costs of one server: verify seconds by positions, draft call seconds by method and k,
    the target's forwards by rows and the draft's batched executions by k (their quietest times: _Floor).

    Until a size has been measured its cost comes from the nearest measured sizes (linear), and before
    anything is measured from the prior v(k) = 1 + prior_verify_slope·k and d(k) = prior_draft_cost·k.
    """

    prior_verify_slope: float = 0.1
    prior_draft_cost: float = 0.3
    decay: float = 0.9
    floor_rise: float = 0.05  # _Floor's
    verify_s: dict[int, _Ewma] = field(default_factory=dict)  # positions -> seconds
    draft_s: dict[str, dict[int, _Ewma]] = field(default_factory=dict)  # method -> tokens -> seconds per call
    # method -> tokens -> seconds per sequence of the draft's batched execution (its device time per call)
    draft_device_s: dict[str, dict[int, _Floor]] = field(default_factory=dict)
    alpha: dict[str, _Acceptance] = field(default_factory=dict)  # method -> running acceptance (requests' prior)
    forward_s: dict[int, _Floor] = field(default_factory=dict)  # token rows -> seconds of a target forward
    tree_depth: dict[str, dict[int, _Ewma]] = field(default_factory=dict)  # method -> nodes asked -> depth reached
    # method -> nodes asked -> acceptance per level of its trees (running, the requests' prior at that size)
    tree_alpha: dict[str, dict[int, _Acceptance]] = field(default_factory=dict)
    # method -> position i -> of the chains that drafted i - 1 tokens and were asked for more, the share that
    # drafted the i-th: a model draft's confidence stop, a copied span's end (i = 1: prompt lookup's match)
    continues: dict[str, dict[int, _Acceptance]] = field(default_factory=dict)
    # method -> position i -> of the chains that drafted the i-th token and had the ones before it accepted,
    # the share that had it accepted too (a draft's sure tokens, those its stop lets through, pass more often)
    accepts: dict[str, dict[int, _Acceptance]] = field(default_factory=dict)
    sequences: _Ewma = field(default_factory=lambda: _Ewma(0.9))  # sequences sharing a target forward
    # seconds of a lone verify call outside its forward (BLS, the adapters, Triton): every round pays it
    machinery: _Ewma = field(default_factory=lambda: _Ewma(0.9))
    # v(k) and d(k) are asked for every k every round of every request, and computing them sorts the
    # tables (~0.14 ms a round at K <= 16): recompute v(k) after every `refresh` new forward observations,
    # and d(k) + v(k) after every `refresh` observations of any kind once the first `refresh` are in (the
    # orchestrator's CPU is the target's too).
    refresh: int = 16
    # Every cost is in target-only steps, and a draft that always drafts never runs one: its rounds were
    # priced by the priors (a skip draft costing a whole step was taken at 0.3 of one and drafted at
    # 0.70-0.85x of target-only). So a round runs target-only, to price a step, when none was measured or after
    # `price_every` plain verifies of more positions (`step_due`): one round in that many drafts nothing.
    price_every: int = 64
    _since_step: int | None = None  # plain verifies of 2+ positions since the last of one (None: never one)
    # A paused draft no acceptance could pay for is probed once in this many of its rounds past a due probe,
    # counted over every request of the server (a request's own schedule starts anew at 8 rounds). Its
    # catch-up runs every row the draft missed of the request, a long prompt's included: once in 256
    # rounds took the skip draft on 4 grounded prompts from target-only's speed to 0.83x
    hopeless_probe_every: int = 4096
    _hopeless: dict[str, int] = field(default_factory=dict)  # method -> such rounds since its last probe
    _forwards_seen: int = 0
    _observations: int = 0
    _v_memo: dict = field(default_factory=dict)
    _round_memo: dict = field(default_factory=dict)

    def observe_forward(self, forward: ForwardStats) -> None:
        """A batched target forward: `rows` token rows of `sequences` sequences took `seconds`."""
        if forward.rows > 0 and forward.sequences > 0:
            self.forward_s.setdefault(forward.rows, _Floor(self.floor_rise)).add(forward.seconds)
            self.sequences.add(forward.sequences)
            self._forwards_seen += 1
            self._observations += 1

    def observe_verify(self, positions: int, seconds: float, forward: ForwardStats | None = None) -> None:
        """A verify call of `positions` positions took `seconds`; forward: the target's forward it ran in."""
        self.verify_s.setdefault(positions, _Ewma(self.decay)).add(seconds)
        if forward is not None and forward.sequences == 1 and forward.seconds > 0:
            self.machinery.add(max(0.0, seconds - forward.seconds))
        self._since_step = 0 if positions == 1 else (self._since_step or 0) + 1
        self._observations += 1

    def hopeless_probe_due(self, method: str) -> bool:
        """A round of `method` past its due probe, where no acceptance could pay for its costs: True once in
        `hopeless_probe_every` such rounds of the server's requests."""
        count = self._hopeless.get(method, 0) + 1
        self._hopeless[method] = 0 if count >= self.hopeless_probe_every else count
        return count >= self.hopeless_probe_every

    def step_due(self) -> bool:
        """Whether the asking round should run target-only to price a step (`price_every`): none measured
        yet, or `price_every` plain verifies of more positions since the last. A True claims it: the
        requests drafting beside this one go on drafting (if the round is not plain, and so not measured,
        the next claim comes `price_every` verifies later, or two where none was ever measured)."""
        since = self._since_step
        due = since is None or since >= (self.price_every if 1 in self.verify_s else 2)
        if due:
            self._since_step = 0
        return due

    def observe_draft(self, method: str, tokens: int, seconds: float, forward: ForwardStats | None = None) -> None:
        """A draft call for `tokens` tokens took `seconds`; forward: the draft's batched execution it ran in."""
        if tokens > 0:
            self.draft_s.setdefault(method, {}).setdefault(tokens, _Ewma(self.decay)).add(seconds)
            if forward is not None and forward.sequences > 0 and forward.seconds > 0:
                self.draft_device_s.setdefault(method, {}).setdefault(tokens, _Floor(self.floor_rise)).add(
                    forward.seconds / forward.sequences)
            self._observations += 1

    def observe_tree(self, method: str, nodes: int, depth: int) -> None:
        """A tree asked for `nodes` nodes reached `depth` levels."""
        self.tree_depth.setdefault(method, {}).setdefault(nodes, _Ewma(self.decay)).add(depth)

    def observe_tree_acceptance(self, method: str, nodes: int, levels: int, accepted: int) -> None:
        """A tree asked for `nodes` nodes had `accepted` of its `levels` levels taken."""
        if levels > 0:
            self.tree_alpha.setdefault(method, {}).setdefault(nodes, _Acceptance(0.98)).add(
                accepted, int(accepted < levels))

    def tree_level_alpha(self, method: str, nodes: int) -> float | None:
        """The running acceptance per level of trees of `nodes` nodes: linear between measured sizes, the
        nearest measured size's beyond them; None before any."""
        table = self.tree_alpha.get(method, {})
        known = sorted((n, a.value) for n, a in table.items() if a.value is not None)
        if not known:
            return None
        if nodes <= known[0][0]:
            return known[0][1]
        if nodes >= known[-1][0]:
            return known[-1][1]
        return _interpolate(table, nodes, extrapolate=False)

    def depth(self, method: str, nodes: int, width: int) -> float:
        """D(n): the levels a tree of at most `nodes` nodes, `width` candidates per level, reaches: measured
        (linear between sizes, along the non-decreasing line past the largest), else ceil(nodes / width)."""
        measured = _interpolate(self.tree_depth.get(method, {}), nodes, extrapolate=True)
        return min(float(nodes), measured if measured is not None else float(-(-nodes // width)))

    def tree_round_cost(self, method: str, nodes: int, depth: float) -> float:
        """d_t(n) + v(n): a round drafting a tree of `nodes` nodes and `depth` levels with `method`, in
        target-only steps. Until a tree draft was measured, its call is priced as the chain's of `depth`
        tokens (one draft step per level)."""
        seen = self._observations
        key = (seen if seen < self.refresh else self.refresh + seen // self.refresh, method + TREE, nodes,
               round(depth, 1))
        cost = self._round_memo.get(key)
        if cost is None:
            if len(self._round_memo) > 1024:
                self._round_memo.clear()
            tree = method + TREE
            draft = (self.draft_cost(tree, nodes) if self.draft_s.get(tree) else
                     self.draft_cost(method, max(1, math.ceil(depth))))
            cost = self._round_memo[key] = draft + self.verify_cost(nodes)
        return cost

    def observe_proposal(self, method: str, asked: int, drafted: int) -> None:
        """A chain asked for `asked` tokens drafted `drafted` (fewer: it stopped early)."""
        table = self.continues.setdefault(method, {})
        for i in range(1, min(asked, drafted + 1) + 1):
            table.setdefault(i, _Acceptance(0.98)).add(int(drafted >= i), int(drafted < i))
        self._observations += 1

    def reach(self, method: str, k: int) -> list[float]:
        """[p_1..p_k]: the chance a chain of `method` asked for k tokens drafts at least i of them, the product
        of the continuation rates up to i. Each position's rate is its measured counts over one pseudo-count
        of the position before's rate (1 for the first two: the first's is a match's, not a continuation's),
        so an unmeasured position continues at the last measured one's rate and a position seen once is
        not taken as certain (one stop at 3 would price every longer chain as a chain of 2)."""
        table = self.continues.get(method, {})
        out, p, before = [], 1.0, 1.0
        for i in range(1, k + 1):
            measured = table.get(i)
            prior = before if i > 2 else 1.0
            rate = prior if measured is None else (
                (measured.accepted + prior) / (measured.accepted + measured.rejected + 1.0))
            before = rate if i > 1 else before
            p *= rate
            out.append(p)
        return out

    def chain_round_cost(self, method: str, k: int) -> float:
        """A round asking `method` for a chain of k tokens, in target-only steps: d(n) + v(n) over the n it
        drafts (reach), a round that drafts nothing costing one step. A draft that stops early (a confidence
        stop) is not charged k draft steps and k + 1 verify rows where it mostly drafts two: priced so, asking
        for more looked dear exactly for the drafts whose stop keeps it cheap, and they were held to 1-2."""
        if k == 0:
            return 1.0
        seen = self._observations
        key = (seen if seen < self.refresh else self.refresh + seen // self.refresh, method, k, "chain")
        cost = self._round_memo.get(key)
        if cost is None:
            if len(self._round_memo) > 1024:
                self._round_memo.clear()
            reach = [1.0] + self.reach(method, k) + [0.0]  # reach[n]: drafts at least n
            cost = sum((reach[n] - reach[n + 1]) * self.round_cost(method, n) for n in range(k + 1))
            self._round_memo[key] = cost
        return cost

    def observe_acceptance(self, method: str, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.alpha.setdefault(method, _Acceptance(0.98)).add(accepted, int(accepted < drafted))
            table = self.accepts.setdefault(method, {})
            for i in range(1, min(drafted, accepted + 1) + 1):
                table.setdefault(i, _Acceptance(0.98)).add(int(i <= accepted), int(i > accepted))

    def position_alpha(self, method: str, k: int) -> list[float] | None:
        """[α_1..α_k]: the running acceptance of position i given the ones before it were accepted, each its
        measured counts over one pseudo-count of the position before's (the first's: the running α); past
        the last measured position at its rate. None before any chain of `method` was verified."""
        table = self.accepts.get(method)
        if not table:
            return None
        out, before = [], self.prior_alpha(method)
        for i in range(1, k + 1):
            measured = table.get(i)
            if measured is not None:
                before = (measured.accepted + before) / (measured.accepted + measured.rejected + 1.0)
            out.append(before)
        return out

    def _seconds(self, positions: int) -> float | None:
        """Verify latency by positions, between measured sizes (no extrapolation)."""
        return _interpolate(self.verify_s, positions, extrapolate=False)

    def _forward_seconds(self, rows: int) -> float | None:
        """T(rows) from the measured forwards' quietest times, non-decreasing in rows; past the largest
        measured row count along the line through the two largest (forward cost grows with rows)."""
        return _interpolate(self.forward_s, rows, extrapolate=True, monotone=True)

    def verify_cost(self, k: int) -> float:
        """v(k): what a round verifying k + 1 positions costs, in target-only steps.

        With the target's forwards measured (rows, sequences, seconds), this is the batch's view:
        when n sequences share each forward, all of them drafting k turns a forward of n rows into one
        of n(k + 1), so v(k) = T(n(k + 1)) / T(n). Alone (n = 1) that is the cost of verifying k + 1
        positions, and the call's machinery m (its time outside the forward) is paid by every round,
        so v(k) = (T(k + 1) + m) / (T(1) + m): on a 2-core CPU m is ~10 ms beside a 50 ms step, and
        without it a 5-row verify was priced 1.33 steps where the round took 1.27. Under load, where a
        forward of many rows stops being nearly free, v(k) grows, and speculation backs off exactly when
        it would cost the server throughput. Without forward measurements: the request's own verify
        latency by positions."""
        if k == 0:
            return 1.0
        if self.sequences.value is not None:
            key = (self._forwards_seen // self.refresh, k)
            if key not in self._v_memo:
                if len(self._v_memo) > 256:
                    self._v_memo.clear()
                n = max(1, round(self.sequences.value))
                alone, drafting = self._forward_seconds(n), self._forward_seconds(n * (k + 1))
                if alone and drafting and n == 1 and self.machinery.value is not None:
                    alone, drafting = alone + self.machinery.value, drafting + self.machinery.value
                self._v_memo[key] = max(drafting / alone, 1.0) if alone and drafting else None
            if self._v_memo[key] is not None:
                return self._v_memo[key]
        one = self._seconds(1)
        many = self._seconds(k + 1)
        if one is None or many is None:
            return 1.0 + self.prior_verify_slope * k
        return many / one

    def draft_cost(self, method: str, k: int) -> float:
        """d(k): a draft call for k tokens in target steps, the larger of two views.

        The request's: the call's seconds over a 1-position verify's (what the round waits for). The
        batch's, with n > 1 sequences per target forward: the n calls of a round take n·s(k) of the
        device the draft shares with the target (s(k): the draft's batched execution's seconds per
        sequence, reported by the draft), against T(n) of a target-only round; under load a call's
        latency hides that (every verify waits in a full batch, so a call looks short beside it), and
        the drafts of all sequences slow every forward. (A draft on a device of its own is overcharged.)
        A method measured only as trees (a chain rarely drafted beside them) is priced from its tree
        calls of k nodes: cheaper than its chain would be, so a chain that pays is tried and measured."""
        if k == 0:
            return 0.0
        calls, device = self.draft_s.get(method), self.draft_device_s.get(method, {})
        if not calls and not method.endswith(TREE) and self.draft_s.get(method + TREE):
            calls, device = self.draft_s[method + TREE], self.draft_device_s.get(method + TREE, {})
        one = self._seconds(1)
        seconds = _call_seconds(calls or {}, k)
        if one is None or seconds is None:
            return self.prior_draft_cost * k
        cost = seconds / one
        n = round(self.sequences.value) if self.sequences.value is not None else 1
        if n > 1:
            share, alone = _call_seconds(device, k), self._forward_seconds(n)
            if share is not None and alone:
                cost = max(cost, n * share / alone)
        return cost

    def round_cost(self, method: str, k: int) -> float:
        """d(k) + v(k): a round drafting k tokens with `method`, in target-only steps (1 at k = 0)."""
        if k == 0:
            return 1.0
        seen = self._observations
        key = (seen if seen < self.refresh else self.refresh + seen // self.refresh, method, k)
        cost = self._round_memo.get(key)
        if cost is None:
            if len(self._round_memo) > 1024:
                self._round_memo.clear()
            cost = self._round_memo[key] = self.draft_cost(method, k) + self.verify_cost(k)
        return cost

    def prior_alpha(self, method: str, default: float = 0.5) -> float:
        running = self.alpha.get(method)
        return default if running is None or running.value is None else running.value


class DraftLengthPolicy:
    """One request's draft length and shape, round by round: the one owner of K (k_max; fixed when not
    adaptive) and of whether a round drafts a tree (`width`: the candidates per position this round asks
    for, at most `branches`, the proposer's).

    free: the proposer costs (almost) nothing and may return fewer tokens than asked (prompt lookup).
    When the rule says k = 0 its proposal is still made but not verified (`shadow`): the loop checks
    its first token against the target's own next token and feeds that to `update`, so the estimate
    keeps learning at no cost and a burst of matches turns drafting back on after one round. (Always
    drafting instead, because misses are free, is what we did before: it stops being free once rows of
    a batched forward cost time.) A costly proposer pauses at k = 0 and probes with one token after `probe_every` rounds,
    doubling the wait after every probe that is rejected (a probe costs d(1) + v(1) - 1 extra steps), so the
    estimate can recover without taxing a draft that never agrees.

    branches > 1: the proposer can draft trees that wide; adaptive, each round drafts whichever of a chain
    and a tree the rule values more (module docstring), another shape every `explore_every` rounds while
    drafting pays; fixed, every round is a tree of k_max nodes.
    """

    # (decay, prior weight) of a request's acceptance estimate: its rounds' counts forgotten by `decay` a
    # round, and the server's running acceptance counted as `prior weight` rounds. A copying draft's
    # acceptance comes in bursts its last few rounds tell best; a model draft's (a small LM, a trained head)
    # varies far less, and forgotten as fast, with the prior as one round, two early rejections took a head
    # that pays from α 0.15 on to 0.13 and paused it, and its probes rarely brought it back.
    MEMORY = {"free": (0.7, 1.0), "model": (0.9, 2.0)}
    MAX_ALPHA = 0.99  # a position's scaled acceptance (chain_alpha): a rate, below 1

    def __init__(self, k_max: int, costs: CostModel, method: str, adaptive: bool = True, free: bool = False,
                 decay: float | None = None, prior_weight: float | None = None, probe_every: int = 8,
                 busy: Callable[[], bool] | None = None, branches: int = 1, explore_every: int = 16):
        """busy: asked every round; while it says True the round drafts nothing (the server's load is past
        where speculation pays, `max_drafting_sequences`), adaptive or not. decay, prior_weight: MEMORY's
        for the kind of draft unless given."""
        if branches < 1:
            raise ValueError(f"branches must be >= 1, got {branches}")
        self.k_max, self.costs, self.method, self.adaptive, self.free = k_max, costs, method, adaptive, free
        self.busy = busy
        memory = self.MEMORY["free" if free else "model"]
        self.decay = memory[0] if decay is None else decay
        self.probe_every = probe_every
        self.prior = costs.prior_alpha(method)
        self.prior_weight = memory[1] if prior_weight is None else prior_weight
        self.successes = 0.0  # decayed counts of accepted and rejected draft positions (chains)
        self.failures = 0.0
        self.paused_rounds = 0
        self.probe_wait = probe_every
        self.probing = False  # the round in flight is a one-token probe
        self.shadow = False  # the round in flight verifies nothing; its proposal is only checked
        self.branches, self.explore_every = branches, explore_every
        self.width = 1  # the round in flight's candidates per position (1: a chain)
        self.tree_method = method + TREE
        self.tree_prior = costs.prior_alpha(self.tree_method, self.prior)
        self.tree_successes = 0.0  # the same counts for tree levels (some candidate taken, or none)
        self.tree_failures = 0.0
        self.tree_sizes: dict[int, list[float]] = {}  # nodes asked -> the same counts, trees of that size
        self.nodes = 0  # the round in flight's nodes asked, when a tree
        self.rounds_since_explore = 0
        self.explored = 0
        self.rounds = 0  # adaptive rounds asked for (next_k)

    @classmethod
    def fixed(cls, k: int, method: str = "fixed", branches: int = 1) -> "DraftLengthPolicy":
        """Always k draft tokens (0: target-only; with branches > 1 a tree of k nodes), with a cost model of
        its own."""
        return cls(k, CostModel(), method, adaptive=False, branches=branches)

    @property
    def alpha(self) -> float:
        """Posterior mean of the acceptance rate: prior pseudo-counts plus decayed observations."""
        a = self.successes + self.prior * self.prior_weight
        return a / (self.successes + self.failures + self.prior_weight)

    def chain_alpha(self) -> float | list[float]:
        """The acceptance of each position of this request's chains: the server's per position
        (CostModel.position_alpha) scaled by how this request's estimate stands to the server's (a
        request drafting well is better at every position), at most MAX_ALPHA; one rate, this request's,
        before the server has any. A draft's later tokens are not as likely as its first: those that pass
        its confidence stop are likelier, and valued at the first's rate a cap above one or two looked
        worthless (a head's K=3 gave 1.42-1.51 tokens per round where the rule drafted 1-2 for 1.19-1.34)."""
        positions = self.costs.position_alpha(self.method, self.k_max)
        server = self.costs.prior_alpha(self.method)
        if positions is None or server <= 0.0:
            return self.alpha
        scale = self.alpha / server
        return [min(self.MAX_ALPHA, rate * scale) for rate in positions]

    @property
    def tree_alpha(self) -> float:
        """The same for a tree's levels, never below the chain's (a level's candidates hold its token)."""
        a = self.tree_successes + self.tree_prior * self.prior_weight
        return max(self.alpha, a / (self.tree_successes + self.tree_failures + self.prior_weight))

    def tree_alpha_at(self, nodes: int) -> float:
        """The acceptance per level of trees of `nodes` nodes: a level of a larger tree holds more candidates,
        so each size has its own (one estimate for all would price a large tree at a small one's rate, and
        the small one the rule then picks would keep it so). This request's rounds of that size over the
        server's running figure for it (else tree_alpha) as the prior; never below the chain's."""
        prior = self.costs.tree_level_alpha(self.tree_method, nodes)
        if prior is None:
            prior = self.tree_alpha
        successes, failures = self.tree_sizes.get(nodes, (0.0, 0.0))
        seen = successes + failures + self.prior_weight
        return max(self.alpha, (successes + prior * self.prior_weight) / seen if seen > 0 else prior)

    def next_k(self) -> int:
        """This round's k (a chain's tokens, or a tree's nodes when it sets `width` above 1)."""
        self.probing = self.shadow = False
        self.width, self.nodes = 1, 0
        if self.k_max <= 0:
            return 0
        if self.busy is not None and self.busy():
            return 0  # not a pause of the adaptive rule: its estimate and probe schedule stay as they are
        if not self.adaptive:  # always k_max (the costs are still measured)
            self.width = self.branches
            self.nodes = self.k_max if self.branches > 1 else 0
            return self.k_max
        self.rounds += 1
        if self.rounds > 1 and self.costs.step_due():  # a plain round (the first verifies the prompt)
            self.shadow = self.free  # a free proposer's proposal is still checked
            return 0
        k, value = best_draft_length(self.chain_alpha(), self.k_max,
                                     lambda j: self.costs.chain_round_cost(self.method, j),
                                     reach=self.costs.reach(self.method, self.k_max))
        if k == 0 and not self.free and not self.costs.draft_s.get(self.method):
            # A draft never timed in a steady round is priced by the prior (prior_draft_cost), which can
            # pause it before it ever shows its cost, and a paused draft's probes catch up on the rounds
            # it missed, so they never time it either: one token until it is timed.
            k = 1
        if self.branches > 1 and self.k_max > 1:
            nodes, tree_value = self._best_tree(floor=max(value, 1.0))
            self.rounds_since_explore += 1
            if (k > 0 or nodes > 0) and nodes < self.k_max and self.rounds_since_explore >= self.explore_every:
                # Drafting pays: now and then a shape the rule does not pick, to see what it does now. While
                # chains win a tree (the rule's best, every other time the largest); while a smaller tree
                # wins the largest, whose levels are the widest (the sizes between are interpolated).
                self.rounds_since_explore = 0
                self.explored += 1
                nodes = self.k_max if nodes or self.explored % 2 == 0 else self._best_tree(floor=0.0)[0]
            if nodes > 0:
                self.width, k, self.nodes = self.branches, nodes, nodes
        elif 0 < k < self.k_max:
            # Drafting pays: now and then the whole cap, or the positions past the rule's k are never drafted
            # and so never measured (reach, position_alpha) and the rule keeps valuing them at its guesses.
            self.rounds_since_explore += 1
            if self.rounds_since_explore >= self.explore_every:
                self.rounds_since_explore, self.explored = 0, self.explored + 1
                k = self.k_max
        if k > 0:
            self.paused_rounds, self.probe_wait = 0, self.probe_every
            return k
        if self.free:
            self.shadow = True
            return 0
        self.paused_rounds += 1
        if self.paused_rounds >= self.probe_wait and (self._could_pay()
                                                       or self.costs.hopeless_probe_due(self.method)):
            self.paused_rounds, self.probing = 0, True
            return 1
        return 0

    def _could_pay(self) -> bool:
        """Whether drafting would pay at the measured costs were every token accepted (MAX_ALPHA): a probe
        tells the acceptance only, and costs more than its round (it catches the draft up on the rounds it
        missed: probed every 8-16 rounds, a paused layer-skip draft's requests ran at 46-51 tokens/s, 61-71
        without the probes). Where no acceptance
        could pay, the server probes the draft once in `hopeless_probe_every` such rounds of all its
        requests (CostModel.hopeless_probe_due): a step's price grows with the context, and a searched
        layer-skip draft changes its layers (its search measures a set after the draft's calls)."""
        return best_draft_length(self.MAX_ALPHA, self.k_max, lambda j: self.costs.chain_round_cost(self.method, j),
                                 reach=self.costs.reach(self.method, self.k_max))[0] > 0

    def _best_tree(self, floor: float) -> tuple[int, float]:
        """(nodes, value) of the tree the rule values most above `floor`; (0, floor) when none is."""
        depth = {n: self.costs.depth(self.method, n, self.branches) for n in range(2, self.k_max + 1)}
        return best_draft_length(self.tree_alpha_at, self.k_max,
                                 lambda n: self.costs.tree_round_cost(self.method, n, depth[n]),
                                 depth=depth.__getitem__, k_min=2, floor=floor)

    def update(self, drafted: int, accepted: int, first_branch: tuple[int, int] | None = None) -> None:
        """Record a verified round: `accepted` of `drafted` tokens (a tree's: levels along its accepted path
        of its deepest branch's), a rejection iff accepted < drafted. first_branch: a tree round's (length,
        accepted) of its first branch, the chain the draft would have proposed: the chain's estimate."""
        if drafted <= 0:
            return
        if self.probing and accepted == 0:  # a failed probe: wait longer next time
            self.probe_wait *= 2
        if first_branch is not None:
            self.tree_successes = self.decay * self.tree_successes + accepted
            self.tree_failures = self.decay * self.tree_failures + (1 if accepted < drafted else 0)
            self.costs.observe_acceptance(self.tree_method, drafted, accepted)
            if self.nodes:
                size = self.tree_sizes.setdefault(self.nodes, [0.0, 0.0])
                size[0] = self.decay * size[0] + accepted
                size[1] = self.decay * size[1] + (1 if accepted < drafted else 0)
                self.costs.observe_tree_acceptance(self.tree_method, self.nodes, drafted, accepted)
            drafted, accepted = first_branch
            if drafted <= 0:
                return
        self.successes = self.decay * self.successes + accepted
        self.failures = self.decay * self.failures + (1 if accepted < drafted else 0)
        self.costs.observe_acceptance(self.method, drafted, accepted)

    def observe_draft(self, k: int, seconds: float, depth: int | None = None,
                      forward: ForwardStats | None = None) -> None:
        """A draft call for k tokens took `seconds`; depth: it drafted a tree of k nodes that deep; forward:
        the draft's batched execution it ran in, where the draft reports it."""
        if depth is None:
            self.costs.observe_draft(self.method, k, seconds, forward)
        else:
            self.costs.observe_draft(self.tree_method, k, seconds, forward)
            self.costs.observe_tree(self.method, k, depth)

    def observe_proposal(self, asked: int, drafted: int) -> None:
        """A chain asked for `asked` tokens drafted `drafted`."""
        self.costs.observe_proposal(self.method, asked, drafted)

    def observe_verify(self, positions: int, seconds: float, forward: ForwardStats | None = None) -> None:
        self.costs.observe_verify(positions, seconds, forward)

    def observe_forward(self, forward: ForwardStats) -> None:
        self.costs.observe_forward(forward)


class PartPolicies:
    """One request's draft-length policies for a proposer of parts (lookup_first.py: prompt lookup where the
    sequence repeats itself, a draft model otherwise): each part's own DraftLengthPolicy, priced, estimated
    and paused as when it drafts alone. The loop `select`s the round's part before it asks for k; every
    other attribute is the selected policy's."""

    def __init__(self, policies: dict[str, DraftLengthPolicy]):
        if not policies:
            raise ValueError("PartPolicies needs at least one part")
        self.policies = policies
        self.active = next(iter(policies.values()))

    def select(self, part: str) -> None:
        self.active = self.policies[part]

    def __getattr__(self, name: str):
        return getattr(self.active, name)
