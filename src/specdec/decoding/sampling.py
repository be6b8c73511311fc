"""Logits -> probabilities and sampling, applied identically to draft and target distributions.

The same `logits_to_probs` runs on the draft's logits (inside draft_model) and on the target's
(inside the orchestrator): rejection sampling is lossless only when both distributions went through
identical temperature / top-k / top-p processing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec import tensor_names as tn


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = tn.DEFAULT_TEMPERATURE  # 0 = greedy (argmax); > 0 = sample from softmax(logits / T)
    top_k: int = tn.DEFAULT_TOP_K  # keep the k most likely tokens; 0 = off
    top_p: float = tn.DEFAULT_TOP_P  # keep the smallest set whose mass reaches top_p; 1 = off
    seed: int | None = None  # makes a sampled request reproducible
    min_p: float = tn.DEFAULT_MIN_P  # keep tokens with probability >= min_p x the largest; 0 = off

    @property
    def greedy(self) -> bool:
        # top_k == 1 keeps only the argmax, which is greedy decoding whatever the temperature.
        return self.temperature == 0.0 or self.top_k == 1


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row: logits (..., V) -> (...,) int64, the first maximum (argmax's tokens,
    ties and NaN alike). Through `max`, whose CPU reduction is about 3x faster than `argmax`'s over a
    vocabulary row; draft, target and tests all pick tokens here."""
    return logits.max(-1).indices


def greedy_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """The log-probability of each row's greedy token under the row's softmax: logits (..., V) ->
    (...,) float32, max - logsumexp (no (..., V) log-softmax is materialised)."""
    logits = logits.float()
    return logits.max(-1).values - logits.logsumexp(-1)


