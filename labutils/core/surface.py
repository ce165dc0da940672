"""A part's public surface, loaded on first use: the short names lessons import, each from the module that owns it.

core, text and perf use it because some of their modules also run as commands (`python -m labutils.perf.quiet`,
`python -m labutils.text.tokenizer`). A package that imported its modules up front would already hold the one
about to run as __main__ (Python warns that it runs a second copy), and the busy-machine check would load torch.
The parts above keep plain imports: some of their modules share a name with a function they export
(`widgets.quiz`), and loading that module would put it where the function should be.
"""
from __future__ import annotations

import importlib
import sys


def lazy_surface(package: str, surface: dict[str, list[str]]):
    """(__getattr__, __dir__, __all__) for `package`: each name in `surface` ({module: [names]}) is imported from
    its module the first time someone asks for it, then kept in the package like a plain import would."""
    where = {name: module for module, names in surface.items() for name in names}

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__, sorted(where)
