"""Weight-only int8: per-output-channel scales, an Int8Linear that swaps in for nn.Linear, and its report card.

Decode reads every weight once per step, so a weight stored in 1 byte instead of 4 (fp32) or 2
(bf16) cuts the bytes a step must read. It only cuts the *time* if the multiply reads the int8
bytes directly. Measured on the course's 2-core CI CPU (torch 2.13, one 3072 x 768 GEMV; run
`int8_paths()` to see this machine's numbers):

- `torch._weight_int8pack_mm` with bf16 activations reads the int8 weight and scales it in
  registers: the fastest path at batch 1, faster than fp32 or bf16 `F.linear`.
- The same op with fp32 activations is many times slower (its fp32 kernel is not the tuned one),
  so the CPU path casts x to bf16 on the way in and back on the way out.
- Dequantize-then-matmul in eager mode writes a float copy of the weight first, then reads it:
  more bytes than the float layer it replaces, so int8 loses.
- `_weight_int8pack_mm` handles one row of x at a time (its time grows with the rows), so above a
  handful of rows (prefill) a bf16 GEMM over the dequantized weight would be faster.

Which kernel a layer runs is decided once per layer, when it is quantized (`int8_path()`), never per call. A kernel
chosen by row count gave a batch of 16 (a GEMM) other rounding than the same request alone (the GEMV), so an
engine's tokens and a speculative verify pass's differed from solo generate()'s. With one kernel per model, and the
CPU's GEMV computing each row on its own, a row's result does not depend on the rows beside it: batched, solo and
verify passes agree. Prefill pays for that on a CPU (its time grows with the prompt). On CUDA the layer runs
gpt-fast's dequantize-matmul under torch.compile, which fuses the cast into the matmul so only the int8 bytes are
read; eager, that form writes and reads a float copy of the weight, slower than a plain 16-bit layer. Compiled on its
own, each layer is still a launch of its own between eager ops, and ran 4.9x slower than bf16 on an H200; under a
whole compiled decode step (FastDecoder mode="compile") the same form fuses into one graph, as in gpt-fast.
"""
from __future__ import annotations

import copy
import statistics
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from labutils.core import fake_cuda
from labutils.perf import roofline, timing
from labutils.core.validate import check_count, check_device, describe, model_device

# Model dtypes Int8Linear can serve, per device type. The CPU kernel computes in bf16 either way;
# fp16 activations take its untuned path there, so an fp16 model must be cast to fp32 or bf16 first.
SUPPORTED = {"cpu": (torch.float32, torch.bfloat16),
             "cuda": (torch.float32, torch.bfloat16, torch.float16),
             "mps": (torch.float32, torch.float16)}
# Why a device runs the slow form, for the one line quantize_ and int8_path report.
FALLBACK = {"mps": "on Apple GPUs (mps) torch has no int8 matmul kernel: each layer dequantizes its weight per call "
                   "(a quarter of the bytes stored, not fewer read)"}
# The CPU int8 kernel walks each weight row in full SIMD vectors (16 floats on AVX-512, 8 on AVX2
# and NEON) with no tail loop: an n_in that is not a multiple reads past the row (NaN or a crash).
PACK_N_IN_MULTIPLE = 16


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kind(device) -> str:
    """The device kind ("cpu", "cuda", "mps", "meta") of a name or torch.device, parsed by the course's device rule.

    A kind, not this machine's device: the kernel table's mps row is read on a machine without one, and a kind torch
    knows but the table lacks ("xpu") gets the table's own message."""
    return check_device("device", device, None, here=False).type


def check_supported(device, dtype: torch.dtype) -> None:
    """Refuse a device or model dtype that Int8Linear has no kernel for, naming the ones it has."""
    kind = _kind(device)
    if kind not in SUPPORTED:
        raise ValueError(f"int8 weights run on {list(SUPPORTED)}, not {kind!r}; move the model with "
                         "model.to('cpu') (or 'cuda') before quantize_(model)")
    if dtype not in SUPPORTED[kind]:
        names = [_dtype_name(d) for d in SUPPORTED[kind]]
        raise ValueError(f"int8 weights on {kind} serve models in {names}, not {_dtype_name(dtype)}; "
                         f"cast the model first, e.g. model.to(torch.{names[0]})")


