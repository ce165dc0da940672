"""Lesson 08's ladder: every stage runs the request it is given, MBU comes from roofline, the profile adds up."""
import time

import pytest
import torch

from labutils.perf import roofline
from labutils.measure import stages
from labutils.decode.fastgen import STAGES
from labutils.decode.loop import generate
from labutils.measure.stages import LADDER, Request, StageRun, op_group, profile_ops, time_ladder, time_requests

from test_generate import VOCAB, make_model, prompt


def fp32_model(seed=0, **kw):
    return make_model(2, seed=seed, **kw).float()


def test_ladder_is_generate_then_fastgen_stages():
    assert LADDER == ("generate", "sync-free", "static", "graph")
    assert set(LADDER[1:]) == set(STAGES)


def test_every_stage_gives_generate_tokens_and_its_own_mbu():
    model = fp32_model(1)
    ids = prompt(2, 6, 1)
    want = generate(model, ids, 20).tokens
    bw = 10e9
    runs = time_ladder(model, ids, 20, rounds=2, bandwidth_Bps=bw)
    assert list(runs) == list(LADDER)
    for name, run in runs.items():
        assert isinstance(run, StageRun) and run.stage == name
        assert torch.equal(run.tokens, want), name
        assert (run.batch, run.prompt_len, run.new_tokens, run.decode_pos) == (2, 6, 20, 16)
        assert run.tpot_s > 0 and run.ttft_s > 0 and run.setup_s >= 0
        # MBU and the floor are roofline's, of this model at this batch and position
        assert run.floor_s == roofline.decode_floor_s(model, 16, 2, bandwidth_Bps=bw)
        assert run.mbu == pytest.approx(roofline.decode_bytes(model, 16, 2) / run.tpot_s / bw, rel=1e-12)
    assert runs["generate"].setup_s == 0
    # On a CPU the graph stage falls back to eager, and says why
    assert runs["graph"].mode == "eager" and "NVIDIA GPU" in runs["graph"].fallback
    assert runs["static"].fallback is None


def test_requests_run_their_own_batch_and_model():
    a, b = fp32_model(2), fp32_model(3)
    runs = time_requests({1: Request(a, prompt(1, 5), 8), 4: Request(b, prompt(4, 5), 8, "sync-free")}, rounds=1)
    assert runs[1].tokens.shape == (1, 8) and runs[4].tokens.shape == (4, 8)
    assert torch.equal(runs[4].tokens, generate(b, prompt(4, 5), 8).tokens)
    assert runs[1].mbu is None and runs[1].floor_s is None          # no bandwidth given


def test_runs_are_interleaved_and_warmed_up(monkeypatch):
    """A B A B ... after one warm-up each: every request sees the same drift in load."""
    calls = []
    real = stages._runner

    def spy(req):
        run, *rest = real(req)
        return (lambda: calls.append(req.stage) or run()), *rest

    monkeypatch.setattr(stages, "_runner", spy)
    model = fp32_model(4)
    time_requests({s: Request(model, prompt(1, 4), 3, s) for s in ("generate", "static")}, rounds=2)
    assert calls == ["generate", "static"] * 3


def test_slower_request_measures_slower():
    """The timer can tell a bigger model from a smaller one in the same run."""
    small, big = fp32_model(5, n_layer=1), fp32_model(5, n_layer=12, n_embd=128)
    runs = time_requests({"small": Request(small, prompt(1, 4), 12), "big": Request(big, prompt(1, 4), 12)})
    assert runs["big"].tpot_s > runs["small"].tpot_s


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(stage="turbo"), ValueError, r"unknown stage 'turbo'; choose one of \['generate', 'sync-free'"),
    (dict(new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
    (dict(ids=prompt(1, 4) + VOCAB), ValueError, "outside the vocab"),
])
def test_bad_requests_are_refused_before_any_timing(kwargs, err, match):
    req = dict(model=fp32_model(), ids=prompt(1, 4), new_tokens=3, stage="static") | kwargs
    with pytest.raises(err, match=match):
        time_requests({"x": Request(**req)})


def test_bad_settings():
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        time_ladder(fp32_model(), prompt(1, 4), 3, rounds=0)
    with pytest.raises(ValueError, match="no requests"):
        time_requests({})
    runs = time_requests({"static": Request(fp32_model(), prompt(1, 4), 3)}, rounds=1)
    with pytest.raises(ValueError, match=r"no MBU; time them with bandwidth_Bps"):
        stages.ladder_figure(runs)


