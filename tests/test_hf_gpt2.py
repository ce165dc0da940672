"""load_hf_gpt2 against Hugging Face's own GPT2LMHeadModel, and reading .safetensors files (safe_load)."""
import json
import struct

import pytest
import torch

from labutils.model.checkpoints import load_hf_gpt2
from labutils.model.safe_load import read_safetensors

VOCAB, CTX = 97, 40


# safetensors dtype names; tests write the format by hand so that they can also write damaged files.
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}


def write_safetensors(tensors: dict, path) -> None:
    """The format by hand: 8-byte header length, JSON header, then each tensor's bytes."""
    names = DTYPE_NAMES
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


# ---- the reader, no transformers needed -------------------------------------------------------

def test_reader_round_trips_every_dtype(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g), "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(2, 2, 2, generator=g).bfloat16(), "f64": torch.randn(4, generator=g).double(),
        "i64": torch.arange(-3, 3), "u8": torch.arange(10, dtype=torch.uint8), "empty": torch.zeros(0, 4),
        "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5),
    }
    write_safetensors(tensors, tmp_path / "t.safetensors")
    back = read_safetensors(tmp_path / "t.safetensors")
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name


def test_reader_agrees_with_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    tensors = {"a": torch.randn(4, 6), "b": torch.randn(5).half(), "c": torch.arange(12).view(3, 4)}
    st.save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})   # __metadata__ is skipped
    back = read_safetensors(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_reader_refuses_damaged_files(tmp_path):
    (tmp_path / "short").write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="too short"):
        read_safetensors(tmp_path / "short")
    (tmp_path / "huge_header").write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(ValueError, match="header length"):
        read_safetensors(tmp_path / "huge_header")
    write_safetensors({"w": torch.randn(8, 8)}, tmp_path / "t.safetensors")
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    with pytest.raises(ValueError, match="'w'.*truncated"):
        read_safetensors(tmp_path / "cut.safetensors")


# ---- against transformers -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=CTX,
                                  bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    # GPT-2's init leaves biases at 0 and LayerNorms at 1; perturb everything so a dropped bias
    # or a missing transpose of a square matrix (attn.c_proj) changes the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def saved(hf_model, tmp_path_factory):
    """The same model as model.safetensors, sharded safetensors, save_pretrained's .bin and a legacy .bin."""
    root = tmp_path_factory.mktemp("hf")
    hf_model.save_pretrained(root / "safetensors")
    hf_model.save_pretrained(root / "sharded", max_shard_size="40KB")
    assert (root / "sharded" / "model.safetensors.index.json").exists()
    hf_model.save_pretrained(root / "hf_bin", safe_serialization=False)   # transformers >= 5 ignores this
    # The original OpenAI GPT-2 .bin files: no "transformer." prefix, plus the causal-mask buffers.
    # (transformers >= 5 no longer writes .bin, so we write what older versions wrote.)
    legacy = root / "bin"
    legacy.mkdir()
    (legacy / "config.json").write_text((root / "safetensors" / "config.json").read_text())
    state = {k.removeprefix("transformer."): v.clone() for k, v in hf_model.state_dict().items()}
    for i in range(hf_model.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(CTX, CTX, dtype=torch.bool))[None, None]
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, legacy / "pytorch_model.bin")
    return root


@pytest.mark.parametrize("layout", ["safetensors", "sharded", "hf_bin", "bin"])
def test_logits_match_transformers(hf_model, saved, layout, record_property):
    if layout == "hf_bin" and not (saved / layout / "pytorch_model.bin").exists():
        pytest.skip("this transformers version writes only safetensors (the 'bin' case covers .bin files)")
    model = load_hf_gpt2(saved / layout)
    assert model.config.n_layer == 2 and model.config.context_length == CTX and model.config.vocab_size == VOCAB
    ids = torch.randint(0, VOCAB, (2, CTX), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model(ids).logits
        got = model(ids)
    diff = (want - got).abs().max().item()
    record_property("max_abs_diff", diff)
    print(f"{layout}: max |logits - transformers| = {diff:.2e}")
    assert diff < 1e-4
    assert model.lm_head.weight is model.tok_emb.weight   # tied, as in GPT-2


def test_loaded_model_generates_like_transformers_with_a_cache(hf_model, saved):
    """Chunked prefill + decode through our KV cache gives HF's full-sequence logits."""
    from labutils.decode.kvcache import KVCache

    model = load_hf_gpt2(saved / "safetensors")
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = KVCache(model.config, batch_size=1, max_len=16)
    with torch.no_grad():
        want = hf_model(ids).logits
        got = torch.cat([model(ids[:, :7], cache)] + [model(ids[:, t:t + 1], cache) for t in range(7, 12)], dim=1)
    assert (want - got).abs().max().item() < 1e-4


def _copy_with(saved, tmp_path, edit):
    """A copy of the safetensors checkpoint with `edit(tensors)` applied."""
    tensors = read_safetensors(saved / "safetensors" / "model.safetensors")
    edit(tensors)
    write_safetensors(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((saved / "safetensors" / "config.json").read_text())
    return tmp_path


def test_missing_tensor_is_named(saved, tmp_path):
    path = _copy_with(saved, tmp_path, lambda t: t.pop("transformer.h.1.mlp.c_fc.weight"))
    with pytest.raises(ValueError, match=r"'transformer\.h\.1\.mlp\.c_fc\.weight' is missing"):
        load_hf_gpt2(path)


def test_misshapen_tensor_is_named(saved, tmp_path):
    def edit(t):
        t["transformer.h.0.attn.c_proj.weight"] = torch.randn(64, 65)
    with pytest.raises(ValueError, match=r"'transformer\.h\.0\.attn\.c_proj\.weight' has shape \(64, 65\)"):
        load_hf_gpt2(_copy_with(saved, tmp_path, edit))


def test_unknown_tensor_is_named(saved, tmp_path):
    def edit(t):
        t["transformer.h.2.ln_1.weight"] = torch.ones(64)   # a third layer the config does not have
    with pytest.raises(ValueError, match=r"'h\.2\.ln_1\.weight'"):
        load_hf_gpt2(_copy_with(saved, tmp_path, edit))


def test_unsupported_config_is_refused(saved, tmp_path):
    path = _copy_with(saved, tmp_path, lambda t: None)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "scale_attn_by_inverse_layer_idx": True}))
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        load_hf_gpt2(path)
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match="GPT-2 only"):
        load_hf_gpt2(path)
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "n_layer"}))
    with pytest.raises(ValueError, match="lacks \\['n_layer'\\]"):
        load_hf_gpt2(path)


