"""The GPU paths, traced on a CPU-only torch under fake CUDA (labutils.core.fake_cuda): devices and dtypes, no values.

Each path runs with every weight a fake bf16 or fp16 tensor on cuda:0. A CPU tensor meeting a CUDA one raises
FakeTensorDeviceMismatchError, as the GPU would; `sixteen_bit` fails a path where a module's floating input or output
leaves the model's dtype. The planted-bug tests show both catch what they are for. The paths traced are listed in
pytest's summary ("fake-CUDA paths traced").
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from labutils.core import fake_cuda
from labutils.model.gpt import GPT, GPTConfig

DTYPES = [torch.bfloat16, torch.float16]
SHAPES = {"gpt2": dict(), "llama": dict(n_kv_head=1, norm="rmsnorm", rope=True, gated_mlp=True)}
TRACED: set[str] = set()          # what ran, for the summary conftest prints


@pytest.fixture(scope="module", autouse=True)
def guard():
    fake_cuda.install_guard()       # once: compiles a tiny C++ extension on a CPU build (about 30 s)


def config(shape: str = "gpt2") -> GPTConfig:
    return GPTConfig(vocab_size=64, context_length=32, n_layer=2, n_head=2, n_embd=32, **SHAPES[shape])


@contextlib.contextmanager
def sixteen_bit(model: torch.nn.Module, dtype: torch.dtype):
    """Fail if any module's floating input or output is not `dtype` (a promotion to fp32 inside a 16-bit step)."""
    bad = []

    def hook(module, args, out):
        for t in [*args, *(out if isinstance(out, tuple) else (out,))]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
                bad.append(f"{type(module).__name__}: {t.dtype}")
    handles = [m.register_forward_hook(hook) for m in model.modules() if m is not model]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
    assert not bad, f"a {dtype} step left {dtype}: {sorted(set(bad))[:6]}"


def fake_model(dtype, shape="gpt2", seed=0):
    torch.manual_seed(seed)
    with fake_cuda.unset():
        model = GPT(config(shape)).eval()
    return fake_cuda.to_fake_cuda(model, dtype)


