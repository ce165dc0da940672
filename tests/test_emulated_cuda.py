"""The GPU's failures on the H200 (shared/gpu/h200-2026-12-04), caught on a CPU by emulated CUDA
(labutils.core.emulated_cuda: real values, CUDA's device rules, CUDA's fused-attention output layout).

- A `.view` of a fused attention kernel's output: every model path runs with SDPA returning CUDA's layout, for MHA,
  GQA and MQA, and gives the tokens it gives with the CPU's layout.
- SDPA's kernels are chosen on CUDA (flash, then memory-efficient, then math; never cuDNN's plan-per-length
  attention): every attention call of every path records what it ran under.
- A CPU generator drawing onto CUDA, a CPU tensor compared with a CUDA one: the harness refuses both as CUDA does,
  and every bench row (quick shapes) runs on emulated CUDA without an error.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from labutils.core import emulated_cuda, fake_cuda
from labutils.core.emulated_cuda import emulated_cuda as emulated
from labutils.model.gpt import GPT, GPTConfig

HEADS = {"mha": 4, "gqa": 2, "mqa": 1}          # KV heads of a 4-head model
NEW = 5


@pytest.fixture(scope="module", autouse=True)
def guard():
    fake_cuda.install_guard()       # once: the no-op CUDA device guard a CPU build lacks (about 30 s, then cached)


def model_for(kv_heads: int, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=64, context_length=48, n_layer=2, n_head=4, n_embd=32, n_kv_head=kv_heads,
                    norm="rmsnorm", rope=True, gated_mlp=True)
    return GPT(cfg).eval()


def every_path(model: GPT, device: str) -> dict[str, list[int]]:
    """Greedy tokens from each way the course runs a model: the loop's prefill and decode step over a growing cache,
    the fast loop's step over a static cache (masked attention), the engine's packed forward over the paged cache,
    the speculative verify pass, and int8 weights."""
    from labutils.decode import quant
    from labutils.decode.fastgen import FastDecoder
    from labutils.decode.loop import generate
    from labutils.decode.speculative import PROMPT_LOOKUP, speculative_generate
    from labutils.serving.engine import Engine
    model = copy.deepcopy(model).to(device)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]], device=device)
    out = {"loop: prefill + decode_step": generate(model, ids, NEW).tokens[0].tolist(),
           "fast loop: static cache, eager step": FastDecoder(model, 1, 32, mode="eager", cache_kind="static")
           .generate(ids, NEW).tokens[0].tolist()}
    engine = Engine(model, 2, block_size=4)
    first = engine.submit(ids[0].tolist(), NEW)
    engine.submit([7, 7, 7], NEW)                          # a second request: decode rows and a prefill chunk packed
    out["engine: packed forward, paged cache"] = next(r for r in engine.run() if r.id == first).tokens
    spec = speculative_generate(model, PROMPT_LOOKUP, ids, NEW, k=3)
    out["speculative: verify pass"] = spec.tokens[0].tolist()
    int8 = quant.quantize_(copy.deepcopy(model))
    out["int8 weights"] = generate(int8, ids, NEW).tokens[0].tolist()
    return out


@pytest.mark.parametrize("heads", list(HEADS))
def test_every_model_path_gives_its_tokens_when_sdpa_returns_cudas_layout(heads, monkeypatch):
    model = model_for(HEADS[heads])
    want = every_path(model, "cpu")
    monkeypatch.setattr(F, "scaled_dot_product_attention", emulated_cuda.cuda_layout_sdpa)
    assert every_path(model, "cpu") == want


def test_a_view_of_cudas_layout_fails_as_on_a_gpu():
    q = torch.randn(1, 4, 6, 8)
    out = emulated_cuda.cuda_layout_sdpa(q, q, q)
    assert torch.equal(out, F.scaled_dot_product_attention(q, q, q)) and not out.is_contiguous()
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        out.view(1, 4 * 6, 8)


@pytest.mark.parametrize("heads", list(HEADS))
def test_every_path_on_emulated_cuda_runs_under_the_chosen_kernels_and_gives_the_cpus_tokens(heads, monkeypatch):
    from labutils.model.kernels.attention import CUDA_SDPA_BACKENDS
    model = model_for(HEADS[heads])
    want = every_path(model, "cpu")
    seen = []
    # The patch is undone before the emulation puts torch's SDPA back: undone at teardown, it restored the
    # emulation's CUDA-layout SDPA for every later test (each attention call then ran one more transpose).
    with emulated(), monkeypatch.context() as patch:
        inner = F.scaled_dot_product_attention                     # the emulation's CUDA-layout SDPA

        def recording(q, *args, **kwargs):
            seen.append((q.device.type, torch.backends.cuda.cudnn_sdp_enabled(),
                         tuple(torch._C._get_sdp_priority_order())))
            return inner(q, *args, **kwargs)
        patch.setattr(F, "scaled_dot_product_attention", recording)
        got = every_path(model, "cuda")
    assert F.scaled_dot_product_attention is not inner, "the emulation's SDPA outlived it"
    assert got == want
    order = tuple(int(b) for b in CUDA_SDPA_BACKENDS)
    assert len(seen) > 5 * NEW and {s[0] for s in seen} == {"cuda"}
    assert not any(cudnn for _, cudnn, _ in seen), "an attention call ran with cuDNN's attention enabled"
    assert all(prio[:len(order)] == order for _, _, prio in seen), f"priority {seen[0][2]}, want {order} first"


def test_outside_cuda_the_choice_is_torchs(monkeypatch):
    from labutils.model.kernels.attention import sdpa_attention
    seen = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: (seen.append(torch.backends.cuda.cudnn_sdp_enabled()), real(*a, **k))[1])
    q = torch.randn(1, 2, 4, 8)
    sdpa_attention(q, q, q)
    assert seen == [torch.backends.cuda.cudnn_sdp_enabled()]       # untouched: the CPU keeps torch's own choice


# ---- the harness refuses what CUDA refuses, and computes what the CPU computes -------------------------------------

def test_emulated_cuda_refuses_a_cpu_tensor_beside_a_cuda_one():
    with emulated():
        x = torch.arange(6.0, device="cuda")
        assert x.is_cuda and x.device == torch.device("cuda", 0)
        with pytest.raises(RuntimeError, match="same device"):
            torch.equal(x, torch.arange(6.0))                      # lesson 06's exercise on the H200
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(6)
        assert (x + torch.tensor(1.0)).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]   # a CPU scalar is allowed
        assert x[torch.tensor([1, 3])].tolist() == [1.0, 3.0]                     # and CPU indices
        assert torch.equal(x.cpu(), torch.arange(6.0)) and not x.cpu().is_cuda


def test_emulated_cuda_refuses_a_cpu_generator_drawing_onto_cuda():
    with emulated():
        with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator but found 'cpu'"):
            torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(0), device="cuda")   # the bench rows
        g = fake_cuda.generator(torch.device("cuda"), 0)
        with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator but found 'cuda'"):
            torch.randint(0, 10, (4,), generator=g)
        drawn = torch.randint(0, 10, (4,), generator=g, device="cuda")
        assert drawn.is_cuda and torch.rand(3, device="cuda").is_cuda


def test_a_copy_to_the_host_is_a_copy():
    with emulated():
        x = torch.zeros(3, device="cuda")
        host = x.cpu()
        host += 1
        assert x.tolist() == [0.0, 0.0, 0.0]


def test_outside_the_emulation_cuda_is_refused_again():
    with emulated():
        assert fake_cuda.active() and emulated_cuda.active()
    assert not fake_cuda.active() and not emulated_cuda.active()
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            torch.zeros(2, device="cuda")


def test_moving_a_model_keeps_its_tied_weights_tied():
    cfg = GPTConfig(vocab_size=64, context_length=32, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    on_cpu = GPT(cfg)
    with emulated():
        moved = copy.deepcopy(on_cpu).to("cuda")
        assert moved.lm_head.weight is moved.tok_emb.weight and moved.lm_head.weight.is_cuda
        assert moved.num_params() == on_cpu.num_params()
