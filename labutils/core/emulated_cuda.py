"""Emulated CUDA: run the GPU code paths on a CPU-only torch with real values and CUDA's device rules.

`fake_cuda` traces shapes only, so it stops at the first value a step reads (`.item()`, `.tolist()`,
`torch.equal`) and never sees which device a generator belongs to. Both hid bugs that a real GPU found at once
(a CPU generator drawing onto CUDA, a CPU tensor compared with a CUDA one). Here every tensor the code puts on
"cuda" is a `CudaTensor`: a real CPU tensor that reports `device='cuda:0'`. Every op runs on the CPU, and first
checks what a CUDA build checks:
- a CPU tensor with dimensions meets a CUDA one in an op (a 0-dim CPU tensor is a scalar, which CUDA allows, and
  copies, transfers and indexing with CPU indices are legal): "Expected all tensors to be on the same device";
- a random draw whose generator lives on another device than its result: "Expected a 'cuda' device type for
  generator but found 'cpu'". `fake_cuda.generator(device, seed)` makes the course's device generators; inside the
  emulation a CUDA one is a CPU generator registered as CUDA's.
- `F.scaled_dot_product_attention` returns its output in the layout CUDA's fused kernels use ([B, T, H, d] in
  memory, seen as [B, H, T, d]), so a `.view` of it fails here as it fails on a GPU.
The CUDA runtime calls the course makes (events, synchronize, memory counters, device properties) get stand-ins;
CUDA graphs and torch.compile are not emulated (fastgen runs eager here, and dynamo does not trace under the
emulation's modes). Everything is slower than plain CPU torch (each op passes through Python), so use small shapes:
a lesson that sizes its experiment for a GPU (lesson 03's 16,384-token attention, lesson 11's serving runs) is too
big for it, while lessons 00-02 and 05-07, 09 and 10 ran through on it.

`enter()` switches it on for the rest of the process (a lesson's kernel, `LABUTILS_EMULATE_CUDA=1`);
`emulated_cuda()` is the context manager tests use.
"""
from __future__ import annotations

import contextlib
import os
import time
import types
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from labutils.core import fake_cuda

CUDA = torch.device("cuda", 0)
ENV = "LABUTILS_EMULATE_CUDA"
aten = torch.ops.aten

# Ops that may legally see a CUDA tensor beside a CPU one with dimensions: copies between devices, and indexing
# a CUDA tensor with CPU index tensors (torch moves the indices).
_MIXED_OK = {aten.copy_.default, aten._to_copy.default, aten.index.Tensor, aten.index_put_.default,
             aten._index_put_impl_.default, aten.index_put.default}


class CudaTensor(torch.Tensor):
    """A real CPU tensor (`.elem`) that says it lives on cuda:0."""

    elem: torch.Tensor
    __slots__ = ["elem"]

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                layout=elem.layout, device=CUDA, requires_grad=elem.requires_grad)
        r.elem = elem
        return r

    def __repr__(self, *, tensor_contents=None):
        return repr(self.elem).removesuffix(")") + ", device='cuda:0')"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


_cuda_generators: dict[int, torch.Generator] = {}     # id -> generator, kept alive so an id is never reused


def cuda_generator(seed: int) -> torch.Generator:
    """A seeded generator that the emulation treats as CUDA's (it draws on the CPU, where the values are)."""
    g = torch.Generator().manual_seed(seed)
    _cuda_generators[id(g)] = g
    return g


def _is_cuda(x) -> bool:
    return isinstance(x, CudaTensor)


def _wants_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _check(func, flat: list, kwargs: dict) -> bool:
    """CUDA's device rules for one op; returns whether its results live on CUDA."""
    cuda_in = any(_is_cuda(x) for x in flat)
    cpu_in = [x for x in flat if isinstance(x, torch.Tensor) and not _is_cuda(x) and x.dim() > 0]
    if cuda_in and cpu_in and func not in _MIXED_OK:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, cuda:0 "
                           f"and cpu! ({func}; emulated CUDA: a CPU tensor of shape {tuple(cpu_in[0].shape)} "
                           "met a CUDA one)")
    if func is aten._to_copy.default or func.overloadpacket is aten.to:      # a transfer, or only a cast
        target = [x for x in flat if isinstance(x, (torch.device, str))]
        return _wants_cuda(target[0]) if target else cuda_in
    return cuda_in or _wants_cuda(kwargs.get("device"))


_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}