def traced(name: str, dtype) -> None:
    TRACED.add(f"{name} ({str(dtype).removeprefix('torch.')})")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefill_decode_step_and_generate(dtype, shape):
    from labutils.decode.loop import decode_step, generate, prefill
    from labutils.decode.kvcache import KVCache
    with fake_cuda.fake_cuda():
        m = fake_model(dtype, shape)
        ids = torch.zeros(2, 5, dtype=torch.long, device="cuda")
        cache = KVCache(m.config, 2, 12, device="cuda", dtype=dtype)
        with torch.inference_mode(), sixteen_bit(m, dtype):
            tok = prefill(m, ids, cache)
            nxt = decode_step(m, tok, cache)
            result = generate(m, ids, 4, temperature=0.8, top_k=5, seed=0)
        assert tok.device.type == "cuda" and nxt.shape == (2,) and cache.k.dtype == dtype
        assert result.tokens.shape == (2, 4) and result.tokens.device.type == "cpu"
    traced(f"prefill, decode_step, generate ({shape})", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cache", ["static", "growing"])
def test_the_fast_loop_eager_step_and_prefill(dtype, cache):
    from labutils.decode.fastgen import FastDecoder, fast_generate
    with fake_cuda.fake_cuda():
        m = fake_model(dtype)
        ids = torch.zeros(1, 5, dtype=torch.long, device="cuda")
        with sixteen_bit(m, dtype):
            greedy = fast_generate(m, ids, 4, mode="eager", cache_kind=cache)
            dec = FastDecoder(m, 1, 12, mode="eager", cache_kind=cache, temperature=0.8, top_k=5)
            sampled = dec.generate(ids, 4, seed=1)
        assert greedy.tokens.shape == sampled.tokens.shape == (1, 4)
        assert dec.cache.k.device.type == "cuda" and dec.token.device.type == "cuda"
    traced(f"fast loop, {cache} cache, eager step + prefill, greedy and sampled", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_engine_step_through_the_paged_cache(dtype):
    from labutils.serving.engine import Engine
    from labutils.serving.scheduler import Feed
    with fake_cuda.fake_cuda():
        m = fake_model(dtype)
        engine = Engine(m, 2, block_size=4)
        engine.submit([1, 2, 3, 4, 5], 3)
        engine.submit([6, 7], 3)
        engine._arrive(0.0)
        plan = engine.scheduler.schedule(0.0)                   # both prompts, whole
        with torch.inference_mode(), sixteen_bit(m, dtype):
            _, first = engine.runner.forward(plan, engine.blocks.high_water)   # both prefills, packed, one forward
            for s, n in plan:                                   # what postprocess does on the host, with stand-ins
                s.n_computed += n
                s.add_token(0, 0.0)
            _, second = engine.runner.forward([Feed(s, 1) for s, _ in plan], engine.blocks.high_water)   # one decode step
        assert [n for _, n in plan] == [5, 2]
        assert first.shape == second.shape == (2,) and second.device.type == "cuda"
        assert engine.runner.cache.device.type == "cuda" and engine.runner.cache.k[0].dtype == dtype
    traced("engine forward over the paged cache (prefill, then decode)", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_speculative_draft_and_verify_pass(dtype):
    from labutils.decode.kvcache import KVCache
    from labutils.decode.speculative import propose, verify
    with fake_cuda.fake_cuda():
        target, draft = fake_model(dtype), fake_model(dtype, seed=1)
        t_cache = KVCache(target.config, 1, 16, device="cuda", dtype=dtype)
        d_cache = KVCache(draft.config, 1, 16, device="cuda", dtype=dtype)
        # Greedy proposals: a sampled draft draws with torch.multinomial, which fake tensors cannot run (it has
        # no shape-only kernel); the verify pass is the same either way.
        sampling = dict(temperature=0.0, top_k=None, top_p=None)
        last = torch.tensor([3], device="cuda")     # made outside inference_mode: a fake one-element constant
        #                                             made inside it trips a torch fake-tensor corner (empty_strided)
        with torch.inference_mode(), sixteen_bit(target, dtype), sixteen_bit(draft, dtype):
            proposal, q = propose(draft, d_cache, [1, 2, 3], 4, sampling, None, torch.device("cuda"))
            logits = verify(target, t_cache, last, proposal)
        assert proposal.shape == (4,) and q is None and logits.shape == (5, 64)
        assert t_cache.pos == 5 and logits.device.type == "cuda"
    traced("speculative: k draft forwards, then one verify pass over k + 1 tokens", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_int8_model_on_the_cuda_kernel_path(dtype):
    from labutils.decode import quant
    from labutils.decode.kvcache import KVCache
    with fake_cuda.fake_cuda():
        m = quant.quantize_(fake_model(dtype))
        path = quant.int8_path(torch.device("cuda"), 32)
        ids = torch.zeros(1, 5, dtype=torch.long, device="cuda")
        with torch.inference_mode(), sixteen_bit(m, dtype):
            logits = m(ids, KVCache(m.config, 1, 8, device="cuda", dtype=dtype), check=False, last_only=True)
        assert logits.dtype == dtype and m.lm_head.weight.dtype == torch.int8 and m.lm_head.weight.is_cuda
    traced(f"int8 weights, the CUDA path ({path})", dtype)


# ---- the harness catches what it is for ---------------------------------------------------------------------------

def test_a_host_tensor_planted_in_a_decode_step_fails(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError
    from labutils.decode.fastgen import FastDecoder
    from labutils.decode.static_cache import StaticKVCache
    real = StaticKVCache.begin

    def planted(self, n_new):                  # the bug: positions built on the host, as torch.arange(n) is
        positions = real(self, n_new)
        return positions + torch.arange(n_new)
    monkeypatch.setattr(StaticKVCache, "begin", planted)
    with fake_cuda.fake_cuda():
        m = fake_model(torch.bfloat16)
        dec = FastDecoder(m, 1, 12, mode="eager")
        with pytest.raises(FakeTensorDeviceMismatchError):
            dec.generate(torch.zeros(1, 5, dtype=torch.long, device="cuda"), 3)


def test_a_mask_built_on_the_host_fails(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError
    from labutils.decode.loop import prefill
    from labutils.decode.kvcache import KVCache
    from labutils.model.kernels import attention as real

    def planted(q, k, v, *args, **kwargs):    # the bug: a causal mask made without device=
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        return real(q, k, v, *args, **kwargs) * mask[None, None, :, :1]
    import labutils.decode.kvcache as cache_mod
    monkeypatch.setattr(cache_mod, "attention", planted)          # what KVCache.attend calls
    with fake_cuda.fake_cuda():
        m = fake_model(torch.bfloat16)
        with pytest.raises(FakeTensorDeviceMismatchError):
            prefill(m, torch.zeros(1, 5, dtype=torch.long, device="cuda"),
                    KVCache(m.config, 1, 8, device="cuda", dtype=torch.bfloat16))


def test_a_promotion_to_fp32_fails(monkeypatch):
    from labutils.decode.loop import prefill
    from labutils.decode.kvcache import KVCache
    import labutils.model.gpt as model_mod
    real = model_mod.MLP.forward
    monkeypatch.setattr(model_mod.MLP, "forward", lambda self, x: real(self, x).float())   # the bug: .float()
    with fake_cuda.fake_cuda():
        m = fake_model(torch.bfloat16)
        with pytest.raises((AssertionError, RuntimeError), match="left torch.bfloat16|expected|dtype"):
            with sixteen_bit(m, torch.bfloat16):
                prefill(m, torch.zeros(1, 5, dtype=torch.long, device="cuda"),
                        KVCache(m.config, 1, 8, device="cuda", dtype=torch.bfloat16))


def test_outside_the_harness_cuda_is_still_refused():
    from labutils.core.validate import DeviceUnavailableError, check_device
    if torch.cuda.is_available():
        pytest.skip("this machine has a real GPU")
    with pytest.raises(DeviceUnavailableError, match="sees no CUDA GPU"):
        check_device("device", "cuda")
    with fake_cuda.fake_cuda():
        assert check_device("device", "cuda").type == "cuda"
    with pytest.raises(DeviceUnavailableError):
        check_device("device", "cuda")
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(2, device="cuda")              # the guard makes no real CUDA tensor possible


def test_one_rule_says_where_cuda_graphs_replay():
    """core.devices.graphs_unavailable is the one rule the fast loop, the serving engine's steps and time_pass ask:
    a CPU, faked CUDA and emulated CUDA replay no graphs, each with its own reason; real CUDA does."""
    from labutils.core.devices import graphs_unavailable
    from labutils.core.emulated_cuda import emulated_cuda
    from labutils.decode import fastgen
    from labutils.measure import request
    cuda = torch.device("cuda")
    assert "on cpu" in graphs_unavailable(torch.device("cpu")) and graphs_unavailable(cuda) is None
    with fake_cuda.fake_cuda():
        assert "faked" in graphs_unavailable(cuda)
        assert "faked" in fastgen._unavailable("graph", cuda, "static")
        assert request.without_launches(print, cuda) is print
    with emulated_cuda():
        assert "emulated" in graphs_unavailable(cuda) and "emulated" in fastgen._unavailable("graph", cuda, "static")
