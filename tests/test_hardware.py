"""Device choice, bandwidth and FLOP/s probes (small sizes, no speed asserts), spec table, error paths."""
import math

import pytest
import torch

from labutils.perf import probes as hw
from labutils.perf.datasheets import SPECS, match_spec
from labutils.perf.probes import MeasurementError, measure_bandwidth, measure_matmul_flops
from labutils.core.devices import describe_device, pick_device
from labutils.perf.roofline import ridge_point


def _no_accelerators(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def test_pick_device_falls_back_to_cpu(monkeypatch):
    _no_accelerators(monkeypatch)
    assert pick_device() == torch.device("cpu")
    assert pick_device("cpu") == torch.device("cpu")


def test_pick_device_prefers_cuda_then_mps(monkeypatch):
    _no_accelerators(monkeypatch)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert pick_device() == torch.device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device() == torch.device("cuda")


def test_pick_device_errors(monkeypatch):
    _no_accelerators(monkeypatch)
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        pick_device("tpu")
    with pytest.raises(RuntimeError, match="not available"):
        pick_device("cuda")


def test_describe_device_cpu():
    name = describe_device("cpu")
    assert isinstance(name, str) and "cores" in name


def test_bandwidth_small_is_positive_finite():
    bw = measure_bandwidth("cpu", nbytes=1 << 20, repeats=2, warmup=1)
    assert math.isfinite(bw) and bw > 0


@pytest.mark.parametrize("bad, error", [(0, ValueError), (100, ValueError), (-5, ValueError),
                                        (2.5e6, TypeError), (True, TypeError)])
def test_bandwidth_rejects_bad_size(bad, error):
    with pytest.raises(error, match="nbytes must be"):
        measure_bandwidth("cpu", nbytes=bad)


def test_bandwidth_default_buffer_shrinks_with_a_warning(monkeypatch):
    monkeypatch.setattr(hw, "free_memory_bytes", lambda device=None: 64 * hw.MiB)
    seen = []
    real_empty = hw._empty
    monkeypatch.setattr(hw, "_empty", lambda numel, dtype, device: seen.append(numel) or real_empty(numel, dtype, device))
    with pytest.warns(UserWarning, match="shrank from .* to 16 MiB"):
        bw = measure_bandwidth("cpu", repeats=1, warmup=0)
    assert bw > 0 and seen == [16 * hw.MiB // 4] * 2


def test_default_copy_is_several_times_the_cache():
    llc = hw.last_level_cache_bytes()
    assert llc is None or llc > 0
    size = hw.default_copy_bytes("cpu")
    assert 256 * hw.MiB <= size <= 2 * hw.GiB
    if llc is not None and 4 * llc <= 2 * hw.GiB:
        assert size >= 4 * llc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_flops_small_is_positive_finite(dtype):
    flops = measure_matmul_flops(dtype, "cpu", n=64, repeats=2)
    assert math.isfinite(flops) and flops > 0


def test_slow_16bit_cpu_matmul_gets_a_smaller_default_n(monkeypatch):
    def fake_time_fn(seconds):
        return lambda fn, **kw: (fn(), type("T", (), {"min_s": seconds, "median_s": seconds})())[1]
    cpu = torch.device("cpu")
    monkeypatch.setattr(hw, "time_fn", fake_time_fn(2 * 512 ** 3 / 1e12))    # 1 TFLOP/s: default fits
    assert hw._affordable_n(torch.float16, cpu, 2048) == 2048
    monkeypatch.setattr(hw, "time_fn", fake_time_fn(2 * 512 ** 3 / 1e9))     # 1 GFLOP/s: emulated
    n = hw._affordable_n(torch.float16, cpu, 2048)
    assert n % 256 == 0 and 512 <= n < 2048 and 2 * n ** 3 / 1e9 <= 1.0


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool, "float32"])
def test_matmul_refuses_non_float_dtypes(dtype):
    with pytest.raises(TypeError, match="float dtype"):
        measure_matmul_flops(dtype, "cpu", n=16)


def test_matmul_flops_formula(monkeypatch):
    # 2 * n**3 FLOPs in the median time: fake the timer to check the arithmetic exactly.
    monkeypatch.setattr(hw, "time_fn", lambda fn, **kw: type("T", (), {"median_s": 0.5})())
    assert measure_matmul_flops(torch.float32, "cpu", n=100) == 2 * 100 ** 3 / 0.5
    assert measure_bandwidth("cpu", nbytes=1 << 20) == 2 * (1 << 20) / 0.5


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
    MemoryError(),
])
def test_out_of_memory_becomes_measurement_error(monkeypatch, error):
    def fail(numel, dtype, device):
        raise error
    monkeypatch.setattr(hw, "_empty", fail)
    with pytest.raises(MeasurementError, match=r"1.0 GiB copy \(two 512 MiB buffers\).*nbytes="):
        measure_bandwidth("cpu", nbytes=512 * hw.MiB)
    with pytest.raises(MeasurementError, match=r"4096 x 4096 float32 matmul .*smaller n="):
        measure_matmul_flops(torch.float32, "cpu", n=4096)


