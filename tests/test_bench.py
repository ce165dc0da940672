"""The benchmark machinery on tiny shapes: rows, ratio columns, JSON, errors. No timing asserts."""
import json
import math

import pytest

from labutils import bench


def test_quick_bench_prints_every_row_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench.main(["--quick", "--rounds", "1", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    for i, fn in enumerate(bench.ROWS, 1):
        assert f"[{i}/{len(bench.ROWS)}] {fn.__name__}" in out           # a progress line per row
    header = next(line for line in out.splitlines() if line.startswith("row "))
    assert all(col in header for col in ("ratio", "target", "status", "measured", "setup"))
    data = json.loads(path.read_text())
    assert data["quick"] is True and data["device"] == "cpu"
    assert len(data["rows"]) == len(bench.ROWS)
    names = [r["name"] for r in data["rows"]]
    assert any("recompute / cached" in n for n in names) and any(n.startswith("TPOT") for n in names)
    for r in data["rows"]:
        assert r["status"] in ("PASS", "FAIL") and math.isfinite(r["ratio"]) and r["ratio"] > 0
        assert r["name"] in out and r["target"] in out


def test_status_follows_the_target():
    assert bench.BenchRow("a", 3.5, ">= 3", "", "").status == "PASS"
    assert bench.BenchRow("a", 2.9, ">= 3", "", "").status == "FAIL"
    assert bench.BenchRow("b", 1.2, "<= 1.3", "", "").status == "PASS"
    assert bench.BenchRow("b", 1.4, "<= 1.3", "", "").status == "FAIL"


def test_a_failing_row_still_exits_zero_but_an_error_does_not(monkeypatch, capsys):
    def slow(s):
        return bench.BenchRow("never fast enough", 1.0, ">= 100", "made up", "made up")

    def broken(s):
        raise RuntimeError("row exploded")

    monkeypatch.setattr(bench, "ROWS", [slow])
    assert bench.main(["--quick"]) == 0
    assert "FAIL" in capsys.readouterr().out
    monkeypatch.setattr(bench, "ROWS", [slow, broken])
    assert bench.main(["--quick"]) == 1
    out = capsys.readouterr().out
    assert "ERROR" in out and "row exploded" in out and "never fast enough" in out


def test_only_filters_rows_and_rejects_unknown(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--only", "no_such_row"])
    assert "no row matches" in capsys.readouterr().err


def test_speculative_rows_report_alpha_and_best_k_and_assert_identical_tokens(monkeypatch):
    s = bench.BenchSettings(quick=True, rounds=1)
    for fn in (bench.speculative_draft_vs_greedy, bench.speculative_lookup_vs_greedy):
        row = fn(s)
        assert row.target == ">= 1.3" and row.status in ("PASS", "FAIL") and row.ratio > 0
        assert "alpha" in row.detail and "best k=" in row.detail and "identical tokens" in row.setup
    # A speculative loop that emits other tokens than greedy decoding must make the row an error.
    import labutils.speculative as spec
    real = spec.speculative_generate

    def off_by_one(*args, **kwargs):
        r = real(*args, **kwargs)
        r.tokens = r.tokens.clone()           # made under inference_mode: copy before editing
        r.tokens[0, -1] = (r.tokens[0, -1] + 1) % 4096
        return r

    monkeypatch.setattr(spec, "speculative_generate", off_by_one)
    with pytest.raises(AssertionError, match="differ from greedy"):
        bench.speculative_draft_vs_greedy(s)