def scale_dtype(device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the scales are stored in: the one the kernel multiplies by, so no per-call cast."""
    return torch.bfloat16 if _kind(device) == "cpu" else dtype


# ---------------------------------------------------------------------------------------------
# Quantize and dequantize
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def quantize_per_channel(w: torch.Tensor, scales_dtype: torch.dtype = torch.float32):
    """w [n_out, n_in] float -> (q int8 [n_out, n_in], scales [n_out]) with w ~= q * scales[:, None].

    Symmetric: each output row gets scale = max|row| / 127, so q spans -127..127 and 0 stays 0.
    The scale is rounded *up* to `scales_dtype`, so no |w| / scale exceeds 127 and nothing clips:
    every element is off by at most scale / 2, the rounding of one step.
    """
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w: expected a 2-D float weight [n_out, n_in], got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    if w.numel() == 0:
        raise ValueError(f"w: the weight {tuple(w.shape)} is empty, so there is no row to quantize; pass a layer's "
                         "weight (an nn.Linear's .weight)")
    if not isinstance(scales_dtype, torch.dtype) or not scales_dtype.is_floating_point:
        raise TypeError(f"scales_dtype must be a floating torch dtype such as torch.float32, got {describe(scales_dtype)}")
    if not fake_cuda.is_fake(w) and not bool(torch.isfinite(w).all()):     # one host sync, once per layer
        raise ValueError("the weight holds NaN or infinity, which no int8 scale can represent (an inf row would "
                         "quantize to zeros with an inf scale); fix the weights before quantizing")
    w32 = w.float()
    tiny = torch.finfo(scales_dtype).tiny            # an all-zero row keeps a usable, normal scale
    exact = (w32.abs().amax(dim=1) / 127).clamp(min=tiny)
    scales = exact.to(scales_dtype)
    scales = torch.where(scales.float() < exact, torch.nextafter(scales, torch.full_like(scales, float("inf"))),
                         scales)
    q = torch.round(w32 / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [n_out, n_in] int8, scales [n_out] -> the float weight they stand for, q * scales[:, None]."""
    if not isinstance(q, torch.Tensor) or not isinstance(scales, torch.Tensor):
        raise TypeError(f"dequantize takes the tensors quantize_per_channel returns, q [n_out, n_in] and scales "
                        f"[n_out], got q {describe(q)}, scales {describe(scales)}")
    if q.dim() != 2 or scales.shape != q.shape[:1]:
        raise ValueError(f"q must be [n_out, n_in] and scales [n_out], got q {tuple(q.shape)}, scales "
                         f"{tuple(scales.shape)}; pass both from one quantize_per_channel(w)")
    return (q.float() * scales.float()[:, None]).to(dtype)


# ---------------------------------------------------------------------------------------------
# The kernels: (x [rows, n_in], q [n_out, n_in] int8, scales [n_out], bias [n_out] or None)
#   -> y [rows, n_out] in x's dtype
# ---------------------------------------------------------------------------------------------

def _finish(y, x, bias):
    # The bias is in the model's dtype, so adding it also casts a bf16 result back: one op, not two.
    return y.to(x.dtype) if bias is None else (y + bias).to(x.dtype)


def _int8pack_bf16(x, q, scales, bias=None):
    # The CPU's tuned int8 GEMV: bf16 activations and scales, the weight read as int8.
    y = torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), q, scales.to(torch.bfloat16))
    return _finish(y, x, bias)


def _int8pack(x, q, scales, bias=None):
    # The same op in x's own dtype. (On CUDA the op converts x and the scales to fp32 itself.)
    return _finish(torch._weight_int8pack_mm(x.contiguous(), q, scales.to(x.dtype)), x, bias)


def _dequant_bf16(x, q, scales, bias=None):
    # Cast the weight to bf16, one bf16 GEMM, scale the output columns: the CPU's prefill path.
    y = F.linear(x.to(torch.bfloat16), q.to(torch.bfloat16)) * scales.to(torch.bfloat16)
    return _finish(y, x, bias)


