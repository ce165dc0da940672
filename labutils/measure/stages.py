"""Lesson 08's ladder: time each stage of the decode loop side by side, and see where a step's time goes."""
from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Hashable

import plotly.graph_objects as go
import torch

from labutils.perf import quiet, roofline, timing
from labutils.measure.attention_cost import _quiet_stderr
from labutils.decode.fastgen import STAGES, FastDecoder, decoder_for
from labutils.decode.loop import GenerationResult, check_request, generate
from labutils.core.validate import check_count, check_device, describe, model_device

# The bars of lesson 08's chart: lesson 05's generate(), then one overhead removed per stage.
LADDER = ("generate", *STAGES)


@dataclass
class Request:
    """One request to time: a model, a prompt [batch, T], how many new tokens, and the ladder stage that runs it."""

    model: torch.nn.Module
    ids: torch.Tensor
    new_tokens: int
    stage: str = "static"


@dataclass
class StageRun:
    """What one Request measured: median TPOT and TTFT over the rounds, and how the loop ran."""

    stage: str
    batch: int
    prompt_len: int
    new_tokens: int
    tpot_s: float
    ttft_s: float
    setup_s: float                 # cache allocation and capture/compile, outside the request's clock
    mode: str                      # the step runner that ran (eager, graph, compile)
    fallback: str | None           # why the stage's mode could not run here, or None
    tokens: torch.Tensor           # [batch, new_tokens] of the last round, on the CPU
    decode_pos: int                # cached positions an average decode step reads
    floor_s: float | None = None   # roofline.decode_floor_s, when a bandwidth was given
    mbu: float | None = None       # roofline.mbu of tpot_s, when a bandwidth was given
    graph_bytes: int | None = None # device memory a capture or compile kept (CUDA), None elsewhere


def _runner(req: Request) -> tuple[Callable[[], GenerationResult], float, str, str | None, int | None]:
    """A no-argument request for `req`, with its setup seconds, mode, fallback reason and graph memory."""
    if req.stage not in LADDER:
        raise ValueError(f"unknown stage {req.stage!r}; choose one of {list(LADDER)}")
    ids = check_request(req.model, req.ids, req.new_tokens)
    n = int(req.new_tokens)
    if req.stage == "generate":
        return (lambda: generate(req.model, ids, n)), 0.0, "eager", None, None
    settings = STAGES[req.stage]
    with warnings.catch_warnings():     # the reason is kept in dec.fallback, and shown by the caller
        warnings.simplefilter("ignore", RuntimeWarning)
        on_gpu = model_device(req.model).type == "cuda"
        if settings["mode"] == "eager" or settings["cache_kind"] != "static" or not on_gpu:
            dec = FastDecoder(req.model, ids.shape[0], ids.shape[1] + n, **settings)
        else:                           # a captured step is kept per shape bucket: never captured twice
            dec = decoder_for(req.model, ids.shape[0], ids.shape[1] + n, **settings)
    return (lambda: dec.generate(ids, n)), dec.setup_s, dec.mode, dec.fallback, dec.graph_bytes


def time_requests(requests: dict[Hashable, Request], *, rounds: int = 3,
                  bandwidth_Bps: float | None = None) -> dict[Hashable, StageRun]:
    """Each request's median TPOT over `rounds`, timed in alternation (A B C A B C ...) after one untimed warm-up.

    Alternating makes a drifting load (other programs, clock changes) hit every request alike, so their
    ratios mean something on a busy machine. With `bandwidth_Bps` (peaks.measured_peaks) each run also
    gets its bandwidth floor and MBU, from roofline, in the model's own dtype.
    """
    rounds = check_count("rounds", rounds, 1)
    if not isinstance(requests, dict):
        raise TypeError(f"requests must be a dict of name -> Request, got {describe(requests)}")
    if not requests:
        raise ValueError("no requests to time; pass a dict of name -> Request")
    wrong = [str(k) for k, r in requests.items() if not isinstance(r, Request)]
    if wrong:
        raise TypeError(f"requests {wrong} are not Requests; time Request(model, ids, new_tokens, stage) each")
    runners = {key: _runner(req) for key, req in requests.items()}
    for run, *_ in runners.values():
        run()                                   # warm-up: first-call allocations, lazy init
    results: dict[Hashable, list[GenerationResult]] = {key: [] for key in requests}
    with quiet.watch():                         # one line if other processes were busy meanwhile
        for _ in range(rounds):
            for key, (run, *_) in runners.items():
                results[key].append(run())
    out = {}
    for key, req in requests.items():
        _, setup_s, mode, fallback, graph_bytes = runners[key]
        res = results[key]
        B, T = res[-1].tokens.shape[0], res[-1].prompt_len
        tpot = statistics.median(r.tpot_s for r in res)
        pos = roofline.mean_decode_pos(T, req.new_tokens)
        run = StageRun(req.stage, B, T, req.new_tokens, tpot, statistics.median(r.ttft_s for r in res), setup_s,
                       mode, fallback, res[-1].tokens, pos, graph_bytes=graph_bytes)
        if bandwidth_Bps is not None:
            run.floor_s = roofline.decode_floor_s(req.model, pos, B, bandwidth_Bps=bandwidth_Bps)
            run.mbu = roofline.mbu(req.model, pos, B, None, tpot, bandwidth_Bps, warn=False)   # measured units
        out[key] = run
    return out


