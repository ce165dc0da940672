"""docs/gpu/predictions.md is what labutils.gpu_predictions writes today, and its shapes are the ones shape_for hands
the lessons on a GPU with the H200's free memory (free memory mocked under emulated CUDA)."""
from __future__ import annotations

import subprocess
import sys

import torch

from labutils import gpu_predictions
from labutils.core.emulated_cuda import emulated_cuda
from labutils.core.paths import SOURCE_ROOT
from labutils.model.gpt import GPTConfig
from labutils.perf.shape_choice import shape_for


def test_the_predictions_page_is_current():
    """In a fresh interpreter, as the page is written: its op counts come from the profiler, which other tests'
    torch state (an emulated-CUDA run's SDPA settings) can move by an op or two."""
    page = SOURCE_ROOT / "docs" / "gpu" / "predictions.md"
    fresh = subprocess.run([sys.executable, "-m", "labutils.gpu_predictions"], capture_output=True, text=True,
                           cwd=SOURCE_ROOT, check=True).stdout
    assert page.read_text() == fresh, (
        "docs/gpu/predictions.md is stale: python -m labutils.gpu_predictions > docs/gpu/predictions.md")


def test_each_lesson_row_uses_the_shape_that_lesson_gets_on_the_h200(monkeypatch):
    # Patched inside the emulation (monkeypatch's undo, after it, would leave the emulation's stand-ins in torch.cuda).
    with emulated_cuda(), monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "mem_get_info", lambda *a: (int(gpu_predictions.H200_FREE_BYTES), int(141e9)))
        patch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
        lesson_05 = shape_for("cuda", "gpt2-small", cache_tokens=1200)            # the calls the lessons make
        lesson_07 = shape_for("cuda", "gpt2-small", cache_tokens=512 + 128, batch=64)
        lesson_06 = shape_for("cuda", "tiny", cache_tokens=4096)
        lesson_09 = shape_for("cuda", "tiny", cache_tokens=128 + 1, batch=64)
        lesson_10 = shape_for("cuda", "gpt2-small", cache_tokens=128 + 512)
        lesson_11 = shape_for("cuda", GPTConfig(vocab_size=4096, context_length=1024, n_layer=8, n_head=8, n_embd=512),
                              cache_tokens=3072 + 64, batch=9)
    rows = gpu_predictions.rows()
    assert next(r for r in rows if r[0] == "05")[3] == lesson_05.preset == "llama-2-7b"
    assert all(lesson_07.preset in arithmetic for lesson, _, arithmetic, _ in rows
               if lesson == "07" and "llama" in arithmetic)
    assert all(lesson_06.preset in arithmetic for lesson, _, arithmetic, _ in rows if lesson == "06" and "TFLOP" in arithmetic)
    assert any(lesson == "09" and arithmetic.startswith(f"{lesson_09.preset}:") for lesson, _, arithmetic, _ in rows)
    assert any(lesson == "10" and arithmetic.startswith(f"{lesson_10.preset}:") for lesson, _, arithmetic, _ in rows)
    assert any(lesson == "11" and arithmetic.startswith(f"{lesson_11.preset}:") for lesson, _, arithmetic, _ in rows)
    assert {lesson for lesson, *_ in rows} == {"00", "05", "06", "07", "08", "09", "09, 11", "10", "11", "bench"}
