"""kvrun serve under hostile requests (issue 46): each case gets a status (a 4xx, or a bounded
answer) within a bound, and the server stays healthy after it (/health 200 and a completion).

One server on a tiny model with small limits: 1 MiB bodies, a 128-token context, a 2 s read
timeout, 16 connections and an API key. KVRUN_HOSTILE_TABLE=path writes the table of cases
(case, status, seconds, healthy after) as markdown."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_serve import Served

import tiny_models

pytestmark = pytest.mark.slow  # a server process

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
CTX = 128
READ_TIMEOUT = 2.0
MAX_CONNECTIONS = 16
QUICK = 10.0  # seconds: a bound on an answer that must not depend on the body's size
ROWS: list[tuple[str, str, str, float, bool]] = []  # (case, request, status, seconds, healthy)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models.build(tmp_path_factory.mktemp("hostile"))


@pytest.fixture(scope="module")
def server(tiny):
    s = Served(tiny.gguf_path, "-np", "2", "--queue", "8", "--max-body", "1", "-c", str(CTX),
               "--read-timeout", str(READ_TIMEOUT), "--max-connections", str(MAX_CONNECTIONS),
               "--api-key", KEY, weights=[])  # fmt: skip
    yield s
    s.stop()
    path = os.environ.get("KVRUN_HOSTILE_TABLE")
    if path:
        lines = [
            "| case | request | status | time (s) | server healthy after |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {c} | {r} | {st} | {t:.2f} | {'yes' if h else 'NO'} |" for c, r, st, t, h in ROWS
        ]
        Path(path).write_text("\n".join(lines) + "\n")


def base(server) -> str:
    return server.url.removesuffix("/v1")


def healthy(server) -> bool:
    """/health answers 200 and a short completion works."""
    if server.health() != 200:
        return False
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{server.url}/completions", json=body, headers=AUTH, timeout=30)
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def record(server, case: str, request: str, status, seconds: float, bound: float = QUICK):
    ok = healthy(server)
    ROWS.append((case, request, str(status), seconds, ok))
    assert seconds < bound, f"{case}: {seconds:.1f} s"
    assert ok, f"{case}: the server is not healthy after it"


def post(server, case: str, request: str, body, path="/v1/completions", headers=AUTH):
    """POST a JSON body (bytes: sent as they are; else compact JSON, so a body's size does not
    depend on httpx's separators); the response, recorded by record()."""
    raw = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    kw = {"content": raw}
    kw["headers"] = {"Content-Type": "application/json", **headers}
    t = time.monotonic()
    r = httpx.post(base(server) + path, timeout=60, **kw)
    seconds = time.monotonic() - t
    record(server, case, request, r.status_code, seconds)
    return r


def error(r, status: int, code: str) -> str:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == code and err["type"], err
    assert "\n" not in err["message"] and "Traceback" not in err["message"]
    return err["message"]


def nested(depth: int) -> bytes:
    inner = b"[" * (depth - 1) + b"]" * (depth - 1)
    # under "metadata", a field that changes no reply (an unknown one is a 400 of its own)
    return b'{"model": "smollm2", "prompt": "Hi", "max_tokens": 1, "metadata": ' + inner + b"}"


def test_a_body_over_the_size_limit(server):
    body = {"model": "smollm2", "prompt": "x" * (2 << 20)}
    error(post(server, "body over --max-body", "2 MiB prompt, limit 1 MiB", body), 413,
          "request_too_large")  # fmt: skip


@pytest.mark.parametrize(
    "depth,request_",
    [(100_000, "JSON nested 100,000 deep"), (65, "JSON nested 65 deep (limit 64)")],
    ids=["100000", "65"],
)
def test_deeply_nested_json(server, depth, request_):
    msg = error(post(server, "deeply nested JSON", request_, nested(depth)), 400, "invalid_json")
    assert "64 levels" in msg


def test_nesting_within_the_limit_is_served(server):
    r = post(server, "nested JSON within the limit", "metadata nested 60 deep", nested(60))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "name,request_,body,status,code",
    [
        ("huge JSON: token ids", "a prompt of 300,000 token ids (~0.9 MiB)",
         {"model": "smollm2", "prompt": [1] * 300_000}, 400, "context_length_exceeded"),
        ("huge JSON: text", "a 1,000,000-character prompt (not tokenized)",
         {"model": "smollm2", "prompt": "ab " * 333_000}, 400, "context_length_exceeded"),
        ("huge JSON: many prompts", "1,000 prompts (limit --queue + -np = 10)",
         {"model": "smollm2", "prompt": [[1, 2]] * 1000}, 400, "too_many_prompts"),
        ("huge JSON: many bad items", "messages: 400,000 integers",
         {"model": "smollm2", "messages": [1] * 400_000}, 422, "invalid_value"),
        ("huge JSON: many bad items", "messages: 2,048 messages of 64 wrong parts",
         {"model": "smollm2", "messages": [{"role": "user", "content": [{}] * 64}] * 2048},
         422, "invalid_value"),
    ],
    ids=["ids", "text", "prompts", "items", "parts"],
)  # fmt: skip
def test_huge_json(server, name, request_, body, status, code):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    error(post(server, name, request_, body, path), status, code)


