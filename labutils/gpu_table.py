"""The GPU table of docs/gpu.md: datasheet peaks, ridge points and batch-1 decode floors (perf.datasheets.SPECS + perf.roofline).

python -m labutils.gpu_table prints it; tests/test_readme.py checks that docs/gpu.md holds exactly this text.
"""
from __future__ import annotations

from labutils.perf import roofline
from labutils.perf.datasheets import SPECS
from labutils.model.presets import PRESETS, get_shape
from labutils.core.validate import check_choice

GPUS = ("A100 80GB SXM", "H100 SXM", "H200 SXM")
MODELS = ("tiny", "gpt2-small", "llama-2-7b")      # the course's two shapes, and the essay's 7B example
DTYPE = "bf16"                                      # weights and KV cache in 16 bits, as GPUs run them
SEED_PROMPT = 1000                                  # the seed's request: a decode step after 1,000 prompt tokens


def decode_pos(preset: str) -> int:
    """Cached positions the floor assumes: the seed's 1,000-token prompt, or the model's whole context if shorter."""
    return min(SEED_PROMPT, get_shape(preset).context_length - 1)


def rows(gpus=GPUS, models=MODELS) -> list[dict]:
    """One dict per GPU: its datasheet figures, 16-bit ridge point and each model's decode floor per token."""
    out = []
    for gpu in gpus:
        spec = SPECS[check_choice("gpu", gpu, SPECS, "the names are labutils.perf.datasheets.SPECS's keys")]
        floors = {m: roofline.decode_floor_s(check_choice("model", m, PRESETS), decode_pos(m), 1, DTYPE,
                                             bandwidth_Bps=spec.bandwidth_Bps) for m in models}
        out.append(dict(gpu=gpu, bandwidth_GBps=spec.bandwidth_GBps, tflops_16=spec.tflops_16,
                        memory_GB=spec.memory_GB, ridge=spec.ridge, floor_s=floors))
    return out


def _time(seconds: float) -> str:
    """A floor as the table shows it: microseconds below a millisecond, else milliseconds."""
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def markdown(gpus=GPUS, models=MODELS) -> str:
    """The table as markdown: one row per GPU, then per model its decode floor per token (batch 1, bf16)."""
    head = ["GPU (datasheet)", "HBM GB/s", "16-bit TFLOP/s (dense)", "ridge FLOP/byte"]
    head += [f"{m} decode floor ({decode_pos(m):,} cached)" for m in models]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows(gpus, models):
        no16 = r["tflops_16"] is None                   # Apple rows publish no 16-bit figure
        cells = [r["gpu"], f"{r['bandwidth_GBps']:,.0f}", "–" if no16 else f"{r['tflops_16']:,.0f}",
                 "–" if no16 else f"{r['ridge']:.0f}"]
        cells += [_time(r["floor_s"][m]) for m in models]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse
    argparse.ArgumentParser(prog="python -m labutils.gpu_table", description=__doc__.splitlines()[0]).parse_args(argv)
    print(markdown())


if __name__ == "__main__":
    main()
