"""The trainer: determinism, learning, the baselines, and the committed tiny checkpoint."""
from __future__ import annotations

import json
import math

import pytest
import torch

from labutils import train as tr
from labutils.text.corpus import load_docstrings
from labutils.model.checkpoints import DATA_DIR, load_pretrained
from labutils.model.gpt import GPT, GPTConfig

SMALL = GPTConfig(vocab_size=64, context_length=32, n_layer=1, n_head=2, n_embd=32)
MB = 1024 * 1024


def pattern(n_repeats: int = 20) -> torch.Tensor:
    """A short fixed token sequence, repeated: easy to learn, so the loss must fall."""
    base = torch.arange(0, 64, 3) % 64
    return base.repeat(n_repeats)


@pytest.fixture(scope="module")
def course_split():
    return tr.course_tokens()


def test_same_seed_gives_bitwise_identical_weights():
    tokens = torch.randint(0, 64, (500,), generator=torch.Generator().manual_seed(1))
    a, losses_a = tr.train(SMALL, 5, 4, tokens, seed=3, show_progress=False)
    b, losses_b = tr.train(SMALL, 5, 4, tokens, seed=3, show_progress=False)
    c, _ = tr.train(SMALL, 5, 4, tokens, seed=4, show_progress=False)
    assert losses_a == losses_b
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)   # the seed matters, so the check can fail


def test_train_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tr.train(SMALL, 2, 2, pattern(), show_progress=False)
    assert torch.equal(torch.rand(3), expected)


def test_loss_decreases_on_a_repeated_slice():
    calls = []
    model, losses = tr.train(SMALL, 30, 8, pattern(), seq_len=16, lr=1e-2, warmup=3,
                             progress=lambda step, loss: calls.append(step), show_progress=False)
    assert calls == list(range(30))
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert not model.training


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    lrs = [tr.lr_at(s, 100, 1.0, 10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert max(lrs) == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))        # monotone after warm-up
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_unigram_loss_matches_a_hand_count():
    train = torch.tensor([0, 0, 0, 1])                  # with add-one over V=3: p = 4/7, 2/7, 1/7
    held = torch.tensor([0, 1, 2])
    want = -(math.log(4 / 7) + math.log(2 / 7) + math.log(1 / 7)) / 3
    assert tr.unigram_loss(train, held, 3) == pytest.approx(want)


def test_heldout_loss_of_an_untrained_model_is_near_log_vocab():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(SMALL)
    tokens = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(0))
    assert tr.heldout_loss(model, tokens) == pytest.approx(math.log(64), abs=0.2)
    with pytest.raises(ValueError, match="need more than"):
        tr.heldout_loss(model, tokens[:10])


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=0), "steps"),
    (dict(batch_size=-1), "batch_size"),
    (dict(seq_len=64), "context_length"),
    (dict(tokens=torch.arange(10)), "need more than"),
    (dict(tokens=torch.arange(100)), "outside vocab_size"),
])
def test_bad_arguments_get_clear_errors(kwargs, match):
    args = dict(config=SMALL, steps=2, batch_size=2, tokens=pattern(), show_progress=False) | kwargs
    with pytest.raises(ValueError, match=match):
        tr.train(**args)


def test_course_tokens_end_every_docstring_with_endoftext(course_split):
    train_ids, held_ids = course_split
    docs = load_docstrings()
    eot = 4095
    assert int((train_ids == eot).sum()) + int((held_ids == eot).sum()) == len(docs)
    assert train_ids[-1] == eot and held_ids[-1] == eot
    assert 0.05 < len(held_ids) / (len(train_ids) + len(held_ids)) < 0.2


def test_pretrained_checkpoint_beats_the_unigram_baseline(course_split):
    model, enc = load_pretrained()
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    assert model.config == GPTConfig.preset("tiny")
    assert model.num_params() == GPTConfig.preset("tiny").num_params()
    train_ids, held_ids = course_split
    held = tr.heldout_loss(model, held_ids[:4097])
    unigram = tr.unigram_loss(train_ids, held_ids[:4097], enc.n_vocab)
    assert held < unigram - 0.5, (held, unigram)


def test_committed_checkpoint_files_are_small_and_match_metrics():
    tiny = DATA_DIR / "tiny"
    for name in ("config.json", "model.pt", "metrics.json"):
        assert (tiny / name).stat().st_size < 20 * MB
    total = sum(p.stat().st_size for p in DATA_DIR.rglob("*") if p.is_file())
    assert total < 20 * MB, f"data/ holds {total / MB:.1f} MB"
    metrics = json.loads((tiny / "metrics.json").read_text())
    assert metrics["heldout_loss"] < metrics["unigram_loss"]
    assert metrics["steps"] == tr.DEFAULTS["steps"] and metrics["seed"] == tr.DEFAULTS["seed"]
    assert metrics["model_sha256"] == tr.sha256(tiny / "model.pt")


