"""labutils: the tested code behind the Prefill & Decode Lab notebooks.

The parts follow the course, bottom to top (LAYERS); each imports only from its own part and those below it:
  core      argument parsing, the dtype table, devices, data/, progress bars, fake and emulated CUDA
  text      tokenizer, streaming detokenizer, corpus                      (lessons 01)
  model     GPT, presets, attention kernels, checkpoints, loss            (02-04)
  perf      timers, busy check, probes, datasheets, peaks, roofline counts (00, 07)
  decode    prefill/decode_step, KV caches, fast loop, speculative, int8  (05-08, 10)
  serving   the engine, paged cache, scheduler, workloads, vLLM client    (09, 11)
  measure   the lessons' experiments and claims that check themselves
  figures   plotly figures shared by lessons and widgets
  widgets   thin ipywidgets views
The top-level modules are the course's commands: `python -m labutils.bench | labutils.train | labutils.gpu_table |
labutils.gpu_check`.
"""
from __future__ import annotations

__version__ = "0.1.0"

LAYERS = ("core", "text", "model", "perf", "decode", "serving", "measure", "figures", "widgets")

# JupyterLab breaks printed lines anywhere (`word-break: break-all` on outputs' <pre>), so a long claim wrapped
# mid-word ("matm" / "ul"). The lesson's page wraps its printed lines at spaces instead, and breaks inside a word
# only where the word alone is wider than the column.
PAGE_STYLE = "<style>.jp-OutputArea-output pre {word-break: normal; overflow-wrap: anywhere}</style>"


def setup_notebook(seed: int = 0):
    """First cell of every lesson: seed every random source, keep plots light, wrap printed lines at spaces.

    Plotly's default notebook renderer embeds all of plotly.js in each output; the mimetype
    renderer stores only the figure JSON, which JupyterLab's bundled plotly extension draws.
    Returns the device the lesson will measure on.
    """
    import random

    import numpy as np
    import plotly.io as pio
    import torch

    from labutils.core.devices import pick_device
    from labutils.core.emulated_cuda import enter_if_asked
    from labutils.core.validate import check_count

    # numpy's legacy seed takes 0 .. 2**32 - 1: refuse anything else by name, before anything is seeded
    seed = check_count("seed", seed, 0, 2 ** 32 - 1, hint="any whole number from 0 to 2**32 - 1")
    pio.renderers.default = "plotly_mimetype"
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    enter_if_asked()        # LABUTILS_EMULATE_CUDA=1: this lesson runs on emulated CUDA (gpu_check --dry-run)
    from labutils.core.progress_bar import in_notebook
    if in_notebook():
        from IPython.display import HTML, display
        display(HTML(PAGE_STYLE))
    return pick_device()