def _dequant(x, q, scales, bias=None):
    # gpt-fast's form. Eager, the cast writes a float weight before the matmul reads it; under
    # torch.compile inductor fuses the cast into the matmul, so only the int8 bytes are read.
    # In fp16 the scale comes first: x @ q.T sums products of up to 127 x |x|, which overflows fp16's 65,504 for
    # large activations long before x @ (q * s).T does (the weights' own range).
    if x.dtype == torch.float16:
        return _finish(F.linear(x, q.to(x.dtype) * scales.to(x.dtype)[:, None]), x, bias)
    return _finish(F.linear(x, q.to(x.dtype)) * scales.to(x.dtype), x, bias)


_COMPILED: dict[str, Callable] = {}


def _compiled_dequant(x, q, scales, bias=None):
    # CUDA: the dequantize-matmul where it is fast, fused by torch.compile (compiled once, on first use).
    if "dequant" not in _COMPILED:
        _COMPILED["dequant"] = torch.compile(_dequant, dynamic=True)
    return _COMPILED["dequant"](x, q, scales, bias)


KERNELS: dict[str, Callable] = {"int8pack_bf16": _int8pack_bf16, "int8pack": _int8pack,
                                "dequant_bf16": _dequant_bf16, "dequant": _dequant,
                                "dequant_compiled": _compiled_dequant}


def int8_path(device, n_in: int) -> str:
    """The KERNELS entry an Int8Linear with `n_in` features on `device` runs, for every call (see the module doc).

    CPU: the int8 GEMV (bf16 in, bf16 scales) where the kernel can walk n_in, else the bf16 dequantize-GEMM.
    CUDA: gpt-fast's dequantize-matmul under torch.compile (eager inside labutils.core.fake_cuda, which cannot compile).
    (torch's CUDA _weight_int8pack_mm converts x to fp32 and computes each output on plain CUDA cores, no tensor
    cores; `int8_paths(device="cuda")` measures it beside the others.) mps: the dequantize-matmul, eager
    (FALLBACK says why).
    """
    kind = _kind(device)
    if kind == "cpu":
        return "int8pack_bf16" if n_in % PACK_N_IN_MULTIPLE == 0 else "dequant_bf16"
    if kind == "cuda":
        return "dequant" if fake_cuda.active() else "dequant_compiled"
    if kind == "mps":
        return "dequant"
    raise ValueError(f"int8 weights run on {list(SUPPORTED)}, not {kind!r}")


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------

