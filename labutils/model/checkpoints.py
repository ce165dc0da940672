"""Checkpoints: the course's own (data/), and GPT-2 in Hugging Face format, loaded and saved."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch

from labutils.model.safe_load import read_json, read_weights, tensor_dict, torch_load, warn_nonfinite
from labutils.core.validate import check_device, check_path, parse_dtype, describe
from labutils.core.paths import data_dir
from labutils.model.gpt import GPT, GPTConfig


DATA_DIR = data_dir()


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
    dtype = parse_dtype("dtype", dtype)
    path = check_path("path", path)
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
    path = check_path("path", path)          # "" would write config.json and the weights into the current folder
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
    path = check_path("path", path)
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
    # weights_only=True, and the message never says otherwise; then a dict of name -> tensor, or refused by entry
    state = tensor_dict(path / "model.pt", torch_load(path / "model.pt"))
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
    path = check_path("path", path)          # "" would write config.json and model.pt into the current folder
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
    from labutils.text.tokenizer import get_encoding
    if name not in PRETRAINED:
        raise ValueError(f"unknown course checkpoint {name!r}; choose one of {list(PRETRAINED)}")
    model = load_checkpoint(DATA_DIR / name, map_location=map_location)
    enc = get_encoding("course")
    if enc.n_vocab != model.config.vocab_size:
        raise ValueError(f"data/{name} expects a vocab of {model.config.vocab_size} but the course encoding "
                         f"has {enc.n_vocab}; rebuild the checkpoint with `python -m labutils.train --model {name}`")
    return model, enc


__all__ = ['DATA_DIR', 'PRETRAINED', 'load_checkpoint', 'load_hf_gpt2', 'load_pretrained', 'save_checkpoint', 'save_hf_gpt2']
