"""Kernels the model calls: attention variants (naive, SDPA, tiled online softmax) and the paged reference.
May import: labutils.core."""
from labutils.model.kernels.attention import (ATTENTION_IMPLS, CUDA_SDPA_BACKENDS, attention, attention_weights,
                                              causal_mask, naive_attention, sdpa, sdpa_attention, sdpa_choice)
from labutils.model.kernels.attention_map import model_attention_weights
from labutils.model.kernels.paged import gather_blocks, paged_attention, paged_mask
from labutils.model.kernels.tiled import causal_tile_counts, skipped_tile_fraction, tile_is_masked, tiled_attention

__all__ = ["ATTENTION_IMPLS", "CUDA_SDPA_BACKENDS", "attention", "attention_weights", "causal_mask",
           "causal_tile_counts", "gather_blocks", "model_attention_weights", "naive_attention", "paged_attention", "paged_mask",
           "sdpa", "sdpa_attention", "sdpa_choice", "skipped_tile_fraction", "tile_is_masked", "tiled_attention"]