def test_huge_chat_messages_are_not_rendered(server):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "ab " * 330_000}]}
    r = post(server, "huge JSON: chat", "a 990,000-character message", body,
             "/v1/chat/completions")  # fmt: skip
    error(r, 400, "context_length_exceeded")


def test_max_tokens_beyond_the_context_is_clamped(server):
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 10**12, "temperature": 0}
    r = post(server, "max_tokens beyond the context", "max_tokens 10^12, context 128", body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert 0 < usage["completion_tokens"] and usage["total_tokens"] <= CTX


@pytest.mark.parametrize(
    "request_,stop,status",
    [
        ("5,000 stop strings (limit 16)", ["a"] * 5000, 422),
        ("one 5,000-character stop string (limit 2,048 in all)", ["ab" * 2500], 422),
        ("16 stop strings of 128 characters (honoured)", [f"{i:02d}" * 64 for i in range(16)], 200),
    ],
    ids=["many", "long", "at-the-limit"],
)
def test_stop_strings(server, request_, stop, status):
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 40, "stop": stop}
    r = post(server, "stop strings", request_, body)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        assert "stop" in error(r, status, "invalid_value")


@pytest.mark.parametrize(
    "request_,bias,status,code",
    [
        ("logit_bias key outside the vocabulary", {"99999999": 5}, 400, "invalid_value"),
        ("logit_bias key not a token id", {"the": 5}, 400, "invalid_value"),
        ("logit_bias value 500 (range -100..100)", {"5": 500}, 400, "invalid_value"),
        ("logit_bias of 5,000 entries (limit 1,024)", {str(i): 0 for i in range(5000)}, 422,
         "invalid_value"),
        ("logit_bias in range, not 0", {"5": 10}, 400, "unsupported"),
        ("logit_bias in range, all 0 (honoured)", {"5": 0, "7": 0}, 200, None),
    ],
    ids=["key-range", "key-text", "value-range", "many", "unsupported", "zero"],
)  # fmt: skip
def test_logit_bias(server, request_, bias, status, code):
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "logit_bias": bias}
    r = post(server, "logit_bias", request_, body)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        error(r, status, code)


@pytest.mark.parametrize(
    "request_,raw,code",
    [
        ("invalid UTF-8 in a string", b'{"model": "smollm2", "prompt": "\xff\xfe"}', "invalid_utf8"),
        ("a UTF-16 body", json.dumps({"model": "smollm2", "prompt": "Hi"}).encode("utf-16"),
         "invalid_utf8"),
        ("an unpaired surrogate escape", b'{"model": "smollm2", "prompt": "\\ud800x"}',
         "invalid_value"),
        ("NaN in the body", b'{"model": "smollm2", "prompt": "Hi", "temperature": NaN}',
         "invalid_json"),
    ],
    ids=["utf8", "utf16", "surrogate", "nan"],
)  # fmt: skip
def test_invalid_text(server, request_, raw, code):
    error(post(server, "invalid UTF-8 / JSON", request_, raw), 400, code)


