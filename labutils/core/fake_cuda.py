"""Fake CUDA: run the GPU code paths on a CPU-only torch, on shapes, devices and dtypes alone, to catch in CI the
device and dtype mistakes a learner's GPU would hit.

`torch._subclasses.fake_tensor.FakeTensorMode` makes tensors whose device is "cuda" on a CPU build; ops inside the
mode compute only shapes and dtypes, and an op that mixes a CPU tensor with a CUDA one raises
FakeTensorDeviceMismatchError, as the GPU would. `fake_cuda()` enters that mode and tells the rest of labutils so:
- `validate.device_available("cuda")` answers yes inside it, and only inside it;
- checks that must read values (token ids in range, finite logits) skip fake tensors, whose values do not exist;
- the few calls that need a real GPU runtime go through small functions here (`event`, `synchronize`,
  `pin_memory`), which do nothing inside it. CUDA graphs and streams are not faked: trace the eager step.
`to_fake_cuda(model, dtype)` swaps a model's weights for fake CUDA tensors. `DtypeWatch` records every op whose
result is float32 while a step should stay in 16 bits.

One piece is missing from a CPU build of torch: a CUDA device guard. Slicing a tensor (`x[:, -1]`) or copying into
one opens a guard for the tensor's device, and a CPU build has none registered for CUDA, so it fails with "PyTorch
is not linked with support for cuda devices" before any fake-tensor code runs (FakeTensorMode's own remedy,
`_ensureCUDADeviceGuardSet`, only swaps a no-op guard in on CUDA builds without a GPU). `install_guard()` compiles
a six-line C++ extension once (torch.utils.cpp_extension, about 30 s; cached in torch's extensions folder) that
registers c10's own no-op guard for CUDA. It changes nothing else: a real CUDA tensor is still refused, and
torch.cuda.is_available() stays False.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections import Counter

import torch

_ACTIVE = contextvars.ContextVar("labutils_fake_cuda", default=None)
_emulating = False      # set by labutils.core.emulated_cuda: CUDA pretended, with values on the CPU


def active() -> bool:
    """True inside fake_cuda() (values do not exist) or labutils.core.emulated_cuda (values on the CPU): CUDA is
    pretended, and there is no CUDA runtime to wait for, pin memory with or capture graphs on."""
    return _ACTIVE.get() is not None or _emulating


def shapes_only() -> bool:
    """True inside fake_cuda(): tensors have no values, and no device can say how much memory it has free."""
    return _ACTIVE.get() is not None


def is_fake(t) -> bool:
    """A tensor with shape, dtype and device but no values (FakeTensor, or a meta tensor)."""
    if not isinstance(t, torch.Tensor):
        return False
    if t.device.type == "meta":
        return True
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


class _CopyShim(torch.utils._python_dispatch.TorchDispatchMode):
    """copy_ into a fake CUDA tensor asks the CUDA runtime for a device guard, which a CPU build lacks. Values do not
    exist here, so a copy only has to be legal: the source must broadcast to the destination, as torch requires."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].device.type == "cuda":
            dst, src = args[0], args[1]
            if torch.broadcast_shapes(dst.shape, src.shape) != dst.shape:
                raise RuntimeError(f"copy_: a source of shape {tuple(src.shape)} does not broadcast to the "
                                   f"destination's {tuple(dst.shape)}")
            return dst
        return func(*args, **(kwargs or {}))


