"""Lesson 06's pictures: the slot map read from a real KVCache, and the cache-vs-context figure."""
import pytest
import torch

from labutils.decode.loop import decode_step, prefill
from labutils.figures.kv import DECODED, EMPTY, PROMPT, cache_vs_context_figure, clear, fill_figure, fill_map
from labutils.decode.kvcache import KVCache
from labutils.model.gpt import GPT, GPTConfig
from labutils.model.presets import get_shape
from labutils.perf.roofline import weight_bytes, kv_cache_bytes

CFG = GPTConfig(vocab_size=64, context_length=32, n_layer=2, n_head=4, n_embd=16, n_kv_head=2)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(CFG).eval()


def filled_cache(model, prompt_len, steps, batch=1):
    cache = KVCache(CFG, batch, 16)
    clear(cache)
    ids = torch.randint(0, CFG.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        token = prefill(model, ids, cache)
        for _ in range(steps):
            token = decode_step(model, token, cache)
    return cache


@pytest.mark.parametrize("prompt_len,steps", [(5, 0), (5, 3), (1, 6), (16, 0)])
def test_fill_map_reads_what_prefill_and_decode_wrote(model, prompt_len, steps):
    cache = filled_cache(model, prompt_len, steps)
    z, labels = fill_map(cache, prompt_len)
    assert z.shape == (CFG.n_layer * 2 * CFG.n_kv_head, 16) and len(labels) == z.shape[0]
    assert labels[:3] == ["L0 K h0", "L0 K h1", "L0 V h0"] and labels[-1] == "L1 V h1"
    assert cache.pos == prompt_len + steps
    assert ((z != EMPTY).sum(dim=1) == cache.pos).all()          # every row filled up to pos, no further
    assert (z[:, :prompt_len] == PROMPT).all()
    assert (z[:, prompt_len:cache.pos] == DECODED).all() and (z[:, cache.pos:] == EMPTY).all()
    # The written slots are exactly the bytes the one formula counts for pos positions.
    assert int((z != EMPTY).sum()) * CFG.head_dim * cache.k.element_size() == kv_cache_bytes(CFG, cache.pos, 1,
                                                                                             torch.float32)


def test_fill_map_sees_a_slot_written_by_hand(model):
    cache = filled_cache(model, 3, 0)
    cache.v[1, 0, 1, 10] = 0.5                     # layer 1, values, head 1, position 10
    z, labels = fill_map(cache, 3)
    assert z[labels.index("L1 V h1"), 10] == DECODED and int((z != EMPTY).sum()) == 8 * 3 + 1


def test_fill_map_refuses_bad_input(model):
    cache = filled_cache(model, 3, 0, batch=2)
    with pytest.raises(ValueError, match="row must be <= 1.*2 sequence"):
        fill_map(cache, 3, row=2)
    with pytest.raises(ValueError, match="prompt_len"):
        fill_map(cache, 17)
    with pytest.raises(TypeError, match="KVCache"):
        fill_map("cache", 3)
    with pytest.raises(TypeError, match="floating-point"):
        clear(KVCache(CFG, 1, 4, dtype=torch.int8))
    with pytest.raises(ValueError, match="snapshots"):
        fill_figure({}, [])


def test_fill_figure_one_heatmap_per_snapshot(model):
    cache = filled_cache(model, 4, 2)
    z, labels = fill_map(cache, 4)
    fig = fill_figure({"a": z, "b": z}, labels)
    assert [t.type for t in fig.data] == ["heatmap", "heatmap"]
    assert list(fig.data[1].y) == labels and list(fig.data[0].z[0][:7]) == [1, 1, 1, 1, 2, 2, 0]


def test_cache_vs_context_each_model_to_its_own_context():
    shapes = [get_shape("llama-2-7b"), get_shape("mistral-7b")]
    fig = cache_vs_context_figure(shapes)
    assert [t.name for t in fig.data] == ["llama-2-7b", "mistral-7b", "llama-2-7b weights", "mistral-7b weights"]
    assert fig.data[0].x[-1] == 4096 and fig.data[1].x[-1] == 32768
    assert fig.data[1].y[-1] == pytest.approx(kv_cache_bytes("mistral-7b", 4096) / 1e9)   # flat past the window
    assert fig.data[2].y[0] == pytest.approx(weight_bytes("llama-2-7b") / 1e9)           # weights, in data units
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.tickvals                  # log, major ticks only
    # Two weight lines close together on the log axis: one label above its line, one below, never on each other.
    close = cache_vs_context_figure([get_shape("llama-3-8b"), get_shape("llama-2-7b")])
    assert [t.textposition for t in close.data[2:]] == ["top left", "bottom left"]