def test_missing_files_say_what_is_needed(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_gpt2(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10, "n_positions": 8,
                                                      "n_layer": 1, "n_head": 1, "n_embd": 4}))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_gpt2(tmp_path)


# ---- save_hf_gpt2, the inverse ------------------------------------------------------------------

def _perturbed_gpt(**overrides):
    """A random GPT whose biases and LayerNorms are not at their init values, so a dropped or
    swapped tensor, or a square matrix left untransposed, changes the logits."""
    from labutils.model.gpt import GPT, GPTConfig

    torch.manual_seed(3)
    model = GPT(GPTConfig(**{"vocab_size": VOCAB, "context_length": CTX, "n_layer": 2, "n_head": 4, "n_embd": 64,
                             **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("tie", [True, False])
def test_save_then_load_gives_identical_logits(tmp_path, tie):
    from labutils.model.checkpoints import save_hf_gpt2

    model = _perturbed_gpt(tie_weights=tie)
    assert save_hf_gpt2(model, tmp_path / "m") == tmp_path / "m"
    back = load_hf_gpt2(tmp_path / "m")
    assert back.config == model.config
    assert (back.lm_head.weight is back.tok_emb.weight) == tie
    ids = torch.randint(0, VOCAB, (2, CTX), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))     # a transpose and its inverse lose nothing
    written = read_safetensors(tmp_path / "m" / "model.safetensors")
    assert ("lm_head.weight" in written) == (not tie)   # a tied head is stored once, as wte
    assert written["transformer.h.0.attn.c_attn.weight"].shape == (64, 3 * 64)   # Conv1D: [in, out]


def test_saved_model_loads_in_transformers_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    from labutils.model.checkpoints import save_hf_gpt2

    model = _perturbed_gpt()
    save_hf_gpt2(model, tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert hf.config.n_positions == CTX and hf.config.vocab_size == VOCAB and hf.config.eos_token_id == VOCAB - 1
    ids = torch.randint(0, VOCAB, (2, CTX), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = (hf(ids).logits - model(ids)).abs().max().item()
    assert diff < 1e-4


def test_the_trained_tiny_model_round_trips(tmp_path):
    from labutils.model.checkpoints import load_pretrained, save_hf_gpt2

    model, enc = load_pretrained()
    save_hf_gpt2(model, tmp_path)
    ids = torch.tensor([enc.encode("Return the number of items in the list.")])
    with torch.no_grad():
        assert torch.equal(load_hf_gpt2(tmp_path)(ids), model(ids))


def test_save_refuses_what_gpt2_cannot_express(tmp_path):
    from labutils.decode import quant
    from labutils.model.checkpoints import save_hf_gpt2

    for overrides, key in [({"n_kv_head": 2}, "n_kv_head"), ({"gated_mlp": True, "bias": False}, "gated_mlp"),
                           ({"bias": False}, "bias")]:
        with pytest.raises(ValueError, match=f"{key}=.*no GPT-2 equivalent"):
            save_hf_gpt2(_perturbed_gpt(**overrides), tmp_path)
    with pytest.raises(ValueError, match="before quantizing"):
        save_hf_gpt2(quant.quantize_(_perturbed_gpt()), tmp_path)
    with pytest.raises(TypeError, match="labutils GPT"):
        save_hf_gpt2(torch.nn.Linear(2, 2), tmp_path)
    with pytest.raises(ValueError, match="eos_token_id=97 is outside"):
        save_hf_gpt2(_perturbed_gpt(), tmp_path, eos_token_id=VOCAB)
    assert not (tmp_path / "config.json").exists()       # nothing half-written
