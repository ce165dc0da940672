"""Every lesson has the course's structure: title, goals, key terms, quiz, exercises with worked solutions, summary.

Each check is its own test per lesson, so a failure names the lesson and what is missing. The structure:
1. first cell: `# NN · Title`, a `**Goals**` line followed by a list, a `**Key terms**` line followed by a list;
2. `## Checkpoint quiz`, then a code cell calling quiz("NN"); data/quizzes/NN.json exists;
3. `## Exercises` with at least two `**Exercise N...` paragraphs, each followed (before the next one) by a hidden code
   cell starting `# Solution` (after an optional `# NBVAL_IGNORE_OUTPUT`) and a `*Solution notes.*` paragraph;
   no `<details>` block holds code;
4. the last cell holds `## Summary` with `**Measured:**`, `**The one idea to keep:**` and a `**Next:**` link to the
   next lesson's file (the last lesson links to ../README.md);
5. no code cell is longer than 15 lines; every link to a notebook lands on a file (and heading) that exists.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from notebook_links import NOTEBOOKS, ROOT, cells, link_problem, markdown_headings, notebook_links

LESSONS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
MAX_CODE_LINES = 15
SOLUTION_START = re.compile(r"^(# NBVAL_IGNORE_OUTPUT\n)?# Solution\b")
# One spelling of each summary label, in every lesson.
LABELS = {"Measured": r"\*\*Measured:\*\*", "The one idea to keep": r"\*\*The one idea to keep:\*\*",
          "Next": r"\*\*Next:\*\*"}


def number(path: Path) -> str:
    return path.name[:2]


def lesson_cells(path: Path) -> list[dict]:
    return cells(path)


def paragraphs(cell: dict) -> list[str]:
    """A markdown cell's blocks separated by blank lines."""
    return [p.strip() for p in re.split(r"\n\s*\n", cell["source"]) if p.strip()]


def section(cs: list[dict], title: str) -> int | None:
    """Index of the first markdown cell holding a `## title` heading."""
    for i, c in enumerate(cs):
        if c["cell_type"] == "markdown" and any(t == title for lvl, t in markdown_headings(c["source"]) if lvl == 2):
            return i
    return None


def list_after(markdown: str, label: str) -> bool:
    """True when a line starting with the bold label is followed by a bulleted or numbered list."""
    lines = markdown.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"**{label}"):
            rest = [ln for ln in lines[i + 1:] if ln.strip()]
            return bool(rest) and re.match(r"\s*([-*+]|\d+\.)\s", rest[0]) is not None
    return False


lesson = pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])


def test_there_are_lessons_numbered_from_00_without_gaps():
    assert [number(p) for p in LESSONS] == [f"{i:02d}" for i in range(len(LESSONS))]


@lesson
def test_first_cell_has_title_goals_and_key_terms(path):
    first = lesson_cells(path)[0]
    assert first["cell_type"] == "markdown", f"{path.name}: the first cell must be markdown, not {first['cell_type']}"
    src = first["source"]
    assert src.startswith(f"# {number(path)} · "), f"{path.name}: the first cell must start `# {number(path)} · Title`"
    missing = [label for label in ("Goals", "Key terms") if not list_after(src, label)]
    assert not missing, f"{path.name}: first cell lacks {' and '.join(f'**{m}** with a list below it' for m in missing)}"


@lesson
def test_checkpoint_quiz_calls_this_lessons_bank(path):
    cs, n = lesson_cells(path), number(path)
    i = section(cs, "Checkpoint quiz")
    assert i is not None, f"{path.name}: no `## Checkpoint quiz` heading"
    following = cs[i + 1] if i + 1 < len(cs) else None
    assert following is not None and following["cell_type"] == "code" and f'quiz("{n}")' in following["source"], (
        f'{path.name}: the cell after `## Checkpoint quiz` must be code calling quiz("{n}")')
    assert (ROOT / "data" / "quizzes" / f"{n}.json").exists(), f"{path.name}: data/quizzes/{n}.json is missing"


def exercise_items(cs: list[dict], start: int) -> list[tuple[str, object]]:
    """From `## Exercises` on: ("md", paragraph) and ("code", cell) in order."""
    items = []
    for c in cs[start:]:
        if c["cell_type"] == "markdown":
            items += [("md", p) for p in paragraphs(c)]
        elif c["cell_type"] == "code":
            items.append(("code", c))
    return items


def exercise_problems(path: Path) -> list[str]:
    cs = lesson_cells(path)
    start = section(cs, "Exercises")
    if start is None:
        return ["no `## Exercises` heading"]
    items = exercise_items(cs, start)
    starts = [k for k, (kind, v) in enumerate(items) if kind == "md" and re.match(r"\*\*Exercise \d+", v)]
    problems = [] if len(starts) >= 2 else [f"{len(starts)} `**Exercise N: title.**` paragraphs, at least 2 needed"]
    old_form = [v[:40] for kind, v in items if kind == "md" and re.match(r"\*\*\d+\. ", v)]
    if len(starts) < 2 and old_form:
        problems[0] += f" (found {old_form}: write them `**Exercise N: Title.**`)"
    for k, end in zip(starts, starts[1:] + [len(items)]):
        title = items[k][1].split("**")[1]
        block = items[k + 1:end]
        solution = next((j for j, (kind, c) in enumerate(block) if kind == "code"
                         and c.get("metadata", {}).get("jupyter", {}).get("source_hidden") is True
                         and SOLUTION_START.match(c["source"])), None)
        if solution is None:
            problems.append(f"{title!r} has no hidden code cell starting `# Solution` (metadata jupyter.source_hidden)")
        elif not any(kind == "md" and v.startswith("*Solution notes.*") for kind, v in block[solution + 1:]):
            problems.append(f"{title!r} has no `*Solution notes.*` paragraph after its solution cell")
    return problems


