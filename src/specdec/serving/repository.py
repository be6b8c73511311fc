"""Render `model_repository/` for a chosen pair: copy it and set the config.pbtxt parameters.

The committed configs are valid Triton configs (paths default to /models/... as in the image); this
rewrites only `parameters` values and instance groups, and adds one draft_model copy per extra draft.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from specdec import tensor_names as tn
from specdec.engine.lora_config import FIRST_LAYERS, format_adapters, parse_adapters
from specdec.serving.pairs import REPO_ROOT, PairSpec, combined_drafts

SOURCE = REPO_ROOT / "model_repository"
# A pair's own chat template, written beside preprocessing's config (the chart mounts its own there too); its
# `chat_template` parameter names it relative to the model's directory
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def set_parameter(config: str, key: str, value: str) -> str:
    """Set parameters { key: "<key>" ... } to value, adding the entry if absent."""
    pattern = re.compile(r'(parameters\s*\{\s*key:\s*"' + re.escape(key) + r'"\s*,?\s*value:\s*\{\s*string_value:\s*")[^"]*(")')
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    if pattern.search(config):
        return pattern.sub(lambda m: m.group(1) + escaped + m.group(2), config)
    return config.rstrip("\n") + f'\nparameters {{ key: "{key}", value: {{ string_value: "{escaped}" }} }}\n'


def instance_group(pair: PairSpec, role: str) -> str:
    """The instance_group line of a language model ("target" or "draft") for the pair's placement.

    One instance, never one per GPU: a sequence's KV cache lives in one instance. A spread target is
    KIND_MODEL, so Triton leaves device placement to transformers' device_map.
    """
    if pair.device == "cpu":
        return "instance_group [ { count: 1, kind: KIND_CPU } ]"
    if role == "target" and pair.spread_target:
        return "instance_group [ { count: 1, kind: KIND_MODEL } ]"
    gpu = pair.target_gpu if role == "target" else pair.draft_gpu
    return f"instance_group [ {{ count: 1, kind: KIND_GPU, gpus: [ {gpu} ] }} ]"


def orchestrator_instances(pair: PairSpec) -> int:
    """speculative_decoding processes: the pair's count, else the default for its models' device."""
    return pair.orchestrator_instances or tn.DEFAULT_ORCHESTRATOR_INSTANCES[pair.device]


def render(pair: PairSpec, dest: Path) -> Path:
    """Write the model repository for `pair` to dest (replacing it); models without weights are left out."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(SOURCE, dest, ignore=shutil.ignore_patterns("__pycache__"))

    def edit(model: str, settings: dict[str, str], instances: str | None = None) -> None:
        path = dest / model / "config.pbtxt"
        text = path.read_text()
        for key, value in settings.items():
            text = set_parameter(text, key, value)
        if instances:
            text = re.sub(r"instance_group \[.*\]", instances, text)
        path.write_text(text)

    def lm_settings(path: str, role: str) -> dict[str, str]:
        on_gpu = pair.device == "gpu"
        return {"model_path": path, "dtype": pair.dtype, "weights_dtype": pair.weights_dtype,
                "device": "cuda" if on_gpu else "cpu",
                "device_map": "auto" if on_gpu and role == "target" and pair.spread_target else "",
                "max_sequences": str(pair.max_sequences),
                "sequence_idle_timeout_s": str(pair.sequence_idle_timeout_s),
                # The static executor's shapes: K + 1 rows per verify, sequences up to the context.
                "max_num_draft_tokens": str(pair.max_num_draft_tokens),
                "max_context_tokens": str(pair.max_context_tokens), "compile": pair.compile,
                "executor": pair.executor,
                "fuse_kernels": str(pair.fuse_kernels).lower(), "fuse_mlp": str(pair.fuse_mlp).lower(),
                "attention": pair.attention,
                "prefill_graph_rows": str(pair.prefill_graph_rows),
                "torch_threads": pair.torch_threads,
                "prefix_caching": str(pair.prefix_caching).lower(), "prefix_cache_tokens": str(pair.prefix_cache_tokens),
                "kv_memory_fraction": str(pair.kv_memory_fraction_target if role == "target"
                                          else pair.kv_memory_fraction_draft)}

    tokenizer = {"tokenizer_path": pair.tokenizer_path}
    if pair.chat_template:
        (dest / "preprocessing" / CHAT_TEMPLATE_FILE).write_text(pair.chat_template, encoding="utf-8")
    edit("preprocessing", {**tokenizer, "apply_chat_template": str(pair.apply_chat_template).lower(),
                           "chat_template": CHAT_TEMPLATE_FILE if pair.chat_template else "",
                           "trust_request_chat_template": str(pair.trust_request_chat_template).lower(),
                           "chat_template_content_format": pair.chat_template_content_format})
    edit("postprocessing", tokenizer)
    # target_model serves the features every head reads (draft_heads.served_layers); each head knows the list
    heads = ",".join([*pair.draft_heads.values(), *pair.hosted_heads.values()])
    adapters = format_adapters(pair.lora_adapters)  # target_model runs them, the orchestrator admits their names
    head_weights = (pair.cpu_head_weights_dtype if pair.device == "cpu" and pair.dtype == "float32"
                    and pair.cpu_head_weights_dtype != "same" else pair.weights_dtype)
    # heads hosted in target_model's process (one call a round), and heads served as draft models of their own
    hosted, called_heads = pair.hosted_heads, pair.draft_heads
    edit("target_model", {**lm_settings(pair.target_path, "target"), "draft_heads": heads, "run_ahead": pair.run_ahead,
                          "hosted_heads": ",".join(f"{name}={path}" for name, path in hosted.items()),
                          "hosted_head_weights_dtype": head_weights,
                          "lora_adapters": adapters, "lora_directory": pair.lora_directory,
                          "max_loras": str(pair.max_loras), "max_lora_rank": str(pair.max_lora_rank)},
         instance_group(pair, "target"))
    drafts = list(pair.draft_paths.items())
    for name, _ in drafts[1:] + list(called_heads.items()) + list(pair.skip_drafts.items()):
        if name == "draft_model":
            continue
        shutil.copytree(dest / "draft_model", dest / name)
        cfg = dest / name / "config.pbtxt"
        cfg.write_text(cfg.read_text().replace('name: "draft_model"', f'name: "{name}"'))
    if not drafts and "draft_model" not in {**called_heads, **pair.skip_drafts}:  # no draft model of its own
        shutil.rmtree(dest / "draft_model")
    # A draft made of the target's layers may run a request's adapter too (its lora_layers; "" : not)
    lora = {"lora_adapters": adapters, "lora_directory": pair.lora_directory, "max_loras": str(pair.max_loras),
            "max_lora_rank": str(pair.max_lora_rank)}
    for name, path in drafts:
        edit(name, {**lm_settings(path, "draft"), "target_tokenizer_path": pair.tokenizer_path,
                    "lora_layers": pair.draft_lora_layers.get(name, ""), **lora}, instance_group(pair, "draft"))
    for name, path in called_heads.items():
        edit(name, {**lm_settings(path, "draft"), "draft_kind": "head", "target_path": pair.target_path,
                    "weights_dtype": head_weights,
                    "target_draft_heads": heads, "target_tokenizer_path": pair.tokenizer_path},
             instance_group(pair, "draft"))
    for name, layers in pair.skip_drafts.items():  # the target's own weights, some layers left out
        edit(name, {**lm_settings(pair.target_path, "draft"), "draft_kind": "skip", "skip_layers": layers,
                    "target_tokenizer_path": pair.tokenizer_path,
                    "lora_layers": FIRST_LAYERS if name in pair.draft_lora_layers else "", **lora},
             instance_group(pair, "draft"))
    draft_models = ([name for name, _ in drafts] + list(pair.draft_heads) + list(hosted) + list(pair.skip_drafts)
                    + list(pair.builtin_drafts) + combined_drafts(pair))
    if pair.default_draft:  # the first entry is the default
        draft_models.remove(pair.default_draft)
        draft_models.insert(0, pair.default_draft)
    edit("speculative_decoding", {
        **tokenizer, "generation_config": pair.generation_config or pair.target_path,
        "draft_models": ",".join(draft_models), "head_drafts": ",".join(called_heads),
        "hosted_drafts": ",".join(hosted),
        "adaptive_draft": str(pair.adaptive_draft).lower(),
        "default_num_draft_tokens": str(pair.default_num_draft_tokens),
        "max_num_draft_tokens": str(pair.max_num_draft_tokens),
        "default_max_tokens": str(pair.default_max_tokens), "max_max_tokens": str(pair.max_max_tokens),
        "max_context_tokens": str(pair.max_context_tokens),
        "max_live_sequences": str(pair.max_live_sequences), "when_full": pair.when_full, "lora_adapters": adapters,
        "lora_directory": pair.lora_directory},
        f"instance_group [ {{ count: {orchestrator_instances(pair)}, kind: KIND_CPU }} ]")
    for model, settings in pair.model_parameters.items():
        edit(model, settings)
    return dest


