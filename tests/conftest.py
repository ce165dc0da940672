"""Shared test settings."""
import pytest
import torch
from hypothesis import settings

# CI machines are small and sometimes busy: a wall-clock deadline per example would make property
# tests flaky without testing anything. derandomize makes every run explore the same examples.
settings.register_profile("course", deadline=None, derandomize=True)
settings.load_profile("course")


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests need CUDA: they run under `make gpu-check` and skip, saying why, elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `make gpu-check` on a machine with one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """After a run that included the fuzz suite, say how many examples each target got (issue 10 asks for it)."""
    import sys
    fuzz = sys.modules.get("test_fuzz")
    if fuzz is None or not fuzz.EXAMPLES:
        return
    terminalreporter.section("fuzz examples (run / of those, refused with a clear error)")
    for name, n in sorted(fuzz.EXAMPLES.items()):
        terminalreporter.write_line(f"{n:5d} {fuzz.REFUSED[name]:5d}  {name}")
    terminalreporter.write_line(f"{sum(fuzz.EXAMPLES.values()):5d} {sum(fuzz.REFUSED.values()):5d}  in all")