def test_ladder_figure_has_one_bar_per_stage():
    runs = time_ladder(fp32_model(6), prompt(1, 4), 6, rounds=1, bandwidth_Bps=5e9)
    fig = stages.ladder_figure(runs)
    bar = fig.data[0]
    assert len(fig.data) == 1 and list(bar.x) == ["generate", "sync-free", "static", "graph<br>(ran eager: fallback)"]
    assert list(bar.y) == [100 * r.mbu for r in runs.values()]
    assert all(t.startswith("TPOT ") for t in bar.text)


# --- the profile ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,group", [
    ("aten::addmm", "matmul"), ("aten::mm", "matmul"), ("aten::_weight_int8pack_mm", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::scaled_dot_product_attention", "attention"),
    ("aten::_local_scalar_dense", "copies and syncs"), ("aten::copy_", "copies and syncs"),
    ("cudaStreamSynchronize", "copies and syncs"), ("cudaLaunchKernel", "kernel launches"),
    ("cudaGraphLaunch", "kernel launches"), ("aten::gelu", "other ops"), ("aten::native_layer_norm", "other ops"),
])
def test_op_groups(name, group):
    assert op_group(name) == group


def test_profile_splits_wall_time_into_ops_and_the_time_between_them():
    model = fp32_model(7)
    ids = prompt(1, 6)

    def steps():
        generate(model, ids, 4)
        time.sleep(0.05)            # Python work outside any op

    prof = profile_ops(steps)
    assert prof.device_busy_s is None
    assert set(prof.groups) == set(stages.GROUPS)
    assert sum(prof.groups.values()) == pytest.approx(prof.wall_s, rel=1e-9)
    assert prof.groups["between ops"] >= 0.045             # the sleep is found between ops
    assert prof.groups["matmul"] > 0 and prof.groups["attention"] > 0
    assert prof.groups["kernel launches"] == 0             # no GPU here
    names = [name for name, _, _ in prof.ops]
    assert "aten::addmm" in names
    assert [s for _, s, _ in prof.ops] == sorted((s for _, s, _ in prof.ops), reverse=True)
    addmm_calls = dict((n, c) for n, _, c in prof.ops)["aten::addmm"]
    assert addmm_calls == 4 * model.config.n_layer * 4   # 4 passes x layers x (qkv, proj, fc, fc2)
    lines = prof.table(3).splitlines()
    assert len(lines) == 4 and lines[0].split()[0] == "op"
    fig = stages.profile_figure(prof)
    assert "between ops" in list(fig.data[0].y)
    # calls: only the ops the code called itself; the addmm inside each linear is nested, so it is left out
    assert "aten::addmm" not in prof.calls
    assert prof.calls["aten::linear"] == 4 * (4 * model.config.n_layer + 1)   # ... plus the output layer
    assert 0 < prof.views < sum(prof.calls.values()) < sum(c for _, _, c in prof.ops)


@pytest.mark.parametrize("name,view", [
    ("aten::view", True), ("aten::transpose", True), ("aten::slice", True), ("aten::select", True),
    ("aten::t", True), ("aten::split_with_sizes", True), ("aten::linear", False), ("aten::copy_", False),
    ("aten::add", False), ("cudaLaunchKernel", False), ("aten::no_such_op", False),
])
def test_view_ops_are_read_from_the_schema(name, view):
    assert stages.is_view_op(name) is view


def test_profile_calls_count_what_a_dispatch_mode_counts():
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n, self.views = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n, self.views = self.n + 1, self.views + func.is_view
            return func(*args, **(kwargs or {}))

    model, ids = fp32_model(3), prompt(1, 6, 3)
    with torch.inference_mode(), CountOps() as counted:
        model(ids, check=False, last_only=True)
    prof = profile_ops(lambda: model(ids, check=False, last_only=True))
    assert (sum(prof.calls.values()), prof.views) == (counted.n, counted.views)


# --- on a GPU (make gpu-check) ------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_ladder_captures_the_graph_and_keeps_the_tokens():
    model = fp32_model(8).cuda()
    ids = prompt(1, 6, 8)
    runs = time_ladder(model, ids, 24, rounds=1, bandwidth_Bps=1e12)
    assert runs["graph"].mode == "graph" and runs["graph"].fallback is None and runs["graph"].setup_s > 0
    want = generate(model, ids, 24).tokens
    assert all(torch.equal(r.tokens, want) for r in runs.values())


@pytest.mark.gpu
def test_gpu_profile_sees_launches_and_device_time():
    model = fp32_model(9).cuda()
    ids = prompt(1, 6, 9).cuda()
    prof = profile_ops(lambda: generate(model, ids, 4), "cuda")
    assert prof.groups["kernel launches"] > 0
    assert prof.device_busy_s is not None and 0 < prof.device_busy_s < prof.wall_s
    assert "GPU busy" in list(stages.profile_figure(prof).data[1].y)
