"""Issue 10's examples, one regression test each: every bad input gets a clear labutils error, never garbage."""
import importlib
import math
import warnings

import numpy as np
import pytest
import tiktoken
import torch

from labutils.measure import request as measure
from labutils.perf import roofline, timing
from labutils.decode.loop import decode_step, generate, prefill
from labutils.decode.sampling import sample, sampling_probs
from labutils.core.devices import pick_device
from labutils.perf.peaks import Peaks
from labutils.decode.kvcache import KVCache
from labutils.model.gpt import GPT, GPTConfig
from labutils.text.tokenizer import encode, get_encoding, train_bpe
from labutils.core.validate import DeviceUnavailableError, check_count
from labutils.widgets.kv_calculator import KVCalculator, kv_summary
from limits import time_limit

explorer_mod = importlib.import_module("labutils.widgets.explorer")
batch_mod = importlib.import_module("labutils.widgets.batch_roofline")

CFG = GPTConfig(vocab_size=64, context_length=32, n_layer=2, n_head=2, n_embd=16)
TEXT = "the cat sat on the mat. the dog sat on the log. " * 20
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(CFG).eval()


# ---- the hang ------------------------------------------------------------------------------------

def test_an_empty_special_token_is_refused_instead_of_hanging():
    with time_limit(10, "train_bpe with an empty special token"):
        with pytest.raises(ValueError, match="special_tokens holds an empty string"):
            train_bpe(TEXT, 280, special_tokens=("",))


def test_encode_refuses_an_encoding_with_an_empty_special_token():
    # An Encoding built by hand, outside train_bpe: tiktoken itself would loop forever on it.
    enc = tiktoken.Encoding(name="bad", pat_str=r"\w+|\s", special_tokens={"": 256},
                            mergeable_ranks={bytes([i]): i for i in range(256)})
    with time_limit(10, "encode with an empty special token"):
        with pytest.raises(ValueError, match="empty special token"):
            encode(enc, "the", allowed_special="all")


@pytest.mark.parametrize("specials, error, message", [
    ("<|endoftext|>", TypeError, r"special_tokens must be a list of strings, got str .*write \['<\|endoftext\|>'\]"),
    (("<|a|>", "<|a|>"), ValueError, r"special_tokens lists '<\|a\|>' more than once"),
    ((b"<|a|>",), TypeError, "special_tokens must hold strings, got bytes"),
    ((7,), TypeError, "special_tokens must hold strings, got int 7"),
])
def test_special_tokens_must_be_distinct_nonempty_strings(specials, error, message):
    with pytest.raises(error, match=message):
        train_bpe(TEXT, 280, special_tokens=specials)


def test_allowed_special_is_checked_before_tiktoken_sees_it():
    enc = train_bpe(TEXT, 270)
    assert encode(enc, "a<|endoftext|>", allowed_special={"<|endoftext|>"})[-1] == enc.eot_token
    with pytest.raises(TypeError, match=r"allowed_special must be 'all' or a set.*write \{'<\|endoftext\|>'\}"):
        encode(enc, "a", allowed_special="<|endoftext|>")
    with pytest.raises(ValueError, match=r"allowed_special names '<\|nope\|>'"):
        encode(enc, "a", allowed_special={"<|nope|>"})


@pytest.mark.parametrize("text", ["\ud800", "a\udc00b", "\ud83d\ude00"])
def test_surrogates_are_refused_because_they_cannot_round_trip(text):
    # tiktoken would turn a lone half into U+FFFD and a pair of halves into the emoji: not the same str.
    with pytest.raises(ValueError, match=r"surrogate .* at index \d+.*surrogatepass"):
        encode("cl100k_base", text)
    repaired = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")   # the way out it names
    cl = get_encoding("cl100k_base")
    assert cl.decode(encode(cl, repaired)) == repaired


# ---- silently wrong results ----------------------------------------------------------------------

