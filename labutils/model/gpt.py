"""A GPT in one file: the config with named presets, the blocks, the model."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from labutils.model.kernels import attention
from labutils.model.presets import get_shape
from labutils.core.validate import check_choice, check_count, check_flag, check_token_ids, describe
from labutils.model.cache import Cache


@dataclass(frozen=True)
class GPTConfig:
    """Every shape of the model. Random weights of a preset's shape are enough for timing."""

    vocab_size: int = 50257
    context_length: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_kv_head: int | None = None   # None means n_head; fewer gives GQA, 1 gives MQA
    n_inner: int | None = None     # feed-forward width; None means 4 * n_embd (GPT-2)
    gated_mlp: bool = False        # SwiGLU feed-forward, as in the Llama family
    bias: bool = True
    tie_weights: bool = True       # GPT-2 reuses the token embedding as the output layer
    norm: str = "layernorm"        # "rmsnorm" (Llama): scale only, no mean, no bias
    rope: bool = False             # rotary positions (Llama): rotate q and k, no learned position table

    def __post_init__(self):
        # One rule for every size (labutils.core.validate): 101.5 or True is refused; numpy ints become ints.
        for field in ("vocab_size", "context_length", "n_layer", "n_head", "n_embd"):
            object.__setattr__(self, field, check_count(f"GPTConfig.{field}", getattr(self, field), 1))
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.n_inner is None:
            object.__setattr__(self, "n_inner", 4 * self.n_embd)
        for field in ("n_kv_head", "n_inner"):
            object.__setattr__(self, field, check_count(f"GPTConfig.{field}", getattr(self, field), 1))
        for field in ("gated_mlp", "bias", "tie_weights", "rope"):
            object.__setattr__(self, field, check_flag(f"GPTConfig.{field}", getattr(self, field)))
        object.__setattr__(self, "norm", check_choice("GPTConfig.norm", self.norm, NORMS))
        if self.rope and self.head_dim % 2:
            raise ValueError(f"rope=True rotates pairs of dims, so head_dim (n_embd / n_head = {self.head_dim}) "
                             "must be even; change n_embd or n_head")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head} "
                             f"(each head gets n_embd / n_head dims)")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head} "
                             f"(each KV head serves an equal group of query heads)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def learned_positions(self) -> bool:
        """A position table exists only without RoPE (the same name as presets.ModelShape's field)."""
        return not self.rope

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """Named shapes from labutils.model.presets: "tiny", "gpt2-small" ... "llama-3-8b", "mistral-7b"."""
        s = get_shape(name)
        # The Llama family (no position table) rotates q and k and normalises with RMSNorm; GPT-2 learns positions.
        cfg = cls(vocab_size=s.vocab_size, context_length=s.context_length, n_layer=s.n_layer,
                  n_head=s.n_head, n_embd=s.n_embd, n_kv_head=s.n_kv_head, n_inner=s.n_inner,
                  gated_mlp=s.gated_mlp, bias=not s.gated_mlp, tie_weights=s.tie_weights,
                  rope=not s.learned_positions, norm="layernorm" if s.learned_positions else "rmsnorm")
        return dataclasses.replace(cfg, **overrides)

    def num_params(self) -> int:
        """Parameter count from the shapes alone (matches GPT.num_params for this architecture)."""
        C, b = self.n_embd, int(self.bias)
        qkv_out = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        attn = C * qkv_out + b * qkv_out + C * C + b * C
        n_up = 2 if self.gated_mlp else 1     # SwiGLU has a gate matrix beside the up projection
        mlp = (n_up + 1) * C * self.n_inner + b * (n_up * self.n_inner + C)
        norm = 2 * C if self.norm == "layernorm" else C   # LayerNorm: weight + bias; RMSNorm: weight
        per_block = attn + mlp + 2 * norm
        embed = self.vocab_size * C + (self.context_length * C if self.learned_positions else 0)
        head = 0 if self.tie_weights else self.vocab_size * C
        return embed + self.n_layer * per_block + norm + head


NORMS = ("layernorm", "rmsnorm")
ROPE_BASE = 10_000.0     # Llama-2's rotary base (config.json rope_theta)


class RMSNorm(nn.Module):
    """x / rms(x) * weight: LayerNorm without the mean and the bias (Llama). One weight per channel."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # x * rsqrt(mean(x^2) + eps) * weight, as one op: five from Python cost a GPU five launches (lesson 08)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(cfg: GPTConfig) -> nn.Module:
    return RMSNorm(cfg.n_embd) if cfg.norm == "rmsnorm" else nn.LayerNorm(cfg.n_embd)


def rope_angles(pos: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32,
                base: float = ROPE_BASE) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles for positions pos ([T], or [batch, T] for a paged batch), shaped to
    broadcast over [batch, heads, T, head_dim / 2]: pos x base^(-2i/head_dim) for pair i, computed in `dtype`
    or float32, whichever is wider."""
    half = head_dim // 2
    work = torch.promote_types(dtype, torch.float32)     # bf16/fp16 angles would be off by whole turns
    inv_freq = base ** (-torch.arange(half, device=pos.device, dtype=work) / half)
    angles = pos.to(work)[..., None] * inv_freq                     # [T, half] or [batch, T, half]
    angles = angles[None, None] if angles.dim() == 2 else angles[:, None]
    return angles.cos(), angles.sin()


