"""One weight matrix from GEMV to GEMM: roofline.linear_flops / linear_bytes and perf.probes.measure_linear_sweep."""
import math

import pytest
import torch

from labutils.perf import roofline
from labutils.perf.probes import measure_linear_sweep


def test_linear_counts_by_hand():
    # W is 3 x 2; two rows of x (2 values each) in, two rows of y (3 values each) out.
    assert roofline.linear_flops(3, 2, 2) == 2 * 3 * 2 * 2
    assert roofline.linear_bytes(3, 2, 2, torch.float32) == (3 * 2 + 2 * 2 + 2 * 3) * 4
    assert roofline.linear_bytes(3, 2, 2, "bf16") == (3 * 2 + 2 * 2 + 2 * 3) * 2


def test_gemv_intensity_is_about_two_flops_per_weight_element_and_grows_with_batch():
    n_out, n_in = 3072, 768
    gemv = roofline.arithmetic_intensity(roofline.linear_flops(n_out, n_in, 1),
                                         roofline.linear_bytes(n_out, n_in, 1, torch.float32))
    assert gemv == pytest.approx(2 / 4, rel=0.01)           # 2 FLOPs per 4-byte weight
    prev = gemv
    for batch in (2, 16, 512):
        ai = roofline.arithmetic_intensity(roofline.linear_flops(n_out, n_in, batch),
                                           roofline.linear_bytes(n_out, n_in, batch, torch.float32))
        assert prev < ai < batch * gemv                    # activations keep it below "batch x"
        prev = ai


@pytest.mark.parametrize("bad", [dict(batch=0), dict(n_in=-1), dict(n_out=2.0)])
def test_linear_counts_reject_bad_sizes(bad):
    args = {"n_out": 4, "n_in": 4, "batch": 1, **bad}
    with pytest.raises((TypeError, ValueError), match=next(iter(bad))):
        roofline.linear_flops(**args)


def test_sweep_rows_are_consistent_with_the_roofline_counts():
    rows = measure_linear_sweep(64, 32, batches=(1, 4, 16), device="cpu", repeats=2, warmup=1)
    assert [r["batch"] for r in rows] == [1, 4, 16]
    for r in rows:
        assert r["bytes"] == roofline.linear_bytes(64, 32, r["batch"], torch.float32)
        assert r["flops"] == roofline.linear_flops(64, 32, r["batch"])
        assert math.isfinite(r["seconds"]) and r["seconds"] > 0
        assert r["bytes_per_s"] == pytest.approx(r["bytes"] / r["seconds"])
        assert r["flops_per_s"] == pytest.approx(r["flops"] / r["seconds"])
        assert r["intensity"] == pytest.approx(r["flops"] / r["bytes"])
    bf16 = measure_linear_sweep(64, 32, batches=(2,), dtype=torch.bfloat16, device="cpu", repeats=1, warmup=0)
    assert bf16[0]["bytes"] == roofline.linear_bytes(64, 32, 2, torch.bfloat16)


def test_the_default_weight_is_as_large_as_the_copy_probes_buffer(monkeypatch):
    # A weight that fits in a cache outruns the copy bandwidth (lesson 07 once stored a 9.4 MB GEMV at 184% of it).
    from labutils.perf import probes
    monkeypatch.setattr(probes, "default_copy_bytes", lambda device=None: 1 << 20)
    rows = measure_linear_sweep(n_in=256, batches=(1, 2), device="cpu", repeats=1, warmup=0)
    assert [(r["n_out"], r["n_in"]) for r in rows] == [(1024, 256)] * 2       # 1 MiB of fp32 in rows 256 wide
    assert rows[0]["bytes"] == roofline.linear_bytes(1024, 256, 1, torch.float32)
    monkeypatch.setattr(probes, "free_memory_bytes", lambda device=None: 1 << 20)
    assert probes.weight_rows_beyond_cache(256, torch.bfloat16, "cpu") == (1 << 18) // 512   # a quarter of free


def test_sweep_rejects_bad_input():
    with pytest.raises(ValueError, match="batch must be >= 1"):
        measure_linear_sweep(8, 8, batches=(1, 0))
    with pytest.raises(ValueError, match="batches is empty"):
        measure_linear_sweep(8, 8, batches=())
    with pytest.raises(TypeError, match="float dtype"):
        measure_linear_sweep(8, 8, dtype=torch.int8)
