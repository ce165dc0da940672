"""The stored lessons tell the truth about themselves: every claim holds, no busy machine, one set of peaks.

This reads the committed notebooks and times nothing. nbval re-executes the lessons and ignores their timings
(they change every run); this test checks what a learner reads before running anything: the outputs stored
beside the prose.
- A claim printed "[does not hold here]" (labutils.measure.claims) means the sentence next to it is contradicted.
- A "busy machine:" line (labutils.perf.quiet) means the stored timings came from a loaded machine.
- Every "peaks of ..." line (labutils.perf.peaks.Peaks.line) must show the same numbers for a device and dtype,
  and the same copy bandwidth for every dtype: MBU and MFU divide by one set of ceilings.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

from labutils.measure.claims import FAILS, VERDICTS
from labutils.perf.quiet import MARKER

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PEAKS = re.compile(r"^peaks of (?P<device>.+), (?P<dtype>\w+): copy (?P<copy>[\d.,]+ [GT]B/s), "
                   r"matmul (?P<matmul>[\d.,]+ [GT]FLOP/s), ridge")
CLAIM_CALL = re.compile(r"\bclaim\(")
COUNTS: dict[str, dict[str, int]] = {}      # lesson -> verdict -> count, for the summary conftest prints


def output_lines(nb: dict) -> list[tuple[int, str]]:
    """(cell index, line) for every line of text a notebook's code cells have stored."""
    found = []
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            texts = [out.get("text", "")] if out["output_type"] == "stream" else \
                [out.get("data", {}).get("text/plain", "")]
            for text in texts:
                text = "".join(text) if isinstance(text, list) else text
                found += [(i, line) for line in text.splitlines()]
    return found


def claim_counts(nb: dict) -> dict[str, int]:
    counts = {v: 0 for v in VERDICTS}
    for _, line in output_lines(nb):
        for verdict in VERDICTS:
            if line.startswith(verdict + " "):
                counts[verdict] += 1
    return counts


def problems(nb: dict) -> list[str]:
    """What is wrong in one notebook's stored outputs: failed claims, busy-machine lines, uncalled claims."""
    found = []
    for i, line in output_lines(nb):
        if line.startswith(FAILS + " "):
            found.append(f"cell {i}: a stored claim fails: {line}")
        if MARKER in line:
            found.append(f"cell {i}: stored on a busy machine: {line}")
    calls = sum(len(CLAIM_CALL.findall("".join(c["source"]))) for c in nb["cells"] if c["cell_type"] == "code")
    printed = sum(claim_counts(nb).values())
    if printed < calls:
        found.append(f"the code calls claim() {calls} times but the stored outputs show {printed} verdicts: "
                     "re-execute the lesson and store its outputs")
    return found


def peaks_problems(notebooks: dict[str, dict]) -> list[str]:
    """Peaks lines that disagree across lessons: per device and dtype, and the copy bandwidth per device."""
    seen = defaultdict(set)          # (device, dtype) -> {(copy, matmul)}
    copies = defaultdict(set)        # device -> {copy}
    where = defaultdict(list)
    for name, nb in notebooks.items():
        for i, line in output_lines(nb):
            if m := PEAKS.match(line):
                seen[m["device"], m["dtype"]].add((m["copy"], m["matmul"]))
                copies[m["device"]].add(m["copy"])
                where[m["device"], m["dtype"]].append(f"{name} cell {i}: {line}")
    out = [f"{device}, {dtype} has {len(v)} different peaks:\n  " + "\n  ".join(where[device, dtype])
           for (device, dtype), v in seen.items() if len(v) > 1]
    out += [f"{device} shows {len(v)} copy bandwidths across dtypes: {sorted(v)}" for device, v in copies.items()
            if len(v) > 1]
    if len(copies) > 1:
        out.append(f"the lessons were stored on {len(copies)} machines ({', '.join(copies)}); store them all on one")
    return out


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_claims_hold_and_no_busy_machine(path):
    nb = load(path)
    COUNTS[path.stem] = claim_counts(nb)
    found = problems(nb)
    assert not found, f"{path.name}:\n" + "\n".join(found)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_lesson_checks_a_claim(path):
    counts = claim_counts(load(path))
    assert counts["[holds]"] >= 1, f"{path.name} states no claim about its own measurements (labutils.measure.claims.claim)"


def test_one_set_of_peaks_in_every_lesson():
    notebooks = {p.stem: load(p) for p in NOTEBOOKS}
    assert not (found := peaks_problems(notebooks)), "\n".join(found)
    lessons = [name for name, nb in notebooks.items() if any(PEAKS.match(line) for _, line in output_lines(nb))]
    assert len(lessons) >= 5, f"only {lessons} print their peaks; every lesson that divides by them should"


# ---- the checks themselves can fail ----------------------------------------------------------------------------

def fake(*texts: str, code: str = "") -> dict:
    return {"cells": [{"cell_type": "code", "source": code, "outputs": [
        {"output_type": "stream", "name": "stdout", "text": t} for t in texts]}]}


def test_a_failed_claim_and_a_busy_line_are_found():
    assert problems(fake("[holds] a: measured 2, expected at least 1\n")) == []
    found = problems(fake("[does not hold here] a: measured 0.5, expected at least 1. Likely reasons: x\n"))
    assert len(found) == 1 and "a stored claim fails" in found[0]
    found = problems(fake(f"{MARKER} other processes used 1.5 of 2 usable cores during this measurement\n"))
    assert len(found) == 1 and "busy machine" in found[0]


def test_a_claim_call_without_its_output_is_found():
    found = problems(fake("", code="claim('a', 2, at_least=1)\nclaim('b', 2, at_least=1)"))
    assert len(found) == 1 and "2 times" in found[0] and "0 verdicts" in found[0]


def test_differing_peaks_are_found():
    line = "peaks of CPU X (2 cores), float32: copy {} GB/s, matmul 300.0 GFLOP/s, ridge 12.0 FLOP/byte\n"
    same = {"00": fake(line.format("25.0")), "05": fake(line.format("25.0"))}
    assert peaks_problems(same) == []
    differ = {"00": fake(line.format("25.0")), "05": fake(line.format("7.5"))}
    assert len(peaks_problems(differ)) == 2          # the (device, dtype) pair, and the copy across dtypes
    bf16 = "peaks of CPU X (2 cores), bfloat16: copy 26.0 GB/s, matmul 2.0 TFLOP/s, ridge 76.6 FLOP/byte\n"
    assert any("copy bandwidths" in p for p in peaks_problems({"00": fake(line.format("25.0")), "07": fake(bf16)}))