def test_real_allocation_failure_is_caught():
    with pytest.raises(MeasurementError, match="does not fit in memory"):
        measure_bandwidth("cpu", nbytes=1 << 50)     # a pebibyte: no machine has it


def test_other_runtime_errors_pass_through(monkeypatch):
    def fail(numel, dtype, device):
        raise RuntimeError("something else broke")
    monkeypatch.setattr(hw, "_empty", fail)
    with pytest.raises(RuntimeError, match="something else broke"):
        measure_bandwidth("cpu", nbytes=1 << 20)


def test_ridge_point_formula_and_errors():
    assert ridge_point(312e12, 2039e9) == pytest.approx(153.0, abs=0.1)
    assert ridge_point(100.0, 4.0) == 25.0
    for bad in [(0, 1), (1, 0), (-1, 1), (float("nan"), 1), (1, float("inf"))]:
        with pytest.raises(ValueError, match="must be a finite number > 0"):
            ridge_point(*bad)
    with pytest.raises(TypeError, match="flops must be a number, got str '1'"):
        ridge_point("1", 1)


def test_spec_table_sanity():
    assert SPECS["A100 80GB SXM"].ridge == pytest.approx(153.0, abs=0.1)      # the seed's 312 TFLOP/s, 2,039 GB/s
    assert SPECS["H100 SXM"].ridge == pytest.approx(295, abs=1)
    assert SPECS["H200 SXM"].ridge == pytest.approx(206, abs=1)
    for spec in SPECS.values():
        assert spec.bandwidth_GBps > 0 and spec.memory_GB > 0 and spec.source
        if spec.tflops_16 is not None and spec.tflops_32 is not None:
            assert spec.tflops_16 > spec.tflops_32   # tensor cores beat plain fp32
        if spec.tflops_16 is None:
            assert spec.ridge is None
    # Each row's own name finds itself, and only itself.
    for name in ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200",
                 "NVIDIA L4", "NVIDIA GeForce RTX 4090", "Apple M1", "Apple M1 Max", "Apple M2 Max"]:
        assert match_spec(name) is not None, name
    assert match_spec("NVIDIA A100-SXM4-80GB").name == "A100 80GB SXM"
    assert match_spec("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert match_spec("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert match_spec("Apple M1 Max").name == "Apple M1 Max"
    assert match_spec("Apple M1").name == "Apple M1"
    assert match_spec("Apple M1 Pro") is None
    assert match_spec("Intel(R) Xeon(R) Processor (2 cores)") is None


# ---- the bandwidth sweep and lesson 00's figures ----------------------------------------------------------

def test_sweep_reaches_past_the_cache_and_respects_free_memory():
    MiB, GiB = hw.MiB, hw.GiB
    sizes = hw.bandwidth_sweep_sizes("cpu", cache_bytes=260 * MiB, free_bytes=64 * GiB)
    assert sizes == sorted(set(sizes)) and sizes[0] == 64 << 10
    assert sizes[-1] >= 4 * 260 * MiB                      # main memory is seen well beyond the cache
    small = hw.bandwidth_sweep_sizes("cpu", cache_bytes=260 * MiB, free_bytes=2 * GiB)
    assert 2 * small[-1] <= (2 * GiB) // 2                  # two buffers fit in half the free memory
    unknown = hw.bandwidth_sweep_sizes("cpu", cache_bytes=None, free_bytes=None)
    assert unknown[-1] == hw.default_copy_bytes("cpu")
    assert hw.bandwidth_sweep_sizes("cpu", cache_bytes=0, free_bytes=None, reach=8)[-1] == unknown[-1]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(reach=0), ValueError, "reach must be >= 1"),
    (dict(cache_bytes=2.5), TypeError, "cache_bytes must be an int"),
    (dict(free_bytes=-3), ValueError, "free_bytes must be >= 0"),
    (dict(smallest=10), ValueError, "smallest must be >= 4096"),
])
def test_sweep_sizes_reject_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        hw.bandwidth_sweep_sizes("cpu", **kwargs)


def test_sweep_uses_fewer_repeats_for_huge_buffers(monkeypatch):
    assert hw.sweep_repeats(1 << 20) >= hw.sweep_repeats(256 * hw.MiB) >= hw.sweep_repeats(2 * hw.GiB)
    assert hw.sweep_repeats(2 * hw.GiB)[1] < hw.sweep_repeats(1 << 20)[1]
    calls = []
    monkeypatch.setattr(hw, "measure_bandwidth", lambda device, nbytes, warmup, repeats:
                        calls.append((nbytes, warmup, repeats)) or float(nbytes))
    sizes = [1 << 20, 2 * hw.GiB]
    assert hw.measure_bandwidth_sweep(sizes, "cpu") == [float(s) for s in sizes]
    assert calls == [(s, *hw.sweep_repeats(s)) for s in sizes]