_GUARD_SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
static c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA> no_op_cuda_guard;
bool install() {
  if (c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) return false;   // a CUDA build has its own
  c10::impl::registerDeviceGuard(c10::DeviceType::CUDA, &no_op_cuda_guard);
  return true;
}
"""
_guard_installed = False


def install_guard() -> None:
    """Register a no-op CUDA device guard on a CPU build (see the module docstring); a CUDA build needs none."""
    global _guard_installed
    if _guard_installed or torch.cuda.is_available() or torch.version.cuda is not None:
        _guard_installed = True
        return
    from torch.utils.cpp_extension import load_inline
    try:
        ext = load_inline("labutils_fake_cuda_guard", cpp_sources=_GUARD_SOURCE, functions=["install"],
                          extra_cflags=["-O0"], verbose=False)
    except Exception as err:    # no compiler, no ninja, no Python headers: say what fake_cuda() needs
        raise RuntimeError(f"fake_cuda() could not build its CUDA device guard ({type(err).__name__}: "
                           f"{str(err).splitlines()[0][:200]}); it needs a C++ compiler, the Python headers and "
                           "ninja (pip install -e '.[dev]')") from None
    ext.install()
    _guard_installed = True


@contextlib.contextmanager
def fake_cuda():
    """Enter a FakeTensorMode that refuses real tensors as inputs, with CUDA pretended; yields the mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    install_guard()
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    token = _ACTIVE.set(mode)
    try:
        with mode, _CopyShim():
            yield mode
    finally:
        _ACTIVE.reset(token)


def unset():
    """Leave fake mode for a moment (a context manager): to build a real model before faking its weights."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    return unset_fake_temporarily()


def to_fake_cuda(model: torch.nn.Module, dtype: torch.dtype | None = None, index: int = 0) -> torch.nn.Module:
    """Swap every parameter and buffer of `model` for a fake tensor on cuda:`index`, floating ones cast to `dtype`
    (tied weights stay tied). Call it inside fake_cuda(); returns the model, changed in place."""
    mode = _ACTIVE.get()
    if mode is None:
        raise RuntimeError("to_fake_cuda needs fake_cuda(): with fake_cuda() as mode: to_fake_cuda(model, ...)")
    from torch._subclasses.fake_tensor import FakeTensor
    device, swapped = torch.device("cuda", index), {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in swapped:
            want = dtype if dtype is not None and t.is_floating_point() else t.dtype
            with torch._subclasses.fake_tensor.unset_fake_temporarily():
                meta = t.detach().to("meta").to(want)
            swapped[id(t)] = FakeTensor(mode, meta, device)
        return swapped[id(t)]

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(fake(p), requires_grad=False)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake(b)
    return model


# ---- the small functions that need a real GPU runtime -------------------------------------------------------------

class _Event:
    """A CUDA event inside fake_cuda(): records nothing, is always complete, measures zero time."""

    def record(self, *args):
        pass

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


def event():
    """torch.cuda.Event(enable_timing=True), or a stand-in inside fake_cuda()."""
    return _Event() if _ACTIVE.get() is not None else torch.cuda.Event(enable_timing=True)


def synchronize(device: torch.device) -> None:
    """Wait for the device (torch.cuda.synchronize / torch.mps.synchronize); nothing inside fake_cuda()."""
    if active():
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def generator(device: torch.device, seed: int | None):
    """A seeded torch.Generator on `device`, or None for no seed; None inside fake_cuda(), where a CUDA generator
    cannot be made and no value is drawn anyway. Under emulated CUDA, one the emulation counts as CUDA's."""
    if seed is None or _ACTIVE.get() is not None:
        return None
    if _emulating and torch.device(device).type == "cuda":
        from labutils.core.emulated_cuda import cuda_generator
        return cuda_generator(seed)
    return torch.Generator(device=device).manual_seed(seed)


def pin_memory(want: bool) -> bool:
    """Whether a host buffer may be pinned: pinning needs the CUDA runtime, which fake_cuda() only pretends."""
    return want and not active()


# ---- dtype promotions ---------------------------------------------------------------------------------------------

class DtypeWatch(torch.utils._python_dispatch.TorchDispatchMode):
    """Inside a step that should stay in 16 bits: count, per op, the results that came out float32."""

    def __init__(self):
        super().__init__()
        self.float32 = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.dtype == torch.float32:
                self.float32[str(func.overloadpacket)] += 1
        return out
