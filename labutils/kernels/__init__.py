"""Kernels the model calls: attention variants (naive, SDPA) and the paged reference (more arrive with later lessons)."""
from .attention import ATTENTION_IMPLS, attention, causal_mask, naive_attention, sdpa_attention
from .paged import block_slots, gather_blocks, paged_attention, paged_mask

__all__ = ["ATTENTION_IMPLS", "attention", "block_slots", "causal_mask", "gather_blocks", "naive_attention",
           "paged_attention", "paged_mask", "sdpa_attention"]
