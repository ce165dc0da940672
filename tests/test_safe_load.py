"""Weight files are not trusted: folder-only shards, no shared bytes, NaN warnings, weights_only .bin, named files."""
import json
import struct
import warnings

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from labutils.model.gpt import GPT, GPTConfig
from labutils.model.checkpoints import load_checkpoint, load_hf_gpt2, save_checkpoint
from labutils.model.safe_load import read_json, read_safetensors, read_weights, torch_load

CFG = dict(model_type="gpt2", vocab_size=11, n_positions=8, n_layer=1, n_head=2, n_embd=4)


def hf_tensors(seed=0) -> dict:
    """A complete 1-layer GPT-2 (HF names) for CFG."""
    g = torch.Generator().manual_seed(seed)
    C, V = CFG["n_embd"], CFG["vocab_size"]
    shapes = {"wte.weight": (V, C), "wpe.weight": (CFG["n_positions"], C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for hf, shape in [("ln_1.weight", (C,)), ("ln_1.bias", (C,)), ("attn.c_attn.weight", (C, 3 * C)),
                      ("attn.c_attn.bias", (3 * C,)), ("attn.c_proj.weight", (C, C)), ("attn.c_proj.bias", (C,)),
                      ("ln_2.weight", (C,)), ("ln_2.bias", (C,)), ("mlp.c_fc.weight", (C, 4 * C)),
                      ("mlp.c_fc.bias", (4 * C,)), ("mlp.c_proj.weight", (4 * C, C)), ("mlp.c_proj.bias", (C,))]:
        shapes[f"h.0.{hf}"] = shape
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def hf_folder(path, tensors=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CFG))
    save_file(hf_tensors() if tensors is None else tensors, path / "model.safetensors")
    return path


def raw_safetensors(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_a_clean_folder_loads(tmp_path):
    model = load_hf_gpt2(hf_folder(tmp_path / "m"))
    assert model.config.n_layer == 1 and torch.equal(model.tok_emb.weight, hf_tensors()["wte.weight"])


# ---- weights resolve inside the model folder -------------------------------------------------------

@pytest.mark.parametrize("shard", ["../other/model.safetensors", "/etc/passwd", "sub/../../x.safetensors",
                                   "..\\other\\model.safetensors"])
def test_a_shard_index_cannot_point_outside_the_folder(tmp_path, shard):
    hf_folder(tmp_path / "other")                          # a real, loadable file outside the model folder
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(CFG))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: shard for name in hf_tensors()}}))
    with pytest.raises(ValueError, match="lies outside .*weights must sit in its own folder"):
        load_hf_gpt2(model_dir)


def test_shards_inside_the_folder_load(tmp_path):
    tensors = hf_tensors()
    names = sorted(tensors)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CFG))
    save_file({k: tensors[k] for k in names[:5]}, folder / "a.safetensors")
    save_file({k: tensors[k] for k in names[5:]}, folder / "b.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "a.safetensors" if i < 5 else "b.safetensors" for i, k in enumerate(names)}}))
    assert torch.equal(load_hf_gpt2(folder).pos_emb.weight, tensors["wpe.weight"])


@pytest.mark.parametrize("linked", ["model.safetensors", "shard", "pytorch_model.bin"])
def test_a_weights_file_that_links_outside_the_folder_is_refused(tmp_path, linked):
    outside = hf_folder(tmp_path / "elsewhere")            # a real, loadable file outside the model folder
    torch.save(hf_tensors(), outside / "pytorch_model.bin")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CFG))
    if linked == "shard":
        (folder / "a.safetensors").symlink_to(outside / "model.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {name: "a.safetensors" for name in hf_tensors()}}))
    else:
        (folder / linked).symlink_to(outside / ("model.safetensors" if linked == "model.safetensors" else linked))
    with pytest.raises(ValueError, match="is a link to .* which lies outside .*Copy the file into the folder"):
        load_hf_gpt2(folder)


def test_links_that_stay_inside_the_folder_and_a_linked_folder_load(tmp_path):
    real = hf_folder(tmp_path / "real")
    (real / "weights").mkdir()
    (real / "model.safetensors").rename(real / "weights" / "w.safetensors")
    (real / "model.safetensors").symlink_to(real / "weights" / "w.safetensors")
    (tmp_path / "alias").symlink_to(real)                  # the folder itself may be a link
    for folder in (real, tmp_path / "alias"):
        assert torch.equal(load_hf_gpt2(folder).tok_emb.weight, hf_tensors()["wte.weight"])


def test_a_shard_index_without_a_weight_map_names_the_file(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CFG))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["x"]}))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json has no 'weight_map'"):
        load_hf_gpt2(folder)