class Int8Linear(nn.Module):
    """y = x @ (q * scales[:, None]).T + bias, with q stored as int8 and one scale per output channel."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Buffers, not parameters: they are not trained, and roofline.weight_bytes counts buffers
        # at their own element size (1 byte for the weight).
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.kernel = int8_path(weight.device, self.in_features)      # one kernel for every call of this layer

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        w = linear.weight
        check_supported(w.device, w.dtype)
        q, scales = quantize_per_channel(w, scale_dtype(w.device, w.dtype))
        return cls(q, scales, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        kernel = self.kernel
        if kernel == "dequant_compiled" and torch.compiler.is_compiling():
            # Inside a compiled decode step (FastDecoder mode="compile", as gpt-fast runs int8): the plain form, so
            # inductor fuses the cast into the matmul's load within the whole step's graph, which a CUDA graph then
            # replays. A layer compiled on its own there would be a graph of its own, launched per layer.
            kernel = "dequant"
        y = KERNELS[kernel](x2, self.weight, self.scales, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)     # the kernel chose y's layout: never view it

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, scales={_dtype_name(self.scales.dtype)}, kernel={self.kernel}")

    def _apply(self, fn, recurse=True):
        # model.to(device) moves the tensors; the kernel must follow the device it now runs on.
        out = super()._apply(fn, recurse)
        self.kernel = int8_path(self.weight.device, self.in_features)
        return out


class Int8Embedding(nn.Module):
    """A token-embedding lookup that reads the rows of a tied Int8Linear's int8 table.

    It holds no tensors of its own: the table and scales belong to the output layer, so the shared
    matrix is stored (and counted by roofline.weight_bytes) once, as it was before quantization.
    """

    def __init__(self, table: Int8Linear, dtype: torch.dtype):
        super().__init__()
        # A plain attribute, not a submodule: registering `table` twice would list its tensors
        # under two names in state_dict.
        self.__dict__["table"] = table
        # An empty float buffer that model.to(dtype) converts with the rest: the dtype rows come out in.
        self.register_buffer("_dtype", torch.empty(0, dtype=dtype, device=table.weight.device), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        dtype = self._dtype.dtype
        return F.embedding(ids, self.table.weight).to(dtype) * self.table.scales[ids].to(dtype).unsqueeze(-1)

    def extra_repr(self) -> str:
        return (f"tied to an Int8Linear {self.table.out_features} x {self.table.in_features}, "
                f"dtype={_dtype_name(self._dtype.dtype)}")


def is_quantized(model: nn.Module) -> bool:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module (a GPT), got {describe(model)}")
    return any(isinstance(m, (Int8Linear, Int8Embedding)) for m in model.modules())


@torch.no_grad()
def quantize_(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear in `model` for an Int8Linear, in place, and return the model.

    Quantize after moving the model to its device and dtype (see SUPPORTED). A token embedding
    tied to an output layer (GPT-2's tok_emb / lm_head) is tied to the int8 table: the
    alternatives would be dishonest about bytes. Leaving the tied matrix in float keeps about a
    third of gpt2-small's weights at 4 bytes, while quantizing a separate copy of it for the
    output layer would store the table twice. A shared int8 table is what both uses then read.
    """
    if is_quantized(model):                  # which also refuses what is no nn.Module, by name
        raise ValueError("the model already holds int8 layers; quantizing twice would lose precision twice. "
                         "Quantize a fresh float copy, e.g. quantize_(copy.deepcopy(float_model))")
    linears = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layers to quantize")
    for _, _, lin in linears:       # check them all before changing any
        check_supported(lin.weight.device, lin.weight.dtype)
    why = FALLBACK.get(linears[0][2].weight.device.type)
    if why:
        print(f"quantize_: {why}")
    swapped: dict[int, Int8Linear] = {}        # id(float weight) -> the Int8Linear that replaced it
    for parent, name, lin in linears:
        if id(lin.weight) not in swapped:
            swapped[id(lin.weight)] = Int8Linear.from_linear(lin)
        setattr(parent, name, swapped[id(lin.weight)])
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Embedding) and id(child.weight) in swapped:
                setattr(parent, name, Int8Embedding(swapped[id(child.weight)], child.weight.dtype))
    return model


# ---------------------------------------------------------------------------------------------
# Measurements for the lesson
# ---------------------------------------------------------------------------------------------

def int8_paths(n_out: int = 3072, n_in: int = 768, batch: int = 1, device=None, *,
               rounds: int = 3, repeats: int = 10, seed: int = 0) -> dict[str, float]:
    """Median seconds of y = x @ W.T for one [n_out, n_in] weight on each path, timed side by side.

    "fp32" and "bf16" are F.linear on a float weight; the others are the int8 KERNELS, fed fp32
    activations and scales stored as Int8Linear stores them, so a path's casts are part of its time
    (as in an fp32 model). The rounds alternate between paths so that load from other programs hits
    every path alike. A path this build of torch cannot run on `device` is left out.
    """
    from labutils.core.devices import pick_device
    device = pick_device() if device is None else check_device("device", device)
    for name, value in (("n_out", n_out), ("n_in", n_in), ("batch", batch), ("rounds", rounds),
                        ("repeats", repeats)):
        check_count(name, value, 1)
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n_out, n_in, generator=g) * 0.02).to(device)
    x = torch.randn(batch, n_in, generator=g).to(device)
    q, scales = quantize_per_channel(w, scale_dtype(device, torch.float32))
    w16, x16 = w.to(torch.bfloat16), x.to(torch.bfloat16)
    fns = {"fp32": lambda: F.linear(x, w), "bf16": lambda: F.linear(x16, w16)}
    for name, kernel in KERNELS.items():
        if name.startswith("int8pack") and device.type == "cpu" and n_in % PACK_N_IN_MULTIPLE:
            continue                             # the CPU kernel would read past each row
        if name == "dequant_compiled" and device.type != "cuda":
            continue                             # CUDA's path; on a CPU inductor would spend seconds compiling it
        fns[name] = (lambda k: lambda: k(x, q, scales))(kernel)
    runnable = {}
    for name, fn in fns.items():
        try:
            fn()
            runnable[name] = fn
        except (RuntimeError, NotImplementedError):
            pass
    samples: dict[str, list[float]] = {name: [] for name in runnable}
    for _ in range(rounds):
        for name, fn in runnable.items():
            samples[name] += timing.time_fn(fn, device=device, warmup=2, repeats=repeats).samples_s
    return {name: statistics.median(s) for name, s in samples.items()}


