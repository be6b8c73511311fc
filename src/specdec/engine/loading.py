"""Loading a causal LM for the executor: a Hugging Face directory or a single GGUF file, on a device, in
a dtype, with CPU linear layers reordered for oneDNN where that pays, or FP8 weights where asked."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec import tensor_names as tn
from specdec.engine import fp8_linear, onednn_linear

DTYPES = {name: getattr(torch, name) for name in tn.DTYPE_NAMES}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_causal_lm(model_path: str, device: str = "cpu", dtype: str = "float32", device_map: str = "",
                   linear_kernels: str = "auto", weights_dtype: str = "same", log=None):
    """Load a causal LM from a Hugging Face directory or a single GGUF file.

    device_map (e.g. "auto") spreads a model too large for one GPU over the visible GPUs.
    linear_kernels: "auto" reorders the linear weights for oneDNN on CPU in float32/bfloat16
    (`onednn_linear.py`: 1.3-2x faster steps there), "onednn" requires it, "torch" keeps torch's own.
    weights_dtype: "same" keeps the linears' weights in `dtype`; "fp8" stores them in FP8 with a scale per
    output channel (`fp8_linear.py`; the vocabulary head stays in `dtype`); `log` gets a line saying how.
    """
    from transformers import AutoModelForCausalLM

    if weights_dtype not in tn.WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype must be one of {tn.WEIGHTS_DTYPES}, got {weights_dtype!r}")
    if weights_dtype == "fp8" and linear_kernels == "onednn":
        raise ValueError("weights_dtype=fp8 and linear_kernels=onednn exclude each other (oneDNN's reordered "
                         "weights are float32/bfloat16)")
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
    if weights_dtype == "fp8":
        replaced, why_not = fp8_linear.quantize_linears(model)
        if log is not None:
            log(f"{model_path}: {replaced} linear layers in FP8 (a scale per output channel), products "
                + ("of up to 16 rows in the FP8 kernel" if why_not is None else f"dequantized ({why_not})"))
    elif onednn_linear.resolve(linear_kernels, model.device, model.dtype):
        onednn_linear.prepack_linears(model)
    return model
