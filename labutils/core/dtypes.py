"""One table of dtypes: the short name lessons show <-> the torch dtype <-> bytes per element."""
from __future__ import annotations

import torch

# name -> torch dtype. fp8 is e4m3 (the inference format); e5m2 tensors are named fp8 too. fp64 is for
# tests, whose random models decode in float64 so that no argmax tie comes from rounding.
TORCH_DTYPES: dict[str, torch.dtype] = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16,
                                        "fp16": torch.float16, "int8": torch.int8}
if hasattr(torch, "float8_e4m3fn"):
    TORCH_DTYPES["fp8"] = torch.float8_e4m3fn
BYTES: dict[str, int] = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
# Dtypes a model computes in (weights and activations); int8 and fp8 are storage formats here.
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")

_NAMES = {dt: name for name, dt in TORCH_DTYPES.items()}
if hasattr(torch, "float8_e5m2"):
    _NAMES[torch.float8_e5m2] = "fp8"


def dtype_name(dtype) -> str:
    """"fp64", "fp32", "bf16", "fp16", "fp8" or "int8" for a torch dtype or one of those names."""
    if isinstance(dtype, str) and dtype in BYTES:
        return dtype
    if isinstance(dtype, torch.dtype) and dtype in _NAMES:
        return _NAMES[dtype]
    raise ValueError(f"unknown dtype {dtype!r}; choose one of {list(BYTES)} or the matching torch dtype")


def dtype_bytes(dtype) -> int:
    """Bytes per element of a torch dtype or a dtype name."""
    return BYTES[dtype_name(dtype)]


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype for a name (or a torch dtype, returned as it is once checked)."""
    name = dtype_name(dtype)
    if name not in TORCH_DTYPES:
        raise ValueError(f"this torch ({torch.__version__}) has no {name} dtype")
    return dtype if isinstance(dtype, torch.dtype) else TORCH_DTYPES[name]


__all__ = ["BYTES", "COMPUTE_DTYPES", "TORCH_DTYPES", "dtype_bytes", "dtype_name", "torch_dtype"]
