"""The fast decode loop: static shapes, no host sync per token, sampling on the device, CUDA graphs / torch.compile.

Lesson 05's `generate()` is correct, and on a GPU it would measure overhead rather than the
memory wall. This loop removes one overhead at a time, and each step is a named stage (STAGES)
that lesson 08 times with this same code:

1. Host syncs out ("sync-free"). generate() copies every token to the host and synchronizes, so
   the CPU waits for the GPU and the GPU then idles while Python launches the next step. Here the
   next token stays on the device and feeds the next step directly; it is also copied into a
   pinned host buffer with non_blocking=True, which does not wait. Sampling draws its own noise
   into a fixed buffer before each step and runs the exponential race (decode.sampling.sample_from),
   argmax(p / E) with E ~ Exponential(1), which picks token i with probability p_i (torch.multinomial
   draws one sample the same way; older PyTorch releases made it sync on CUDA, reading its check of
   the probabilities back with .item()). A captured step then holds no random-number state.
   Timestamps come from CUDA events, read once at the end.
2. Static shapes ("static"). Lesson 06's KVCache returns a slice that grows each step and keeps
   its position as a Python int: a new shape and a new constant every step. StaticKVCache writes
   at a device-tensor position (index_copy_), attends over its whole buffer under a mask built
   from that position, and feeds the same position to the position embedding.
3. Graphs ("graph", "compile", CUDA). A decode step of a small model is tens of tiny kernels
   (the course's 4-layer model: 17 matrix multiplies and some tens of other ops per step, as
   lesson 08's profile counts); launching them from Python costs more than running them. A CUDA
   graph records the step once and replays it with one launch, though each recorded kernel
   still costs the GPU about 1-3 us. torch.compile(mode="reduce-overhead") does the same and
   fuses kernels too. Capture and compile time are reported apart from TPOT (`setup_s`).
   check_graph_ready tests, on any device, conditions a capture needs; it is a necessary check,
   not a proof (see its docstring).

GQA reads each KV head once (kernels.attention): no repeated K/V, so the bytes moved per step are
roofline.decode_bytes. Greedy tokens equal generate()'s (tests/test_fastgen.py).
"""
from __future__ import annotations

import itertools
import time
import types
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from labutils.core import emulated_cuda, fake_cuda
from labutils.core.devices import graphs_unavailable
from labutils.decode.loop import GenerationResult, check_request, decode_step, prefill
from labutils.decode.quant import is_quantized
from labutils.decode.sampling import check_sampling
from labutils.decode.kvcache import KVCache
from labutils.decode.static_cache import StaticKVCache
from labutils.core.validate import check_choice, check_seed

# What mode= picks: the step runner (self._run), eager, a CUDA graph or torch.compile. A word of its own, apart from
# serving's continuous or static batching.
RUNNERS = ("auto", "eager", "graph", "compile")
# Steps run before a capture or a compile (lazy init, workspaces; for reduce-overhead: compile, record, replay). Each
# writes the next cache position from 0, so a cache of max_len positions allows at most max_len of them: a third step
# into a 2-position cache wrote out of bounds, which on CUDA is a device-side assert that kills the context.
WARMUP_STEPS = 3
# cache_kind=: a name, not a cache object (as `cache` is everywhere else); FastDecoder makes the cache
CACHE_KINDS = ("static", "growing")
# Lesson 08's ladder, after generate() itself: fast_generate(model, ids, n, **STAGES[name]).
STAGES = {
    "sync-free": dict(cache_kind="growing", mode="eager"),
    "static": dict(cache_kind="static", mode="eager"),
    "graph": dict(cache_kind="static", mode="graph"),
}


@dataclass
class FastGenerationResult(GenerationResult):
    """A GenerationResult, plus how it was produced."""

    mode: str = "eager"             # the step runner that actually ran: eager, graph or compile
    setup_s: float = 0.0            # cache allocation + capture/compile, before the request's clock started
    fallback: str | None = None     # why the requested mode did not run, or None
    graph_bytes: int | None = None  # device memory the capture or compile kept (CUDA), None elsewhere


def _unavailable(mode: str, device: torch.device, cache_kind: str) -> str | None:
    """Why `mode` cannot run here (a fallback reason), or None."""
    if mode in ("graph", "compile") and cache_kind == "growing":
        return (f"{mode} needs static shapes, and the growing cache changes shape every step; "
                "running eager (use cache_kind='static')")
    if mode == "graph" and (why := graphs_unavailable(device)):
        return f"{why}; running eager"
    if mode == "compile" and emulated_cuda.active():
        return f"CUDA is emulated on the CPU here (labutils.core.emulated_cuda), which has no {mode}; running eager"
    return None


