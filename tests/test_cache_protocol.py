"""GPT.forward asks a cache four verbs (model.cache.Cache) and nothing else: a cache the course never saw works."""
import ast
import inspect
import textwrap

import torch

from labutils.decode.kvcache import KVCache
from labutils.decode.static_cache import StaticKVCache
from labutils.model.cache import Cache
from labutils.model.gpt import GPT, CausalSelfAttention, GPTConfig
from labutils.model.kernels.attention import attention
from labutils.serving.paged_cache import PackedBatch


class ListCache:
    """The four verbs over Python lists: keys grow by torch.cat, positions from an int. No k, v buffers, no pos
    attribute the model could read."""

    def __init__(self, n_layer):
        self.keys, self.values, self.written = [None] * n_layer, [None] * n_layer, 0
        self.calls = []

    def check(self, model, ids):
        self.calls.append("check")

    def begin(self, n_new):
        self.calls.append("begin")
        return torch.arange(self.written, self.written + n_new)

    def attend(self, layer, q, k, v, impl):
        old_k, old_v = self.keys[layer], self.values[layer]
        self.keys[layer] = k if old_k is None else torch.cat([old_k, k], dim=2)
        self.values[layer] = v if old_v is None else torch.cat([old_v, v], dim=2)
        return attention(q, self.keys[layer], self.values[layer], q_offset=self.written, impl=impl)

    def advance(self, n):
        self.calls.append("advance")
        self.written += n


def _model(rope):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, context_length=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                         rope=rope, norm="rmsnorm" if rope else "layernorm")).eval()


def test_a_new_cache_needs_only_the_four_verbs():
    for rope in (False, True):
        model = _model(rope)
        ids = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(1))
        want = model(ids)
        cache = ListCache(2)
        with torch.no_grad():
            got = [model(ids[:, :7], cache)[0]] + [model(ids[:, t:t + 1], cache)[0] for t in range(7, 12)]
        torch.testing.assert_close(torch.cat(got), want[0], rtol=1e-5, atol=1e-5)
        assert cache.calls[:3] == ["check", "begin", "advance"] and cache.written == 12


def test_the_course_caches_are_caches():
    cfg = _model(True).config
    for cache in (KVCache(cfg, 1, 16), StaticKVCache(cfg, 1, 16)):
        assert isinstance(cache, Cache)
    for verb in ("check", "begin", "attend", "advance"):
        assert callable(getattr(PackedBatch, verb))


def test_the_model_never_asks_which_cache_it_holds():
    """The forward passes touch the cache only through the four verbs: no hasattr, no pos, no mask, no update."""
    touched, asked = set(), []
    for fn in (GPT.forward, CausalSelfAttention.forward):
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cache":
                touched.add(node.attr)
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("hasattr", "getattr", "type"):
                asked.append(ast.unparse(node))
            if isinstance(node, ast.Name) and node.id in ("KVCache", "StaticKVCache", "PackedBatch"):
                asked.append(node.id)
    assert touched == {"check", "begin", "attend", "advance"}
    assert asked == []