def top_log_probs(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's n most likely tokens, most likely first, and their log-probabilities under the row's
    softmax: logits (rows, V) -> (ids (rows, n) int64, log-probabilities (rows, n) float32). A row's
    first entry is its greedy token (`greedy_log_probs`' value, the same float32 arithmetic)."""
    logits = logits.float()
    values, ids = logits.topk(min(n, logits.shape[-1]), dim=-1)
    return ids, values - logits.logsumexp(-1, keepdim=True)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[i, tokens[i]]: logits (n, V), tokens (n,) int64 -> (n,) float32."""
    logits = logits.float()
    return logits.gather(-1, tokens.to(logits.device)[:, None])[:, 0] - logits.logsumexp(-1)


def scored_log_probs(logits: torch.Tensor, tokens: torch.Tensor, n: int = 0, block: int = 256
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A prompt's scores: each row's log-probability of its token (`token_log_probs`), the token's rank (1 +
    the tokens its row makes strictly more likely: 1 where it is the greedy choice, as vLLM ranks a prompt's
    tokens) and, with n > 0, its n most likely tokens with theirs (`top_log_probs`): logits (rows, V), tokens
    (rows,) int64 -> ((rows,) float32, (rows,) int64, (rows, n) int64 or None, (rows, n) float32 or None).
    One log-sum-exp a row, `block` rows at a time: a long prompt's float32 copy of its logits stays a block's."""
    values, ranks, ids, tops = [], [], [], []
    for start in range(0, len(logits), block):
        part = logits[start:start + block].float()
        norm = part.logsumexp(-1, keepdim=True)
        chosen = part.gather(-1, tokens[start:start + block].to(part.device)[:, None])
        values.append(chosen[:, 0] - norm[:, 0])
        ranks.append((part > chosen).sum(-1) + 1)
        if n:
            top, top_ids = part.topk(min(n, part.shape[-1]), dim=-1)
            ids.append(top_ids)
            tops.append(top - norm)
    if not values:  # no rows
        empty = logits.new_zeros((0,), dtype=torch.float32)
        return empty, logits.new_zeros((0,), dtype=torch.long), \
            (logits.new_zeros((0, n), dtype=torch.long) if n else None), \
            (logits.new_zeros((0, n), dtype=torch.float32) if n else None)
    return torch.cat(values), torch.cat(ranks), (torch.cat(ids) if n else None), (torch.cat(tops) if n else None)


def scored_rows(logits: torch.Tensor, new_ids: list[int], score_rows: int, n: int = 0, score_next: int = -1
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`scored_log_probs` of a step's score rows: the first `score_rows` of its logits (rows, V), one per new
    token from the `rows`-th last on, each scoring the new token after its own. The last score row's next
    token is `score_next` where the step's rows end there (a prompt's chunk scored before the next chunk
    arrives, `score_next` >= 0: that chunk's first token). One owner of this indexing for the in-process
    scorer and the served target."""
    start = len(new_ids) - len(logits) + 1
    following = new_ids + ([score_next] if score_next >= 0 else [])
    after = torch.tensor(following[start:start + score_rows], dtype=torch.long)
    if len(after) != score_rows:
        raise ValueError(f"{score_rows} score rows need the {score_rows} tokens after them, got {len(after)}")
    return scored_log_probs(logits[:score_rows], after, n)


def token_probability(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """softmax(logits)[token]: logits (V,), token (1,) or () int64 -> () float32. A draft's confidence in
    its own token (the confidence stop): its raw distribution's, whatever the request's sampling does."""
    return torch.softmax(logits.float(), dim=-1).gather(-1, token.reshape(1)).reshape(())


def stops_after(probability: float, stop_below: float) -> bool:
    """The confidence stop: drafting ends after a token the draft gave less than `stop_below` (0: never).
    Exact for any draft: the decision after x_i reads only the draft's own x_1..x_i, and x_i itself is
    verified as usual (dropping it instead would change what a sampled round accepts)."""
    return probability < stop_below


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed next-token distributions: temperature, then top-k, top-p and min-p (transformers'
    order of its warpers).

    logits: (..., V) float. Returns (..., V) float32 probabilities summing to 1 over V.
    Greedy params give a one-hot distribution on the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(greedy(logits), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < top_p_floor(probs, params.top_p), float("-inf"))
    if params.min_p > 0.0:
        # Drop tokens less likely than min_p x the most likely one (which always stays).
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits.softmax(-1)


# Top-p on CPU finds each row's nucleus among its NUCLEUS_PROBE most likely tokens (a partial top-k) and
# sorts only where the nucleus is wider: torch's CPU sort of a whole vocabulary row costs milliseconds
# (~4 ms for 49152 tokens), and the orchestrator runs it on every sampled round's K + 1 rows.
NUCLEUS_PROBE = 256


def _nucleus_floor(sorted_probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """sorted_probs (N, n), each row descending -> ((N, 1) the probability of the last token the nucleus
    keeps, (N, 1) how many of the n it keeps). Top-p keeps tokens while the mass before them is under
    top_p; the first always stays."""
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    kept = (mass_before < top_p).sum(-1, keepdim=True)
    return sorted_probs.gather(-1, kept.clamp(min=1) - 1), kept


def sorted_top_p_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`top_p_floor` by sorting whole rows: (N, V) -> (N, 1). On a GPU, where a sort is cheap, this is
    the path: no host synchronization."""
    return _nucleus_floor(probs.sort(-1, descending=True).values, top_p)[0]


def top_p_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The probability of the least likely token top-p keeps: probs (..., V) -> (..., 1). Top-p keeps
    the most likely tokens until the mass before the next one reaches top_p (the first always stays);
    the tokens it keeps are those at least this likely (tokens tied at the boundary stay together)."""
    flat = probs.reshape(-1, probs.shape[-1])
    if flat.device.type != "cpu" or flat.shape[-1] <= NUCLEUS_PROBE:
        return sorted_top_p_floor(flat, top_p).reshape(*probs.shape[:-1], 1)
    floor, kept = _nucleus_floor(flat.topk(NUCLEUS_PROBE, -1).values, top_p)
    # A row may keep more than the probe holds. The mass strictly above its last kept token is under top_p,
    # so the tokens at most that likely hold over 1 - top_p: that token's probability is above
    # (1 - top_p) / V. Sorting the tokens above half that (room for rounding) finds the same nucleus.
    least = (1.0 - top_p) / (2 * flat.shape[-1])
    for row in (kept[:, 0] == NUCLEUS_PROBE).nonzero()[:, 0].tolist():
        candidates = flat[row][flat[row] >= least].numpy()
        ordered = torch.from_numpy(-np.sort(-candidates))  # numpy's value sort: ~2x torch's, no indices
        floor[row] = _nucleus_floor(ordered[None], top_p)[0][0]
    return floor.reshape(*probs.shape[:-1], 1)


def pad_vocab(probs: torch.Tensor, width: int) -> torch.Tensor:
    """probs (..., V) widened to (..., width) with zero mass on the new ids (V <= width).

    Models pad their vocabularies differently (to a multiple of 64 or 128, say) past the tokenizer's
    ids; an id a model cannot produce has probability 0 under it, so comparing distributions of
    different widths means padding the narrower one with zeros."""
    if probs.shape[-1] == width:
        return probs
    return torch.nn.functional.pad(probs, (0, width - probs.shape[-1]))


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per distribution. probs: (..., V). Returns (...) int64.

    A generator on another device than probs (the orchestrator's CPU generator, the target's logits on
    the GPU) seeds one on probs' device from its own stream: a seeded request stays reproducible."""
    if generator is not None and not same_device(generator.device, probs.device):
        seed = torch.randint(0, 2**62, (1,), generator=generator, device=generator.device)
        generator = make_generator(int(seed), probs.device)
    flat = probs.reshape(-1, probs.shape[-1])
    if flat.device.type != "cpu":
        return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
    # On CPU by inverting the cumulative distribution: torch's CPU multinomial costs ~1 ms per
    # 49152-token row, and the draft samples each drafted token.
    cdf = flat.double().cumsum(-1)
    total = cdf[:, -1:]
    if not bool(torch.isfinite(total).all() and (total > 0).all() and (flat >= 0).all()):
        raise ValueError("probabilities must be finite, non-negative and not all zero")
    # u in [0, total), kept below it against rounding: the first entry whose cumulative mass exceeds u
    # is a token of non-zero probability, drawn with probability p / total.
    u = torch.minimum(torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64) * total,
                      torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).reshape(probs.shape[:-1])


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether two devices are one: `cuda` (a generator made for "cuda") and `cuda:0` (a tensor on the current
    device) are, where a plain comparison says they differ."""
    def key(device):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            return "cuda", torch.cuda.current_device()
        return device.type, device.index or 0

    return key(a) == key(b)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` (where the probabilities it samples live: a CUDA tensor needs a CUDA
    generator), seeded from the request's seed, or from fresh entropy when it has none."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return generator
