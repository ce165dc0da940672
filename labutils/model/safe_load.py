"""Read model files without trusting them: JSON configs, .safetensors and .bin weights, inside one folder.

A checkpoint folder is data from somewhere else. What it can do to us is limited here:
- every error names the file, so a damaged download is quick to find;
- a shard index may only name files inside the model folder (no "../", no absolute paths);
- two tensors may not share bytes (the safetensors package refuses that too; we check first, so the
  message names both tensors);
- a .bin (a pickle) is read with torch.load(weights_only=True), so only tensors come out of it,
  and a refusal never suggests turning that off: unpickling anything else can run arbitrary code;
- NaN or infinite weights load, since a lesson may want to look at them, but with a warning naming
  each tensor, because every logit computed from them is garbage.
"""
from __future__ import annotations

import json
import re
import struct
import warnings
import zipfile
from pathlib import Path, PurePosixPath

import torch

from labutils.core.validate import check_path, describe

# The safetensors package refuses headers above 100 MB; so do we, before reading one into memory.
MAX_HEADER_BYTES = 100_000_000
SHARD_INDEX = "model.safetensors.index.json"


def read_json(path: str | Path, what: str = "a JSON object") -> dict:
    """A JSON object from a file; a missing, unreadable or malformed file raises an error naming it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); it should hold {what}. "
                         "Re-save or re-download the file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not {what}; re-save or re-download it")
    return data


def _check_byte_ranges(path: Path) -> None:
    """Refuse a safetensors header whose tensors overlap, naming both tensors and the file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file ({len(raw)} bytes); re-download it")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER_BYTES, path.stat().st_size - 8):
            raise ValueError(f"{path}: header length {n} runs past the end of the file or above "
                             f"{MAX_HEADER_BYTES:,} bytes; it is not a safetensors file, or it is damaged")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: the safetensors header is not valid JSON ({err}); the file is damaged") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object; the file is damaged")
    ranges = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise ValueError(f"{path}: tensor {name!r} has no valid data_offsets [begin, end]; the file is damaged")
        ranges.append((offsets[0], offsets[1], name))
    ranges.sort()
    data_bytes = path.stat().st_size - 8 - n
    for begin, end, name in ranges:
        if not 0 <= begin <= end <= data_bytes:
            raise ValueError(f"{path}: tensor {name!r} claims bytes {begin}-{end}, but the file holds {data_bytes} "
                             "bytes of data; it is truncated or damaged. Get the checkpoint again from its source")
    for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise ValueError(f"{path}: tensors {n0!r} (bytes {b0}-{e0}) and {n1!r} (bytes {b1}-{e1}) share "
                             "bytes; a safetensors file stores each tensor once. The file is damaged or was "
                             "crafted; get the checkpoint again from its source")


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor in one .safetensors file, on the CPU, in its stored dtype (via the safetensors package)."""
    from safetensors import SafetensorError, safe_open
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    _check_byte_ranges(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, TypeError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"{path} is not a valid safetensors file ({first}); it is damaged or truncated: "
                         "get the checkpoint again from its source") from None


def inside(folder: Path, path: Path) -> Path:
    """`path` itself, once its real location (symlinks followed) is known to lie inside `folder`'s; else refused.

    A link named model.safetensors can point anywhere on the disk; the name alone proves nothing.
    """
    real, home = path.resolve(), folder.resolve()
    if real != home and home not in real.parents:
        raise ValueError(f"{path} is a link to {real}, which lies outside {home}; a checkpoint's weights must sit "
                         "in its own folder. Copy the file into the folder in place of the link (Hugging Face's hub "
                         "cache links snapshot files to its blobs folder: load from a save_pretrained folder instead)")
    return path


def weights_file(folder: Path, name) -> Path:
    """`name` (from a shard index) as a path inside `folder`; a name that leads anywhere else is refused."""
    index = folder / SHARD_INDEX
    if not isinstance(name, str) or not name or "\0" in name:
        raise ValueError(f"{index} names a shard {name!r}; shard names are file names such as "
                         "'model-00001-of-00002.safetensors' (the index is damaged or was crafted)")
    parts = PurePosixPath(name.replace("\\", "/"))
    if parts.is_absolute() or ".." in parts.parts or re.match(r"^[A-Za-z]:", name):
        raise ValueError(f"{index} names the shard {name!r}, which lies outside {folder}; a checkpoint's "
                         "weights must sit in its own folder. Move the shards there and fix the index")
    return inside(folder, folder / parts)


def torch_load(path: str | Path) -> object:
    """torch.load(path, weights_only=True) on the CPU, with a refusal that names the file and never advises
    weights_only=False."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except Exception as err:          # torch raises UnpicklingError, RuntimeError, EOFError ... for bad files
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
        if found:
            why = f"it holds a Python object ({found.group(1)}), not only tensors"
        elif not zipfile.is_zipfile(path):
            why = "it is not a file torch.save wrote (damaged, truncated or another format)"
        else:
            why = f"torch could not read it ({type(err).__name__})"
        raise ValueError(f"{path} cannot be loaded safely: {why}. labutils reads weights with "
                         "weights_only=True, because unpickling anything but tensors can run arbitrary code. "
                         "Ask for a .safetensors copy of this checkpoint, or re-save its state_dict from a "
                         "program you trust") from None


