"""Running a longdoc batch: the command line's options made into the run's job, and the
runners that answer its documents, on this process's sessions (one at a time, or several at
once through kvrun.engine) or on Ray workers (kvrun.cluster).

A runner is called as run(docs, job, write, done, start, finish) -> documents failed, with
run_batch's callbacks (kvrun.tasks.longdoc_questions); the CLI (kvrun.cli.longdoc) reads the input and
writes the output around it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..models.config import SamplingConfig
from ..run.options import KVOptions, ModelOptions, ParallelOptions, RayOptions
from . import longdoc as task
from . import longdoc_questions as batch
from .longdoc import Doc, LongdocJob


@dataclass(frozen=True)
class LongdocOptions:
    """What the command line asks of every document, known before a model loads; with what
    the model tells (its KV manager, its settings) it makes the run's LongdocJob."""

    templates: dict  # "question" | "summarize" -> template text with a {document} slot
    question: str | None  # -q: for every document without its own
    summarize: bool
    chat: bool | None  # --chat/--raw; None: --chat when the model has a chat template
    template: str | None  # --template FILE; None: the built-in prompts
    n_predict: int
    truncate: str  # one of TRUNCATE_MODES
    sampling: SamplingConfig
    seed: int
    question_after: bool = False

    def settings(self, rt, session) -> dict:
        """The run's settings, repeated in every record."""
        chat = self.chat if self.chat is not None else rt.tokenizer.chat_template is not None
        return {
            "model": str(rt.path),
            "model_name": rt.config.name,
            "seed": self.seed,
            "n_predict": self.n_predict,
            "truncate": self.truncate,
            "chat": chat,
            "template": self.template or "builtin",
            "question_after": self.question_after,
            "ctx_size": session.context,
            "ubatch": session.ubatch,
            "dtype": str(rt.model.dtype).removeprefix("torch."),
            "wtype": rt.weights.wtype,
            "device": str(rt.model.device),
            **dataclasses.asdict(self.sampling),
        }

    def job(self, kv: dict, settings: dict, debug: bool = False) -> LongdocJob:
        """The run's job: kv, the KV manager's describe(); settings, as `settings` made them."""
        return LongdocJob(
            self.templates,
            self.question,
            self.summarize,
            settings["chat"],
            self.n_predict,
            self.truncate,
            self.sampling,
            self.seed,
            kv,
            settings,
            debug=debug,
            question_after=self.question_after,
        )


class LocalRunner:
    """This process's sessions: one (documents in order, answers streamed) or several
    (kvrun.engine; kv_mem: its admission limit in bytes); new_kv() -> a fresh cache of the
    run's method (a "questions" line's document prefills in one)."""

    def __init__(self, sessions: list, kv_mem: int | None, new_kv=None, kvc_dir=None):
        self.sessions, self.kv_mem, self.stats, self.new_kv = sessions, kv_mem, None, new_kv
        self.kvc_dir = kvc_dir  # longdoc_questions.KvcDir (--kv-cache-dir)

    @property
    def parallel(self) -> bool:
        return len(self.sessions) > 1

    def __call__(self, docs, job: LongdocJob, write, done, start, finish) -> int:
        if not self.parallel:
            s = self.sessions[0]
            kw = {"new_kv": self.new_kv, "kvc_dir": self.kvc_dir}
            return batch.run_batch(s, docs, job, write, done, start, finish, **kw)
        failed, self.stats = batch.run_parallel(
            self.sessions, docs, job, write, done, finish, self.kv_mem, self.new_kv, self.kvc_dir
        )
        return failed

    def describe(self) -> str | None:
        """A progress label while the batch runs (None: the bar's own)."""
        return None

    def summary(self) -> str | None:
        """The engine's figures of a --parallel run (None for one session)."""
        s = self.stats
        if s is None:
            return None
        if not s.wall_s:
            return f"parallel {len(self.sessions)}: nothing to run"
        graph = f", {s.graph_steps} static, {s.graph_captures} graphs" if s.graph_steps else ""
        return (
            f"parallel {len(self.sessions)}: {s.sequences} sequences in {s.wall_s:.1f} s "
            f"({60 * s.sequences / s.wall_s:.1f}/min); decode {s.decode_tok_s:.1f} tok/s "
            f"aggregate ({s.decode_steps} batched steps{graph}, {s.decode_s:.1f} s), prefill "
            f"{s.prefill_tokens} tok in {s.prefill_s:.1f} s; up to {s.max_active} at once, "
            f"peak KV {s.peak_kv_bytes / 2**20:.1f} MiB"
        )


