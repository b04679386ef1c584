"""kvrun longdoc: answer or summarize long documents, one by one or as a resumable JSONL batch."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import click

from ..errors import KvrunError
from ..tasks import longdoc as task
from .common import (
    check_kv,
    graph_option,
    kv_options,
    load_on_worker,
    load_with_progress,
    model_options,
    needs_text,
    new_session,
    parallel_options,
    parse_mem,
    progress_bar,
    question_after_option,
    ray_options,
    read_stdin,
    sampling_from,
    sampling_options,
    set_debug,
    stats_line,
)


@click.command()
@model_options
@graph_option
@kv_options()
@parallel_options
@sampling_options(temp=0.0)  # greedy: answers should not depend on the seed
@click.argument("files", nargs=-1, metavar="[FILE]...")
@click.option(
    "-q",
    "--question",
    default=None,
    help="Question asked of every document (of each --jsonl line without one).",
)
@click.option(
    "--summarize",
    is_flag=True,
    help="Summarize every document (each --jsonl line without a question) instead.",
)
@click.option(
    "--jsonl",
    default=None,
    metavar="IN",
    help='Batch input, one JSON object a line: {"id", "text" or "path", "question"?}; '
    "'-' = stdin; relative paths are taken from the current directory.",
)
@click.option(
    "-o", "--out", default=None, metavar="OUT", help="Write the JSON lines here (default: stdout)."
)
@click.option("--resume", is_flag=True, help="Skip ids already answered in OUT; retry its errors.")
@click.option(
    "--truncate",
    type=click.Choice(task.TRUNCATE_MODES),
    default="middle",
    show_default=True,
    help="Documents longer than the context: keep head+tail, keep the tail, or fail the document.",
)
@click.option(
    "-n",
    "--n-predict",
    default=256,
    show_default=True,
    type=click.IntRange(min=0),
    help="Tokens to generate per document (reserved in the context).",
)
@click.option(
    "--chat/--raw",
    "chat",
    default=None,
    help="Wrap prompts in the model's chat template (default: --chat when it has one).",
)
@click.option(
    "--template",
    default=None,
    metavar="FILE",
    help="Own prompt template with a {document} slot and an optional {question} slot.",
)
@question_after_option
@ray_options
@click.pass_context
def longdoc(ctx, files, question, summarize, jsonl, out, resume, truncate, n_predict, chat,
            template, question_after, ray_address, workers, cpus_per_worker, retries,
            **kw):  # fmt: skip
    """Answer a question about long documents, or summarize them, on a fresh KV cache each.

    Documents longer than the context (minus the prompt and -n) are cut on tokens by
    --truncate; the prompt template and question are never cut. With FILEs, each answer is
    printed under a header with its stats line on stderr. With --jsonl (or --out), each
    document gives one JSON line (answer, tokens, stats, truncated/dropped_tokens, kv, error),
    written as soon as it is done; every line repeats the run's settings (model, seed,
    n_predict, truncate, sampling, ...) under "settings" (with FILEs they go once to stderr).
    A failing document gets a line with its error and the batch goes on; the exit status is 1
    when any failed. --resume skips ids already answered in OUT. Greedy (--temp 0) by default.
    --parallel N answers N documents at once (lines are written as each finishes, so not in
    input order; with FILEs each answer is printed whole when it is done). --ray runs a --jsonl
    batch on Ray workers, each with its own model and --parallel sessions; a worker that dies
    has its documents sent again (--retries), and every line gets the worker's "node".

    \b
    kvrun longdoc report.txt -q "Who signed the contract?"
    kvrun longdoc --summarize --kv snapkv --kv-budget 0.25 a.txt b.txt
    kvrun longdoc --jsonl docs.jsonl --out answers.jsonl --summarize --truncate left
    kvrun longdoc --jsonl docs.jsonl --out answers.jsonl --resume
    kvrun longdoc --jsonl docs.jsonl --out answers.jsonl -q "..." --parallel 8 --kv-mem 2G
    kvrun longdoc report.txt -q "Who signed?" --kv snapkv --question-after
    kvrun longdoc --jsonl docs.jsonl --out answers.jsonl -q "..." --ray   (on a Ray cluster)
    cat docs.jsonl | kvrun longdoc --jsonl - -q "What is the main claim?" > answers.jsonl
    """
    set_debug(ctx, kw.pop("debug"))
    out = None if out == "-" else out
    if files and jsonl:
        raise KvrunError("give FILEs or --jsonl IN, not both")
    if not files and not jsonl:
        raise KvrunError("no documents: give FILE... or --jsonl IN")
    if question is not None and summarize:
        raise KvrunError("give --question or --summarize, not both")
    if question is None and not summarize and not jsonl:
        raise KvrunError('nothing to ask: give --question "..." or --summarize')
    if resume and not out:
        raise KvrunError("--resume needs --out OUT (the file to continue)")
    if out and not Path(out).absolute().parent.is_dir():
        raise KvrunError(f"cannot write --out {out}: its folder does not exist")
    if ray_address and not jsonl:
        raise KvrunError("--ray runs a batch: give --jsonl IN (and --out OUT)")
    if ray_address:
        from ..cluster import import_ray

        import_ray()  # missing Ray is said before anything else is read
        needs_text(kw["model"])
    docs = None if ray_address else _read_docs(files, jsonl)
    done, note = task.prepare_results(Path(out), resume) if out else (set(), None)
    sampling, seed = sampling_from(kw)
    opts = {
        "templates": {t: task.load_template(t, template) for t in ("question", "summarize")},
        "question": question,
        "summarize": summarize,
        "chat": chat,
        "template": template,
        "n_predict": n_predict,
        "truncate": truncate,
        "sampling": sampling,
        "seed": seed,
        "question_after": question_after,
    }
    spec = check_kv(kw)
    debug = bool((ctx.find_root().obj or {}).get("debug"))
    if ray_address:
        if note:
            click.echo(note, err=True)
        ray = (ray_address, workers, cpus_per_worker, retries)
        return _longdoc_ray(ctx, ray, jsonl, out, done, kw, opts, debug)
    rt = load_with_progress(kw)
    parallel, kv_mem = kw.pop("parallel"), parse_mem(kw.pop("kv_mem"), rt.model.device)
    sessions = [new_session(rt, rt.new_kv(spec), kw, note=i == 0) for i in range(parallel)]
    settings = _settings(rt, sessions[0], opts)
    job = _job(opts, sessions[0].kv.describe(), settings, debug)
    if note:
        click.echo(note, err=True)
    run = _Runner(sessions, kv_mem)
    if jsonl or out:
        failed = _run_records(ctx, run, docs, job, out, done)
    else:
        click.echo("settings: " + json.dumps({"kv": job.kv, **settings}), err=True)
        failed = _run_text(run, docs, job)
    if run.stats is not None:
        click.echo(run.summary(), err=True)
    if failed:
        raise KvrunError(f"{failed} of {len(docs)} documents failed (their errors are above)")


def _settings(rt, session, opts: dict) -> dict:
    """The run's settings, repeated in every record."""
    tok = rt.tokenizer
    return {
        "model": str(rt.path),
        "model_name": rt.config.name,
        "seed": opts["seed"],
        "n_predict": opts["n_predict"],
        "truncate": opts["truncate"],
        "chat": opts["chat"] if opts["chat"] is not None else tok.chat_template is not None,
        "template": opts["template"] or "builtin",
        "question_after": opts["question_after"],
        "ctx_size": session.context,
        "ubatch": session.ubatch,
        "dtype": str(rt.model.dtype).removeprefix("torch."),
        "wtype": rt.weights.wtype,
        "device": str(rt.model.device),
        **dataclasses.asdict(opts["sampling"]),
    }


