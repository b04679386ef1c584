"""The engine thread of kvrun serve: it loads the model, owns every torch call, and runs the
continuous-batching engine (kvrun.run.engine) on the requests the HTTP side hands it.

The two sides meet in an `HttpJob`: the HTTP handler builds it (prompt ids, sampling, the
cache to build) and `submit`s it to a thread-safe inbox; the engine polls the inbox at every
step (`_Inbox`, the engine's Intake) and admits jobs as slots free up, so a job that arrives
while a batch runs joins it; each one's text, tokens and end go back to the event loop with
`loop.call_soon_threadsafe`, into the job's asyncio queue. Stop strings are found here, as the
text arrives, so a sequence that hits one ends within the same engine step; a job whose client
is gone is cancelled and its slot is free by the next step. With a prefix cache
(kvrun.server.prefix_cache) a job goes on from a fork of the longest kept cache its prompt
starts with, and its own cache is kept when it ends on a turn boundary (before its end is
posted, so a client's next turn finds it). A longer cache on disk (--cache-dir) is read on the
disk cache's loader thread: the job leaves the engine meanwhile and comes back to the inbox
with it, so the engine's other sequences never wait for a file.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kvrun.serve")


class StopText:
    """Finds stop strings in streamed text: `push` returns what may be shown now (text that
    cannot be the start of a stop string), `flush` the rest; `hit` once one was found (the
    text ends just before it)."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""
        self.hit = False

    def push(self, piece: str) -> str:
        if self.hit:
            return ""
        if not self.stops:
            return piece
        text = self.held + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self.held = True, ""
            return text[:cut]
        keep = max((_partial(text, s) for s in self.stops), default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def _partial(text: str, stop: str) -> int:
    """The longest k < len(stop) such that text ends with stop[:k] (0: none). Only the places
    where stop's first character occurs in text's tail are tried: a per-token cost near
    len(stop), not len(stop) squared as testing every k would be."""
    i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while i >= 0:
        if stop.startswith(text[i:]):
            return len(text) - i
        i = text.find(stop[0], i + 1)
    return 0


@dataclass
class HttpJob:
    """One sequence of one HTTP request, shared by the event loop and the engine thread."""

    ids: list[int]
    n_predict: int
    sampling: Any  # SamplingConfig
    seed: int | None
    spec: Any  # KVSpec of its cache
    logprobs: int | None = None  # alternatives per generated token (None: no logprobs)
    prompt_logprobs: int | None = None  # the same for the prompt (echo)
    cache_prompt: bool = True  # go on from a kept prefix, and keep this cache at the end
    cached: int = 0  # prompt tokens a kept cache held (engine thread; read after "end")
    kv: Any = None  # the cache it runs on (engine thread)
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None  # ("text", str, [TokenLogprob]) | ("end", Result, error)
    cancel: threading.Event = field(default_factory=threading.Event)
    stop: StopText | None = None
    constraint: Any = None  # kvrun.run.grammar.Constraint the reply follows (engine thread)
    calls: Any = None  # kvrun.server.tools.CallStream reading tool calls (event loop side)
    # the prefix cache on disk: "" not asked yet, "loading" (the job is off the engine until
    # its file is read), "done" (disk_start: what the load gave, (kv, tokens) or None)
    disk: str = ""
    disk_start: Any = None
    finish_reason: str | None = None
    submitted: float = 0.0
    started: float = 0.0
    last_token: float = 0.0
    pending: list = field(default_factory=list)  # logprobs not yet sent with text
    text_parts: list[str] = field(default_factory=list)  # the text received (event loop side)
    # the engine thread's events of this step, sent together by EngineThread.flush (None:
    # each posted at once)
    outbox: list | None = None

    def post(self, *event) -> None:
        """Hand an event to the request's handler on the event loop (any thread)."""
        if self.outbox is not None:
            self.outbox.append((self, event))
        elif self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def _deliver(batch: list) -> None:
    """On the event loop: a step's events into their jobs' queues."""
    for job, event in batch:
        job.events.put_nowait(event)


class EngineThread:
    """The engine thread. `load` builds the runtime (in the thread, so the server answers
    /health with 503 meanwhile); `submit` queues a job; `close` ends the thread.

    make_session(runtime, kv) -> Session builds each slot's session; metrics: an object with
    ttft(seconds), itl(seconds), ended(job, result, error), cache_lookup(tokens reused),
    cache_evicted(n). prefix_cache: a PrefixCache (None: every prompt is prefilled whole)."""

    def __init__(
        self,
        load: Callable[[], Any],
        n_parallel: int,
        kv_mem: int | None,
        make_session,
        metrics,
        default_spec,
        prefix_cache=None,
        disk_cache=None,
    ) -> None:
        self._load = load
        self.n_parallel = n_parallel
        self.kv_mem = kv_mem  # bytes (--kv-mem), None: no limit
        self.make_session = make_session  # (runtime, kv) -> Session
        self.metrics = metrics
        self.default_spec = default_spec
        self.prefix_cache = prefix_cache
        self.disk_cache = disk_cache  # kvrun.server.disk_cache.DiskCache (--cache-dir) or None
        self.inbox: queue.Queue[HttpJob | None] = queue.Queue()
        self.runtime = None
        self.engine = None
        self.load_error: str | None = None
        self.on_load_error: Callable[[], None] | None = None  # told once loading fails
        self.ready = threading.Event()
        self.waiting = 0  # submitted, not yet holding a slot
        self._lock = threading.Lock()
        self._live: set[int] = set()  # ids of jobs holding a slot
        # jobs drawn from the inbox and not yet ended, started or not: an engine that fails
        # drops its waiting list too, and each of them must still get its end
        self._jobs: dict[int, HttpJob] = {}
        # events posted during an engine step: one wake-up of the event loop a step, not one
        # a token (each costs the loop a self-pipe write and the engine a GIL round trip)
        self._outbox: list[tuple[HttpJob, tuple]] = []
        self.thread = threading.Thread(target=self._main, name="kvrun-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    # --------------------------------------------------------------- the HTTP side
    def submit(self, job: HttpJob) -> None:
        with self._lock:
            self.waiting += 1
        job.submitted = time.perf_counter()
        self.inbox.put(job)

    def close(self, timeout: float = 5.0) -> None:
        self.inbox.put(None)
        if self.thread.is_alive():
            self.thread.join(timeout)
        if self.disk_cache is not None:  # the writes already queued reach the disk
            self.disk_cache.close()

    # ------------------------------------------------------------- the engine side
    def _main(self) -> None:
        try:
            self.runtime = self._load()
            if self.disk_cache is not None:
                self.disk_cache.attach(self.runtime)
            self._new_engine()
        except Exception as e:  # noqa: BLE001 - reported by /health and the log
            self.load_error = str(e) or type(e).__name__
            if self.on_load_error:
                self.on_load_error()
            return
        self.ready.set()
        while True:
            first = self.inbox.get()
            if first is None:
                return
            try:
                for req, result, error in self.engine.results(_Inbox(self, first)):
                    self._end(req.tag, result, error)
                    self.flush()
            except _Closing:
                return
            except Exception as e:  # noqa: BLE001 - the server keeps serving
                log.exception("the engine failed; failing its sequences and starting afresh")
                for job in list(self._jobs.values()):
                    self._end(job, None, f"the engine failed: {type(e).__name__}: {e}")
                self.flush()  # no step follows to send these ends
                if self.prefix_cache is not None:  # memory back (the failure may be OOM)
                    self.prefix_cache.clear()
                self._new_engine()

    def _new_engine(self) -> None:
        from ..run.engine import Engine

        rt = self.runtime
        sessions = [
            self.make_session(rt, rt.new_kv(self.default_spec)) for _ in range(self.n_parallel)
        ]
        self.engine = Engine(sessions, kv_mem=self.kv_mem)
        self.engine.on_step = self.flush

    def flush(self) -> None:
        """Send the events posted since the last flush, one call per event loop."""
        if not self._outbox:
            return
        batch, self._outbox[:] = list(self._outbox), []
        by_loop: dict[int, tuple] = {}
        for job, event in batch:
            by_loop.setdefault(id(job.loop), (job.loop, []))[1].append((job, event))
        for loop, items in by_loop.values():
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(_deliver, items)

    def _unwait(self) -> None:
        with self._lock:
            self.waiting -= 1

    def _cache_key(self, job: HttpJob) -> tuple:
        return (str(self.runtime.path), job.spec)

    def _uses_cache(self, job: HttpJob) -> bool:
        kept = self.prefix_cache is not None and self.prefix_cache.limit > 0
        return job.cache_prompt and (kept or self.disk_cache is not None)

    def _start(self, job: HttpJob, ids: list[int]):
        """The kept cache the job goes on from, (kv, tokens) or None; False while its file is
        read from disk, off this thread (the job comes back to the inbox when it is)."""
        memory = self.prefix_cache
        held = memory.peek(self._cache_key(job), ids) if memory is not None else 0
        disk = self.disk_cache
        if disk is not None and not job.disk:  # a longer one on disk (a restart's, an evicted)
            if disk.longest(job.spec, ids, held) > held:
                job.disk = "loading"
                disk.load_async(job.spec, ids, held, lambda got: self._loaded(job, got))
                return False
            disk.miss()
            job.disk = "done"
        got, job.disk_start = job.disk_start, None
        if got and len(got[1]) > held:  # the memory may have kept a longer one meanwhile
            return got
        return memory.lookup(self._cache_key(job), ids) if memory is not None else None

    def _loaded(self, job: HttpJob, got) -> None:
        """On the loader thread: the job, with what its file gave, back to the engine."""
        job.disk, job.disk_start = "done", got
        self.inbox.put(job)

    def _request(self, job: HttpJob):
        """The engine's Request for a job drawn from the inbox; None when the job waits for
        its cache from disk (it comes back to the inbox)."""
        from ..run.engine import Request

        rt = self.runtime
        ids, start = list(job.ids), None
        # prompt logprobs (echo) need every prompt token's logits: those are prefilled whole
        if self._uses_cache(job) and job.prompt_logprobs is None:
            start = self._start(job, ids)
            if start is False:
                return None
            job.cached = len(start[1]) if start else 0
            self.metrics.cache_lookup(job.cached)
            if start:
                job.kv, ids = start[0], ids[job.cached :]
        job.outbox = self._outbox
        self._jobs[id(job)] = job

        def new_kv():
            job.kv = rt.new_kv(job.spec)
            return job.kv

        def on_start() -> None:
            self._unwait()
            job.started = time.perf_counter()
            self._live.add(id(job))

        def on_token(_tok: int, entry) -> None:
            now = time.perf_counter()
            if job.last_token:
                self.metrics.itl(now - job.last_token)
            else:
                self.metrics.ttft(now - job.submitted)
            job.last_token = now
            if entry is not None:
                job.pending.append(entry)

        def on_text(piece: str) -> None:
            shown = job.stop.push(piece)
            if job.stop.hit:
                job.cancel.set()
                job.finish_reason = "stop"
            if shown or job.pending:
                job.post("text", shown, job.pending)
                job.pending = []

        return Request(
            ids,
            job.n_predict,
            job.sampling,
            seed=job.seed,
            tag=job,
            on_text=on_text,
            new_kv=new_kv,
            logprobs=job.logprobs,
            prompt_logprobs=job.prompt_logprobs,
            on_start=on_start,
            on_token=on_token,
            cancelled=job.cancel.is_set,
            start=start,
            constraint=job.constraint,
        )

    def _keep(self, job: HttpJob, result) -> None:
        """Keep the job's cache if it ended on a turn boundary: its model ended the reply or
        max_tokens did (not a stop string, a client gone, a full context). It holds the prompt
        and the generated tokens it was fed: all of them after an end-of-turn token (which is
        not fed: the next turn's prompt brings it, as Session.pending's turns do), all but the
        last after max_tokens (the next prompt brings that one too)."""
        kv = job.kv
        if (
            result is None
            or kv is None
            or not self._uses_cache(job)
            or job.stop.hit
            or result.stats.stop_reason not in ("eos", "length")
        ):
            return
        fed = [*job.ids, *result.tokens]
        if not len(job.ids) <= kv.seen <= len(fed):
            return
        if self.prefix_cache is not None:
            key = self._cache_key(job)
            self.metrics.cache_evicted(self.prefix_cache.keep(key, fed[: kv.seen], kv))
        if self.disk_cache is not None:
            self.disk_cache.keep(job.spec, fed[: kv.seen], kv)

    def _end(self, job: HttpJob, result, error: str | None, drawn: bool = True) -> None:
        if drawn and id(job) not in self._live:  # failed before it took a slot
            self._unwait()
        self._live.discard(id(job))
        self._jobs.pop(id(job), None)
        if result is not None and not job.stop.hit:
            tail = job.stop.flush()
            if tail or job.pending:
                job.post("text", tail, job.pending)
                job.pending = []
        if error is not None and error != "cancelled":
            log.warning("a request failed: %s", error)
        if error is None:
            self._keep(job, result)
        job.kv = None
        self.metrics.ended(job, result, error)
        job.post("end", result, error)


class _Inbox:
    """The engine's Intake (kvrun.run.engine) over the inbox: the first job, then at every step
    whatever the inbox holds right now, so jobs that arrive while a batch runs join it. When
    the inbox is empty and no sequence is active the engine's run ends, and the engine thread
    waits for the next job; drawing the shutdown mark raises _Closing."""

    def __init__(self, engine: EngineThread, first: HttpJob):
        self.engine, self.first = engine, first

    def poll(self):
        """The next job's Request, None while the inbox is empty (engine.Intake.poll)."""
        w = self.engine
        while True:
            job, self.first = self.first, None
            if job is None:
                try:
                    job = w.inbox.get_nowait()
                except queue.Empty:
                    return None
                if job is None:
                    raise _Closing
            if job.cancel.is_set():  # its client left while it waited
                w._unwait()
                w._end(job, None, "cancelled", drawn=False)
                continue
            req = w._request(job)
            if req is not None:  # None: its cache is read from disk meanwhile
                return req


class _Closing(Exception):
    """The inbox's shutdown mark was drawn."""
