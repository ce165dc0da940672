"""The package's layers: every import inside labutils runs downhill, and each part says what it may import.

The parts, bottom to top, are labutils.LAYERS. A module may import its own part and the parts below it, never one
above: lazy imports inside functions count too, since they are the easy way to hide a cycle.
"""
import ast
import importlib
import pathlib
import re

import pytest

import labutils
from labutils import LAYERS

ROOT = pathlib.Path(labutils.__file__).parent
COMMANDS = "commands"          # labutils/__init__.py, bench (a package), train, gpu_table: the top floor
COMMAND_PACKAGES = ("bench",)


def part_of(module: str) -> str:
    """"labutils.decode.loop" -> "decode"; a top-level module (a command) -> COMMANDS."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else COMMANDS


def rank(part: str) -> int:
    return len(LAYERS) if part == COMMANDS else LAYERS.index(part)


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) for every labutils import in the source, relative ones resolved, lazy ones included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "labutils":
                # `from labutils.perf import roofline` imports labutils.perf.roofline: same part either way
                found += [(node.lineno, f"{target}.{a.name}" if target == "labutils" else target) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "labutils"]
    return found


def uphill(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every import of `module`'s source that climbs to a higher part, as 'line N: target (part)'."""
    mine = rank(part_of(module))
    return [f"line {line}: {target} ({part_of(target)} is above {part_of(module)})"
            for line, target in imported(source, module, is_package)
            if target != "labutils" and rank(part_of(target)) > mine]


MODULES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_every_import_runs_downhill(path):
    module = module_name(path)
    assert uphill(path.read_text(), module, path.name == "__init__.py") == []


def test_the_layers_are_the_folders():
    folders = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(LAYERS + COMMAND_PACKAGES)


@pytest.mark.parametrize("part", LAYERS)
def test_each_part_says_what_it_is_for_and_what_it_may_import(part):
    doc = importlib.import_module(f"labutils.{part}").__doc__ or ""
    assert "May import" in doc and len(doc.strip().splitlines()) == 2, (
        f"labutils.{part}'s docstring must say in two lines what it is for and what it may import")
    may = doc.split("May import", 1)[1]
    below = LAYERS[:LAYERS.index(part)]
    named = [p for p in LAYERS if p != part and re.search(rf"\b{p}\b", may.replace("labutils.", ""))]
    assert set(named) <= set(below), f"labutils.{part} says it may import {named}, but only {below} lie below it"


def test_the_check_finds_an_import_that_climbs():
    """The checker itself can fail: a planted upward import, eager or lazy, relative or absolute, is found."""
    planted = "from labutils.widgets import quiz\n\ndef f():\n    from ..decode import loop\n    import labutils.serving.engine\n"
    found = uphill(planted, "labutils.model.gpt")
    assert [f.split(":")[0] for f in found] == ["line 1", "line 4", "line 5"]
    assert uphill("from labutils.core import validate\nfrom . import presets\n", "labutils.model.gpt") == []
    assert uphill("from labutils.widgets import quiz\n", "labutils.bench.serving_rows") == []   # commands sit on top
    assert uphill("from labutils.bench import ROWS\n", "labutils.widgets.quiz") != []


def test_the_module_map_names_every_module():
    """docs/modules.md keeps up with the tree: every module is there, by its dotted name or in its package's row."""
    text = (ROOT.parent / "docs" / "modules.md").read_text(encoding="utf-8")
    missing = []
    for path in MODULES:
        name = module_name(path)
        if path.name.startswith("__"):
            continue
        parent, last = name.rsplit(".", 1)
        if name in text or (parent in text and f"`{last}`" in text):
            continue
        missing.append(name)
    assert missing == [], f"docs/modules.md does not name {missing}"


@pytest.mark.parametrize("part", LAYERS)
def test_a_part_shows_only_its_own_modules_and_every_name_resolves(part):
    package = importlib.import_module(f"labutils.{part}")
    surface = getattr(package, "SURFACE", {})        # the lazy parts (core, text, perf) name their modules
    assert all(module.startswith(f"labutils.{part}.") for module in surface), surface
    for name in package.__all__ if hasattr(package, "__all__") else []:
        assert getattr(package, name) is not None


@pytest.mark.parametrize("command", [["labutils.perf.quiet", "0.1"]])
def test_a_module_that_runs_as_a_command_is_not_loaded_twice(command):
    """A part's __init__ must not import a module that `python -m` runs, or Python runs a second copy of it."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", *command], capture_output=True,
                          text=True, timeout=60)
    assert "found in sys.modules" not in done.stderr and done.returncode in (0, 1), done.stderr
