"""Many requests at once: the course's engine (token budget, paged KV cache, prefix caching), workloads and their
metrics, a real server through its OpenAI API. May import: core, text, model, perf, decode."""
from labutils.serving.blocks import BlockManager
from labutils.serving.engine import Engine, EngineCounts, serve
from labutils.serving.openai_client import OpenAIClient
from labutils.serving.workload import SLO, SamplingParams, make_workload, summarize
