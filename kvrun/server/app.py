"""kvrun serve's HTTP side: OpenAI's chat and completions endpoints on the engine thread
(kvrun.server.worker), /v1/models, /health and /metrics, on Starlette and uvicorn.

Everything here runs on the event loop and never calls torch: a request is validated
(pydantic, the --kv grammar, the context, --kv-mem), tokenized, and handed to the engine
thread as HttpJobs; their text comes back through an asyncio queue per request. Errors are
OpenAI's error objects; the server stays up after any of them.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import KvrunError
from ..run.grammar import GrammarError, Grammars
from . import tools
from .metrics import Metrics
from .schema import ChatBody, CompletionBody, error_body, validation_message
from .worker import EngineThread, HttpJob, StopText

log = logging.getLogger("kvrun.serve")

MAX_DEPTH = 64  # JSON nesting levels a body may have (a chat body has 5; tool schemas more)
# a text prompt of more UTF-8 bytes than context x (the longest token's bytes) x this cannot fit
# and is refused untokenized (tokenizing megabytes holds the event loop for seconds); the
# margin covers normalizers that compose characters (NFC: up to 3 bytes into 1)
TEXT_MARGIN = 4


@dataclass
class Settings:
    names: list[str]  # the model ids requests may name; the first is /v1/models' id
    default_kv: str
    default_budget: Any
    context: int
    api_key: str | None = None
    queue: int = 256  # waiting requests beyond the slots; more get 503
    max_body: int = 8 * 2**20
    grace: float = 5.0  # seconds in-flight streams get after SIGTERM before an error event
    read_timeout: float = 30.0  # seconds for a request's headers, and again for its body
    max_connections: int = 512
    default_dtype: str = "auto"  # --kv-dtype, for every request's cache


class ApiError(Exception):
    """An OpenAI error object with its HTTP status (kind: its "type")."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param=None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.kind, self.headers = kind, headers


def _error(e: ApiError) -> JSONResponse:
    param = _line(e.param) if isinstance(e.param, str) else e.param
    body = error_body(_line(e.message), e.kind, e.code, param)
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def _line(text: str, limit: int = 1000) -> str:
    """One line of valid UTF-8, at most `limit` characters: a message may quote the client's
    text, with its newlines or an unpaired surrogate (which UTF-8 cannot encode)."""
    text = " ".join(text.splitlines()).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "..."


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


_NESTS = frozenset((dict, list))


def _deeper_than(data: Any, limit: int) -> bool:
    """Whether parsed JSON nests more than `limit` levels (each object or list is one). Level by
    level, without recursion; a list or object without containers in it is passed over at C
    speed (the set of its item types)."""
    level = [data] if type(data) in _NESTS else []
    for _ in range(limit):
        inner = []
        for node in level:
            items = node.values() if type(node) is dict else node
            if not _NESTS.isdisjoint(map(type, items)):
                inner.extend(x for x in items if type(x) in _NESTS)
        if not inner:
            return False
        level = inner
    return True