class RayRunner:
    """Ray workers (a kvrun.cluster.Pool), `chunk` documents per call; `done` counts the
    documents answered."""

    def __init__(self, pool, chunk: int):
        self.pool, self.chunk, self.done = pool, chunk, 0

    def __call__(self, docs, job: LongdocJob, write, done, start, finish) -> int:
        failed = 0

        def on_result(doc, recs) -> None:
            nonlocal failed
            for rec in recs if isinstance(recs, list) else [recs]:
                write(rec)
                failed += rec["error"] is not None
                finish(doc, rec)
            self.done += 1

        def items():
            for doc in task.todo(docs, done, finish):
                if doc.error:  # a bad input line: its record here, no worker needed
                    on_result(doc, task.process(None, doc, job))
                    continue
                key = task.doc_key(doc.id) if doc.id is not None else f"line {doc.line}"
                yield key, doc

        for doc, rec, error in self.pool.stream(items(), self.chunk):
            on_result(doc, rec if error is None else task.error_records(doc, job, error))
        return failed

    def describe(self) -> str:
        wall = time.monotonic() - self.pool.t0 if self.pool.t0 else 0.0
        rate = f"{60 * self.done / wall:.1f}/min" if wall > 0 and self.done else "-/min"
        return f"documents  {rate}  workers {self.pool.alive}/{self.pool.lay.workers}"

    def summary(self) -> str:
        return self.pool.summary(self.done, "documents")

    def close(self) -> None:
        self.pool.close()


def start_local(rt, spec, parallel: ParallelOptions, opts: LongdocOptions, debug: bool,
                kv_cache_dir: str | None, new_session) -> tuple[LocalRunner, LongdocJob, dict]:  # fmt: skip
    """This process's --parallel sessions on rt (new_session(kv, first) makes each; only the
    first notes a graph that is not used): the runner over them, the run's job and settings."""
    from .longdoc_questions import KvcDir

    kv_mem = parallel.kv_mem_bytes(rt.model.device)
    sessions = [new_session(rt.new_kv(spec), i == 0) for i in range(parallel.n)]
    settings = opts.settings(rt, sessions[0])
    job = opts.job(sessions[0].kv.describe(), settings, debug)
    kvc_dir = KvcDir(kv_cache_dir, rt, spec) if kv_cache_dir else None
    return LocalRunner(sessions, kv_mem, lambda: rt.new_kv(spec), kvc_dir), job, settings


def start_ray(
    ray: RayOptions,
    model: ModelOptions,
    kv: KVOptions,
    parallel: ParallelOptions,
    opts: LongdocOptions,
    debug: bool,
    echo: Callable[[str], None],
) -> tuple[RayRunner, LongdocJob]:
    """Ray workers started (worker_setup on each) and one of them ready: the runner over them
    (close it when done) and the run's job, from what that worker's model tells."""
    from ..run import cluster

    args = {"kv": kv, "parallel": parallel, "opts": opts}
    pool, facts = cluster.start(ray, worker_setup, model, args, echo)
    return RayRunner(pool, parallel.n), opts.job(facts["kv"], facts["settings"], debug)


def worker_setup(
    model: ModelOptions, kv: KVOptions, parallel: ParallelOptions, opts: LongdocOptions
):
    """On a Ray worker (kvrun.cluster): the model, the command's sessions and its job.
    Returns (handler, facts): handler(docs, node) -> each doc's records (a list), in order."""
    from ..run.cluster import load_model

    spec = kv.spec()
    rt = load_model(model)
    sessions = [model.session(rt, rt.new_kv(spec)) for _ in range(parallel.n)]
    settings = opts.settings(rt, sessions[0])
    job = opts.job(sessions[0].kv.describe(), settings)
    kv_mem = parallel.kv_mem_bytes(rt.model.device)
    new_kv = lambda: rt.new_kv(spec)  # noqa: E731

    def handler(docs: list[Doc], node: str) -> list[list[dict]]:
        got = {d.line: [] for d in docs}
        keep = lambda r: got[r["line"]].append({**r, "node": node})  # noqa: E731
        none = lambda d, r: None  # noqa: E731
        if len(sessions) == 1:
            batch.run_batch(
                sessions[0], docs, job, keep, set(), lambda d: (None, None), none, new_kv
            )
        else:
            batch.run_parallel(sessions, docs, job, keep, set(), none, kv_mem, new_kv)
        return [got[d.line] for d in docs]

    return handler, {"settings": settings, "kv": job.kv}


def absolute_paths(docs: Iterable[Doc]) -> Iterator[Doc]:
    """Relative "path" fields are taken from this directory, wherever the worker runs."""
    for doc in docs:
        if doc.path is not None:
            doc.path = str(Path(doc.path).absolute())
        yield doc