def _job(opts: dict, kv: dict, settings: dict, debug: bool) -> task.Job:
    o = opts
    return task.Job(
        o["templates"], o["question"], o["summarize"], settings["chat"], o["n_predict"],
        o["truncate"], o["sampling"], o["seed"], kv, settings, debug=debug,
        question_after=o["question_after"],
    )  # fmt: skip


def worker_setup(load: dict, kv: dict, opts: dict):
    """On a Ray worker (kvrun.cluster): the model, the command's sessions and its Job.
    Returns (handler, facts): handler(docs, node) -> their records, in order."""
    spec = check_kv(kv)
    rt = load_on_worker(load)
    sessions = [new_session(rt, rt.new_kv(spec), load, note=False) for _ in range(load["parallel"])]
    settings = _settings(rt, sessions[0], opts)
    job = _job(opts, sessions[0].kv.describe(), settings, debug=False)
    kv_mem = parse_mem(load["kv_mem"], rt.model.device)

    def handler(docs: list, node: str) -> list[dict]:
        if len(sessions) == 1:
            recs = [task.process(sessions[0], d, job) for d in docs]
        else:
            got = {}
            task.run_parallel(sessions, docs, job, lambda r: got.__setitem__(r["line"], r),
                              set(), lambda d, r: None, kv_mem)  # fmt: skip
            recs = [got[d.line] for d in docs]
        for r in recs:
            r["node"] = node
        return recs

    return handler, {"settings": settings, "kv": job.kv}


