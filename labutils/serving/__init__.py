"""Serving: continuous batching over a paged KV cache with prefix caching, workloads and their metrics."""