def _host_index(index):
    """x[[0, 2]] on a CUDA tensor builds its index tensor below the dispatcher: build it on the host instead (CUDA
    takes CPU index tensors). The same indexing, since a list of ints indexes as a tensor of them."""
    if isinstance(index, tuple):
        return tuple(_host_index(i) for i in index)
    if isinstance(index, list) and all(isinstance(i, (int, bool)) for i in index):
        return torch.tensor(index)
    return index


class _FunctionChecks(torch.overrides.TorchFunctionMode):
    """At the Python call: a random draw's generator must live on its result's device (checked here, where the
    generator is still the object the code made: the dispatcher hands each op a fresh wrapper of it), and the
    calls that build a tensor below the dispatcher (`torch.tensor(data, device="cuda")`, `.tolist()`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist and _is_cuda(args[0]):
            return args[0].elem.tolist()          # a CUDA tensor's .tolist() copies to the host, as this does
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _is_cuda(args[0]):
            args = (args[0], _host_index(args[1]), *args[2:])
        if func in _FROM_DATA and _wants_cuda(kwargs.get("device")):
            # torch.tensor(data, device="cuda") fills its tensor below the dispatcher: build it here, then wrap
            return CudaTensor(func(*args, **{**kwargs, "device": "cpu"}))
        gen = kwargs.get("generator")
        if gen is not None:
            tensors = [x for x in _leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
            out_cuda = (_wants_cuda(kwargs["device"]) if kwargs.get("device") is not None
                        else bool(tensors) and _is_cuda(tensors[0]))
            gen_cuda = id(gen) in _cuda_generators
            if gen_cuda != out_cuda:
                want, got = ("cuda", "cpu") if out_cuda else ("cpu", "cuda")
                raise RuntimeError(f"Expected a '{want}' device type for generator but found '{got}' "
                                   f"({getattr(func, '__name__', func)}; emulated CUDA: draw with a generator on "
                                   "the result's device, labutils.core.fake_cuda.generator(device, seed))")
        return func(*args, **kwargs)


def _leaves(x):
    """The leaves of an op's arguments or results: aten ops nest only lists, tuples and dicts (pytree's general walk
    cost three quarters of each emulated op)."""
    if isinstance(x, (list, tuple)):
        for item in x:
            yield from _leaves(item)
    elif isinstance(x, dict):
        for item in x.values():
            yield from _leaves(item)
    else:
        yield x


def _map(fn, x):
    """`fn` on each leaf, in containers of the same shape. Only a plain list or tuple is rebuilt: a torch.Size is a
    leaf (its ints pass through `fn` unchanged)."""
    if type(x) in (list, tuple):
        return type(x)(_map(fn, item) for item in x)
    if isinstance(x, dict):
        return {key: _map(fn, item) for key, item in x.items()}
    return fn(x)


def _run(func, args, kwargs):
    flat = list(_leaves((args, kwargs)))
    out_cuda = _check(func, flat, kwargs)
    wrappers = {id(x.elem): x for x in flat if _is_cuda(x)}

    def unwrap(x):
        if _is_cuda(x):
            return x.elem
        return torch.device("cpu") if isinstance(x, torch.device) and x.type == "cuda" else x
    args, kwargs = _map(unwrap, (args, kwargs))      # a "cuda" device becomes the CPU; meta stays meta
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    out = func(*args, **kwargs)
    if not out_cuda:
        # A copy to the host is a copy: never hand back the CUDA tensor's own storage.
        return out.clone() if isinstance(out, torch.Tensor) and id(out) in wrappers else out

    def wrap(x):
        if not isinstance(x, torch.Tensor) or _is_cuda(x):
            return x
        own = wrappers.get(id(x))                        # an in-place op returns its own (wrapped) input
        return CudaTensor(x) if own is None else own
    # A view is an inference tensor exactly when its base is one, inside inference_mode or not, as torch's own are.
    view = getattr(func, "is_view", False)
    with torch.inference_mode(any(_is_cuda(x) and x.is_inference() for x in flat)) if view else contextlib.nullcontext():
        return _map(wrap, out)


class _Mode(TorchDispatchMode):
    """Catches factories (`torch.zeros(..., device="cuda")`), which have no CUDA tensor to dispatch on."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


_real_sdpa = F.scaled_dot_product_attention


def cuda_layout_sdpa(*args, **kwargs):
    """F.scaled_dot_product_attention with its output in CUDA's fused layout: [B, T, H, d] in memory, seen as
    [B, H, T, d]. The same values, other strides."""
    out = _real_sdpa(*args, **kwargs)
    if out.dim() != 4:
        return out
    return out.transpose(1, 2).contiguous().transpose(1, 2)


