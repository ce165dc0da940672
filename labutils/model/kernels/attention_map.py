"""What a model's layer attends to: its attention weights, recomputed from the layer's own queries and keys."""
from __future__ import annotations

import torch

from labutils.core.validate import check_count
from labutils.model.kernels.attention import attention_weights


def model_attention_weights(model, ids, layer: int = 0) -> torch.Tensor:
    """[n_head, T, T] attention weights of one layer of a course GPT for one prompt of token ids.

    A forward hook catches the layer's fused qkv projection during an ordinary forward pass, and the
    weights come from the same formula naive attention uses, so the model itself is left untouched.
    """
    n_layer = model.config.n_layer
    layer = check_count("layer", layer, 0, n_layer - 1, hint=f"this model has layers 0..{n_layer - 1}")
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"ids must be one non-empty prompt (a 1-D list of token ids), got shape {tuple(ids.shape)}")
    attn, caught = model.blocks[layer].attn, {}
    hook = attn.qkv.register_forward_hook(lambda _mod, _inp, out: caught.setdefault("qkv", out))
    try:
        with torch.no_grad():
            model(ids[None].to(next(model.parameters()).device))
    finally:
        hook.remove()
    T, d = ids.numel(), attn.head_dim
    q, k, _ = caught["qkv"][0].split([attn.n_head * d, attn.n_kv_head * d, attn.n_kv_head * d], dim=-1)
    q = q.view(T, attn.n_head, d).transpose(0, 1)[None]       # [1, n_head, T, d], as the layer shapes it
    k = k.view(T, attn.n_kv_head, d).transpose(0, 1)[None]
    return attention_weights(q, k)[0].cpu()
