"""Drafting with a trained head (draft_heads.py) over the target's features, for many sequences.

The decode loop hands a head what it hands any draft (keep `keep` entries, append `new_ids` =
tokens[keep:]) plus the target's features at the positions before the last token (`Step.features`). A
head's entry i pairs the target's feature at position i with token i + 1, so a call with tokens up to
position N - 1 fills entries keep .. N - 2 from features f_keep .. f_{N-2}, then drafts: entry N - 2's
output gives x_1, and each further entry runs on the head's own output feature and the token it drafted.
The drafted entries are dropped afterwards (`cached_length` = N - 1): the next call fills those
positions again from the target's real features, as EAGLE does.

With `Step.branches` > 1 a head drafts EAGLE-2's dynamic tree instead (decoding/draft_tree.best_first_tree):
one head step per depth over that depth's likeliest nodes, their entries written after the sequence's under
a tree mask and dropped like a chain's.

Features the call lacks (the target's prefix cache served those positions: it ran none of them) are
zeros: the head drafts worse there, never wrongly (verification decides). No features at all (a
sequence's first round, before the target ran) drafts nothing.

The executor surface is the one the draft_model adapter uses (sequences, release, evict_idle,
propose_many, counters). A batch's chains draft in lockstep: on the CPU kernels each head step runs over
every sequence's rows at once; elsewhere (CUDA graphs, the module) a sequence's rows at a time.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdec.decoding.draft_tree import best_first_tree
from specdec.decoding.sampling import SamplingParams, greedy, logits_to_probs, sample, stops_after, token_probability
from specdec.engine.draft_heads import EagleHead, HeadCache, MedusaHeads, MlpSpeculator
from specdec.engine.errors import CacheError, CapacityError
from specdec.engine.executor import Executor
from specdec.engine.head_kernels import ANCESTOR_BITS, DraftLogits, HeadKernels
from specdec.engine.interfaces import Drafted, Step


@dataclass
class HeadSequence:
    cache: HeadCache = field(default_factory=HeadCache)
    slot: int | None = None  # its slot of the pool (captured steps), None: a cache of its own (eager)
    # The newest entry's output (EAGLE: the head's feature (1, h) and logits (V,), what the next draft
    # starts from; Medusa and MLP speculators: the target's feature (F,))
    last_feature: torch.Tensor | None = None
    last_logits: torch.Tensor | DraftLogits | None = None
    entries: int = 0  # entries holding the target's features (Medusa: positions seen)
    last_used: float = 0.0


class _NoForward:
    """What the adapter reads of an executor's forward: nothing is captured for a head."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, cached: bool = True):
        self.cached = cached  # an EAGLE head's per-sequence keys and values (Medusa and MLP speculators: none)

    def summary(self, ready: int, seconds: float) -> str:
        if not self.cached:
            return "draft head: eager, no cache (the target's newest feature per sequence)"
        return "draft head: eager, per-sequence KV buffers"


