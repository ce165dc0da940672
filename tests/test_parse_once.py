"""Parse once, at the boundary: a learner's dtype is checked where it comes in, then travels as a torch.dtype.

Before the package was laid out in parts, measure_request ran validate.check_dtype 13 times on one dtype (and
the dtype table's name lookup 25 times); a public function now parses, and what it calls trusts the result.
"""
import pytest
import torch

from labutils import measure
from labutils.core import validate
from labutils.perf import roofline
from labutils.perf.peaks import Peaks

FAKE_PEAKS = Peaks(10e12, 100e12, "test CPU")      # above any CPU: a share above 1 of peaks passed in is refused


@pytest.fixture
def parses(monkeypatch):
    """Every run of the one dtype rule (validate.check_dtype, which parse_dtype calls), as (name, value)."""
    seen, real = [], validate.check_dtype
    monkeypatch.setattr(validate, "check_dtype", lambda name, value, *a, **k: seen.append((name, value)) or
                        real(name, value, *a, **k))
    return seen


@pytest.mark.parametrize("dtype", ["fp32", torch.float32])
def test_measure_request_parses_its_dtype_once(parses, dtype):
    measure.get_model("tiny", "fp32")          # built (and parsed) before the count starts, as a warm cache would be
    parses.clear()
    row = measure.measure_request("tiny", 8, 4, dtype=dtype, peaks=FAKE_PEAKS)
    assert parses == [("dtype", dtype)]
    assert row["dtype"] == "fp32" and row["decode_bytes"] == roofline.decode_bytes("tiny", row["decode_pos"], 1, "fp32")


def test_a_composed_roofline_formula_parses_once(parses):
    roofline.mbu("gpt2-small", 128, 4, "bf16", tpot_s=0.01, bandwidth_Bps=1e12)
    roofline.knee_batch("gpt2-small", 128, "fp16", bandwidth_Bps=1e12, peak_flops=1e14)
    assert parses == [("dtype", "bf16"), ("dtype", "fp16")]


def test_the_one_parse_keeps_the_rules_and_messages():
    with pytest.raises(ValueError, match=r"unknown dtype 'fp12'; choose one of \['fp32', 'bf16', 'fp16'\]"):
        measure.measure_request("tiny", 8, 4, dtype="fp12")
    with pytest.raises(ValueError, match="'int8' is not offered here .a storage format"):
        measure.memory_needed("tiny", 8, 4, dtype=torch.int8)
    with pytest.raises(ValueError, match="not offered here"):     # narrowed: a float outside the table is refused too
        measure.get_model("tiny", torch.float8_e5m2)
    assert roofline.kv_bytes_per_token("tiny", torch.float8_e5m2) * 4 == roofline.kv_bytes_per_token("tiny", "fp32")


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64, torch.bool, "int4"])
def test_a_dtype_without_a_byte_count_here_is_still_refused(dtype):
    with pytest.raises(ValueError, match="unknown dtype"):
        roofline.kv_cache_bytes("gpt2-small", 10, dtype=dtype)


@pytest.mark.parametrize("fn", [lambda x: roofline.decode_bytes(x, 3), lambda x: roofline.prefill_bytes(x, 3),
                                lambda x: roofline.mbu(x, 3, 1, None, 0.1, 1e9)])
def test_a_module_that_is_not_a_gpt_is_refused_by_name_before_it_is_read(fn):
    with pytest.raises(TypeError, match="x .the model. must be a GPT model"):
        fn(torch.nn.Linear(2, 2))
