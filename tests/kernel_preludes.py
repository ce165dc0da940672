"""Code a test runs first in a lesson's kernel where it checks that the cells run and the plots draw, not what they
measure (nbval runs every lesson whole, as stored, and compares it)."""

# One sample of each timed call (labutils.perf.timing.time_fn), after at most one warm-up: the same paths, and the
# same plots, for a fraction of the repeats a median needs.
ONE_SAMPLE = """
import labutils.perf.timing as timing
_time = timing._time
timing._time = lambda fn, device, warmup, repeats: _time(fn, device, min(warmup, 1), 1)
"""

# One run of each point of lesson 11's budget sweep, where the lesson serves each three times for a median wall time.
ONE_RUN_A_BUDGET = """
import labutils.serving.interference as interference
_budget_sweep = interference.budget_sweep
interference.budget_sweep = lambda *args, **kw: _budget_sweep(*args, **{**kw, "repeats": 1})
"""
