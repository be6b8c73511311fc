"""The model executor: one type that runs a causal LM step by step for many sequences at once, composed
of a KV store and a forward.

  KV store   where each sequence's keys and values live: `kv_cache.ContiguousKV` (one growable buffer per
             sequence) or `paged_kv.PagedKV` (blocks of one pool allocated at load, within a budget)
  forward    what runs the model over the new rows of several sequences: `TransformersForward`
             (transformers' own forward, any architecture) or `StaticForward` (a Llama-family forward
             over the paged pool in bucketed shapes, replayed as CUDA graphs)

`build.build_executor` picks the pair. The executor owns what is common: the sequences, rollback,
admission (the live-sequence limit, idle eviction), prefix caching's bookkeeping (`prefix_cache.py`;
where keyed blocks live is the store's), packed batches and drafting.

Every call names the sequence, how many of its cached tokens to keep (rolling back rejected draft tokens
is just a smaller `keep`) and the new tokens to append, so each round processes only new tokens and the
prompt is never re-sent. Steps of several sequences run as one forward (`extend_many`, `propose_many`),
each computing exactly what its own forward would.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from specdec import tensor_names as tn
from specdec.decoding.draft_tree import chain_depth, top_k_tree
from specdec.decoding.sampling import SamplingParams, greedy, logits_to_probs, sample, stops_after, token_probability
from specdec.engine.errors import CacheError, CapacityError
from specdec.engine.interfaces import Drafted, Forward, ForwardOutput, KVStore, Scored, Step
from specdec.engine.kv_cache import kv_layout
from specdec.engine.prefix_cache import PrefixIndex, SequenceState, root
from specdec.engine.run_ahead import Ahead, ForwardTimer

__all__ = ["CacheError", "CapacityError", "Drafted", "Executor", "Forward", "KVStore", "Scored", "Step"]


def leading_chain(tree: tuple[int, ...], num_logits: int) -> int:
    """How many of a tree step's first tokens form a chain that can run ahead of the rest: every node
    below them hangs from the chain's last token or deeper (which stays, as the tree's root row), and no
    wanted logits are among them."""
    # smallest[i]: the smallest parent among tokens i.. (one pass: a first round's tree follows a whole prompt)
    smallest = [len(tree)] * (len(tree) + 1)
    for i in range(len(tree) - 1, -1, -1):
        smallest[i] = min(tree[i], smallest[i + 1])
    lead = 1
    while lead < len(tree) and tree[lead] == lead - 1 and smallest[lead + 1] >= lead:
        lead += 1
    return max(0, min(lead - 1, len(tree) - num_logits))


class Executor:
    """Per-sequence incremental forward passes over one model: a KV store plus a forward.

    `clock` is injectable so idle eviction is testable without sleeping."""

    def __init__(self, model, kv: KVStore, forward: Forward, max_sequences: int = 256,
                 idle_timeout_s: float = 600.0, clock: Callable[[], float] = time.monotonic, adapters=None):
        self.model, self.kv, self.forward = model, kv, forward
        self.device = model.device  # where inputs go (a spread model: its first layer's)
        head = model.get_output_embeddings()
        # Where the logits come out (the last GPU of a spread model): sampling generators belong there.
        self.logits_device = head.weight.device if head is not None and hasattr(head, "weight") else model.device
        self.max_sequences = max_sequences
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self.sequences: dict[int, SequenceState] = {}
        self.tokens_processed = 0  # every token run through the model, for the token-count metric
        # Prefix caching: tokens of new sequences' first steps, and how many of them were found cached.
        self.prefix_queried_tokens = self.prefix_hit_tokens = 0
        width = head.weight.shape[0] if head is not None and hasattr(head, "weight") else self.vocab_size
        self._no_logits = torch.empty(0, width, dtype=model.dtype, device=self.logits_device)
        # The confidence stop (sampling.stops_after): a proposal ends after a token the model gave less than
        # this probability (0: it drafts all k). The adapter sets it (draft_model's draft_stop_below).
        self.stop_below = 0.0
        # Whether each sequence's tokens are kept on the host (seq.tokens) without prefix caching: a
        # layer-skip draft's search reads them (skip_layers.SkipTuner).
        self.keep_tokens = False
        # Greedy steps run ahead of their requests (run_ahead.py): per sequence the one pending; how many
        # were taken and dropped (the metrics'); per sequence the timer of the forward the last extend_many
        # took (the adapter reports its time instead of its own wait for it).
        self.ahead: dict[int, Ahead] = {}
        self.ahead_used = self.ahead_dropped = 0
        self.ahead_taken: dict[int, ForwardTimer] = {}
        self._cached_features: dict[int, torch.Tensor] = {}  # extend_many's, of its `whole` steps
        # The LoRA adapters a sequence may run (lora.AdapterSet, which the forward adds; None: none): the executor
        # checks a new sequence's slot against them
        self.adapters = adapters

    @property
    def tracks_tokens(self) -> bool:
        return self.prefix is not None or self.keep_tokens

    @property
    def prefix(self) -> PrefixIndex | None:
        return self.kv.prefix

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one cached token takes: keys and values of every layer."""
        layers, heads, head_dim = kv_layout(self.model)
        return 2 * layers * heads * head_dim * self.model.dtype.itemsize

    @property
    def kv_bytes_allocated(self) -> int:
        """Bytes the sequences' KV memory holds (the store's own measure)."""
        return self.kv.bytes_held(self.sequences.values())

    @property
    def kv_bytes_capacity(self) -> int:
        """Bytes the KV memory may hold in all (a paged pool's size; 0: not budgeted, buffers grow on demand)."""
        return self.kv.capacity_bytes

    @property
    def block_size(self) -> int:
        """Tokens per KV block (the prefix cache's unit, the paged pool's)."""
        return self.kv.block_size

    @property
    def prefix_cache_bytes(self) -> int:
        """Bytes of keyed blocks kept for later prompts and held by no sequence, and of the features kept
        with keyed blocks (a served head's, prefix_cache.py)."""
        return self.kv.prefix_cache_bytes + (self.prefix.features_bytes if self.prefix is not None else 0)

    def warm_up(self, time_budget_s: float = 120.0) -> tuple[int, float]:
        """Capture the forward's shape buckets where it has any: (buckets ready, seconds)."""
        return self.forward.warm_up(time_budget_s)

    def cached_length(self, seq_id: int) -> int:
        seq = self.sequences.get(seq_id)
        return seq.length if seq else 0

    def _acquire(self, step: Step, grow: int = 0) -> int:
        """The step's sequence rolled back to `step.keep` tokens, with room for `grow` more (CacheError if
        there is none; a sequence that was new then holds nothing). A new sequence also takes room for
        `step.reserve` positions (`Step.reserve`). A new sequence, or the next chunk of a prompt sent in
        chunks, may go on from cached blocks (prefix caching, where the executor has it): returns how many
        of the step's new tokens it found cached (they are not run again), 0 otherwise."""
        seq_id, keep = step.seq_id, step.keep
        seq = self.sequences.get(seq_id)
        if seq is None:
            if keep != 0:
                raise CacheError(
                    f"sequence {seq_id} has no cache (never started, released or evicted after idling)"
                    f" but cache_length={keep} was requested")
            if len(self.sequences) >= self.max_sequences:
                raise CapacityError(f"too many live sequences ({self.max_sequences}, max_sequences); {tn.RETRY_LATER}")
            adapter = self._adapter_slot(step.adapter) if step.adapter else 0
            seq = self.sequences[seq_id] = self.kv.new_sequence()
            seq.adapter, seq.adapter_key = adapter, self.adapters.key(adapter) if adapter else 0
            seq.salt = step.salt
            try:
                cached, queried = self._reuse_prefix(seq, step, 0)
                self.kv.reserve(seq, grow)
                if step.reserve > grow:
                    self.kv.hold(seq, step.reserve)
            except CacheError:
                self.release(seq_id)
                raise
        elif keep > seq.length:
            raise CacheError(f"cache_length={keep} exceeds the {seq.length} tokens cached for sequence {seq_id}")
        else:
            if step.path is not None:
                self._accept_path(seq, step.path)
            self.kv.reserve(seq, keep + grow)
            self._keep(seq, keep)
            # A prompt sent in chunks: each chunk may go on with blocks the index knows.
            cached, queried = self._reuse_prefix(seq, step, keep)
        seq.length = keep + cached  # rollback: later writes overwrite the rejected positions
        seq.cached += cached
        seq.last_used = self.clock()
        # Counted once the step holds its room (a refused first step is asked again).
        self.prefix_queried_tokens += queried
        self.prefix_hit_tokens += cached
        return cached

    def _accept_path(self, seq, path: tuple[int, ...]) -> None:
        """The previous step's tree: its accepted nodes' keys and values move to the positions a chain of
        them would have had (node path[j] to start + j), so that the sequence goes on as if it had drafted
        that chain alone; the rest of the tree is dropped with the rollback to `keep`."""
        start, _, tokens = seq.tree
        moves = [(start + node, start + j) for j, node in enumerate(path) if node != j]
        if moves:
            self.kv.move(seq, [source for source, _ in moves], [target for _, target in moves])
        if self.tracks_tokens and tokens is not None:  # known now: the blocks can be keyed later
            seq.tokens[start:start + len(path)] = [tokens[node] for node in path]
        seq.tree = None

    def _path_problem(self, step: Step) -> str | None:
        """What is wrong with a step's `path`, or None."""
        seq = self.sequences.get(step.seq_id)
        if seq is None or seq.tree is None:
            return f"path={list(step.path)} given, but sequence {step.seq_id}'s last step was not a tree"
        start, tree, _ = seq.tree
        if any(not 0 <= node < len(tree) for node in step.path) or \
                any(tree[node] != (step.path[j - 1] if j else -1) for j, node in enumerate(step.path)):
            return (f"path={list(step.path)} is not a path from the root of the last step's tree (parents "
                    f"{list(tree)})")
        if step.keep > start + len(step.path):
            return (f"cache_length={step.keep} exceeds the {start} tokens before the tree and its {len(step.path)} "
                    f"accepted nodes")
        return None

    def _adapter_problem(self, step: Step) -> str | None:
        """What is wrong with a step's LoRA adapter, or None."""
        if self.adapters is None:
            return f"no LoRA adapter {step.adapter!r} (this model serves none)"
        return self.adapters.problem(step.adapter)

    def _adapter_slot(self, name: str) -> int:
        """A new sequence's adapter's slot, the adapter read into one if it is not held (a slot that running
        sequences' adapter holds is not taken); CacheError (CapacityError: every slot is held so) saying why."""
        try:
            return self.adapters.acquire(name, {seq.adapter for seq in self.sequences.values()})
        except CacheError:
            raise
        except ValueError as exc:  # an adapter of the directory that does not fit the model: the request's input
            raise CacheError(f"input '{tn.LORA_NAME}': {exc}") from None

    def _reuse_prefix(self, seq, step: Step, start: int) -> tuple[int, int]:
        """A new sequence's first step, or the next chunk of a prompt sent in chunks (steps wanting no
        logits): where seq's cached tokens (`start`) are all in keyed blocks, give it the known blocks that
        continue them with the step's new tokens. Returns their tokens, and the tokens looked up (the
        prefix cache's metrics: every prompt token, no generated one)."""
        if self.prefix is None or not seq.prefilling:
            return 0, 0
        # a prompt's chunk: more of it follows (a tree of candidates: the prompt's end is its leading chain)
        seq.prefilling = step.k == 0 and step.num_logits == 0 and step.tree is None
        ids, size = step.new_ids, self.prefix.block_size
        if start != len(seq.chain) * size:
            return 0, len(ids)
        if step.whole and step.tree is not None:  # a tree's leading chain runs apart and its features are not
            return 0, len(ids)  # returned: cached ones before the tree's would sit where the chain's belong
        # The positions whose logits are wanted run (a proposal's last one, which it drafts from); of a
        # tree only its leading chain (a first round's prompt) can have been cached.
        reusable = (len(ids) - step.num_logits if step.tree is None else leading_chain(step.tree, step.num_logits)) // size
        blocks, chain = self.prefix.match(ids, reusable, seq.chain[-1] if seq.chain else root(seq)) if reusable > 0 \
            else ([], [])
        if step.whole:  # every position's features are wanted: the blocks whose features are kept (prefix_cache.py)
            kept = self.prefix.features(chain)
            blocks, chain = blocks[:len(kept)], chain[:len(kept)]
            if kept:
                self._cached_features[step.seq_id] = torch.cat(kept)
        cached = len(blocks) * size
        if blocks:
            self.kv.adopt(seq, blocks, start // size)
            seq.chain += chain
            del seq.tokens[start:]
            seq.tokens += ids[:cached]
        return cached, len(ids)

    def _keep(self, seq, keep: int) -> None:
        """A step keeps `keep` of seq's cached tokens (the caller has confirmed them) and overwrites the
        rest: the full blocks below `keep` are keyed, the keyed ones from `keep` on are not any more."""
        if self.prefix is None:
            return
        self._register(seq, keep)
        first = keep // self.prefix.block_size
        self.kv.rewrite_from(seq, first)
        del seq.chain[first:]

    def _register(self, seq, confirmed: int, start: int = 0, hidden: torch.Tensor | None = None) -> None:
        """Key seq's full blocks within its first `confirmed` positions (tokens that will not be rolled
        back: the caller kept them, or they are a prompt) in the index, so later prompts find them.
        hidden: the features of the positions from `start` on that the forward which ran them computed,
        kept with the blocks they cover (a head's prompt takes only blocks with features)."""
        size, first = self.prefix.block_size, len(seq.chain)
        blocks = []
        for j in range(first, min(confirmed, len(seq.tokens)) // size):
            tokens = tuple(seq.tokens[j * size:(j + 1) * size])
            if -1 in tokens:  # a drafted token the host has not seen yet
                break
            blocks.append(tokens)
        if not blocks:
            return
        serials = self.kv.key_blocks(seq, first, seq.chain[-1] if seq.chain else root(seq), blocks)
        seq.chain += serials
        if hidden is not None:
            for j, serial in enumerate(serials, first):
                offset = j * size - start
                if 0 <= offset and offset + size <= len(hidden):
                    self.prefix.keep_features(serial, hidden[offset:offset + size])

    def _forward(self, seqs: list, rows: list, num_logits: list[int], trees: list | None = None) -> ForwardOutput:
        """The forward over seqs' new rows (each cache grows by its row, a chain or a tree); with prefix
        caching, noting each sequence's tokens and keying its newly confirmed full blocks."""
        if self.tracks_tokens:
            for seq, row, tree in zip(seqs, rows, trees or [None] * len(seqs)):
                del seq.tokens[seq.length:]
                # -1: not known on the host (a drafted token), or not a sequence (a tree's nodes): never keyed
                seq.tokens += [-1] * len(row) if isinstance(row, torch.Tensor) or tree is not None else row
        starts = [seq.length for seq in seqs]
        out = self.forward(seqs, rows, num_logits, trees)
        for seq, row, tree in zip(seqs, rows, trees or [None] * len(seqs)):
            # A tree is remembered until the next step, whose `path` says which of its nodes to keep.
            seq.tree = None if tree is None else (seq.length, tuple(tree),
                                                  None if isinstance(row, torch.Tensor) else list(row))
            seq.length += len(row)
            self.tokens_processed += len(row)
        if self.prefix is not None:
            for i, (seq, n) in enumerate(zip(seqs, num_logits)):  # rows after the first with logits: drafts
                # (a tree's rows are its nodes: their tokens are not keyed, nor their features kept)
                self._register(seq, seq.length - max(n - 1, 0), starts[i], out.hidden[i] if out.hidden else None)
        return out

    def _acquire_all(self, steps: list[Step], problem: Callable[[Step], str | None]) -> tuple[list[int], list]:
        """Check each step (`problem` returns what is wrong with it, or None) and only then acquire its
        sequence, so a bad step leaves its cache untouched. Returns the valid indices and per-step errors;
        a step whose prompt starts with cached tokens is replaced, in `steps`, by the step that runs only
        the rest."""
        ok, errors = [], []
        seen = set()
        for i, step in enumerate(steps):
            try:
                if step.seq_id in seen:
                    raise CacheError(f"sequence {step.seq_id} has two steps in one batch")
                if not step.new_ids:
                    raise CacheError("no new tokens to append")
                message = problem(step) or (self._path_problem(step) if step.path is not None else None) \
                    or (self._adapter_problem(step) if step.adapter else None)
                if message:
                    raise CacheError(message)
                # Room for the new tokens, and for a proposal's drafted ones run through the model.
                cached = self._acquire(step, len(step.new_ids) + max(step.k - 1, 0))
                if cached:  # the prompt's first `cached` tokens are in the cache already
                    steps[i] = step._replace(keep=cached, new_ids=step.new_ids[cached:], tree=None if step.tree is None
                                             else tuple(p - cached for p in step.tree[cached:]))
                seen.add(step.seq_id)
                ok.append(i)
                errors.append(None)
            except CacheError as exc:
                # Kept without its traceback: that would hold this frame and its callers' (in a server,
                # the adapter's requests and responses) in a cycle only the garbage collector frees; a
                # target_model stub left to free such cycles at its exit was seen hanging there.
                errors.append(exc.with_traceback(None))
        return ok, errors

    def _extend_problem(self, step: Step) -> str | None:
        if not 0 <= step.num_logits <= len(step.new_ids):
            return f"num_logits={step.num_logits} must be within [0, {len(step.new_ids)}] (the new tokens)"
        if step.tree is None:
            return None
        if len(step.tree) != len(step.new_ids) or any(not -1 <= parent < node for node, parent in enumerate(step.tree)):
            return (f"tree must give each of the {len(step.new_ids)} new tokens its parent: -1 or an earlier "
                    f"token's index, got {list(step.tree)}")
        limit = self.forward.max_tree_rows
        size = len(step.tree) - leading_chain(step.tree, step.num_logits)  # what runs as a tree
        if limit is not None and size > limit:
            return (f"a tree of {size} tokens (after its leading chain) exceeds this executor's {limit} (its "
                    f"largest row bucket)")
        return None

    @torch.inference_mode()
    def extend_many(self, steps: list[Step], with_hidden: bool = False) -> list[torch.Tensor | Scored | CacheError]:
        """`extend` for several sequences in one forward pass: per step its (num_logits, V) logits, or
        the CacheError that step raised (the others still run). with_hidden: per step `Scored`, the logits
        with the hidden states of the forward's `hidden_layers` at every position it ran."""
        if with_hidden and not self.forward.hidden_layers:
            raise ValueError("with_hidden needs an executor built with hidden_layers")
        sent, steps = steps, list(steps)  # _acquire_all may shorten a step (prefix caching); the caller's stay as sent
        self._cached_features = {}  # a `whole` step's features of the cached blocks it took, by sequence
        taken = self._settle_ahead(steps, usable=True)
        rest = [i for i in range(len(steps)) if i not in taken]
        asked = [steps[i] for i in rest]
        ok, errors = self._acquire_all(asked, self._extend_problem)
        results: list = [None] * len(steps)
        for j, i in enumerate(rest):
            steps[i], results[i] = asked[j], errors[j]
        ok = [rest[j] for j in ok]
        for i, ahead in taken.items():  # computed already: run ahead after the previous step
            logits, hidden = ahead.rows(steps[i])
            results[i] = logits if not with_hidden else Scored(logits, hidden)
        # A prompt's chunk found whole in the prefix cache has nothing left to run (and wants no logits).
        run = [i for i in ok if steps[i].new_ids]
        cached = self._cached_features
        for i in ok:
            if not steps[i].new_ids:
                results[i] = self._no_logits if not with_hidden else \
                    Scored(self._no_logits, cached.get(steps[i].seq_id, self._no_hidden()))
        if run:
            self._run_leading_chains(steps, run)
            out = self._forward([self.sequences[steps[i].seq_id] for i in run], [steps[i].new_ids for i in run],
                                [steps[i].num_logits for i in run], [steps[i].tree for i in run])
            for i in run:  # a tree as the next step's path counts it: from the step's first token, as sent
                step = sent[i]
                if step.tree is not None:
                    self.sequences[step.seq_id].tree = (step.keep, tuple(step.tree),
                                                        step.new_ids if isinstance(step.new_ids, list) else None)
            for row, i in enumerate(run):
                if not with_hidden:
                    results[i] = out.logits[row]
                    continue
                hidden = out.hidden[row]
                if steps[i].seq_id in cached:  # the cached blocks' features first: every position's
                    hidden = torch.cat([cached[steps[i].seq_id].to(hidden.device), hidden])
                results[i] = Scored(out.logits[row], hidden)
        return results

    @torch.inference_mode()
    def run_ahead(self, seq_id: int, token: torch.Tensor, value: int) -> bool:
        """Append `token` (one id, on the device: the greedy pick of the sequence's last step, `value` on
        the host) and run its forward now, without waiting for it (run_ahead.py): the sequence's next
        `extend` that asks for exactly this step takes its logits; any other step drops it. False where
        it cannot run (no such sequence, one pending already, no room)."""
        seq = self.sequences.get(seq_id)
        if seq is None or seq_id in self.ahead:
            return False
        start = seq.length
        try:
            self.kv.reserve(seq, start + 1)
        except CacheError:
            return False
        with ForwardTimer(self.device) as timer:
            out = self._forward([seq], [token.reshape(1)], [1])
        self.tokens_processed -= 1  # counted when a request takes it
        self.ahead[seq_id] = Ahead(start, (value,), out.logits[0], out.hidden[0] if out.hidden else None, timer)
        return True

    @torch.inference_mode()
    def run_ahead_step(self, step: Step) -> bool:
        """Run `step`, a chain whose tokens the host knows (a hosted head's next round, guessed from this
        round's greedy picks: run_ahead.py), now, without waiting for it: the sequence's next `extend_many`
        that asks for it (or for a prefix of it, where it has every row's logits) takes its results; any other
        step drops it. False where it cannot run (no such sequence, one pending already, a tree, no room)."""
        if step.seq_id not in self.sequences or step.seq_id in self.ahead or step.tree is not None \
                or step.path is not None:
            return False
        ok, _ = self._acquire_all([step], self._extend_problem)
        if not ok:
            return False
        seq = self.sequences[step.seq_id]
        start = seq.length
        with ForwardTimer(self.device) as timer:
            out = self._forward([seq], [list(step.new_ids)], [step.num_logits])
        self.tokens_processed -= len(step.new_ids)  # counted when a request takes it
        self.ahead[step.seq_id] = Ahead(start, tuple(int(token) for token in step.new_ids), out.logits[0],
                                        out.hidden[0] if out.hidden else None, timer)
        return True

    def _settle_ahead(self, steps: list[Step], usable: bool) -> dict[int, Ahead]:
        """The steps run ahead that these steps ask for (by index; `usable` false: none), taken; the other
        pending ones of these steps' sequences dropped (the sequence rolls back to before them)."""
        self.ahead_taken = {}
        taken: dict[int, Ahead] = {}
        if not self.ahead:
            return taken
        for i, step in enumerate(steps):
            ahead = self.ahead.pop(step.seq_id, None)
            if ahead is None:
                continue
            seq = self.sequences[step.seq_id]
            if usable and ahead.matches(step):
                n = len(step.new_ids)
                seq.last_used = self.clock()
                seq.length = ahead.start + n  # asked for fewer: the rest lie past it, as rejected drafts do
                self.tokens_processed += n
                if self.tracks_tokens:  # its tokens are known on the host now: their blocks can be keyed
                    seq.tokens[ahead.start:] = ahead.tokens[:n]
                    if self.prefix is not None:
                        self._register(seq, seq.length - max(step.num_logits - 1, 0))
                self.ahead_used += 1
                self.ahead_taken[step.seq_id] = ahead.timer
                taken[i] = ahead
            else:
                self._drop_ahead(seq, ahead)
        return taken

    def _drop_ahead(self, seq, ahead: Ahead) -> None:
        # Its keys and values stay where they are, past the length: the next forward overwrites them.
        seq.length = ahead.start
        if self.tracks_tokens:
            del seq.tokens[ahead.start:]
        self.ahead_dropped += 1

    def _run_leading_chains(self, steps: list[Step], run: list[int]) -> None:
        """A tree step that starts with a chain (the tokens a cache lacks before the candidates: a prompt,
        in a first round) runs that chain first, as a step of its own, and then the tree from the chain's
        last token: a tree runs where trees fit (a static executor's decode buckets) and a prompt where
        prompts do. Rewrites those steps in `steps` (the next step's path counts from the step as sent)."""
        leads = {}
        for i in run:
            tree = steps[i].tree
            if tree is None:
                continue
            lead = leading_chain(tree, steps[i].num_logits)
            if lead > 0:
                leads[i] = lead
        if not leads:
            return
        self._forward([self.sequences[steps[i].seq_id] for i in leads], [steps[i].new_ids[:lead] for i, lead in
                                                                       leads.items()], [0] * len(leads))
        for i, lead in leads.items():
            step = steps[i]
            steps[i] = step._replace(new_ids=step.new_ids[lead:], tree=tuple(p - lead for p in step.tree[lead:]))

    def _no_hidden(self) -> torch.Tensor:
        size = self.model.config.get_text_config().hidden_size
        return torch.empty(0, len(self.forward.hidden_layers), size, dtype=self.model.dtype, device=self.logits_device)

    @torch.inference_mode()
    def propose_many(self, steps: list[Step]) -> list[Drafted | CacheError]:
        """`propose` for several sequences: their draft forwards run together, one batched pass per
        drafted position (a sequence that asked for fewer tokens leaves the batch early). Drafted tokens
        stay on the model's device from one step to the next and come back to the host in one transfer
        at the end: no host sync per drafted token."""
        # A proposal wants its last position's logits (it drafts from them); k = 0, a prompt's chunk, none.
        steps = [step._replace(num_logits=int(step.k > 0)) for step in steps]
        self._settle_ahead(steps, usable=False)
        ok, errors = self._acquire_all(steps, lambda step: None if step.k >= 0 and step.branches >= 1 else
                                       f"num_draft_tokens must be >= 0 and branches >= 1, got {step.k} and "
                                       f"{step.branches}")
        results: list = list(errors)
        tokens = {i: [] for i in ok}
        probs = {i: [] for i in ok}
        # A tree: fewer tokens drafted, the other candidates of each position beside them (draft_tree.py)
        depth = {i: chain_depth(steps[i].k, steps[i].branches) for i in ok}
        others: dict[int, list[torch.Tensor]] = {i: [] for i in ok}
        # k = 0: a prompt's chunk, appended and nothing drafted (nothing at all if the prefix cache had it).
        active = [i for i in ok if steps[i].new_ids]
        rows = [steps[i].new_ids for i in active]
        while active:
            logits = self._forward([self.sequences[steps[i].seq_id] for i in active], rows,
                                   [steps[i].num_logits for i in active]).logits
            still = []
            for row, i in enumerate(active):
                step = steps[i]
                if step.k == 0:
                    continue
                last = logits[row][-1]
                p = None
                if step.params.greedy:
                    token = greedy(last)
                else:
                    p = logits_to_probs(last, step.params)
                    token = sample(p, step.generator)
                    probs[i].append(p)
                tokens[i].append(token.reshape(1))
                if step.branches > 1:
                    others[i].append(_candidates(last, token, p, step.branches, step.generator))
                # The confidence stop reads the probability on the host: a sync per drafted token, where
                # without it the tokens stay on the device until the end (it is off unless set).
                if len(tokens[i]) < depth[i] and not (
                        self.stop_below and stops_after(float(token_probability(last, token)), self.stop_below)):
                    still.append(i)
            # The last drafted token is not run through the model: nothing needs its logits yet.
            active, rows = still, [tokens[i][-1] for i in still]
        parts = [t for i in ok for t in tokens[i]] + [t for i in ok for t in others[i]]
        drafted = torch.cat(parts).tolist() if parts else []  # one transfer
        first, later = 0, sum(len(tokens[i]) for i in ok)
        for i in ok:
            count = len(tokens[i])
            chain = drafted[first:first + count]
            candidates = []
            for t in others[i]:
                candidates.append(drafted[later:later + len(t)])
                later += len(t)
            # The last drafted token is not run through the model: the cache holds the rest.
            results[i] = self._drafted(chain, probs[i], candidates, steps[i].k, self.sequences[steps[i].seq_id].length)
            if self.tracks_tokens and count:  # the drafted tokens run through the model, known now
                seq = self.sequences[steps[i].seq_id]
                seq.tokens[seq.length - count + 1:seq.length] = drafted[first:first + count - 1]
            first += count
        return results

    @staticmethod
    def _drafted(chain: list[int], probs: list[torch.Tensor], candidates: list[list[int]], budget: int,
                 cached_length: int) -> Drafted:
        """A proposal: the chain, or with other candidates the tree of them (draft_tree.top_k_tree), whose
        probs row r is what row r's children were drawn from."""
        nodes, parents, chain_of = top_k_tree(chain, candidates, budget) if candidates else (chain, None, [])
        if len(nodes) == len(chain):  # no room or no other candidate: a chain
            return Drafted(chain, torch.stack(probs) if probs else None, cached_length)
        rows = None
        if probs:
            leaf = torch.zeros_like(probs[0])
            rows = torch.stack([probs[0]] + [probs[d + 1] if 0 <= d < len(chain) - 1 else leaf for d in chain_of])
        return Drafted(nodes, rows, cached_length, parents)

    def propose(self, seq_id: int, keep: int, new_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None = None, reserve: int = 0) -> tuple[list[int], torch.Tensor | None]:
        """Draft k tokens autoregressively after appending new_ids.

        Returns k draft tokens and, when sampling, their (k, V) processed distributions (None when
        greedy: the greedy rule needs only the tokens), and the cache's length after the call: the last
        drafted token is not run through the model (nothing needs its logits until the next round), so
        the cache grows by len(new_ids) + k - 1. k = 0 only appends (a prompt's chunk). One sequence's
        `propose_many`; raises its CacheError.
        """
        (result,) = self.propose_many([Step(seq_id, keep, new_ids, k=k, params=params, generator=generator,
                                            reserve=reserve)])
        if isinstance(result, CacheError):
            raise result
        return result

    def extend(self, seq_id: int, keep: int, new_ids: list[int], num_logits: int, reserve: int = 0) -> torch.Tensor:
        """Keep the first `keep` cached tokens, append `new_ids`, return logits of the last positions.

        Returns (num_logits, V) in the model's dtype; num_logits <= len(new_ids). One sequence's
        `extend_many`; raises its CacheError.
        """
        (result,) = self.extend_many([Step(seq_id, keep, new_ids, num_logits, reserve=reserve)])
        if isinstance(result, CacheError):
            raise result
        return result

    def release(self, seq_id: int) -> bool:
        seq = self.sequences.pop(seq_id, None)
        if self.ahead.pop(seq_id, None) is not None:
            self.ahead_dropped += 1
        if seq is not None:
            self.kv.release(seq)
        return seq is not None

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (a client's reset: cache_reset.py), and the trained heads' features kept
        with them; running sequences keep the blocks they hold. Returns the blocks forgotten."""
        return self.kv.reset_prefix_cache()

    def evict_idle(self) -> list[int]:
        """Drop sequences idle for longer than idle_timeout_s; returns their ids."""
        deadline = self.clock() - self.idle_timeout_s
        stale = [sid for sid, seq in self.sequences.items() if seq.last_used < deadline]
        for sid in stale:
            self.release(sid)
        return stale


def _candidates(logits: torch.Tensor, token: torch.Tensor, p: torch.Tensor | None, branches: int,
                generator: torch.Generator | None) -> torch.Tensor:
    """A drafted position's other candidates, on the device: greedy, the `branches` most likely (the drafted
    token among them, dropped on the host); sampled (p the distribution `token` was drawn from), up to
    branches - 1 more drawn from p without replacement after it (tree_sampler's SAMPLED children)."""
    if p is None:
        return logits.topk(min(branches, logits.shape[-1])).indices
    rest = p.clone()
    rest[token] = 0
    count = min(branches - 1, int((rest > 0).sum()))  # a host sync: sampled trees only
    if not count:
        return token.new_empty(0)
    return torch.multinomial(rest, count, replacement=False, generator=generator)
