"""labutils.gpu_check's machinery, on the CPU: the wheel check, the report builder, and a dry run end to end (the gpu
tests, one lesson and the quick bench on emulated CUDA), so a broken harness shows up before anyone holds a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import nbformat
import pytest

from labutils import bench, gpu_check


def test_the_wheel_check_names_what_is_missing_and_how_to_carry_it():
    gone = {"nbclient", "plotly"}
    missing = gpu_check.missing_packages(find=lambda mod: None if mod in gone else object())
    assert missing == {"lessons": ["nbclient", "plotly"]}
    advice = gpu_check.wheel_advice(missing)
    assert "lessons: nbclient, plotly" in advice
    assert "pip download --only-binary=:all:" in advice and "-d wheels nbclient plotly" in advice
    assert "--no-index --find-links wheels nbclient plotly" in advice
    assert gpu_check.wheel_advice({}) == ""


def test_every_module_the_check_needs_is_named_by_its_import_name():
    assert gpu_check.missing_packages() == {}          # the dev install has them all: a typo would show up here


def test_a_lesson_summary_counts_cells_errors_and_claims():
    nb = {"cells": [
        {"cell_type": "code", "execution_count": 1, "outputs": [
            {"output_type": "stream", "name": "stdout", "text": "[holds] a: measured 1\n[does not hold here] b: 2\n"}]},
        {"cell_type": "markdown", "source": "x"},
        {"cell_type": "code", "execution_count": 2, "outputs": [
            {"output_type": "error", "ename": "RuntimeError", "evalue": "Expected all tensors\nmore", "traceback": []},
            {"output_type": "stream", "name": "stdout", "text": ["[not expected here] c: 3\n"]}]},
        {"cell_type": "code", "execution_count": None, "outputs": []}]}
    s = gpu_check.lesson_summary(nb)
    assert (s["cells"], s["ran"]) == (3, 2)
    assert s["errors"] == ["cell 2: RuntimeError: Expected all tensors"]
    assert s["claims"] == {"holds": 1, "does not hold here": 1, "not expected here": 1}
    assert s["not_holding"] == ["cell 0: [does not hold here] b: 2", "cell 2: [not expected here] c: 3"]


def test_junit_results_are_read_with_their_reasons(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.a" name="ok"/>'
                   '<testcase classname="tests.a" name="bad"><failure message="assert 1 == 2&#10;more">x</failure>'
                   '</testcase><testcase classname="tests.b" name="gpu"><skipped message="needs a CUDA GPU"/>'
                   '</testcase></testsuite></testsuites>')
    assert gpu_check.parse_junit(xml) == [
        {"name": "tests.a::ok", "result": "passed", "why": ""},
        {"name": "tests.a::bad", "result": "failed", "why": "assert 1 == 2"},
        {"name": "tests.b::gpu", "result": "skipped", "why": "needs a CUDA GPU"}]


def test_without_a_gpu_the_real_check_refuses_and_names_the_dry_run():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = subprocess.run([sys.executable, "-m", "labutils.gpu_check"], capture_output=True, text=True, timeout=120,
                       cwd=gpu_check.ROOT)
    assert p.returncode == 2 and "no CUDA GPU here" in p.stderr and "--dry-run" in p.stderr


def test_a_dry_run_writes_the_report_a_reviewer_reads(tmp_path):
    out = tmp_path / "gpu-check"
    p = subprocess.run([sys.executable, "-m", "labutils.gpu_check", "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=1500, cwd=gpu_check.ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["environment"]["dry_run"] and report["environment"]["torch"]
    assert report["tests"]["counts"]["failed"] == 0 and report["tests"]["tests"], report["tests"]
    (lesson,) = report["lessons"]
    assert lesson["lesson"] == gpu_check.DRY_LESSON and lesson["ran"] == lesson["cells"] > 10
    assert lesson["errors"] == [], lesson["errors"]          # every cell ran on emulated CUDA
    assert sum(lesson["claims"].values()) > 5
    # Every bench row ran on emulated CUDA and none errored: the H200 run stopped two rows at their first line (a CPU
    # generator drawing onto CUDA). Only the vLLM rows may skip, without a vLLM venv; a row's timings mean nothing.
    rows = report["bench"]["rows"]
    assert len(rows) == len(bench.ROWS) and not [r for r in rows if r["status"] == "ERROR"], rows
    assert all(r["status"] != "SKIP" or "vLLM" in r["name"] for r in rows), rows
    assert all(r["seconds"] >= 0 for r in rows)
    md = (out / "REPORT.md").read_text()
    for heading in ("# gpu-check:", "## Tests", "## Lessons", "## Bench", "dry run"):
        assert heading in md
    assert f"| {gpu_check.DRY_LESSON} | {lesson['ran']} of {lesson['cells']} | 0 |" in md
    with tarfile.open(out / "lessons.tar.gz") as tar:
        assert f"lessons/{gpu_check.DRY_LESSON}" in tar.getnames()


def test_a_lesson_stopped_at_its_limit_keeps_the_cells_it_ran_and_stops_its_kernel(tmp_path, monkeypatch):
    """On a GPU a 7B lesson can outrun its share of the check: the cells before the limit, and their claims, still
    reach the report, and its kernel does not outlive it (it would hold the GPU under the next lesson)."""
    pid_file = tmp_path / "kernel.pid"
    lesson = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell('print("[holds] a first claim: measured yes, expected yes")'),
        nbformat.v4.new_code_cell(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                                  "time.sleep(600)"),
        nbformat.v4.new_code_cell('print("never")')])
    nbformat.write(lesson, tmp_path / "99_slow.ipynb")
    monkeypatch.setattr(gpu_check, "LESSONS", tmp_path)
    (tmp_path / "out" / "lessons").mkdir(parents=True)
    (row,) = gpu_check.run_lessons(["99_slow.ipynb"], tmp_path / "out", dict(os.environ), limit_s=60, lesson_s=10)
    assert row["failed"] == "timed out" and row["cells"] == 3 and row["ran"] == 2, row
    assert row["claims"]["holds"] == 1 and row["errors"] == ["cell 1: KeyboardInterrupt: "], row   # where it stopped
    kernel = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while alive(kernel) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(kernel), f"the lesson's kernel {kernel} outlived its limit"


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie waiting for its parent to read its exit."""
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]
    except FileNotFoundError:
        return False


