"""vLLM's `--speculative-config` (a JSON object) read as this launcher's draft settings, so that a vLLM command
line's speculation serves here as it is written.

| vLLM's `method` | here |
| --- | --- |
| `ngram` (`prompt_lookup_min`, `prompt_lookup_max`) | `--draft ngram` (speculative_decoding's `lookup_min_ngram`, `lookup_max_ngram`) |
| `suffix` | `--draft suffix` (prompt lookup also over earlier requests' text); its `suffix_decoding_*` tuning is vLLM's own |
| `eagle`, `eagle3`, `medusa`, `mlp_speculator` (`model`: the head's directory) | `--draft-head DIR` (the kind read from its config) |
| `draft_model` (`model`: a small LM) | `--draft PATH` |
| `mtp`, `mimo_mtp` (`model` optional) | `--draft-head DIR`: the MTP layer in DIR, by default the target's (MiMo's) |
| none, with `model` | a head where the directory's config.json is one (EAGLE's, EAGLE-3's, Medusa's, an MLP speculator's), else a draft model |

A directory in the speculators library's layout given as the model to serve (`vllm serve
RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3`) is served as vLLM serves it (`speculator`): its verifier
(`speculators_config.verifier.name_or_path`, a directory here: nothing is downloaded) as the target, the
directory as the head, K its default proposal method's `speculative_tokens`.

`num_speculative_tokens` K is `--num-draft-tokens K`: the most a round drafts; the adaptive draft length picks
each round's K up to it (vLLM drafts K every round; the output is the same either way, only the speed differs).
SGLang's speculative flags (`from_sglang`) are read the same way:

| SGLang's `--speculative-algorithm` | here |
| --- | --- |
| `EAGLE`, `EAGLE3` (`--speculative-draft-model-path` the head) | `--draft-head DIR` |
| `NEXTN` (a model's MTP layer; the path the model's own, or none) | `--draft-head DIR`, by default the target |
| `STANDALONE` (the path a small LM) | `--draft PATH` |
| `NGRAM` (its match window: `lookup_min_ngram`, `lookup_max_ngram`) | `--draft ngram` |

and its tree's shape: `--speculative-eagle-topk` 1 (or none) drafts chains of `--speculative-num-steps` tokens
(else `--speculative-num-draft-tokens` - 1); a topk B > 1 drafts trees B wide (speculative_decoding's
`draft_branches`) of `--speculative-num-draft-tokens` - 1 nodes (the verify's tokens but the root; else
num_steps x B), the adaptive draft length choosing each round's size up to that.

Keys that tune vLLM's own engine (its parallelism, batching, padding) change nothing here and are logged;
`acceptance_method` other than rejection sampling (vLLM's typical acceptance changes the output's distribution),
a method this server has no draft for (DeepSeek's and the other MoE models' MTP methods) and keys it does not
know are refused, naming them.
Pure: JSON text in, settings out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdec import tensor_names as tn

FLAG = "--speculative-config"
HEADS = ("eagle", "eagle3", "medusa", "mlp_speculator")  # draft_heads.KINDS (read here without torch)
MTP_METHODS = ("mtp", "mimo_mtp")  # a model's own MTP layer (draft_heads.MTP): vLLM's name and its older one
METHODS = (tn.NGRAM, tn.SUFFIX, *HEADS, *MTP_METHODS, "draft_model")
LEGACY_NGRAM = "[ngram]"
# vLLM's engine tuning: nothing to do here (its parallelism and batching are this server's own)
ENGINE_KEYS = ("draft_tensor_parallel_size", "disable_by_batch_size", "quantization", "max_model_len", "revision",
               "code_revision", "disable_padded_drafter_batch", "speculative_token_tree", "disable_log_stats",
               "draft_model_config", "parallel_drafting", "suffix_decoding_max_tree_depth",
               "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
               "suffix_decoding_min_token_prob")


@dataclass(frozen=True)
class Speculation:
    """What a --speculative-config asks of the launcher: `draft` (a draft model's path, ngram or suffix) or
    `head` (a trained head's directory), `mtp` (the target's own MTP layer: `head` the directory it is read from,
    None for the target's), `num_draft_tokens`, `settings` (speculative_decoding's parameters, as --set takes
    them) and `ignored` (the keys that change nothing here)."""

    draft: str | None = None
    head: str | None = None
    mtp: bool = False
    num_draft_tokens: int | None = None
    settings: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()


def read(text: str) -> Speculation:
    """--speculative-config's JSON; ValueError naming the flag and the key for what cannot be served."""
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{FLAG} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{FLAG} must be a JSON object, got {text[:60]}")
    known = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
             "acceptance_method", *ENGINE_KEYS}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"{FLAG}: {unknown[0]!r} is not a setting served here (known: {', '.join(sorted(known))})")
    if config.get("acceptance_method", "rejection_sampler") != "rejection_sampler":
        raise ValueError(f"{FLAG}: acceptance_method {config['acceptance_method']!r} is not served: rejection "
                         "sampling keeps the target's distribution exactly, and is the only rule here")
    model, method = config.get("model"), config.get("method")
    if LEGACY_NGRAM in (method, model):  # vLLM's older spelling: {"model": "[ngram]"}
        method, model = tn.NGRAM, None if model == LEGACY_NGRAM else model
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"{FLAG}: 'model' must be a path, got {json.dumps(model)}")
    if method is None:
        if model is None:
            raise ValueError(f"{FLAG}: give 'method' ({', '.join(METHODS)}) or a draft's 'model'")
        method = HEADS[0] if _is_head(model) else "draft_model"
    if method not in METHODS:
        raise ValueError(f"{FLAG}: method {method!r} is not served here (one of {', '.join(METHODS)})")
    builtin = method in tn.BUILTIN_DRAFTS
    if builtin == (model is not None) and method not in MTP_METHODS:
        raise ValueError(f"{FLAG}: method {method!r} " + ("takes no 'model'" if builtin else "needs a 'model' (its path)"))
    k = config.get("num_speculative_tokens")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ValueError(f"{FLAG}: num_speculative_tokens must be an integer >= 1, got {json.dumps(k)}")
    lookup = [config.get("prompt_lookup_min"), config.get("prompt_lookup_max")]
    for key, value in zip(("prompt_lookup_min", "prompt_lookup_max"), lookup):
        if value is not None and not builtin:
            raise ValueError(f"{FLAG}: {key} is prompt lookup's (method ngram or suffix), not {method!r}'s")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not 1 <= value <= tn.MAX_LOOKUP_NGRAM):
            raise ValueError(f"{FLAG}: {key} must be an integer within [1, {tn.MAX_LOOKUP_NGRAM}], got "
                             f"{json.dumps(value)}")
    settings = ()
    if lookup != [None, None]:  # one given: the other the same, as vLLM reads them
        shortest, longest = (lookup[0] if lookup[0] is not None else lookup[1],
                             lookup[1] if lookup[1] is not None else lookup[0])
        if shortest > longest:
            raise ValueError(f"{FLAG}: prompt_lookup_min ({shortest}) is above prompt_lookup_max ({longest})")
        settings = (f"speculative_decoding.lookup_min_ngram={shortest}",
                    f"speculative_decoding.lookup_max_ngram={longest}")
    return Speculation(draft=method if builtin else (model if method == "draft_model" else None),
                       head=model if method in (*HEADS, *MTP_METHODS) else None, mtp=method in MTP_METHODS,
                       num_draft_tokens=k, settings=settings,
                       ignored=tuple(sorted(set(config) & set(ENGINE_KEYS))))