@lesson
def test_exercises_have_worked_solutions(path):
    problems = exercise_problems(path)
    assert not problems, f"{path.name}: " + "; ".join(problems)


@lesson
def test_no_details_block_holds_code(path):
    blocks = [b for c in lesson_cells(path) if c["cell_type"] == "markdown"
              for b in re.findall(r"<details.*?</details>", c["source"], flags=re.S | re.I)]
    with_code = [b for b in blocks if re.search(r"```|<pre|<code|^(    |\t)\S", b, flags=re.M)]
    assert not with_code, (f"{path.name}: {len(with_code)} <details> block(s) hold code; make each a hidden "
                           f"`# Solution` code cell: {with_code[0][:120]!r}")


@lesson
def test_summary_is_last_with_its_three_bullets(path):
    cs, n = lesson_cells(path), int(number(path))
    last = cs[-1]
    parts = re.split(r"^## Summary\s*$", last["source"], maxsplit=1, flags=re.M) \
        if last["cell_type"] == "markdown" else []
    assert len(parts) == 2, f"{path.name}: the last cell must hold the `## Summary` heading"
    summary = parts[1]
    missing = [name for name, pattern in LABELS.items() if not re.search(r"^- " + pattern, summary, flags=re.M)]
    assert not missing, f"{path.name}: the summary lacks the bullet(s) " + ", ".join(f"- **{m}:**" for m in missing)
    nxt = summary[re.search(r"^- " + LABELS["Next"], summary, flags=re.M).end():]
    nxt = nxt.split("\n- ")[0]
    following = [p for p in LESSONS if int(number(p)) == n + 1]
    want = following[0].name if following else "../README.md"
    assert re.search(r"\]\(" + re.escape(want) + r"(#[^)]*)?\)", nxt), (
        f"{path.name}: the **Next:** bullet must link to ({want})")


@lesson
def test_code_cells_are_short(path):
    long = [(i, len(c["source"].splitlines())) for i, c in enumerate(lesson_cells(path))
            if c["cell_type"] == "code" and len(c["source"].splitlines()) > MAX_CODE_LINES]
    assert not long, (f"{path.name}: code cells over {MAX_CODE_LINES} lines (cell index, lines): {long}; "
                      "move the code into labutils and call it")


@lesson
def test_links_to_notebooks_land(path):
    problems = [f"cell {i}: {p}" for i, c in enumerate(lesson_cells(path)) if c["cell_type"] == "markdown"
                for name, frag in notebook_links(c["source"]) if (p := link_problem(name, frag))]
    assert not problems, f"{path.name}: " + "; ".join(problems)


def _write(path: Path, cells_: list[dict]) -> Path:
    import nbformat
    nb = nbformat.v4.new_notebook()
    for kind, src, hidden in cells_:
        cell = (nbformat.v4.new_code_cell if kind == "code" else nbformat.v4.new_markdown_cell)(src)
        if hidden:
            cell.metadata["jupyter"] = {"source_hidden": True}
        nb.cells.append(cell)
    nbformat.write(nb, path)
    return path


def test_the_exercise_check_catches_what_is_missing(tmp_path):
    good = [("markdown", "## Exercises\n\n**Exercise 1: one.** Do it.", False),
            ("code", "# NBVAL_IGNORE_OUTPUT\n# Solution\nprint(1)", True),
            ("markdown", "*Solution notes.* It prints 1.\n\n**Exercise 2: two.** Again.", False),
            ("code", "# Solution\nprint(2)", True), ("markdown", "*Solution notes.* 2.", False)]
    assert exercise_problems(_write(tmp_path / "good.ipynb", good)) == []
    shown = [*good[:3], ("code", "# Solution\nprint(2)", False), good[4]]          # solution not hidden
    assert "'Exercise 2: two.' has no hidden code cell" in exercise_problems(_write(tmp_path / "a.ipynb", shown))[0]
    no_notes = [*good[:4], ("markdown", "It prints 2.", False)]
    assert "no `*Solution notes.*`" in exercise_problems(_write(tmp_path / "b.ipynb", no_notes))[0]
    assert "1 `**Exercise N" in exercise_problems(_write(tmp_path / "c.ipynb", good[:2]))[0]


@pytest.mark.parametrize("heading, expected", [
    ("3. The same merges from `labutils`, fast", "3.-The-same-merges-from-labutils,-fast"),
    ("6. Why: arithmetic intensity", "6.-Why:-arithmetic-intensity"),
    ("A **bold** [link](x.ipynb) and *emphasis*", "A-bold-link-and-emphasis"),
    ("decode_step() &amp; prefill_flops", "decode_step()-&-prefill_flops"),
])
def test_anchor_is_jupyterlabs_heading_id(heading, expected):
    """JupyterLab 4: the heading's text content with each space made "-" (test_browser checks it on a real page)."""
    from notebook_links import anchor
    assert anchor(heading) == expected


def test_a_link_to_a_missing_heading_or_lesson_is_reported():
    assert link_problem("05_prefill_decode.ipynb", "7.-The-explorer") is None
    assert "no heading with anchor #7.-the-explorer" in link_problem("05_prefill_decode.ipynb", "7.-the-explorer")
    assert "does not exist" in link_problem("05_prefill.ipynb", None)
    assert notebook_links("see [x](05_prefill_decode.ipynb#7.-The-explorer) and [y](../README.md)") == [
        ("05_prefill_decode.ipynb", "7.-The-explorer")]