def test_infinite_temperature_is_refused_and_a_huge_one_still_obeys_top_k():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got inf"):
        sample(logits, temperature=float("inf"), top_k=2)
    probs = sampling_probs(logits, temperature=1e30, top_k=2)
    assert ((probs > 0).sum(dim=-1) == 2).all()
    assert torch.isfinite(sampling_probs(logits, temperature=1e-30)).all()   # no overflow to NaN


def test_greedy_sampling_refuses_nan_logits():
    logits = torch.zeros(2, 10)
    logits[1, 3] = float("nan")
    with pytest.raises(ValueError, match="logits hold NaN"):
        sample(logits)
    with pytest.raises(ValueError, match="logits hold NaN"):
        sample(torch.full((1, 5), float("-inf")), temperature=1.0)
    masked = torch.tensor([[float("-inf"), 1.0, float("-inf")]])
    assert sample(masked).item() == 1                       # -inf alone is a masked token, fine


def test_nan_weights_fail_generation_once_per_request(model):
    broken = GPT(CFG).eval()
    broken.load_state_dict(model.state_dict())
    with torch.no_grad():
        broken.blocks[0].mlp.fc.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="logits hold NaN"):
        generate(broken, [1, 2, 3], 4)


def _nan_fast(m):
    from labutils.decode.fastgen import fast_generate
    return fast_generate(m, [1, 2, 3], 4)


def _nan_speculative(m):
    from labutils.decode.speculative import PROMPT_LOOKUP, speculative_generate
    return speculative_generate(m, PROMPT_LOOKUP, [1, 2, 3, 1, 2], 4, k=2)


def _nan_engine(m):
    from labutils.serving.engine import Engine
    engine = Engine(m, 2)
    engine.submit([1, 2, 3], 4)
    return engine.run()


@pytest.mark.parametrize("run", [_nan_fast, _nan_speculative, _nan_engine], ids=["fast_generate",
                                                                               "speculative_generate", "engine"])
def test_nan_weights_fail_every_decode_loop_not_only_generate(model, run):
    """They used to return token 0 forever."""
    broken = GPT(CFG).eval()
    broken.load_state_dict(model.state_dict())
    with torch.no_grad():
        broken.blocks[0].mlp.fc.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="logits hold NaN"):
        run(broken)