def rotation(pos: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32,
             base: float = ROPE_BASE) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_angles' cos and sin laid out for rotate, head_dim wide, (cos, cos) and (-sin, sin), in `dtype`: the angles
    are worked out in float32 at least, then cast once, as Hugging Face's Llama casts them to the model's dtype. Made
    once a forward for every layer, so that a layer's turn is four ops and no cast."""
    cos, sin = rope_angles(pos, head_dim, dtype, base)
    return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each pair (dim i, dim i + head_dim/2) of x [batch, heads, T, head_dim] by rotation's cos and sin:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), in x's dtype where cos and sin are in it (rotation's are).

    Written as x * (cos, cos) + (x2, x1) * (-sin, sin): four ops (a cat, two multiplies, an add), where halves took
    eight and a cast each way two more, each a kernel launch on a GPU (lesson 08). The values are those of the
    pairwise turn to the bit: negating a product is exact."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin


def rope(x: torch.Tensor, pos: torch.Tensor, base: float = ROPE_BASE) -> torch.Tensor:
    """Rotate x [batch, heads, T, head_dim] by its positions pos ([T], or [batch, T] for a paged batch).

    Dim i and dim i + head_dim/2 form a pair (the Hugging Face Llama layout) turned by pos x base^(-2i/head_dim):
    fast turns in the first pairs, slow ones in the last. A rotation keeps lengths, and q.k of two rotated
    vectors depends only on the difference of their positions. No weights: a position costs no parameters.
    """
    return rotate(x, *rotation(pos, x.shape[-1], x.dtype, base))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # One fused projection for Q, K and V; with GQA the K and V parts are narrower.
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.impl = "sdpa"
        self.rope = cfg.rope
        self.layer_idx = 0   # set by GPT: which slot of the KV cache this layer owns

    def forward(self, x: torch.Tensor, cache=None, rot: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """rot: RoPE's (cos, sin) for x's tokens, from rotation; GPT.forward makes them once for every layer."""
        B, T, C = x.shape
        # [batch, heads, T, head_dim], the layout attention and the caches take: q's heads, k's, then v's
        qkv = self.qkv(x).view(B, T, self.n_head + 2 * self.n_kv_head, self.head_dim).transpose(1, 2)
        qk, v = qkv.split([self.n_head + self.n_kv_head, self.n_kv_head], dim=1)
        if self.rope:
            # Rotate before caching: a cached key keeps the rotation of the position it was written at. q and k
            # turn together, in one rotate: each op a layer runs is a launch on a GPU, and its host's time.
            cos, sin = rot if rot is not None else rotation(torch.arange(T, device=x.device), self.head_dim, x.dtype)
            qk = rotate(qk, cos, sin)
        q, k = qk.split([self.n_head, self.n_kv_head], dim=1)
        if cache is None:
            y = attention(q, k, v, impl=self.impl)                      # causal over this forward's tokens
        else:
            y = cache.attend(self.layer_idx, q, k, v, self.impl)       # the cache stores k, v, then attends
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gated = cfg.gated_mlp
        self.fc = nn.Linear(cfg.n_embd, cfg.n_inner, bias=cfg.bias)
        if self.gated:
            self.gate = nn.Linear(cfg.n_embd, cfg.n_inner, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_inner, cfg.n_embd, bias=cfg.bias)

    def forward(self, x):
        if self.gated:
            return self.proj(F.silu(self.gate(x)) * self.fc(x))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))   # GPT-2's tanh GELU


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, cache=None, rot=None):
        x = x + self.attn(self.ln_1(x), cache, rot)
        return x + self.mlp(self.ln_2(x))


# Deeper than any published model (Llama 3.1 405B has 126 layers); building 10**6 blocks would run for hours.
MAX_LAYERS = 1024


