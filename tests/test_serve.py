"""kvrun serve end to end: a server subprocess on a free loopback port with the default model,
driven by the official `openai` client and by raw HTTP (httpx)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from kvrun.server import wait_ready

pytestmark = pytest.mark.slow  # a server process

WEIGHTS = ["--wtype", "f32"]  # the dense reference path: what default_runtime loads
CTX = 1024
CHAT = [{"role": "user", "content": "Name three colors of the rainbow."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A `kvrun serve` subprocess; `url` is its /v1 base."""

    def __init__(self, gguf, *args: str, weights: list[str] = WEIGHTS):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        cmd = [sys.executable, "-m", "kvrun", "serve", "-m", str(gguf), "--alias", "smollm2",
               "--port", str(self.port), "-c", str(CTX), *weights, *args]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvrun-serve-{self.port}.log"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log.open("w"),
                                     env=env)  # fmt: skip
        try:
            wait_ready(f"http://127.0.0.1:{self.port}/health", self.proc, timeout=120)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{e}: {self.log.read_text()[-2000:]}") from None

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=300)

    def health(self) -> int:
        return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=10).status_code

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url.removesuffix('/v1')}/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


@pytest.fixture(scope="module")
def server(default_gguf):
    # float32 caches: test_logprobs_and_echo compares the server's log-probabilities with
    # kvrun perplexity's to 1e-4; in f16 the two paths round keys at different steps (2e-3)
    s = Served(default_gguf, "-np", "2", "--queue", "64", "--max-body", "1", "--kv-dtype", "f32")
    yield s
    s.stop()


def kvrun_generate(gguf, *args: str) -> dict:
    """`kvrun generate --json` greedy, on the same weights and cache type as the server."""
    cmd = [sys.executable, "-m", "kvrun", "generate", "-m", str(gguf), "--json", "--temp", "0",
           "-c", str(CTX), "--kv-dtype", "f32", *WEIGHTS, *args]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout)


def test_chat_and_completions_equal_kvrun_generate(server, default_gguf):
    """Greedy chat (plain and streamed) and completions equal `kvrun generate` with the same
    prompt, method and budget; usage reports the cache's bytes."""
    c = server.client()
    ref = kvrun_generate(default_gguf, "-p", CHAT[0]["content"], "-n", "24")
    r = c.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == ref["text"]
    assert r.usage.prompt_tokens == ref["prompt_tokens"]
    assert r.usage.completion_tokens == ref["generated_tokens"]
    assert r.usage.model_extra["kv_bytes"] == r.usage.model_extra["kv_bytes_full"] > 0
    parts, usage, finish = [], None, None
    stream = c.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=24,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    for ch in stream:
        if ch.usage:
            usage = ch.usage
        for choice in ch.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == ref["text"]
    assert usage.completion_tokens == ref["generated_tokens"]
    assert finish == ("stop" if ref["stop_reason"] == "eos" else "length")

    prompt = "The history of the printing press begins " * 12
    snap = kvrun_generate(default_gguf, "--raw", "-p", prompt, "-n", "16",
                          "--kv", "snapkv", "--kv-budget", "0.25")  # fmt: skip
    r = c.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0,
                             extra_body={"kv": "snapkv", "kv_budget": 0.25})  # fmt: skip
    assert r.choices[0].text == snap["text"]
    extra = r.usage.model_extra
    assert extra["kv_bytes"] == snap["kv_bytes"] < extra["kv_bytes_full"] == snap["kv_bytes_full"]


