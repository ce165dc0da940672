"""The course's training text: docstrings of Python's own standard library, extracted offline."""
from __future__ import annotations

import ast
import functools
import re
import sysconfig
import warnings
from pathlib import Path

from labutils.core.paths import data_dir
from labutils.core.validate import check_number

# Test suites and the IDLE GUI are mostly terse test names and widget callbacks: noise, not prose.
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__",
                       "lib2to3", "turtledemo", "tkinter", "ensurepip", "venv"})
MIN_CHARS = 80
SEPARATOR = "\n\n"
# Short texts the course wrote itself (English story, a parallel English/Japanese pair, code, numbers).
TEXTS_DIR = data_dir("texts")


def stdlib_dir() -> Path:
    """Where this Python keeps its standard library (present on every machine, no download)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _clean(doc: str) -> str:
    """Dedent (ast.get_docstring already did), drop trailing spaces and collapse runs of blank lines."""
    lines = [line.rstrip() for line in doc.strip().splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


def _docstrings(path: Path) -> list[str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old files
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []  # a file that does not parse is simply left out
    docs = []
    # ast.walk is breadth-first; sort by position so the text reads in file order.
    nodes = [n for n in ast.walk(tree)
             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    nodes.sort(key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc:
            doc = _clean(doc)
            if len(doc) > MIN_CHARS:
                docs.append(doc)
    return docs


def corpus_files(root: Path | None = None) -> list[Path]:
    """Every .py file under the stdlib, in sorted (deterministic) order, minus SKIP_DIRS."""
    root = stdlib_dir() if root is None else Path(root)
    return sorted(p for p in root.rglob("*.py")
                  if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))


@functools.lru_cache(maxsize=1)
def load_docstrings() -> tuple[str, ...]:
    """Every kept docstring, in file order (parsed once per process, a few seconds).

    Built afresh from this Python's stdlib. It is never committed: the prose belongs to the
    Python project, and every machine already has it.
    """
    docs = tuple(doc for path in corpus_files() for doc in _docstrings(path))
    if not docs:
        raise RuntimeError(f"no docstrings found under {stdlib_dir()}; is the standard library source installed?")
    return docs


@functools.lru_cache(maxsize=1)
def load_corpus() -> str:
    """The whole corpus as one string (about 1.4 MB); docstrings joined by a blank line."""
    return SEPARATOR.join(load_docstrings())


def split_corpus(text: str, frac: float = 0.9) -> tuple[str, str]:
    """Split text into (train, heldout) at the docstring boundary nearest to frac of its length."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str for split_corpus, got {type(text).__name__}")
    check_number("frac", frac, above=0, below=1, hint="e.g. 0.9 keeps 90% for training")
    cut = int(len(text) * frac)
    boundary = text.find(SEPARATOR, cut)
    if boundary == -1:  # no separator after the cut: split mid-text rather than return an empty heldout
        return text[:cut], text[cut:]
    return text[:boundary], text[boundary + len(SEPARATOR):]


def course_prose() -> str:
    """The course's own ~5,000-character English short story (data/texts/prose_en.txt)."""
    return (TEXTS_DIR / "prose_en.txt").read_text(encoding="utf-8")


def text_samples() -> dict[str, str]:
    """Short samples by kind: "english", "japanese" (the same sentence), "code", "numbers"."""
    import json
    return json.loads((TEXTS_DIR / "samples.json").read_text(encoding="utf-8"))
