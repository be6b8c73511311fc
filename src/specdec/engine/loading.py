"""Loading a causal LM for the executor: a Hugging Face directory or a single GGUF file, on a device, in
a dtype, with CPU linear layers reordered for oneDNN where that times faster, or FP8 weights where asked or where
the checkpoint holds them (compressed-tensors, ModelOpt and AutoFP8 layouts, loaded as they are)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec import tensor_names as tn
from specdec.engine import fp8_linear, llama_forward, llama_model, onednn_linear

DTYPES = {name: getattr(torch, name) for name in tn.DTYPE_NAMES}
# config.json's quantization_config.quant_method of the FP8 checkpoints loaded here: llm-compressor's
# compressed-tensors ("float-quantized"), NVIDIA ModelOpt's, AutoFP8's / vLLM's "fp8"
FP8_CHECKPOINTS = ("compressed-tensors", "modelopt", "fp8")
# a quantized linear's tensors beside its weight: the weight's scale is used; activation scales are not
# (activations stay in the model's dtype)
SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".weight_zero_point", ".input_zero_point")


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_causal_lm(model_path: str, device: str = "cpu", dtype: str = "float32", device_map: str = "",
                   linear_kernels: str = "auto", weights_dtype: str = "same", log=None, own_modules: bool = False):
    """Load a causal LM from a Hugging Face directory or a single GGUF file.

    own_modules: build a Llama-family directory's modules here (`llama_model.py`: for the static executor,
    whose forward is this project's own) without importing transformers' modeling stack; a model that
    module does not build (`llama_model.unsupported`) loads through transformers all the same.

    device_map (e.g. "auto") spreads a model too large for one GPU over the visible GPUs.
    linear_kernels: "auto" puts the linear layers on the panel kernel (float32) or oneDNN's reordered
    weights on CPU where that times faster at load on this machine (`onednn_linear.choose`), "onednn" and
    "panels" require theirs, "torch" keeps torch's own.
    weights_dtype: "same" keeps the linears' weights in `dtype`; "fp8" stores them in FP8 with a scale per
    output channel (`fp8_linear.py`; the vocabulary head stays in `dtype`); "q8" rounds them to 8-bit
    blocks for the CPU's panel kernel (`quantize_q8`); `log` gets a line saying how.
    """
    if weights_dtype not in tn.WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype must be one of {tn.WEIGHTS_DTYPES}, got {weights_dtype!r}")
    if weights_dtype == "fp8" and linear_kernels in ("onednn", "panels"):
        raise ValueError(f"weights_dtype=fp8 and linear_kernels={linear_kernels} exclude each other (its "
                         "weights are float32/bfloat16)")
    if weights_dtype == "q8":
        check_q8(device, dtype, linear_kernels)
    path = Path(model_path)
    if not path.exists():
        raise FileNotFoundError(f"model_path {model_path!r} does not exist")
    torch_dtype = resolve_dtype(dtype)
    method = fp8_checkpoint(path)
    kwargs = {"dtype": torch_dtype}
    if device_map:
        kwargs["device_map"] = device_map
    own = own_modules and not device_map and method is None and llama_model.unsupported(path) is None
    if own:
        model = llama_model.load(path, torch_dtype)
    elif path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model_path {model_path!r} is a file but not a .gguf file")
        model = load_gguf(path, kwargs)
    else:
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model_path {model_path!r} has no config.json (not a Hugging Face model directory)")
        if method is not None:
            if device_map:
                raise ValueError(f"model_path {model_path!r}: an FP8 checkpoint ({method}) is loaded on one device "
                                 "(no device_map)")
            model = load_fp8_checkpoint(path, method, torch_dtype)
        else:
            model = _transformers_model(path, kwargs)
    if not device_map:
        model.to(torch.device(device))
    model.eval()
    if weights_dtype == "fp8" or method is not None:
        replaced, why_not = fp8_linear.quantize_linears(model) if weights_dtype == "fp8" else \
            (0, fp8_linear.use_kernel(model))
        if log is not None:
            held = sum(isinstance(m, fp8_linear.Fp8Linear) for m in model.modules())
            log(f"{model_path}: {held} linear layers in FP8 ({held - replaced} as the checkpoint stores them, "
                f"{replaced} quantized at load with a scale per output channel), products "
                + (f"of up to {fp8_linear.KERNEL_ROWS} rows in the FP8 kernel (launch "
                   f"{','.join(map(str, fp8_linear.kernel_config()))})" if why_not is None
                   else f"dequantized ({why_not})"))
    if weights_dtype == "q8":
        quantize_q8(model, model_path, log)
    if weights_dtype != "fp8":  # the linears left dense (all but an FP8 checkpoint's)
        onednn_linear.apply(q8_kernels(linear_kernels, weights_dtype), model, model_path, log)
    return model


def _transformers_model(path: Path, kwargs: dict):
    """A Hugging Face directory through transformers' classes. MiMo's are remote code (its repository's Python,
    which this server does not run): its model is Qwen2's, read as that, its MTP layers left to its draft."""
    from transformers import AutoModelForCausalLM

    raw = json.loads((path / "config.json").read_text())
    if raw.get("model_type") == llama_forward.MIMO:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(**{key: value for key, value in raw.items()
                                if key not in ("model_type", "architectures", "auto_map")})
        return Qwen2ForCausalLM.from_pretrained(str(path), config=config, **kwargs)
    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)