def test_logprobs_and_echo(server, default_runtime):
    """echo + logprobs with max_tokens 0 (lm-evaluation-harness's log-likelihood request):
    every prompt token's log-probability equals kvrun perplexity's per-token value (1e-4);
    generated tokens carry their logprob and top alternatives, chat's as well."""
    from kvrun.run.session import Session
    from kvrun.tasks.perplexity import evaluate, file_tokens

    tok = default_runtime.tokenizer
    text = Path(__file__).with_name("test_serve.py").read_text()[:1500]
    ids = file_tokens(tok, text)[:200]
    context = 120
    sess = Session(default_runtime.model, tok, default_runtime.new_kv())
    rep = evaluate(sess, None, ids, context, len(ids) - context)
    c = server.client()
    r = c.completions.create(model="smollm2", prompt=ids, max_tokens=0, echo=True, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
    assert r.choices[0].text == tok.decode(ids)
    got = lp.token_logprobs[context:]
    want = [-x for x in rep.windows[0].token_nll]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert len(top) <= 3 and max(top.values()) >= value - 1e-6
    r = c.completions.create(model="smollm2", prompt="One, two, three,", max_tokens=5,
                             temperature=0, logprobs=2)  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and "".join(lp.tokens) == r.choices[0].text
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert abs(max(top.values()) - value) < 1e-5  # greedy: the chosen token is the best
    r = c.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4, temperature=0,
                                  logprobs=True, top_logprobs=2)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(
        len(e.top_logprobs) == 2 for e in content
    )
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_concurrent_streams_equal_sequential_runs(server):
    """Eight streaming clients at once (threads), mixed methods, on two slots: each text equals
    the same request run alone."""
    methods = [("full", None), ("snapkv", 0.5), ("kivi2", None), ("h2o", 0.5),
               ("streaming", 0.5), ("tova", 0.5), ("minikv", None), ("knorm", 0.5)]  # fmt: skip
    c = server.client()

    def run(i: int) -> str:
        kv, budget = methods[i]
        extra = {"kv": kv} | ({"kv_budget": budget} if budget else {})
        msgs = [{"role": "user", "content": f"Write a sentence about the number {i + 3}."}]
        stream = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=12,
                                           temperature=0, stream=True, extra_body=extra)  # fmt: skip
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

    alone = [run(i) for i in range(len(methods))]
    with ThreadPoolExecutor(len(methods)) as pool:
        together = list(pool.map(run, range(len(methods))))
    assert together == alone
    assert all(alone)


def test_a_client_that_leaves_frees_its_slot(server):
    """Two slots busy with long streams; one client disconnects: a new request is admitted and
    finishes while the other long stream is still going (closed then, it too counts as
    cancelled: had it ended first it would count as ok)."""
    long_body = {"model": "smollm2", "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 300,
                 "temperature": 0, "stream": True}  # fmt: skip
    before = server.metric('kvrun_requests_total{outcome="cancelled"}')
    with httpx.Client(timeout=120) as h1, httpx.Client(timeout=120) as h2:
        with h1.stream("POST", f"{server.url}/completions", json=long_body) as a, \
                h2.stream("POST", f"{server.url}/completions", json=long_body) as b:  # fmt: skip
            lines_a, lines_b = a.iter_lines(), b.iter_lines()
            for _ in range(4):  # both are streaming
                next(x for x in lines_a if x.startswith("data:"))
                next(x for x in lines_b if x.startswith("data:"))
            a.close()  # the first client leaves
            c = server.client()
            r = c.completions.create(model="smollm2", prompt="Hello", max_tokens=3, temperature=0)
            assert r.usage.completion_tokens >= 1
            b.close()  # still streaming: its end is counted as cancelled below, not ok
    deadline = time.monotonic() + 30
    while server.metric('kvrun_requests_total{outcome="cancelled"}') < before + 2:
        assert time.monotonic() < deadline, "the disconnected streams were not cancelled"
        time.sleep(0.2)
    assert server.health() == 200


