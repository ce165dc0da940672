"""A GPT in one file: config with named presets, the blocks, the model, and checkpoints (course and GPT-2 format)."""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kernels import attention
from .presets import get_shape
from .safe_load import read_json, read_weights, torch_load, warn_nonfinite
from .validate import (check_cache, check_choice, check_count, check_device, check_flag, check_token_ids,
                       check_torch_dtype, describe)

from .paths import data_dir  # the one lookup for data/: a clear error outside a clone
DATA_DIR = data_dir()


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
        # One rule for every size (labutils.validate): 101.5 or True is refused; numpy ints become ints.
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
        """Named shapes from labutils.presets: "tiny", "gpt2-small" ... "llama-3-8b", "mistral-7b"."""
        s = get_shape(name)
        cfg = cls(vocab_size=s.vocab_size, context_length=s.context_length, n_layer=s.n_layer,
                  n_head=s.n_head, n_embd=s.n_embd, n_kv_head=s.n_kv_head, n_inner=s.n_inner,
                  gated_mlp=s.gated_mlp, bias=not s.gated_mlp, tie_weights=s.tie_weights)
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
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight


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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each pair (dim i, dim i + head_dim/2) of x [batch, heads, T, head_dim] by rope_angles' angles."""
    half = x.shape[-1] // 2
    work = torch.promote_types(x.dtype, cos.dtype)
    x1, x2 = x.to(work)[..., :half], x.to(work)[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, base: float = ROPE_BASE) -> torch.Tensor:
    """Rotate x [batch, heads, T, head_dim] by its positions pos ([T], or [batch, T] for a paged batch).

    Dim i and dim i + head_dim/2 form a pair (the Hugging Face Llama layout) turned by pos x base^(-2i/head_dim):
    fast turns in the first pairs, slow ones in the last. A rotation keeps lengths, and q.k of two rotated
    vectors depends only on the difference of their positions. No weights: a position costs no parameters.
    """
    return rotate(x, *rope_angles(pos, x.shape[-1], x.dtype, base))


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

    def forward(self, x: torch.Tensor, cache=None, pos: torch.Tensor | None = None) -> torch.Tensor:
        """pos: the positions of x's tokens (GPT.forward passes them); only RoPE reads them."""
        B, T, C = x.shape
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        q, k, v = self.qkv(x).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.rope:
            # Rotate before caching: a cached key keeps the rotation of the position it was written at.
            pos = torch.arange(T, device=x.device) if pos is None else pos
            cos, sin = rope_angles(pos, self.head_dim, q.dtype)          # once for q and k
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None and hasattr(cache, "attend"):
            # A packed batch (serving.paged_cache): many requests end to end, each attending to its own blocks.
            y = cache.attend(self.layer_idx, q, k, v, self.impl)
        else:
            q_offset, mask = 0, None
            if cache is not None:
                # KVCache returns the written prefix (mask None: causal by offset); a static cache returns
                # its whole buffer and the mask of the keys written so far (labutils.static_cache).
                mask = cache.mask
                q_offset = cache.pos if mask is None else 0
                k, v = cache.update(self.layer_idx, k, v)   # now every key and value so far
            y = attention(q, k, v, q_offset=q_offset, impl=self.impl, mask=mask)
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

    def forward(self, x, cache=None, pos=None):
        x = x + self.attn(self.ln_1(x), cache, pos)
        return x + self.mlp(self.ln_2(x))


# Deeper than any published model (Llama 3.1 405B has 126 layers); building 10**6 blocks would run for hours.
MAX_LAYERS = 1024


