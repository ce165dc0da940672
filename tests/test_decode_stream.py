"""The decode stream widget: text grows token by token, split characters wait for their last byte, pace shown."""
import pytest
import torch

from labutils.decode.fastgen import fast_generate
from labutils.model.checkpoints import load_pretrained
from labutils.text.tokenizer import get_encoding
from labutils.widgets import DecodeStream, decode_stream


def feed(view, ids, row=0, batch=1):
    for tid in ids:
        step = torch.zeros(batch, dtype=torch.long)
        step[row] = tid
        view.on_token(step)


def test_text_grows_with_each_token_and_split_characters_wait():
    enc = get_encoding("course")
    text = "Return the \u6771 value"          # a 4k vocabulary splits this character into byte tokens
    ids = enc.encode(text)
    view = decode_stream(enc, "Prompt: ")
    assert view.shown == "Prompt: " and "waiting" in view.status.value
    seen = []
    for tid in ids:
        view.on_token(torch.tensor([tid]))
        seen.append(view.shown)
    assert view.text == view.shown == "Prompt: " + text
    assert view.ids == ids and "\ufffd" not in "".join(seen)     # never a half character on screen
    cut = DecodeStream(enc)
    feed(cut, ids[:-3])                     # stopped inside the character: the text says so, as decode does
    assert cut.text == enc.decode(ids[:-3]) and cut.shown == cut.text.rstrip("\ufffd")
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))   # it only grows
    assert f"{len(ids)} tokens" in view.status.value and "tokens/s" in view.status.value


def test_row_picks_one_sequence_of_a_batch_and_reset_starts_over():
    enc = get_encoding("course")
    view = DecodeStream(enc, row=1)
    feed(view, enc.encode(" hello"), row=1, batch=3)
    assert view.generated == " hello"
    view.reset("again:")
    assert view.text == "again:" and view.ids == []


def test_streams_a_real_decode_loop():
    model, enc = load_pretrained()
    prompt = "The function returns"
    ids = torch.tensor([enc.encode(prompt)])
    view = decode_stream(enc, prompt)
    res = fast_generate(model, ids, 12, on_token=view.on_token)
    assert view.ids == res.tokens[0].tolist()
    assert view.text == prompt + enc.decode(res.tokens[0].tolist())


def test_bad_input():
    with pytest.raises(TypeError, match="tiktoken.Encoding"):
        DecodeStream("course")
    enc = get_encoding("course")
    with pytest.raises(ValueError, match=r"99999.*course has ids 0\.\.4095"):
        DecodeStream(enc).on_token(torch.tensor([99999]))


def test_the_box_keeps_the_newest_text_in_view_in_normal_colour():
    from labutils.widgets.decode_stream import box_html
    page = box_html("a < b & c\n" * 50)
    assert "flex-direction:column-reverse" in page and "overflow-y:auto" in page     # anchored at its end
    assert "a &lt; b &amp; c" in page and "disabled" not in page and "color:inherit" in page