# ---- two tensors may not share bytes ----------------------------------------------------------------

def test_overlapping_byte_ranges_are_refused_naming_both_tensors(tmp_path):
    path = tmp_path / "model.safetensors"
    data = torch.arange(8, dtype=torch.float32).numpy().tobytes()
    raw_safetensors(path, {"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]},
                           "b": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}, data)
    with pytest.raises(ValueError, match=r"tensors 'a' \(bytes 0-32\) and 'b' \(bytes 16-32\) share bytes"):
        read_safetensors(path)


def test_the_safetensors_package_refuses_overlaps_by_itself(tmp_path):
    # What safe_load relies on besides its own check: offsets must tile the data exactly.
    path = tmp_path / "x.safetensors"
    data = torch.arange(8, dtype=torch.float32).numpy().tobytes()
    raw_safetensors(path, {"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]},
                           "b": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, data)
    with pytest.raises(SafetensorError, match="invalid offset"):
        with safe_open(str(path), framework="pt") as f:
            [f.get_tensor(k) for k in f.keys()]


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(b"\x01\x02"), "too short to be a safetensors file"),
    (lambda p: p.write_bytes(struct.pack("<Q", 10**9) + b"{}"), "header length 1000000000 runs past"),
    (lambda p: p.write_bytes(struct.pack("<Q", 5) + b"{bad!"), "header is not valid JSON"),
    (lambda p: raw_safetensors(p, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
     "tensor 'w' claims bytes 0-16, but the file holds 8 bytes"),
    (lambda p: raw_safetensors(p, {"w": {"dtype": "F31", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
     "not a valid safetensors file"),
])
def test_a_damaged_header_names_the_file(tmp_path, damage, message):
    path = tmp_path / "model.safetensors"
    damage(path)
    with pytest.raises(ValueError, match=message) as err:
        read_safetensors(path)
    assert str(path) in str(err.value)


# ---- NaN and Inf weights warn, naming the tensor --------------------------------------------------------

def test_nan_and_inf_weights_warn_by_name(tmp_path):
    tensors = hf_tensors()
    tensors["h.0.mlp.c_fc.weight"][0, :3] = float("nan")
    tensors["wpe.weight"][1, 1] = float("inf")
    with pytest.warns(RuntimeWarning) as record:
        load_hf_gpt2(hf_folder(tmp_path / "m", tensors))
    text = " | ".join(str(w.message) for w in record)
    assert "'h.0.mlp.c_fc.weight'" in text and "3 NaN or infinite" in text
    assert "'wpe.weight'" in text and "1 NaN or infinite" in text
    assert "'wte.weight'" not in text


def test_finite_weights_load_without_a_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_hf_gpt2(hf_folder(tmp_path / "m"))


# ---- .bin stays weights_only=True, and never says otherwise ---------------------------------------------

class Payload:
    def __reduce__(self):
        return (print, ("this would have run",))


@pytest.mark.parametrize("content, why", [
    ("pickle", r"holds a Python object \(print\)"),
    ("garbage", "not a file torch.save wrote"),
])
def test_a_refused_bin_names_the_file_and_never_advises_weights_only_false(tmp_path, content, why):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CFG))
    if content == "pickle":
        torch.save({"wte.weight": torch.ones(2), "evil": Payload()}, folder / "pytorch_model.bin")
    else:
        (folder / "pytorch_model.bin").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match=why) as err:
        load_hf_gpt2(folder)
    message = str(err.value)
    assert str(folder / "pytorch_model.bin") in message and "weights_only=True" in message
    assert "weights_only=False" not in message and "weights_only` set to `False" not in message
    assert err.value.__cause__ is None and err.value.__suppress_context__     # torch's advice is not chained in


def test_a_bin_of_plain_tensors_still_loads(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CFG))
    torch.save(hf_tensors(), folder / "pytorch_model.bin")
    assert set(read_weights(folder)) == set(hf_tensors())


def test_a_bin_with_non_tensor_entries_is_refused(tmp_path):
    torch.save({"a": torch.ones(1), "b": 3}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="entry 'b' is a int, not a tensor"):
        read_weights(tmp_path)


# ---- config errors name the file -------------------------------------------------------------------

