"""Shared test settings."""
import atexit
import os
import shutil
import tempfile

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
    _claims_summary(terminalreporter)
    _fake_cuda_summary(terminalreporter)
    fuzz = sys.modules.get("test_fuzz")
    if fuzz is None or not fuzz.EXAMPLES:
        return
    terminalreporter.section("fuzz examples (run / of those, refused with a clear error)")
    for name, n in sorted(fuzz.EXAMPLES.items()):
        terminalreporter.write_line(f"{n:5d} {fuzz.REFUSED[name]:5d}  {name}")
    terminalreporter.write_line(f"{sum(fuzz.EXAMPLES.values()):5d} {sum(fuzz.REFUSED.values()):5d}  in all")


# Tests (and the lessons nbval runs from this process) keep their measured peaks in a private cache, so a test
# never writes the learner's ~/.cache/prefill-decode-lab/peaks.json and every run starts from a fresh file.
if "LABUTILS_CACHE_DIR" not in os.environ:
    os.environ["LABUTILS_CACHE_DIR"] = tempfile.mkdtemp(prefix="labutils-test-cache-")
    atexit.register(shutil.rmtree, os.environ["LABUTILS_CACHE_DIR"], ignore_errors=True)


def _claims_summary(terminalreporter):
    """After the stored-output test ran, how many claims each stored lesson checks (issue 16 asks for it)."""
    import sys
    stored = sys.modules.get("test_stored_outputs")
    if stored is None or not stored.COUNTS:
        return
    terminalreporter.section("claims in the stored lessons (holds / does not hold here / not expected here)")
    for name, counts in sorted(stored.COUNTS.items()):
        terminalreporter.write_line(f"{counts['[holds]']:4d} {counts['[does not hold here]']:4d} "
                                    f"{counts['[not expected here]']:4d}  {name}")
    total = {k: sum(c[k] for c in stored.COUNTS.values()) for k in next(iter(stored.COUNTS.values()))}
    terminalreporter.write_line(f"{total['[holds]']:4d} {total['[does not hold here]']:4d} "
                                f"{total['[not expected here]']:4d}  in all")


def _fake_cuda_summary(terminalreporter):
    """After the fake-CUDA harness ran, the GPU paths it traced (issue 18 asks for the list)."""
    import sys
    harness = sys.modules.get("test_fake_cuda")
    if harness is None or not harness.TRACED:
        return
    terminalreporter.section("fake-CUDA paths traced (devices and dtypes checked, no values)")
    for line in sorted(harness.TRACED):
        terminalreporter.write_line(f"  {line}")