@dataclass(frozen=True)
class Speculator:
    """A speculators-layout head served with its verifier (vLLM's `serve SPECULATOR`)."""

    target: str  # the verifier's directory
    head: str
    num_draft_tokens: int = 0  # its default proposal method's speculative_tokens; 0: none said


SGLANG_ALGORITHM = "--speculative-algorithm"
SGLANG_PATH, SGLANG_STEPS = "--speculative-draft-model-path", "--speculative-num-steps"
SGLANG_TOPK, SGLANG_TOKENS = "--speculative-eagle-topk", "--speculative-num-draft-tokens"
SGLANG_HEADS, SGLANG_MTP, SGLANG_STANDALONE, SGLANG_NGRAM = ("EAGLE", "EAGLE3"), "NEXTN", "STANDALONE", "NGRAM"
SGLANG_ALGORITHMS = (*SGLANG_HEADS, SGLANG_MTP, SGLANG_STANDALONE, SGLANG_NGRAM)
# SGLang's NGRAM: its match window, prompt lookup's shortest and longest n-gram here
SGLANG_NGRAM_WINDOW = ("--speculative-ngram-min-match-window-size", "--speculative-ngram-max-match-window-size")
# SGLang's flags that tune its engine (attention backends, revisions, FR-Spec's reduced lm_head) and the shape of
# its NGRAM trie's search (breadth, match type, branch length, capacity): taken, logged
SGLANG_ENGINE_FLAGS = ("--speculative-token-map", "--speculative-draft-model-revision", "--speculative-attention-mode",
                       "--speculative-draft-attention-backend", "--speculative-moe-runner-backend",
                       "--speculative-draft-load-format", "--speculative-ngram-min-bfs-breadth",
                       "--speculative-ngram-max-bfs-breadth", "--speculative-ngram-match-type",
                       "--speculative-ngram-branch-length", "--speculative-ngram-capacity")
