"""Read a .safetensors file into torch tensors with nothing but the standard library and torch.

The format is small enough to read by hand: 8 bytes (little-endian uint64) give the length N of a
JSON header; the header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]},
offsets counted from the first byte after the header; then come the raw little-endian bytes.
"""
from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
for _st, _torch in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _torch):
        DTYPES[_st] = getattr(torch, _torch)


def read_safetensors_header(path: str | Path) -> tuple[dict, int]:
    """The JSON header (tensor name -> dtype, shape, data_offsets) and where the data starts."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > path.stat().st_size - 8:
            raise ValueError(f"{path}: header length {n} runs past the end of the file; is it a safetensors file?")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)   # free-form strings, not a tensor
    return header, 8 + n


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor in the file, on CPU, in its stored dtype."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors stores little-endian bytes; this reader assumes a little-endian machine")
    path = Path(path)
    header, start = read_safetensors_header(path)
    tensors = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            if info["dtype"] not in DTYPES:
                raise ValueError(f"tensor {name!r} in {path} has dtype {info['dtype']}, "
                                 f"which this reader does not know; known: {list(DTYPES)}")
            dtype, shape = DTYPES[info["dtype"]], tuple(info["shape"])
            begin, end = info["data_offsets"]
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"tensor {name!r} in {path}: {end - begin} bytes do not fit shape {shape} "
                                 f"of {info['dtype']}; the file is damaged")
            if end == begin:
                tensors[name] = torch.empty(shape, dtype=dtype)
                continue
            f.seek(start + begin)
            # A bytearray is writable, so the tensor owns ordinary memory (no read-only warning).
            buf = bytearray(f.read(end - begin))
            if len(buf) != end - begin:
                raise ValueError(f"tensor {name!r} in {path}: the file ends early; it is truncated")
            tensors[name] = torch.frombuffer(buf, dtype=dtype).reshape(shape)
    return tensors
