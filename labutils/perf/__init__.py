"""How fast, measured and promised: timers, the busy-machine check, probes, datasheets, peaks, the roofline's counts.
May import: labutils.core, labutils.text, labutils.model.gpt."""
from labutils.perf import quiet, roofline
from labutils.perf.quiet import watch
from labutils.perf.datasheets import SPECS, DeviceSpec, match_spec
from labutils.perf.peaks import Peaks, measured_peaks
from labutils.perf.probes import (MeasurementError, last_level_cache_bytes, measure_bandwidth, measure_linear_sweep,
                                  measure_matmul_flops)
from labutils.perf.timing import Timing, itl_s, synchronize, time_fn, torch_threads, tpot_s, ttft_s
