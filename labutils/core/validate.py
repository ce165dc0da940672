"""Argument checks shared by every public function, so one kind of value has one rule and one message.

Every message names the argument, shows the value, says what is allowed and how to get there.
The rules, one per kind of value:
- a count (tokens, batch, layers, positions) is an integer: Python int or numpy integer, never a
  bool and never a float, even 8.0 (n / 2 is a float; n // 2 is the count). It comes back as int.
- a number (seconds, bytes/s, probabilities) is a real number, never a bool, never NaN; infinity
  only where it means something. It comes back as float.
- a flag is True or False (numpy bools too); "no" is not False.
- a choice (dtype, preset, device, phase) is one of a listed set of names.
"""
from __future__ import annotations

import math
import numbers
import os
from pathlib import Path

import numpy as np
import torch

from labutils.core import dtypes, fake_cuda

_MAX_REPR = 80


def describe(value) -> str:
    """The value as a message shows it: its type and a repr cut to a readable length."""
    text = repr(value)
    if len(text) > _MAX_REPR:
        text = text[:_MAX_REPR - 3] + "..."
    return f"{type(value).__name__} {text}"


def _shown(value) -> str:
    """A name as it was typed ('fp8'), anything else with its type (NoneType None)."""
    return repr(value) if isinstance(value, str) else describe(value)


_BOOLS = (bool, np.bool_)


def _is_integer(value) -> bool:
    # bool is an int subclass, but True tokens is a typo, not 1.
    return isinstance(value, numbers.Integral) and not isinstance(value, _BOOLS)


def check_count(name: str, value, minimum: int = 0, maximum: int | None = None, hint: str = "") -> int:
    """An integer count in [minimum, maximum]; returns it as a Python int.

    `hint` adds the way out for a value out of range (e.g. "shorten the prompt").
    """
    if not _is_integer(value):
        way_out = "pass a whole number"
        if isinstance(value, float) and math.isfinite(value) and value == int(value):
            way_out = f"pass int({value!r})"
        elif isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
            way_out = "pass a whole number (use // for integer division, or round())"
        raise TypeError(f"{name} must be an int, got {describe(value)}; {way_out}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}; {hint or f'pass a value of at least {minimum}'}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}; {hint or f'pass a value of at most {maximum}'}")
    return value


def check_number(name: str, value, *, minimum: float | None = None, above: float | None = None,
                 maximum: float | None = None, below: float | None = None, allow_inf: bool = False,
                 hint: str = "") -> float:
    """A real number (no bool, no NaN; infinity only with allow_inf) within the given bounds; returns a float.

    `minimum` and `maximum` are inclusive, `above` and `below` exclusive.
    """
    if not isinstance(value, numbers.Real) or isinstance(value, _BOOLS):
        raise TypeError(f"{name} must be a number, got {describe(value)}; pass an int or a float")
    value = float(value)
    allowed = _range_text(minimum, above, maximum, below, allow_inf)
    way_out = f"; {hint}" if hint else ""
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be {allowed}, got {value}{way_out or '; pass a finite number'}")
    if ((minimum is not None and value < minimum) or (above is not None and value <= above)
            or (maximum is not None and value > maximum) or (below is not None and value >= below)):
        raise ValueError(f"{name} must be {allowed}, got {value!r}{way_out}")
    return value


def _range_text(minimum, above, maximum, below, allow_inf) -> str:
    parts = []
    if minimum is not None:
        parts.append(f">= {minimum:g}")
    if above is not None:
        parts.append(f"> {above:g}")
    if maximum is not None:
        parts.append(f"<= {maximum:g}")
    if below is not None:
        parts.append(f"< {below:g}")
    kind = "a number" if allow_inf else "a finite number"
    return kind + (" " + " and ".join(parts) if parts else "")


def check_positive(name: str, value) -> float:
    """A finite number > 0 (a time, a bandwidth, a peak FLOP/s)."""
    return check_number(name, value, above=0)


def check_probability(name: str, value) -> float:
    """A probability mass in (0, 1], as top_p is."""
    return check_number(name, value, above=0, maximum=1,
                        hint="e.g. 0.9 keeps the most likely tokens that cover 90% of the mass")


def check_temperature(value) -> float:
    """A sampling temperature: 0 (greedy) or a finite number > 0. Infinity would flatten every logit."""
    return check_number("temperature", value, minimum=0,
                        hint="0 means greedy; 1 samples the model's own distribution")


def check_seed(value, name: str = "seed") -> int:
    """A random seed: a whole number in [0, 2**63), what torch.Generator.manual_seed takes."""
    return check_count(name, value, 0, 2 ** 63 - 1,
                       hint="any whole number >= 0 picks a reproducible stream; None picks none")


