"""Which device we measure on, how fast it really is, and what its datasheet promises."""
from __future__ import annotations

import torch


def pick_device(prefer: str | None = None) -> torch.device:
    """cuda, then mps, then cpu; `prefer` forces one and says clearly when it is not available."""
    available = {"cuda": torch.cuda.is_available(),
                 "mps": getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(),
                 "cpu": True}
    if prefer is not None:
        if prefer not in available:
            raise ValueError(f"unknown device {prefer!r}; choose cuda, mps or cpu")
        if not available[prefer]:
            raise RuntimeError(f"device {prefer!r} is not available on this machine; use pick_device() to fall back")
        return torch.device(prefer)
    return torch.device(next(name for name, ok in available.items() if ok))
