"""Is the machine quiet enough to time? The CPU time other processes used while a measurement ran.

On a small machine a second busy process ruins timings without a word: torch splits an op over its threads, and
when another process holds a core, the op waits a scheduler slice (milliseconds) for its last thread, so a step
can stall 10x. A load average cannot tell this from our own work, and it trails by a minute. So a measurement
reads the kernel's CPU counters (`/proc/stat` for the cores this process may use, `/proc/<pid>/stat` for this
process and the processes it started, such as the bench's vLLM server) before and after it runs; what the cores
did beyond that is the other processes' share (hypervisor steal included). Where there are no such counters (macOS, Windows) the load average stands in.

    with quiet.watch() as w:       # prints one line when others were busy (the outermost watch only)
        ...timed work...
    w.busy, w.others_cores         # what it saw
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass

from labutils.core.progress_bar import in_notebook

# Other processes may use this much of one core before timings are called unreliable. A desktop, a
# browser tab and Jupyter itself stay far below it; a second notebook, a test run or a build does not.
BUSY_CORES = 0.25
# Counters tick 100 times a second, and the two readings round on their own: allow a couple of ticks of slack.
SLACK_TICKS = 2
MARKER = "busy machine:"
ADVICE = "timings are unreliable; close other notebooks and programs, then measure again"
# In a notebook the learner's own page can be the other process: a browser drawing plots used up to 0.9 of a core.
PAGE_ADVICE = "; a browser still drawing this page's plots counts too, so let them finish"

_local = threading.local()
_last: "Window | None" = None


def usable_cores() -> list[int]:
    """The CPU numbers this process may run on (its affinity), or all of them where that is unknown."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _ticks(fields: list[str]) -> int:
    """utime + stime + cutime + cstime: a process's CPU time with that of the children it has reaped."""
    return sum(int(x) for x in fields[11:15])