def load_gguf(path: Path, kwargs: dict):
    """A GGUF file's model: a Llama-architecture one read by gguf_checkpoint (one parse, no random
    initialisation: a third of the time), any other (or one spread by a device_map) through transformers' GGUF
    loader. Both give the same weights bit for bit."""
    from specdec.engine import gguf_checkpoint

    if "device_map" not in kwargs:
        try:
            config, weights = gguf_checkpoint.read(path)
        except gguf_checkpoint.UnsupportedGGUF:
            pass
        else:
            from transformers import LlamaForCausalLM

            return LlamaForCausalLM.from_pretrained(None, config=gguf_checkpoint.llama_config(config),
                                                    state_dict=weights, **kwargs)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)


def check_q8(device: str, dtype: str, linear_kernels: str) -> None:
    """weights_dtype=q8 is for the CPU's panel kernel: float32 on a CPU, linear_kernels auto or panels."""
    if torch.device(device).type != "cpu" or dtype != "float32" or linear_kernels not in ("auto", "panels"):
        raise ValueError(f"weights_dtype=q8 rounds the weights for the CPU's panel kernel: it needs device cpu, "
                         f"dtype float32 and linear_kernels auto or panels, got {device}, {dtype}, {linear_kernels}")


def q8_kernels(linear_kernels: str, weights_dtype: str) -> str:
    """The linear_kernels setting a model's weights_dtype leaves: q8's 8-bit blocks are for the panel kernel,
    the one kernel that streams them as codes (torch's and oneDNN's would stream them widened back to
    float32, four times the bytes), so `auto` takes it untimed where it builds. Timed beside the other
    stubs loading, the default pair's q8 head went to torch's kernels in some starts and drafted at half
    speed (docs/results/2026-11-30-head-kernel-choice.md)."""
    from specdec.engine import panel_linear

    if weights_dtype == "q8" and linear_kernels == "auto" and \
            panel_linear.available(torch.device("cpu"), torch.float32) is None:
        return "panels"
    return linear_kernels


def quantize_q8(model: torch.nn.Module, model_path: str, log=None) -> int:
    """Round the model's linear weights to 8-bit blocks in place (panel_linear.round_q8): lossy, as FP8
    is; speculation stays exact with respect to the model so served. Returns how many."""
    from specdec.engine import panel_linear

    rounded = panel_linear.quantize_linears(model)
    if log is not None:
        log(f"{model_path}: {rounded} linear layers rounded to 8-bit blocks (weights_dtype q8: a scale per 32 "
            "inputs, GGUF's Q8_0)")
    return rounded


def fp8_checkpoint(path: Path) -> str | None:
    """The quant_method of a model directory's FP8 checkpoint (FP8_CHECKPOINTS), else None."""
    config = path / "config.json" if path.is_dir() else None
    if config is None or not config.exists():
        return None
    method = (json.loads(config.read_text()).get("quantization_config") or {}).get("quant_method")
    return method if method in FP8_CHECKPOINTS else None


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        if not (path / name).exists():
            raise FileNotFoundError(f"{path}: the FP8 checkpoint's {name} is missing (safetensors files only)")
        tensors.update(load_file(str(path / name)))
    return tensors


@torch.no_grad()
def load_fp8_checkpoint(path: Path, method: str, dtype: torch.dtype):
    """The model of an FP8 checkpoint (`method`: its quant_method), its FP8 linears (a weight in float8_e4m3fn and its
    weight_scale) as Fp8Linear layers holding them as stored, every other tensor in `dtype`. Activation
    scales (input_scale) are not used. A linear the checkpoint keeps dense (lm_head, usually) stays so."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # loaded here, not by a quantizer of transformers'
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = _checkpoint_tensors(path)
    quantized = {key[:-len(".weight")] for key, value in tensors.items()
                 if key.endswith(".weight") and value.dtype == fp8_linear.FP8}
    dense = {key: value.to(dtype) if value.is_floating_point() else value for key, value in tensors.items()
             if key[:-len(".weight")] not in quantized and not key.endswith(SCALE_SUFFIXES)}
    missing, unexpected = model.load_state_dict(dense, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [key for key in missing if key[:-len(".weight")] not in quantized and key not in tied]
    if missing or unexpected:
        raise ValueError(f"{path}: the FP8 checkpoint ({method}) does not fit its config: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    for name in sorted(quantized):
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        linear = getattr(owner, child, None)
        if type(linear) is not torch.nn.Linear:
            raise ValueError(f"{path}: {name} holds an FP8 weight but is not a linear layer of the model")
        scale = tensors.get(name + ".weight_scale")
        if scale is None:
            raise ValueError(f"{path}: {name}.weight is FP8 without a weight_scale")
        try:
            setattr(owner, child, fp8_linear.Fp8Linear.from_checkpoint(linear, tensors[name + ".weight"], scale))
        except ValueError as exc:
            raise ValueError(f"{path}: {name}: {exc}") from None
    if tied:
        model.tie_weights()
    return model