_POOL = None


def _graph_pool():
    """One memory pool for every captured step, as vLLM and nano-vllm keep one: graphs of several batch sizes then
    share their intermediate buffers instead of each holding its own."""
    global _POOL
    if _POOL is None:
        _POOL = torch.cuda.graph_pool_handle()
    return _POOL


def capture_graph(fn: Callable[[], object], device: torch.device, *, warm_up: Callable[[Callable], None],
                  reset: Callable[[], None] = lambda: None) -> Callable[[], None]:
    """Record `fn` once into a torch.cuda.CUDAGraph and return its replay, which launches all of it at once.

    `warm_up(fn)` runs it first on a side stream (lazy init and workspaces must not happen under capture), then
    `reset()` undoes what those runs wrote. The capture records kernels without running them, so nothing moves.
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        warm_up(fn)
    torch.cuda.current_stream(device).wait_stream(side)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=_graph_pool()):
        fn()
    replay = graph.replay             # a bound method: it keeps the graph (and its memory pool) alive
    return replay


def _device_bytes(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" and not fake_cuda.active() else None


class FastDecoder:
    """One cache and one decode-step runner for requests of a fixed batch size, up to max_len positions.

    Build it once and call generate() many times: the capture (or compile) is paid in __init__,
    reported as `setup_s`, and reused by every request. `fast_generate` builds one per call.
    """

    @torch.inference_mode()
    def __init__(self, model, batch_size: int = 1, max_len: int | None = None, *, mode: str = "auto",
                 cache_kind: str = "static", temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None):
        t0 = time.perf_counter()
        check_choice("mode", mode, RUNNERS)
        check_choice("cache_kind", cache_kind, CACHE_KINDS)
        check_sampling(temperature, top_k, top_p)
        self.model, self.graph_bytes = model, None
        param = next(model.parameters())
        self.device, cfg = param.device, model.config
        max_len = cfg.context_length if max_len is None else max_len
        make = StaticKVCache if cache_kind == "static" else KVCache
        self.cache = make(cfg, batch_size, max_len, device=self.device, dtype=param.dtype)
        self.batch_size, self.max_len, self.cache_kind = batch_size, max_len, cache_kind
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        # The step's inputs live in fixed buffers: a captured graph reads them at fixed addresses.
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)
        self.noise = (torch.ones(batch_size, cfg.vocab_size, device=self.device) if temperature > 0 else None)

        self.mode, self.fallback = _choose_mode(mode, model, cache_kind)
        self._run: Callable[[], None] = self.step
        self._build_runner()
        self._reset()
        self.setup_s = time.perf_counter() - t0

    # -- the step and its runners ----------------------------------------------------------------

    def _build_runner(self) -> None:
        """Capture (graph) or compile the step once, counting the device memory it keeps; eager needs nothing."""
        before = _device_bytes(self.device)
        if self.mode == "graph":
            self._try(self._capture_graph, "CUDA graph capture")
        elif self.mode == "compile":
            self._try(self._compile, "torch.compile")
        if before is not None and self.mode != "eager":
            self.graph_bytes = _device_bytes(self.device) - before
        if self.fallback:
            warnings.warn(f"fast decode: {self.fallback}", RuntimeWarning, stacklevel=4)

    def step(self) -> None:
        """One decode step in place: reads self.token, writes the cache, leaves the next token in self.token.

        It is loop.decode_step, generate()'s own step, unchecked (the request was checked once, in prefill); the
        graph and compile runners capture this very method, so every runner steps through the same code.
        """
        nxt = decode_step(self.model, self.token[:, 0], self.cache, check=False, noise=self.noise, **self.sampling)
        self.token.copy_(nxt[:, None])

    def _try(self, build: Callable[[], Callable[[], None]], what: str) -> None:
        try:
            self._run = build()
        except Exception as err:   # any failure to capture/compile: keep going, eager, and say why
            first = (str(err).strip().splitlines() or [""])[0][:200]
            self.fallback = f"{what} failed ({type(err).__name__}: {first}); running eager"
            self.mode, self._run = "eager", self.step
            self._reset()

    def _capture_graph(self) -> Callable[[], None]:
        """Record one decode step into a torch.cuda.CUDAGraph; replay() then launches all of it at once."""
        return capture_graph(self.step, self.device, warm_up=self._warm_up, reset=self._reset)

    def _compile(self) -> Callable[[], None]:
        """torch.compile the step; on CUDA, "reduce-overhead" also replays it as a CUDA graph."""
        c = self.cache                    # a StaticKVCache: _unavailable() refuses compile with a growing one
        for t in (c.k, c.v, c.pos, c._key_pos, self.token, *([self.noise] if self.noise is not None else [])):
            torch._dynamo.mark_static_address(t)   # fixed buffers: no copy into the graph's inputs per call
        compiled = torch.compile(fresh_function(self.step, "fast_decoder_step"), mode="reduce-overhead",
                                 fullgraph=True, dynamic=False)
        self._warm_up(compiled)           # compile, record, replay once: all before the request starts
        self._reset()
        return compiled

    def _warm_up(self, run: Callable[[], None]) -> None:
        """WARMUP_STEPS calls of `run`, never more than the cache has positions (see WARMUP_STEPS)."""
        for _ in range(min(WARMUP_STEPS, self.max_len)):
            run()

    def _reset(self) -> None:
        self.cache.reset()
        self.token.zero_()
        self._used = False

    # -- one request -------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, ids, max_new_tokens: int, *, seed: int | None = None,
                 on_token: Callable[[torch.Tensor], object] | None = None) -> FastGenerationResult:
        """Prefill, then decode; same result as decode.loop.generate (tokens [batch, new] on the CPU, host timestamps).

        `on_token(tokens)` receives each step's tokens [batch] on the CPU as soon as they are there,
        for streaming text. On CUDA it runs as the events say the copies landed, never blocking a step.
        """
        ids = check_request(self.model, ids, max_new_tokens, **self.sampling)
        B, T, n = ids.shape[0], ids.shape[1], int(max_new_tokens)
        if B > self.batch_size:
            raise ValueError(f"a batch of {B} prompts does not fit this decoder's batch_size={self.batch_size}; "
                             "build a FastDecoder for that batch size (or use decoder_for)")
        if B < self.batch_size:
            return self._generate_padded(ids, max_new_tokens, seed, on_token)
        if T + n > self.max_len:
            raise ValueError(f"prompt ({T}) + max_new_tokens ({n}) = {T + n} positions do not fit the cache's "
                             f"max_len={self.max_len}; build a FastDecoder with a larger max_len or ask for fewer")
        seed = None if seed is None else check_seed(seed)
        if on_token is not None and not callable(on_token):
            raise TypeError(f"on_token must be a function of one [batch] tensor, got {type(on_token).__name__}")
        if self._used:
            self._reset()                 # zeroing the cache belongs to setup, not to this request's clock
        self._used = True
        gen = None if seed is None or self.noise is None else fake_cuda.generator(self.device, seed)
        landing = _Landing(self.device, n, B, on_token)
        self._decode(ids, n, gen, landing)
        tokens, stamps = landing.finish()
        return FastGenerationResult(tokens, stamps, T, mode=self.mode, setup_s=self.setup_s,
                                    fallback=self.fallback, graph_bytes=self.graph_bytes)

    def _generate_padded(self, ids, max_new_tokens, seed, on_token) -> FastGenerationResult:
        """A smaller batch rides in this decoder's bucket: padded with copies of the first prompt, cut back after."""
        B = ids.shape[0]
        padded = torch.cat([ids, ids[:1].expand(self.batch_size - B, -1)])
        inner = None if on_token is None else (lambda tokens: on_token(tokens[:B]))
        result = self.generate(padded, max_new_tokens, seed=seed, on_token=inner)
        result.tokens = result.tokens[:B]
        return result

    def _decode(self, ids: torch.Tensor, n: int, gen, landing: "_Landing") -> None:
        """Prefill eagerly, then n - 1 steps through the runner; each step's tokens land as they come."""
        landing.start()
        self._draw(gen)
        # loop.prefill, eager: check_request has checked the ids and the sampling options, and the cache was built
        # here for this length, so only the logits are checked (NaN weights would otherwise give token 0 forever),
        # once per request
        first = prefill(self.model, ids, self.cache, check=False, noise=self.noise, **self.sampling)
        self.token.copy_(first[:, None])
        landing.land(0, self.token)
        for i in range(1, n):
            self._draw(gen)
            self._run()
            landing.land(i, self.token)

    def _draw(self, gen) -> None:
        """Fresh exponential noise for sampling on the device (greedy decoding has none)."""
        if self.noise is not None:
            self.noise.exponential_(generator=gen).clamp_min_(1e-30)   # E = 0 would divide by zero