# SGLang's relaxed acceptance (a token accepted with less than the target's probability): lossy unless 1.0
SGLANG_THRESHOLDS = ("--speculative-accept-threshold-single", "--speculative-accept-threshold-acc")


def from_sglang(algorithm: str, path: str | None = None, num_steps: int | None = None, topk: int | None = None,
                num_draft_tokens: int | None = None, thresholds: tuple[float | None, ...] = (),
                engine: tuple[str, ...] = (), windows: tuple[int | None, int | None] = (None, None)) -> Speculation:
    """SGLang's speculative flags as the launcher's draft settings (the table above); ValueError naming the flag
    for what cannot be served. thresholds: the accept-threshold flags' values; engine: the engine flags given;
    windows: NGRAM's min and max match window (SGLANG_NGRAM_WINDOW), None where not given."""
    name = (algorithm or "").upper()
    if name not in SGLANG_ALGORITHMS:
        raise ValueError(f"{SGLANG_ALGORITHM} {algorithm!r} is not served here (one of {', '.join(SGLANG_ALGORITHMS)})")
    if path is not None and not path:
        raise ValueError(f"{SGLANG_PATH} must be a path")
    if name in (*SGLANG_HEADS, SGLANG_STANDALONE) and path is None:
        raise ValueError(f"{SGLANG_ALGORITHM} {name} needs {SGLANG_PATH} (the draft's directory)")
    if name == SGLANG_NGRAM and path is not None:
        raise ValueError(f"{SGLANG_ALGORITHM} NGRAM takes no {SGLANG_PATH}")
    for flag, value, least in ((SGLANG_STEPS, num_steps, 1), (SGLANG_TOPK, topk, 1),
                               (SGLANG_TOKENS, num_draft_tokens, 2)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    if topk is not None and topk > tn.MAX_DRAFT_BRANCHES:
        raise ValueError(f"{SGLANG_TOPK} {topk}: trees here are at most {tn.MAX_DRAFT_BRANCHES} wide")
    for flag, value in zip(SGLANG_THRESHOLDS, thresholds):
        if value is not None and value != 1.0:
            raise ValueError(f"{flag} {value:g} is not served: a token accepted above the target's probability changes "
                             "the output's distribution; rejection sampling here keeps it exact (1.0)")
    lookup = ()
    if windows != (None, None):
        if name != SGLANG_NGRAM:
            raise ValueError(f"{SGLANG_NGRAM_WINDOW[windows[0] is None]} is NGRAM's, not {name}'s")
        for flag, value in zip(SGLANG_NGRAM_WINDOW, windows):
            if value is not None and not 1 <= value <= tn.MAX_LOOKUP_NGRAM:
                raise ValueError(f"{flag} {value}: prompt lookup here matches 1 to {tn.MAX_LOOKUP_NGRAM} tokens")
        # SGLang's defaults for the one not given (1 and 12)
        shortest = windows[0] if windows[0] is not None else 1
        longest = windows[1] if windows[1] is not None else max(12, shortest)
        if shortest > longest:
            raise ValueError(f"{SGLANG_NGRAM_WINDOW[0]} {shortest} is above {SGLANG_NGRAM_WINDOW[1]} {longest}")
        lookup = (f"speculative_decoding.lookup_min_ngram={shortest}",
                  f"speculative_decoding.lookup_max_ngram={longest}")
    branches = topk if topk is not None and topk > 1 and name != SGLANG_NGRAM else 1
    if branches > 1:  # a tree: its nodes are the verify's tokens but the root
        k = num_draft_tokens - 1 if num_draft_tokens is not None else (num_steps * branches if num_steps else None)
    else:
        k = num_steps if num_steps is not None else (num_draft_tokens - 1 if num_draft_tokens is not None else None)
    settings = ((f"speculative_decoding.draft_branches={branches}",) if branches > 1 else ()) + lookup
    return Speculation(draft=tn.NGRAM if name == SGLANG_NGRAM else (path if name == SGLANG_STANDALONE else None),
                       head=path if name in (*SGLANG_HEADS, SGLANG_MTP) else None, mtp=name == SGLANG_MTP,
                       num_draft_tokens=k, settings=settings, ignored=tuple(engine))


def speculator(path: str) -> Speculator | None:
    """`path` as vLLM reads a model directory in the speculators library's layout: its verifier and itself as
    the head (None for a directory of any other model). A verifier that is not a directory here is refused,
    naming it and what to give instead (this server downloads nothing at start)."""
    config = read_config(path)
    if config is None or config.get("speculators_model_type") not in HEADS:
        return None
    settings = config.get("speculators_config") if isinstance(config.get("speculators_config"), dict) else {}
    verifier = named_verifier(config)
    if not verifier or not Path(verifier).is_dir():
        raise ValueError(f"{path} is a draft head (the speculators library's layout) whose verifier "
                         f"{verifier or '(none named)'!r} is not a directory here: give the verifier's directory as "
                         f"the target and {path} as --draft-head (the chart: models.fetch.targetRepo the verifier, "
                         "draftRepo the head, models.draft.method head)")
    methods = [method for method in settings.get("proposal_methods") or [] if isinstance(method, dict)]
    default = settings.get("default_proposal_method")
    chosen = next((method for method in methods if method.get("proposal_type") == default),
                  methods[0] if methods else {})
    return Speculator(target=verifier, head=path, num_draft_tokens=int(chosen.get("speculative_tokens") or 0))


def named_verifier(config: dict | None) -> str:
    """The model a head in the speculators library's layout drafts for, as its config.json names it
    (speculators_config.verifier.name_or_path: a repository id or a directory); "" for any other config."""
    try:
        return str(config["speculators_config"]["verifier"]["name_or_path"] or "")
    except (KeyError, TypeError):
        return ""


def read_config(path: str | Path) -> dict | None:
    """A directory's config.json as a dict; None where it has none or it is not one."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _is_head(path: str) -> bool:
    """Whether a directory's config.json is a trained head's (EAGLE's, EAGLE-3's, Medusa's, an MLP
    speculator's), as vLLM tells them apart when no method is given."""
    config = read_config(path)
    if config is None:
        return False
    architectures = " ".join(a for a in config.get("architectures") or [] if isinstance(a, str)).lower()
    return "medusa_num_heads" in config or "draft_vocab_size" in config or "eagle" in architectures \
        or config.get("model_type") == "mlp_speculator" or "mlpspeculator" in architectures \
        or config.get("speculators_model_type") in HEADS \
        or "eagle" in Path(path).name.lower()
