"""Train the course's GPTs on stdlib docstrings: `python -m labutils.train [--model draft]` rebuilds data/tiny/ or data/draft/."""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from labutils.model.checkpoints import DATA_DIR, load_checkpoint, save_checkpoint
from labutils.model.gpt import GPT, GPTConfig
from labutils.core.validate import check_count, check_device, check_model, check_number, check_seed, describe
from labutils.text.dataset import course_tokens
from labutils.model.loss import heldout_loss, unigram_loss


TINY_DIR = DATA_DIR / "tiny"
DRAFT_DIR = DATA_DIR / "draft"

# Everything the rebuild depends on, in one place; changing any of these changes model.pt.
DEFAULTS = dict(steps=1600, batch_size=8, lr=2e-3, warmup=50, seed=0, threads=2, teacher="none", on_policy=0)

# The draft learns the tiny target's distributions (distillation), on corpus windows and on 4096 of the
# target's own continuations: at decode time it is judged on text the target writes, not on the corpus.
# Measured on the bench prompts at k=4: alpha 0.68 from corpus windows alone (1200 steps), 0.84 with
# 2048 continuations (2400 steps), 0.89 with these settings.
DRAFT_DEFAULTS = dict(steps=4000, batch_size=8, lr=3e-3, warmup=50, seed=0, threads=2, teacher="tiny",
                      on_policy=4096)


def draft_config() -> GPTConfig:
    """The speculative-decoding draft (lesson 10): the tiny target's vocabulary and context, one narrow layer,
    so one of its forward passes costs a fraction of the target's."""
    tiny = GPTConfig.preset("tiny")
    return GPTConfig(vocab_size=tiny.vocab_size, context_length=tiny.context_length, n_layer=1, n_head=4, n_embd=128)


# --model name -> (config, output folder, defaults).
MODELS: dict[str, tuple[Callable[[], GPTConfig], Path, dict]] = {
    "tiny": (lambda: GPTConfig.preset("tiny"), TINY_DIR, DEFAULTS),
    "draft": (draft_config, DRAFT_DIR, DRAFT_DEFAULTS),
}


def get_batch(tokens: torch.Tensor, batch_size: int, seq_len: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """batch_size random windows of seq_len tokens (x) and the same windows shifted by one (y)."""
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator)
    x = torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1:s + 1 + seq_len] for s in starts.tolist()])
    return x, y


# Each teacher continuation starts from a corpus window this long (lesson 10's prompts are about as short).
PROMPT_LEN = 32


