"""Kernels the model calls: attention variants (naive, SDPA, tiled online softmax) and the paged reference."""
from .attention import ATTENTION_IMPLS, attention, attention_weights, causal_mask, naive_attention, sdpa_attention
from .attention_map import model_attention_weights
from .paged import gather_blocks, paged_attention, paged_mask
from .tiled import causal_tile_counts, skipped_tile_fraction, tile_is_masked, tiled_attention

__all__ = ["ATTENTION_IMPLS", "attention", "attention_weights", "causal_mask", "causal_tile_counts",
           "gather_blocks", "model_attention_weights", "naive_attention", "paged_attention", "paged_mask",
           "sdpa_attention", "skipped_tile_fraction", "tile_is_masked", "tiled_attention"]
