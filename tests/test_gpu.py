"""Checks that only mean something on a CUDA GPU (run by `make gpu-check`; skipped without one)."""
import statistics
import time

import pytest
import torch

from labutils.measure import request as measure
from labutils.perf import timing
from labutils.decode.loop import generate
from labutils.perf.peaks import measured_peaks
from labutils.model.gpt import GPT, GPTConfig

pytestmark = pytest.mark.gpu
CFG = GPTConfig(vocab_size=1024, context_length=256, n_layer=4, n_head=8, n_embd=256, n_kv_head=2)


@pytest.fixture(scope="module")
def bf16_model():
    torch.manual_seed(0)
    return GPT(CFG).to("cuda", torch.bfloat16).eval()


def test_cached_equals_recompute_in_bf16(bf16_model):
    # bf16 rounding differs between a [T] pass and T one-token passes, so logits agree only to a tolerance;
    # with greedy decoding a near-tie can flip a token, so we compare the first step's logits and most tokens.
    ids = torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)).cuda()
    cached = generate(bf16_model, ids, 16)
    recompute = generate(bf16_model, ids, 16, use_cache=False)
    assert torch.equal(cached.tokens[:, 0], recompute.tokens[:, 0])
    assert (cached.tokens == recompute.tokens).float().mean() > 0.9


def test_cuda_event_timing_agrees_with_a_synchronised_wall_clock():
    # Events time the GPU's work; a wall clock read after torch.cuda.synchronize() times the same work plus the
    # host's launches and the sync. On work long enough that those are a sliver (20 bf16 matmuls of 8192^2, 22 TFLOP:
    # about 28 ms at the H200's measured 776 TFLOP/s, 0.35 s on a T4), the two agree. A 4096^2 matmul (0.18 ms
    # there) is not long enough: host work around it dominates the wall time, which is what the old test tripped on.
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def work():
        for _ in range(20):
            a @ a
    events = timing.time_fn(work, device="cuda", warmup=2, repeats=5).median_s
    walls = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        work()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    ratio = events / statistics.median(walls)
    assert 0.9 <= ratio <= 1.02, f"events {events * 1e3:.2f} ms, synchronised wall {statistics.median(walls) * 1e3:.2f} ms"


def test_measure_request_on_cuda():
    row = measure.measure_request("gpt2-small", 128, 16, dtype=measure.default_dtype_name("cuda"), device="cuda")
    assert row["device"].startswith("cuda") and row["ttft_s"] > 0 and row["tpot_s"] > 0
    assert 0 < row["mbu"] < 1.5 and 0 < row["mfu_prefill"] < 1.5
    peaks = measured_peaks("cuda")
    assert peaks.bandwidth_Bps > 100e9 and peaks.flops > 1e12


def test_out_of_memory_gives_a_clear_message_and_frees_the_models():
    free = torch.cuda.mem_get_info()[0]
    with pytest.raises((RuntimeError, ValueError), match="out of memory|needs about|is free"):
        # A batch whose KV cache alone is bigger than the free memory: refused or caught, never a crash.
        measure.measure_request("gpt2-small", 512, 8, batch=int(free // (512 * 73728)) * 4 + 8,
                                dtype="bf16", device="cuda")
    assert torch.cuda.is_available() and torch.ones(1, device="cuda").item() == 1.0   # the device still works
