"""KV-cache calculator: kv_summary numbers, and the widget driven headlessly."""
import pytest

from labutils.perf.roofline import kv_cache_bytes, weight_bytes
from labutils.model.presets import PRESETS
from labutils.widgets import KVCalculator, kv_calculator, kv_summary
from labutils.figures.kv import GB, cache_curve


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp8", "int8"])
def test_summary_numbers_come_from_the_formulas(preset, dtype):
    ctx = PRESETS[preset].context_length
    s = kv_summary(preset, ctx, 3, dtype)
    assert s["cache_bytes"] == kv_cache_bytes(preset, ctx, 3, dtype)
    assert s["weight_bytes"] == weight_bytes(preset, "fp16")
    assert s["cache_to_weights"] == pytest.approx(s["cache_bytes"] / s["weight_bytes"])
    if s["crossover_tokens"] is None:      # a sliding window: no context makes the cache outgrow the weights
        assert kv_cache_bytes(preset, 10 ** 9, 3, dtype) <= s["weight_bytes"] and not s["crossover_in_context"]
    else:
        assert kv_cache_bytes(preset, s["crossover_tokens"], 3, dtype) > s["weight_bytes"]
        assert kv_cache_bytes(preset, s["crossover_tokens"] - 1, 3, dtype) <= s["weight_bytes"]
    assert kv_cache_bytes(preset, ctx, s["batch_to_exceed"], dtype) > s["weight_bytes"]
    if s["batch_to_exceed"] > 1:        # Llama 3.2's 131,072-token context outgrows the weights at batch 1
        assert kv_cache_bytes(preset, ctx, s["batch_to_exceed"] - 1, dtype) <= s["weight_bytes"]
    assert s["crossover_in_context"] == (s["crossover_tokens"] is not None and s["crossover_tokens"] <= ctx)


def test_summary_text_for_the_seed_example():
    s = kv_summary("llama-2-7b", 4096)
    assert "524,288 bytes (0.5 MiB) per token" in s["text"]
    assert "2.15 GB of KV cache vs 13.48 GB of fp16 weights" in s["text"]
    assert "25,706 tokens" in s["text"] and "beyond this model's 4,096-token context" in s["text"]
    assert "a batch of 7" in s["text"]
    assert "overtakes the weights at 3,214 tokens" in kv_summary("llama-2-7b", 4096, 8)["text"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(preset="gpt2-small", context=2048), "at most 1,024 tokens"),
    (dict(preset="tiny", context=0), "context"),
    (dict(preset="tiny", context=10, batch=0), "batch"),
    (dict(preset="tiny", context=10, dtype="fp4"), "dtype"),
    (dict(preset="gpt-9", context=10), "unknown preset"),
])
def test_impossible_settings_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kv_summary(**kwargs)


def test_cache_curve_is_a_line_to_the_context():
    xs, ys = cache_curve("llama-3-8b", 2, "fp8")
    assert xs[0] == 0 and xs[-1] == 8192 and ys[0] == 0
    assert ys[-1] == pytest.approx(kv_cache_bytes("llama-3-8b", 8192, 2, "fp8") / GB)


def test_mistral_cache_stops_at_its_sliding_window():
    xs, ys = cache_curve("mistral-7b")
    assert 4096 in xs and xs[-1] == 32768
    flat = ys[xs.index(4096)]
    assert all(y == flat for x, y in zip(xs, ys) if x >= 4096)          # flat past the window...
    assert all(y < flat for x, y in zip(xs, ys) if x < 4096)            # ...and rising before it
    s = kv_summary("mistral-7b", 32768)
    assert s["cache_bytes"] == kv_cache_bytes("mistral-7b", 4096) and s["cached_positions"] == 4096
    assert s["crossover_tokens"] is None and "never overtakes the weights" in s["text"]
    assert "4,096-token sliding window" in s["text"] and "a batch of 27" in s["text"]
    assert "keeps only the last" not in kv_summary("mistral-7b", 4096)["text"]    # at the window nothing is dropped


def legend_problems(fig) -> list[str]:
    """Traces the legend would show without a real name (plotly would call them "trace N")."""
    return [f"trace {i}" for i, t in enumerate(fig.data)
            if t.showlegend is not False and not (t.name or "").strip()]


