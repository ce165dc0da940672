"""Every claim in the lessons has bounds as strict as its words (labutils.measure.claims.WORDS): "about" is not a
factor of two, "several" is not 2x, "a large share" is not a quarter."""
from __future__ import annotations

import ast
import json
import operator

import pytest

from labutils.core.paths import SOURCE_ROOT
from labutils.measure.claims import INF, loose_words

NOTEBOOKS = sorted((SOURCE_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def number(node):
    """A bound written as numbers and + - * /; None for anything that needs the lesson's variables."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = number(node.left), number(node.right)
        return None if a is None or b is None else _OPS[type(node.op)](a, b)
    return None


def relative(pair):
    """(a * x, b * x), the same x on both sides: a window of a to b around x; None otherwise."""
    if all(isinstance(e, ast.BinOp) and isinstance(e.op, ast.Mult) for e in pair):
        (a, x1), (b, x2) = ((number(e.left), ast.dump(e.right)) for e in pair)
        if a is not None and b is not None and x1 == x2:
            return a, b
    return None


def text_of(node) -> str:
    """The claim's sentence: its constant parts (an f-string's fields read as '{}')."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return ast.unparse(node)


def claims(path):
    """(cell index, sentence, (lo, hi) or None where the bound needs the lesson's variables) of every claim() call."""
    for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
        if cell["cell_type"] != "code" or "claim(" not in "".join(cell["source"]):
            continue
        for node in ast.walk(ast.parse("".join(cell["source"]))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "claim"):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            if "between" in kw:
                pair = kw["between"].elts
                bounds = (number(pair[0]), number(pair[1]))
                bounds = relative(pair) if None in bounds else bounds
            elif "at_least" in kw:
                bounds = (number(kw["at_least"]), INF)
            elif "at_most" in kw:
                bounds = (-INF, number(kw["at_most"]))
            else:
                bounds = (-INF, INF)                  # a yes/no claim: no word may promise a number
            yield i, text_of(node.args[0]), None if None in bounds else bounds


def problems(path) -> list[str]:
    found = []
    for i, text, bounds in claims(path):
        if bounds is None:
            if loose_words(text):                     # words to check, and a bound this test cannot read
                found.append(f"cell {i}: {text!r}: its bound needs the lesson's variables; write it in numbers")
            continue
        found += [f"cell {i}: {text!r} {bounds}: {why}" for why in loose_words(text, *bounds)]
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_claims_bounds_are_as_strict_as_its_words(path):
    found = problems(path)
    assert not found, f"{path.name}:\n" + "\n".join(found)


def test_the_reader_finds_a_loose_bound_and_passes_a_strict_one(tmp_path):
    nb = tmp_path / "99_x.ipynb"
    cells = ['claim("twice the prompt about doubles TTFT", r, between=(1.6, 2.6))',
             'claim("several times slower", r, at_least=3)',
             'claim(f"{a} is close to {b}", r, between=(0.8 * b, 1.2 * b))',
             'claim("nearly 8 times", r, between=(6, 8))']
    nb.write_text(json.dumps({"cells": [{"cell_type": "code", "source": c} for c in cells]}))
    found = problems(nb)
    assert len(found) == 2 and "about doubles" in found[0] and "nearly 8" in found[1], found
    assert "(1.6, 2.6)" in found[0]
