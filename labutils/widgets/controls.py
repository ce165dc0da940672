"""Sliders that refuse a value outside their range, by name, instead of clamping it without a word."""
from __future__ import annotations

import ipywidgets as w
from traitlets import validate


class IntSlider(w.IntSlider):
    """ipywidgets' IntSlider, except that a value outside [min, max] is refused with a ValueError that names the
    argument and the range, whether it comes to the constructor or is set from code later (`view.batch.value = 500`).
    ipywidgets itself would clamp it to the nearest end and show a setting nobody asked for."""

    _ready = False      # ipywidgets sets value, min and max in any order while it builds: judge only after that

    def __init__(self, *, name: str, value: int, **kwargs):
        self.name = name
        super().__init__(value=value, **kwargs)
        self._ready = True
        if self.value != value:                     # built: now the range is known, and ipywidgets moved the value
            self._refuse(value)

    @validate("value")
    def _validate_value(self, proposal):
        value = proposal["value"]
        if self._ready and not self.min <= value <= self.max:
            self._refuse(value)
        return super()._validate_value(proposal)

    def _refuse(self, value) -> None:
        raise ValueError(f"{self.name}={value!r} is outside the slider's range {self.min} to {self.max}; "
                         "choose a value in that range")
