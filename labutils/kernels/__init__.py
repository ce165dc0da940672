"""Kernels the model calls: attention variants (more arrive with later lessons)."""
from .attention import ATTENTION_IMPLS, attention, causal_mask, naive_attention, sdpa_attention

__all__ = ["ATTENTION_IMPLS", "attention", "causal_mask", "naive_attention", "sdpa_attention"]