@pytest.mark.parametrize("text, message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "holds a JSON list, not a GPT-2 config"),
    (json.dumps({**CFG, "n_layer": 1.5}), "GPTConfig.n_layer must be an int, got float 1.5"),
    (json.dumps({**CFG, "vocab_size": "11"}), "GPTConfig.vocab_size must be an int, got str"),
])
def test_a_bad_hf_config_names_the_file(tmp_path, text, message):
    folder = hf_folder(tmp_path / "m")
    (folder / "config.json").write_text(text)
    with pytest.raises((ValueError, TypeError), match=message) as err:
        load_hf_gpt2(folder)
    assert str(folder / "config.json") in str(err.value)


def test_course_checkpoints_name_their_files(tmp_path):
    model = GPT(GPTConfig(vocab_size=11, context_length=8, n_layer=1, n_head=2, n_embd=4))
    save_checkpoint(model, tmp_path / "ok")
    assert torch.equal(load_checkpoint(tmp_path / "ok").tok_emb.weight, model.tok_emb.weight)
    save_checkpoint(model, tmp_path / "bad")
    (tmp_path / "bad" / "config.json").write_text('{"vocab_size": 11, "n_layr": 1}')
    with pytest.raises(ValueError, match=r"config.json has unknown field\(s\) \['n_layr'\]"):
        load_checkpoint(tmp_path / "bad")
    (tmp_path / "bad" / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"bad/config.json is not valid JSON"):
        load_checkpoint(tmp_path / "bad")
    save_checkpoint(GPT(GPTConfig(vocab_size=12, context_length=8, n_layer=1, n_head=2, n_embd=4)), tmp_path / "other")
    (tmp_path / "other" / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model.pt does not match .*config.json: .*size mismatch"):
        load_checkpoint(tmp_path / "other")
    torch.save({"x": Payload()}, tmp_path / "ok" / "model.pt")
    with pytest.raises(ValueError, match="model.pt cannot be loaded safely"):
        load_checkpoint(tmp_path / "ok")


def test_read_json_and_torch_load_report_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json does not exist"):
        read_json(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="nope.bin does not exist"):
        torch_load(tmp_path / "nope.bin")


# ---- damaged files found by the sweep of issue 29 §5 -------------------------------------------------------------

@pytest.mark.parametrize("entry", ["a string", 3, None, [1.0]])
def test_a_course_checkpoint_holding_something_else_than_tensors_names_the_entry(tmp_path, entry):
    """A state_dict holding a string failed inside warn_nonfinite with "'str' object has no attribute
    'is_floating_point'"."""
    save_checkpoint(GPT(GPTConfig(vocab_size=11, context_length=8, n_layer=1, n_head=2, n_embd=4)), tmp_path / "m")
    state = torch.load(tmp_path / "m" / "model.pt", weights_only=True)
    state["ln_f.weight"] = entry
    torch.save(state, tmp_path / "m" / "model.pt")
    with pytest.raises(ValueError, match=r"model.pt: entry 'ln_f.weight' is a .*, not a tensor"):
        load_checkpoint(tmp_path / "m")


def test_warn_nonfinite_names_an_entry_that_is_not_a_tensor():
    from labutils.model.safe_load import warn_nonfinite
    with pytest.raises(ValueError, match="entry 'w' is str 'x', not a tensor"):
        warn_nonfinite({"w": "x"}, "model.pt")


@pytest.mark.parametrize("shard", ["model\0.safetensors", "\0"])
def test_a_shard_name_with_a_nul_byte_is_refused_naming_the_index(tmp_path, shard):
    """os.path.realpath said only "embedded null byte"."""
    hf_folder(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "model-1.safetensors")
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte.weight": shard}}))
    with pytest.raises(ValueError, match="model.safetensors.index.json names a shard"):
        read_weights(tmp_path / "m")


@pytest.mark.parametrize("call", [lambda p: read_weights(p), lambda p: load_hf_gpt2(p), lambda p: load_checkpoint(p),
                                  lambda p: save_checkpoint(GPT(GPTConfig(vocab_size=11, context_length=8, n_layer=1,
                                                                          n_head=2, n_embd=4)), p)])
@pytest.mark.parametrize("path", ["m\0odel", ""])
def test_a_folder_name_no_file_can_have_is_refused_by_name(tmp_path, monkeypatch, call, path):
    """A NUL byte leaked "embedded null byte" from the OS layer; "" meant the current folder (save_checkpoint wrote
    config.json and model.pt there)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="(path|folder) .*(NUL byte|is empty)|(path|folder) is empty"):
        call(path)
    assert list(tmp_path.iterdir()) == []