@pytest.mark.parametrize("call, error, message", [
    (lambda: timing.ttft_s("abc"), TypeError, "timestamps must be a list of seconds, one per token, got str 'abc'"),
    (lambda: timing.tpot_s([0.1, float("nan"), 0.3]), ValueError, r"timestamps\[1\] must be a finite number >= 0"),
    (lambda: timing.itl_s([0.1, None]), TypeError, r"timestamps\[1\] must be a number, got NoneType"),
    (lambda: timing.tpot_s([0.2, 0.1]), ValueError, r"must not decrease, but timestamps\[1\]=0.1"),
])
def test_timestamps_are_checked(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_an_impossible_mbu_is_flagged_and_a_plausible_one_is_not():
    with pytest.warns(RuntimeWarning, match=r"MBU = .* is above 1.*units of tpot_s and bandwidth_Bps"):
        u = roofline.mbu("gpt2-small", 128, 1, "fp16", 0.02, 26.0)     # bandwidth typed in GB/s
    assert u > 1e6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert 0 < roofline.mbu("gpt2-small", 128, 1, "fp16", 0.02, 26e9) < 1
    with pytest.warns(RuntimeWarning, match="MFU"):
        roofline.mfu(1e12, 1.0, 1e9)


@pytest.mark.parametrize("field, value, error", [
    ("vocab_size", 101.5, TypeError), ("context_length", True, TypeError), ("n_embd", "16", TypeError),
    ("n_layer", 0, ValueError), ("bias", "yes", TypeError), ("tie_weights", 1, TypeError),
])
def test_gpt_config_fields_follow_one_rule(field, value, error):
    with pytest.raises(error, match=f"GPTConfig.{field} must be"):
        GPTConfig(**{**CFG.__dict__, field: value})


def test_numpy_ints_are_accepted_and_stored_as_ints():
    cfg = GPTConfig(vocab_size=np.int64(64), context_length=np.int32(32), n_layer=1, n_head=2, n_embd=16)
    assert type(cfg.vocab_size) is int and type(cfg.context_length) is int and cfg.vocab_size == 64


def test_cache_advance_takes_a_whole_number_of_positions():
    cache = KVCache(CFG, 1, 8)
    with pytest.raises(TypeError, match=r"n must be an int, got float 2.5"):
        cache.advance(2.5)
    with pytest.raises(ValueError, match="n must be >= 0"):
        cache.advance(-1)
    assert cache.pos == 0


def test_use_cache_must_be_a_bool(model):
    with pytest.raises(TypeError, match="use_cache must be True or False, got str 'no'"):
        generate(model, [1, 2], 2, use_cache="no")


@pytest.mark.parametrize("other, what", [
    (dict(n_layer=1), "n_layer=2 .the model has 1."),
    (dict(n_embd=32), "head_dim=8 .the model has 16."),
    (dict(n_head=2, n_kv_head=1), "n_kv_head=2 .the model has 1."),
])
def test_a_cache_built_for_another_model_is_refused(other, what):
    torch.manual_seed(0)
    m = GPT(GPTConfig(**{**CFG.__dict__, **other})).eval()
    cache = KVCache(CFG, 1, 8)                  # built for CFG: 2 layers, 2 KV heads of 8 dims
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=f"cache does not fit this model: it has .*{what}"):
        prefill(m, ids, cache)
    with pytest.raises(ValueError, match=f"cache does not fit this model: it has .*{what}"):
        decode_step(m, torch.tensor([1]), cache)
    assert cache.pos == 0


def test_a_cache_of_another_dtype_is_refused(model):
    cache = KVCache(CFG, 1, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"dtype=torch.float16 \(the model computes in torch.float32\)"):
        prefill(model, torch.tensor([[1, 2]]), cache)


def test_decode_step_refuses_a_token_outside_the_vocab(model):
    cache = KVCache(CFG, 1, 8)
    tok = prefill(model, torch.tensor([[1, 2]]), cache)
    with pytest.raises(ValueError, match="token id 64, outside the vocab of size 64"):
        decode_step(model, torch.tensor([64]), cache)
    with pytest.raises(TypeError, match="integer tensor of token ids"):
        decode_step(model, torch.tensor([1.0]), cache)
    assert cache.pos == 2 and decode_step(model, tok, cache).shape == (1,)


# ---- one rule for integers ---------------------------------------------------------------------

INT_TAKERS = {
    "kv_summary(batch)": lambda b: kv_summary("tiny", 16, batch=b),
    "roofline.decode_bytes(batch)": lambda b: roofline.decode_bytes("tiny", 4, b),
    "measure.check_preset_request(batch)": lambda b: measure.check_preset_request("tiny", 8, 4, b),
    "KVCache(batch_size)": lambda b: KVCache(CFG, b, 4, device="meta"),
    "GPTConfig(n_layer)": lambda b: GPTConfig(vocab_size=8, context_length=8, n_layer=b, n_head=1, n_embd=4),
}


@pytest.mark.parametrize("taker", list(INT_TAKERS))
def test_numpy_integers_are_accepted_everywhere(taker):
    INT_TAKERS[taker](np.int64(8))


@pytest.mark.parametrize("taker", list(INT_TAKERS))
def test_integral_floats_are_refused_everywhere_with_the_same_way_out(taker):
    with pytest.raises(TypeError, match=r"must be an int, got float 8.0; pass int\(8.0\)"):
        INT_TAKERS[taker](8.0)