def teacher_continuations(teacher: GPT, tokens: torch.Tensor, n: int, prompt_len: int = PROMPT_LEN, *,
                          seed: int = 0, batch_size: int = 64, show_progress: bool = True) -> torch.Tensor:
    """n rows of context_length tokens: a random prompt_len-token window of `tokens`, then the teacher's
    continuation. Half are greedy and half sampled (temperature 0.8, top-k 40), the two ways lesson 10
    decodes, so a draft trained on them sees the text it will be asked to predict (on-policy data, as in
    DistillSpec, Zhou et al. 2023, arXiv:2310.08461). Deterministic given seed."""
    from labutils.decode.loop import generate
    check_count("n", n, 1)
    new = teacher.config.context_length - prompt_len
    generator = torch.Generator().manual_seed(seed)
    rows = []
    batches = range(0, n, batch_size)
    if show_progress:
        from labutils.core.progress_bar import progress as bar
        batches = bar(batches, desc="teacher continuations")
    for i in batches:
        starts = torch.randint(0, len(tokens) - prompt_len, (min(batch_size, n - i),), generator=generator)
        prompts = torch.stack([tokens[s:s + prompt_len] for s in starts.tolist()])
        sampled = (i // batch_size) % 2 == 1
        out = generate(teacher, prompts, new, **(dict(temperature=0.8, top_k=40, seed=seed + i) if sampled else {}))
        rows.append(torch.cat([prompts, out.tokens], dim=1))
    return torch.cat(rows)


@torch.no_grad()
def greedy_agreement(student: GPT, teacher: GPT, rows: torch.Tensor, prompt_len: int) -> float:
    """How often the student's argmax equals the teacher's after the prompt of each row: for rows the
    teacher wrote greedily, this is the acceptance rate of a greedy speculative draft."""
    x = rows[:, :-1]
    return float((student(x, check=False).argmax(-1) == teacher(x, check=False).argmax(-1))[:, prompt_len - 1:]
                 .float().mean())


def lr_at(step: int, steps: int, lr: float, warmup: int, min_frac: float = 0.1) -> float:
    """Linear warm-up for `warmup` steps, then a cosine decay from lr to min_frac * lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def train(config: GPTConfig, steps: int, batch_size: int, tokens: torch.Tensor | None = None, *,
          seq_len: int | None = None, lr: float = 2e-3, warmup: int | None = None,
          weight_decay: float = 0.1, seed: int = 0, device: str | torch.device = "cpu",
          progress: Callable[[int, float], None] | None = None,
          show_progress: bool = True, teacher: GPT | None = None,
          teacher_rows: torch.Tensor | None = None) -> tuple[GPT, list[float]]:
    """Train a fresh GPT(config) for `steps` AdamW steps on random windows of `tokens`.

    Deterministic: the weights come from `seed`, the batches from a torch.Generator seeded with
    `seed`, and nothing else is random (no dropout), so the same call on the same machine and
    thread count gives bitwise-identical weights. The global RNG is left as it was.
    With a `teacher` the targets are its next-token distributions instead of the corpus's next
    tokens (distillation): the loss is the cross-entropy from the teacher's probabilities, which is
    what a speculative draft should match, since its proposals are judged against the teacher's p.
    teacher_rows (from teacher_continuations) then supply every other batch, in place of corpus windows.
    tokens defaults to the course's training split. progress(step, loss) is called after every
    step (e.g. to update a live plot). Returns the model (in eval mode) and the loss of each step.
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {describe(config)}; use GPTConfig.preset(name) or "
                        "draft_config()")
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        check_count(name, value, 1)
    device, seed = check_device("device", device), check_seed(seed)      # parsed once, here, by the course
    weight_decay = check_number("weight_decay", weight_decay, minimum=0, hint="a decay such as 0.1, or 0 for none")
    if tokens is None:
        tokens, _ = course_tokens()
    seq_len = seq_len or config.context_length
    if seq_len > config.context_length:
        raise ValueError(f"seq_len={seq_len} exceeds the model's context_length={config.context_length}")
    if len(tokens) <= seq_len + 1:
        raise ValueError(f"need more than {seq_len + 1} training tokens for windows of {seq_len}, "
                         f"got {len(tokens)}; pass more tokens or a smaller seq_len")
    if int(tokens.max()) >= config.vocab_size:
        raise ValueError(f"token id {int(tokens.max())} is outside vocab_size={config.vocab_size}; "
                         "train with the encoding that matches the config")
    warmup = max(1, steps // 20) if warmup is None else check_count("warmup", warmup, 0,
                                                                    hint="warm-up steps, 0 for none")
    lr = check_number("lr", lr, above=0, hint="a learning rate such as 2e-3")
    if teacher is not None:
        tc = teacher.config
        if tc.vocab_size != config.vocab_size or tc.context_length < seq_len:
            raise ValueError(f"the teacher (vocab {tc.vocab_size}, context {tc.context_length}) must share the "
                             f"student's vocab ({config.vocab_size}) and cover its windows of {seq_len} tokens")
        teacher.eval()
    if teacher_rows is not None and (teacher is None or teacher_rows.shape[1] < seq_len):
        raise ValueError("teacher_rows need a teacher and rows of at least seq_len tokens "
                         f"(got {tuple(teacher_rows.shape)} for seq_len={seq_len})")

    with torch.random.fork_rng(devices=[]):   # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = GPT(config).to(device)
    generator = torch.Generator().manual_seed(seed)
    # Weight decay on matrices only; biases, LayerNorm gains and position tables stay undecayed.
    params = list(model.parameters())   # the tied embedding / output matrix comes once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    losses: list[float] = []
    model.train()
    steps_iter = range(steps)
    if show_progress:
        from labutils.core.progress_bar import progress as bar
        steps_iter = bar(steps_iter, desc="training")
    for step in steps_iter:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        x, y = get_batch(tokens, batch_size, seq_len, generator)
        # On teacher-row steps the corpus batch above is drawn and dropped: skipping it would shift the
        # generator, and with it every later batch and the committed draft's bits.
        if teacher_rows is not None and step % 2 == 1:
            x = teacher_rows[torch.randint(0, len(teacher_rows), (batch_size,), generator=generator), :seq_len]
        x, y = x.to(device), y.to(device)
        logits = model(x, check=False)
        if teacher is None:
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        else:
            with torch.no_grad():
                p = torch.softmax(teacher(x, check=False).float(), dim=-1)
            loss = -(p * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step, losses[-1])
    return model.eval(), losses