def check_path(name: str, value) -> Path:
    """A file or folder name: a non-empty str or os.PathLike with no NUL byte; returns a Path. "" would mean the current
    folder, which no caller means."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (a str or pathlib.Path), got {describe(value)}")
    text = os.fspath(value)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{name} is empty; name the file or folder, such as 'out/model'")
    if "\0" in text:
        raise ValueError(f"{name} {text!r} holds a NUL byte, which no file name can")
    return Path(text)


def check_flag(name: str, value) -> bool:
    """True or False; a string such as "no" is refused rather than read as True."""
    if not isinstance(value, _BOOLS):
        raise TypeError(f"{name} must be True or False, got {describe(value)}")
    return bool(value)


def check_choice(name: str, value, choices, hint: str = ""):
    """One of `choices` (compared by type and value, so 1 never matches "1" and unhashable values are fine)."""
    choices = list(choices)
    # Same kind and equal: a str subclass (numpy's str_) matches its name, 1 never matches "1" or True.
    same = [c for c in choices
            if (isinstance(value, str) and isinstance(c, str) or type(value) is type(c)) and value == c]
    if not same:
        raise ValueError(f"unknown {name} {_shown(value)}; choose one of {choices}" + (f"; {hint}" if hint else ""))
    return same[0]


def check_dtype(name: str, value, allowed=None) -> str:
    """A dtype name or torch dtype from the one table (labutils.core.dtypes); returns its name ("fp32", ...).

    `allowed` narrows the names, e.g. dtypes.COMPUTE_DTYPES for what a model computes in.
    """
    try:
        dtype_name = dtypes.dtype_name(value)
    except ValueError:
        known = list(allowed if allowed is not None else dtypes.BYTES)
        raise ValueError(f"unknown {name} {_shown(value)}; "
                         f"choose one of {known} or the matching torch dtype") from None
    if allowed is not None and dtype_name not in allowed:
        why = " (a storage format here, not one a model computes in)" if dtype_name not in dtypes.COMPUTE_DTYPES else ""
        raise ValueError(f"{name} {dtype_name!r} is not offered here{why}; choose one of {list(allowed)}")
    return dtype_name


def parse_dtype(name: str, value, allowed=None) -> torch.dtype:
    """The one dtype parse: a name ("bf16"), a numpy string or a torch dtype from the table (narrowed by `allowed`),
    or any other floating torch dtype when nothing narrows it; returns the canonical torch.dtype.

    Public functions call it once, where a learner's value comes in; what they call next takes the torch.dtype as
    it is. A torch dtype that is canonical already (any float, or int8/fp8 from the table) passes straight through
    when nothing narrows it, so a function that receives one from another does not check it again. check_dtype's
    rules and messages are this function's.
    """
    if (allowed is None and isinstance(value, torch.dtype)
            and (value.is_floating_point or value in dtypes.TORCH_DTYPES.values())):
        return value
    return dtypes.torch_dtype(check_dtype(name, value, allowed))


DEVICE_KINDS = ("cpu", "cuda", "mps")


class DeviceUnavailableError(ValueError, RuntimeError):
    """A device this machine does not have. A ValueError (a bad argument) and, for older callers, a RuntimeError."""


class DoesNotFitError(ValueError, MemoryError):
    """A setting this machine's memory cannot hold: a ValueError (change the setting) and a MemoryError."""


def device_available(kind: str) -> bool:
    """Whether this machine and this build of torch can run on a device kind ("cpu", "cuda", "mps").

    Inside labutils.core.fake_cuda.fake_cuda() CUDA is pretended (tensors there have no values), and only there.
    """
    if kind == "cuda":
        return torch.cuda.is_available() or fake_cuda.active()
    if kind == "mps":
        return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    return kind == "cpu"


def _kinds_text(kinds) -> str:
    best_first = sorted(kinds, key=lambda k: ("cuda", "mps", "cpu", "meta").index(k))   # as pick_device tries them
    return ", ".join(best_first[:-1]) + f" or {best_first[-1]}"


