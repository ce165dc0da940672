"""One set of peaks per machine: measured once, saved per (device, torch, dtype), read back, never saved when busy."""
import json
import time

import pytest
import torch

from labutils.perf import peaks as pk
from labutils.perf import quiet


@pytest.fixture
def probes(monkeypatch, tmp_path):
    """Fake probes that count their calls, a private cache file, and a machine that is quiet unless told."""
    calls = []
    monkeypatch.setenv("LABUTILS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(pk, "_SESSION", {})
    monkeypatch.setattr(pk, "measure_bandwidth", lambda device: calls.append("copy") or 10e9 + len(calls))
    monkeypatch.setattr(pk, "measure_matmul_flops", lambda dtype, device: calls.append(dtype) or 100e9)
    monkeypatch.setattr(quiet, "_read_counters", lambda cores: (0, 0, 0))
    return calls


def test_measured_once_then_read_from_the_file(probes, tmp_path):
    first = pk.measured_peaks("cpu")
    assert probes.count("copy") == pk.RUNS and probes.count(torch.float32) == pk.RUNS
    assert first.flops == 100e9 and first.bandwidth_Bps == 10e9 + pk.RUNS      # the best of RUNS runs
    assert "saved to" in first.source and (tmp_path / "peaks.json").exists()
    again = pk.measured_peaks("cpu")
    assert len(probes) == 2 * pk.RUNS, "a second call must read the file, not measure"
    assert again == first and "read from" in again.source
    entries = json.loads((tmp_path / "peaks.json").read_text())["entries"]
    assert any(torch.__version__ in key and key.endswith("| copy") for key in entries)
    assert any(key.endswith("| float32") for key in entries)


def test_one_bandwidth_for_every_dtype(probes):
    fp32 = pk.measured_peaks("cpu", torch.float32)
    bf16 = pk.measured_peaks("cpu", torch.bfloat16)
    assert probes.count("copy") == pk.RUNS, "the copy bandwidth is one entry per device, shared by every dtype"
    assert bf16.bandwidth_Bps == fp32.bandwidth_Bps and bf16.dtype == "bfloat16"


def test_refresh_and_stale_entries_measure_again(probes, tmp_path, monkeypatch):
    pk.measured_peaks("cpu")
    pk.measured_peaks("cpu", refresh=True)
    assert probes.count("copy") == 2 * pk.RUNS
    path = tmp_path / "peaks.json"
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        entry["measured_at"] = time.time() - (pk.MAX_AGE_DAYS + 1) * 86400
    path.write_text(json.dumps(data))
    pk.measured_peaks("cpu")
    assert probes.count("copy") == 3 * pk.RUNS, "an entry older than MAX_AGE_DAYS is measured again"


def test_a_broken_file_is_measured_over(probes, tmp_path):
    (tmp_path / "peaks.json").write_text("{not json")
    p = pk.measured_peaks("cpu")
    assert p.flops == 100e9 and json.loads((tmp_path / "peaks.json").read_text())["format"] == 1


def test_a_busy_measurement_is_never_saved(probes, tmp_path, monkeypatch, capsys):
    ticks = iter(range(0, 10**9, 1000))
    # Every reading: both cores fully busy, none of it this process's -> others used all of the machine.
    monkeypatch.setattr(quiet, "_read_counters", lambda cores: ((t := next(ticks)) * 2, t * 2, 0))
    p = pk.measured_peaks("cpu")
    assert "busy machine" in p.source and not (tmp_path / "peaks.json").exists()
    assert quiet.MARKER in capsys.readouterr().out
    # Still one set of numbers within the session, even though the file has none.
    assert pk.measured_peaks("cpu") == p and probes.count("copy") == pk.RUNS


def test_peaks_are_measured_at_the_starting_thread_count(probes, monkeypatch):
    seen = []
    monkeypatch.setattr(pk, "measure_bandwidth", lambda device: seen.append(torch.get_num_threads()) or 1e9)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pk.measured_peaks("cpu")
    finally:
        torch.set_num_threads(before)
    assert set(seen) == {pk.THREADS}


def test_the_printed_line_is_one_format():
    p = pk.Peaks(25.04e9, 316.2e9, "Some CPU (2 cores)", "float32", source="from a test")
    assert p.line() == "peaks of Some CPU (2 cores), float32: copy 25.0 GB/s, matmul 316.2 GFLOP/s, ridge 12.6 FLOP/byte"
    assert str(p) == p.line() + "\n  (from a test)"
    gpu = pk.Peaks(4.5e12, 800e12, "NVIDIA H200", "bfloat16")
    assert "copy 4.5 TB/s, matmul 800.0 TFLOP/s" in gpu.line()
    assert p == pk.Peaks(25.04e9, 316.2e9, "Some CPU (2 cores)", "float32", source="elsewhere")   # source is not data


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LABUTILS_CACHE_DIR", str(tmp_path / "x"))
    assert pk.cache_file() == tmp_path / "x" / "peaks.json"
    monkeypatch.delenv("LABUTILS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert pk.cache_dir() == tmp_path / "prefill-decode-lab"


def test_a_busy_refresh_wins_over_an_older_file_within_the_session(probes, monkeypatch):
    quiet_first = pk.measured_peaks("cpu")                     # saved
    ticks = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(quiet, "_read_counters", lambda cores: ((t := next(ticks)) * 2, t * 2, 0))
    busy = pk.measured_peaks("cpu", refresh=True)              # not saved
    monkeypatch.setattr(quiet, "_read_counters", lambda cores: (0, 0, 0))
    assert busy != quiet_first and pk.measured_peaks("cpu") == busy, "one set of peaks within a session"