def round_to_bf16(model: GPT) -> GPT:
    """Round every weight to bf16 and back: what the bf16 checkpoint file holds, so the metrics
    measured afterwards are the metrics of the model a lesson loads."""
    with torch.no_grad():
        for p in check_model("model", model).parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def save_bf16(model: GPT, out_dir: Path, metrics: dict) -> Path:
    """config.json, model.pt (bf16 state_dict: half the bytes; load_checkpoint upcasts to fp32), metrics.json."""
    save_checkpoint(model, out_dir)
    state, cast = {}, {}
    for k, v in model.state_dict().items():
        if v.is_floating_point():
            # Cast a tied tensor once, so the file keeps storing it once.
            v = cast.setdefault(v.data_ptr(), v.to(torch.bfloat16))
        state[k] = v
    torch.save(state, out_dir / "model.pt")
    metrics = {**metrics, "model_sha256": sha256(out_dir / "model.pt")}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return out_dir


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=list(MODELS), default="tiny",
                   help="tiny: the course's target model (data/tiny); draft: its speculative draft (data/draft)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads; bitwise reproducibility needs the same count")
    p.add_argument("--teacher", choices=["none", *MODELS], default=None,
                   help="distil from this committed checkpoint (data/NAME) instead of the corpus's next tokens")
    p.add_argument("--on-policy", type=int, default=None, metavar="N",
                   help="with --teacher: also train on N of the teacher's own continuations (every other batch)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    make_config, out_dir, defaults = MODELS[args.model]
    # Anything not given on the command line comes from the model's DEFAULTS, so metrics.json records it.
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out = out_dir if args.out is None else args.out
    for flag, value, low in (("--steps", args.steps, 1), ("--batch-size", args.batch_size, 1),
                             ("--warmup", args.warmup, 0), ("--threads", args.threads, 1),
                             ("--on-policy", args.on_policy, 0)):
        if value < low:
            p.error(f"{flag} must be >= {low}, got {value}")
    if not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")

    from labutils.decode.loop import generate
    from labutils.text.tokenizer import get_encoding

    torch.set_num_threads(args.threads)
    enc = get_encoding("course")
    config = make_config()
    if config.vocab_size != enc.n_vocab:
        raise ValueError(f"model {args.model!r} has vocab_size={config.vocab_size} but the course encoding "
                         f"has {enc.n_vocab}; keep labutils/model/presets.py and train.MODELS in sync")
    train_ids, heldout_ids = course_tokens(enc=enc)
    print(f"corpus: {len(train_ids):,} train tokens, {len(heldout_ids):,} held-out tokens")
    print(f"model: {config.num_params():,} parameters; {args.steps} steps x {args.batch_size} x "
          f"{config.context_length} tokens ({args.steps * args.batch_size * config.context_length / len(train_ids):.1f} epochs)")

    t0 = time.perf_counter()

    def report(step, loss):
        if (step + 1) % 50 == 0 or step == 0:
            print(f"step {step + 1:5d}/{args.steps}  loss {loss:.3f}  {time.perf_counter() - t0:6.0f} s", flush=True)

    teacher = None if args.teacher == "none" else load_checkpoint(DATA_DIR / args.teacher)
    if args.on_policy and teacher is None:
        p.error("--on-policy needs --teacher: the continuations are the teacher's")
    rows = None
    if args.on_policy:
        rows = teacher_continuations(teacher, train_ids, args.on_policy, seed=args.seed)
        print(f"{len(rows)} teacher continuations in {time.perf_counter() - t0:.0f} s", flush=True)
    model, losses = train(config, args.steps, args.batch_size, train_ids, lr=args.lr, warmup=args.warmup,
                          seed=args.seed, progress=report, show_progress=False, teacher=teacher,
                          teacher_rows=rows)
    train_time_s = time.perf_counter() - t0
    round_to_bf16(model)
    held = heldout_loss(model, heldout_ids)
    uni = unigram_loss(train_ids, heldout_ids, config.vocab_size)
    prompt = "Return the"
    ids = enc.encode_ordinary(prompt)
    greedy = enc.decode(generate(model, ids, 40).tokens[0].tolist())
    sampled = enc.decode(generate(model, ids, 60, temperature=0.8, top_k=40, seed=0).tokens[0].tolist())
    metrics = dict(model=args.model, teacher=args.teacher, on_policy=args.on_policy, steps=args.steps, batch_size=args.batch_size, seq_len=config.context_length,
                   lr=args.lr, warmup=args.warmup, seed=args.seed, threads=args.threads, n_params=config.num_params(),
                   train_tokens=len(train_ids), heldout_tokens=len(heldout_ids),
                   final_train_loss=round(sum(losses[-50:]) / len(losses[-50:]), 4),
                   heldout_loss=round(held, 4), unigram_loss=round(uni, 4),
                   train_time_s=round(train_time_s, 1), torch_version=torch.__version__,
                   sample_prompt=prompt, sample_greedy=prompt + greedy,
                   sample_t08_top40_seed0=prompt + sampled)
    if teacher is not None:
        # Greedy agreement on the teacher's continuations of held-out prompts: the draft's alpha, estimated.
        # n == batch_size: one batch, and the first batch is the greedy one.
        held_rows = teacher_continuations(teacher, heldout_ids, 64, batch_size=64, seed=1, show_progress=False)
        metrics["heldout_greedy_agreement"] = round(greedy_agreement(model, teacher, held_rows, PROMPT_LEN), 4)
    save_bf16(model, args.out, metrics)
    metrics = json.loads((args.out / "metrics.json").read_text())
    # A round trip through the files must give the model that was measured.
    reloaded = heldout_loss(load_checkpoint(args.out), heldout_ids)
    if abs(reloaded - held) > 1e-4:
        raise RuntimeError(f"the saved checkpoint measures {reloaded:.4f}, not {held:.4f}")
    print(f"trained in {train_time_s:.0f} s; held-out loss {held:.3f} nats/token "
          f"(unigram baseline {uni:.3f})")
    print(f"greedy : {prompt + greedy!r}")
    print(f"sampled: {prompt + sampled!r}")
    print(f"wrote {args.out} (model.pt sha256 {metrics['model_sha256'][:16]}...)")
    return metrics


__all__ = ['DEFAULTS', 'DRAFT_DEFAULTS', 'DRAFT_DIR', 'MODELS', 'PROMPT_LEN', 'TINY_DIR', 'draft_config', 'get_batch',
           'greedy_agreement', 'lr_at', 'main', 'round_to_bf16', 'save_bf16', 'sha256', 'teacher_continuations', 'train']


if __name__ == "__main__":
    main()
