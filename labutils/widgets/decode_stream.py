"""Decode stream: generated text that grows in the notebook as each token reaches the host."""
from __future__ import annotations

import html
import time

import ipywidgets as w
import tiktoken
import torch

from labutils.text.detokenize import StreamDecoder
from labutils.core.validate import check_count, describe


# A box of fixed height whose content is laid out bottom-up (flex column-reverse): the browser keeps such a box
# scrolled to its end, so the newest text stays in view as it grows, with no script. A disabled Textarea, the
# obvious choice, greys its text out and stays scrolled to the top, so after a few lines the stream looks frozen.
BOX = ("height:10em;overflow-y:auto;display:flex;flex-direction:column-reverse;border:1px solid #ccc;"
       "padding:4px 6px;font-family:monospace;color:inherit")


def box_html(text: str) -> str:
    """The stream's text, escaped, in the bottom-anchored box."""
    return (f'<div class="decode-stream" style="{BOX}"><div style="white-space:pre-wrap;overflow-wrap:anywhere">'
            f'{html.escape(text)}</div></div>')


class DecodeStream(w.VBox):
    """A text box that keeps its newest line in view, and a status line; pass `on_token` to fast_generate.

    Tokens arrive as ids; a character can span several byte-level tokens, so they go through lesson
    01's StreamDecoder, which holds back an unfinished character instead of printing garbage.
    """

    def __init__(self, enc: tiktoken.Encoding, prompt: str = "", row: int = 0):
        if not isinstance(enc, tiktoken.Encoding):
            raise TypeError(f"enc must be a tiktoken.Encoding (labutils.text.tokenizer.get_encoding), got {type(enc).__name__}")
        self.enc, self.row = enc, check_count("row", row, 0)
        self.area = w.HTML(layout=w.Layout(width="100%"))
        self.status = w.HTML()
        super().__init__([self.area, self.status])
        self.reset(prompt)

    def reset(self, prompt: str = "") -> None:
        """Start over with `prompt` shown and no generated tokens."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be text (a str), got {describe(prompt)}")
        self.prompt, self.ids, self.generated = prompt, [], ""
        self._stream = StreamDecoder(self.enc)
        self._t0: float | None = None
        self._show(prompt)
        self.status.value = "waiting for the first token"

    def _show(self, text: str) -> None:
        self.shown = text                     # what the box holds, as plain text
        self.area.value = box_html(text)

    @property
    def text(self) -> str:
        """Prompt and generated text as enc.decode gives it: a character cut off at the end shows as U+FFFD."""
        return self.prompt + self.generated + self._stream.pending.decode("utf-8", errors="replace")

    def on_token(self, tokens: torch.Tensor) -> None:
        """One step's tokens [batch] on the host: append row `row`'s token and show the pace so far."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or not self.row < tokens.shape[0]:
            got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else describe(tokens)
            raise ValueError(f"tokens must be one step's token ids [batch] with batch > row={self.row}, got {got}; "
                             "pass DecodeStream.on_token as fast_generate's on_token")
        tid = int(tokens[self.row])
        piece = self._stream.push(tid)        # checks the id against the encoding first
        now = time.perf_counter()
        self._t0 = now if self._t0 is None else self._t0
        self.ids.append(tid)
        self.generated += piece
        self._show(self.prompt + self.generated)
        n = len(self.ids)
        pace = f", {(n - 1) / (now - self._t0):,.0f} tokens/s since the first" if n > 1 and now > self._t0 else ""
        self.status.value = html.escape(f"{n} tokens{pace}")


def decode_stream(enc: tiktoken.Encoding, prompt: str = "") -> DecodeStream:
    """A DecodeStream showing `prompt`: display it, then pass its on_token to the decode loop."""
    return DecodeStream(enc, prompt)