def _resolve_auto(mode: str, model, cache_kind: str) -> str:
    """The mode "auto" stands for for this model; any other mode as it is."""
    if mode != "auto":
        return mode
    if next(model.parameters()).device.type != "cuda" or cache_kind != "static":
        # Eager: no CUDA graphs off CUDA, and inductor's compile takes longer on a CPU than a lesson's time
        # budget allows (time it with mode="compile").
        return "eager"
    # int8 weights: compiled, so each layer's int8-to-16-bit cast fuses into its matmul's loads and only int8 bytes
    # leave memory (gpt-fast's way); a graph of the eager ops would write a 16-bit copy of every weight each step.
    return "compile" if is_quantized(model) else "graph"


def _choose_mode(mode: str, model, cache_kind: str) -> tuple[str, str | None]:
    """(the mode that will run, why it fell back to eager or None)."""
    mode = _resolve_auto(mode, model, cache_kind)
    fallback = _unavailable(mode, next(model.parameters()).device, cache_kind)
    return ("eager" if fallback else mode), fallback


class _Landing:
    """Where each step's tokens go: a pinned host buffer, a timestamp per step, on_token as soon as they are there.

    On a CPU ops are synchronous, so the host clock is honest. On CUDA the copies are asynchronous: an event per
    step is recorded and read at the end, and on_token runs for the steps whose events say they landed, so no
    step waits for a copy.
    """

    def __init__(self, device: torch.device, n: int, batch: int, on_token):
        self.cuda, self.on_token, self.n = device.type == "cuda", on_token, n
        self.host = torch.empty((n, batch), dtype=torch.long, pin_memory=fake_cuda.pin_memory(self.cuda))  # row i: step i
        self.stamps: list[float] = []
        self.pending: list[int] = []
        if self.cuda:
            self.begin, self.events = fake_cuda.event(), [fake_cuda.event() for _ in range(n)]
            fake_cuda.synchronize(device)     # the GPU starts idle, so its clock and the host's agree

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if self.cuda:
            self.begin.record()               # the request's start on the device clock
            self.offset = time.perf_counter() - self.t0

    def land(self, i: int, token: torch.Tensor) -> None:
        """Step i's tokens are in `token` [batch, 1]: copy them out without waiting, stamp them."""
        self.host[i].copy_(token[:, 0], non_blocking=self.cuda)
        if not self.cuda:
            self.stamps.append(time.perf_counter() - self.t0)
            if self.on_token is not None:
                self.on_token(self.host[i])
            return
        self.events[i].record()
        if self.on_token is not None:
            self.pending.append(i)
            while self.pending and self.events[self.pending[0]].query():   # query() asks; it does not wait
                self.on_token(self.host[self.pending.pop(0)])

    def finish(self) -> tuple[torch.Tensor, list[float]]:
        """(tokens [batch, n] on the CPU, seconds from the request's start to each step's tokens)."""
        if self.cuda:
            for i in self.pending:
                self.events[i].synchronize()
                self.on_token(self.host[i])
            self.events[self.n - 1].synchronize()
            self.stamps = [self.offset + self.begin.elapsed_time(self.events[i]) / 1e3 for i in range(self.n)]
        return self.host.t().contiguous(), self.stamps