def test_the_count_rule():
    assert check_count("n", np.int16(3), 1) == 3 and type(check_count("n", np.int16(3), 1)) is int
    for bad in (True, 3.0, "3", None, float("nan")):
        with pytest.raises(TypeError, match="n must be an int"):
            check_count("n", bad, 1)
    with pytest.raises(ValueError, match="n must be <= 5, got 6; shorter"):
        check_count("n", 6, 1, 5, hint="shorter")


# ---- raw errors where a check belongs --------------------------------------------------------------

@no_cuda
@pytest.mark.parametrize("call", [
    lambda: pick_device("cuda"),
    lambda: measure.get_model("tiny", "fp32", "cuda"),
    lambda: KVCache(CFG, 1, 4, device="cuda"),
    lambda: measure.measure_request("tiny", 8, 4, device="cuda"),
])
def test_cuda_on_a_cpu_only_torch_says_so(call):
    with pytest.raises(DeviceUnavailableError, match=r"device 'cuda' is not available on this machine.*use 'cpu'"):
        call()
    assert issubclass(DeviceUnavailableError, ValueError) and issubclass(DeviceUnavailableError, RuntimeError)


@pytest.mark.parametrize("call", [lambda: measure.get_model("llama-2-7b"),
                                  lambda: measure.roofline_point("llama-2-7b", "decode", 1)])
def test_a_model_too_big_for_free_memory_is_refused_before_it_is_built(monkeypatch, call):
    """get_model and roofline_point used to build a 7B model in fp32 (about 27 GB) on any CPU."""
    monkeypatch.setattr(measure, "free_bytes", lambda device: 8e9)
    built = []
    monkeypatch.setattr(measure, "GPT", lambda *a, **k: built.append(a))
    with pytest.raises(ValueError, match=r"llama-2-7b in fp32 needs about \d+\.\d GB to build, but only 8\.0 GB is free"):
        call()
    assert built == []


def test_get_model_refuses_a_storage_dtype_by_name():
    with pytest.raises(ValueError, match=r"dtype 'fp8' is not offered here .*choose one of \['fp32', 'bf16', 'fp16'\]"):
        measure.get_model("tiny", "fp8")
    with pytest.raises(ValueError, match=r"unknown dtype 'fp4'"):
        measure.get_model("tiny", "fp4")


# ---- widgets -----------------------------------------------------------------------------------

def test_kv_calculator_survives_none_and_recovers():
    k = KVCalculator("llama-2-7b", 4096)
    curve = list(k.fig.figure.data[0].y)
    for control in (k.dtype, k.preset):
        good = control.value
        control.value = None                            # no exception out of the observer
        assert "Not possible" in k.summary.value and "NoneType None" in k.summary.value
        assert list(k.fig.figure.data[0].y) == curve           # the last good plot stays
        k.batch.value = 2                               # a later change does not raise either
        assert "Not possible" in k.summary.value
        control.value = good                            # the next valid value recovers
        assert "Not possible" not in k.summary.value and "llama-2-7b" in k.summary.value
        k.batch.value = 1


FAKE_PEAKS = Peaks(bandwidth_Bps=10e9, flops=100e9, device_name="test CPU")
ROW = dict(preset="tiny", dtype="fp32", device="cpu", batch=1, prompt_len=32, new_tokens=4,
           timestamps=[0.010, 0.012, 0.014, 0.016], ttft_s=0.010, tpot_s=0.002, latency_s=0.016,
           achieved_Bps=5e9, peak_bandwidth_Bps=10e9, mbu=0.5, mfu_prefill=0.25, mfu_decode=0.01,
           achieved_flops=25e9, peak_flops=100e9, decode_tok_s=500.0)


@pytest.fixture
def fake_explorer(monkeypatch):
    monkeypatch.setattr(explorer_mod, "measured_peaks", lambda *a, **k: FAKE_PEAKS)
    rows = {"row": ROW}
    ex = explorer_mod.Explorer("cpu", preset="tiny", prompt_len=32, new_tokens=4,
                               measure_fn=lambda **s: dict(rows["row"], **s))
    return ex, rows


