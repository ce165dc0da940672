"""Token viewer: type text, see it split into coloured tokens with their ids, live."""
from __future__ import annotations

import html

import ipywidgets as w
import tiktoken

from labutils.text.tokenizer import ENCODING_NAMES, as_encoding, encode, get_encoding

PALETTE = ("#ffd6a5", "#caffbf", "#9bf6ff", "#bdb2ff", "#ffc6ff", "#fdffb6", "#a0c4ff", "#ffadad")
MAX_TOKENS_SHOWN = 3000  # beyond this the browser, not the tokenizer, becomes the slow part


def token_label(token: bytes) -> str:
    """A token's text as shown in the viewer: visible whitespace; bytes that are not whole
    UTF-8 characters (a character split across tokens) written as \\xe3 escapes."""
    text = token.decode("utf-8", errors="backslashreplace")
    return text.replace(" ", "\u00b7").replace("\t", "\u2192").replace("\r", "\u240d").replace("\n", "\u21b5\n")


def render_tokens(enc: tiktoken.Encoding | str, text: str) -> str:
    """HTML for text split by enc: one coloured span per token (its id in the tooltip and below), plus counts."""
    enc = as_encoding(enc)
    ids = encode(enc, text)
    spans = []
    for i, tid in enumerate(ids[:MAX_TOKENS_SHOWN]):
        label = html.escape(token_label(enc.decode_single_token_bytes(tid)))
        spans.append(f'<span title="id {tid}" style="background:{PALETTE[i % len(PALETTE)]};'
                     f'border-radius:3px;padding:0 1px;margin-right:1px">{label}</span>')
    more = len(ids) - MAX_TOKENS_SHOWN
    if more > 0:
        spans.append(f"<i> \u2026 and {more} more tokens</i>")
    shown_ids = ", ".join(map(str, ids[:MAX_TOKENS_SHOWN])) + (", \u2026" if more > 0 else "")
    ratio = f"{len(text) / len(ids):.2f}" if ids else "\u2013"
    counts = (f'<div class="token-counts"><b>{len(text)}</b> characters \u00b7 '
              f'<b>{len(ids)}</b> tokens \u00b7 <b>{ratio}</b> characters/token '
              f'({html.escape(enc.name)}, vocabulary {enc.n_vocab:,})</div>')
    # ipywidgets' HTML sets white-space: nowrap, and a token shows its spaces as "·", so a paragraph has no break
    # opportunity at all: both blocks wrap anywhere, or a pasted paragraph becomes one line thousands of pixels wide.
    wrap = "white-space:pre-wrap;overflow-wrap:anywhere;word-break:break-all;max-width:100%"
    return (f'{counts}<div class="token-spans" style="font-family:monospace;{wrap};line-height:1.8">{"".join(spans)}'
            f'</div><div class="token-ids" style="font-family:monospace;font-size:85%;color:#555;{wrap}">'
            f'[{shown_ids}]</div>')


class TokenViewer(w.VBox):
    """A Textarea, an encoding picker and the rendered tokens, re-rendered on every keystroke."""

    def __init__(self, encoding: tiktoken.Encoding | str = "cl100k_base", text: str = ""):
        enc = as_encoding(encoding)
        self.encodings = {name: None for name in ENCODING_NAMES}
        self.encodings[enc.name] = enc
        self.picker = w.Dropdown(options=list(self.encodings), value=enc.name, description="encoding")
        self.textarea = w.Textarea(value=text, continuous_update=True, placeholder="Type here",
                                   layout=w.Layout(width="100%", height="8em"))
        self.html = w.HTML()
        super().__init__([self.picker, self.textarea, self.html])
        self.textarea.observe(self._update, names="value")
        self.picker.observe(self._update, names="value")
        self._update()

    @property
    def encoding(self) -> tiktoken.Encoding:
        name = self.picker.value
        if self.encodings[name] is None:
            self.encodings[name] = get_encoding(name)
        return self.encodings[name]

    def _update(self, change=None):
        try:
            self.html.value = render_tokens(self.encoding, self.textarea.value)
        except Exception as err:  # show the problem in the widget; an observer must never kill the kernel
            self.html.value = f'<span style="color:#b00">{html.escape(str(err))}</span>'


def token_viewer(encoding: tiktoken.Encoding | str = "cl100k_base",
                 text: str = "Tokenizers split text into pieces. 東京は晴れ 🙂\n    return x + 12345") -> TokenViewer:
    """The token viewer widget; display it as the last line of a cell."""
    return TokenViewer(encoding, text)
