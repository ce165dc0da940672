"""The load dashboard, driven headless: a run shows the engine's meters and a Gantt; errors stay in the widget."""
import html

import pytest

from labutils.serving.engine import serve
from labutils.widgets import ServingDashboard, serving_dashboard
from labutils.widgets.serving_dashboard import dashboard_workload

from test_generate import make_model


@pytest.fixture(scope="module")
def model():
    return make_model(seed=3)         # context 96


def test_a_run_serves_the_controls_workload_and_shows_the_meters(model):
    calls = []

    def spy(m, wl, slots, on_finished, **kw):
        calls.append((wl, slots, kw))
        return serve(m, wl, slots, on_finished=on_finished, **kw)

    dash = ServingDashboard(model, n_requests=6, serve_fn=spy)
    dash.slots.value, dash.at_once.value = 3, True
    dash.prompt.value, dash.output.value, dash.prefix.value = (4, 12), (2, 6), 32
    served = dash.button.click() or dash.served
    wl, slots, kw = calls[-1]
    assert slots == 3 and kw == {"prefix_caching": True, "max_num_batched_tokens": 2048} and len(wl) == 6
    assert all(r.arrival_s == 0 for r in wl) and len({r.prompt_ids[:32] for r in wl}) == 1
    assert served.summary.n_completed == 6 and served.counts.hit_rate > 0
    for text in ("TTFT p50 / p99", "TPOT p50 / p99", "output tokens/s", "hit rate", "6 of 6 completed"):
        assert text in dash.meters.value
    assert "6 requests" in dash.status.value and "Could not" not in dash.status.value
    bars = {t.name: t for t in dash.fig.figure.data}
    assert set(bars) == {"queued", "prefill", "decode"} and len(bars["prefill"].x) >= 6

    dash.caching.value = False
    off = dash.run()
    assert off.counts.hit_rate == 0 and calls[-1][2] == {"prefix_caching": False, "max_num_batched_tokens": 2048}


def test_a_moved_control_marks_the_last_results_stale_until_the_next_run(model):
    dash = ServingDashboard(model, n_requests=5)
    dash.at_once.value = True                        # before any run: nothing to mark
    assert "pdl-stale" not in dash.meters._dom_classes and "settings changed" not in dash.status.value
    dash.run()
    assert (dash.progress.value, dash.progress.max, dash.progress.bar_style) == (5, 5, "success")
    dash.slots.value = 2                             # the chart still shows the run with 8 slots
    assert "pdl-stale" in dash.meters._dom_classes and "pdl-stale" in dash.fig._dom_classes
    assert "settings changed" in dash.status.value
    dash.run()
    assert "pdl-stale" not in dash.meters._dom_classes + dash.fig._dom_classes
    assert "2 batch slots" in dash.fig.figure.layout.title.text and "settings changed" not in dash.status.value


def test_an_impossible_setting_is_explained_in_the_widget_and_the_last_results_stay(model):
    dash = serving_dashboard(model, n_requests=3)
    dash.at_once.value = True
    dash.prompt.value, dash.output.value = (4, 8), (2, 4)
    assert dash.run() is not None
    good = dash.meters.value
    dash.prefix.value = 96                           # nothing fits the 96-token context now
    assert dash.run() is None
    status = html.unescape(dash.status.value)
    assert "exceeds the model's context of 96" in status and "lower the shared prefix" in status
    assert dash.meters.value == good


def test_too_long_requests_are_reported_as_rejected(model):
    dash = ServingDashboard(model, n_requests=8)
    dash.at_once.value = True
    dash.prompt.value, dash.output.value = (70, 95), (1, 16)
    served = dash.run()
    rejected = [r for r in served.results if r.finish_reason == "rejected"]
    assert rejected and len(rejected) < 8 and f"{len(rejected)} rejected" in dash.status.value
    assert "context length" in dash.status.value and served.summary.n_completed == 8 - len(rejected)


def test_an_engine_error_never_escapes_the_button(model):
    def broken(*a, **k):
        raise RuntimeError("engine exploded")

    dash = ServingDashboard(model, n_requests=2, serve_fn=broken)
    dash.button.click()
    assert "engine exploded" in dash.status.value


def test_dashboard_workload_checks_the_context():
    with pytest.raises(ValueError, match="shortest request"):
        dashboard_workload(64, 10, n_requests=2, rate=None, prompt_len=(40, 50), output_len=(30, 40))


def test_a_run_on_a_busy_machine_says_so(model, monkeypatch):
    from test_quiet import fake_counters
    fake_counters(monkeypatch, others_per_reading=0)            # a quiet machine first, whatever runs beside us
    dash = ServingDashboard(model, n_requests=4)
    dash.run()
    assert "busy machine" not in dash.status.value
    fake_counters(monkeypatch, others_per_reading=150)
    dash.run()
    assert "busy machine" in dash.status.value and "timings are unreliable" in dash.status.value
    assert "pdl-busy" in dash.meters._dom_classes and "pdl-busy" in dash.fig._dom_classes
    assert "with <b>Run workload</b>" in dash.status.value
    fake_counters(monkeypatch, others_per_reading=0)
    dash.run()
    assert "pdl-busy" not in dash.meters._dom_classes + dash.fig._dom_classes and "busy machine" not in dash.status.value


def test_the_chunked_switch_and_the_token_budget_reach_the_engine():
    from labutils.widgets.serving_dashboard import budget_options
    m = make_model()
    calls = []

    def spy(model, wl, slots, on_finished, **kw):
        calls.append(kw)
        return serve(model, wl, slots, on_finished=on_finished, **kw)

    dash = ServingDashboard(m, n_requests=4, serve_fn=spy)
    dash.at_once.value = True
    dash.budget.value = 16
    served = dash.run()
    assert calls[-1]["max_num_batched_tokens"] == 16 and served is not None
    assert max(row["decode_tokens"] + row["prefill_tokens"] for row in served.timeline) <= 16
    dash.chunked_prefill.value = False
    assert dash.budget.disabled
    dash.run()
    assert calls[-1] == {"prefix_caching": True, "chunked_prefill": False}
    dash.slots.value, dash.chunked_prefill.value = 32, True            # a budget below the batch: the engine's error, shown
    assert dash.run() is None and "smaller than max_batch_size=32" in dash.status.value
    assert budget_options(96) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert budget_options(4096)[-1] == 4096
