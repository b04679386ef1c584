"""Perplexity of a KV method as decode sees it, with KL and top-1 agreement to the full cache.

Each window prefills `context` tokens through the method (so prefill-time compression runs),
then feeds the next `eval_tokens` true tokens one at a time (teacher forcing). Every token is
scored from the logits that predicted it, the first from the prefill's last logits. A
full-cache Session runs beside the method on the same tokens for KL(P_full || P_method) and
top-1 agreement; when the method is the full cache its own logits are the reference.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import ContextOverflow, KvrunError

if TYPE_CHECKING:  # torch loads with the model; the checks above run before that
    import torch

    from ..run.session import Session

FIGURES = ("nll", "ppl", "nll_full", "ppl_full", "kl", "top1")


@dataclass(slots=True)
class Window:
    """The figures of one window (means over its eval tokens)."""

    index: int
    start: int  # first file token of the window
    nll: float  # nats per token, method
    nll_full: float  # nats per token, full cache
    kl: float  # KL(P_full || P_method), nats
    top1: float  # share of positions where both argmaxes agree
    kv_bytes: int  # held by the method's cache at the end of the window
    kv_bytes_full: int
    token_nll: list[float] = field(default_factory=list)  # per eval token, method

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def ppl_full(self) -> float:
        return math.exp(self.nll_full)

    def as_dict(self) -> dict:
        """The window as --json reports it (per-token values left out)."""
        d = {"window": self.index, "start": self.start}
        d.update({k: getattr(self, k) for k in FIGURES})
        d.update(kv_bytes=self.kv_bytes, kv_bytes_full=self.kv_bytes_full)
        return d


@dataclass(slots=True)
class Report:
    """Every window of one run, with the means and the spread over windows."""

    windows: list[Window]
    context: int
    eval_tokens: int
    file_tokens: int
    prefill_s: float = 0.0  # method and reference together
    decode_s: float = 0.0
    peak_mem_bytes: int = 0

    def summary(self) -> dict:
        """Means (ppl = exp(mean nll)), KV bytes, and std/min/max of each figure over windows."""
        w = self.windows
        nll = statistics.fmean(x.nll for x in w)
        nll_full = statistics.fmean(x.nll_full for x in w)
        kv, kv_full = _mean_int(x.kv_bytes for x in w), _mean_int(x.kv_bytes_full for x in w)
        out = {
            "nll": nll,
            "ppl": math.exp(nll),
            "nll_full": nll_full,
            "ppl_full": math.exp(nll_full),
            "kl": statistics.fmean(x.kl for x in w),
            "top1": statistics.fmean(x.top1 for x in w),
            "kv_bytes": kv,
            "kv_bytes_full": kv_full,
            "kv_ratio": round(kv / kv_full, 4) if kv_full else 1.0,
        }
        out["spread"] = {k: spread([getattr(x, k) for x in w]) for k in FIGURES}
        return out


def _mean_int(values) -> int:
    v = list(values)
    return round(sum(v) / len(v))


def spread(values: Sequence[float]) -> dict:
    """Sample std (0 for one value), min and max."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"std": std, "min": min(values), "max": max(values)}


def file_tokens(tokenizer, text: str) -> list[int]:
    """The text's ids as llama.cpp's perplexity reads a file: control-token texts as plain
    text, BOS first when the model adds one."""
    ids = tokenizer.encode(text, add_bos=False, special=False)
    if tokenizer.add_bos and tokenizer.bos_id is not None:
        ids = [tokenizer.bos_id, *ids]
    return ids


def check_context(context: int, eval_tokens: int, max_context: int, ctx_flag: bool) -> None:
    """Raise ContextOverflow when one window (context + eval tokens) exceeds the context."""
    span = context + eval_tokens
    if span > max_context:
        limit = "-c/--ctx-size" if ctx_flag else "the model's context"
        raise ContextOverflow(
            f"--context {context} + --eval-tokens {eval_tokens} = {span} tokens exceed "
            f"{limit} of {max_context}; lower --context or --eval-tokens"
        )


