"""Serving: many requests at once, on the course's own engine (continuous batching over a paged KV cache with
prefix caching) or on a real server through its OpenAI API; workloads and their metrics."""