def check_buildable(config: GPTConfig) -> None:
    """Refuse a model this machine cannot build, before any parameter is allocated: too many layers, or
    more parameter bytes (in torch's default dtype, on its default device) than the free memory."""
    if not isinstance(config, GPTConfig):
        raise TypeError(f"GPT takes a GPTConfig, got {type(config).__name__}; use GPT(GPTConfig(...)) or "
                        "GPTConfig.preset(name)")
    if config.n_layer > MAX_LAYERS:
        raise ValueError(f"GPTConfig.n_layer={config.n_layer:,} is more than {MAX_LAYERS} layers, deeper than any "
                         "real model; building it would not finish. Choose a few to a hundred layers")
    device = torch.get_default_device()
    if device.type not in ("cpu", "cuda", "mps"):
        return                                   # meta and the like hold shapes, not memory
    from .hardware import free_memory_bytes
    from .validate import DoesNotFitError
    dtype = torch.get_default_dtype()
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
        if config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections so the residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * config.n_layer) ** 0.5)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Unique parameters: parameters() yields a tied tensor once, so the shared embedding counts once."""
        return sum(p.numel() for p in self.parameters())

    def set_attention(self, impl: str) -> "GPT":
        """Switch every layer between "naive" and "sdpa" attention."""
        from .kernels import ATTENTION_IMPLS
        check_choice("attention impl", impl, ATTENTION_IMPLS)
        for block in self.blocks:
            block.attn.impl = impl
        return self

    def check_ids(self, ids: torch.Tensor, start: int = 0) -> None:
        """Refuse input the model cannot embed, with a message that says how to fix it."""
        check_token_ids("ids", ids, self.config.vocab_size, self.config.context_length, start)

    def forward(self, ids: torch.Tensor, cache=None, *, check: bool = True, last_only: bool = False,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """ids [batch, seq] -> logits [batch, seq, vocab]. With a cache, ids continue from cache.pos.

        A cache is anything with begin(n) -> positions, update(layer, k, v) -> (keys, values), a
        `mask` (None, or [n, keys] bool), advance(n), pos and check_fits: kvcache.KVCache and
        static_cache.StaticKVCache both are. serving.paged_cache.PackedBatch lays many requests end to end in
        one row ([1, n], a position per token) and attends itself (`attend`), each request to its own keys.

        `check=False` skips input validation (a host sync); decode_step feeds the model's own
        argmax, which is always in range. `last_only=True` returns logits for the last position
        only ([batch, 1, vocab]): generation needs nothing else, and for a long prompt the output
        layer over every position is a large share of prefill's FLOPs and a [T, vocab] tensor.
        Training keeps every position. `logits_at` (token indices of row 0) returns those positions'
        logits only, [1, len(logits_at), vocab]: a packed batch needs each finished request's last token.
        """
        if check:
            if cache is not None:
                check_cache(cache, self)     # what it is, layers, heads, dtype, device: once per request, not per step
            # int(): a static cache keeps pos on the device; reading it is a host sync, like check_ids.
            self.check_ids(ids, int(cache.pos) if cache is not None else 0)
            if cache is not None:
                cache.check_fits(ids.shape[0], ids.shape[1])
        T = ids.shape[1]
        # The cache says where the new tokens sit: a Python int for KVCache, a device tensor for a
        # static cache (so a captured CUDA graph reads the position instead of baking it in).
        pos = torch.arange(T, device=ids.device) if cache is None else cache.begin(T)
        x = self.tok_emb(ids)
        if self.pos_emb is not None:
            x = x + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x, cache, pos)
        if cache is not None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:]
        elif logits_at is not None:
            x = x[:, logits_at]
        return self.lm_head(self.ln_f(x))


def _hf_gpt2_config(hf: dict, source="config.json") -> GPTConfig:
    """GPTConfig from a Hugging Face GPT-2 config.json; refuse the options our blocks do not implement."""
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{source} describes a {hf['model_type']!r} model; load_hf_gpt2 reads GPT-2 only")
    unsupported = {
        "activation_function": (hf.get("activation_function", "gelu_new"), ("gelu_new", "gelu_pytorch_tanh")),
        "layer_norm_epsilon": (hf.get("layer_norm_epsilon", 1e-5), (1e-5,)),
        "scale_attn_weights": (hf.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (hf.get("scale_attn_by_inverse_layer_idx", False), (False,)),
        "add_cross_attention": (hf.get("add_cross_attention", False), (False,)),
    }
    for key, (value, ok) in unsupported.items():
        if value not in ok:
            raise ValueError(f"{source} sets {key}={value!r}; this GPT implements only {ok}")
    hf = {"n_positions": hf.get("n_ctx"), **hf}   # very old GPT-2 configs call the context n_ctx
    missing = [k for k in ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd") if hf.get(k) is None]
    if missing:
        raise ValueError(f"{source} lacks {missing}; it is not a GPT-2 config")
    try:
        return GPTConfig(vocab_size=hf["vocab_size"], context_length=hf["n_positions"],
                         n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"],
                         n_inner=hf.get("n_inner"), tie_weights=hf.get("tie_word_embeddings", True))
    except (TypeError, ValueError) as err:
        raise type(err)(f"{source}: {err}") from None


def _hf_gpt2_names(cfg: GPTConfig) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """HF tensor name -> (our parameter, HF shape, transpose?).

    HF's GPT-2 uses Conv1D layers, which store weights as [in, out]; nn.Linear wants [out, in].
    c_attn's output is Q, K and V side by side, each split into heads, exactly like our fused qkv.
    """
    C, F_, V = cfg.n_embd, cfg.n_inner, cfg.vocab_size
    names = {"wte.weight": ("tok_emb.weight", (V, C), False),
             "wpe.weight": ("pos_emb.weight", (cfg.context_length, C), False)}
    for i in range(cfg.n_layer):
        for hf, ours, shape, transpose in [
            ("ln_1.weight", "ln_1.weight", (C,), False), ("ln_1.bias", "ln_1.bias", (C,), False),
            ("attn.c_attn.weight", "attn.qkv.weight", (C, 3 * C), True),
            ("attn.c_attn.bias", "attn.qkv.bias", (3 * C,), False),
            ("attn.c_proj.weight", "attn.proj.weight", (C, C), True),
            ("attn.c_proj.bias", "attn.proj.bias", (C,), False),
            ("ln_2.weight", "ln_2.weight", (C,), False), ("ln_2.bias", "ln_2.bias", (C,), False),
            ("mlp.c_fc.weight", "mlp.fc.weight", (C, F_), True), ("mlp.c_fc.bias", "mlp.fc.bias", (F_,), False),
            ("mlp.c_proj.weight", "mlp.proj.weight", (F_, C), True),
            ("mlp.c_proj.bias", "mlp.proj.bias", (C,), False),
        ]:
            names[f"h.{i}.{hf}"] = (f"blocks.{i}.{ours}", shape, transpose)
    names["ln_f.weight"] = ("ln_f.weight", (C,), False)
    names["ln_f.bias"] = ("ln_f.bias", (C,), False)
    if not cfg.tie_weights:
        names["lm_head.weight"] = ("lm_head.weight", (V, C), False)
    return names


def load_hf_gpt2(path: str | Path, device=None, dtype: torch.dtype = torch.float32) -> GPT:
    """Load a GPT-2 saved in Hugging Face format (config.json + model.safetensors or pytorch_model.bin).

    Every tensor is mapped by name and its shape checked, as nanoGPT's from_pretrained does;
    a missing, misshapen or unknown tensor raises ValueError naming it. Nothing is downloaded.
    """
    # Parsed here, once: a device this machine has, a float dtype ("fp16" or torch.float16), before any file is read.
    device = None if device is None else check_device("device", device)
    dtype = check_torch_dtype("dtype", dtype)
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json; point load_hf_gpt2 at a save_pretrained folder")
    cfg = _hf_gpt2_config(read_json(path / "config.json", "a GPT-2 config"), path / "config.json")
    raw = read_weights(path)     # inside `path` only; NaN/Inf tensors warn by name
    # GPT2LMHeadModel prefixes "transformer."; GPT2Model and the original OpenAI .bin files do not.
    prefix = "transformer." if any(k.startswith("transformer.") for k in raw) else ""
    state = {k.removeprefix("transformer."): v for k, v in raw.items()}
    names = _hf_gpt2_names(cfg)
    missing = [n for n in names if n not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"tensor {prefix + missing[0]!r}{more} is missing from {path}; "
                         "the checkpoint does not match its config.json")
    # attn.bias / attn.masked_bias are HF's causal-mask buffers, not parameters; a tied lm_head repeats wte.
    ignored = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$" + ("|lm_head\\.weight$" if cfg.tie_weights else ""))
    unknown = [k for k in state if k not in names and not ignored.match(k)]
    if unknown:
        raise ValueError(f"tensor {unknown[0]!r} in {path} has no place in a GPT-2 with {cfg.n_layer} layers; "
                         "the checkpoint does not match its config.json")
    model = GPT(cfg)
    params = dict(model.named_parameters())   # a tied lm_head appears once, as tok_emb.weight
    with torch.no_grad():
        for hf_name, (ours, shape, transpose) in names.items():
            w = state[hf_name]
            if tuple(w.shape) != shape:
                raise ValueError(f"tensor {prefix + hf_name!r} has shape {tuple(w.shape)}, but the config "
                                 f"(n_embd={cfg.n_embd}, vocab_size={cfg.vocab_size}) needs {shape}")
            params[ours].copy_(w.t() if transpose else w)
    return model.to(device=device, dtype=dtype).eval()


def save_hf_gpt2(model: GPT, path: str | Path, *, eos_token_id: int | None = None) -> Path:
    """Write `model` as a Hugging Face GPT-2 folder (config.json + model.safetensors): load_hf_gpt2's inverse.

    Any server that reads GPT2LMHeadModel folders (vLLM, SGLang, TGI, transformers) can then load the
    course's own model. eos_token_id defaults to the last id, where GPT-2 and the course encoding
    both keep <|endoftext|>. Returns the folder.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"save_hf_gpt2 takes a labutils GPT, got {type(model).__name__}")
    cfg = model.config
    unsupported = {"gated_mlp": (cfg.gated_mlp, False), "bias": (cfg.bias, True),
                   "n_kv_head": (cfg.n_kv_head, cfg.n_head), "norm": (cfg.norm, "layernorm"), "rope": (cfg.rope, False)}
    for key, (value, gpt2) in unsupported.items():
        if value != gpt2:
            raise ValueError(f"config {key}={value!r} has no GPT-2 equivalent (GPT-2 has {key}={gpt2!r}); "
                             "save_hf_gpt2 writes GPT-2-shaped models only")
    params = dict(model.named_parameters())
    names = _hf_gpt2_names(cfg)
    missing = sorted({ours for ours, _, _ in names.values()} - params.keys())
    if missing:
        raise ValueError(f"the model has no parameter {missing[0]!r}; a quantized model (quant.quantize_) "
                         "cannot be written as GPT-2: save the fp32/bf16 model before quantizing")
    if eos_token_id is None:
        eos_token_id = cfg.vocab_size - 1
    if not 0 <= eos_token_id < cfg.vocab_size:
        raise ValueError(f"eos_token_id={eos_token_id} is outside the vocab of size {cfg.vocab_size}")
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ImportError("save_hf_gpt2 writes safetensors: pip install safetensors") from None
    # Conv1D stores [in, out]: transpose back. contiguous() gives each tensor its own storage,
    # which safetensors requires (a tied lm_head is simply not written, as save_pretrained does).
    tensors = {"transformer." + hf: (params[ours].t() if transpose else params[ours]).detach().cpu().contiguous()
               for hf, (ours, _, transpose) in names.items()}
    if "transformer.lm_head.weight" in tensors:
        tensors["lm_head.weight"] = tensors.pop("transformer.lm_head.weight")
    dtype = next(iter(tensors.values())).dtype
    hf_config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.context_length, "n_ctx": cfg.context_length,
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": cfg.n_inner,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": cfg.tie_weights, "bos_token_id": eos_token_id, "eos_token_id": eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_checkpoint(path: str | Path, map_location="cpu") -> GPT:
    """Load a course checkpoint: a folder with config.json and model.pt (a state_dict)."""
    path = Path(path)
    if not (path / "config.json").exists() or not (path / "model.pt").exists():
        raise FileNotFoundError(f"{path} needs config.json and model.pt; rebuild the course checkpoints "
                                "with `python -m labutils.train` (data/tiny) or `... --model draft` (data/draft)")
    raw = read_json(path / "config.json", "a GPTConfig")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    if unknown := sorted(set(raw) - fields):
        raise ValueError(f"{path / 'config.json'} has unknown field(s) {unknown}; a GPTConfig has {sorted(fields)}")
    try:
        cfg = GPTConfig(**raw)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{path / 'config.json'}: {err}") from None
    model = GPT(cfg)
    state = torch_load(path / "model.pt")       # weights_only=True; the message never says otherwise
    if not isinstance(state, dict):
        raise ValueError(f"{path / 'model.pt'} holds a {type(state).__name__}, not a state_dict")
    warn_nonfinite(state, path / "model.pt")
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(f"{path / 'model.pt'} does not match {path / 'config.json'}: "
                         f"{' '.join(str(err).split())[:400]}") from None
    return model.eval()