def _tree_ticks(root: int) -> int:
    """CPU ticks of process `root` and every live process below it, with the children each has reaped.

    A process's cutime/cstime hold the children it has waited for, so a child that ends during a
    measurement still counts once it is reaped; live descendants are found through their parent ids.
    """
    own = root == os.getpid()
    fields = _stat_fields("self" if own else root)
    if fields is None:
        if own:
            raise OSError("no /proc/self/stat")
        return 0                 # a tree that has already gone
    children: dict[int, list[tuple[int, list[str]]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (f := _stat_fields(name)) is not None:
            children.setdefault(int(f[1]), []).append((int(name), f))
    total, todo = _ticks(fields), [root]
    while todo:
        for pid, f in children.get(todo.pop(), ()):
            total += _ticks(f)
            todo.append(pid)
    return total


_credited = 0     # ticks of stopped processes this process started that ended unreaped (see `stopping`)


def _own_ticks() -> int:
    """CPU ticks of this process and of the processes it started, alive, reaped or credited by `stopping`."""
    return _tree_ticks(os.getpid()) + _credited


@contextlib.contextmanager
def stopping(pid: int):
    """Wrap the stopping of a process tree this process started (the bench's vLLM server).

    Processes deep in such a tree (vLLM's compile workers) can end without their parent waiting for them;
    their CPU time then leaves this process's counters, and a measurement around the server would blame
    it on other processes. So the tree's time is read before the stop, and what the reaping does not bring
    back is credited as this process's own.
    """
    global _credited
    if not os.path.exists("/proc/self/stat"):
        yield
        return
    before, reaped = _tree_ticks(pid), _reaped_ticks()
    try:
        yield
    finally:
        _credited += max(0, before - (_reaped_ticks() - reaped))


def _reaped_ticks() -> int:
    """cutime + cstime of this process: the CPU time of the children it has waited for."""
    fields = _stat_fields("self")
    return int(fields[13]) + int(fields[14])


def _read_counters(cores: list[int]) -> tuple[int, int, int] | None:
    """(busy ticks of `cores`, all ticks of `cores`, ticks of this process and its own), or None without /proc."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        own = _own_ticks()
    except OSError:
        return None
    wanted = {f"cpu{n}" for n in cores}
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if name in wanted:
            # user nice system idle iowait irq softirq steal ...: idle and iowait are the only quiet columns
            ticks = [int(x) for x in fields[:8]]
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total, own


@dataclass
class Window:
    """What other processes did between `start` and `stop`: their share in cores, and a one-line verdict."""

    cores: int
    others_cores: float | None = None     # None: no counters on this platform
    load: float | None = None
    seconds: float = 0.0

    @property
    def busy(self) -> bool:
        if self.others_cores is not None:
            return self.others_cores > BUSY_CORES
        # No counters: this process can account for up to `cores` of the load, so only more than that is others.
        return self.load is not None and self.load > self.cores + 0.5

    @property
    def message(self) -> str:
        load = "" if self.load is None else f" (load average {self.load:.1f})"
        advice = ADVICE + (PAGE_ADVICE if in_notebook() else "")
        if self.others_cores is None:
            return f"{MARKER} load average {self.load:.1f} on {self.cores} usable cores; {advice}"
        return (f"{MARKER} other processes used {self.others_cores:.1f} of {self.cores} usable cores during "
                f"this measurement{load}; {advice}")


class _Counter:
    def __init__(self):
        self.cores = usable_cores()
        self.t0 = time.perf_counter()
        self.start = _read_counters(self.cores)

    def window(self) -> Window:
        end = _read_counters(self.cores)
        w = Window(cores=len(self.cores), load=_load_average(), seconds=time.perf_counter() - self.t0)
        if self.start is not None and end is not None:
            busy, total, own = (b - a for a, b in zip(self.start, end))
            per_core = total / len(self.cores)             # ticks each core lived through
            if per_core > 0:
                w.others_cores = max(0, busy - own - SLACK_TICKS) / per_core
            else:
                w.others_cores = 0.0
        return w


@contextlib.contextmanager
def watch(report: bool = True):
    """Count the other processes' CPU time while the block runs; yield the Window, filled in on exit.

    The outermost watch prints the busy-machine line when `report` is true, so a measurement built from
    smaller timed calls says it once. The last finished window is kept for `claims.claim` to cite.
    """
    global _last
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    counter = _Counter()
    w = Window(cores=len(counter.cores))
    try:
        yield w
    finally:
        _local.depth = depth
        seen = counter.window()
        w.others_cores, w.load, w.seconds = seen.others_cores, seen.load, seen.seconds
        if depth == 0:
            _last = w
            if report and w.busy:
                _report(w)


_reported_in: object = None      # the notebook cell that printed a busy line already


def _cell() -> object:
    """A number that tells the running notebook cell from the others (IPython's execution count, whichever side of
    the cell it counts on); None outside a notebook, where every busy line prints."""
    if not in_notebook():
        return None
    from IPython import get_ipython
    return get_ipython().execution_count


def _report(w: Window) -> None:
    """Print the busy-machine line once per notebook cell: a cell of many measurements on a busy machine printed
    one line each, seven in a row, all saying the same thing. A failing claim still cites its own measurement's."""
    global _reported_in
    cell = _cell()
    if cell is not None and cell == _reported_in:
        return
    _reported_in = cell
    print(w.message + ("" if cell is None else " (said once per cell)"))


def last_window() -> Window | None:
    """The last outermost watch that finished (None before any): what a claim about its numbers should cite."""
    return _last


def sample(seconds: float = 1.0) -> Window:
    """Watch an idle pause of `seconds`: is anything else running right now? (`make notebooks` asks this.)"""
    counter = _Counter()
    time.sleep(seconds)
    return counter.window()


def main(argv: list[str] | None = None) -> int:
    """python -m labutils.perf.quiet [seconds]: exit 1 with the busy-machine line when others are busy, else 0."""
    import sys
    args = sys.argv[1:] if argv is None else argv
    try:
        seconds = float(args[0]) if args else 2.0
    except ValueError:
        print(f"usage: python -m labutils.perf.quiet [seconds]; got {args[0]!r}", file=sys.stderr)
        return 2
    w = sample(seconds)
    if w.busy:
        print(w.message.replace("during this measurement", f"in the last {seconds:g} s"), file=sys.stderr)
        return 1
    share = "unknown" if w.others_cores is None else f"{w.others_cores:.2f}"
    print(f"quiet: other processes used {share} of {w.cores} usable cores in the last {seconds:g} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
