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
from typing import Sequence

import numpy as np

from labutils.perf import quiet

HOLDS, FAILS, NOT_HERE = "[holds]", "[does not hold here]", "[not expected here]"
VERDICTS = (HOLDS, FAILS, NOT_HERE)


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
