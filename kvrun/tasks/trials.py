"""Prompts x KV configs, each on a fresh cache, answered greedily one by one or batched through
kvrun.run.engine, results given back in the order the trials came: the runner under kvrun
needle and kvrun ruler."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import KvrunError
from ..kv import KVSpec
from ..models.config import SamplingConfig

GREEDY = SamplingConfig(temp=0.0, top_k=0, top_p=1.0, min_p=0.0)


@dataclass(frozen=True)
class Trial:
    """One prompt under one KV method."""

    tag: Any  # the caller's, given back with the result
    spec: KVSpec  # the method, on a fresh cache of its own
    ids: list[int]  # the prompt (with question: the document's turn)
    question: list[int] | None  # --question-after: a turn of its own on the compressed cache
    n_predict: int
    label: str  # names the trial in an error


def run_trials(
    rt, trials: Iterable[Trial], seed: int, ubatch: int = 512, context: int = 0, parallel: int = 1
) -> Iterator[tuple[Trial, Any]]:
    """(trial, kvrun.run.session.Result) for each trial, in the order given; with parallel > 1
    that many decode together (kvrun.run.engine) and every result is the sequential one."""
    if parallel > 1:
        yield from _parallel(rt, trials, seed, ubatch, context, parallel)
        return
    from ..run.session import Session

    for t in trials:
        session = Session(rt.model, rt.tokenizer, rt.new_kv(t.spec), ubatch=ubatch, context=context)
        yield t, session.generate(t.ids, t.n_predict, GREEDY, seed=seed, question=t.question)


def _parallel(rt, trials, seed, ubatch, context, parallel):
    """run_trials through the batch engine; results are held back until every earlier trial's
    is in, so the order is the sequential one."""
    from ..run.engine import Engine, Request
    from ..run.session import Session

    it = iter(trials)
    first = next(it, None)
    if first is None:
        return

    def requests():
        for i, t in enumerate(itertools.chain([first], it)):
            new_kv = lambda spec=t.spec: rt.new_kv(spec)  # noqa: E731
            yield Request(t.ids, t.n_predict, GREEDY, seed, (i, t), question=t.question,
                          new_kv=new_kv)  # fmt: skip

    sessions = [
        Session(rt.model, rt.tokenizer, rt.new_kv(first.spec), ubatch=ubatch, context=context)
        for _ in range(parallel)
    ]
    done, nxt = {}, 0
    for req, result, error in Engine(sessions).results(requests()):
        i, t = req.tag
        if error is not None:
            raise KvrunError(f"{t.label}: {error}")
        done[i] = (t, result)
        while nxt in done:
            yield done.pop(nxt)
            nxt += 1