def time_ladder(model, ids, new_tokens: int, *, stages=LADDER, rounds: int = 3,
                bandwidth_Bps: float | None = None) -> dict[str, StageRun]:
    """The same request run by each stage of the ladder, side by side (time_requests)."""
    return time_requests({s: Request(model, ids, new_tokens, s) for s in stages}, rounds=rounds,
                         bandwidth_Bps=bandwidth_Bps)


def ladder_figure(runs: dict[Hashable, StageRun], title: str = "TPOT against the bandwidth floor") -> go.Figure:
    """One bar per run: MBU in percent (floor / TPOT), labelled with its TPOT; runs need a bandwidth (time_requests)."""
    if not isinstance(runs, dict) or not all(isinstance(r, StageRun) for r in runs.values()):
        raise TypeError(f"runs must be the dict of StageRun that time_requests or time_ladder returns, "
                        f"got {describe(runs)}")
    missing = [str(k) for k, r in runs.items() if r.mbu is None]
    if missing:
        raise ValueError(f"runs {missing} have no MBU; time them with bandwidth_Bps=measured_peaks(...).bandwidth_Bps")
    names = [f"{k}<br>(ran {r.mode}: fallback)" if r.fallback else str(k) for k, r in runs.items()]
    fig = go.Figure(go.Bar(
        x=names, y=[100 * r.mbu for r in runs.values()],
        text=[f"TPOT {r.tpot_s * 1e3:.2f} ms" for r in runs.values()], textposition="outside",
        customdata=[[r.floor_s * 1e3, r.setup_s] for r in runs.values()],
        hovertemplate="%{x}: MBU %{y:.1f}%<br>%{text}<br>floor %{customdata[0]:.3f} ms"
                      "<br>setup %{customdata[1]:.2f} s<extra></extra>"))
    top = max(100 * r.mbu for r in runs.values())
    fig.update_layout(title=title, yaxis_title="MBU: bandwidth floor / TPOT (%)", height=380,
                      yaxis_range=[0, 1.25 * top], margin=dict(t=60, b=40))
    return fig


# --- where the time of a few decode steps goes (torch.profiler) ------------------------------------------

GROUPS = ("matmul", "attention", "copies and syncs", "kernel launches", "other ops", "between ops")
_MATMUL = ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm",
           "aten::_weight_int8pack_mm")
