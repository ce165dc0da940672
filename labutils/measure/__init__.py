"""The lessons' experiments: one request on a preset shape, one pass on the roofline, the stage ladder, attention and
KV sweeps, and claims that check themselves. May import: core, text, model, perf, decode, serving."""
from labutils.measure import stages
from labutils.measure.attention_cost import (cpu_memory_events, flash_traffic_bytes, make_qkv, measure_attention,
                                             measure_causal_skip, peak_memory_bytes, qkvo_bytes, score_matrix_bytes)
from labutils.measure.claims import claim
from labutils.measure.kv_timing import step_cost_ms
from labutils.measure.request import (available_devices, check_preset_request, clear_models,
                                      compute_bound_prompt, contender_dtypes,
                                      default_dtype_name, dtype_choices, fixed_pass_s, floor_sets_time, free_bytes,
                                      get_model, measure_request, measure_requests, memory_needed, model_config,
                                      preset_choices, roofline_point, skeleton_config, time_pass, timed_generate,
                                      without_launches)
