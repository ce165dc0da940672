"""The busy-machine check: other processes' CPU time during a measurement, faked and real."""
import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from labutils.perf import quiet, timing
from labutils.measure.claims import claim


def fake_counters(monkeypatch, others_per_reading: int, own_per_reading: int = 0, cores: int = 2):
    """Each reading advances every core by 100 ticks; others and this process add the busy ticks given."""
    state = {"n": 0}

    def read(_cores):
        state["n"] += 1
        n = state["n"]
        return (n * (others_per_reading + own_per_reading), n * 100 * cores, n * own_per_reading)
    monkeypatch.setattr(quiet, "usable_cores", lambda: list(range(cores)))
    monkeypatch.setattr(quiet, "_read_counters", read)


def test_a_faked_busy_machine_prints_one_line(monkeypatch, capsys):
    fake_counters(monkeypatch, others_per_reading=150)          # others: 1.5 of 2 cores
    with quiet.watch() as w:
        pass
    assert w.busy and w.others_cores == pytest.approx((150 - quiet.SLACK_TICKS) / 100)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(quiet.MARKER)
    assert "1.5 of 2 usable cores" in out and quiet.ADVICE in out


def test_own_work_is_not_counted(monkeypatch, capsys):
    fake_counters(monkeypatch, others_per_reading=0, own_per_reading=200)     # this process used both cores
    with quiet.watch() as w:
        pass
    assert not w.busy and capsys.readouterr().out == ""


def test_nested_watches_report_once(monkeypatch, capsys):
    fake_counters(monkeypatch, others_per_reading=150)
    with quiet.watch():
        for _ in range(3):
            timing.time_fn(lambda: None, warmup=0, repeats=1)          # time_fn watches too
    assert capsys.readouterr().out.count(quiet.MARKER) == 1


def test_a_notebook_cell_of_many_measurements_says_it_once(monkeypatch, capsys):
    # Lesson 07's GEMV cell printed seven busy lines in a row; a cell now prints one, and the next cell its own.
    fake_counters(monkeypatch, others_per_reading=150)
    cell = {"n": 5}
    monkeypatch.setattr(quiet, "_cell", lambda: cell["n"])
    for _ in range(7):
        timing.time_fn(lambda: None, warmup=0, repeats=1)
    out = capsys.readouterr().out
    assert out.count(quiet.MARKER) == 1 and "once per cell" in out
    cell["n"] = 6
    timing.time_fn(lambda: None, warmup=0, repeats=1)
    assert capsys.readouterr().out.count(quiet.MARKER) == 1
    monkeypatch.setattr(quiet, "_cell", lambda: None)          # a script: every measurement says it
    for _ in range(2):
        timing.time_fn(lambda: None, warmup=0, repeats=1)
    assert capsys.readouterr().out.count(quiet.MARKER) == 2


def test_time_fn_warns_on_a_busy_machine(monkeypatch, capsys):
    fake_counters(monkeypatch, others_per_reading=150)
    timing.time_fn(lambda: None, warmup=0, repeats=1)
    assert quiet.MARKER in capsys.readouterr().out


def test_a_failed_claim_names_the_busy_machine(monkeypatch, capsys):
    fake_counters(monkeypatch, others_per_reading=150)
    with quiet.watch(report=False):
        pass
    claim("doubling the prompt about doubles TTFT", 1.2, between=(1.6, 2.4))
    out = capsys.readouterr().out
    assert out.startswith("[does not hold here]") and "the machine was busy" in out


def test_without_counters_the_load_average_stands_in(monkeypatch):
    monkeypatch.setattr(quiet, "_read_counters", lambda cores: None)
    monkeypatch.setattr(quiet, "usable_cores", lambda: [0, 1])
    monkeypatch.setattr(quiet, "_load_average", lambda: 4.0)
    w = quiet.sample(0.0)
    assert w.others_cores is None and w.busy and "load average 4.0 on 2 usable cores" in w.message
    monkeypatch.setattr(quiet, "_load_average", lambda: 1.0)
    assert not quiet.sample(0.0).busy


SPIN = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_real_busy_process_is_seen():
    # Started through a shell that exits at once, the hog is nobody's child here: another process.
    hog = subprocess.run(["sh", "-c", f'{sys.executable} -c "{SPIN.format(s=3)}" >/dev/null 2>&1 & echo $!'],
                         capture_output=True, text=True, check=True)
    pid = int(hog.stdout)
    try:
        time.sleep(0.3)                                # let it start spinning
        w = quiet.sample(1.0)
    finally:
        subprocess.run(["kill", str(pid)])
    assert w.busy and w.others_cores > 0.5, w


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_processes_this_one_started_are_its_own_work():
    # The bench's vLLM row times a server it started: that server's CPU time is the measurement, not noise.
    with quiet.watch(report=False) as w:
        child = subprocess.Popen([sys.executable, "-c", SPIN.format(s=1.2)])
        time.sleep(0.6)                                # alive: found through its parent id
        child.wait()                                   # finished and reaped: in this process's cutime
    assert w.seconds > 1.0 and not w.busy, w


def test_the_command_line_exit_codes(monkeypatch, capsys):
    fake_counters(monkeypatch, others_per_reading=150)
    assert quiet.main(["0"]) == 1 and quiet.MARKER in capsys.readouterr().err
    fake_counters(monkeypatch, others_per_reading=0)
    assert quiet.main(["0"]) == 0 and capsys.readouterr().out.startswith("quiet:")
    assert quiet.main(["soon"]) == 2


ORPHANING_PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", {spin!r}])     # never waited for: it outlives this parent unreaped
time.sleep(5)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("credited", [True, False])
def test_a_stopped_tree_whose_grandchild_was_never_reaped(credited):
    # vLLM's compile workers end that way: without `stopping`, their CPU time would look like another process's.
    parent = subprocess.Popen([sys.executable, "-c", ORPHANING_PARENT.format(spin=SPIN.format(s=1.0))],
                              start_new_session=True)
    with quiet.watch(report=False) as w:
        time.sleep(1.1)                                # the grandchild spins for all of it
        stop = quiet.stopping(parent.pid) if credited else contextlib.nullcontext()
        with stop:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()
    assert w.busy is not credited, w
