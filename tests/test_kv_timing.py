"""Lesson 06's step-cost sweep: shapes of the result, the cache it fills, and refusals."""
import pytest
import torch

from labutils.measure.kv_timing import check_positions, step_cost_ms
from labutils.model.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, context_length=32, n_layer=1, n_head=2, n_embd=16)


def test_one_median_per_position_and_kind():
    torch.manual_seed(0)
    before = torch.get_num_threads()
    out = step_cost_ms(GPT(CFG).eval(), [1, 8, 32], repeats=2)
    assert set(out) == {"recompute", "cached"}
    assert all(len(v) == 3 and all(ms > 0 for ms in v) for v in out.values())
    assert torch.get_num_threads() == before          # the thread count comes back


@pytest.mark.parametrize("positions,err,match", [
    ([], ValueError, "non-empty"), (5, ValueError, "non-empty"), ([0], ValueError, "positions must be >= 1"),
    ([33], ValueError, "context length 32"), ([1.5], TypeError, "positions")])
def test_bad_positions(positions, err, match):
    with pytest.raises(err, match=match):
        check_positions(positions, 32)


def test_bad_repeats():
    with pytest.raises(ValueError, match="repeats"):
        step_cost_ms(GPT(CFG).eval(), [4], repeats=0)


def test_each_step_at_each_position_is_timed_as_one_graph_where_graphs_replay(monkeypatch):
    """On CUDA a 7B model's eager step is its host's queueing, the same at every position: each step is handed to
    without_launches, which replays it as a CUDA graph there (and leaves it as it is on a CPU). A graph replays a
    step only if nothing in it reads a device value on the host: the cached step is checked the way lesson 08
    checks the fast loop's."""
    from labutils.decode.fastgen import check_graph_ready
    from labutils.measure import kv_timing
    handed, timed = [], []

    def record(step, device):
        handed.append(device.type)
        if len(handed) in (1, 2):
            check_graph_ready(step, steps=2)        # the recompute step, then the cached one, at the first position

        def replay():                               # what the sweep times must be what without_launches returned
            timed.append(len(handed))
            return step()
        return replay
    monkeypatch.setattr(kv_timing, "without_launches", record)
    out = step_cost_ms(GPT(CFG).eval(), [4, 8, 16], repeats=1)
    assert handed == ["cpu"] * 6 and all(len(v) == 3 for v in out.values())
    assert sorted(set(timed)) == [1, 2, 3, 4, 5, 6]             # each step timed through its own wrapper
