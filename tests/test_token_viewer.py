"""The token viewer: render_tokens as a plain function, and the widget driven headlessly."""
import re

from labutils.text.tokenizer import get_encoding
from labutils.widgets import token_viewer
from labutils.widgets.token_viewer import MAX_TOKENS_SHOWN, render_tokens, token_label


def n_spans(html):
    return len(re.findall(r'<span title="id \d+"', html))


def test_render_counts_and_ids():
    enc = get_encoding("cl100k_base")
    out = render_tokens(enc, "hello world")
    assert "<b>11</b> characters" in out and "<b>2</b> tokens" in out and "<b>5.50</b>" in out
    assert 'title="id 15339"' in out and 'title="id 1917"' in out
    assert "[15339, 1917]" in out
    assert n_spans(out) == 2


def test_render_escapes_html_and_shows_whitespace():
    out = render_tokens("cl100k_base", "<script>alert(1)</script>\n\tx y")
    assert "<script" not in out and "&lt;script" in out and "&gt;alert" in out
    assert "\u21b5" in out and "\u2192" in out and "\u00b7" in out


def test_split_character_shown_as_bytes():
    enc = get_encoding("course")  # a 4k vocabulary has no token for this character
    ids = enc.encode("\u6771")  # 東 = e6 9d b1
    assert len(ids) > 1
    out = render_tokens(enc, "\u6771")
    assert "\\xe6" in out
    assert token_label(b"\xe6\x9d") == "\\xe6\\x9d"
    assert token_label("\u6771".encode()) == "\u6771"


def test_empty_and_long_text():
    assert "<b>0</b> tokens" in render_tokens("course", "")
    out = render_tokens("course", "a b " * 4000)
    assert n_spans(out) == MAX_TOKENS_SHOWN and "more tokens" in out


def test_widget_updates_on_every_keystroke():
    viewer = token_viewer("cl100k_base", text="hi")
    assert viewer.textarea.continuous_update
    before = viewer.html.value
    viewer.textarea.value = "hello world, hello tokens"
    after = viewer.html.value
    assert after != before
    n = len(get_encoding("cl100k_base").encode("hello world, hello tokens"))
    assert f"<b>{n}</b> tokens" in after and n_spans(after) == n
    viewer.picker.value = "course"
    m = len(get_encoding("course").encode("hello world, hello tokens"))
    assert f"<b>{m}</b> tokens" in viewer.html.value and "course" in viewer.html.value


def test_widget_accepts_an_encoding_object():
    from labutils.text.tokenizer import train_bpe
    enc = train_bpe("aaaa bbbb aaaa", 260, name="mini")
    viewer = token_viewer(enc, text="aaaa")
    assert viewer.picker.value == "mini"
    assert "mini" in viewer.html.value