class _Event:
    """torch.cuda.Event inside the emulation: ops run synchronously on the CPU, so the host clock is the GPU's."""

    def __init__(self, *args, **kwargs):
        self.t = None

    def record(self, *args):
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass

    def wait(self, *args):
        pass

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1e3


# The free memory emulated CUDA reports: room for the lessons' small shapes, too little for any of shape_for's GPU
# shapes (Llama-3.2-1B needs 2.5 GB in bf16), so lessons keep their CPU shapes here. Emulated values live on the CPU
# and run at its speed: a Llama shape's 4,096-token passes would take hours, not the seconds a GPU needs.
EMULATED_FREE_BYTES = 2 * (1 << 30)


def _properties(device=None):
    return types.SimpleNamespace(name="emulated CUDA (values on the CPU)", total_memory=24 * (1 << 30),
                                 L2_cache_size=50 * (1 << 20), multi_processor_count=132, major=9, minor=0)


class _NoGraphs:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("CUDA graphs are not emulated on the CPU (labutils.core.emulated_cuda)")


def _runtime_patches() -> list:
    """Stand-ins for the CUDA runtime calls the course makes."""
    c = torch.cuda
    stand_ins = {
        "Event": _Event, "synchronize": lambda *a, **k: None, "current_device": lambda: 0,
        "get_device_name": lambda *a: _properties().name, "get_device_properties": _properties,
        "is_bf16_supported": lambda *a, **k: True, "memory_allocated": lambda *a, **k: 0,
        "max_memory_allocated": lambda *a, **k: 0, "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda: None, "mem_get_info": lambda *a: (EMULATED_FREE_BYTES, _properties().total_memory),
        "CUDAGraph": _NoGraphs, "graph_pool_handle": _NoGraphs,
        "_lazy_init": lambda: None,     # torch asks it before making a tensor on "cuda"; a CPU build refuses
    }
    return [mock.patch.object(c, name, value) for name, value in stand_ins.items()]


_real_apply = torch.nn.Module._apply
_applying = False


def _apply_keeping_ties(self, fn, *args, **kwargs):
    """Module._apply making new Parameters (above) gives each module its own copy of a tied weight (GPT-2's
    embedding and output layer): tie them again, as torch's default conversion keeps them."""
    global _applying
    if _applying:
        return _real_apply(self, fn, *args, **kwargs)
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in self.modules():
        for name, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, name))
    _applying = True
    try:
        out = _real_apply(self, fn, *args, **kwargs)
    finally:
        _applying = False
    for tied in owners.values():
        first = tied[0][0]._parameters[tied[0][1]]
        for module, name in tied[1:]:
            module._parameters[name] = first
    return out


_stack: contextlib.ExitStack | None = None


def active() -> bool:
    return _stack is not None


def _flag(on: bool) -> None:
    fake_cuda._emulating = on      # fake_cuda.active() then answers yes, and fake_cuda.generator makes CUDA's


def enter() -> None:
    """Switch the emulation on for the rest of this process (idempotent)."""
    global _stack
    if _stack is not None:
        return
    fake_cuda.install_guard()            # the no-op CUDA device guard a CPU build lacks
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention", cuda_layout_sdpa))
    for patch in _runtime_patches():
        stack.enter_context(patch)
    # model.to("cuda") must make new Parameters around the CudaTensors; by default it swaps the data of the old
    # ones in place, which would give a Parameter CUDA's device with no tensor behind it.
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    stack.callback(torch.__future__.set_overwrite_module_params_on_conversion, before)
    stack.enter_context(mock.patch.object(torch.nn.Module, "_apply", _apply_keeping_ties))
    stack.enter_context(_Mode())
    stack.enter_context(_FunctionChecks())
    stack.callback(_flag, False)
    _flag(True)
    _stack = stack


def leave() -> None:
    global _stack
    if _stack is not None:
        stack, _stack = _stack, None
        stack.close()
        _cuda_generators.clear()


@contextlib.contextmanager
def emulated_cuda():
    """CUDA emulated on the CPU inside the block (see the module docstring)."""
    if active():
        yield
        return
    enter()
    try:
        yield
    finally:
        leave()


def enter_if_asked() -> bool:
    """`LABUTILS_EMULATE_CUDA=1` in the environment: emulate for this process (gpu_check --dry-run's lessons)."""
    if os.environ.get(ENV, "") not in ("", "0"):
        enter()
    return active()