def test_n_above_1(server):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "n": 3}
    r = post(server, "n > 1", "n: 3", body, "/v1/chat/completions")
    assert "n > 1" in error(r, 400, "unsupported")


@pytest.mark.parametrize(
    "request_,extra,status",
    [
        ("temperature 1e-300 (greedy)", {"temperature": 1e-300}, 200),
        ("top_p 1e-300 (the top token)", {"top_p": 1e-300, "temperature": 1}, 200),
        ("repeat_penalty 1e-300", {"repeat_penalty": 1e-300, "temperature": 1}, 422),
        ("seed 10^30", {"seed": 10**30}, 422),
    ],
    ids=["temperature", "top_p", "repeat_penalty", "seed"],
)
def test_extreme_sampling_values(server, request_, extra, status):
    """Values that overflowed float32 (NaN probabilities) or torch's seed failed the engine's
    whole step, every sequence in it, and left the request unanswered."""
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 6, "seed": 1} | extra
    r = post(server, "extreme sampling values", request_, body)
    if status != 200:
        error(r, status, "invalid_value")
        return
    assert r.status_code == 200, r.text
    greedy = httpx.post(f"{server.url}/completions", headers=AUTH, timeout=30,
                        json=body | {"temperature": 0, "top_p": 1}).json()  # fmt: skip
    assert r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_api_key_is_compared_in_constant_time(server):
    """A wrong key of any length gets 401 (the comparison is hmac.compare_digest over SHA-256
    digests, kvrun.server.app.Server._auth); /health needs none."""
    t = time.monotonic()
    codes = []
    for key in ("sesamf", "s", "sesame" * 100, None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        codes.append(httpx.get(f"{server.url}/models", headers=headers, timeout=10).status_code)
    assert codes == [401] * 4
    assert httpx.get(f"{server.url}/models", headers=AUTH, timeout=10).status_code == 200
    record(server, "--api-key", "wrong keys of 1, 6, 600 characters, none", 401,
           time.monotonic() - t)  # fmt: skip
    import inspect

    from kvrun.server.app import Server

    assert "hmac.compare_digest" in inspect.getsource(Server._auth)


def raw(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=READ_TIMEOUT + 10)


def read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def closed(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        s.setblocking(True)


def test_idle_connections_neither_block_health_nor_streams(server):
    """A stream runs; 3 x --max-connections clients connect and send nothing: /health and a
    completion are served at once (the longest-idle connections are closed to make room), the
    stream ends normally, and every idle connection is closed within --read-timeout."""
    body = {"model": "smollm2", "prompt": "1, 2, 3,", "max_tokens": 100, "stream": True}
    events: list[str] = []
    with httpx.Client(timeout=60) as h, h.stream("POST", f"{server.url}/completions", json=body,
                                                 headers=AUTH) as stream:  # fmt: skip
        lines = (x for x in stream.iter_lines() if x.startswith("data:"))
        events.append(next(lines))
        t = time.monotonic()
        idle = [raw(server) for _ in range(3 * MAX_CONNECTIONS)]
        assert server.health() == 200
        assert healthy(server)
        seconds = time.monotonic() - t
        events.extend(lines)
    assert events[-1] == "data: [DONE]" and len(events) > 3
    time.sleep(0.2)
    assert sum(closed(s) for s in idle) >= 2 * MAX_CONNECTIONS - 2  # made room
    deadline = time.monotonic() + READ_TIMEOUT + 5
    for s in idle:
        s.settimeout(max(deadline - time.monotonic(), 0.1))
        assert read_all(s) == b""  # closed, nothing sent: they sent nothing either
        s.close()
    record(server, "idle connections", f"{3 * MAX_CONNECTIONS} connections that send nothing "
           f"(--max-connections {MAX_CONNECTIONS}), beside a stream", "closed", seconds)  # fmt: skip


def test_headers_sent_slowly_get_408(server):
    s = raw(server)
    t = time.monotonic()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")

    def drip():
        try:
            for _ in range(20):
                s.sendall(b"X-Slow: 1\r\n")
                time.sleep(0.3)
        except OSError:
            pass

    threading.Thread(target=drip, daemon=True).start()
    out = read_all(s)
    seconds = time.monotonic() - t
    s.close()
    assert out.startswith(b"HTTP/1.1 408"), out[:100]
    assert json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    record(server, "slow headers", "one header line every 0.3 s", 408, seconds,
           READ_TIMEOUT + 3)  # fmt: skip
    assert seconds >= READ_TIMEOUT - 0.5


def slow_body(server) -> socket.socket:
    s = raw(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"mo")  # fmt: skip
    return s


def test_a_body_sent_slowly_gets_408(server):
    t = time.monotonic()
    s = slow_body(server)
    out = read_all(s)
    seconds = time.monotonic() - t
    s.close()
    assert out.startswith(b"HTTP/1.1 408"), out[:100]
    assert b"request_timeout" in out
    record(server, "slow body", "4 of 100 body bytes, then nothing", 408, seconds,
           READ_TIMEOUT + 3)  # fmt: skip


def test_connections_all_busy_get_503(server):
    """--max-connections connections each in the middle of a request (a body that does not
    come): a new request gets 503 with Retry-After; once their bodies time out, requests are
    served again."""
    busy = [slow_body(server) for _ in range(MAX_CONNECTIONS)]
    time.sleep(0.3)
    t = time.monotonic()
    r = httpx.get(f"{base(server)}/health", timeout=10)
    seconds = time.monotonic() - t
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["code"] == "too_many_connections"
    for s in busy:
        assert read_all(s).startswith(b"HTTP/1.1 408")
        s.close()
    record(server, "every connection busy", f"{MAX_CONNECTIONS} unfinished bodies, then GET "
           "/health", 503, seconds)  # fmt: skip


def test_huge_headers_get_400(server):
    s = raw(server)
    t = time.monotonic()
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
    except OSError:  # the server answered and closed before all of it was sent
        pass
    out = read_all(s)
    seconds = time.monotonic() - t
    s.close()
    assert out.startswith(b"HTTP/1.1 400"), out[:100]
    record(server, "huge headers", "a 1 MiB header (h11's limit: 16 KiB)", 400, seconds)


def test_an_engine_failure_ends_every_job_it_held(tiny):
    """The engine thread on its own: a job that fails the engine's step (here a seed torch
    refuses, which the HTTP side now turns away with 422) ends with an error, as does every
    job the engine had drawn; none is left unanswered, and the next job is served."""
    from kvrun.kv import check
    from kvrun.models.config import SamplingConfig
    from kvrun.run.runtime import load_runtime
    from kvrun.run.session import Session
    from kvrun.server.worker import EngineThread, HttpJob, StopText

    rt = load_runtime(str(tiny.gguf_path), "float32", "cpu", log=lambda m: None)
    spec, greedy = check("full"), SamplingConfig(temp=0.0)

    class Metrics:
        def __getattr__(self, name):
            return lambda *args: None

    def session(rt, kv):
        return Session(rt.model, rt.tokenizer, kv, ubatch=64)

    worker = EngineThread(lambda: rt, 1, None, session, Metrics(), spec)
    worker.start()
    ids = rt.tokenizer.encode(tiny_models.TEXT)

    async def run(seeds: list[int]) -> list[str | None]:
        loop, jobs = asyncio.get_running_loop(), []
        for seed in seeds:
            job = HttpJob(ids, 4, greedy, seed, spec, stop=StopText([]))
            job.loop, job.events = loop, asyncio.Queue()
            worker.submit(job)
            jobs.append(job)
        ends = []
        for job in jobs:
            while (ev := await asyncio.wait_for(job.events.get(), 30))[0] != "end":
                pass
            ends.append(ev[2])
        return ends

    try:
        assert worker.ready.wait(60), worker.load_error
        ends = asyncio.run(run([10**30, 1, 2]))
        assert "the engine failed" in ends[0]
        assert all(e is None or "the engine failed" in e for e in ends[1:])
        assert asyncio.run(run([3])) == [None]
        assert worker.waiting == 0
    finally:
        worker.close()