_FRESH = itertools.count()


def fresh_function(fn: Callable[[], object], name: str) -> Callable[[], object]:
    """A new function that calls fn(), with a code object of its own.

    dynamo keeps compiled graphs per code object, guarded by what the frame reads. Every FastDecoder's step is the
    same method, so compiling `decoder.step` for a second decoder guarded against the first one's tensors and
    recompiled, and the ninth decoder hit the recompile limit and ran eager. A code object per compile keeps each
    decoder's graph, and each check, apart.
    """
    def call():
        return fn()
    code = call.__code__.replace(co_name=f"{name}_{next(_FRESH)}")
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)


_HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


def _eager_without_host_reads(gm, example_inputs):
    """A dynamo backend that runs the traced graph as it is, after refusing any read back to the host."""
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target in _HOST_READS:
            raise RuntimeError(f"the step reads a device value on the host ({node.target}() in {node.stack_trace or node.name}); "
                               "a CUDA graph cannot replay that")
    return gm.forward


def check_graph_ready(step: Callable[[], object], steps: int = 4) -> None:
    """Raise if `step()` is not one static graph, a condition for CUDA-graph capture; checked on any device.

    dynamo traces the step (no compiler, about a second) with fullgraph=True, so a graph break
    raises; a read of a device value on the host (.item(), a Python branch on a tensor) raises;
    and error_on_recompile makes a shape or Python constant that changes between steps raise
    too, as a growing cache slice or a Python-int position would. Run it on a prefilled decoder:
    check_graph_ready(decoder.step). It leaves the step's effects (cache writes, tokens) in place.

    Passing is necessary for capture, not a proof of it. The trace does not see memory allocated
    outside the graph's private pool, a CPU tensor inside the step, or random-number generator
    state that a replay would have to advance. The capture itself on a GPU, and
    tests/test_fastgen.py comparing the graph path's tokens with eager's there, check the rest.
    """
    import torch._dynamo
    # A function of its own, so no torch._dynamo.reset(): a reset would throw away every compiled decoder in the
    # process (each later call of theirs then compiles again, or, past the recompile limit, silently runs eager).
    traced = torch.compile(fresh_function(step, "check_graph_ready"), fullgraph=True, dynamic=False,
                           backend=_eager_without_host_reads)
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(steps):
            traced()


