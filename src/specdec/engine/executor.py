"""A Hugging Face causal LM that keeps one KV cache per sequence, with rollback.

draft_model and target_model both wrap this class. Every call names the sequence, how many of its
cached tokens to keep (rolling back rejected draft tokens is just a smaller `keep`) and the new
tokens to append, so each round processes only new tokens and the prompt is never re-sent.
Caches live in a keyed store with an idle timeout, so a sequence abandoned without a release call
(client crash, orchestrator restart) cannot hold memory forever.

Steps of several sequences run as one packed forward pass (`extend_many`, `propose_many`): their new
tokens back to back in one row with per-token positions (no padding to a common width), and each
sequence's segment reads and appends to its own KV buffers in place (`kv_cache.py`), so each computes
exactly what its own forward would and no cache is copied. Where a forward's cost hardly grows with its
rows (memory-bound decoding, and small batches even on this CPU), B sequences cost far less than B
forwards.

With prefix caching a new sequence (or the next chunk of a prompt sent in chunks) starts from the keys
and values of earlier prompts that began the same way, and runs only the rest: `prefix_cache.py` keys
full blocks by their tokens; here they are copied into a store and out of it (kv_cache.BlockStore), the
static executor shares its pool's blocks instead.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from specdec import tensor_names as tn
from specdec.engine import onednn_linear
from specdec.engine.kv_cache import BlockStore, KVBatch, SequenceKV, layer_devices, use_sequence_kv
from specdec.engine.prefix_cache import ROOT, PrefixIndex
from specdec.decoding.sampling import SamplingParams, greedy, logits_to_probs, sample

DTYPES = {name: getattr(torch, name) for name in tn.DTYPE_NAMES}


EXACT_ROWS = 16  # forwards of up to this many token rows always run at their own size


def padded_rows(rows: int, min_rows: int = 1, bucketed: bool = False) -> int:
    """How many token rows a forward of `rows` runs with (padding rows are dropped afterwards).

    2 .. min_rows - 1 rows are padded to min_rows. With `bucketed`, more than EXACT_ROWS rows are rounded
    up to one of 8 sizes per power of two (at most 12.5 % padding, 17 -> 18, 300 -> 320), so a server sees
    a bounded set of shapes: oneDNN builds and caches a kernel per (rows, weight) shape it meets, and under
    prompts of every length that cache alone grew a stub by ~100 MB over minutes (README, "Soak").
    """
    if 1 < rows < min_rows:
        return min_rows
    if not bucketed or rows <= EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


class CacheError(ValueError):
    """A request that does not match the sequence's cached state (a client or orchestrator bug)."""


class CapacityError(CacheError):
    """No room for the sequence now (the KV budget or the live-sequence limit is reached): the same step
    can succeed once other sequences end. The adapters answer it UNAVAILABLE."""


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_causal_lm(model_path: str, device: str = "cpu", dtype: str = "float32", device_map: str = "",
                   linear_kernels: str = "auto"):
    """Load a causal LM from a Hugging Face directory or a single GGUF file.

    device_map (e.g. "auto") spreads a model too large for one GPU over the visible GPUs.
    linear_kernels: "auto" reorders the linear weights for oneDNN on CPU in float32/bfloat16
    (`onednn_linear.py`: 1.3-2x faster steps there), "onednn" requires it, "torch" keeps torch's own.
    """
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if not path.exists():
        raise FileNotFoundError(f"model_path {model_path!r} does not exist")
    torch_dtype = resolve_dtype(dtype)
    kwargs = {"dtype": torch_dtype}
    if device_map:
        kwargs["device_map"] = device_map
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model_path {model_path!r} is a file but not a .gguf file")
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    else:
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model_path {model_path!r} has no config.json (not a Hugging Face model directory)")
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    if not device_map:
        model.to(torch.device(device))
    model.eval()
    if onednn_linear.resolve(linear_kernels, model.device, model.dtype):
        onednn_linear.prepack_linears(model)
    return model


