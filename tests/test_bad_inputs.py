"""The bad inputs a sweep of careless and hostile calls still found (issue 29 §5), one regression each: every call
must end in a ValueError or TypeError raised by labutils that names the argument, never a raw AttributeError,
IndexError or torch message, never silent acceptance, and never a write into the current folder."""
from __future__ import annotations

import copy
import os
import traceback
from pathlib import Path

import pytest
import torch

import labutils
from labutils.model.gpt import GPT, GPTConfig

PACKAGE = str(Path(labutils.__file__).resolve().parent)
CFG = GPTConfig(vocab_size=64, context_length=32, n_layer=1, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(CFG).eval()


def _cases(model, tmp):
    from labutils.decode.sampling import sampling_probs
    from labutils.decode.quant import quantize_per_channel
    from labutils.decode.speculative import PROMPT_LOOKUP, speculative_generate
    from labutils.measure import request as measure
    from labutils.model.checkpoints import load_checkpoint, save_hf_gpt2
    from labutils.perf.peaks import Peaks
    from labutils.perf.probes import measure_linear_sweep, sweep_repeats
    from labutils.serving.engine import Engine
    from labutils.serving.openai_client import OpenAIClient
    from labutils.serving.workload import make_workload
    from labutils.text.detokenize import StreamDecoder
    from labutils.text.tokenizer import save_encoding, train_bpe
    from labutils.widgets import serving_dashboard
    return {
        # a string or number where an object is expected
        "sampling_probs(list)": (lambda: sampling_probs([[1.0, 2.0]], temperature=1.0), "logits"),
        "serving_dashboard(str)": (lambda: serving_dashboard("model"), "model"),
        "save_encoding(str)": (lambda: save_encoding("course", tmp / "enc"), "enc"),
        "load_checkpoint(123)": (lambda: load_checkpoint(123), "path"),
        # NaN and infinity
        "quantize_per_channel(inf)": (lambda: quantize_per_channel(torch.tensor([[float("inf"), 1.0]])), "NaN or inf"),
        # silently accepted before
        "train_bpe(name=42)": (lambda: train_bpe("hello world " * 20, 260, name=42), "name"),
        "Engine.submit(dict)": (lambda: Engine(model, 2, block_size=4).submit({1: 2}, 4), "prompt_ids"),
        "OpenAIClient(model=5)": (lambda: OpenAIClient("http://127.0.0.1:8000", model=5), "model"),
        "OpenAIClient(port 70000)": (lambda: OpenAIClient("http://127.0.0.1:70000"), "base_url"),
        "StreamDecoder.extend(dict)": (lambda: StreamDecoder("course").extend({1: "a"}), "ids"),
        "speculative_generate(seed=-1)": (lambda: speculative_generate(model, PROMPT_LOOKUP, [1, 2, 3], 2, seed=-1),
                                          "seed"),
        "measure_linear_sweep(seed=-1)": (lambda: measure_linear_sweep(8, 8, batches=(1,), seed=-1), "seed"),
        "sweep_repeats(-1)": (lambda: sweep_repeats(-1), "nbytes"),
        "save_hf_gpt2(model, '')": (lambda: save_hf_gpt2(model, ""), "path"),
        "measure_request(peaks in GB/s)": (lambda: measure.measure_request(
            "tiny", 8, 2, peaks=Peaks(20.0, 500.0, device_name="typed by hand")), "peaks"),
        "measure_request(peaks below what it measured)": (lambda: measure.measure_request(
            "tiny", 8, 2, peaks=Peaks(1e8, 1e8, device_name="a far slower machine")), "peaks"),
        # memory: refused before anything is allocated
        "make_workload(100,000 x 2**20 tokens)": (lambda: make_workload(100_000, vocab_size=64, prompt_len=2 ** 20),
                                                   "prompt tokens"),
    }


CASE_NAMES = list(_cases(None, Path(".")))


@pytest.mark.parametrize("case", CASE_NAMES)
def test_a_bad_input_is_refused_by_name(case, model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                       # anything written to "" lands here, where the test sees it
    call, name = _cases(model, tmp_path)[case]
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    where = traceback.extract_tb(info.tb)[-1].filename
    assert str(Path(where).resolve()).startswith(PACKAGE), f"raised outside labutils ({where}): {info.value}"
    assert name in str(info.value), f"the message does not name {name!r}: {info.value}"
    assert os.listdir(tmp_path) == [], f"{case} wrote {os.listdir(tmp_path)} into the current folder"


def test_an_int8_models_decode_bytes_are_counted_not_refused(model):
    from labutils.decode import quant
    from labutils.perf import roofline
    int8 = quant.quantize_(copy.deepcopy(model))
    fp32 = roofline.decode_bytes(model, 4)
    got = roofline.decode_bytes(int8, 4)
    # Every weight at 1 byte instead of 4, plus a scale per output row; the cache stays in the float dtype.
    assert roofline.kv_cache_bytes(model, 4) < got < fp32 / 2


def test_the_quiz_observer_says_a_bad_question_under_the_score():
    from labutils.widgets.quiz import quiz
    q = quiz("06")
    q._on_choice(999, 0)                               # an observer never raises
    assert "question index 999" in q.score.value
    q._on_choice(0, 999)
    assert "choice 999" in q.feedback[0].value