def parse_json(raw: bytes) -> Any:
    """A body's JSON: 400 unless it is UTF-8 (a BOM is allowed), standard JSON (no NaN or
    Infinity) and at most MAX_DEPTH levels deep. The parser recurses in C, so a deeper body
    raises RecursionError before the depth is measured: both are the same 400."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        msg = f"the body is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})"
        raise ApiError(400, msg, "invalid_utf8") from None
    deep = f"the body nests deeper than {MAX_DEPTH} levels"
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, deep, "invalid_json") from None
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", "invalid_json") from None
    if _deeper_than(data, MAX_DEPTH):
        raise ApiError(400, deep, "invalid_json")
    return data


class Server:
    """The application and what its handlers share (settings, worker, metrics, draining)."""

    def __init__(self, settings: Settings, worker: EngineThread, metrics: Metrics):
        self.s, self.worker, self.metrics = settings, worker, metrics
        self.draining = threading.Event()  # set on SIGTERM / Ctrl-C
        self.drain_t = 0.0
        self.created = int(time.time())
        self._text_bytes: int | None = None  # the longest prompt text that may fit (bytes)
        self._grammars: Grammars | None = None  # built once the model is loaded
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prom, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/completions", self.completions, methods=["POST"]),
        ]
        handlers = {HTTPException: self._http_error, Exception: self._crash}
        self.app = Starlette(routes=routes, exception_handlers=handlers)

    def drain(self) -> None:
        self.drain_t = time.monotonic()
        self.draining.set()

    # ------------------------------------------------------------------ plumbing
    async def _http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return _error(ApiError(exc.status_code, msg, code, kind="invalid_request_error"))

    async def _crash(self, request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return _error(
            ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
        )

    def _auth(self, request: Request) -> None:
        key = self.s.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given.lower().startswith("bearer ") else ""
        # constant time, and over digests of equal length: neither how much of the key a guess
        # got right nor the key's length shows in the time (headers are latin-1: their bytes)
        digest = hashlib.sha256(token.encode("latin-1")).digest()
        if not hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest()):
            msg = "invalid or missing API key (Authorization: Bearer KEY)"
            raise ApiError(401, msg, "invalid_api_key", kind="authentication_error")

    def _ready(self) -> None:
        w = self.worker
        if w.load_error:
            raise ApiError(503, f"the model failed to load: {w.load_error}", kind="server_error")
        if not w.ready.is_set():
            msg = "the model is still loading; retry shortly"
            raise ApiError(503, msg, "loading", kind="server_error", headers={"Retry-After": "2"})
        if self.draining.is_set():
            raise ApiError(503, "the server is shutting down", "shutting_down", kind="server_error")

    async def _read(self, request: Request) -> bytes:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.s.max_body:
            msg = f"the body is {int(size)} bytes; the limit is {self.s.max_body}"
            raise ApiError(413, msg, "request_too_large")
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > self.s.max_body:
                msg = f"the body is over the limit of {self.s.max_body} bytes"
                raise ApiError(413, msg, "request_too_large")
        return bytes(raw)

    async def _body(self, request: Request, model: type[BaseModel]) -> Any:
        t = self.s.read_timeout
        try:  # a client that sends its body slowly holds a connection: not for long
            raw = await asyncio.wait_for(self._read(request), t)
        except asyncio.TimeoutError:
            msg = f"the body did not arrive within {t:g} s (--read-timeout)"
            raise ApiError(408, msg, "request_timeout", headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise ApiError(499, "the client left during its body", "client_closed") from None
        data = parse_json(raw)
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object", "invalid_json")
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            msg, param = validation_message(e)
            raise ApiError(422, msg, "invalid_value", param) from None
        if body.model not in self.s.names:
            msg = f"model {body.model!r} is not served here (serving: {', '.join(self.s.names)})"
            raise ApiError(404, msg, "model_not_found", "model")
        why = body.unsupported()
        if why:
            raise ApiError(400, why, "unsupported", "n" if "n >" in why else None)
        return body

    def _spec(self, body) -> Any:
        from ..kv import check

        kv = body.kv if body.kv is not None else self.s.default_kv
        budget = body.kv_budget
        if budget is None and body.kv is None:  # the server's budget goes with its method
            budget = self.s.default_budget
        try:
            return check(kv, budget).with_dtype(self.s.default_dtype)
        except KvrunError as e:
            raise ApiError(400, str(e), "invalid_kv", "kv") from None

    def _grammar(self, body, forced=None):
        """The grammar spec the body asks for (forced: a tool call's, which excludes the
        others); 400 for a request that asks for two or for a bad schema."""
        try:
            spec = body.grammar_spec()
        except GrammarError as e:
            raise ApiError(400, str(e), "invalid_grammar", "response_format") from None
        if forced is not None and spec is not None:
            msg = "tool_choice required or a named function takes no response_format or grammar"
            raise ApiError(400, msg, "invalid_grammar", "tool_choice")
        return forced if forced is not None else spec

    async def _constraint(self, spec, param: str = "response_format"):
        """A fresh kvrun.run.grammar.Constraint for spec (None for None), compiled off the event
        loop: the first builds the vocabulary's trie (a second), a large grammar takes up to
        as long; 400 for one that does not compile."""
        if spec is None:
            return None
        if self._grammars is None:
            rt = self.worker.runtime
            self._grammars = Grammars(rt.tokenizer, rt.config.vocab_size)
        try:
            return await asyncio.to_thread(self._grammars.compile, spec)
        except GrammarError as e:
            raise ApiError(400, str(e), "invalid_grammar", param) from None

    def _fits(self, n_tokens: int, param: str) -> None:
        ctx = self.s.context
        if n_tokens > ctx:
            msg = (
                f"the prompt is {n_tokens} tokens but the context is {ctx}; shorten it or start "
                "the server with a larger -c"
            )
            raise ApiError(400, msg, "context_length_exceeded", param)

    def _text_limit(self) -> int:
        """Bytes beyond which a prompt text cannot fit the context: each token stands for at
        most the longest token's bytes (TEXT_MARGIN)."""
        if self._text_bytes is None:
            tok, longest = self.worker.runtime.tokenizer, 1
            for i in range(tok.vocab_size):
                try:
                    longest = max(longest, len(tok.decode([i]).encode("utf-8", "replace")))
                except Exception:  # noqa: BLE001 - an id the vocabulary skips: no text
                    continue
            self._text_bytes = self.s.context * longest * TEXT_MARGIN
        return self._text_bytes

    def _encode(self, text: str, param: str) -> list[int]:
        """A prompt text's token ids; 400 for text that is not Unicode (an unpaired surrogate,
        sent as a \\ud800-style escape) or too long to fit whatever its tokens."""
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            msg = f"the {param} holds an unpaired surrogate (U+{ord(text[e.start]):04X})"
            raise ApiError(400, msg, "invalid_value", param) from None
        if size > self._text_limit():
            msg = (
                f"the {param} is {size} bytes, more than {self.s.context} tokens of this "
                "model can hold; shorten it or start the server with a larger -c"
            )
            raise ApiError(400, msg, "context_length_exceeded", param)
        return self.worker.runtime.tokenizer.encode(text)

    def _logit_bias(self, body) -> None:
        """logit_bias: keys token ids of the vocabulary, values in [-100, 100] (OpenAI's
        range), else 400; any value but 0 asks for what kvrun does not do: 400 as well."""
        bias = body.logit_bias
        if not bias:
            return
        vocab = self.worker.runtime.tokenizer.vocab_size
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit() and len(key) < 12 and int(key) < vocab):
                msg = f"logit_bias keys are token ids 0..{vocab - 1}, not {key[:40]!r}"
                raise ApiError(400, msg, "invalid_value", "logit_bias")
            if not -100 <= value <= 100:
                msg = f"logit_bias values are in [-100, 100], not {value}"
                raise ApiError(400, msg, "invalid_value", "logit_bias")
        if any(bias.values()):
            msg = "logit_bias is not supported: kvrun samples without per-token biases"
            raise ApiError(400, msg, "unsupported", "logit_bias")

    def _job(
        self, body, ids: list[int], n_predict: int, spec, logprobs=None, prompt_logprobs=None
    ) -> HttpJob:
        ctx = self.s.context
        self._fits(len(ids), "messages")
        if not ids:
            raise ApiError(400, "the prompt is empty", "empty_prompt", "prompt")
        # max_tokens beyond what the context leaves is clamped to it (as llama-server does): the
        # reply ends at the context's end, finish_reason "length"
        n_predict = min(n_predict, ctx - len(ids))
        w = self.worker
        n = n_predict if n_predict >= 0 else ctx
        limit = w.kv_mem
        need = w.engine.per_token * (len(ids) + n) if w.engine is not None else 0
        if limit is not None and need > limit:
            msg = (
                f"its KV cache may need {need / 2**20:.1f} MiB ({len(ids)} prompt + {n} tokens at "
                f"full size) but --kv-mem is {limit / 2**20:.1f} MiB; ask for fewer max_tokens or "
                "shorten the prompt"
            )
            raise ApiError(400, msg, "kv_mem_exceeded")
        return HttpJob(
            ids,
            n_predict,
            body.config(),
            body.seed,
            spec,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            cache_prompt=body.cache_prompt,
            stop=StopText(body.stop),
        )

    def _submit(self, jobs: list[HttpJob]) -> None:
        w = self.worker
        if w.waiting + len(jobs) > self.s.queue + max(0, w.n_parallel - w.engine.active):
            msg = f"the queue is full ({w.waiting} requests waiting); retry later"
            raise ApiError(
                503, msg, "queue_full", kind="server_error", headers={"Retry-After": "1"}
            )
        loop = asyncio.get_running_loop()
        for job in jobs:
            job.loop, job.events = loop, asyncio.Queue()
            w.submit(job)

    async def _guard(self, request: Request, handler) -> Response:
        try:
            self._auth(request)
            return await handler(request)
        except ApiError as e:
            if e.status in (400, 408, 413, 422, 503):
                self.metrics.rejected()
            return _error(e)

    # ----------------------------------------------------------------- endpoints
    async def health(self, request: Request) -> Response:
        w = self.worker
        if w.load_error:
            return JSONResponse({"status": "error", "error": w.load_error}, status_code=503)
        if not w.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def prom(self, request: Request) -> Response:
        async def go(request):
            data = self.metrics.render(self.worker)
            return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")

        return await self._guard(request, go)

    async def models(self, request: Request) -> Response:
        async def go(request):
            self._ready()  # 503 while the model loads, as llama-server
            model = {
                "id": self.s.names[0],
                "object": "model",
                "created": self.created,
                "owned_by": "kvrun",
                "context_length": self.s.context,
                "kv": self.s.default_kv,
            }
            return JSONResponse({"object": "list", "data": [model]})

        return await self._guard(request, go)

    async def chat(self, request: Request) -> Response:
        return await self._guard(request, self._chat)

    async def completions(self, request: Request) -> Response:
        return await self._guard(request, self._completions)

    async def _chat(self, request: Request) -> Response:
        body: ChatBody = await self._body(request, ChatBody)
        self._ready()
        self._logit_bias(body)
        spec = self._spec(body)
        tok = self.worker.runtime.tokenizer
        msgs = [m.as_dict() for m in body.messages]
        chars = sum(len(m["content"]) for m in msgs)  # at most their bytes: no need to render
        if chars > self._text_limit():
            msg = f"the messages hold {chars} characters, more than the context can hold"
            raise ApiError(400, msg, "context_length_exceeded", "messages")
        fam, forced = None, None
        tool_list = [t.model_dump(exclude_none=True) for t in body.tools or []]
        try:
            if body.uses_tools():
                fam = tools.family(tok.chat_template)
            must, name = body.forced_call()
            if must and not tool_list:
                raise tools.ToolError("tool_choice required or a named function needs tools")
            if must:
                forced = tools.call_spec(fam, tool_list, name, tok)
        except tools.ToolError as e:
            raise ApiError(400, str(e), "tools_unsupported", "tools") from None
        grammar = self._grammar(body, forced)
        try:
            if fam is not None:
                prompt = tools.render(tok, fam, msgs, tool_list)
            else:
                prompt = tok.render_chat(msgs, add_generation_prompt=True)
        except KvrunError as e:
            msg = f"the chat template failed on these messages: {e}"
            raise ApiError(400, msg, "template_error", "messages") from None
        ids = self._encode(prompt, "messages")
        job = self._job(body, ids, body.limit(), spec, logprobs=body.alternatives())
        job.constraint = await self._constraint(grammar)
        if tool_list and body.tool_choice != "none":
            job.calls = tools.CallStream(fam)
        self._submit([job])
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._stream(request, [job], rid, "chat", usage)
        result = await self._wait(request, job)
        text = "".join(job.text_parts)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = _finish(job, result)
        if job.calls is not None:
            content, calls = tools.parse(job.calls.fam, text)
            if calls:
                message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                finish = "tool_calls"
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": finish,
            "logprobs": self._chat_logprobs(result.logprobs),
        }
        return JSONResponse(self._envelope(rid, "chat.completion", [choice], [(job, result)]))

    async def _completions(self, request: Request) -> Response:
        body: CompletionBody = await self._body(request, CompletionBody)
        self._ready()
        self._logit_bias(body)
        spec = self._spec(body)
        tok = self.worker.runtime.tokenizer
        prompts = body.prompts()
        if not prompts:
            raise ApiError(400, "the prompt is empty", "empty_prompt", "prompt")
        if body.stream and len(prompts) > 1:
            raise ApiError(400, "stream takes one prompt", "unsupported", "prompt")
        most = self.s.queue + self.worker.n_parallel  # more could never be admitted together
        if len(prompts) > most:
            msg = f"{len(prompts)} prompts; a request takes at most {most} (--queue + -np)"
            raise ApiError(400, msg, "too_many_prompts", "prompt")
        vocab = tok.vocab_size
        grammar = self._grammar(body)
        jobs = []
        for p in prompts:
            if isinstance(p, str):
                ids = self._encode(p, "prompt")
            else:
                self._fits(len(p), "prompt")
                if p and (min(p) < 0 or max(p) >= vocab):
                    msg = f"a prompt token id is outside the vocabulary (0..{vocab - 1})"
                    raise ApiError(400, msg, "invalid_value", "prompt")
                ids = list(p)
            echo_lp = body.logprobs if body.echo else None
            jobs.append(self._job(body, ids, body.limit(), spec, body.logprobs, echo_lp))
        for job in jobs:  # each sequence its own grammar state
            job.constraint = await self._constraint(grammar)
        self._submit(jobs)
        rid = f"cmpl-{secrets.token_hex(12)}"
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._stream(request, jobs, rid, "text", usage, echo=body.echo)
        done = []
        try:
            for job in jobs:
                done.append((job, await self._wait(request, job)))
        finally:  # one failed or its client left: the others stop too
            for job in jobs:
                job.cancel.set()
        choices = []
        for i, (job, result) in enumerate(done):
            text = "".join(job.text_parts)
            prompt_text = tok.decode(job.ids) if body.echo else ""
            lp = None
            if body.logprobs is not None:
                entries = (result.prompt_logprobs or []) if body.echo else []
                lp = self._text_logprobs(job, entries, result.logprobs or [], body.echo)
            text = prompt_text + text
            choices.append(
                {"index": i, "text": text, "logprobs": lp, "finish_reason": _finish(job, result)}
            )
        return JSONResponse(self._envelope(rid, "text_completion", choices, done))

    # ------------------------------------------------------------------ results
    async def _events(self, request: Request, job: HttpJob, poll: bool = False):
        """The job's events as they come. Once the server drains, after the grace period, the
        job is cancelled and an ApiError ends the response (a final error event for a stream).
        poll: ask whether the client is gone (a plain response; a stream learns it from
        Starlette, which closes this generator) and cancel the job when it is."""
        checked = time.monotonic()
        while True:
            try:  # an event already there needs no timer (a task and a handle a token)
                ev = job.events.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    ev = await asyncio.wait_for(job.events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    ev = None
            now = time.monotonic()
            if self.draining.is_set() and now - self.drain_t > self.s.grace:
                job.cancel.set()
                msg = "the server is shutting down"
                raise ApiError(503, msg, "shutting_down", kind="server_error")
            if poll and now - checked > 0.25:
                checked = now
                if await request.is_disconnected():
                    job.cancel.set()  # nobody reads the answer: a status for the log alone
                    raise ApiError(499, "the client left", "client_closed")
            if ev is None:
                continue
            if ev[0] == "text":
                job.text_parts.append(ev[1])
            yield ev
            if ev[0] == "end":
                return

    async def _wait(self, request: Request, job: HttpJob):
        try:
            async for ev in self._events(request, job, poll=True):
                if ev[0] == "end":
                    _, result, error = ev
                    if error is not None and "failed" in error:  # the engine's fault
                        raise ApiError(500, error, kind="server_error")
                    if error is not None:  # the request's
                        raise ApiError(400, error)
                    return result
        finally:
            job.cancel.set()  # a no-op once it ended; frees the slot if the handler is cut off
        raise ApiError(500, "the engine ended the request without a result", kind="server_error")

    def _stream(
        self,
        request: Request,
        jobs: list[HttpJob],
        rid: str,
        kind: str,
        usage: bool,
        echo: bool = False,
    ) -> StreamingResponse:
        job = jobs[0]
        tok = self.worker.runtime.tokenizer
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(choice: dict | None, extra: dict | None = None) -> str:
            data = {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": self.s.names[0],
                "choices": [] if choice is None else [choice],
                **(extra or {}),
            }
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        def piece(text: str, entries, finish=None) -> dict:
            if kind == "chat":
                lp = self._chat_logprobs(entries) if job.logprobs is not None else None
                delta = {"content": text} if text or finish is None else {}
                return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            lp = self._text_logprobs(job, [], entries, False) if job.logprobs is not None else None
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}

        async def gen():
            try:
                none = {"logprobs": None, "finish_reason": None}
                if kind == "chat":
                    yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, **none})
                elif echo:
                    yield chunk({"index": 0, "text": tok.decode(job.ids), **none})
                ready: list[str] = []  # text chunks already here go out in one write
                calls = job.calls  # tool calls read from the text (chat with tools)
                async for ev in self._events(request, job):
                    if ev[0] == "text" and calls is not None:
                        before = len(calls.calls)
                        text, done = calls.push(ev[1])
                        if text or ev[2]:
                            ready.append(chunk(piece(text, ev[2])))
                        ready += [chunk(_delta(d)) for d in tools.call_deltas(done, before)]
                    elif ev[0] == "text":
                        ready.append(chunk(piece(ev[1], ev[2])))
                    if ev[0] == "text":
                        if job.events.empty() and ready:
                            yield "".join(ready)
                            ready.clear()
                        continue
                    if ready:
                        yield "".join(ready)
                        ready.clear()
                    _, result, error = ev
                    if error is not None:
                        yield f"data: {json.dumps(error_body(error, 'server_error'))}\n\n"
                        return
                    finish = _finish(job, result)
                    if calls is not None:
                        before = len(calls.calls)
                        text, done = calls.flush()
                        if text:
                            yield chunk(piece(text, []))
                        for d in tools.call_deltas(done, before):
                            yield chunk(_delta(d))
                        finish = "tool_calls" if calls.calls else finish
                    yield chunk(piece("", [], finish))
                    if usage:
                        yield chunk(None, {"usage": _usage([(job, result)])})
                    yield "data: [DONE]\n\n"
                    return
            except ApiError as e:  # shutting down: the stream ends with an error event
                yield f"data: {json.dumps(error_body(e.message, e.kind, e.code))}\n\n"
            finally:
                job.cancel.set()

        headers = {"Cache-Control": "no-cache"}
        return StreamingResponse(gen(), media_type="text/event-stream", headers=headers)

    def _envelope(self, rid: str, obj: str, choices: list, done: list) -> dict:
        return {
            "id": rid,
            "object": obj,
            "created": int(time.time()),
            "model": self.s.names[0],
            "choices": choices,
            "usage": _usage(done),
        }

    def _token(self, t: int) -> str:
        return self.worker.runtime.tokenizer.decode([t])

    def _chat_logprobs(self, entries) -> dict | None:
        if entries is None:
            return None
        out = []
        for e in entries:
            top = [self._chat_entry(t, v) for t, v in e.top]
            out.append({**self._chat_entry(e.token, e.logprob), "top_logprobs": top})
        return {"content": out}

    def _chat_entry(self, token: int, logprob: float) -> dict:
        s = self._token(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

    def _text_logprobs(self, job: HttpJob, prompt_entries, entries, echo: bool) -> dict:
        """The completions endpoint's logprobs: tokens, token_logprobs, top_logprobs,
        text_offset; with echo the prompt's tokens first (the first one without a value)."""
        tokens, values, tops = [], [], []
        if echo:
            tokens.append(job.ids[0])
            values.append(None)
            tops.append(None)
        for e in [*prompt_entries, *entries]:
            tokens.append(e.token)
            values.append(e.logprob)
            tops.append({self._token(t): v for t, v in e.top})
        texts = [self._token(t) for t in tokens]
        offsets, at = [], 0
        for s in texts:
            offsets.append(at)
            at += len(s)
        return {
            "tokens": texts,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def _delta(delta: dict) -> dict:
    """A chat stream's choice holding one delta (a tool call's part)."""
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}


def _finish(job: HttpJob, result) -> str:
    if job.stop.hit or result.stats.stop_reason == "eos":
        return "stop"
    return "length"


def _usage(done: list) -> dict:
    """OpenAI's usage; prompt_tokens counts the tokens a kept cache held (cached_tokens) as
    well as those prefilled."""
    cached = sum(job.cached for job, _ in done)
    p = cached + sum(r.stats.prompt_tokens for _, r in done)
    c = sum(r.stats.generated_tokens for _, r in done)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
        "kv_bytes": sum(r.stats.kv_bytes for _, r in done),
        "kv_bytes_full": sum(r.stats.kv_bytes_full for _, r in done),
    }


