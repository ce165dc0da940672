"""Stream completions from any OpenAI-compatible server and time each token: the engine's meters on a real server.

vLLM, SGLang, TGI and llama.cpp's server all speak `POST /v1/completions` with `"stream": true`, which
sends one server-sent event (`data: {...}`) per generated token. The client sends token-id prompts,
notes when each event reaches it on one monotonic clock, and reports TTFT, TPOT and ITL with the
definitions in labutils.perf.timing, counted from each request's arrival, so time spent queueing counts.
Only the standard library is used: one thread per request in flight, bounded by max_concurrency.
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from labutils.perf import timing
from labutils.core.validate import check_count, check_number, check_positive, check_prompt_ids
from labutils.serving.workload import MAX_ARRIVAL_S, Request   # one request type drives the course's engine and a server

# vLLM's extensions to the OpenAI API: the ids of each streamed token (a server started with
# --skip-tokenizer-init streams no text at all), and running to max_tokens, as the course's engine
# does when a request has no eos_id. Pass extra_body={} to a server that refuses unknown fields.
DEFAULT_EXTRA_BODY = {"return_token_ids": True, "ignore_eos": True}


@dataclass
class StreamResult:
    """What one request got back: each token with the time it reached the client."""

    id: int
    prompt_len: int
    max_new_tokens: int
    arrival_s: float                                        # when it was due, seconds after the workload start
    tokens: list[int | None] = field(default_factory=list)  # None where a server streamed text without ids
    timestamps: list[float] = field(default_factory=list)   # per token, seconds after arrival_s
    finish_reason: str | None = None                        # the server's ("length", "stop"), or "error"
    error: str | None = None                                # what went wrong, when finish_reason is "error"
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.finish_reason not in (None, "error")

    @property
    def ttft_s(self) -> float:
        return timing.ttft_s(self.timestamps) if self.timestamps else float("nan")

    @property
    def tpot_s(self) -> float:
        return timing.tpot_s(self.timestamps) if self.timestamps else float("nan")

    @property
    def itl_s(self) -> list[float]:
        return timing.itl_s(self.timestamps) if self.timestamps else []

    @property
    def latency_s(self) -> float:
        return self.timestamps[-1] if self.timestamps else float("nan")


class ServerError(RuntimeError):
    """The server answered, but with an error (an HTTP error status, or an error event mid-stream)."""


def as_request(r, index: int) -> Request:
    """A Request from a Request, any object with the same attributes, or a mapping; refuse bad values."""
    get = r.get if isinstance(r, Mapping) else lambda k, d=None: getattr(r, k, d)
    ids, n, arrival = get("prompt_ids"), get("max_new_tokens"), get("arrival_s", 0.0)
    where = f"request {index}"
    if ids is None or n is None:
        raise TypeError(f"{where} is a {type(r).__name__}; a request needs prompt_ids and max_new_tokens "
                        "(and optionally arrival_s, id): use labutils.serving.workload.Request")
    ids = check_prompt_ids(f"{where}: prompt_ids", ids)      # the server's vocabulary is unknown here: ids >= 0
    n = check_count(f"{where}: max_new_tokens", n, 1)
    arrival = check_number(f"{where}: arrival_s", arrival, minimum=0, maximum=MAX_ARRIVAL_S,
                           hint="seconds after the run starts, on the real clock (an hour at most, as the engine)")
    rid = get("id")
    return Request(ids, n, arrival, index if rid is None else rid)


def _chunk_tokens(chunk, server: str) -> tuple[list[int | None], str, str | None]:
    """(token ids, text, finish_reason) of one streamed completion chunk; a chunk of another shape is the server's
    mistake, said as a ServerError that names the server and what its reply held."""
    def wrong(what: str) -> ServerError:
        return ServerError(f"{server} streamed a chunk whose {what}; an OpenAI completions chunk is "
                           "{'choices': [{'text': ..., 'token_ids': [...], 'finish_reason': ...}]}: "
                           "is it an OpenAI-compatible completions server?")
    if not isinstance(chunk, dict):
        raise wrong(f"JSON is a {type(chunk).__name__} ({_cut(chunk)}), not an object")
    choices = chunk.get("choices") or []
    if not isinstance(choices, list):
        raise wrong(f"'choices' is a {type(choices).__name__} ({_cut(choices)}), not a list")
    if not choices:                       # e.g. a usage-only chunk
        return [], "", None
    c = choices[0]
    if not isinstance(c, dict):
        raise wrong(f"choices[0] is a {type(c).__name__} ({_cut(c)}), not an object")
    text = c.get("text") or ""
    if not isinstance(text, str):
        raise wrong(f"choices[0]['text'] is a {type(text).__name__} ({_cut(text)}), not a string")
    ids = c.get("token_ids")              # vLLM and SGLang with return_token_ids
    if ids is None:
        ids = [None] if text else []      # a text-only server: one chunk is one token, id unknown
    elif not isinstance(ids, list):
        raise wrong(f"choices[0]['token_ids'] is a {type(ids).__name__} ({_cut(ids)}), not a list")
    return list(ids), text, c.get("finish_reason")


def _cut(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _model_names(body: bytes, where: str) -> list[str]:
    """The names in a /v1/models reply, {"data": [{"id": name, ...}, ...]}; any other reply says what it held."""
    def wrong(what: str) -> ConnectionError:
        return ConnectionError(f"{where} did not return an OpenAI model list ({{'data': [{{'id': ...}}]}}): {what}; "
                               "is it an OpenAI-compatible server?")
    try:
        reply = json.loads(body)
    except ValueError:
        raise wrong(f"its reply is not JSON ({_cut(body[:200])})") from None
    if not isinstance(reply, dict) or "data" not in reply:
        raise wrong(f"its reply is a {type(reply).__name__} without 'data' ({_cut(reply)})")
    if not isinstance(reply["data"], list):
        raise wrong(f"its 'data' is a {type(reply['data']).__name__} ({_cut(reply['data'])}), not a list")
    for i, m in enumerate(reply["data"]):
        if not isinstance(m, dict) or not isinstance(m.get("id"), str):
            raise wrong(f"data[{i}] has no model name 'id' ({_cut(m)})")
    return [m["id"] for m in reply["data"]]


class OpenAIClient:
    """Streams completions from an OpenAI-compatible server at base_url (e.g. "http://127.0.0.1:8000").

    model=None asks the server (GET /v1/models) and uses the first model it serves. Every request is
    greedy (temperature 0), so its tokens can be compared with the course's generate().
    """

    def __init__(self, base_url: str, model: str | None = None, *, timeout_s: float = 60.0,
                 extra_body: dict | None = None, api_key: str | None = None):
        if not isinstance(base_url, str):
            raise TypeError(f"base_url must be a string such as 'http://127.0.0.1:8000', got {type(base_url).__name__}")
        try:
            parts = urlsplit(base_url)
        except ValueError as err:           # e.g. an unclosed IPv6 bracket: urllib says only "Invalid IPv6 URL"
            raise ValueError(f"base_url={base_url!r} is not a URL ({err}); write it like 'http://127.0.0.1:8000' "
                             "(an IPv6 host in brackets: 'http://[::1]:8000')") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url={base_url!r} is not an http(s) URL; write it like 'http://127.0.0.1:8000'")
        try:
            parts.port                       # urllib checks the port only when asked
        except ValueError:
            raise ValueError(f"base_url={base_url!r} has no valid port (0 to 65535); write it like "
                             "'http://127.0.0.1:8000'") from None
        if model is not None and not isinstance(model, str):
            raise TypeError(f"model must be the served model's name (a str) or None for the server's first, got "
                            f"{type(model).__name__} {model!r}")
        check_positive("timeout_s", timeout_s)
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self._scheme, self._host, self._port = parts.scheme, parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/").removesuffix("/v1")
        self.timeout_s = float(timeout_s)
        self.extra_body = dict(DEFAULT_EXTRA_BODY if extra_body is None else extra_body)
        self._headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.model = model

    def _connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self.timeout_s)

    def models(self) -> list[str]:
        """The model names the server serves; also the check that it is there at all."""
        conn = self._connection()
        try:
            conn.request("GET", self._prefix + "/v1/models", headers=self._headers)
            resp = conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException) as err:
            raise ConnectionError(f"cannot reach an OpenAI-compatible server at {self.base_url} "
                                  f"({type(err).__name__}: {err}); "
                                  "start the server (for vLLM: `make vllm`, then "
                                  "labutils.serving.vllm_server.VLLMServer) or fix the URL") from None
        finally:
            conn.close()
        if resp.status != 200:
            raise ConnectionError(f"{self.base_url}/v1/models answered HTTP {resp.status} "
                                  f"({body[:200].decode(errors='replace')}); is it an OpenAI-compatible server?")
        return _model_names(body, f"{self.base_url}/v1/models")

    def _model(self) -> str:
        if self.model is None:
            served = self.models()
            if not served:
                raise ConnectionError(f"the server at {self.base_url} serves no model")
            self.model = served[0]
        return self.model

    def complete(self, prompt_ids, max_new_tokens: int) -> StreamResult:
        """One greedy request, sent now; its clock starts now."""
        req = as_request({"prompt_ids": prompt_ids, "max_new_tokens": max_new_tokens}, 0)
        self._model()
        return self._stream(req, time.perf_counter())

    def run(self, requests: Iterable, *, max_concurrency: int = 8) -> list[StreamResult]:
        """Send each request at its arrival_s, at most max_concurrency in flight; results in workload order.

        `requests` is a list of Request (or objects or dicts with prompt_ids, max_new_tokens and
        optionally arrival_s and id), or a workload object whose .requests is such a list.

        A request that finds every slot busy waits, and that wait is part of its TTFT. A request the
        server fails (an HTTP error, an error event, a dropped stream) comes back with
        finish_reason "error" and the error text; the others go on.
        """
        max_concurrency = check_count("max_concurrency", max_concurrency, 1)
        # A workload object that holds its requests (labutils.serving's) drives the client as it drives the engine.
        reqs = [as_request(r, i) for i, r in enumerate(getattr(requests, "requests", requests))]
        self._model()                         # unreachable server: fail now, naming the URL
        results: list[StreamResult | None] = [None] * len(reqs)
        with ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="openai-client") as pool:
            futures = {}
            t0 = time.perf_counter()
            for i in sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s):
                due = t0 + reqs[i].arrival_s
                if (wait := due - time.perf_counter()) > 0:
                    time.sleep(wait)
                futures[i] = pool.submit(self._stream, reqs[i], due)
            for i, f in futures.items():
                results[i] = f.result()
        return results

    def _check_chunk(self, ids: list, finish, n_before: int, max_tokens: int) -> None:
        """Refuse a streamed chunk no correct server sends: its ids must be token ids, within max_tokens."""
        bad = [t for t in ids if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0)]
        if bad:
            raise ServerError(f"{self.base_url} streamed token ids that are not non-negative ints: {bad[:3]!r}; "
                              "is it an OpenAI-compatible completions server with return_token_ids?")
        if n_before + len(ids) > max_tokens:
            raise ServerError(f"{self.base_url} streamed {n_before + len(ids)} tokens for max_tokens={max_tokens}")
        if finish is not None and not isinstance(finish, str):
            raise ServerError(f"{self.base_url} sent finish_reason={finish!r}; the API's finish_reason is a string "
                              "such as 'length' or 'stop'")

    def _stream(self, req: Request, start: float) -> StreamResult:
        """Send one request and read its event stream; `start` is its arrival on the perf_counter clock."""
        res = StreamResult(req.id, len(req.prompt_ids), req.max_new_tokens, req.arrival_s)
        # top_k and seed: vLLM's extras
        sampling = {k: v for k, v in dataclasses.asdict(req.sampling).items() if v is not None}
        body = {"model": self.model, "prompt": list(req.prompt_ids), "max_tokens": req.max_new_tokens,
                "stream": True, **sampling, **self.extra_body}
        conn = self._connection()
        try:
            conn.request("POST", self._prefix + "/v1/completions", body=json.dumps(body), headers=self._headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise ServerError(f"{self.base_url} answered HTTP {resp.status}: "
                                  f"{resp.read(500).decode(errors='replace')}")
            for line in resp:                 # one SSE line at a time, as it arrives
                now = time.perf_counter()
                if not line.startswith(b"data:"):
                    continue                  # blank separators and ": keep-alive" comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    raise ServerError(f"{self.base_url} streamed an event that is not JSON: {_cut(data)}") from None
                if isinstance(chunk, dict) and ("error" in chunk or chunk.get("object") == "error"):
                    raise ServerError(f"{self.base_url} sent an error event mid-stream: {chunk.get('error', chunk)}")
                ids, text, finish = _chunk_tokens(chunk, self.base_url)
                self._check_chunk(ids, finish, len(res.tokens), req.max_new_tokens)
                res.tokens += ids
                res.timestamps += [now - start] * len(ids)
                res.text += text
                res.finish_reason = finish or res.finish_reason
            if res.finish_reason is None:
                raise ServerError(f"{self.base_url}'s stream ended after {len(res.tokens)} tokens without a "
                                  "finish_reason")
        except (OSError, http.client.HTTPException, ValueError, ServerError) as err:
            res.finish_reason, res.error = "error", f"{type(err).__name__}: {err}"
        finally:
            conn.close()
        return res
