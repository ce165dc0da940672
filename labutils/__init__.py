"""labutils: the tested code behind the Prefill & Decode Lab notebooks."""
from __future__ import annotations

__version__ = "0.1.0"


def setup_notebook(seed: int = 0):
    """First cell of every lesson: seed every random source and keep plots light.

    Plotly's default notebook renderer embeds all of plotly.js in each output; the mimetype
    renderer stores only the figure JSON, which JupyterLab's bundled plotly extension draws.
    Returns the device the lesson will measure on.
    """
    import random

    import numpy as np
    import plotly.io as pio
    import torch

    from .hardware import pick_device
    from .validate import check_count

    # numpy's legacy seed takes 0 .. 2**32 - 1: refuse anything else by name, before anything is seeded
    seed = check_count("seed", seed, 0, 2 ** 32 - 1, hint="any whole number from 0 to 2**32 - 1")
    pio.renderers.default = "plotly_mimetype"
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return pick_device()