def test_a_second_call_runs_only_the_parts_it_names(tmp_path, monkeypatch):
    """With 15 minutes of device time a second call takes the lessons the first did not reach, with their whole budget,
    and neither the tests nor the bench again."""
    ran = {}
    monkeypatch.setattr(gpu_check, "run_tests", lambda *a: ran.setdefault("tests", a))
    monkeypatch.setattr(gpu_check, "run_bench", lambda *a, **k: ran.setdefault("bench", a))
    monkeypatch.setattr(gpu_check, "run_lessons", lambda names, out, env, limit_s, lesson_s: ran.setdefault(
        "lessons", (names, limit_s, lesson_s)) and [])
    report = gpu_check.check(tmp_path, lessons=["09_serving.ipynb"], log=lambda *_: None, parts=["lessons"],
                             limits={"lessons": 450})
    assert ran == {"lessons": (["09_serving.ipynb"], 450, gpu_check.LIMITS_S["lesson"])}
    assert report["parts"] == ["lessons"] and report["bench"]["rows"] == [] and report["tests"]["tests"] == []
    md = (tmp_path / "REPORT.md").read_text()
    assert "Not run in this call (--parts): tests, bench." in md and "## Lessons" in md
    assert "## Tests" not in md and "## Bench" not in md


def test_the_command_line_takes_parts_and_limits_and_refuses_a_bad_limit(monkeypatch, capsys):
    asked = {}

    def check(out, dry_run, lessons, parts, limits):
        asked.update(parts=list(parts), limits=limits)
        return {"tests": {"counts": {"failed": 0}}, "lessons": [], "bench": {"rows": []}}
    monkeypatch.setattr(gpu_check, "check", check)
    assert gpu_check.main(["--dry-run", "--parts", "lessons", "--limit", "lessons=450", "lesson=200"]) == 0
    assert asked == {"parts": ["lessons"], "limits": {"lessons": 450.0, "lesson": 200.0}}
    with pytest.raises(SystemExit):
        gpu_check.main(["--limit", "lessons=soon"])            # refused before it looks for a GPU
    assert "--limit lessons=soon: give PART=SECONDS with PART one of tests, lesson, lessons, bench" in \
        capsys.readouterr().err
