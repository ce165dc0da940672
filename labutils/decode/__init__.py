"""From a prompt to tokens: prefill and decode_step, the KV caches, the fast loop, speculative decoding, int8, prepack.
May import: labutils.core, labutils.text, labutils.model, labutils.perf."""
from labutils.decode import quant
from labutils.decode.fastgen import STAGES, FastDecoder, check_graph_ready, fast_generate
from labutils.decode.kvcache import KVCache
from labutils.decode.loop import decode_step, generate, prefill
from labutils.decode.sampling import sample, sampling_probs
from labutils.decode.prepack import column_major_weights, prepack_linears, prepack_unavailable
from labutils.decode.speculative import (PROMPT_LOOKUP, expected_speedup, expected_tokens_per_step,
                                         speculative_generate)
from labutils.decode.static_cache import StaticKVCache