@pytest.mark.parametrize("preset,context,batch", [("llama-2-7b", 4096, 1), ("llama-2-7b", 4096, 8),
                                                   ("mistral-7b", 8192, 1), ("mistral-7b", 8192, 30)])
def test_every_trace_in_the_legend_has_a_name(preset, context, batch):
    k = kv_calculator(preset, context, batch)
    assert legend_problems(k.fig.figure) == []
    for t in k.fig.figure.data:          # an empty trace is hidden from the legend, a drawn one is shown
        assert (t.showlegend is not False) == (len(t.x or ()) > 0), t.name
    k.preset.value = "gpt2-small"                     # the context slider moves to gpt2's 1,024, and its marker
    assert legend_problems(k.fig.figure) == [] and list(k.fig.figure.data[3].x) == [1024]


def test_legend_check_catches_an_unnamed_trace():
    k = kv_calculator()
    k.fig.figure.add_scatter(x=[1], y=[1])
    assert legend_problems(k.fig.figure) == ["trace 5"]


def test_sliding_window_line_in_the_widget():
    k = kv_calculator("mistral-7b", context=8192)
    assert list(k.fig.figure.data[4].x) == [4096, 4096] and "4,096" in k.fig.figure.data[4].name
    assert list(k.fig.figure.data[2].x) == [] and "below the weights" in k.fig.figure.layout.title.text
    k.batch.value = 30                                # 30 windows of 0.54 GB pass the 14.48 GB of weights
    assert list(k.fig.figure.data[2].x) == [kv_summary("mistral-7b", 8192, 30)["crossover_tokens"]]
    k.preset.value = "llama-3-8b"                     # full attention: no window line
    assert list(k.fig.figure.data[4].x) == [] and k.fig.figure.data[4].showlegend is False


def test_widget_follows_its_controls():
    k = kv_calculator()
    assert isinstance(k, KVCalculator)
    y16 = list(k.fig.figure.data[0].y)
    assert "llama-2-7b" in k.summary.value and "2.15 GB" in k.summary.value
    assert k.fig.figure.data[1].y[0] == pytest.approx(weight_bytes("llama-2-7b") / GB)
    assert list(k.fig.figure.data[2].x) == []                      # crossover beyond 4,096 tokens at batch 1
    assert list(k.fig.figure.data[3].x) == [4096]

    k.dtype.value = "fp8"
    assert list(k.fig.figure.data[0].y) == pytest.approx([y / 2 for y in y16])
    assert "1.07 GB of KV cache" in k.summary.value and "in fp8" in k.summary.value

    k.batch.value = 8                                       # fp8, batch 8: crossover at 6,427 tokens, off the plot
    k.dtype.value = "fp16"
    assert list(k.fig.figure.data[0].y) == pytest.approx([8 * y for y in y16])
    assert list(k.fig.figure.data[2].x) == [3214]                  # now the crossover lies inside the context
    assert "3,214" in k.fig.figure.layout.title.text and "17.18 GB" in k.summary.value

    k.preset.value = "llama-3-8b"                           # GQA: 4x fewer bytes per token
    assert k.fig.figure.data[0].x[-1] == 8192
    assert "131,072 bytes" in k.summary.value


def test_the_context_slider_ends_at_the_models_own_context():
    # It once went on to 131,072 tokens for every model and answered "Not possible" past the model's context.
    k = kv_calculator("llama-3-8b", context=8192)
    assert k.context.max == 8192
    k.preset.value = "gpt2-small"                            # 8,192 > gpt2's 1,024: the slider moves to 1,024
    assert (k.context.max, k.context.value) == (1024, 1024)
    assert "Not possible" not in k.summary.value and "gpt2-small" in k.summary.value
    assert list(k.fig.figure.data[3].x) == [1024] and k.fig.figure.data[0].x[-1] == 1024
    k.preset.value = "mistral-7b"                            # a longer context: the slider reaches it again
    assert k.context.max == 32768 and k.context.value == 1024
    with pytest.raises(ValueError, match="context"):
        k.context.value = 40000
    with pytest.raises(ValueError, match="context"):
        kv_calculator("gpt2-small", context=2048)