def fast_generate(model, ids, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None, seed: int | None = None, mode: str = "auto",
                  cache_kind: str = "static", on_token: Callable[[torch.Tensor], object] | None = None
                  ) -> FastGenerationResult:
    """generate() without the overheads: same arguments, same GenerationResult, same greedy tokens.

    mode, one of RUNNERS: "eager", "graph" (CUDA graph of one decode step), "compile" (torch.compile,
    reduce-overhead) or "auto" (on CUDA the graph, or compile for int8 weights; eager elsewhere). Where the mode
    cannot run, it falls back to eager with a warning and says why in `result.fallback`. cache_kind="growing" uses
    lesson 06's KVCache (the "sync-free" stage). Setup (cache, capture, compile) is `result.setup_s`,
    outside the timestamps. For many requests of one shape, build a FastDecoder once instead.
    """
    check_choice("mode", mode, RUNNERS)
    check_choice("cache_kind", cache_kind, CACHE_KINDS)
    ids = check_request(model, ids, max_new_tokens, temperature, top_k, top_p)   # before any allocation
    B, need = ids.shape[0], ids.shape[1] + int(max_new_tokens)
    mode = _resolve_auto(mode, model, cache_kind)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    if mode == "eager":                   # cheap to build: one per call, at exactly this shape
        decoder = FastDecoder(model, B, need, mode=mode, cache_kind=cache_kind, **sampling)
        return decoder.generate(ids, max_new_tokens, seed=seed, on_token=on_token)
    # A captured or compiled decoder is costly to make: keep it, at bucketed shapes, for the next request.
    return decoder_for(model, B, need, mode=mode, cache_kind=cache_kind, **sampling).generate(
        ids, max_new_tokens, seed=seed, on_token=on_token)


MAX_DECODERS = 4          # captured decoders kept by decoder_for: each holds a cache (and a graph) in device memory
_DECODERS: "dict[tuple, FastDecoder]" = {}


def bucket(n: int, smallest: int = 1) -> int:
    """The power of two at or above n (and at least `smallest`): the shapes graphs are captured at."""
    return max(smallest, 1 << max(0, int(n) - 1).bit_length())


def decoder_for(model, batch: int, max_len: int, *, mode: str, cache_kind: str = "static", temperature: float = 0.0,
                top_k: int | None = None, top_p: float | None = None) -> FastDecoder:
    """A FastDecoder for at least `batch` sequences of `max_len` positions, from a small cache keyed by
    (model, batch bucket, max_len bucket, dtype, mode, sampling): a shape seen before is never captured or
    compiled again. Batches round up to 1, 2, 4, 8, ...; lengths to a power of two from 64, within the context."""
    param = next(model.parameters())
    length = min(bucket(max_len, 64), model.config.context_length)
    key = (id(model), bucket(batch), length, param.dtype, param.device, mode, cache_kind, temperature, top_k, top_p)
    if key in _DECODERS:
        _DECODERS[key] = _DECODERS.pop(key)          # most recently used last
        return _DECODERS[key]
    while len(_DECODERS) >= MAX_DECODERS:
        _DECODERS.pop(next(iter(_DECODERS)))
    _DECODERS[key] = FastDecoder(model, bucket(batch), length, mode=mode, cache_kind=cache_kind,
                                 temperature=temperature, top_k=top_k, top_p=top_p)
    return _DECODERS[key]


__all__ = ["CACHE_KINDS", "RUNNERS", "STAGES", "FastDecoder", "FastGenerationResult", "bucket", "capture_graph",
           "check_graph_ready", "decoder_for", "fast_generate", "fresh_function"]