class _Captured:
    """What the adapter reads of an EAGLE head's captured steps (graphs)."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, pool, steps):
        self.pool, self.steps = pool, steps

    def summary(self, ready: int, seconds: float) -> str:
        steps = self.steps
        return (f"draft head: steps as CUDA graphs ({ready} buckets: {', '.join(map(str, steps.rows))} rows x "
                f"{len(steps.windows)} windows up to {self.pool.capacity} positions, captured in {seconds:.1f} s), "
                f"a pool of {len(self.pool.keys)} sequences ({self.pool.bytes / 2**20:.0f} MiB); more sequences, "
                f"and fills or tree levels of more rows, run eagerly")


class HeadExecutor:
    """graphs (EAGLE heads on CUDA; default there): the draft steps (one-token chain steps, the fill of a
    round's accepted positions, a tree's levels: up to head_graphs.ROW_BUCKETS rows) replay CUDA graphs over
    a pool of `graph_slots` sequences x `max_context` positions (head_graphs.py); sequences past the slots
    run eagerly (on a CPU, graphs runs the same static steps uncaptured: what the tests check). cpu_kernels
    (EAGLE heads in float32 on a CPU; default there): every step on the CPU's layer
    kernels (head_kernels.py) instead of the module's torch operations."""

    def __init__(self, head: EagleHead | MedusaHeads | MlpSpeculator, max_sequences: int = 256,
                 idle_timeout_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic, graphs: bool | None = None, max_context: int = 8192,
                 graph_slots: int = 32, cpu_kernels: bool | None = None):
        self.head = head
        self.config = head.config
        # a head whose linears are all prepacked (onednn_linear: Medusa's) holds buffers, no parameters
        parameter = next(itertools.chain(head.parameters(), head.buffers()))
        self.device = self.logits_device = parameter.device
        self.dtype = parameter.dtype
        self.vocab_size = self.config.vocab_size
        self.max_sequences, self.idle_timeout_s, self.clock = max_sequences, idle_timeout_s, clock
        self.sequences: dict[int, HeadSequence] = {}
        self.forward = _NoForward(cached=isinstance(head, EagleHead))
        self.tokens_processed = 0
        self.prefix_queried_tokens = self.prefix_hit_tokens = 0
        self.prefix_cache_bytes = 0
        self.stop_below = 0.0  # the confidence stop, as Executor's
        self.ahead_taken, self.ahead_used, self.ahead_dropped = {}, 0, 0  # nothing runs ahead (Executor's run_ahead)
        self.adapters = None  # no LoRA adapters (Executor's; a head drafts for the base model's target)
        if graphs is None:
            graphs = self.device.type == "cuda"
        self.kernels = HeadKernels.serving(head) if cpu_kernels is not False else None
        if cpu_kernels and self.kernels is None:
            raise ValueError("cpu_kernels: the CPU layer kernels serve EAGLE heads in float32 on a CPU "
                             "(with the kernels built)")
        self.pool = self.steps = None
        if graphs and isinstance(head, EagleHead):
            from specdec.engine.head_graphs import CapturedSteps, HeadPool
            self.pool = HeadPool(head, min(graph_slots, max_sequences), max_context)
            self.steps = CapturedSteps(head, self.pool)
            self.forward = _Captured(self.pool, self.steps)

    kv_bytes_capacity = 0  # not budgeted: sequences outside the graphs' pool grow their caches on demand

    @property
    def kv_bytes_allocated(self) -> int:
        own = sum(seq.cache.bytes for seq in self.sequences.values() if seq.slot is None)
        return own + (self.pool.bytes if self.pool is not None else 0)

    def warm_up(self, time_budget_s: float = 0.0) -> tuple[int, float]:
        """Capture the draft steps' graphs (with graphs): (buckets, seconds)."""
        if self.steps is None:
            return 0, 0.0
        started = time.perf_counter()
        with torch.inference_mode():
            self.steps.capture()
        return len(self.steps.graphs), time.perf_counter() - started

    def release(self, seq_id: int) -> bool:
        seq = self.sequences.pop(seq_id, None)
        if seq is not None and seq.slot is not None:
            self.pool.release(seq.slot)
        return seq is not None

    # The executor's own rule, over the same fields (sequences, last_used, clock, idle_timeout_s, release)
    evict_idle = Executor.evict_idle
    prefix = None  # no prefix cache of its own: a head's features come from the target's

    @torch.inference_mode()
    def propose_many(self, steps: list[Step]) -> list[Drafted | CacheError]:
        """Each step's proposal (or its CacheError). An EAGLE head's steps go through one loop: the fills of
        the positions each round accepted, then the chains' drafting steps in lockstep (`_run`: on the CPU
        kernels each head step over every sequence's rows at once, the head's weights read once a step
        instead of once a sequence; elsewhere a sequence's rows at a time); trees run one sequence after
        another from their filled caches."""
        results: list = [None] * len(steps)
        live = []  # (index, sequence, rows to fill): an EAGLE head's sequences that draft from their features
        for i, step in enumerate(steps):
            try:
                seq = self._sequence(step)
                needed = len(step.new_ids) - 1  # entries keep .. N - 2, each pairing f_i with token i + 1
                if needed and (step.features is None or not len(step.features)):
                    # No feature at all: the target has not run these positions yet (a first round)
                    results[i] = Drafted([], None, step.keep)
                elif isinstance(self.head, MedusaHeads):
                    results[i] = self._propose_medusa(seq, step, needed)
                elif isinstance(self.head, MlpSpeculator):
                    results[i] = self._propose_mlp(seq, step, needed)
                else:
                    live.append((i, seq, needed))
            except CacheError as exc:
                results[i] = exc.with_traceback(None)
        fills = [(i, seq, needed) for i, seq, needed in live if needed]
        if fills:
            hidden = self.head.from_target(torch.cat([self._features(steps[i], needed) for i, _, needed in fills]))
            rows = torch.tensor([needed for _, _, needed in fills]).cumsum(0).tolist()
            outputs = self._run([(seq, torch.tensor(steps[i].new_ids[1:]), hidden[end - needed:end], steps[i].keep)
                                 for (i, seq, needed), end in zip(fills, rows)], outlive=True)
            for (_, seq, needed), (hidden, logits) in zip(fills, outputs):
                seq.last_feature, seq.last_logits = hidden, logits
                self.tokens_processed += needed
        chains = []  # [index, sequence, drafted, probs, hidden, logits]
        for i, seq, needed in live:
            step = steps[i]
            seq.entries = seq.cache.length = step.keep + needed
            if step.k == 0 or seq.entries == 0 or seq.last_feature is None:
                results[i] = Drafted([], None, seq.entries)
            elif step.branches > 1:
                try:
                    results[i] = self._eagle_tree(seq, step)
                except CacheError as exc:
                    results[i] = exc.with_traceback(None)
            else:
                chains.append([i, seq, [], [], seq.last_feature, seq.last_logits])
        j = 0
        while chains:  # drafting step j of every chain still going
            going = []
            for chain in chains:
                i, seq, drafted, probs, _, logits = chain
                step = steps[i]
                token = self._pick(logits, step, probs)
                drafted.append(token)
                if self._unsure(logits, token) or j + 1 >= step.k:  # the confidence stop, or K drafted
                    seq.cache.length = seq.entries  # the drafted entries go: the target's features replace them
                    results[i] = Drafted(torch.cat(drafted).tolist(), torch.stack(probs) if probs else None,
                                         seq.entries)
                else:
                    going.append(chain)
            # entry N - 1 + j of each: the head's own feature with the token it drafted
            outputs = self._run([(seq, drafted[-1].reshape(1), hidden, seq.entries + j)
                                 for _, seq, drafted, _, hidden, _ in going])
            for chain, (hidden, logits) in zip(going, outputs):
                chain[4], chain[5] = hidden, logits
            chains, j = going, j + 1
        return results

    def _run(self, rows: list[tuple[HeadSequence, torch.Tensor, torch.Tensor, int]], outlive: bool = False
             ) -> list[tuple[torch.Tensor, torch.Tensor | DraftLogits]]:
        """[(sequence, tokens (m,), input features (m, h), first entry)] -> each sequence's last row's output
        ((1, h) feature, (V,) logits), every row seeing its sequence's cache up to itself: one
        HeadKernels.step_many over all of them on the CPU kernels, else `_chain` a sequence at a time (a
        captured step's outputs cloned where they must outlive the next step: another sequence's, or with
        `outlive` the next call's)."""
        if self.kernels is not None and len(rows) > 1:
            positions = [torch.arange(start, start + len(tokens)) for _, tokens, _, start in rows]
            caches = [(len(tokens), seq.cache, start, at + 1, torch.zeros(len(tokens), dtype=torch.long))
                      for (seq, tokens, _, start), at in zip(rows, positions)]
            hidden, logits = self.kernels.step_many(torch.cat([tokens for _, tokens, _, _ in rows]),
                                                    torch.cat([inputs for _, _, inputs, _ in rows]),
                                                    torch.cat(positions), caches, reduced=True)
            ends = torch.tensor([len(tokens) for _, tokens, _, _ in rows]).cumsum(0).tolist()
            return [(hidden[end - 1:end], logits[end - 1]) for end in ends]
        outputs = []
        for seq, tokens, inputs, start in rows:
            hidden, logits = self._chain(tokens, inputs, seq, start)
            hidden, logits = hidden[-1:], logits[-1]
            if seq.slot is not None and (outlive or len(rows) > 1):  # the next captured step overwrites them
                hidden, logits = hidden.clone(), logits.clone()
            outputs.append((hidden, logits))
        return outputs

    def propose(self, seq_id: int, keep: int, new_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None = None, reserve: int = 0,
                features: torch.Tensor | None = None) -> Drafted:
        (result,) = self.propose_many([Step(seq_id, keep, new_ids, k=k, params=params, generator=generator,
                                            reserve=reserve, features=features)])
        if isinstance(result, CacheError):
            raise result
        return result

    def _sequence(self, step: Step) -> HeadSequence:
        seq = self.sequences.get(step.seq_id)
        if seq is None:
            if len(self.sequences) >= self.max_sequences:
                raise CapacityError(f"{self.max_sequences} sequences are live (max_sequences)")
            taken = self.pool.cache() if self.pool is not None else None
            seq = self.sequences[step.seq_id] = (HeadSequence() if taken is None else
                                                 HeadSequence(cache=taken[1], slot=taken[0]))
        if step.k < 0:
            raise CacheError(f"num_draft_tokens must be >= 0, got {step.k}")
        if not step.new_ids:
            raise CacheError("no new tokens to append")
        if step.keep > seq.entries:
            raise CacheError(f"keep={step.keep} exceeds the {seq.entries} entries cached for sequence {step.seq_id}")
        if seq.cache.fixed and step.keep + len(step.new_ids) + step.k > self.pool.capacity:
            raise CacheError(f"the head's context holds {self.pool.capacity} positions (max_context_tokens), "
                             f"{step.keep + len(step.new_ids) + step.k} asked for")
        seq.last_used = self.clock()
        return seq

    def _features(self, step: Step, needed: int) -> torch.Tensor:
        """The (needed, F) features of entries keep .. keep + needed - 1: the call's last ones, zeros before
        them where it has fewer (positions the target's prefix cache served)."""
        given = step.features if step.features is not None else torch.zeros(0, self.config.feature_width)
        given = given[-needed:].to(device=self.device, dtype=self.dtype) if needed else given[:0]
        if given.shape[0] < needed:
            given = torch.cat([given.new_zeros(needed - given.shape[0], given.shape[1]), given])
        return given

    def _chain(self, tokens: torch.Tensor, hidden: torch.Tensor, seq: HeadSequence, start: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over entries start.. (each seeing the cache up to itself): EagleHead.forward, or its
        captured step (a pool slot's sequence, up to the row buckets: the outputs valid until the next)."""
        m = tokens.shape[0]
        if seq.slot is not None and self.steps.fits(m, start + m - 1):
            positions = torch.arange(start, start + m)
            return self.steps.run(tokens, hidden, positions, seq.slot, start, positions + 1)
        tokens = tokens.to(self.device)
        if self.kernels is None:
            return self.head(tokens, hidden, seq.cache, start)
        positions = torch.arange(start, start + m)
        return self.kernels.step(tokens, hidden, positions, seq.cache, start, positions + 1,
                                 torch.zeros_like(positions), reduced=True)

    def _eagle_tree(self, seq: HeadSequence, step: Step) -> Drafted:
        """EAGLE-2's dynamic tree of at most k nodes (draft_tree.best_first_tree): each level's nodes run
        through the head together, at the level's position, each attending to the sequence's entries, its
        ancestors' drafted entries and itself (written after the entries, then dropped like a chain's)."""
        head: EagleHead = self.head
        start = seq.entries
        width = step.branches
        depth = step.k
        if seq.cache.fixed:  # a pool slot: the levels' rows must fit in it
            depth = max(1, min(depth, 1 + (self.pool.capacity - start) // width))
        hidden_of = {-1: seq.last_feature}  # a run node's output feature: what its children start from
        slot_of: dict[int, int] = {}
        parent_of: dict[int, int] = {}
        level_of = {-1: -1}
        # the drafted entries a run node sees (its ancestors' and its own), as bits past the sequence's
        bits_of = {-1: 0}
        used = start  # the next free cache slot
        # On the CPU kernels a reduced vocabulary's tree is ranked over its columns (a sixth of the target's
        # for the default pair's head: the scores' softmax and top-k), its tokens mapped to target ids
        ids = seq.last_logits.ids if isinstance(seq.last_logits, DraftLogits) else None

        def expand(nodes: list[int], parents: list[int], tokens: list[int]) -> torch.Tensor:
            nonlocal used
            m = len(nodes)
            level = level_of[parents[0]] + 1
            first = used
            token_ids = torch.tensor(tokens)
            if ids is not None:
                token_ids = ids[token_ids]
            inputs = torch.cat([hidden_of[parent] for parent in parents])
            positions = torch.full((m,), start + level)
            for row, (node, parent) in enumerate(zip(nodes, parents)):
                bits_of[node] = bits_of[parent] | 1 << (first + row - start)
            as_bits = first + m - start <= ANCESTOR_BITS
            if as_bits:
                bits = torch.tensor([bits_of[node] - (1 << 64 if bits_of[node] >> 63 else 0)  # as int64
                                     for node in nodes])
            if as_bits and seq.slot is not None and self.steps.fits(m, first + m - 1):
                hidden, logits = self.steps.run(token_ids, inputs, positions, seq.slot, first, torch.full((m,), start),
                                                bits, start)
                hidden = hidden.clone()  # the children's inputs: the next level's run overwrites the outputs
                if ids is not None:  # ranked over the draft columns, as the eager levels do
                    logits = DraftLogits(logits.index_select(-1, ids), ids, seq.last_logits.index)
            elif as_bits and self.kernels is not None:
                hidden, logits = self.kernels.step(token_ids, inputs, positions, seq.cache, first,
                                                   torch.full((m,), start), bits, reduced=ids is not None)
            else:
                visible = torch.zeros(m, first + m, dtype=torch.bool, device=self.device)
                visible[:, :start] = True
                for row, (node, parent) in enumerate(zip(nodes, parents)):
                    visible[row, first + row] = True
                    ancestor = parent
                    while ancestor >= 0:
                        visible[row, slot_of[ancestor]] = True
                        ancestor = parent_of[ancestor]

                def window(layer, k, v):
                    keys, values = seq.cache.write(first, k, v, layer)
                    return keys, values, visible

                hidden, logits = head.step(token_ids.to(self.device), inputs, positions.to(self.device), window)
                if ids is not None:  # the draft columns of the scattered logits
                    logits = DraftLogits(logits.index_select(-1, ids), ids, seq.last_logits.index)
            for row, (node, parent) in enumerate(zip(nodes, parents)):
                hidden_of[node], slot_of[node], parent_of[node], level_of[node] = hidden[row:row + 1], first + row, parent, level
            used += m
            self.tokens_processed += m
            return self._scores(logits, step.params)

        tokens, parents = best_first_tree(self._scores(seq.last_logits, step.params), expand, step.k, width, depth,
                                          self.stop_below)
        seq.cache.length = seq.entries  # the drafted entries go: the target's features replace them
        if ids is not None:
            tokens = ids[torch.tensor(tokens, dtype=torch.long)].tolist()
        return Drafted(tokens, None, seq.entries, parents)

    @staticmethod
    def _scores(logits: torch.Tensor | DraftLogits, params: SamplingParams) -> torch.Tensor:
        """What a tree ranks candidates by: the log-probabilities of the (processed, when sampling) distribution;
        of DraftLogits, over the draft vocabulary's columns (the target's other tokens have probability 0: the
        same values, and a processed distribution's top-k, top-p and min-p keep the same tokens)."""
        if isinstance(logits, DraftLogits):
            logits = logits.draft
        if params.greedy:
            return torch.log_softmax(logits.float(), dim=-1)
        return logits_to_probs(logits, params).float().log()

    def _newest_feature(self, seq: HeadSequence, step: Step, needed: int) -> torch.Tensor | None:
        """A head without a cache (Medusa, MLP speculators): the target's feature at the position before the
        newest token, the call's or (it brought none) the last one kept; the positions it has seen."""
        if needed:
            seq.last_feature = self._features(step, needed)[-1]
        seq.entries = step.keep + needed
        return seq.last_feature

    def _propose_medusa(self, seq: HeadSequence, step: Step, needed: int) -> Drafted:
        count = min(step.k, self.config.medusa_heads)
        if self._newest_feature(seq, step, needed) is None or not count:
            return Drafted([], None, seq.entries)
        logits = self.head(seq.last_feature, count)
        if step.branches > 1:
            # Medusa's heads do not read the drafted tokens: every node of a level has the same children's
            # distribution, head d's (a dynamic form of Medusa's static trees)
            scores = self._scores(logits, step.params)
            levels = iter(range(1, count))  # best_first_tree expands one level per call, in order

            def expand(nodes, parents, tokens):
                return scores[next(levels)].expand(len(nodes), -1)

            tokens, parents = best_first_tree(scores[0], expand, step.k, step.branches, count, self.stop_below)
            return Drafted(tokens, None, seq.entries, parents)
        probs: list = []
        drafted = []
        for row in logits:  # the heads ran at once; the confidence stop still shortens what is verified
            drafted.append(self._pick(row, step, probs))
            if self._unsure(row, drafted[-1]):
                break
        return Drafted(torch.cat(drafted).tolist(), torch.stack(probs) if probs else None, seq.entries)

    def _propose_mlp(self, seq: HeadSequence, step: Step, needed: int) -> Drafted:
        """An MLP speculator's chain (each stage reads the token the one before drafted) or tree (a level's
        nodes each run the next stage from their parent's state: EAGLE-2's dynamic tree over its stages)."""
        count = min(step.k, self.config.mlp_stages)
        if self._newest_feature(seq, step, needed) is None or not count or not step.new_ids:
            return Drafted([], None, seq.entries)
        head = self.head
        # stage 0 reads the target's feature at the position before the newest token, and that token
        state, logits = head.stage(0, head.start(seq.last_feature.reshape(1, -1)),
                                   torch.tensor([step.new_ids[-1]], device=self.device))
        if step.branches > 1:
            states, stages = {-1: state}, {-1: 0}  # by node: the state its children's stage reads, that stage

            def expand(nodes, parents, tokens):
                stage = stages[parents[0]] + 1  # (a level's nodes are one depth)
                new, children = head.stage(stage, torch.cat([states[p] for p in parents]),
                                           torch.tensor(tokens, device=self.device))
                for row, node in enumerate(nodes):
                    states[node], stages[node] = new[row:row + 1], stage
                return self._scores(children, step.params)

            tokens, parents = best_first_tree(self._scores(logits[0], step.params), expand, step.k, step.branches,
                                              count, self.stop_below)
            return Drafted(tokens, None, seq.entries, parents)
        probs: list = []
        drafted = []
        for j in range(count):
            drafted.append(self._pick(logits[0], step, probs))
            if self._unsure(logits[0], drafted[-1]) or j + 1 == count:
                break
            state, logits = head.stage(j + 1, state, drafted[-1])
        return Drafted(torch.cat(drafted).tolist(), torch.stack(probs) if probs else None, seq.entries)

    def _unsure(self, logits: torch.Tensor | DraftLogits, token: torch.Tensor) -> bool:
        """Whether the confidence stop ends the proposal after `token` (Executor.stop_below)."""
        if not self.stop_below:
            return False
        probability = logits.probability(token) if isinstance(logits, DraftLogits) else token_probability(logits, token)
        return stops_after(float(probability), self.stop_below)

    @staticmethod
    def _pick(logits: torch.Tensor | DraftLogits, step: Step, probs: list) -> torch.Tensor:
        """logits (V,) -> a (1,) token: greedy, or sampled from the processed distribution (kept in probs)."""
        if isinstance(logits, DraftLogits):
            if step.params.greedy:
                return logits.greedy().reshape(1)
            logits = logits.full()
        if step.params.greedy:
            return greedy(logits).reshape(1)
        p = logits_to_probs(logits, step.params)
        probs.append(p)
        return sample(p, step.generator).reshape(1)