def test_explorer_survives_none_controls_and_recovers(fake_explorer):
    ex, _ = fake_explorer
    before = list(ex.fig_timeline.figure.data[2].x)
    for control, good in ((ex.preset, "tiny"), (ex.device, "cpu")):
        control.value = None
        assert "Could not measure" in ex.status.value
        assert list(ex.fig_timeline.figure.data[2].x) == before
        control.value = good
        assert "TTFT" in ex.status.value


def test_explorer_refuses_a_row_missing_a_key_and_keeps_its_plots(fake_explorer):
    ex, rows = fake_explorer
    before = list(ex.fig_timeline.figure.data[2].x)
    rows["row"] = {k: v for k, v in ROW.items() if k != "mbu"}
    ex.new_tokens.value = 6
    assert "lacks [&#x27;mbu&#x27;]" in ex.status.value and list(ex.fig_timeline.figure.data[2].x) == before
    rows["row"] = ROW
    ex.new_tokens.value = 8
    assert "TTFT" in ex.status.value


def test_batch_roofline_refuses_a_row_missing_a_key():
    def measure_fn(preset, phase, n, dtype, device, pos):
        row = dict(phase=phase, n=n, seconds=1e-3, intensity=1.0, achieved_flops=1e9, achieved_Bps=1e9,
                   tokens_per_s=n / 1e-3)
        return row if n == 1 else {k: v for k, v in row.items() if k != "intensity"}
    view = batch_mod.BatchRoofline("cpu", preset="tiny", peaks=FAKE_PEAKS, measure_fn=measure_fn)
    assert "tokens/s" in view.status.value
    view.slider.value = 2
    assert "lacks [&#x27;intensity&#x27;]" in view.status.value
    view.slider.value = 1
    assert "tokens/s" in view.status.value


@pytest.mark.parametrize("call, match", [
    (lambda: __import__("labutils.decode.speculative", fromlist=["x"]).expected_speedup(0.8, 4, 0.1, verify_cost=True),
     "verify_cost must be a number, got bool True"),
    (lambda: __import__("labutils.decode.speculative", fromlist=["x"]).expected_speedup(0.8, 4, -0.1), "cost_ratio"),
    (lambda: __import__("labutils.decode.speculative", fromlist=["x"]).lookup_proposals([1, 2, 1, 2], -1), "k must be >= 0"),
    (lambda: __import__("labutils.decode.speculative", fromlist=["x"]).lookup_proposals([1, 2, 1, 2], 2, ngram=0),
     "ngram must be >= 1"),
])
def test_silently_accepted_arguments_are_refused(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_train_refuses_a_negative_warmup_and_learning_rate():
    from labutils.train import train
    cfg = GPTConfig(vocab_size=64, context_length=8, n_layer=1, n_head=1, n_embd=8)
    tokens = torch.arange(64).repeat(4)
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        train(cfg, 2, 1, tokens, warmup=-5, show_progress=False)
    with pytest.raises(ValueError, match="lr must be a finite number > 0, got -1.0"):
        train(cfg, 2, 1, tokens, lr=-1.0, show_progress=False)


def test_gpu_table_refuses_unknown_arguments(capsys):
    from labutils import gpu_table
    with pytest.raises(SystemExit) as exit_:
        gpu_table.main(["--bogus"])
    assert exit_.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
    gpu_table.main([])
    assert capsys.readouterr().out.startswith("| GPU (datasheet)")


@pytest.mark.parametrize("argv, match", [(["--warmup", "-5"], "--warmup must be >= 0, got -5"),
                                         (["--steps", "0"], "--steps must be >= 1"), (["--lr", "-1"], "--lr must be > 0")])
def test_the_train_command_refuses_bad_numbers_before_training(argv, match, capsys):
    from labutils.train import main
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize("cfg, match", [
    (dict(n_layer=10 ** 6, n_head=1, n_embd=8, vocab_size=16, context_length=8), "more than 1024 layers"),
    (dict(n_layer=1, n_head=1, n_embd=8, vocab_size=10 ** 12, context_length=8), "parameters, .* GB in torch.float32"),
])
def test_a_gpt_this_machine_cannot_build_is_refused_before_allocating(cfg, match):
    """GPT(GPTConfig(n_layer=10**6)) ran without end; vocab_size=10**12 reached the allocator."""
    from labutils.core.validate import DoesNotFitError
    with pytest.raises((ValueError, DoesNotFitError), match=match):
        GPT(GPTConfig(**cfg))


def test_gpt_refuses_a_preset_name_in_place_of_a_config():
    with pytest.raises(TypeError, match=r"GPT takes a GPTConfig, got str; use GPT\(GPTConfig\(...\)\)"):
        GPT("tiny")


# --- raw errors from wrong types (issue 20 §4): parsed at the boundary, with the way out ------------------------

def _small():
    from labutils.model.gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=64, context_length=32, n_layer=1, n_head=2, n_embd=16))