_COPIES = ("aten::copy_", "aten::_to_copy", "aten::to", "aten::_local_scalar_dense", "aten::item",
           "cudaMemcpyAsync", "cudaMemcpy", "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


def op_group(name: str) -> str:
    """Which of GROUPS (except "between ops") a profiled op or runtime call belongs to."""
    if name in _MATMUL:
        return "matmul"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if name in _COPIES:
        return "copies and syncs"
    if name.startswith(("cudaLaunch", "cuLaunch", "cudaGraphLaunch")):
        return "kernel launches"
    return "other ops"


def is_view_op(name: str) -> bool:
    """Whether a profiled aten op ("aten::view") only returns a view of its input: no arithmetic, no kernel.

    Read from the op's schema: every overload on tensors returns an alias of an input and writes none
    (aten::slice also has overloads on Python lists and strings, which are left out).
    """
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None) if name.startswith("aten::") else None
    overloads = [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
    on_tensors = [o for o in overloads if any(isinstance(a.type, torch.TensorType) for a in o._schema.arguments)]
    return bool(on_tensors) and all(o.is_view for o in on_tensors)


@dataclass
class OpProfile:
    """Host time of a profiled call: wall seconds, seconds per op (self time, children excluded) and per group."""

    wall_s: float
    ops: list[tuple[str, float, int]]        # (name, self seconds, calls), the most expensive first
    groups: dict[str, float] = field(default_factory=dict)   # GROUPS -> seconds; they add up to wall_s
    device_busy_s: float | None = None       # on CUDA: seconds the GPU spent in kernels and copies
    calls: dict[str, int] = field(default_factory=dict)   # aten ops the code called itself, nested calls left out

    @property
    def views(self) -> int:
        """How many of `calls` only returned a view (is_view_op): ops that do no work and launch no kernel."""
        return sum(n for name, n in self.calls.items() if is_view_op(name))

    def table(self, rows: int = 8) -> str:
        """The top ops as a short text table: name, share of wall time, milliseconds, calls."""
        lines = [f"{'op':<52}{'% of wall':>10}{'ms':>9}{'calls':>7}"]
        for name, s, calls in self.ops[:rows]:
            lines.append(f"{name[:51]:<52}{s / self.wall_s:>10.1%}{s * 1e3:>9.2f}{calls:>7}")
        return "\n".join(lines)


def profile_ops(fn: Callable[[], object], device: torch.device | str = "cpu") -> OpProfile:
    """Run fn() once under torch.profiler; split its wall time into op groups and the time between ops.

    Self times of ops never overlap, so what they leave of the wall time was spent outside every op:
    Python, dispatch, and the loop's own bookkeeping. (The profiler adds its own cost to each op, so
    treat the split as a picture, not a measurement to the microsecond.) `calls` counts nested calls
    too (aten::linear and the aten::addmm inside it, views), so it is not a count of kernels; on CUDA
    the cudaLaunchKernel rows are. `calls` counts only the aten ops that no other aten op called: the ops
    the code dispatched itself, views included, as a TorchDispatchMode counts them (lesson 09).
    The profiler backend's start/stop lines on stderr are hidden.
    """
    from torch.profiler import ProfilerActivity, profile
    device = check_device("device", device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _quiet_stderr(), torch.inference_mode(), profile(activities=activities) as prof:
        timing.synchronize(device)
        t0 = time.perf_counter()
        fn()
        timing.synchronize(device)
        wall = time.perf_counter() - t0
    ops = sorted(((e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()
                  if e.self_cpu_time_total > 0), key=lambda row: -row[1])
    groups = dict.fromkeys(GROUPS, 0.0)
    for name, s, _ in ops:
        groups[op_group(name)] += s
    groups["between ops"] = max(0.0, wall - sum(s for _, s, _ in ops))
    calls: dict[str, int] = {}
    for e in prof.events():
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if e.name.startswith("aten::") and parent is None:
            calls[e.name] = calls.get(e.name, 0) + 1
    busy = None
    if cuda:   # kernels and copies as the GPU ran them: what is left of the wall time, the GPU waited
        busy = sum(e.self_device_time_total for e in prof.key_averages()
                   if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    return OpProfile(wall, ops, groups, busy, calls)


def profile_figure(prof: OpProfile, title: str = "Where the time of a few decode steps goes") -> go.Figure:
    """A horizontal bar per group: its share of the wall time (and, on CUDA, the GPU's busy share)."""
    names = [g for g in GROUPS if prof.groups.get(g, 0) > 0]
    fig = go.Figure(go.Bar(y=names, x=[100 * prof.groups[g] / prof.wall_s for g in names], orientation="h",
                           name="host", text=[f"{prof.groups[g] * 1e3:.1f} ms" for g in names],
                           textposition="outside"))
    if prof.device_busy_s is not None:
        fig.add_bar(y=["GPU busy"], x=[100 * prof.device_busy_s / prof.wall_s], orientation="h", name="GPU")
    fig.update_layout(title=title, xaxis_title="% of wall time", height=320, showlegend=False,
                      yaxis_autorange="reversed", margin=dict(l=10, t=60))
    return fig


__all__ = ["GROUPS", "LADDER", "OpProfile", "Request", "StageRun", "ladder_figure", "op_group",
           "profile_figure", "profile_ops", "time_ladder", "time_requests"]
