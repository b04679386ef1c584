"""Batched generation: up to N sequences at once, continuously batched (as nano-vllm and
llama.cpp's --parallel serve), each with its own KV cache of any --kv method.

Each engine step runs
  1. admission: waiting requests take free slots while their KV reservation fits --kv-mem;
  2. one prefill chunk (--ubatch tokens) of the oldest sequence still prefilling;
  3. one decode token for every sequence that has one to feed, in a single forward pass
     (Session.decode_batch: the linear layers read the weights once for all rows, each
     sequence's cache attends for its own row, kvrun/batch.py).
A sequence that finishes frees its slot at once, so the next request is admitted in the
following step. Prefill chunks and decode steps alternate, so a long prompt never stalls the
sequences that are decoding for more than one chunk. With --cuda-graph a decode step is the
static one, replayed from a CUDA graph per batch-size bucket and members
(kvrun.graph.BatchGraph) where every member's method has a static form; others run eagerly.

Requests come from an Intake, polled at every step while the engine holds no request (the
one it holds waits for a slot): a request that arrives while a batch runs (kvrun serve's)
joins that batch. The run ends once the intake has none and no sequence is active; a list or
a generator of requests is an intake drawn as slots free up.

Per sequence the engine does what Session.generate does (the same sampling, history, stop
tokens, streamed text and stats), so greedy outputs equal a sequential run's (up to the float
reordering of a B-row product). A request that fails (a prompt that does not fit, a method
that refuses the input) is reported with its error and the others go on; an error inside a
batched decode step fails the sequences of that step, whose caches it may have half-written.

Memory admission: a request reserves bytes_per_token * (prompt + n_predict), the full cache's
size, which bounds every method (a prefill-time selection holds the whole prompt until the
prefill ends). Once a sequence has prefilled, its reservation becomes its measured bytes plus
the full cost of the tokens it may still generate. A request is admitted only while the
reservations of all active sequences fit the limit; one that cannot fit even alone fails
with an error that says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import KvrunError
from .graph import BatchGraph
from .sampling import SamplingConfig
from .session import Session
from .token_end import PhaseStats, Result, TokenEnd, sync, token_logprobs


@dataclass
class Request:
    """One sequence to generate: prompt ids, how many tokens, how to sample."""

    ids: list[int]
    n_predict: int
    sampling: SamplingConfig
    seed: int | None = None
    tag: Any = None  # the caller's handle, given back with the result
    on_text: Callable[[str], None] | None = None
    # a fresh KV cache for this request (None: the slot's own cache, reset); lets one batch
    # mix --kv methods, as a needle grid does
    new_kv: Callable[[], Any] | None = None
    # a question prefilled as a turn of its own after `ids` were compressed (--question-after)
    question: list[int] | None = None
    # log-probabilities kept in the Result (kvrun.token_end.TokenLogprob), with this many
    # alternatives each: of every generated token, and of every prompt token after the first
    # (the prefill's own logits: what the cache held while each chunk ran)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # told as the request takes a slot, and of each generated token (id, TokenLogprob or None)
    # before its text reaches on_text
    on_start: Callable[[], None] | None = None
    on_token: Callable[[int, Any], None] | None = None
    # polled every engine step (and after each token): True ends the sequence there, its
    # result so far reported with stop_reason "cancelled" (a client gone, a stop string seen)
    cancelled: Callable[[], bool] | None = None
    # a cache to go on from and the tokens it holds (a kept prefix, a compressed document:
    # a fork the request owns, kvrun.kv.protocol.KVManager.fork); `ids` are then the new
    # turn only, prefilled on top of it as a chat's next turn is
    start: tuple[Any, list[int]] | None = None
    # the request's grammar state (kvrun.run.grammar.Constraint): masks its logits, and ends the
    # sequence once the grammar is complete
    constraint: Any = None

    @property
    def prompt(self) -> list[int]:
        """Every prompt token, the question's included."""
        return list(self.ids) + list(self.question or [])


