"""Claims that check themselves: a lesson's sentence about its own measurement, printed next to the number.

    claim("doubling the prompt about doubles TTFT", ttft_ratio, between=(1.6, 2.4))
    [holds] doubling the prompt about doubles TTFT: measured 1.97, expected between 1.6 and 2.4

A claim that fails says "does not hold here" and the likely reasons: the caller's `why_not` (a shape too small to
be compute-bound on this device, say) and, first, a busy machine when `labutils.perf.quiet` saw one during the last
measurement. A claim that is not expected on this device (`expected_here=False`: a GPU effect on a CPU) prints
the measured value and why it is not claimed. `tests/test_stored_outputs.py` reads every stored lesson and fails
on any "does not hold here", so the prose never contradicts the output beside it.
"""
from __future__ import annotations

import math
import re
from typing import Sequence

import numpy as np

from labutils.perf import quiet

HOLDS, FAILS, NOT_HERE = "[holds]", "[does not hold here]", "[not expected here]"
VERDICTS = (HOLDS, FAILS, NOT_HERE)


# ---- the words a claim may use, and the bounds each one promises ----------------------------------------------------
# A claim checks its sentence only if its bounds are as strict as the sentence's words. Each word below names the
# loosest bounds it allows, on a ratio measured against 1 (or against the N the words name). The numbers:
# - "about" / "roughly": within 0.8x-1.25x, symmetric on a log scale: a 25% miss either way, the size of a busy
#   second on a shared 2-core machine; a window wider than 1.25 / 0.8 = 1.56 no longer means "about".
# - "close to": within 0.75x-1.33x, a third either way: near, not equal.
# - "doubles": 1.7x-2.3x, "about" around 2 (1.6x-2.5x) tightened, because "doubles" names the number itself.
# - "nearly N": at least 0.85 N: within 15% below it.
# - "several": at least 3: two is "a couple"; "many" and "far": at least 5 (or at most a fifth): an order of
#   magnitude in spirit, and 5 is the least a reader would not call merely "more".
# - "a large share": at least 50%, a majority; "a fair share": at least 25%; "a small fraction": at most 25%
#   (or, read as its inverse, at least 4x).
# - "barely moves": within 0.87x-1.15x, tighter than "about": barely is less than about.
# - "within a factor of N": between 1/N and N, as the words say.
# tests/test_claim_words.py reads every claim in the lessons and fails where a bound is looser than its words.

INF = float("inf")


def _about(lo: float, hi: float, low: float = 0.8, high: float = 1.25, center: float = 1.0) -> bool:
    """(lo, hi) within low x center .. high x center; a two-sided window around 1 may sit anywhere, only its width
    (high / low) is bounded, since the words name no number."""
    if center == 1.0 and lo > 0 and hi < INF:
        return hi / lo <= high / low + 1e-9
    lo_ok, hi_ok = lo >= low * center - 1e-9, hi <= high * center + 1e-9
    if hi == INF:
        return lo_ok
    if lo <= 0:
        return hi_ok
    return lo_ok and hi_ok


_NUMBERS = {"twice": 2, "two": 2, "three": 3, "four": 4, "five": 5, "ten": 10}


def _n(word: str) -> float:
    return float(_NUMBERS.get(word, word))


# (regex on the claim's text, what the words promise, the check on (lo, hi)); the first pattern that matches a
# stretch of text claims it, so the specific patterns come before the general ones.
WORDS: list[tuple[str, str, object]] = [
    (r"\bwithin a factor of (\d+(?:\.\d+)?|two|three|four|five|ten)\b", "between 1/N and N",
     lambda lo, hi, m: lo >= 1 / _n(m[1]) - 1e-9 and hi <= _n(m[1]) + 1e-9),
    (r"\b(?:about |roughly )?doubles?\b", "1.7x-2.3x", lambda lo, hi, m: lo >= 1.7 and hi <= 2.3),
    (r"\b(?:about|roughly) (twice|\d+(?:\.\d+)?x|(?:two|three|four|five|ten) times)", "0.8 N-1.25 N",
     lambda lo, hi, m: _about(lo, hi, center=_n(m[1].split()[0].rstrip("x")))),
    (r"\bnearly (\d+|all)\b", "at least 0.85 N",
     lambda lo, hi, m: lo >= 0.85 * (1.0 if m[1] == "all" else _n(m[1])) - 1e-9),
    (r"\bbarely\b", "0.87x-1.15x", lambda lo, hi, m: hi <= 1.15 and (lo <= 0 or lo >= 0.87)),
    (r"\b(?:about|roughly)\b", "0.8x-1.25x", lambda lo, hi, m: _about(lo, hi)),
    (r"\bclose to\b", "0.75x-1.33x", lambda lo, hi, m: _about(lo, hi, 0.75, 1.33)),
    (r"\bseveral\b", "at least 3", lambda lo, hi, m: lo >= 3),
    (r"\bmany times\b", "at least 5", lambda lo, hi, m: lo >= 5),
    (r"(?<!not )\bfar (?!from)\w+", "at least 5, or at most 0.2", lambda lo, hi, m: lo >= 5 or hi <= 0.2),
    (r"\ba large share\b", "at least 50%", lambda lo, hi, m: lo >= 0.5),
    (r"\ba fair share\b", "at least 25%", lambda lo, hi, m: lo >= 0.25),
    (r"\ba small fraction\b", "at most 25% (or its inverse at least 4x)", lambda lo, hi, m: hi <= 0.25 or lo >= 4),
]