def check_file(
    n_tokens: int, context: int, eval_tokens: int, windows: int, name: str = "the file"
) -> None:
    """Raise when the file is too short for `windows` non-overlapping windows."""
    need = windows * (context + eval_tokens)
    if n_tokens < need:
        raise KvrunError(
            f"{name} has {n_tokens} tokens but {windows} window(s) of {context} + {eval_tokens} "
            f"tokens need {need}; use a longer file or lower --windows, --context or --eval-tokens"
        )


def window_starts(n_tokens: int, span: int, windows: int) -> list[int]:
    """Starts of `windows` non-overlapping windows of `span` tokens spread evenly over the
    file: the first at 0, the last ending at the file's end (one window: at 0)."""
    if windows * span > n_tokens:
        raise KvrunError(f"{windows} windows of {span} tokens do not fit in {n_tokens} tokens")
    if windows == 1:
        return [0]
    # floor keeps consecutive starts >= span apart since (n - span) / (k - 1) >= span
    return [i * (n_tokens - span) // (windows - 1) for i in range(windows)]


def window_ids(tokens: Sequence[int], start: int, span: int, bos_id: int | None) -> list[int]:
    """The window's tokens; like llama.cpp, its first becomes BOS when the model adds one."""
    ids = list(tokens[start : start + span])
    if bos_id is not None:
        ids[0] = bos_id
    return ids


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.log_softmax(logits.to(torch.float64), dim=-1)  # (V,)


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(slots=True)
class Scores:
    """Per eval token of one window, and the window's prefill / decode seconds."""

    nll: list[float]  # method
    nll_full: list[float]  # full cache
    kl: list[float]  # KL(P_full || P_method)
    top1: list[bool]  # argmaxes agree
    prefill_s: float
    decode_s: float


def score_window(
    method: Session,
    ref: Session | None,
    ids: Sequence[int],
    context: int,
    step: Callable[[int], None] | None = None,
) -> Scores:
    """Prefill ids[:context] into both sessions, then teacher-force ids[context:].

    ref None: the method is the full cache and is its own reference (KL 0, agreement 1).
    step(n) is told of every n tokens fed (prefill chunks, then one per eval token).
    """
    sessions = [method] if ref is None else [method, ref]
    for s in sessions:
        s.reset()
    prog = None if step is None else _chunk_steps(step)
    t0 = time.perf_counter()
    logits = [method.prefill(ids[:context], prog)]
    if ref is not None:
        logits.append(ref.prefill(ids[:context]))
    _sync(method.device)
    t1 = time.perf_counter()
    nll, nll_ref, kl, agree = [], [], [], []  # 0-d tensors: no device sync per token
    targets = ids[context:]
    for j, target in enumerate(targets):
        lp = _logprobs(logits[0])  # (V,)
        lp_ref = lp if ref is None else _logprobs(logits[1])  # (V,)
        nll.append(-lp[target])
        nll_ref.append(-lp_ref[target])
        kl.append((lp_ref.exp() * (lp_ref - lp)).sum())  # exactly 0 when lp_ref is lp
        agree.append(lp.argmax() == lp_ref.argmax())
        if j + 1 < len(targets):  # the last token's logits would score nothing
            logits = [s.decode(target) for s in sessions]
        if step:
            step(1)
    import torch

    out = [torch.stack(x).tolist() for x in (nll, nll_ref, kl, agree)]  # syncs
    return Scores(*out, prefill_s=t1 - t0, decode_s=time.perf_counter() - t1)


def score_windows(
    pairs: Sequence[tuple[Session, Session | None]],
    windows: Sequence[Sequence[int]],
    context: int,
    step: Callable[[int], None] | None = None,
) -> list[Scores]:
    """score_window for several windows at once, each on its own (method, ref) pair: the
    prefills run one by one, then every eval token of every window (method and reference
    rows) goes through one batched decode step (Session.decode_batch, kvrun.engine's batch).
    The time of the batch is shared evenly among its windows."""
    k = len(windows)
    flat = [s for m, r in pairs[:k] for s in ([m] if r is None else [m, r])]
    owners = [i for i, (_, r) in enumerate(pairs[:k]) for _ in range(1 if r is None else 2)]
    for s in flat:
        s.reset()
    t0 = time.perf_counter()
    logits = []
    for s, i in zip(flat, owners, strict=True):  # progress counts the method's prefills
        prog = _chunk_steps(step) if step and s is pairs[i][0] else None
        logits.append(s.prefill(windows[i][:context], prog))
    _sync(flat[0].device)
    t1 = time.perf_counter()
    n = len(windows[0]) - context
    acc = [([], [], [], []) for _ in range(k)]  # nll, nll_ref, kl, agree per window
    for j in range(n):
        for i in range(k):
            rows = [x for x, o in zip(logits, owners, strict=True) if o == i]
            lp = _logprobs(rows[0])
            lp_ref = lp if len(rows) == 1 else _logprobs(rows[1])
            target = windows[i][context + j]
            kl = (lp_ref.exp() * (lp_ref - lp)).sum()
            agree = lp.argmax() == lp_ref.argmax()
            for out, x in zip(acc[i], (-lp[target], -lp_ref[target], kl, agree), strict=True):
                out.append(x)
        if j + 1 < n:
            feed = [windows[i][context + j] for i in owners]
            from ..run.session import Session

            logits = list(Session.decode_batch(flat, feed))
        if step:
            step(k)
    t2 = time.perf_counter()
    import torch

    return [
        Scores(
            *(torch.stack(x).tolist() for x in a), prefill_s=(t1 - t0) / k, decode_s=(t2 - t1) / k
        )
        for a in acc
    ]


def _chunk_steps(step: Callable[[int], None]) -> Callable[[int, int], None]:
    """A Session.prefill progress callback (done, total) that reports increments to step."""
    last = [0]

    def cb(done: int, total: int) -> None:
        step(done - last[0])
        last[0] = done

    return cb


def evaluate(
    method: Session,
    ref: Session | None,
    tokens: Sequence[int],
    context: int,
    eval_tokens: int,
    windows: int = 1,
    bos_id: int | None = None,
    step: Callable[[int], None] | None = None,
    on_window: Callable[[Window], None] | None = None,
    more: Sequence[tuple[Session, Session | None]] = (),
) -> Report:
    """Score `windows` windows of context + eval_tokens tokens spread over `tokens`.

    ref: a full-cache Session on the same model (None when the method is the full cache).
    bos_id: replaces each window's first token (pass it when the model adds BOS).
    more: further (method, ref) pairs like the first: windows are then scored
    1 + len(more) at a time in batched decode steps (--parallel).
    """
    span = context + eval_tokens
    ctx_flag = method.context != method.model.config.context_length
    check_context(context, eval_tokens, method.context, ctx_flag)
    check_file(len(tokens), context, eval_tokens, windows)
    out: list[Window] = []
    prefill_s = decode_s = 0.0
    pairs = [(method, ref), *more]
    starts = window_starts(len(tokens), span, windows)
    for b in range(0, len(starts), len(pairs)):
        batch = starts[b : b + len(pairs)]
        ids = [window_ids(tokens, start, span, bos_id) for start in batch]
        if len(pairs) == 1:
            scores = [score_window(method, ref, ids[0], context, step)]
        else:
            scores = score_windows(pairs, ids, context, step)
        for i, (start, sc) in enumerate(zip(batch, scores, strict=True)):
            m = pairs[i][0]
            prefill_s, decode_s = prefill_s + sc.prefill_s, decode_s + sc.decode_s
            w = Window(
                index=b + i,
                start=start,
                nll=statistics.fmean(sc.nll),
                nll_full=statistics.fmean(sc.nll_full),
                kl=statistics.fmean(sc.kl),
                top1=sum(sc.top1) / len(sc.top1),
                kv_bytes=m.kv.nbytes(),
                kv_bytes_full=m.kv.nbytes_full(),
                token_nll=sc.nll,
            )
            out.append(w)
            if on_window:
                on_window(w)
    from ..run.session import peak_memory_bytes

    peak = peak_memory_bytes(method.device)
    return Report(out, context, eval_tokens, len(tokens), prefill_s, decode_s, peak)
