"""How fast, measured and promised: timers, the busy-machine check, probes, datasheets, peaks, the roofline's counts.
May import: labutils.core, labutils.text, labutils.model."""
from labutils.core.surface import lazy_surface

SURFACE = {
    "labutils.perf.datasheets": ["SPECS", "DeviceSpec", "match_spec"],
    "labutils.perf.peaks": ["Peaks", "measured_peaks"],
    "labutils.perf.probes": ["MeasurementError", "cpu_multiplies_bf16", "last_level_cache_bytes", "measure_bandwidth",
                             "measure_linear_sweep", "measure_matmul_flops"],
    "labutils.perf.quiet": ["watch"],
    "labutils.perf.shape_choice": ["LONG_PROMPT_MOST", "ShapeChoice", "long_prompt_tokens", "next_larger", "shape_for"],
    "labutils.perf.timing": ["Timing", "itl_s", "synchronize", "time_fn", "torch_threads", "tpot_s", "ttft_s"],
}
__getattr__, __dir__, __all__ = lazy_surface(__name__, SURFACE)