BATCHER_DELAY = "max_queue_delay_microseconds"


def override(repo: Path, setting: str) -> None:
    """Apply "MODEL.PARAMETER=VALUE" to a rendered repository's config.pbtxt. MODEL.max_queue_delay_microseconds
    sets the sequence batcher's delay (a config field, not a parameter): how long a forward waits for more
    sequences."""
    target, sep, value = setting.partition("=")
    model, dot, key = target.partition(".")
    path = repo / model / "config.pbtxt"
    if not (sep and dot and key) or not path.exists():
        raise ValueError(f"--set wants MODEL.PARAMETER=VALUE with a model of {repo}, got {setting!r}")
    text = path.read_text()
    if key == BATCHER_DELAY:
        if not value.isdigit() or BATCHER_DELAY not in text:
            raise ValueError(f"--set {setting!r}: {model} has no sequence batcher delay, or {value!r} is not "
                             f"a whole number of microseconds")
        path.write_text(re.sub(BATCHER_DELAY + r":\s*\d+", f"{BATCHER_DELAY}: {value}", text))
        return
    path.write_text(set_parameter(text, key, value))


def served_adapters(repo: Path) -> tuple[list[str], str]:
    """The names of the LoRA adapters a rendered repository's orchestrator admits (its lora_adapters), and the
    directory it admits more from (its lora_directory; "": none)."""
    try:
        config = (repo / "speculative_decoding" / "config.pbtxt").read_text()
    except OSError:
        return [], ""
    found = {key: re.search(rf'key: "{key}", value: \{{ string_value: "([^"]*)" \}}', config)
             for key in ("lora_adapters", "lora_directory")}
    directory = found["lora_directory"].group(1) if found["lora_directory"] else ""
    try:
        return list(parse_adapters(found["lora_adapters"].group(1) if found["lora_adapters"] else "",
                                   "lora_adapters")), directory
    except ValueError:
        return [], directory  # the orchestrator refuses it at load, naming it