def test_a_cache_of_the_model_itself_says_to_pass_its_config():
    from labutils.decode.kvcache import KVCache
    with pytest.raises(TypeError, match=r"KVCache\(model.config, batch_size, max_len\), got a model: pass its .config"):
        KVCache(_small())
    with pytest.raises(TypeError, match="got str"):
        KVCache("tiny")


def test_prefill_with_something_that_is_not_a_cache():
    from labutils.decode.loop import prefill
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        prefill(_small(), torch.tensor([[1, 2]]), "cache")


def test_save_checkpoint_with_its_arguments_swapped(tmp_path):
    from labutils.model.checkpoints import save_checkpoint
    with pytest.raises(TypeError, match="takes the GPT first, got str"):
        save_checkpoint(str(tmp_path), _small())


def test_load_hf_gpt2_parses_its_device_and_dtype(tmp_path):
    from labutils.model.checkpoints import load_hf_gpt2, save_hf_gpt2
    save_hf_gpt2(_small(), tmp_path)
    assert load_hf_gpt2(tmp_path, dtype="fp16").lm_head.weight.dtype == torch.float16     # a name works too
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        load_hf_gpt2(tmp_path, device="tpu")
    with pytest.raises(ValueError, match="unknown dtype 'fp12'"):
        load_hf_gpt2(tmp_path, dtype="fp12")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda' is not available on this machine"):
            load_hf_gpt2(tmp_path, device="cuda")


def test_a_broken_split_pattern_is_refused_by_name():
    from labutils.text.tokenizer import train_bpe
    with pytest.raises(ValueError, match=r"pat_str is not a regular expression .*missing \)"):
        train_bpe("hello world " * 20, 300, pat_str="(")


def test_setup_notebook_names_a_bad_seed():
    import labutils
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        labutils.setup_notebook(seed=-1)


# --- the last classes (issue 20 §4): a hand-edited tokenizer file, sliders set out of range --------------------