def test_cache_label_names_level_size_and_the_vm_caveat(monkeypatch):
    monkeypatch.setattr(hw, "last_level_cache", lambda: (3, 260 * hw.MiB))
    monkeypatch.setattr(hw, "in_virtual_machine", lambda: False)
    assert hw.cache_label("cpu") == "last-level cache (L3, 260 MiB as reported)"
    monkeypatch.setattr(hw, "in_virtual_machine", lambda: True)
    assert "in a VM this may be the host's" in hw.cache_label("cpu")
    monkeypatch.setattr(hw, "last_level_cache", lambda: None)
    assert hw.cache_label("cpu") == "last-level cache: size unknown" and hw.device_cache("cpu") is None


def test_bandwidth_figure_puts_the_cache_label_in_log_units():
    from labutils.figures.hardware import bandwidth_figure
    sizes = [2 ** k for k in range(16, 29, 2)]                       # 64 KiB ... 256 MiB
    fig = bandwidth_figure(sizes, [1e10] * len(sizes), cache_bytes=260 * hw.MiB, cache_text="LLC")
    (note,), (line,) = fig.layout.annotations, fig.layout.shapes
    assert line.x0 == line.x1 == 260                                 # shapes: data units
    assert note.x == pytest.approx(math.log10(260)) and note.text == "LLC"   # annotations: log10 units
    assert note.xanchor == "right"                                   # near the right edge: hangs left
    lo, hi = fig.layout.xaxis.range                                  # in log10 units too
    assert lo <= math.log10(sizes[0] / hw.MiB) and hi >= math.log10(260)
    assert hi - lo < 6                                               # a few decades, not 10**260
    with pytest.raises(ValueError, match="one bandwidth per buffer size"):
        bandwidth_figure(sizes, [1e10])


def test_datasheet_figure_one_legend_entry_for_the_machine_and_no_silent_gaps():
    from labutils.figures.hardware import NO_FIGURE_TEXT, datasheet_figure, legend_names
    fig = datasheet_figure(20e9, 100e9, "float32")
    names = legend_names(fig)
    assert sum("this machine" in n for n in names) == 1 and len(names) == len(set(names))
    measured = [t for t in fig.data if "this machine" in (t.name or "")]
    assert len(measured) == 2 and {t.legendgroup for t in measured} == {"measured"}
    bare = next(t for t in fig.data if t.name == NO_FIGURE_TEXT)
    assert list(bare.x) == [s.name for s in SPECS.values() if s.tflops_16 is None and s.tflops_32 is None]
    assert NO_FIGURE_TEXT in names and "no fp16/bf16" in fig.layout.title.subtitle.text      # the note, under the title
    with pytest.raises(ValueError, match="flops must be a finite number > 0"):
        datasheet_figure(20e9, 0)


def test_rooflines_figure_uses_the_one_formula_and_log_units_for_labels():
    from labutils.perf import roofline
    from labutils.figures.hardware import rooflines_figure
    fig = rooflines_figure([("A", 100e12, 1e12)], marks=[(1.0, "decode"), (961.0, "prefill")],
                           intensities=[1, 100, 1e4])
    assert list(fig.data[0].y) == [roofline.attainable_flops(i, 100e12, 1e12) / 1e12 for i in (1, 100, 1e4)]
    assert [a.x for a in fig.layout.annotations] == [0.0, pytest.approx(math.log10(961))]
    assert [s.x0 for s in fig.layout.shapes] == [1.0, 961.0]
    with pytest.raises(ValueError, match="x must be a finite number > 0"):
        rooflines_figure([], marks=[(0, "zero")])


def test_device_cache_reads_a_gpus_l2(monkeypatch):
    # No GPU in CI: fake the device and its properties; the sweep then plans past 4x that L2.
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(hw, "resolve_device", lambda device=None: cuda)
    props = type("Props", (), {"L2_cache_size": 50 << 20})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert hw.device_cache("cuda") == ("L2", 50 << 20)
    assert hw.cache_label("cuda") == "last-level cache (L2, 50 MiB as reported)"
    sizes = hw.bandwidth_sweep_sizes("cuda", free_bytes=80 * hw.GiB)
    assert sizes[-1] == hw.GiB >= 4 * (50 << 20)            # default_copy_bytes for a GPU, past 4x its L2
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: object())   # an older torch
    assert hw.device_cache("cuda") is None


@pytest.mark.parametrize("cache_mib, free_gib", [(c, f) for c in (0, 1, 32, 260, 1024) for f in (0.01, 1, 3, 64)])
def test_sweep_sizes_property(cache_mib, free_gib):
    MiB, GiB = hw.MiB, hw.GiB
    free = int(free_gib * GiB)
    sizes = hw.bandwidth_sweep_sizes("cpu", cache_bytes=cache_mib * MiB, free_bytes=free)
    assert sizes and sizes == sorted(set(sizes)) and sizes[0] == 64 << 10
    assert all(s & (s - 1) == 0 for s in sizes[:-1])                 # powers of two below the top
    if sizes[-1] > 64 << 10:
        assert 2 * sizes[-1] <= free // 2                            # never more than half the free memory
    if 2 * 4 * cache_mib * MiB * 2 <= free // 2:                     # room to spare: the sweep passes 4x the cache
        assert sizes[-1] >= 4 * cache_mib * MiB
