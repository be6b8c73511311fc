"""Loading a causal LM for the executor: a Hugging Face directory or a single GGUF file, on a device, in
a dtype, with CPU linear layers reordered for oneDNN where that pays."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec import tensor_names as tn
from specdec.engine import onednn_linear

DTYPES = {name: getattr(torch, name) for name in tn.DTYPE_NAMES}


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
