"""Published model shapes, one table shared by the model, the KV-cache calculator and the widgets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from labutils.core.validate import check_choice, check_count


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a model's public config.json that decide its weight and KV-cache bytes."""

    name: str
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    vocab_size: int
    context_length: int
    n_inner: int            # feed-forward hidden width
    gated_mlp: bool         # SwiGLU (Llama family) uses three FFN matrices instead of two
    tie_weights: bool
    n_params: int           # as published (config + safetensors index), for weight bytes
    source: str
    learned_positions: bool = True   # GPT-2 learns a position table; RoPE models (Llama family) have none
    # Attention span in positions, None for full attention. Mistral-7B attends to the last 4,096 tokens only, so its
    # cache (a rolling buffer) stops growing there: the KV bytes in labutils.perf.roofline cap the positions at it.
    sliding_window: int | None = None

    def __post_init__(self):
        if self.sliding_window is not None:
            window = check_count("sliding_window", self.sliding_window, 1,
                                 hint=f"{self.name}'s window is a number of positions; use None for full attention")
            object.__setattr__(self, "sliding_window", window)      # a numpy int becomes a Python int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def with_kv_heads(self, n_kv_head: int, name: str | None = None) -> "ModelShape":
        """The same model with another number of KV heads (a GQA/MQA variant).

        Narrower K and V projections hold fewer parameters: each layer loses (or gains)
        2 x n_embd x head_dim weights per KV head (plus their biases, which the GPT-2 family has and
        the gated Llama family does not), so n_params changes with the cache.
        """
        n_kv_head = check_count("n_kv_head", n_kv_head, 1)
        if self.n_head % n_kv_head:
            divisors = [d for d in range(1, self.n_head + 1) if self.n_head % d == 0]
            raise ValueError(f"n_kv_head must divide n_head={self.n_head}, got {n_kv_head}; choose one of {divisors}")
        bias = 0 if self.gated_mlp else 1
        delta = 2 * self.n_layer * (self.n_embd + bias) * self.head_dim * (self.n_kv_head - n_kv_head)
        return dataclasses.replace(self, name=name or f"{self.name}, {n_kv_head} KV heads",
                                   n_kv_head=n_kv_head, n_params=self.n_params - delta)


def _gpt2(name, n_layer, n_head, n_embd, n_params):
    # https://huggingface.co/openai-community/<name>/blob/main/config.json (n_ctx=1024, vocab 50257)
    return ModelShape(name, n_layer, n_head, n_head, n_embd, 50257, 1024, 4 * n_embd, False, True,
                      n_params, f"huggingface.co/openai-community/{name.replace('-small', '')}")


PRESETS: dict[str, ModelShape] = {s.name: s for s in [
    # The course's own model, trained by `python -m labutils.train` (see data/tiny/config.json).
    ModelShape("tiny", 4, 4, 4, 256, 4096, 256, 1024, False, True, 4_273_664, "data/tiny (this course)"),
    _gpt2("gpt2-small", 12, 12, 768, 124_439_808),
    _gpt2("gpt2-medium", 24, 16, 1024, 354_823_168),
    _gpt2("gpt2-large", 36, 20, 1280, 774_030_080),
    _gpt2("gpt2-xl", 48, 25, 1600, 1_557_611_200),
    # Llama 3.2's small models, for GPUs that cannot hold a 7B model in 16 bits beside a cache (8 KV heads, tied).
    ModelShape("llama-3.2-1b", 16, 32, 8, 2048, 128256, 131072, 8192, True, True, 1_235_814_400,
               "huggingface.co/meta-llama/Llama-3.2-1B (GQA, 8 KV heads)", learned_positions=False),
    ModelShape("llama-3.2-3b", 28, 24, 8, 3072, 128256, 131072, 8192, True, True, 3_212_749_824,
               "huggingface.co/meta-llama/Llama-3.2-3B (GQA, 8 KV heads)", learned_positions=False),
    ModelShape("llama-2-7b", 32, 32, 32, 4096, 32000, 4096, 11008, True, False, 6_738_415_616,
               "huggingface.co/meta-llama/Llama-2-7b-hf", learned_positions=False),
    ModelShape("llama-2-13b", 40, 40, 40, 5120, 32000, 4096, 13824, True, False, 13_015_864_320,
               "huggingface.co/meta-llama/Llama-2-13b-hf", learned_positions=False),
    ModelShape("llama-2-70b", 80, 64, 8, 8192, 32000, 4096, 28672, True, False, 68_976_648_192,
               "huggingface.co/meta-llama/Llama-2-70b-hf (GQA, 8 KV heads)", learned_positions=False),
    ModelShape("llama-3-8b", 32, 32, 8, 4096, 128256, 8192, 14336, True, False, 8_030_261_248,
               "huggingface.co/meta-llama/Meta-Llama-3-8B (GQA, 8 KV heads)", learned_positions=False),
    ModelShape("llama-3-70b", 80, 64, 8, 8192, 128256, 8192, 28672, True, False, 70_553_706_496,
               "huggingface.co/meta-llama/Meta-Llama-3-70B (GQA, 8 KV heads)", learned_positions=False),
    ModelShape("mistral-7b", 32, 32, 8, 4096, 32000, 32768, 14336, True, False, 7_241_732_096,
               "huggingface.co/mistralai/Mistral-7B-v0.1 (GQA, 8 KV heads; config.json sliding_window 4096)",
               learned_positions=False, sliding_window=4096),
    # Qwen2.5's config.json names a sliding_window but sets use_sliding_window false: full attention.
    ModelShape("qwen2.5-7b", 28, 28, 4, 3584, 152064, 32768, 18944, True, False, 7_615_616_512,
               "huggingface.co/Qwen/Qwen2.5-7B (GQA, 4 KV heads)", learned_positions=False),
]}


def get_shape(name: str) -> ModelShape:
    """Look up a preset by its lowercase, hyphenated name."""
    return PRESETS[check_choice("preset", name, PRESETS)]