def _copy_encoding(tmp_path, edit_meta=None, edit_body=None):
    """The course encoding copied to tmp_path, its .json (dict) and .tiktoken (bytes) edited as a hand would."""
    import hashlib
    import json
    from labutils.text.tokenizer import DATA_DIR as TOKENIZER_DIR
    meta = json.loads((TOKENIZER_DIR / "course.json").read_text())
    body = (TOKENIZER_DIR / "course.tiktoken").read_bytes()
    if edit_body is not None:
        body = edit_body(body)
        meta["sha256"] = hashlib.sha256(body).hexdigest()     # a careful hand: the checksum matches the edit
    if edit_meta is not None:
        edit_meta(meta)
    (tmp_path / "course.tiktoken").write_bytes(body)
    (tmp_path / "course.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    return tmp_path / "course.tiktoken"


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.pop("pat_str"), r"course.json was edited by hand .*missing \['pat_str'\].*Rebuild it \(python -m "
                                 r"labutils.text.tokenizer\)"),
    (lambda m: m.pop("sha256") and m.pop("n_vocab"), r"missing \['n_vocab', 'sha256'\]"),
    (lambda m: m.update(n_vocab="4096"), r"wrong type: n_vocab \(should be int, got str '4096'\)"),
    (lambda m: m.update(special_tokens={"<|endoftext|>": "0"}), r"special_tokens \(token text -> int id\)"),
    (lambda m: m.update(n_vocab=5), r"do not make an encoding"),
    (lambda m: m.update(pat_str="("), r"do not make an encoding"),
])
def test_a_hand_edited_tokenizer_file_is_refused_by_name(tmp_path, edit, match):
    from labutils.text.tokenizer import load_encoding
    with pytest.raises(ValueError, match=match):
        load_encoding(_copy_encoding(tmp_path, edit_meta=edit))


def test_a_tokenizer_file_cut_short_or_not_json_is_refused_by_name(tmp_path):
    from labutils.text.tokenizer import load_encoding
    path = _copy_encoding(tmp_path, edit_body=lambda b: b + b"not-base64!\n")
    with pytest.raises(ValueError, match=r"course.tiktoken, line 4\d\d\d: expected '<base64 token> <rank>'"):
        load_encoding(path)
    path.with_suffix(".json").write_text("{broken")
    with pytest.raises(ValueError, match="course.json is not valid JSON"):
        load_encoding(path)
    path.with_suffix(".json").unlink()
    with pytest.raises(FileNotFoundError, match="no .*course.json beside its .tiktoken file"):
        load_encoding(path)
    assert load_encoding(_copy_encoding(tmp_path)).n_vocab == get_encoding("course").n_vocab   # an honest copy loads


@pytest.mark.parametrize("make, control, value, match", [
    (lambda: KVCalculator("tiny", 128), "batch", 500, r"batch=500 is outside the slider's range 1 to 256"),
    (lambda: KVCalculator("tiny", 128), "context", 0, r"context=0 is outside the slider's range 1 to"),
    (lambda: KVCalculator("tiny", 128), "batch", 0, r"batch=0 is outside the slider's range 1 to 256"),
])
def test_a_slider_set_out_of_range_from_code_says_so_and_keeps_its_value(make, control, value, match):
    view = make()
    slider = getattr(view, control)
    before = slider.value
    with pytest.raises(ValueError, match=match):
        slider.value = value
    assert slider.value == before


@pytest.mark.parametrize("call, match", [
    (lambda: KVCalculator("tiny", context=0), r"context=0 is outside the slider's range 1 to"),
    (lambda: KVCalculator("tiny", 128, batch=500), r"batch=500 is outside the slider's range 1 to 256"),
    (lambda: KVCalculator("tiny", 128, batch=2.5), r"batch"),
    (lambda: KVCalculator("tiny", 128, dtype="fp32"), r"unknown dtype 'fp32'; choose one of \['fp16', 'bf16'"),
    (lambda: explorer_mod.Explorer("cpu", preset="tiny", prompt_len=4, new_tokens=4),
     r"prompt_len=4 is outside the slider's range 8 to"),
    (lambda: explorer_mod.Explorer("cpu", preset="tiny", prompt_len=16, new_tokens=500),
     r"new_tokens=500 is outside the slider's range 2 to"),
    (lambda: explorer_mod.Explorer("cpu", preset="tiny", batch=3), r"unknown batch int 3; choose one of \[1, 2, 4"),
    (lambda: explorer_mod.Explorer("cpu", preset="tiny", prompt_len=248, new_tokens=32),
     r"prompt_len \(248\) \+ new_tokens \(32\) = 280 tokens exceed tiny's context length 256"),
])
def test_a_widget_refuses_a_starting_value_its_slider_would_clamp(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