def check_buildable(config: GPTConfig, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
    """Refuse a model this machine cannot build, before any parameter is allocated: too many layers, or
    more parameter bytes (in `dtype` on `device`; by default torch's default dtype and device) than the free
    memory."""
    if not isinstance(config, GPTConfig):
        raise TypeError(f"GPT takes a GPTConfig, got {type(config).__name__}; use GPT(GPTConfig(...)) or "
                        "GPTConfig.preset(name)")
    if config.n_layer > MAX_LAYERS:
        raise ValueError(f"GPTConfig.n_layer={config.n_layer:,} is more than {MAX_LAYERS} layers, deeper than any "
                         "real model; building it would not finish. Choose a few to a hundred layers")
    device = torch.get_default_device() if device is None else torch.device(device)
    if device.type not in ("cpu", "cuda", "mps"):
        return                                   # meta and the like hold shapes, not memory
    from labutils.core.devices import free_memory_bytes
    from labutils.core.validate import DoesNotFitError
    dtype = torch.get_default_dtype() if dtype is None else dtype
    n_params = config.num_params()
    need, free = n_params * dtype.itemsize, free_memory_bytes(device)
    if free is not None and need > 0.9 * free:
        raise DoesNotFitError(f"this GPT has {n_params:,} parameters, {need / 1e9:,.1f} GB in {dtype}, "
                              f"but only {free / 1e9:.1f} GB is free on {device.type}; choose a smaller shape "
                              "(fewer layers, a smaller width or vocab)")


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        check_buildable(config)
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        # With RoPE the positions live in attention's rotation: no table (None keeps the attribute for readers).
        self.pos_emb = nn.Embedding(config.context_length, config.n_embd) if config.learned_positions else None
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        for i, block in enumerate(self.blocks):
            block.attn.layer_idx = i
        self.ln_f = make_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()

    def tie_weights(self) -> "GPT":
        """GPT-2 reuses the token embedding as the output layer (config.tie_weights): one tensor, counted once.
        Moving a model to new memory (to_empty, in model.build) makes a tensor per module, so it ties them again."""
        if self.config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        return self

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> "GPT":
        """GPT-2's initialisation, module by module, in place, wherever the weights live (model.build fills a model
        allocated on the device this way, with a generator on that device)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02, generator=generator)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, (nn.LayerNorm, RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        # GPT-2: scale the residual projections so the residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * self.config.n_layer) ** 0.5, generator=generator)
        return self

    def num_params(self) -> int:
        """Unique parameters: parameters() yields a tied tensor once, so the shared embedding counts once."""
        return sum(p.numel() for p in self.parameters())

    def set_attention(self, impl: str) -> "GPT":
        """Switch every layer between "naive" and "sdpa" attention."""
        from labutils.model.kernels import ATTENTION_IMPLS
        check_choice("attention impl", impl, ATTENTION_IMPLS)
        for block in self.blocks:
            block.attn.impl = impl
        return self

    def check_ids(self, ids: torch.Tensor, start: int = 0) -> None:
        """Refuse input the model cannot embed, with a message that says how to fix it."""
        check_token_ids("ids", ids, self.config.vocab_size, self.config.context_length, start)

    def forward(self, ids: torch.Tensor, cache=None, *, check: bool = True, last_only: bool = False,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """ids [batch, seq] -> logits [batch, seq, vocab]. With a cache, ids continue where it left off.

        A cache is a model.cache.Cache: check, begin, attend, advance. decode.kvcache.KVCache,
        decode.static_cache.StaticKVCache and serving.paged_cache.PackedBatch (many requests end to end in one
        row, [1, n], a position per token, each attending to its own keys) all are.

        `check=False` skips input validation (a host sync); decode_step feeds the model's own
        argmax, which is always in range. `last_only=True` returns logits for the last position
        only ([batch, 1, vocab]): generation needs nothing else, and for a long prompt the output
        layer over every position is a large share of prefill's FLOPs and a [T, vocab] tensor.
        Training keeps every position. `logits_at` (token indices of row 0) returns those positions'
        logits only, [1, len(logits_at), vocab]: a packed batch needs each finished request's last token.
        """
        if check:
            if cache is None:
                self.check_ids(ids)
            elif isinstance(cache, Cache):
                cache.check(self, ids)       # the cache's own checks (KVCache: layers, heads, dtype, device, room)
            else:
                raise TypeError(f"cache must be a KVCache (or StaticKVCache) built for the model, got "
                                f"{describe(cache)}; make one with KVCache(model.config, batch_size, max_len)")
        T = ids.shape[1]
        # The cache says where the new tokens sit: a range from a Python int for KVCache, from a device tensor
        # for a static cache (so a captured CUDA graph reads the position instead of baking it in).
        pos = torch.arange(T, device=ids.device) if cache is None else cache.begin(T)
        x = self.tok_emb(ids)
        if self.pos_emb is not None:
            x = x + self.pos_emb(pos)
        rot = rotation(pos, self.config.head_dim, x.dtype) if self.config.rope else None   # once, for every layer
        for block in self.blocks:
            x = block(x, cache, rot)
        if cache is not None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:]
        elif logits_at is not None:
            x = x[:, logits_at]
        return self.lm_head(self.ln_f(x))


__all__ = ['Block', 'CausalSelfAttention', 'GPT', 'GPTConfig', 'MAX_LAYERS', 'MLP', 'NORMS', 'RMSNorm', 'ROPE_BASE',
           'check_buildable', 'make_norm', 'rope', 'rope_angles', 'rotate', 'rotation']
