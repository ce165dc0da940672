"""The README as a landing page, and the docs/ pages it links: the claim table, lesson links, screenshots, GPU
figures, run times and CI job cannot drift, and the landing page stays one screen of essentials."""
from __future__ import annotations

import re

import pytest

from labutils import gpu_table
from labutils.perf.datasheets import SPECS
from notebook_links import NOTEBOOKS, ROOT, link_problem, notebook_links, section_cells
from test_stored_outputs import CLAIM_CALL

README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = ROOT / "docs"
PAGES = {p.name: p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md"))}
CLAIMS = PAGES["claims.md"]
CLAIMS_HEADING = "## What the source texts claim, and where you measure it"
README_MAX_BYTES = 8000          # a landing page: what the course is, two commands, the map, pictures, links


def section(text: str, heading: str) -> str:
    """The README's text from `heading` to the next `## ` heading."""
    start = text.index(heading + "\n") + len(heading) + 1
    nxt = text.find("\n## ", start)
    return text[start:] if nxt < 0 else text[start:nxt]


def table_rows(markdown: str) -> list[str]:
    """The body rows of the first markdown table in `markdown` (header and separator left out)."""
    rows = [ln for ln in markdown.splitlines() if ln.startswith("|")]
    return rows[2:]


SHOWN_AS = ("measured", "computed", "not shown")


def section_shows(name: str, fragment: str | None, kind: str) -> bool:
    """Whether a linked section holds what its row promises: a claim() call (measured) or a code cell (computed)."""
    code = [c["source"] for c in section_cells(NOTEBOOKS / name, fragment) if c["cell_type"] == "code"]
    return any(CLAIM_CALL.search(src) for src in code) if kind == "measured" else bool(code)


def row_problems(row: str) -> list[str]:
    """Why one claim-table row fails: a missing link or heading, or a section that does not show the claim.

    A row is `claim | where | shown as | note`. "measured": some linked section calls labutils.measure.claims.claim on its
    own measurement; "computed": some linked section computes it in a code cell; "not shown": no lesson shows it,
    and the note says why.
    """
    cells_ = [c.strip() for c in row.strip().strip("|").split("|")]
    if len(cells_) != 4 or not cells_[0]:
        return [f"a row needs 4 cells (claim | where | shown as | note), got {len(cells_)}: {row[:80]!r}"]
    claim, where, kind, note = cells_
    if kind not in SHOWN_AS:
        return [f"{claim!r}: 'shown as' must be one of {SHOWN_AS}, got {kind!r}"]
    links = notebook_links(where)
    if kind == "not shown":
        return [] if note else [f"{claim!r} is not shown anywhere: its note must say why"]
    if not links:
        return [f"{claim!r} links to no lesson section"]
    problems = [f"{claim!r}: {p}" for name, frag in links if (p := link_problem(name, frag))]
    if not problems and not any(section_shows(name, frag, kind) for name, frag in links):
        what = "a claim() call on its measurement" if kind == "measured" else "a code cell that computes it"
        problems.append(f"{claim!r} is marked {kind}, but none of its linked sections holds {what}")
    return problems


def test_the_claim_table_is_there_and_full():
    rows = table_rows(section(CLAIMS, CLAIMS_HEADING))
    assert len(rows) >= 40, f"the claim table has {len(rows)} rows; the two seed texts hold more claims than that"


def test_every_claim_links_to_a_heading_that_exists():
    problems = [p for row in table_rows(section(CLAIMS, CLAIMS_HEADING)) for p in row_problems(row)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("row, expected", [
    ("| a made-up claim | [05 §3](notebooks/05_prefill_decode.ipynb#3.-The-seeds-bar-chart) | computed | |", "no heading"),
    ("| a made-up claim | [05 §3](notebooks/05_prefill_decode.ipynb#3.-the-seed's-bar-chart,-measured-on-this-machine) "
     "| computed | |", "no heading"),                                      # JupyterLab's anchors keep case
    ("| a made-up claim | [99](notebooks/99_missing.ipynb) | computed | |", "does not exist"),
    ("| a made-up claim | lesson 05 | computed | |", "links to no lesson section"),
    ("| a made-up claim | [05 §3](notebooks/05_prefill_decode.ipynb) | |", "needs 4 cells"),
    ("| a made-up claim | [05 §3](notebooks/05_prefill_decode.ipynb) | shown | |", "'shown as' must be one of"),
    ("| a made-up claim | | not shown | |", "its note must say why"),
    # The quiz heading holds one code cell (the quiz) and no claim() call.
    ("| a made-up claim | [05 quiz](notebooks/05_prefill_decode.ipynb#Checkpoint-quiz) | measured | |",
     "none of its linked sections holds a claim() call"),
])
def test_a_wrong_row_fails(row, expected):
    problems = row_problems(row)
    assert problems and expected in problems[0]


def test_a_right_row_passes():
    row = ("| made up | [05 §3](notebooks/05_prefill_decode.ipynb#3.-The-seed's-bar-chart,-measured-on-this-machine), "
           "[01 §6](notebooks/01_tokenization.ipynb#6.-Checking-a-claim:-%225,000-characters-is-about-1,300-tokens%22) "
           "| computed | |")
    assert row_problems(row) == []
    assert row_problems("| made up | | not shown | a claim about history, not about a machine |") == []


def test_a_heading_only_section_is_not_a_computation(tmp_path):
    import json
    nb = {"cells": [{"cell_type": "markdown", "source": "## 1. Words\nonly words"},
                    {"cell_type": "markdown", "source": "## 2. Code"}, {"cell_type": "code", "source": "1 + 1"}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "01_x.ipynb").write_text(json.dumps(nb))
    assert section_cells(tmp_path / "01_x.ipynb", "1.-Words")[0]["source"].startswith("## 1.")
    assert [c["cell_type"] for c in section_cells(tmp_path / "01_x.ipynb", "1.-Words")] == ["markdown"]
    assert [c["cell_type"] for c in section_cells(tmp_path / "01_x.ipynb", "2.-Code")] == ["markdown", "code"]


def test_every_lesson_link_in_the_readme_and_its_pages_lands():
    links = notebook_links(README) + [link for text in PAGES.values() for link in notebook_links(text)]
    assert len(links) > 40
    problems = [p for name, frag in links if (p := link_problem(name, frag))]
    assert not problems, "\n".join(problems)


LOCAL_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s#]+)(?:#[^)]*)?\)")


def local_link_problems(text: str, folder) -> list[str]:
    """Relative links of a markdown page (not web addresses) whose file does not exist, seen from `folder`."""
    return [f"{target} (from {folder.name or 'the root'})" for target in LOCAL_LINK.findall(text)
            if not re.match(r"^[a-z]+:", target) and not (folder / target).exists()]


def test_every_file_the_readme_and_its_pages_link_exists():
    problems = local_link_problems(README, ROOT)
    problems += [p for name, text in PAGES.items() for p in local_link_problems(text, DOCS)]
    assert not problems, "\n".join(problems)
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", README))
    assert linked == set(PAGES), f"the README links {sorted(linked)}, docs/ holds {sorted(PAGES)}"
    assert all("](../README.md)" in text for text in PAGES.values()), "every page links back to the README"


def test_a_missing_file_is_reported(tmp_path):
    (tmp_path / "a.md").write_text("x")
    assert local_link_problems("[a](a.md) [b](b.md) [web](https://x.org/b.md)", tmp_path) == [
        f"b.md (from {tmp_path.name})"]


def test_the_readme_is_a_landing_page():
    size = len(README.encode("utf-8"))
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes; move detail into a docs/ page and link it"
    headings = [line for line in README.splitlines() if line.startswith("## ")]
    assert headings[:2] == ["## Two commands", "## Course map"] and "## More" in headings
    assert "make lab" in README and "make test" in README


def test_the_screenshots_exist():
    shots = re.findall(r"!\[[^\]]*\]\((docs/[^)]+\.png)\)", README)
    assert len(shots) == 3, f"the landing page shows three screenshots, got {shots}"
    widget_shots = {f"docs/{s}" for s in re.findall(r"!\[[^\]]*\]\(([^)/]+\.png)\)", PAGES["widgets.md"])}
    assert {"docs/token_viewer.png", "docs/kv_calculator.png", "docs/explorer.png",
            "docs/serving_dashboard.png"} <= widget_shots
    assert [s for s in shots + sorted(widget_shots) if not (ROOT / s).exists()] == []


def test_the_gpu_table_is_what_labutils_computes():
    block = re.search(r"<!-- gpu-table:[^>]*-->\n(.*?)\n<!-- /gpu-table -->", PAGES["gpu.md"], flags=re.S)
    assert block, "docs/gpu.md lost its <!-- gpu-table --> block"
    assert block.group(1) == gpu_table.markdown(), "docs/gpu.md's GPU table is stale: paste python -m labutils.gpu_table"


def test_gpu_table_figures():
    rows = {r["gpu"]: r for r in gpu_table.rows()}
    a100 = SPECS["A100 80GB SXM"]
    assert rows["A100 80GB SXM"]["ridge"] == pytest.approx(312e12 / 2039e9)
    # bandwidth alone sets the floor: the H200 is faster than the H100 by their bandwidth ratio, for every model
    for m in gpu_table.MODELS:
        ratio = rows["H100 SXM"]["floor_s"][m] / rows["H200 SXM"]["floor_s"][m]
        assert ratio == pytest.approx(4800 / 3350)
    # Llama-2-7B in bf16 is about 13.5 GB of weights: the A100 floor is a bit above 13.5e9 / 2.039e12 s
    assert 13.4e9 / a100.bandwidth_Bps < rows["A100 80GB SXM"]["floor_s"]["llama-2-7b"] < 14.5e9 / a100.bandwidth_Bps
    with pytest.raises(ValueError, match="unknown gpu 'A100'"):
        gpu_table.rows(gpus=["A100"])
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        gpu_table.rows(models=["gpt-5"])


def test_the_readme_shows_the_committed_workflow():
    workflow = (ROOT / ".github" / "workflows" / "test.yml").read_text(encoding="utf-8").rstrip("\n")
    assert f"```yaml\n{workflow}\n```" in PAGES["instructors.md"], \
        "docs/instructors.md's block differs from .github/workflows/test.yml"
    assert ".ci/run" in workflow and "3.12" in workflow


def test_the_course_map_gives_each_lessons_quiet_machine_run_time():
    from notebook_links import run_seconds
    body = section(README, "## Course map")
    rows = [r for r in table_rows(body)]
    assert len(rows) == len(list(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")))
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        number, shown = cells[0], cells[-1]
        m = re.fullmatch(r"(\d+) s", shown)
        assert m, f"lesson {number}: the last column must read like '35 s', got {shown!r}"
        stored = run_seconds(next(NOTEBOOKS.glob(f"{number}_*.ipynb")))
        assert abs(int(m.group(1)) - stored) <= max(5, 0.25 * stored), \
            f"lesson {number}: the README says {shown}, its stored outputs took {stored:.0f} s; update the course map"