SWITCH_INTERVAL_S = 2e-4


def serve(server: Server, sock, log_level: str = "warning") -> None:
    """Serve on a listening socket until SIGTERM / Ctrl-C, then close the engine thread. The
    signal starts the drain (no new requests; in-flight streams get `grace` seconds, then an
    error event), and the process exits 0 once connections are closed (uvicorn alone re-raises
    the signal after its shutdown, which would end the process by the signal). A model that
    fails to load stops the server: KvrunError, one line from the CLI."""
    import uvicorn

    class Runner(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not server.draining.is_set():
                log.warning("shutting down: %gs for streams in flight", server.s.grace)
                server.drain()
            if self.should_exit:
                self.force_exit = True  # a second signal: now
            self.should_exit = True  # not kept in _captured_signals: no re-raise

    from uvicorn.protocols.http.h11_impl import H11Protocol

    from .guard import guarded

    # h11 even where httptools is installed ("auto" would take it): h11 refuses headers over
    # 16 KiB, and the limits of guard.py are tested on it
    config = uvicorn.Config(
        server.app,
        http=guarded(H11Protocol, server.s.read_timeout, server.s.max_connections),
        ws="none",  # no websocket routes: an upgrade request is an ordinary request
        timeout_keep_alive=5,  # uvicorn's: an idle connection closes 5 s after a response
        log_level=log_level,
        timeout_graceful_shutdown=int(server.s.grace) + 5,
        lifespan="off",
        access_log=False,
    )
    runner = Runner(config)
    server.worker.on_load_error = lambda: setattr(runner, "should_exit", True)
    # the engine thread makes ~100 native calls a step, each letting the GIL go and taking
    # it back; while the event loop formats and writes a token's chunk, the engine waits for
    # the GIL up to the switch interval (5 ms by default) after each of them
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server.worker.start()
    try:
        runner.run(sockets=[sock])
    finally:
        server.worker.close()
    if server.worker.load_error:  # a file that passed the CLI's checks but does not load
        raise KvrunError(f"cannot load the model: {server.worker.load_error}")