def save_checkpoint(model: GPT, path: str | Path) -> None:
    if not isinstance(model, GPT):
        raise TypeError(f"save_checkpoint(model, path) takes the GPT first, got {describe(model)}; the folder "
                        "comes second")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dataclasses.asdict(model.config), indent=2) + "\n")
    torch.save(model.state_dict(), path / "model.pt")   # a tied tensor is stored once


PRETRAINED = ("tiny", "draft")   # the folders in data/ that `python -m labutils.train --model NAME` rebuilds


def load_pretrained(name: str = "tiny", map_location="cpu"):
    """A course checkpoint from data/<name> (fp32, eval mode) and the course encoding it reads.

    "tiny" is the trained 4-layer GPT of lessons 04-06; "draft" is its 1-layer speculative draft
    (lesson 10), trained on the same corpus with the same tokenizer. Both come from files in the
    repository: nothing is downloaded. Returns (model, encoding).
    """
    from .tokenizer import get_encoding
    if name not in PRETRAINED:
        raise ValueError(f"unknown course checkpoint {name!r}; choose one of {list(PRETRAINED)}")
    model = load_checkpoint(DATA_DIR / name, map_location=map_location)
    enc = get_encoding("course")
    if enc.n_vocab != model.config.vocab_size:
        raise ValueError(f"data/{name} expects a vocab of {model.config.vocab_size} but the course encoding "
                         f"has {enc.n_vocab}; rebuild the checkpoint with `python -m labutils.train --model {name}`")
    return model, enc
