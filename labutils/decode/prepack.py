"""CPU weight layouts: column-major weights, and prepacking (every nn.Linear multiplies through oneDNN with its
weight reordered once). Both change how a weight lies in memory, never its values or shapes.

On the course's CPUs, PyTorch's default fp32 matmul (MKL) costs about twice as much for 5 rows as
for 1 with a small model's weights: it is bound by arithmetic, not by reading the weights. That
spoils what speculative decoding relies on, that a verify pass over k + 1 tokens costs about as
much as one decode step (lesson 10 measures both lines). oneDNN with a weight prepacked into its
blocked layout multiplies a few rows for little more than one: the memory-bound behaviour. PyTorch's
own inductor prepacks weights this way when it freezes a model for CPU inference; prepack_linears does
only that step, in eager mode.

A prepacked kernel also does each row's sums in the same order whatever the number of rows, so a
row's output is bit-identical in a verify pass of 5 tokens and in a decode step of 1 (checked by
`tests/test_prepack.py` on the machine it runs on). That is what lets the bench assert identical
tokens between speculative and plain greedy decoding on a prepacked model.
"""
from __future__ import annotations

import torch
from torch import nn

from labutils.core.validate import check_count

# oneDNN picks its blocked layout from a batch-size hint. A hint of 1 selects a matrix-vector layout
# whose sums change order with the number of rows; from 4 up, rows were bit-identical for any count
# (1 ... 300 checked) and a few rows cost little more than one.
BATCH_HINT = 8


def prepack_unavailable(model) -> str | None:
    """Why `model` cannot be prepacked here, or None when it can."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this PyTorch build has no oneDNN (mkldnn) CPU kernels"
    p = next(model.parameters(), None)
    if p is None:
        return "the model has no parameters"
    if p.device.type != "cpu":
        return f"prepacking is a CPU layout; the model is on {p.device} (GPU matmuls need no such step)"
    if p.dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN prepacks float32 and bfloat16 weights, not {p.dtype}"
    return None


class PackedLinear(nn.Module):
    """An nn.Linear whose forward multiplies by a oneDNN-prepacked copy of its weight.

    The original weight and bias stay parameters (so devices, dtypes and byte counts still read
    them, and a tied weight stays shared); the packed weight is a plain attribute, made once. It is a
    snapshot: changing `weight` afterwards does not change the output, so prepack for inference only.
    """

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.packed_bias = None if linear.bias is None else linear.bias.detach()   # detached once, not per call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.packed_bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked for oneDNN"


def prepack_linears(model: nn.Module, batch_hint: int = BATCH_HINT) -> nn.Module:
    """Replace every nn.Linear of a CPU model by a PackedLinear, in place; returns the model.

    Move the model to its device and dtype first: the packed copies do not follow `.to()`.
    Raises ValueError, saying why, where prepacking does not apply (a GPU, another dtype, no oneDNN).
    """
    check_count("batch_hint", batch_hint, 1)
    reason = prepack_unavailable(model)
    if reason:
        raise ValueError(f"cannot prepack this model: {reason}. Use it as it is")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child, batch_hint))
    return model


@torch.no_grad()
def column_major_weights(model):
    """Store every nn.Linear weight (and a tied embedding) transposed in memory; same shapes, same values.

    A decode step multiplies one row of activations by each weight (a GEMV). CPU BLAS libraries
    stream a weight stored [in, out] (column-major for its [out, in] shape) faster than the
    row-major one nn.Linear allocates on some CPUs; Hugging Face's GPT-2 (Conv1D) stores its
    blocks that way. Whether it wins here is measured, not assumed: the bench rows run with it
    on CPU, and lesson 08 times both layouts. Returns the model, changed in place.
    """
    seen: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            w = module.weight
            if id(w) not in seen:      # a tied tensor is moved once and stays shared
                seen[id(w)] = torch.nn.Parameter(w.t().contiguous().t(), requires_grad=w.requires_grad)
            module.weight = seen[id(w)]
    return model


__all__ = ["BATCH_HINT", "PackedLinear", "column_major_weights", "prepack_linears", "prepack_unavailable"]