@runtime_checkable
class Intake(Protocol):
    """Where an engine run takes its requests from."""

    def poll(self) -> Request | None:
        """The next request that has arrived, or None when none waits now. Called at every
        engine step while the engine holds no request; after a None the engine asks again at
        its next step while sequences are active, and ends once none are."""


class IterIntake:
    """An Intake over an iterable of requests, each built as the engine polls for it."""

    def __init__(self, requests: Iterable[Request]):
        self.it = iter(requests)

    def poll(self) -> Request | None:
        return next(self.it, None)


@dataclass
class EngineStats(PhaseStats):
    """Aggregate figures of one run. prefill_s: time in prefill chunks; decode_s: in batched
    decode steps; their rates (PhaseStats) are the aggregate ones, over every sequence."""

    sequences: int = 0
    failed: int = 0
    steps: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0  # tokens fed through batched decode steps
    prefill_tokens: int = 0
    max_active: int = 0
    peak_kv_bytes: int = 0  # measured bytes of all caches together, at step ends
    graph_steps: int = 0  # decode steps in their static form (replayed, with --cuda-graph)
    graph_captures: int = 0  # CUDA graphs captured for them
    wall_s: float = 0.0


@dataclass
class _Seq:
    req: Request
    session: Session
    chunks: Any  # the prefill generator (None once prefilled)
    tail: TokenEnd  # sampling, stops, streamed text and stats (time counts from admission)
    prompt_logprobs: list = field(default_factory=list)
    feed: int | None = None  # the sampled token the next decode step feeds
    done: bool = False

    @property
    def limit(self) -> int:
        return self.tail.limit

    @property
    def stats(self):
        return self.tail.stats

    @property
    def out(self) -> list[int]:
        return self.tail.out