def test_distillation_moves_the_student_toward_the_teacher():
    """With a teacher the targets are its distributions: the student's KL to the teacher must fall."""
    tokens = pattern()
    teacher, _ = tr.train(SMALL, 30, 8, tokens, seq_len=16, lr=1e-2, warmup=3, show_progress=False)
    x = tokens[:16][None]

    def kl_to_teacher(student):
        with torch.no_grad():
            p = torch.softmax(teacher(x), -1)
            return float((p * (p.log() - torch.log_softmax(student(x), -1))).sum(-1).mean())

    untrained, _ = tr.train(SMALL, 1, 8, tokens, seq_len=16, lr=1e-9, show_progress=False, seed=5)
    student, losses = tr.train(SMALL, 30, 8, tokens, seq_len=16, lr=1e-2, warmup=3, show_progress=False,
                               seed=5, teacher=teacher)
    assert kl_to_teacher(student) < 0.3 * kl_to_teacher(untrained)
    assert all(math.isfinite(x) for x in losses)
    wrong = GPTConfig(vocab_size=32, context_length=32, n_layer=1, n_head=2, n_embd=32)
    with pytest.raises(ValueError, match="must share the student's vocab"):
        tr.train(SMALL, 2, 2, tokens, show_progress=False, teacher=GPT(wrong))


def test_teacher_continuations_are_windows_then_the_teachers_own_tokens():
    """Rows start with a window of the corpus; the greedy batch continues it exactly as generate() does."""
    from labutils.decode.loop import generate
    tokens = pattern()
    torch.manual_seed(0)
    teacher, other = GPT(SMALL), GPT(SMALL)
    rows = tr.teacher_continuations(teacher, tokens, 6, prompt_len=8, seed=2, batch_size=3, show_progress=False)
    assert rows.shape == (6, SMALL.context_length)
    text = tokens.tolist()
    for row in rows[:, :8].tolist():
        assert any(text[i:i + 8] == row for i in range(len(text) - 7))
    greedy = generate(teacher, rows[:3, :8], SMALL.context_length - 8).tokens
    assert torch.equal(rows[:3, 8:], greedy)                       # batch 0: greedy
    assert not torch.equal(rows[3:, 8:], generate(teacher, rows[3:, :8], SMALL.context_length - 8).tokens)
    again = tr.teacher_continuations(teacher, tokens, 6, prompt_len=8, seed=2, batch_size=3, show_progress=False)
    assert torch.equal(rows, again)
    assert tr.greedy_agreement(teacher, teacher, rows, 8) == 1.0
    assert tr.greedy_agreement(other, teacher, rows, 8) < 1.0      # another init disagrees somewhere


def test_teacher_rows_are_refused_without_a_teacher():
    rows = torch.zeros(4, SMALL.context_length, dtype=torch.long)
    with pytest.raises(ValueError, match="teacher_rows need a teacher"):
        tr.train(SMALL, 2, 2, pattern(), show_progress=False, teacher_rows=rows)


def test_on_policy_training_raises_agreement_on_the_teachers_text():
    """The student's corpus here is unlike what the teacher writes, as a real corpus is unlike a small model's
    greedy loops: only a student that also trains on the teacher's continuations learns to agree there."""
    text = torch.randint(0, 64, (400,), generator=torch.Generator().manual_seed(3))
    teacher, _ = tr.train(SMALL, 40, 8, text, seq_len=32, lr=1e-2, warmup=3, show_progress=False)
    rows = tr.teacher_continuations(teacher, text, 32, prompt_len=4, seed=0, batch_size=32, show_progress=False)
    common = dict(lr=1e-2, warmup=3, show_progress=False, seed=7, teacher=teacher)
    corpus_only, _ = tr.train(SMALL, 60, 8, pattern(), **common)
    on_policy, _ = tr.train(SMALL, 60, 8, pattern(), teacher_rows=rows, **common)
    assert tr.greedy_agreement(on_policy, teacher, rows, 4) > tr.greedy_agreement(corpus_only, teacher, rows, 4) + 0.2


def test_committed_draft_is_small_shares_the_tokenizer_and_matches_its_metrics(course_split):
    draft, enc = load_pretrained("draft")
    target, _ = load_pretrained("tiny")
    assert draft.config == tr.draft_config() and draft.config.n_layer <= 2
    assert draft.config.vocab_size == target.config.vocab_size == enc.n_vocab
    assert draft.num_params() < target.num_params() / 4
    d = DATA_DIR / "draft"
    assert sum(p.stat().st_size for p in d.iterdir()) < 4 * MB
    metrics = json.loads((d / "metrics.json").read_text())
    for key, value in tr.DRAFT_DEFAULTS.items():
        assert metrics[key] == value, key                     # the committed file is what the command rebuilds
    assert metrics["model_sha256"] == tr.sha256(d / "model.pt")
    train_ids, held_ids = course_split
    held = tr.heldout_loss(draft, held_ids[:4097])
    assert held < tr.unigram_loss(train_ids, held_ids[:4097], enc.n_vocab) - 0.5


def test_load_pretrained_refuses_unknown_names():
    with pytest.raises(ValueError, match=r"unknown course checkpoint 'huge'.*'tiny', 'draft'"):
        load_pretrained("huge")
