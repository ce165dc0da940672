"""The OpenAI-compatible streaming client against a small fake server in this process (no vLLM needed).

The fake server streams one SSE event per token with a known pause, so the client's timestamps can be
checked against what the server did; a prompt's first id picks a failure for that request.
"""
import json
import math
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from labutils.serving.openai_client import OpenAIClient, Request, StreamResult, as_request
from labutils.serving.vllm_server import free_port

GAP_S = 0.03                  # the fake server's pause before each token
ERROR_EVENT, HTTP_500, DROP, TEXT_ONLY = 1, 2, 3, 4   # prompt[0] values that pick a behaviour
# ... and malformed streams no correct server sends: what each puts in place of a good chunk
MALFORMED = {5: dict(token_ids=[1.5]), 6: dict(token_ids=[-4]), 7: dict(token_ids=[True]),
             8: dict(token_ids=[1, 2]), 9: dict(finish_reason=3)}
# ... and whole events of the wrong shape (a raw AttributeError, KeyError or TypeError escaped the client before)
BAD_EVENTS = {901: b"[1, 2]", 902: b'{"choices": {"0": {"text": "a"}}}', 903: b'{"choices": [5]}',
              904: b'{"choices": [{"token_ids": 5}]}', 905: b'{"choices": [{"text": 5}]}', 906: b"not json",
              907: b'"a string"'}
# A /v1/models reply of the wrong shape, picked by the path prefix /models-<n>
BAD_MODELS = {0: b"[1, 2]", 1: b'{"object": "list"}', 2: b'{"data": 5}', 3: b'{"data": [{"name": "x"}]}', 4: b"<html>"}


def fake_tokens(prompt, n):
    """What the fake server generates: deterministic, so tests know every id."""
    return [(prompt[-1] + 7 * (k + 1)) % 1000 for k in range(n)]