def _longdoc_ray(ctx, ray_opts, jsonl, out, done, kw, opts, debug) -> None:
    """The --jsonl batch on Ray workers: documents streamed to them, lines written as they
    come back, in the local run's format (plus "node")."""
    from .. import cluster

    def args_of(load: dict) -> dict:
        return {"load": load, "kv": {"kv": load["kv"], "kv_budget": load.get("kv_budget")},
                "opts": opts}  # fmt: skip

    if jsonl == "-":
        lines, total = (line.rstrip("\n") for line in sys.stdin), None
    else:  # an unreadable input fails before any worker starts
        try:
            total = task.count_docs(jsonl)
        except OSError as e:
            raise KvrunError(f"cannot read --jsonl {jsonl}: {e.strerror}") from None
        lines = task.jsonl_lines(jsonl)
    echo = lambda m: click.echo(m, err=True)  # noqa: E731
    pool, facts = cluster.start(ray_opts, kw, worker_setup, args_of, echo)
    try:
        job = _job(opts, facts["kv"], facts["settings"], debug)
        run = _RayRunner(pool, kw["parallel"])
        failed = _run_records(ctx, run, _absolute_paths(task.iter_docs(lines)), job, out, done,
                              total)  # fmt: skip
    finally:
        pool.close()
    click.echo(run.summary(), err=True)
    if not run.done and not done:
        raise KvrunError(f"--jsonl {jsonl} holds no documents")
    if failed:
        raise KvrunError(f"{failed} of {run.done} documents failed (their errors are above)")


def _absolute_paths(docs):
    """Relative "path" fields are taken from this directory, wherever the worker runs."""
    for doc in docs:
        if doc.path is not None:
            doc.path = str(Path(doc.path).absolute())
        yield doc


class _RayRunner:
    """_Runner's interface over a kvrun.cluster.Pool: `chunk` documents per call."""

    def __init__(self, pool, chunk: int):
        self.pool, self.chunk, self.done = pool, chunk, 0

    def __call__(self, docs, job, write, done, start, finish) -> int:
        failed = 0

        def on_result(doc, rec) -> None:
            nonlocal failed
            write(rec)
            failed += rec["error"] is not None
            self.done += 1
            finish(doc, rec)

        def items():
            for doc in task._todo(docs, done, finish):
                if doc.error:  # a bad input line: its record here, no worker needed
                    on_result(doc, task.process(None, doc, job))
                    continue
                key = task.doc_key(doc.id) if doc.id is not None else f"line {doc.line}"
                yield key, doc

        for doc, rec, error in self.pool.stream(items(), self.chunk):
            on_result(doc, rec if error is None else task.error_record(doc, job, error))
        return failed

    def describe(self) -> str:
        wall = time.monotonic() - self.pool.t0 if self.pool.t0 else 0.0
        rate = f"{60 * self.done / wall:.1f}/min" if wall > 0 and self.done else "-/min"
        return f"documents  {rate}  workers {self.pool.alive}/{self.pool.lay.workers}"

    def summary(self) -> str:
        return self.pool.summary(self.done, "documents")


def _read_docs(files, jsonl) -> list[task.Doc]:
    """Docs from FILE arguments (checked now, before the model loads) or from --jsonl IN."""
    if files:
        for f in files:
            if f != "-" and not Path(f).is_file():
                raise KvrunError(f"cannot read {f}: no such file")
        return [task.Doc(f, text=read_stdin() if f == "-" else None, path=f) for f in files]
    try:
        text = read_stdin() if jsonl == "-" else Path(jsonl).read_text("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KvrunError(
            f"cannot read --jsonl {jsonl}: {getattr(e, 'strerror', None) or e}"
        ) from None
    docs = task.docs_from_jsonl(text.split("\n"))  # JSON strings may hold U+2028
    if not docs:
        raise KvrunError(f"--jsonl {jsonl} holds no documents")
    return docs


def _stats(rec: dict):
    from ..generate import Stats

    return Stats(**{f.name: rec[f.name] for f in dataclasses.fields(Stats)})


