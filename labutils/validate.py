"""Argument checks shared by every public function, so one kind of value has one rule and one message."""
from __future__ import annotations

import numbers


def check_count(name: str, value, minimum: int) -> None:
    """Refuse a token count, length or batch that is not an integer >= minimum."""
    # bool is an int subclass; True tokens is a typo, not 1.
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):   # numpy ints are fine
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


__all__ = ["check_count"]