def check_device(name: str, value, kinds=DEVICE_KINDS, *, here: bool = True) -> torch.device:
    """A device this machine has: "cpu", "cuda", "cuda:N", "mps" or a torch.device; returns the torch.device.

    `kinds` may add "meta" (shapes without memory) where that makes sense. here=False parses a device kind
    without asking whether this machine has one (a kernel table keyed by kind: int8's "mps" row is read on a CPU);
    kinds=None takes any kind torch names, for a table that says itself which of them it serves.
    """
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"{name} must be a device name such as 'cpu' or 'cuda', got {describe(value)}")
    shown = _kinds_text(kinds or DEVICE_KINDS)
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(f"unknown {name} {value!r}; choose {shown}") from None
    if kinds is not None and device.type not in kinds:
        raise ValueError(f"unknown {name} {value!r}; choose {shown}")
    if not here:
        return device
    if device.type != "meta" and not device_available(device.type):
        why = (f"this torch ({torch.__version__}) sees no CUDA GPU" if device.type == "cuda"
               else "this machine has no Apple GPU" if device.type == "mps" else "")
        raise DeviceUnavailableError(f"{name} {value!r} is not available on this machine ({why}); use 'cpu', "
                                     "or pick_device() to fall back to the best one there is")
    if (device.type == "cuda" and device.index is not None and not fake_cuda.active()
            and device.index >= torch.cuda.device_count()):
        raise DeviceUnavailableError(f"{name} {value!r} is not available: this machine has "
                                     f"{torch.cuda.device_count()} CUDA device(s); use 'cuda:0'")
    return device


def check_token_ids(name: str, ids, vocab_size: int | None, context_length: int | None = None, start: int = 0) -> None:
    """An integer tensor [batch, seq] of ids in [0, vocab_size), with start + seq within context_length.

    vocab_size=None (a remote server's vocabulary, unknown here) checks only that ids are >= 0.
    Reading the values is a host sync: call it once per request, not once per decode step.
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        got = f"dtype {ids.dtype}" if isinstance(ids, torch.Tensor) else describe(ids)
        raise TypeError(f"{name} must be an integer tensor of token ids [batch, seq], got {got}; "
                        "use torch.tensor(ids, dtype=torch.long)")
    if ids.dim() != 2 or ids.shape[1] == 0 or ids.shape[0] == 0:
        raise ValueError(f"{name} must have shape [batch, seq] with batch, seq >= 1, got {tuple(ids.shape)}; "
                         "for one sequence use ids[None]")
    if fake_cuda.is_fake(ids):          # shapes only: a fake tensor has no ids to read
        lo, hi = 0, 0
    else:
        lo, hi = int(ids.min()), int(ids.max())
    if vocab_size is None:
        if lo < 0:
            raise ValueError(f"{name} holds token id {lo}; token ids are >= 0: encode text with the model's tokenizer")
    elif lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} holds token id {hi if hi >= vocab_size else lo}, outside the vocab of size "
                         f"{vocab_size} (ids 0..{vocab_size - 1}); encode with the tokenizer that matches this model")
    if context_length is not None and start + ids.shape[1] > context_length:
        raise ValueError(f"{start + ids.shape[1]} positions exceed the model's context length "
                         f"{context_length}; shorten the prompt or the output")


def check_model(name: str, model, *, weights: bool = True):
    """A course model (labutils.model.GPT, or an nn.Module with a .config as one): refuse a name, a path or a number
    in its place before any attribute is read. weights=True (anything that runs the model) also refuses a model laid
    out on the meta device, which has shapes and no values; counting bytes and FLOPs (roofline) needs only shapes."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        way_out = (" (a preset name: build it with labutils.model.build(GPTConfig.preset(name)); a checkpoint: "
                   "labutils.model.load_checkpoint(path))" if isinstance(model, (str, os.PathLike)) else "")
        raise TypeError(f"{name} must be a GPT model (labutils.model.GPT), got {describe(model)}{way_out}")
    if weights:
        first = next(model.parameters(), None)
        if first is not None and first.device.type == "meta":
            raise ValueError(f"the {name}'s weights are on the meta device (shapes without values), so it cannot run; "
                             "build it with labutils.model.build or load weights (labutils.model.load_checkpoint)")
    return model


def check_prompt_ids(name: str, ids, vocab_size: int | None = None, context_length: int | None = None) -> tuple[int, ...]:
    """One prompt's token ids: a non-empty list or tuple of ints, or a 1-D integer tensor or array; returns a tuple of
    ints. Each id is an int (never a bool or a float, even 3.0); their range is check_token_ids'."""
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        if ids.ndim != 1:
            raise ValueError(f"{name} must be one prompt, a 1-D sequence of token ids, got shape {tuple(ids.shape)}; "
                             "pass one row, e.g. ids[0]")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes, dict, set, frozenset)) or not isinstance(ids, (list, tuple, range)):
        raise TypeError(f"{name} must be a list of token ids, got {describe(ids)}; encode text with the model's "
                        "tokenizer first")
    if len(ids) == 0:
        raise ValueError(f"{name} is empty; a prompt needs at least one token")
    for i, t in enumerate(ids):
        if not _is_integer(t):
            raise TypeError(f"{name}[{i}] must be an int (a token id), got {describe(t)}; encode text with the "
                            "model's tokenizer, whose ids are ints")
        if not -2 ** 63 <= t < 2 ** 63:
            raise ValueError(f"{name}[{i}]={t} is no token id of any vocabulary; encode text with the model's tokenizer")
    ids = tuple(int(t) for t in ids)
    check_token_ids(name, torch.tensor([ids], dtype=torch.long), vocab_size, context_length)
    return ids