class Engine:
    """Runs requests on N sessions of one model (`sessions`, each with its own cache).

    kv_mem: the admission limit in bytes (None: no limit)."""

    def __init__(self, sessions: list[Session], kv_mem: int | None = None):
        if not sessions:
            raise ValueError("the engine needs at least one session")
        self.sessions = sessions
        self.kv_mem = kv_mem
        model = sessions[0].model
        # sessions asked for CUDA graphs (--cuda-graph): the batch's decode steps replay one
        # per bucket and members ("static": the same steps uncaptured, for CPU tests)
        modes = {s.graph_mode for s in sessions}
        self.graph = None
        if modes - {"off"}:
            self.graph = BatchGraph(model, sessions[0].context, capture="on" in modes)
        # a full cache's bytes per token in the sessions' KV type (--kv-dtype)
        c, t = model.config, sessions[0].kv.kv_type
        self.per_token = (
            2 * c.n_layers * c.n_kv_heads * t.row_bytes(c.head_dim)
            if t is not None
            else c.kv_bytes_per_token(model.dtype.itemsize)
        )
        self.stats = EngineStats()
        # as of the last step: sequences holding a slot, the bytes their caches hold, and what
        # full caches would hold for the same tokens (kvrun serve's /metrics reads these)
        self.active = self.kv_bytes = self.kv_bytes_full = 0
        self.on_step: Callable[[], None] | None = None  # told at the end of every step

    # ------------------------------------------------------------------ admission
    def reserve(self, seq: _Seq | None, req: Request) -> int:
        """Bytes a sequence may still come to hold (module docstring)."""
        n = req.n_predict if req.n_predict >= 0 else self.sessions[0].context
        if seq is None or seq.chunks is not None:  # waiting or prefilling: the full cache
            held = req.start[0].nbytes() if req.start is not None else 0
            return held + self.per_token * (len(req.prompt) + n)
        return seq.session.kv.nbytes() + self.per_token * max(seq.limit - len(seq.out), 0)

    def _fits(self, req: Request, active: list[_Seq]) -> bool:
        if self.kv_mem is None:
            return True
        used = sum(self.reserve(q, q.req) for q in active)
        return used + self.reserve(None, req) <= self.kv_mem

    # ------------------------------------------------------------------------ run
    def run(
        self,
        requests: Intake | Iterable[Request],
        finish: Callable[[Request, Result | None, str | None], None],
    ) -> EngineStats:
        """Generate every request; finish(request, result, None) or (request, None, error)
        is called as each one ends, in the order they end."""
        for ended in self.results(requests):
            finish(*ended)
        return self.stats

    def results(
        self, requests: Intake | Iterable[Request]
    ) -> Iterator[tuple[Request, Result | None, str | None]]:
        """`run` as a generator: (request, result, error) as each request ends (after the
        engine step it ended in); requests are polled as slots free up (Intake)."""
        waiting = _Next(requests if isinstance(requests, Intake) else IterIntake(requests))
        free = list(self.sessions)
        active: list[_Seq] = []
        st = self.stats
        t_start = time.perf_counter()
        ready: list[tuple[Request, Result | None, str | None]] = []

        def end(seq: _Seq, error: str | None = None) -> None:
            seq.done = True
            active.remove(seq)
            free.append(seq.session)
            st.sequences += 1
            if error is not None:
                st.failed += 1
                seq.session.reset()
                ready.append((seq.req, None, error))
                return
            ready.append((seq.req, self._result(seq), None))

        while waiting.peek() is not None or active:
            for q in [q for q in active if q.req.cancelled and q.req.cancelled()]:
                q.stats.stop_reason = "cancelled"
                end(q)
            while free and waiting.peek() is not None:  # admission
                req = waiting.peek()
                if not self._fits(req, active):
                    if active:
                        break  # wait for a slot's memory
                    waiting.pop()
                    st.sequences += 1
                    st.failed += 1
                    ready.append((req, None, self._too_big(req)))
                    continue
                active.append(self._start(free.pop(), waiting.pop()))
            st.max_active = max(st.max_active, len(active))
            pre = next((q for q in active if q.chunks is not None), None)
            t = time.perf_counter()
            if pre is not None:
                self._prefill_chunk(pre, end)
            t1 = time.perf_counter()
            st.prefill_s += t1 - t
            dec = [q for q in active if q.feed is not None and not q.done]
            if dec:
                self._decode_step(dec, end)
                st.decode_s += time.perf_counter() - t1
            st.steps += 1
            self.active = len(active)
            self.kv_bytes = sum(q.session.kv.nbytes() for q in active)
            self.kv_bytes_full = sum(q.session.kv.nbytes_full() for q in active)
            st.peak_kv_bytes = max(st.peak_kv_bytes, self.kv_bytes)
            st.wall_s = time.perf_counter() - t_start
            if self.graph is not None:
                st.graph_steps, st.graph_captures = self.graph.static_steps, self.graph.captures
            if self.on_step is not None:
                self.on_step()
            yield from ready
            ready.clear()

    def _too_big(self, req: Request) -> str:
        need, lim = self.reserve(None, req), self.kv_mem
        return (
            f"its KV cache may need {need / 2**20:.1f} MiB ({len(req.prompt)} prompt + "
            f"{req.n_predict} tokens at full size) but --kv-mem is {lim / 2**20:.1f} MiB; "
            "raise --kv-mem or shorten the input"
        )

    def _start(self, session: Session, req: Request) -> _Seq:
        if req.start is not None:  # the request's own cache, holding its tokens already
            session.kv, held = req.start
            session.tokens, session.pending = list(held), []
        else:
            if req.new_kv is not None:
                session.kv = req.new_kv()
            session.reset()
        tail = TokenEnd(
            session.tokenizer, req.sampling,
            req.n_predict if req.n_predict >= 0 else session.context, session.context,
            req.seed, req.prompt[-1] if req.prompt else None, req.on_text, req.on_token,
            req.logprobs, req.cancelled, constraint=req.constraint,
        )  # fmt: skip
        rows = req.prompt_logprobs is not None
        chunks = session.prefill_turns(req.ids, req.question, rows=rows)
        seq = _Seq(req, session, chunks, tail)
        seq.stats.prompt_tokens = len(req.prompt)
        tail.t0 = time.perf_counter()  # from admission: waiting for a slot is not counted
        if req.on_start:
            req.on_start()
        return seq

    def _prefill_chunk(self, seq: _Seq, end) -> None:
        """One chunk of seq's prefill; after the last, its first token is sampled."""
        t, before = time.perf_counter(), len(seq.session.tokens)
        try:
            logits, last = next(seq.chunks)
        except KvrunError as e:
            return end(seq, str(e))
        except Exception as e:  # noqa: BLE001 - one bad sequence must not end the batch
            return end(seq, f"{type(e).__name__}: {e}")
        sync(seq.session.device)
        now = time.perf_counter()
        seq.stats.prefill_s += now - t
        self.stats.prefill_tokens += len(seq.session.tokens) - before
        if logits is not None and logits.dim() == 2:  # every row: the prompt's logprobs
            prompt = seq.req.prompt
            n = len(seq.session.tokens)
            targets = prompt[n - len(logits) + 1 : n + 1]  # what each row predicts
            seq.prompt_logprobs += token_logprobs(
                logits[: len(targets)], targets, seq.req.prompt_logprobs
            )
            logits = logits[-1]
        if not last:
            return None
        if logits is None:
            return end(seq, "the prompt is empty")
        seq.chunks = None
        seq.tail.prefilled(seq.session.device)
        if self.graph is not None:  # room for every token it may generate, once
            self.graph.reserve(seq.session.kv, len(seq.session.tokens) + seq.limit)
        if seq.limit > 0:
            self._take(seq, logits, end)
        else:
            end(seq)
        return None

    def _decode_step(self, seqs: list[_Seq], end) -> None:
        """One token for each of seqs in one forward pass."""
        try:
            if self.graph is not None:  # slot order: the same members, the same graph
                seqs = sorted(seqs, key=lambda q: self.sessions.index(q.session))
            logits = Session.decode_batch(
                [q.session for q in seqs], [q.feed for q in seqs], self.graph
            )
        except Exception as e:  # noqa: BLE001 - the step's caches may be half-written
            msg = str(e) if isinstance(e, KvrunError) else f"{type(e).__name__}: {e}"
            for q in seqs:
                end(q, f"failed in a batched decode step: {msg}")
            return
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(seqs)
        for q, row in zip(seqs, logits, strict=True):
            q.feed = None
            self._take(q, row, end)

    def _take(self, seq: _Seq, logits: torch.Tensor, end) -> None:
        """Sample the next token from logits (TokenEnd, as Session.generate does): the
        sequence goes on (seq.feed set) or ends."""
        try:
            seq.feed = seq.tail.take(logits, seq.session.tokens)
        except KvrunError as e:  # the grammar engine refusing its own mask: this sequence ends
            seq.feed = None
            return end(seq, str(e))
        if seq.feed is None:
            end(seq)

    def _result(self, seq: _Seq) -> Result:
        seq.session.pending = []
        pl = seq.prompt_logprobs if seq.req.prompt_logprobs is not None else None
        return seq.tail.finish(
            seq.session.kv, seq.session.device, seq.req.prompt, prompt_logprobs=pl
        )


class _Next:
    """The next request to admit: polled from the intake while none is held."""

    def __init__(self, intake: Intake):
        self.intake, self.req = intake, None

    def peek(self) -> Request | None:
        if self.req is None:
            self.req = self.intake.poll()
        return self.req

    def pop(self) -> Request | None:
        req, self.req = self.peek(), None
        return req
