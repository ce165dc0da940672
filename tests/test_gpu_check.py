"""labutils.gpu_check's machinery, on the CPU: the wheel check, the report builder, and a dry run end to end (the gpu
tests, lesson 06 and the quick bench on emulated CUDA), so a broken harness shows up before anyone holds a GPU."""
from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import pytest

from labutils import gpu_check


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
    rows = report["bench"]["rows"]
    assert len(rows) > 10 and not [r for r in rows if r["status"] == "ERROR"]
    assert all(r["seconds"] >= 0 for r in rows)
    md = (out / "REPORT.md").read_text()
    for heading in ("# gpu-check:", "## Tests", "## Lessons", "## Bench", "dry run"):
        assert heading in md
    assert f"| {gpu_check.DRY_LESSON} | {lesson['ran']} of {lesson['cells']} | 0 |" in md
    with tarfile.open(out / "lessons.tar.gz") as tar:
        assert f"lessons/{gpu_check.DRY_LESSON}" in tar.getnames()
