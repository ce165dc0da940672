"""Prepacked linears: same outputs as nn.Linear, rows independent of how many there are, same greedy tokens."""
import copy

import pytest
import torch

from labutils.decode.loop import generate
from labutils.model.gpt import GPT, GPTConfig
from labutils.decode.prepack import PackedLinear, prepack_linears, prepack_unavailable
from labutils.decode.speculative import speculative_generate

pytestmark = pytest.mark.skipif(prepack_unavailable(torch.nn.Linear(2, 2)) is not None,
                                reason="no oneDNN in this PyTorch build")


def small_gpt(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=97, context_length=64, n_layer=2, n_head=4, n_embd=32)
    return GPT(GPTConfig(**{**cfg, **kw})).eval()


def test_every_linear_is_packed_and_outputs_match():
    model = small_gpt()
    packed = prepack_linears(copy.deepcopy(model))
    kinds = {type(m).__name__ for m in packed.modules()}
    assert "Linear" not in kinds and "PackedLinear" in kinds
    assert packed.lm_head.weight is packed.tok_emb.weight          # the tie survives
    ids = torch.randint(0, 97, (2, 40))
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids), model(ids), rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in packed.parameters()) == model.num_params()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_is_bit_identical_whatever_the_number_of_rows(threads):
    # What the bench's identical-tokens assertion on a prepacked model rests on, checked on this machine.
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(1)
        layer = PackedLinear(torch.nn.Linear(256, 768))
        x = torch.randn(70, 256)
        with torch.inference_mode():
            one_by_one = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
            for rows in (2, 3, 5, 8, 9, 17, 64, 70):
                assert torch.equal(layer(x[:rows]), one_by_one[:rows]), rows
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculative_on_prepacked_models_equals_their_greedy_generate(k):
    target = prepack_linears(small_gpt(0))
    draft = prepack_linears(small_gpt(1, n_layer=1, n_embd=16, n_head=2))
    for length in (1, 7, 40):
        ids = torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(length))
        want = generate(target, ids, 64 - length).tokens
        assert torch.equal(speculative_generate(target, draft, ids, 64 - length, k=k).tokens, want)


def test_refusals_name_the_reason():
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        prepack_linears(small_gpt().to(torch.float64))
    with pytest.raises(TypeError, match="batch_hint"):
        prepack_linears(small_gpt(), batch_hint=2.5)
