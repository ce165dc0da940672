"""claim(): one line per sentence, holds or does not hold here, and clear errors for a wrong call."""
import math

import numpy as np
import pytest

from labutils.perf import quiet
from labutils.measure.claims import FAILS, HOLDS, NOT_HERE, claim


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    monkeypatch.setattr(quiet, "_last", None)


def one_line(capsys) -> str:
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out
    return out.strip()


@pytest.mark.parametrize("kwargs, value, verdict", [
    (dict(between=(1.6, 2.4)), 2.0, HOLDS), (dict(between=(1.6, 2.4)), 1.28, FAILS),
    (dict(between=(1.6, 2.4)), 1.6, HOLDS), (dict(at_least=0.5), 0.49, FAILS), (dict(at_least=0.5), 0.5, HOLDS),
    (dict(at_most=0.25), 3.482, FAILS), (dict(at_most=0.25), 0.1, HOLDS), ({}, True, HOLDS), ({}, False, FAILS),
    ({}, np.bool_(True), HOLDS), (dict(at_least=1), np.float64(2.0), HOLDS),
])
def test_verdicts(capsys, kwargs, value, verdict):
    claim("a sentence", value, **kwargs)
    assert one_line(capsys).startswith(verdict + " a sentence: measured ")


def test_the_line_shows_value_and_expectation(capsys):
    claim("doubling the prompt about doubles TTFT", 1.974, between=(1.6, 2.4), unit="x")
    assert one_line(capsys) == ("[holds] doubling the prompt about doubles TTFT: measured 1.97x, "
                                "expected between 1.6x and 2.4x")
    claim("MBU", 0.613, at_least=0.5, fmt=".0%")
    assert one_line(capsys) == "[holds] MBU: measured 61%, expected at least 50%"


def test_a_failure_gives_reasons(capsys):
    claim("prefill is compute-bound", 0.3, at_least=0.5, why_not=["a shape too small", "a slow kernel"])
    line = one_line(capsys)
    assert line.startswith(FAILS) and line.endswith("Likely reasons: a shape too small; a slow kernel")
    claim("x", 0.3, at_least=0.5)
    assert "run the cell again with nothing else running" in one_line(capsys)


def test_not_expected_here_is_not_a_failure(capsys):
    claim("CUDA graphs cut TPOT", 1.0, at_least=1.5, unit="x", expected_here=False, why_not="no NVIDIA GPU here")
    assert one_line(capsys) == f"{NOT_HERE} CUDA graphs cut TPOT: measured 1.00x; no NVIDIA GPU here"


@pytest.mark.parametrize("args, kwargs, error, match", [
    (("", 1.0), dict(at_least=0), ValueError, "non-empty string"),
    (("x", 1.0), {}, ValueError, "needs an expectation"),
    (("x", 1.0), dict(at_least=0, at_most=2), ValueError, "give one expectation"),
    (("x", math.nan), dict(at_least=0), ValueError, "finite"),
    (("x", "1.0"), dict(at_least=0), TypeError, "must be a number"),
    (("x", 1.0), dict(between=(2, 1)), ValueError, "is empty"),
    (("x", 1.0), dict(between=3), ValueError, "a pair"),
    (("x", True), dict(at_least=1), ValueError, "yes/no value takes no at_least"),
])
def test_wrong_calls_are_refused(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        claim(*args, **kwargs)