def tensor_dict(path: Path, data) -> dict[str, torch.Tensor]:
    """The state_dict inside a loaded .bin/.pt: a dict of name -> tensor, or a clear error."""
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a state_dict (a dict of tensors)")
    bad = [k for k, v in data.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(f"{path}: entry {bad[0]!r} is a {type(data[bad[0]]).__name__}, not a tensor; "
                         "a state_dict maps names to tensors")
    return data


def warn_nonfinite(tensors: dict[str, torch.Tensor], source) -> None:
    """Warn once per tensor that holds NaN or infinity, naming it: logits computed from it are garbage.

    An entry that is not a tensor (a damaged or hand-made state_dict) is refused, naming it."""
    if not isinstance(tensors, dict):
        raise ValueError(f"{source} holds a {type(tensors).__name__}, not a state_dict (a dict of name -> tensor)")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{source}: entry {name!r} is {describe(t)}, not a tensor; a state_dict maps names to "
                             "tensors. The file is damaged or was not saved from model.state_dict()")
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            n_bad = int((~torch.isfinite(t)).sum())
            warnings.warn(f"tensor {name!r} in {source} holds {n_bad:,} NaN or infinite value(s) out of "
                          f"{t.numel():,}; logits computed from it will be NaN. The checkpoint is damaged "
                          "or was saved after training diverged", RuntimeWarning, stacklevel=3)


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved Hugging Face model: model.safetensors, its sharded form, or pytorch_model.bin."""
    folder = check_path("folder", folder)
    if (folder / "model.safetensors").exists():
        tensors = read_safetensors(inside(folder, folder / "model.safetensors"))
    elif (folder / SHARD_INDEX).exists():
        weight_map = read_json(folder / SHARD_INDEX, "a shard index with a 'weight_map'").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{folder / SHARD_INDEX} has no 'weight_map' of tensor name -> shard file")
        shards = []                      # in first-mention order; values may be anything, so no set()
        for shard in weight_map.values():
            if shard not in shards:
                shards.append(shard)
        tensors = {}
        for shard in shards:
            tensors.update(read_safetensors(weights_file(folder, shard)))
    elif (folder / "pytorch_model.bin").exists():
        tensors = tensor_dict(folder / "pytorch_model.bin", torch_load(inside(folder, folder / "pytorch_model.bin")))
    else:
        raise FileNotFoundError(f"{folder} has no model.safetensors or pytorch_model.bin; "
                                "save one with GPT2LMHeadModel.save_pretrained(path)")
    warn_nonfinite(tensors, folder)
    return tensors


__all__ = ["MAX_HEADER_BYTES", "inside", "read_json", "read_safetensors", "read_weights", "tensor_dict", "torch_load",
           "warn_nonfinite", "weights_file"]
