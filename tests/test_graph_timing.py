"""On CUDA the lessons time bytes, not launches: measure_request decodes through fastgen's graph loop, and time_pass
times one pass replayed as a CUDA graph. Checked without a GPU: the request path on emulated CUDA, the pass path with
the capture stubbed (a CPU has no graphs to capture)."""
from __future__ import annotations

import pytest
import torch

from labutils import measure
from labutils.core import fake_cuda
from labutils.core.emulated_cuda import emulated_cuda
from labutils.measure import request


def test_a_request_on_cuda_decodes_through_the_graph_loop(monkeypatch):
    calls = []
    real = request.fast_generate

    def recording(model, ids, n, **kw):
        calls.append((tuple(ids.shape), n, kw["mode"]))
        return real(model, ids, n, **kw)

    monkeypatch.setattr(request, "fast_generate", recording)
    with emulated_cuda(), pytest.warns(RuntimeWarning, match="emulated"):    # no graphs here: eager, and it says so
        row = measure.measure_request("tiny", 8, 4, dtype="bf16", device="cuda", repeats=2)
    assert calls == [((1, 8), 4, "auto")] * 2
    assert row["device"].startswith("cuda") and row["tpot_s"] > 0 and len(row["timestamps"]) == 4
    measure.clear_models()


def test_a_request_on_the_cpu_keeps_lesson_05s_loop(monkeypatch):
    monkeypatch.setattr(request, "fast_generate", lambda *a, **k: pytest.fail("the CPU has no graph loop"))
    assert measure.measure_request("tiny", 8, 4, device="cpu")["new_tokens"] == 4


def test_a_pass_on_cuda_is_timed_as_one_graph_and_falls_back_eager_with_a_reason(monkeypatch):
    def one_pass():
        return None

    cuda = torch.device("cuda")
    assert request.without_launches(one_pass, torch.device("cpu")) is one_pass
    monkeypatch.setattr(fake_cuda, "active", lambda: False)
    monkeypatch.setattr(request, "capture_graph", lambda fn, device, warm_up: ("replay of", fn, device))
    assert request.without_launches(one_pass, cuda) == ("replay of", one_pass, cuda)

    def refuse(fn, device, warm_up):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(request, "capture_graph", refuse)
    with pytest.warns(RuntimeWarning, match="capture failed .*stream is capturing.*eager, with its launches"):
        assert request.without_launches(one_pass, cuda) is one_pass