def model_dtype(model) -> torch.dtype:
    """The dtype a model's activations (and so its KV cache) are in: its final norm's, which int8 leaves alone."""
    norm = getattr(model, "ln_f", None)
    weight = getattr(norm, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else next(model.parameters()).dtype


def model_device(model) -> torch.device:
    """The device a model runs on; a model that cannot run (not a model, weights on meta) is refused (check_model)."""
    return next(check_model("model", model).parameters()).device


def check_cache(cache, model) -> None:
    """Refuse a KV cache that was not built for `model`: layers, KV heads, head_dim, length, dtype, device.

    Plain attribute reads, no host sync; GPT.forward(check=True) calls it once per request.
    """
    k = getattr(cache, "k", None)
    if not isinstance(k, torch.Tensor) or k.dim() != 5:
        raise TypeError(f"cache must be a KVCache (or StaticKVCache) built for the model, got {describe(cache)}; "
                        "make one with KVCache(model.config, batch_size, max_len)")
    cfg = model.config
    n_layer, _, n_kv, max_len, head_dim = k.shape
    wrong = [f"{what}={got} (the model has {want})" for what, got, want in
             (("n_layer", n_layer, cfg.n_layer), ("n_kv_head", n_kv, cfg.n_kv_head),
              ("head_dim", head_dim, cfg.head_dim))
             if got != want]
    dtype, device = model_dtype(model), model_device(model)
    if k.dtype != dtype:
        wrong.append(f"dtype={k.dtype} (the model computes in {dtype})")
    if k.device.type != device.type or (k.device.index or 0) != (device.index or 0):
        wrong.append(f"device={k.device} (the model is on {device})")
    if max_len > cfg.context_length:
        wrong.append(f"max_len={max_len} (the model's context length is {cfg.context_length})")
    if wrong:
        raise ValueError(f"cache does not fit this model: it has {'; '.join(wrong)}. Build it for the model: "
                         "KVCache(model.config, batch_size, max_len, device=<the model's device>, "
                         "dtype=<the model's dtype>)")


def check_row(name: str, row, numbers_: tuple[str, ...], others: tuple[str, ...] = ()) -> dict:
    """A measurement row (a dict) that holds every key a view reads: `numbers_` as finite numbers, `others` at all."""
    if not isinstance(row, dict):
        raise TypeError(f"{name} must be a dict of measurements, got {describe(row)}")
    missing = [k for k in (*numbers_, *others) if k not in row]
    if missing:
        raise ValueError(f"{name} lacks {missing}; a measurement must return every key the plots read "
                         f"({', '.join((*numbers_, *others))})")
    for key in numbers_:
        check_number(f"{name}[{key!r}]", row[key], allow_inf=False)
    return row


def check_timestamps(name: str, timestamps) -> list[float]:
    """Token timestamps: a non-empty sequence of finite seconds >= 0 that never decreases."""
    if hasattr(timestamps, "tolist") and getattr(timestamps, "ndim", None) == 1:    # a numpy array or a tensor
        timestamps = timestamps.tolist()
    if not isinstance(timestamps, (list, tuple)):
        raise TypeError(f"{name} must be a list of seconds, one per token, got {describe(timestamps)}")
    if len(timestamps) == 0:
        raise ValueError(f"{name} is empty: no token timestamps; a request must produce at least one token")
    values = [check_number(f"{name}[{i}]", t, minimum=0,
                           hint="timestamps are seconds since the request began, from one monotonic clock")
              for i, t in enumerate(timestamps)]
    for i, (a, b) in enumerate(zip(values, values[1:])):
        if b < a:
            raise ValueError(f"{name} must not decrease, but {name}[{i + 1}]={b!r} < {name}[{i}]={a!r}; "
                             "record token timestamps with one monotonic clock (time.perf_counter)")
    return values


__all__ = ["DEVICE_KINDS", "DeviceUnavailableError", "DoesNotFitError", "check_cache", "check_choice", "check_count",
           "check_device", "check_dtype", "check_flag", "check_model", "check_number", "check_path", "check_positive",
           "check_probability", "check_prompt_ids", "check_row", "check_seed", "check_temperature", "check_timestamps", "check_token_ids",
           "parse_dtype", "describe", "device_available", "model_device", "model_dtype"]
