"""Generation: chunked prefill, one-token decode, sampling and streaming, with measured stats."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch

from ..errors import ContextOverflow, KvrunError
from .graph import BatchGraph, DecodeGraph, eager_rows, static_unsupported
from .sampling import SamplingConfig

# re-exported: kvrun.generate.Stats, Result, ... (their home is kvrun.token_end)
from .token_end import (  # noqa: F401
    PhaseStats,
    Result,
    Stats,
    TokenEnd,
    TokenLogprob,
    peak_memory_bytes,
    sync,
    token_logprobs,
)


def run_pass(model, p, ubatch: int) -> None:
    """A planning pass (kvrun/kv/protocol.py's Pass) through the model, in --ubatch chunks."""
    kv = p.kv
    kv.begin_prefill(len(p.ids))
    for s in range(0, len(p.ids), ubatch):
        chunk = p.ids[s : s + ubatch]
        tok = torch.tensor([chunk], device=model.device)
        pos = torch.arange(p.start + s, p.start + s + len(chunk), device=model.device)
        model(tok, pos, kv, last_only=True)
        kv.end_chunk(len(chunk))
    kv.end_prefill()


class Session:
    """One sequence on one model: owns the KV manager and the tokens it has seen."""

    def __init__(
        self, model, tokenizer, kv, ubatch: int = 512, context: int = 0, graph: str = "off"
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.kv = kv
        self.ubatch = max(1, ubatch)
        self.context = context or model.config.context_length
        # "on": decode steps replay a CUDA graph (kvrun/graph.py); "static": the same static
        # step without capture (CPU tests); "off": eager dynamic steps
        self.graph: DecodeGraph | None = None
        self.graph_note = ""  # why a requested graph is not used (the CLI prints it)
        if graph not in ("off", "on", "static"):
            raise ValueError(f"graph mode {graph!r}: use off, on or static")
        if graph == "on" and self.device.type != "cuda":
            raise KvrunError("--cuda-graph needs a CUDA device (--device cuda)")
        why = static_unsupported(kv) if graph != "off" else None
        if why:
            self.graph_note = f"CUDA graph off: {why}; decoding eagerly"
            graph = "off"
        self.graph_mode = graph
        self.tokens: list[int] = []  # every token fed to the cache, in order
        self.pending: list[int] = []  # sampled last turn but not yet fed to the cache

    @property
    def device(self) -> torch.device:
        return self.model.device

    def reset(self) -> None:
        """Start a new sequence (drops the cache)."""
        self.kv.reset()
        self.tokens = []
        self.pending = []

    def check_fits(self, n_new: int) -> None:
        """Raise ContextOverflow when n_new more tokens do not fit the context."""
        if len(self.tokens) + n_new > self.context:
            held = f" ({len(self.tokens)} already in the cache)" if self.tokens else ""
            raise ContextOverflow(
                f"the prompt is {n_new} tokens{held} but the context is {self.context}; "
                f"raise -c/--ctx-size (model max {self.model.config.context_length}) or shorten the input"
            )

    def prefill(
        self,
        ids: Sequence[int],
        progress: Callable[[int, int], None] | None = None,
        question: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Feed ids in chunks of --ubatch; return the logits (V,) after the last one. With
        `question`, ids are a document turn, compressed at its end, and the question follows
        as a turn of its own that selects nothing (--question-after)."""
        logits = None
        for out in self.prefill_turns(ids, question, progress):
            logits = out[0]
        return logits

    def prefill_turns(
        self,
        ids: Sequence[int],
        question: Sequence[int] | None = None,
        progress: Callable[[int, int], None] | None = None,
        rows: bool = False,
    ) -> Iterator[tuple[torch.Tensor, bool]]:
        """`prefill` one --ubatch chunk per step: yields (logits after the chunk, whether it
        was the last of the prompt); rows: every position's logits (prefill_chunks)."""
        if not question:
            yield from self.prefill_chunks(ids, progress, rows=rows)
            return
        if not ids:  # the document is in the cache already (a fork, a .kvc): no turn of its own
            yield from self.prefill_chunks(question, progress, select=False, rows=rows)
            return
        self.check_fits(len(ids) + len(question))
        n = len(ids) + len(question)
        done = lambda k, _: progress(k, n) if progress else None  # noqa: E731
        yield from ((out, False) for out, _ in self.prefill_chunks(ids, done, rows=rows))
        more = lambda k, _: progress(len(ids) + k, n) if progress else None  # noqa: E731
        yield from self.prefill_chunks(question, more, select=False, rows=rows)

    def prefill_chunks(
        self,
        ids: Sequence[int],
        progress: Callable[[int, int], None] | None = None,
        select: bool = True,
        rows: bool = False,
    ) -> Iterator[tuple[torch.Tensor, bool]]:
        """One turn's prefill, one --ubatch chunk per step (the batch engine interleaves them
        with decode steps): yields (logits after the chunk, whether it was the last). With
        select=False the cache stores the turn and compresses nothing (kvrun/kv/protocol.py).
        rows: the logits of every position of the chunk (T, V), not only the last (V,)."""
        self.check_fits(len(ids))
        with torch.inference_mode():
            self.plan(ids, "before")
            self.kv.begin_prefill(len(ids), select)
        if not ids:  # nothing to feed: the turn ends at once (no logits)
            with torch.inference_mode():
                self.kv.end_prefill()
            yield None, True
            return
        for s in range(0, len(ids), self.ubatch):
            chunk = list(ids[s : s + self.ubatch])
            start = len(self.tokens)
            with torch.inference_mode():
                tok = torch.tensor([chunk], device=self.device)  # (1, T)
                pos = torch.arange(start, start + len(chunk), device=self.device)  # (T,)
                logits = self.model(tok, pos, self.kv, last_only=not rows)[0]
                logits = logits if rows else logits[-1]
                self.kv.end_chunk(len(chunk))
                self.tokens.extend(chunk)
                if progress:
                    progress(s + len(chunk), len(ids))
                last = s + len(chunk) >= len(ids)
                if last:
                    self.plan(ids, "after")
                    self.kv.end_prefill()
            yield logits, last

    @torch.inference_mode()
    def plan(self, ids: Sequence[int], when: str) -> None:
        """The planning passes the cache asks for "before" the prefill of `ids` (XKV's scoring
        pass) or "after" it, before its end_prefill (a reconstruction pass): each runs through
        the model with a manager of its own (kvrun/kv/protocol.py's planning_pass). A pass that
        must be one chunk is skipped when longer than --ubatch."""
        for p in self.kv.planning_pass(when, ids, self.tokenizer):
            if not (p.whole and len(p.ids) > self.ubatch):
                run_pass(self.model, p, self.ubatch)

    def prepare_decode(self, n_more: int) -> None:
        """Set up graph decoding for up to n_more more tokens (capture happens here, so
        callers that time decode steps can leave it out); a no-op with graph mode off."""
        if self.graph_mode == "off" or len(self.tokens) >= self.context:
            return
        need = min(len(self.tokens) + max(n_more, 1), self.context)
        with torch.inference_mode():
            if self.graph is None:
                capture = self.graph_mode == "on"
                self.graph = DecodeGraph(self.model, self.kv, need, self.context, capture)
            elif need > self.graph.capacity:
                self.graph.reserve(need)
            self.graph.ready(len(self.tokens))

    @torch.inference_mode()
    def decode(self, token: int) -> torch.Tensor:
        """Feed one token; return the next-token logits (V,)."""
        if self.graph_mode != "off":
            if self.graph is None:
                self.prepare_decode(1)
            logits = self.graph.step(token, len(self.tokens))
        else:
            pos = torch.tensor([len(self.tokens)], device=self.device)
            tok = torch.tensor([[token]], device=self.device)
            logits = self.model(tok, pos, self.kv)[0, -1]
        self.kv.end_step()
        self.tokens.append(token)
        return logits

    @staticmethod
    @torch.inference_mode()
    def decode_batch(
        sessions: Sequence[Session], tokens: Sequence[int], graph: BatchGraph | None = None
    ) -> torch.Tensor:
        """Feed one token to each of several sessions of one model in one forward pass (the
        linear layers read the weights once for all of them; each session's cache attends
        for its own row: kvrun.batch). Returns the next-token logits (B, V). With `graph`
        the step is the static one, replayed from a CUDA graph where every cache allows
        (kvrun.graph.BatchGraph); without, eager (the sessions' own graph mode is not used)."""
        if len(sessions) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens for {len(sessions)} sessions")
        model = sessions[0].model
        if any(s.model is not model for s in sessions):
            raise ValueError("a batch runs sessions of one model")
        for s in sessions:
            s.check_fits(1)
        kvs, positions = [s.kv for s in sessions], [len(s.tokens) for s in sessions]
        if graph is not None:
            logits = graph.step(kvs, tokens, positions)
        else:
            logits = eager_rows(model, kvs, tokens, positions)
        for s, t in zip(sessions, tokens, strict=True):
            s.kv.end_step()
            s.tokens.append(t)
        return logits

    def generate(
        self,
        prompt_ids: Sequence[int],
        n_predict: int,
        sampling: SamplingConfig,
        seed: int | None = None,
        on_text: Callable[[str], None] | None = None,
        progress: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        question: Sequence[int] | None = None,
        constraint=None,
    ) -> Result:
        """Prefill prompt_ids (appended to what the cache holds), then sample up to n_predict.

        n_predict < 0 generates until a stop token or the end of the context. With `question`
        the prompt is a document turn and a question turn (`prefill`). constraint: a grammar
        (kvrun.run.grammar.Constraint) the reply must follow; it ends once the grammar is
        complete.
        """
        last = (list(question or []) or list(prompt_ids))[-1:]
        limit = n_predict if n_predict >= 0 else self.context
        end = TokenEnd(
            self.tokenizer, sampling, limit, self.context, seed, last[0] if last else None,
            on_text=on_text, stop=should_stop, stop_reason="interrupt", constraint=constraint,
        )  # fmt: skip
        prompt_ids = self.pending + list(prompt_ids)
        end.stats.prompt_tokens = len(prompt_ids) + len(question or [])
        sync(self.device)
        end.t0 = time.perf_counter()
        logits = self.prefill(prompt_ids, progress, question)
        self.pending = []
        end.prefilled(self.device)
        end.stats.prefill_s = end.t_prefill - end.t0
        if limit > 1:
            self.prepare_decode(limit - 1)  # a graph capture counts as decode time
        fed = 0  # every token sampled so far has been fed, so the cache's tokens are the history
        tok = end.take(logits, self.tokens) if limit > 0 else None
        while tok is not None:
            logits = self.decode(tok)
            fed += 1
            tok = end.take(logits, self.tokens)
        # a sampled token that never went through decode is fed before the next prefill
        self.pending = end.out[fed:]
        return end.finish(self.kv, self.device, list(prompt_ids) + list(question or []))