class FakeServer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"   # the body ends when the connection closes
    received: list = []             # (perf_counter at receipt, request body), shared by the class

    def log_message(self, *args):
        pass

    def _send_json(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.startswith("/models-"):                # a server whose model list is malformed
            body = BAD_MODELS[int(self.path.split("/")[1].removeprefix("models-"))]
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [{"id": "fake-gpt", "object": "model"}]})
        else:
            self._send_json(404, {"error": "no such route"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeServer.received.append((time.perf_counter(), body))
        prompt, n = body["prompt"], body["max_tokens"]
        if prompt[0] == HTTP_500:
            return self._send_json(500, {"error": {"message": "engine crashed"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for k, tok in enumerate(fake_tokens(prompt, n)):
            time.sleep(GAP_S)
            if prompt[0] == ERROR_EVENT and k == 2:
                self._event({"error": {"message": "out of KV blocks", "code": 500}})
                return
            if prompt[0] == DROP and k == 2:
                return                                     # connection closes mid-stream
            choice = {"index": 0, "text": f"<{tok}>", "finish_reason": "length" if k == n - 1 else None}
            if prompt[0] != TEXT_ONLY:
                choice["token_ids"] = [tok]
            if prompt[0] in MALFORMED and k == n - 1:
                choice.update(MALFORMED[prompt[0]])
            if prompt[0] in BAD_EVENTS and k == n - 1:
                self.wfile.write(b"data: " + BAD_EVENTS[prompt[0]] + b"\n\n")
                continue
            self._event({"object": "text_completion", "choices": [choice]})
            self.wfile.write(b": keep-alive comment\n\n")  # SSE comments must be skipped
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, obj):
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def received():
    FakeServer.received.clear()
    return FakeServer.received


def test_streams_token_ids_with_a_timestamp_as_each_arrives(server, received):
    client = OpenAIClient(server)
    res = client.complete([10, 11, 12], 5)
    assert isinstance(res, StreamResult) and res.ok and res.finish_reason == "length" and res.error is None
    assert res.tokens == fake_tokens([12], 5)
    assert len(res.timestamps) == 5 and res.prompt_len == 3
    # The server pauses GAP_S before each token: tokens recorded as they arrive, not at the end.
    # (A busy machine can deliver two tokens in one read, so the gaps are checked in sum, not one by one.)
    assert res.ttft_s >= GAP_S * 0.9
    assert all(gap >= 0 for gap in res.itl_s) and sum(res.itl_s) >= 4 * GAP_S * 0.9
    assert res.tpot_s == pytest.approx((res.latency_s - res.ttft_s) / 4)
    assert sum(res.itl_s) == pytest.approx(res.latency_s - res.ttft_s)
    # What went over the wire: the model the server named, token ids, greedy, streaming.
    body = received[0][1]
    assert body["model"] == "fake-gpt" and body["prompt"] == [10, 11, 12] and body["max_tokens"] == 5
    assert body["temperature"] == 0 and body["stream"] is True and body["return_token_ids"] is True


def test_a_failed_request_is_marked_and_the_others_finish(server):
    client = OpenAIClient(server)
    reqs = [Request((50, 51), 6), Request((ERROR_EVENT, 9), 6), Request((HTTP_500, 9), 6),
            Request((DROP, 9), 6), Request((60,), 6)]
    results = client.run(reqs, max_concurrency=5)
    assert [r.id for r in results] == [0, 1, 2, 3, 4]
    ok = {r.id: r for r in results if r.ok}
    assert sorted(ok) == [0, 4]
    assert ok[0].tokens == fake_tokens([51], 6) and ok[4].tokens == fake_tokens([60], 6)
    bad = {r.id: r for r in results if not r.ok}
    assert all(r.finish_reason == "error" for r in bad.values())
    assert "out of KV blocks" in bad[1].error and len(bad[1].tokens) == 2     # what came before the error stays
    assert "HTTP 500" in bad[2].error and "engine crashed" in bad[2].error and bad[2].tokens == []
    assert math.isnan(bad[2].ttft_s) and bad[2].itl_s == []
    assert "without a finish_reason" in bad[3].error and len(bad[3].tokens) == 2


def test_a_text_only_server_still_gets_timed(server):
    res = OpenAIClient(server).complete([TEXT_ONLY, 5], 4)
    assert res.ok and res.tokens == [None] * 4 and len(res.timestamps) == 4
    assert res.text == "".join(f"<{t}>" for t in fake_tokens([5], 4))


def test_queueing_counts_toward_ttft(server):
    """With one slot, the second request waits for the first; its TTFT includes that wait."""
    first, second = OpenAIClient(server).run([Request((20,), 5), Request((21,), 5)], max_concurrency=1)
    assert first.ok and second.ok
    assert second.ttft_s > first.latency_s      # it could not start before the first had finished
    assert second.ttft_s >= 6 * GAP_S * 0.9


def test_requests_are_sent_at_their_arrival_times(server, received):
    reqs = [Request((30,), 2, arrival_s=0.0), Request((31,), 2, arrival_s=0.25), Request((32,), 2, arrival_s=0.5)]
    results = OpenAIClient(server).run(reqs, max_concurrency=3)
    assert all(r.ok for r in results) and [r.arrival_s for r in results] == [0.0, 0.25, 0.5]
    sent = {body["prompt"][0]: t for t, body in received}
    assert sent[31] - sent[30] >= 0.25 * 0.95 and sent[32] - sent[30] >= 0.5 * 0.95
    # Each TTFT is from its own arrival, not from the workload start.
    assert all(r.ttft_s < 0.25 for r in results)


def test_results_come_back_in_workload_order_whatever_the_arrival_order(server):
    reqs = [{"prompt_ids": [40], "max_new_tokens": 2, "arrival_s": 0.2, "id": "late"},
            {"prompt_ids": [41], "max_new_tokens": 2, "arrival_s": 0.0, "id": "early"}]
    late, early = OpenAIClient(server).run(reqs)
    assert (late.id, early.id) == ("late", "early")
    assert late.tokens == fake_tokens([40], 2) and early.tokens == fake_tokens([41], 2)


def test_a_workload_object_with_requests_drives_the_client(server):
    class Workload:
        requests = [Request((70,), 3), Request((71,), 2, arrival_s=0.05)]

    a, b = OpenAIClient(server).run(Workload())
    assert a.tokens == fake_tokens([70], 3) and b.tokens == fake_tokens([71], 2)


def test_an_unreachable_server_is_named():
    url = f"http://127.0.0.1:{free_port()}"
    client = OpenAIClient(url)
    with pytest.raises(ConnectionError, match=f"cannot reach .* at {url}"):
        client.run([Request((1,), 2)])
    with pytest.raises(ConnectionError, match=url):
        client.complete([1], 2)


def test_a_server_without_the_openai_routes_is_named(server):
    client = OpenAIClient(server + "/nothing-here")
    with pytest.raises(ConnectionError, match="HTTP 404.*OpenAI-compatible"):
        client.models()


def test_base_url_may_end_in_v1(server):
    assert OpenAIClient(server + "/v1/").models() == ["fake-gpt"]


@pytest.mark.parametrize("bad, err, match", [
    ({"prompt_ids": [], "max_new_tokens": 2}, ValueError, "request 0: prompt_ids is empty"),
    ({"prompt_ids": "hello", "max_new_tokens": 2}, TypeError, "list of token ids"),
    ({"prompt_ids": [1, 2.5], "max_new_tokens": 2}, TypeError, r"request 0: prompt_ids\[1\] must be an int .*got float 2.5"),
    ({"prompt_ids": [1, True], "max_new_tokens": 2}, TypeError, r"request 0: prompt_ids\[1\] must be an int .*got bool"),
    ({"prompt_ids": [1, -3], "max_new_tokens": 2}, ValueError, r"request 0: prompt_ids holds token id -3; token ids are >= 0"),
    ({"prompt_ids": [2 ** 64], "max_new_tokens": 2}, ValueError, r"prompt_ids\[0\]=18446744073709551616 is no token id"),
    ({"prompt_ids": [[1, 2]], "max_new_tokens": 2}, TypeError, r"prompt_ids\[0\] must be an int .*got list"),
    ({"prompt_ids": [1], "max_new_tokens": 0}, ValueError, "request 0: max_new_tokens must be >= 1, got 0"),
    ({"prompt_ids": [1], "max_new_tokens": 2, "arrival_s": -1}, ValueError, "arrival_s .* got -1"),
    ({"prompt_ids": [1], "max_new_tokens": 2, "arrival_s": float("inf")}, ValueError, "arrival_s"),
    ({"tokens": [1]}, TypeError, "needs prompt_ids and max_new_tokens"),
])
def test_bad_requests_are_refused_before_anything_is_sent(bad, err, match):
    with pytest.raises(err, match=match):
        as_request(bad, 0)


def test_bad_client_settings_are_refused(server):
    with pytest.raises(ValueError, match="not an http"):
        OpenAIClient("127.0.0.1:8000")
    with pytest.raises(TypeError, match="base_url must be a string"):
        OpenAIClient(8000)
    with pytest.raises(ValueError, match="timeout_s"):
        OpenAIClient(server, timeout_s=0)
    with pytest.raises(ValueError, match="max_concurrency must be >= 1, got 0"):
        OpenAIClient(server).run([Request((1,), 1)], max_concurrency=0)


def test_a_tensor_prompt_is_accepted():
    torch = pytest.importorskip("torch")
    req = as_request({"prompt_ids": torch.tensor([3, 4, 5]), "max_new_tokens": 1}, 7)
    assert req == Request((3, 4, 5), 1, 0.0, 7)


@pytest.mark.parametrize("marker, match", [(5, "not non-negative ints: \\[1.5\\]"), (6, "not non-negative ints: \\[-4\\]"),
                                           (7, "not non-negative ints: \\[True\\]"),
                                           (8, "streamed 4 tokens for max_tokens=3"),
                                           (9, "finish_reason=3; the API's finish_reason is a string")])
def test_a_malformed_stream_is_refused_naming_the_server(server, marker, match):
    res = OpenAIClient(server).complete([marker, 9], 3)
    assert not res.ok and res.finish_reason == "error"
    assert server in res.error and re.search(match, res.error), res.error
    assert len(res.tokens) == 2                                    # what came before the bad chunk stays


@pytest.mark.parametrize("marker, match", [
    (901, "JSON is a list"), (902, "'choices' is a dict"), (903, r"choices\[0\] is a int"),
    (904, r"'token_ids'\] is a int"), (905, r"'text'\] is a int"), (906, "not JSON: b'not json'"), (907, "JSON is a str")])
def test_a_reply_of_the_wrong_shape_is_refused_naming_the_server_and_what_it_held(server, marker, match):
    res = OpenAIClient(server).complete([marker, 9], 3)
    assert not res.ok and res.error.startswith("ServerError") and server in res.error and re.search(match, res.error), \
        res.error
    assert len(res.tokens) == 2                                    # what came before the bad event stays


@pytest.mark.parametrize("which, match", [(0, "reply is a list without 'data'"), (1, "reply is a dict without 'data'"),
                                          (2, "'data' is a int"), (3, r"data\[0\] has no model name 'id'"),
                                          (4, "reply is not JSON")])
def test_a_malformed_model_list_is_refused_naming_the_server(server, which, match):
    with pytest.raises(ConnectionError, match=match) as info:
        OpenAIClient(f"{server}/models-{which}").models()
    assert f"{server}/models-{which}/v1/models" in str(info.value)


@pytest.mark.parametrize("url, match", [("http://[::1", "not a URL .*Invalid IPv6"), ("http://127.0.0.1:65536", "port"),
                                        ("http://127.0.0.1:-1", "port"), ("http://127.0.0.1:http", "port")])
def test_a_bad_url_is_refused_by_the_client_not_by_urllib(url, match):
    with pytest.raises(ValueError, match=match) as info:
        OpenAIClient(url)
    assert "base_url" in str(info.value)


def test_arrivals_are_capped_as_the_engine_caps_them():
    from labutils.serving.engine import MAX_ARRIVAL_S
    assert as_request({"prompt_ids": [1], "max_new_tokens": 2, "arrival_s": MAX_ARRIVAL_S}, 0).arrival_s == MAX_ARRIVAL_S
    with pytest.raises(ValueError, match="arrival_s"):
        as_request({"prompt_ids": [1], "max_new_tokens": 2, "arrival_s": MAX_ARRIVAL_S + 1}, 0)
