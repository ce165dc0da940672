"""Links into lessons, checked the way JupyterLab resolves them: the one heading-anchor rule for every test.

JupyterLab 4 gives each rendered heading the id `heading.textContent.replace(/ /g, "-")` (rendermime's
createHeaderId): the text as shown, markdown markup gone, case and punctuation kept, each space a "-".
So `## 6. Why: arithmetic intensity` is `#6.-Why:-arithmetic-intensity`.
"""
from __future__ import annotations

import html
import json
import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
# [text](target): the target of a markdown link, up to the first space or ")" (a title may follow the space).
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)")
NOTEBOOK_TARGET = re.compile(r"^(?:\.?/|notebooks/|\.\./notebooks/)?(\d\d_[\w.-]+\.ipynb)(?:#(.*))?$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def heading_text(markdown: str) -> str:
    """What a heading's markdown shows as text: no code ticks, emphasis, link targets, HTML tags or entities."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", markdown)        # [text](url) and images -> text
    text = re.sub(r"`+([^`]*)`+", r"\1", text)
    text = re.sub(r"(\*\*|__)(.+?)\1", r"\2", text)
    text = re.sub(r"(?<![\w*])([*_])(?!\s)(.+?)(?<!\s)\1(?![\w*])", r"\2", text)
    text = re.sub(r"<[^>]+>", "", text)
    return html.unescape(text).strip()


def anchor(heading_markdown: str) -> str:
    """JupyterLab 4's id for a heading: its shown text with every space replaced by "-"."""
    return heading_text(heading_markdown).replace(" ", "-")


def cells(path: Path) -> list[dict]:
    """A notebook's cells with `source` joined into one string."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    return [dict(c, source="".join(c["source"]) if isinstance(c["source"], list) else c["source"])
            for c in nb["cells"]]


def markdown_headings(markdown: str) -> list[tuple[int, str]]:
    """(level, heading markdown) of every ATX heading outside fenced code blocks."""
    found, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            found.append((len(m.group(1)), m.group(2)))
    return found


def anchors(path: Path) -> set[str]:
    """Every heading anchor in a notebook's markdown cells."""
    return {anchor(text) for c in cells(path) if c["cell_type"] == "markdown"
            for _, text in markdown_headings(c["source"])}


def notebook_links(markdown: str) -> list[tuple[str, str | None]]:
    """(notebook file name, anchor or None) for every link to a lesson notebook in some markdown."""
    out = []
    for target in LINK.findall(markdown):
        if m := NOTEBOOK_TARGET.match(target):
            out.append((m.group(1), unquote(m.group(2)) if m.group(2) else None))
    return out


def link_problem(name: str, fragment: str | None, notebooks: Path = NOTEBOOKS) -> str | None:
    """Why a link to notebooks/<name>#<fragment> would not land, or None when it does."""
    path = notebooks / name
    if not path.exists():
        return f"{name} does not exist in {notebooks.name}/"
    if fragment and fragment not in (known := anchors(path)):
        near = sorted(a for a in known if a.split("-")[0] == fragment.split("-")[0])
        return (f"{name} has no heading with anchor #{fragment}"
                + (f" (headings there starting alike: {', '.join('#' + a for a in near)})" if near else ""))
    return None


def section_cells(path: Path, fragment: str | None) -> list[dict]:
    """The cells under the heading with this anchor, up to the next heading of the same or a higher level.

    With no fragment, the whole notebook. A heading in the middle of a markdown cell starts its section there,
    so the rest of that cell and the cells after it count; an unknown anchor gives [].
    """
    cs = cells(path)
    if not fragment:
        return cs
    for i, c in enumerate(cs):
        if c["cell_type"] != "markdown":
            continue
        for level, text in markdown_headings(c["source"]):
            if anchor(text) != fragment:
                continue
            out = [c]
            for nxt in cs[i + 1:]:
                if nxt["cell_type"] == "markdown" and any(lvl <= level for lvl, _ in markdown_headings(nxt["source"])):
                    break
                out.append(nxt)
            return out
    return []


def run_seconds(path: Path) -> float:
    """Seconds the stored outputs took to compute: the sum of each code cell's execution time (nbclient's
    iopub.execute_input to shell.execute_reply), as `make notebooks` recorded it on a quiet machine."""
    from datetime import datetime
    total = 0.0
    for c in json.loads(Path(path).read_text(encoding="utf-8"))["cells"]:
        e = c.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in e and "shell.execute_reply" in e:
            start, end = (datetime.fromisoformat(e[k].replace("Z", "+00:00"))
                          for k in ("iopub.execute_input", "shell.execute_reply"))
            total += (end - start).total_seconds()
    return total