BAD = [  # (name, method, path, body or raw bytes, headers, status, code)
    ("malformed json", "POST", "/v1/chat/completions", b'{"model": "smollm2", "mess', {}, 400, "invalid_json"),
    ("not an object", "POST", "/v1/chat/completions", b"[1, 2]", {}, 400, "invalid_json"),
    ("wrong type", "POST", "/v1/chat/completions",
     {"model": "smollm2", "messages": CHAT, "max_tokens": "ten"}, {}, 422, "invalid_value"),
    ("missing field", "POST", "/v1/chat/completions", {"model": "smollm2"}, {}, 422, "invalid_value"),
    ("empty messages", "POST", "/v1/chat/completions", {"model": "smollm2", "messages": []}, {}, 422, "invalid_value"),
    ("unknown kv", "POST", "/v1/chat/completions",
     {"model": "smollm2", "messages": CHAT, "kv": "zip9"}, {}, 400, "invalid_kv"),
    ("bad kv option", "POST", "/v1/chat/completions",
     {"model": "smollm2", "messages": CHAT, "kv": "snapkv:speed=9"}, {}, 400, "invalid_kv"),
    ("budget out of range", "POST", "/v1/completions",
     {"model": "smollm2", "prompt": "Hi", "kv": "snapkv", "kv_budget": -1}, {}, 400, "invalid_kv"),
    ("context overflow", "POST", "/v1/completions",
     {"model": "smollm2", "prompt": [5] * (CTX + 10)}, {}, 400, "context_length_exceeded"),
    ("n > 1", "POST", "/v1/chat/completions", {"model": "smollm2", "messages": CHAT, "n": 2}, {}, 400, "unsupported"),
    ("oversized body", "POST", "/v1/completions",
     {"model": "smollm2", "prompt": "x" * (1 << 21)}, {}, 413, "request_too_large"),
    ("unknown route", "GET", "/v1/engines", None, {}, 404, "not_found"),
    ("unknown model", "POST", "/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}, {}, 404, "model_not_found"),
    ("token outside vocab", "POST", "/v1/completions",
     {"model": "smollm2", "prompt": [1, 10**9]}, {}, 400, "invalid_value"),
    ("unknown role", "POST", "/v1/chat/completions",
     {"model": "smollm2", "messages": [{"role": "wizard", "content": "x"}]}, {}, 422, "invalid_value"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error_and_the_server_stays_up(server, case):
    _, method, path, body, headers, status, code = case
    url = server.url.removesuffix("/v1") + path
    kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body else {}
    r = httpx.request(method, url, headers=headers, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]
    assert server.health() == 200


def test_api_key_and_a_full_queue(default_gguf):
    """With --api-key a bad or missing key is 401 (/health needs none); beyond --queue
    waiting requests, 503 with Retry-After; a bounded load (100 short requests from 16
    clients) gets no other error and leaves the server's RSS within 10 % of before."""
    s = Served(default_gguf, "-np", "4", "--queue", "2", "--api-key", "sesame", weights=[])
    try:
        assert s.health() == 200
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.get(f"{s.url}/models", headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        c = s.client("sesame")
        assert c.models.list().data[0].id == "smollm2"
        auth = {"Authorization": "Bearer sesame"}
        body = {"model": "smollm2", "prompt": "Hi there", "max_tokens": 1, "temperature": 0}

        def one(i: int) -> list[tuple[int, str | None]]:
            """One request, sent again after each 503 until it is served: every answer."""
            answers = []
            while not answers or answers[-1][0] == 503:
                if answers:
                    time.sleep(float(answers[-1][1]))  # as Retry-After says
                r = httpx.post(
                    f"{s.url}/completions", json=body | {"seed": i}, headers=auth, timeout=120
                )
                answers.append((r.status_code, r.headers.get("retry-after")))
            return answers

        for i in range(8):  # warm up: first-call allocations are not a leak
            assert one(i) == [(200, None)]
        rss0 = s.rss()
        with ThreadPoolExecutor(16) as pool:
            answers = [a for one_request in pool.map(one, range(100)) for a in one_request]
        codes = [code for code, _ in answers]
        assert set(codes) <= {200, 503}, codes
        assert codes.count(200) == 100 and codes.count(503) > 0  # the queue did turn some away
        assert all(ra == "1" for code, ra in answers if code == 503)
        assert s.rss() <= 1.10 * rss0
        assert s.health() == 200
    finally:
        assert s.stop() == 0


def test_sigterm_ends_streams_with_an_error_and_exits_0(default_gguf):
    s = Served(default_gguf, "-np", "1", "--grace", "1", weights=[])
    body = {"model": "smollm2", "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 900,
            "temperature": 0, "stream": True}  # fmt: skip
    events = []
    with httpx.Client(timeout=60) as h, h.stream("POST", f"{s.url}/completions", json=body) as r:
        lines = (x for x in r.iter_lines() if x.startswith("data:"))
        events.append(next(lines))
        s.proc.send_signal(signal.SIGTERM)
        events.extend(lines)
    assert '"error"' in events[-1] and "shutting down" in events[-1]
    assert not any("[DONE]" in e for e in events)
    assert s.proc.wait(30) == 0