class _Runner:
    """One session (documents in order, answers streamed) or several (kvrun.engine)."""

    def __init__(self, sessions, kv_mem):
        self.sessions, self.kv_mem, self.stats = sessions, kv_mem, None

    @property
    def parallel(self) -> bool:
        return len(self.sessions) > 1

    def __call__(self, docs, job, write, done, start, finish) -> int:
        if not self.parallel:
            return task.run_batch(self.sessions[0], docs, job, write, done, start, finish)
        failed, self.stats = task.run_parallel(
            self.sessions, docs, job, write, done, finish, self.kv_mem
        )
        return failed

    def summary(self) -> str:
        s = self.stats
        graph = f", {s.graph_steps} static, {s.graph_captures} graphs" if s.graph_steps else ""
        return (
            f"parallel {len(self.sessions)}: {s.sequences} sequences in {s.wall_s:.1f} s "
            f"({60 * s.sequences / s.wall_s:.1f}/min); decode {s.decode_tok_s:.1f} tok/s "
            f"aggregate ({s.decode_steps} batched steps{graph}, {s.decode_s:.1f} s), prefill "
            f"{s.prefill_tokens} tok in {s.prefill_s:.1f} s; up to {s.max_active} at once, "
            f"peak KV {s.peak_kv_bytes / 2**20:.1f} MiB"
            if s.wall_s
            else f"parallel {len(self.sessions)}: nothing to run"
        )


def _run_text(run, docs, job) -> int:
    """Answers streamed to stdout under a header (with --parallel: printed whole as each
    document finishes); stats (or the error) on stderr."""
    prefill = _PrefillBar(run.sessions[0].ubatch)

    def start(doc):
        click.echo(f"==> {doc.id} <==")
        return (lambda s: (sys.stdout.write(s), sys.stdout.flush())), prefill

    def finish(doc, rec):
        prefill.close()
        if run.parallel:
            click.echo(f"==> {doc.id} <==")
            sys.stdout.write(rec["answer"] or "")
        click.echo("\n")
        if rec["error"] and len(docs) == 1:
            raise KvrunError(f"{doc.id}: {rec['error']}")
        if rec["error"]:
            click.echo(f"error: {doc.id}: {rec['error']}", err=True)
            return
        if rec["truncated"]:
            cut = f"{doc.id}: truncated ({job.truncate}), {rec['dropped_tokens']} tokens dropped"
            click.echo(cut, err=True)
        click.echo(stats_line(_stats(rec)), err=True)

    return run(docs, job, lambda rec: None, set(), start, finish)


def _run_records(ctx, run, docs, job, out, done, total=None) -> int:
    """One JSON line per document to OUT (appended, flushed each) or stdout; a bar over docs
    (total: their number where docs is a stream)."""
    try:
        sink = open(out, "a", encoding="utf-8") if out else sys.stdout  # noqa: SIM115
    except OSError as e:
        raise KvrunError(f"cannot write --out {out}: {e.strerror}") from None
    written = 0

    def write(rec):
        nonlocal written
        line = json.dumps(rec, ensure_ascii=False)
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (from a JSON escape) stays escaped
            line = json.dumps(rec)
        sink.write(line + "\n")
        sink.flush()
        written += 1

    with progress_bar("documents") as bar:
        describe = getattr(run, "describe", None)
        docs_task = bar.add_task("documents", total=len(docs) if total is None else total)
        prefill_task = bar.add_task("prefill", total=None, visible=False)

        def start(doc):
            return None, lambda n, t: bar.update(prefill_task, completed=n, total=t, visible=True)

        def finish(doc, rec):
            bar.update(prefill_task, visible=False)
            bar.advance(docs_task)
            if describe:
                bar.update(docs_task, description=describe())
            if rec is not None:
                line = f"error: {rec['error']}" if rec["error"] else stats_line(_stats(rec))
                name = doc.id if doc.id is not None else f"line {doc.line}"
                click.echo(f"{name}: {line}", err=True)

        try:
            return run(docs, job, write, done, start, finish)
        except KeyboardInterrupt:
            where = f"; rerun with --out {out} --resume to go on" if out else ""
            click.echo(f"interrupted after {written} new documents{where}", err=True)
            ctx.exit(130)
        finally:
            if out:
                sink.close()


class _PrefillBar:
    """A prefill bar for text mode, shown for long prompts and gone before the answer streams."""

    def __init__(self, ubatch: int):
        self.ubatch, self.bar = ubatch, None

    def __call__(self, n: int, total: int) -> None:
        if self.bar is None:
            if total <= 2 * self.ubatch or not sys.stderr.isatty():
                return
            self.bar = progress_bar("prefill").__enter__()
            self.task = self.bar.add_task("prefill", total=total)
        self.bar.update(self.task, completed=n)
        if n >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None