def _greedy_agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(fraction of positions equal, mean tokens before the first difference) of two [batch, n] token tensors."""
    same = a == b
    first_diff = torch.where(same.all(dim=1), same.shape[1], (~same).int().argmax(dim=1))
    return float(same.float().mean()), float(first_diff.float().mean())


@torch.no_grad()
def compare(model: nn.Module, tokens: torch.Tensor | None = None, *, new_tokens: int = 32,
            n_prompts: int = 8, prompt_len: int = 16, logit_windows: int = 4) -> dict:
    """How an int8 copy of `model` compares with it: one row for the lesson to print.

    The model itself is left unquantized. `tokens` are held-out token ids (default: the course's
    held-out split, text.dataset.course_tokens()). Returns
      weight_bytes, int8_weight_bytes  roofline.weight_bytes of each model;
      logit_max_abs_err                max |int8 logit - float logit| over `logit_windows` windows;
      logit_rel_err                    ||int8 logits - float logits|| / ||float logits|| (Frobenius);
      greedy_agreement                 fraction of `new_tokens` greedy tokens equal, position by
                                       position, over `n_prompts` held-out prompts (generate());
      greedy_prefix                    mean greedy tokens before the first difference;
      heldout_loss, int8_heldout_loss  model.loss.heldout_loss of each model on `tokens` (nats/token).
    """
    from labutils.decode.loop import generate
    from labutils.text.dataset import course_tokens
    from labutils.model.loss import heldout_loss
    device = model_device(model)           # a name, a number or a model on meta: refused here, by name
    if is_quantized(model):
        raise ValueError("compare() takes the float model and quantizes a copy; this one is already int8")
    if tokens is None:
        _, tokens = course_tokens()
    int8 = quantize_(copy.deepcopy(model)).eval()
    seq = model.config.context_length
    n_windows = min(logit_windows, (len(tokens) - 1) // seq)
    if n_windows < 1 or len(tokens) < n_prompts * prompt_len:
        raise ValueError(f"need at least {max(seq + 1, n_prompts * prompt_len)} held-out tokens, got {len(tokens)}")
    windows = tokens[:n_windows * seq].view(n_windows, seq).to(device)
    ref, got = model(windows, check=False).float(), int8(windows, check=False).float()
    # Prompts spread evenly over the held-out tokens, decoded as one batch.
    step = len(tokens) // n_prompts
    prompts = torch.stack([tokens[i * step:i * step + prompt_len] for i in range(n_prompts)])
    agree, prefix = _greedy_agreement(generate(model, prompts, new_tokens).tokens,
                                      generate(int8, prompts, new_tokens).tokens)
    return {"dtype": _dtype_name(next(model.parameters()).dtype),
            "weight_bytes": roofline.weight_bytes(model), "int8_weight_bytes": roofline.weight_bytes(int8),
            "logit_max_abs_err": float((got - ref).abs().max()),
            "logit_rel_err": float((got - ref).norm() / ref.norm()),
            "greedy_agreement": agree, "greedy_prefix": prefix, "greedy_steps": new_tokens,
            "heldout_loss": heldout_loss(model, tokens), "int8_heldout_loss": heldout_loss(int8, tokens)}


__all__ = ["FALLBACK", "Int8Embedding", "Int8Linear", "KERNELS", "SUPPORTED", "check_supported", "compare",
           "dequantize", "int8_path", "int8_paths", "is_quantized", "quantize_", "quantize_per_channel",
           "scale_dtype"]