def loose_words(text: str, lo: float = -INF, hi: float = INF) -> list[str]:
    """The words of `text` whose promise the bounds (lo, hi) do not keep, each with what it needs: [] when the bounds
    are as strict as the words. A one-sided bound passes INF (or -INF) on its open side."""
    taken, loose = [], []
    for pattern, needs, check in WORDS:
        for m in re.finditer(pattern, text):
            if any(a < m.end() and m.start() < b for a, b in taken):
                continue                               # a more specific word already claimed this stretch
            taken.append((m.start(), m.end()))
            if not check(lo, hi, m):
                loose.append(f"{m[0]!r} needs {needs}")
    return loose


def _number(value: float, fmt: str | None) -> str:
    if fmt is not None:
        return format(value, fmt)
    size = abs(value)
    return (f"{value:,.0f}" if size >= 100 else f"{value:.1f}" if size >= 10 else
            f"{value:.2f}" if size >= 0.01 or size == 0 else f"{value:.2g}")


def _bound(value: float, fmt: str | None) -> str:
    return format(value, fmt) if fmt is not None else f"{value:,g}"


def _check_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"claim: {name} must be a number, got {type(value).__name__} {value!r}; "
                        "pass the measured value (a float), or a bool for a yes/no claim")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"claim: {name} is {value}; a claim needs a finite measured value (did a timing fail?)")
    return value


def claim(text: str, value, *, between: tuple[float, float] | None = None, at_least: float | None = None,
          at_most: float | None = None, unit: str = "", fmt: str | None = None,
          why_not: str | Sequence[str] = (), expected_here: bool = True) -> None:
    """Print `text`, the measured `value` and whether it meets the expectation, in one line.

    The expectation is one of `between=(lo, hi)`, `at_least=`, `at_most=`, or none for a yes/no claim whose
    value is a bool. `unit` follows the number ("x", " ms"); `fmt` is a format spec (".0%") for it. `why_not`
    names the likely reasons when the claim fails (or, with `expected_here=False`, why it is not claimed here).
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("claim: text must be the sentence being checked, a non-empty string")
    bounds = {k: v for k, v in (("between", between), ("at_least", at_least), ("at_most", at_most)) if v is not None}
    if len(bounds) > 1:
        raise ValueError(f"claim: give one expectation, got {', '.join(bounds)}; use between=(lo, hi) for both ends")
    reasons = [why_not] if isinstance(why_not, str) else list(why_not)
    if isinstance(value, (bool, np.bool_)):
        if bounds:
            raise ValueError(f"claim: a yes/no value takes no {next(iter(bounds))}=; pass the number instead")
        value = bool(value)
        shown, holds, expected = ("yes" if value else "no"), value, "expected yes"
    else:
        if not bounds:
            raise ValueError("claim: a measured number needs an expectation: between=(lo, hi), at_least= or at_most=")
        v = _check_number("value", value)
        shown = _number(v, fmt) + unit
        if between is not None:
            if not (isinstance(between, (tuple, list)) and len(between) == 2):
                raise ValueError(f"claim: between must be a pair (lo, hi), got {between!r}")
            lo, hi = (_check_number("between", b) for b in between)
            if lo > hi:
                raise ValueError(f"claim: between=({lo}, {hi}) is empty; put the smaller end first")
            holds, expected = lo <= v <= hi, f"expected between {_bound(lo, fmt)}{unit} and {_bound(hi, fmt)}{unit}"
        elif at_least is not None:
            lo = _check_number("at_least", at_least)
            holds, expected = v >= lo, f"expected at least {_bound(lo, fmt)}{unit}"
        else:
            hi = _check_number("at_most", at_most)
            holds, expected = v <= hi, f"expected at most {_bound(hi, fmt)}{unit}"
    if not expected_here:
        why = "; ".join(reasons) or "not expected on this device"
        print(f"{NOT_HERE} {text}: measured {shown}; {why}")
        return
    if holds:
        print(f"{HOLDS} {text}: measured {shown}, {expected}")
        return
    last = quiet.last_window()
    if last is not None and last.busy:
        reasons.insert(0, f"the machine was busy during the measurement ({last.message.removeprefix(quiet.MARKER).strip()})")
    if not reasons:
        reasons = ["timings are noisy: run the cell again with nothing else running"]
    print(f"{FAILS} {text}: measured {shown}, {expected}. Likely reasons: " + "; ".join(reasons))