class Step(NamedTuple):
    """One sequence's part of a batched call: keep `keep` cached tokens, append `new_ids`."""

    seq_id: int
    keep: int
    new_ids: list[int]
    num_logits: int = 1  # extend: logits of the last num_logits new positions
    k: int = 0  # propose: tokens to draft
    params: SamplingParams = SamplingParams()
    generator: torch.Generator | None = None
    # A new sequence's room for its whole generation, taken at its first step (so that a sequence that
    # starts can finish): positions, or 0 for just this step's. Ignored once the sequence exists.
    reserve: int = 0
    # extend, read by whoever picks tokens from the logits (not the forward): (num_logits, words) int32
    # bitmask of the tokens each position's greedy pick may take (grammar.GrammarMatcher.allowed)
    allowed: torch.Tensor | None = None


class CausalLM:
    """Per-sequence incremental forward passes over one model.

    `clock` is injectable so idle eviction is testable without sleeping.
    """

    def __init__(self, model, max_sequences: int = 256, idle_timeout_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic, min_forward_rows: int = 1,
                 row_buckets: bool = False, prefix_cache_tokens: int = 0, block_size: int = 32):
        self.model = model
        # Where inputs go (a spread model: its first layer's), read once: transformers looks it up through
        # the parameters on every access, several times per forward.
        self._device = model.device
        use_sequence_kv(model)
        self.layer_devices = layer_devices(model, self._num_layers)  # each layer's KV buffers live beside it
        head = model.get_output_embeddings()
        # Where the logits come out (the last GPU of a spread model): sampling generators belong there.
        self.logits_device = head.weight.device if head is not None and hasattr(head, "weight") else model.device
        # A forward over fewer than this many token rows (but more than one) is padded up to it: with
        # torch's own CPU kernels, GEMMs of 2-3 rows take a slower BLAS path than 4 (README, "Measured
        # design choices"). Padding rows attend to nothing and are never cached.
        self.min_forward_rows = min_forward_rows
        self.row_buckets = row_buckets  # see padded_rows: bounds the shapes oneDNN's kernel cache keeps
        self.max_sequences = max_sequences
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self.sequences: dict[int, SequenceKV] = {}
        self.tokens_processed = 0  # every token run through the model, for the token-count metric
        # Prefix caching: keyed blocks of `block_size` tokens, copied into a store of prefix_cache_tokens
        # (rounded down to blocks; 0: off). Counted: tokens of new sequences' first steps, and how many of
        # them were found cached.
        self.prefix = PrefixIndex(block_size) if prefix_cache_tokens >= block_size else None
        if self.prefix is not None:
            heads, head_dim = self._kv_heads_and_dim()
            self.store = BlockStore(self.prefix, prefix_cache_tokens // block_size, self.layer_devices, heads,
                                    head_dim, model.dtype)
        self.prefix_queried_tokens = self.prefix_hit_tokens = 0
        width = head.weight.shape[0] if head is not None and hasattr(head, "weight") else self.vocab_size
        self._no_logits = torch.empty(0, width, dtype=model.dtype, device=self.logits_device)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def device(self) -> torch.device:
        return self._device

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
            seq = self.sequences[seq_id] = self._new_sequence()
            try:
                cached, queried = self._reuse_prefix(seq, step, 0)
                self._reserve(seq, grow)
                if step.reserve > grow:
                    self._hold(seq, step.reserve)
            except CacheError:
                self.release(seq_id)
                raise
        elif keep > seq.length:
            raise CacheError(f"cache_length={keep} exceeds the {seq.length} tokens cached for sequence {seq_id}")
        else:
            self._reserve(seq, keep + grow)
            self._keep(seq, keep)
            # A prompt sent in chunks: each chunk may go on with blocks the index knows.
            cached, queried = self._reuse_prefix(seq, step, keep)
        seq.length = keep + cached  # rollback: later writes overwrite the rejected positions
        seq.last_used = self.clock()
        # Counted once the step holds its room (a refused first step is asked again).
        self.prefix_queried_tokens += queried
        self.prefix_hit_tokens += cached
        return cached

    # ---- prefix caching (prefix_cache.py): the index is common, where blocks live is each executor's ----
    def _reuse_prefix(self, seq, step: Step, start: int) -> tuple[int, int]:
        """A new sequence's first step, or the next chunk of a prompt sent in chunks (steps wanting no
        logits): where seq's cached tokens (`start`) are all in keyed blocks, give it the known blocks that
        continue them with the step's new tokens. Returns their tokens, and the tokens looked up (the
        prefix cache's metrics: every prompt token, no generated one)."""
        if self.prefix is None or not seq.prefilling:
            return 0, 0
        seq.prefilling = step.k == 0 and step.num_logits == 0  # a prompt's chunk: more of it follows
        ids, size = step.new_ids, self.prefix.block_size
        if start != len(seq.chain) * size:
            return 0, len(ids)
        # The positions whose logits are wanted run (a proposal's last one, which it drafts from).
        reusable = (len(ids) - step.num_logits) // size
        blocks, chain = self.prefix.match(ids, reusable, seq.chain[-1] if seq.chain else ROOT) if reusable > 0 \
            else ([], [])
        cached = len(blocks) * size
        if blocks:
            self._adopt(seq, blocks, start // size)
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
        self._rewrite_from(seq, first)
        del seq.chain[first:]

    def _register(self, seq, confirmed: int) -> None:
        """Key seq's full blocks within its first `confirmed` positions (tokens that will not be rolled
        back: the caller kept them, or they are a prompt) in the index, so later prompts find them."""
        size, first = self.prefix.block_size, len(seq.chain)
        blocks = []
        for j in range(first, min(confirmed, len(seq.tokens)) // size):
            tokens = tuple(seq.tokens[j * size:(j + 1) * size])
            if -1 in tokens:  # a drafted token the host has not seen yet
                break
            blocks.append(tokens)
        if blocks:
            seq.chain += self._key_blocks(seq, first, seq.chain[-1] if seq.chain else ROOT, blocks)

    def _forward(self, seqs: list, rows: list, num_logits: list[int]) -> list[torch.Tensor]:
        """`_forward_rows`, noting each sequence's tokens and keying its newly confirmed full blocks."""
        if self.prefix is None:
            return self._forward_rows(seqs, rows, num_logits)
        for seq, row in zip(seqs, rows):
            del seq.tokens[seq.length:]
            seq.tokens += [-1] * len(row) if isinstance(row, torch.Tensor) else row
        logits = self._forward_rows(seqs, rows, num_logits)
        for seq, n in zip(seqs, num_logits):  # rows after the first with logits are drafts: unconfirmed
            self._register(seq, seq.length - max(n - 1, 0))
        return logits

    def _adopt(self, seq, blocks: list[int], first: int) -> None:
        """seq's blocks first, first + 1, ... get the contents of these keyed blocks: copied from the store
        here."""
        self.store.load(seq, blocks, first)

    def _key_blocks(self, seq, first: int, parent: int, blocks: list[tuple[int, ...]]) -> list[int]:
        """Key seq's blocks first, first + 1, ... (holding `blocks`' tokens; the first follows the prefix
        `parent`): copied into the store here. Returns their serials (fewer if the store is full of them)."""
        return self.store.save(seq, first, parent, blocks)

    def _rewrite_from(self, seq, j: int) -> None:
        """seq writes into its blocks from j on next. Here they are its own buffers: nothing to do."""

    def _new_sequence(self):
        heads, head_dim = self._kv_heads_and_dim()
        return SequenceKV(self.layer_devices, heads, head_dim, self.model.dtype,
                          max_capacity=getattr(self.model.config, "max_position_embeddings", None))

    def _reserve(self, seq, positions: int) -> None:
        """Make sure `seq` can hold `positions` tokens; here buffers grow on demand (`KVBatch`)."""

    def _hold(self, seq, positions: int) -> None:
        """Set room aside for `positions` tokens of a new sequence's generation (CapacityError when there
        is none). Here memory is not budgeted: nothing to hold."""

    def extend(self, seq_id: int, keep: int, new_ids: list[int], num_logits: int, reserve: int = 0) -> torch.Tensor:
        """Keep the first `keep` cached tokens, append `new_ids`, return logits of the last positions.

        Returns (num_logits, V) in the model's dtype; num_logits <= len(new_ids). One sequence's
        `extend_many`; raises its CacheError.
        """
        (result,) = self.extend_many([Step(seq_id, keep, new_ids, num_logits, reserve=reserve)])
        if isinstance(result, CacheError):
            raise result
        return result

    def _kv_heads_and_dim(self) -> tuple[int, int]:
        cfg = self.model.config
        text = getattr(cfg, "get_text_config", lambda: cfg)()
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return heads, head_dim

    @property
    def _num_layers(self) -> int:
        return getattr(self.model.config, "get_text_config", lambda: self.model.config)().num_hidden_layers

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one cached token takes: keys and values of every layer."""
        heads, head_dim = self._kv_heads_and_dim()
        return 2 * self._num_layers * heads * head_dim * self.model.dtype.itemsize

    @property
    def prefix_cache_bytes(self) -> int:
        """Bytes of keyed blocks kept for later prompts and held by no sequence (here: the store's)."""
        return self.store.nbytes if self.prefix is not None else 0

    @property
    def kv_bytes_allocated(self) -> int:
        """Bytes the sequences' KV buffers hold (their capacity, which grows by doubling)."""
        return sum(seq.nbytes for seq in self.sequences.values())

    def _forward_rows(self, seqs: list[SequenceKV], rows: list, num_logits: list[int]) -> list[torch.Tensor]:
        """One packed forward over several sequences; seqs[b]'s cache grows by len(rows[b]) tokens and it
        gets the logits (num_logits[b], V) of its last num_logits[b] new positions. A row is a list of ids
        or a 1-D tensor of ids already on the model's device (drafted tokens: no trip through the host)."""
        if all(isinstance(row, list) for row in rows):
            ids = torch.tensor([token for row in rows for token in row], device=self.device)
        else:
            ids = torch.cat([row if isinstance(row, torch.Tensor) else torch.tensor(row, device=self.device)
                             for row in rows])
        positions = [seq.length + j for seq, row in zip(seqs, rows) for j in range(len(row))]
        heads, end = [], 0  # packed indices of the positions whose logits are wanted
        for row, n in zip(rows, num_logits):
            end += len(row)
            heads += range(end - n, end)
        # Pad the body and the head to padded_rows (see __init__). Padding tokens follow every segment,
        # attend to nothing and are never cached; padded head rows are dropped.
        pad = padded_rows(len(ids), self.min_forward_rows, self.row_buckets) - len(ids)
        if pad:
            ids, positions = torch.cat([ids, ids.new_zeros(pad)]), positions + [positions[-1]] * pad
        wanted = len(heads)
        size = padded_rows(max(wanted, 1), self.min_forward_rows, self.row_buckets)
        heads += [heads[-1] if heads else 0] * (size - wanted)
        out = self.model(input_ids=ids[None],
                         position_ids=torch.tensor([positions], device=self.device), use_cache=False,
                         logits_to_keep=torch.tensor(heads, device=self.device),
                         kv_batch=KVBatch(seqs, [len(row) for row in rows]))
        for seq, row in zip(seqs, rows):
            seq.length += len(row)
            self.tokens_processed += len(row)
        logits, results, first = out.logits[0], [], 0
        for n in num_logits:
            results.append(logits[first:first + n])
            first += n
        return results

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
                message = problem(step)
                if message:
                    raise CacheError(message)
                # Room for the new tokens, and for a proposal's drafted ones run through the model.
                cached = self._acquire(step, len(step.new_ids) + max(step.k - 1, 0))
                if cached:  # the prompt's first `cached` tokens are in the cache already
                    steps[i] = step._replace(keep=cached, new_ids=step.new_ids[cached:])
                seen.add(step.seq_id)
                ok.append(i)
                errors.append(None)
            except CacheError as exc:
                # Kept without its traceback: that would hold this frame and its callers' (in a server,
                # the adapter's requests and responses) in a cycle only the garbage collector frees; a
                # target_model stub left to free such cycles at its exit was seen hanging there.
                errors.append(exc.with_traceback(None))
        return ok, errors

    @torch.inference_mode()
    def extend_many(self, steps: list[Step]) -> list[torch.Tensor | CacheError]:
        """`extend` for several sequences in one forward pass: per step its (num_logits, V) logits, or
        the CacheError that step raised (the others still run)."""
        steps = list(steps)  # _acquire_all may shorten a step (prefix caching); the caller's stay as sent
        ok, errors = self._acquire_all(steps, lambda step: None if 0 <= step.num_logits <= len(step.new_ids) else
                                       f"num_logits={step.num_logits} must be within [0, {len(step.new_ids)}] "
                                       "(the new tokens)")
        results: list[torch.Tensor | CacheError] = list(errors)
        # A prompt's chunk found whole in the prefix cache has nothing left to run (and wants no logits).
        run = [i for i in ok if steps[i].new_ids]
        for i in ok:
            if not steps[i].new_ids:
                results[i] = self._no_logits
        if run:
            logits = self._forward([self.sequences[steps[i].seq_id] for i in run], [steps[i].new_ids for i in run],
                                   [steps[i].num_logits for i in run])
            for row, i in enumerate(run):
                results[i] = logits[row]
        return results

    @torch.inference_mode()
    def propose_many(self, steps: list[Step]) -> list[tuple[list[int], torch.Tensor | None] | CacheError]:
        """`propose` for several sequences: their draft forwards run together, one batched pass per
        drafted position (a sequence that asked for fewer tokens leaves the batch early). Drafted tokens
        stay on the model's device from one step to the next and come back to the host in one transfer
        at the end: no host sync per drafted token."""
        # A proposal wants its last position's logits (it drafts from them); k = 0, a prompt's chunk, none.
        steps = [step._replace(num_logits=int(step.k > 0)) for step in steps]
        ok, errors = self._acquire_all(steps, lambda step: None if step.k >= 0 else
                                       f"num_draft_tokens must be >= 0, got {step.k}")
        results: list = list(errors)
        tokens = {i: [] for i in ok}
        probs = {i: [] for i in ok}
        # k = 0: a prompt's chunk, appended and nothing drafted (nothing at all if the prefix cache had it).
        active = [i for i in ok if steps[i].new_ids]
        rows = [steps[i].new_ids for i in active]
        while active:
            logits = self._forward([self.sequences[steps[i].seq_id] for i in active], rows,
                                   [steps[i].num_logits for i in active])
            still = []
            for row, i in enumerate(active):
                step = steps[i]
                if step.k == 0:
                    continue
                last = logits[row][-1]
                if step.params.greedy:
                    token = greedy(last)
                else:
                    p = logits_to_probs(last, step.params)
                    token = sample(p, step.generator)
                    probs[i].append(p)
                tokens[i].append(token.reshape(1))
                if len(tokens[i]) < step.k:
                    still.append(i)
            # The last drafted token is not run through the model: nothing needs its logits yet.
            active, rows = still, [tokens[i][-1] for i in still]
        drafted = torch.cat([t for i in ok for t in tokens[i]]).tolist() if any(tokens.values()) else []  # one transfer
        first = 0
        for i in ok:
            count = len(tokens[i])
            results[i] = (drafted[first:first + count], torch.stack(probs[i]) if probs[i] else None)
            if self.prefix is not None and count:  # the drafted tokens run through the model, known now
                seq = self.sequences[steps[i].seq_id]
                seq.tokens[seq.length - count + 1:seq.length] = drafted[first:first + count - 1]
            first += count
        return results

    def propose(self, seq_id: int, keep: int, new_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None = None, reserve: int = 0) -> tuple[list[int], torch.Tensor | None]:
        """Draft k tokens autoregressively after appending new_ids.

        Returns (tokens, probs): k draft tokens and, when sampling, their (k, V) float32 processed
        distributions (None when greedy: the greedy rule needs only the tokens). The last drafted token
        is not run through the model (nothing needs its logits until the next round), so the cache
        grows by len(new_ids) + k - 1. k = 0 only appends (a prompt's chunk). One sequence's
        `propose_many`; raises its CacheError.
        """
        (result,) = self.propose_many([Step(seq_id, keep, new_ids, k=k, params=params, generator=generator,
                                            reserve=reserve)])
        if isinstance(result, CacheError):
            raise result
        return result

    def release(self, seq_id: int) -> bool:
        return self.sequences.pop(seq_id, None) is not None

    def evict_idle(self) -> list[int]:
        """Drop sequences idle for longer than idle_timeout_s; returns their ids."""
        deadline = self.clock() - self.idle_timeout_s
        stale = [sid for sid, seq in self.sequences.items() if seq.last_used < deadline]
        for sid in stale:
            del self.sequences[sid]
        return stale
