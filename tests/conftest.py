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
