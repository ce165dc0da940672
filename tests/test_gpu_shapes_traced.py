"""The lessons that ask `shape_for` run top to bottom on a GPU shape, on emulated CUDA (core.emulated_cuda).

On a GPU, `shape_for` hands a lesson a Llama shape in bf16 instead of gpt2-small in fp32: rotary positions, RMSNorm,
SwiGLU, grouped KV heads, no position table, a 16-bit dtype, CUDA tensors, the graph loop's path. A lesson whose
cells assume GPT-2 (a position table to extend, a fp32 dtype, a CPU tensor beside a CUDA one) breaks only there.
Emulated CUDA keeps real values on the CPU and applies CUDA's device rules, so those mistakes surface here; a
7B model would take hours on a CPU, so the test registers a Llama shape of the same family at toy width and makes it
the only GPU shape. The timings mean nothing (every op runs through Python), so the test checks that every cell ran,
no cell raised, and the lesson chose the GPU shape in bf16; claims may print any verdict. For the same reason the
lessons run two at a time, each kernel on one torch thread.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from labutils import gpu_check
from labutils.core.paths import SOURCE_ROOT

from kernel_preludes import ONE_RUN_A_BUDGET, ONE_SAMPLE

NOTEBOOKS = SOURCE_ROOT / "notebooks"

# Run first in the lesson's kernel: two toy shapes of the Llama family, the only ones shape_for may pick on a GPU.
REGISTER_TOY_LLAMAS = '''
import dataclasses
import labutils.model.presets as presets, labutils.perf.shape_choice as shape_choice
from labutils.model.gpt import GPTConfig
for name, layers in (("llama-toy", 2), ("llama-toy-2", 4)):
    presets.PRESETS[name] = dataclasses.replace(presets.PRESETS["llama-3.2-1b"], name=name, n_layer=layers, n_head=4,
                                                n_kv_head=2, n_embd=128, n_inner=256, vocab_size=512, n_params=0)
    presets.PRESETS[name] = dataclasses.replace(presets.PRESETS[name], n_params=GPTConfig.preset(name).num_params())
shape_choice.GPU_SHAPES = ("llama-toy",)
shape_choice.LADDERS = (("llama-toy", "llama-toy-2"),)
# Here a probe's size only costs: 16 MiB buffers for the copy probe and the GEMV sweep (a GPU's are 1 GiB, which a CPU
# multiplies in bf16 for minutes) reach every path; and a time means nothing (ONE_SAMPLE).
import labutils.perf.probes as probes
probes.default_copy_bytes = lambda device=None: 16 << 20
''' + ONE_SAMPLE


# A lesson, and the parts of it that ask shape_for: (first heading, heading it ends before), None for the start or the
# end. Lesson 08's aside on graph readiness runs dynamo, which does not trace under the emulation's modes (a real GPU
# runs it in make gpu-check); the rest of the lesson, its ladder at the GPU shape included, runs here. Lesson 09's
# sections 2 to 4 serve the trained tiny model on any device, and section 6 on asks a real vLLM server: section 1
# (decode against batch) and section 5 (prefix caching) ask shape_for. Lesson 10's trained draft and target run on
# any device; its verify passes at the size a GPU needs ask shape_for. Lesson 11's sections 2 and 3 ask it (the
# stall and the budget sweep), and section 5 simulates disaggregation on section 3's shape; section 4 reads their
# results, and section 6 asks vLLM.
LESSONS = [("05_prefill_decode.ipynb", [(None, None)]), ("06_kv_cache.ipynb", [(None, None)]),
           ("07_memory_wall.ipynb", [(None, None)]),
           ("08_fast_decode.ipynb", [(None, "## Aside: is the step"), ("## Aside: a CPU lever", "## Checkpoint")]),
           ("09_serving.ipynb", [(None, "## 2."), ("## 5.", "## 6.")]),
           ("10_speculative_decoding.ipynb", [(None, "## 1."), ("### The same passes", "### Aside")]),
           ("11_two_phases.ipynb", [(None, "## 4."), ("## 5.", "## 6.")])]
# Run after REGISTER_TOY_LLAMAS in a lesson's kernel. Lesson 05 doubles its baseline prompt until a roof sets its
# prefill: here, where every op runs through Python, none ever does, and 4,096 + 8,192-token prefills would take
# minutes; 512 reaches the same path. Lesson 11's budget sweep serves 32 requests under 6 budgets
# and whole prompts, 3 times each, to pick a median run on the real clock; its claims read only the smallest budget
# and the whole prompts. Here every op runs through Python and the timings mean nothing, so one run of each of those
# two reaches every path, and each of its workloads (24 or 32 requests for a steady rate) serves its first 8: a
# full batch, so the same chunked, mixed and disaggregated paths.
FASTER = {"05_prefill_decode.ipynb": """
import functools, labutils.measure as measure
measure.compute_bound_prompt = functools.partial(measure.compute_bound_prompt, longest=512)
""", "11_two_phases.ipynb": ONE_RUN_A_BUDGET + """
_one_run = interference.budget_sweep
interference.budget_sweep = lambda model, wl, budgets, *args, **kw: _one_run(model, wl, budgets[:1], *args, **kw)
import labutils.serving as serving
_make_workload = serving.make_workload
serving.make_workload = lambda n_requests, **kw: _make_workload(min(n_requests, 8), **kw)
"""}


def heading_at(cells, heading: str | None, lesson: str, default: int) -> int:
    if heading is None:
        return default
    found = [i for i, c in enumerate(cells) if f"\n{heading}" in f"\n{c.source}"]
    assert found, f"{lesson} has no heading {heading!r}: update LESSONS in this test"
    return found[0]


def run_on_gpu_shape(lesson: str, parts, out: Path) -> Path:
    """Run a lesson's parts in a kernel of its own on emulated CUDA, with its own peaks cache (emulated peaks stay out
    of the learner's cache); return the executed copy written into `out`."""
    nb = nbformat.read(NOTEBOOKS / lesson, as_version=4)
    cells = nb.cells
    nb.cells = [c for start, end in parts
                for c in cells[heading_at(cells, start, lesson, 0):heading_at(cells, end, lesson, len(cells))]]
    nb.cells.insert(0, nbformat.v4.new_code_cell(REGISTER_TOY_LLAMAS + FASTER.get(lesson, "")))
    client = NotebookClient(nb, timeout=600, kernel_name=gpu_check.KERNEL, allow_errors=True,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    # One torch thread: two kernels share the two cores, and two threads each would stall every op (8 min, not 2.5).
    client.execute(env=dict(os.environ, LABUTILS_EMULATE_CUDA="1", LABUTILS_CACHE_DIR=str(out), OMP_NUM_THREADS="1"))
    nbformat.write(nb, out / lesson)
    return out / lesson


@pytest.fixture(scope="module")
def traced(request, tmp_path_factory):
    """The lessons this run selected, two kernels at a time. Emulated CUDA sends every op of a toy shape through
    Python, so each kernel keeps one core busy and two halve the wait; nothing here is timed that a test reads."""
    chosen = {item.callspec.params["lesson"] for item in request.session.items       # nbval's cells are items too
              if isinstance(item, pytest.Function) and item.originalname == "test_a_lesson_runs_on_its_gpu_shape"}
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {lesson: pool.submit(run_on_gpu_shape, lesson, parts, tmp_path_factory.mktemp(lesson[:2]))
               for lesson, parts in LESSONS if lesson in chosen}


@pytest.mark.parametrize("lesson", [lesson for lesson, _ in LESSONS])
def test_a_lesson_runs_on_its_gpu_shape(lesson, traced):
    path = traced[lesson].result()
    nb = nbformat.read(path, as_version=4)
    summary = gpu_check.lesson_summary(nb)
    assert summary["errors"] == [], f"{lesson} on a GPU shape (kept in {path})"
    assert summary["ran"] == summary["cells"]
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                      if o.get("output_type") == "stream")
    assert "llama-toy in bf16: the largest of llama-toy whose weights" in printed      # the lesson's choice line
