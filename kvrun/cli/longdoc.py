"""kvrun longdoc: answer or summarize long documents, one by one or as a resumable JSONL batch."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from ..errors import KvrunError
from ..progress import PrefillBar, progress_bar
from ..report import stats_line
from ..run.options import KVOptions, ModelOptions, ParallelOptions, RayOptions, SamplingOptions
from ..tasks import longdoc as task
from ..tasks.longdoc_run import LongdocOptions, absolute_paths, start_local, start_ray
from .common import (
    chat_option,
    debugging,
    graph_option,
    kv_options,
    load_with_progress,
    model_options,
    needs_text,
    new_session,
    parallel_options,
    question_after_option,
    ray_options,
    read_stdin,
    sampling_options,
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
    help='Batch input, one JSON object a line: {"id", "text" or "path", "question"? or '
    "\"questions\"?}; '-' = stdin; relative paths are taken from the current directory. "
    '"questions": [...] compresses the document once and answers each question on a fork of '
    "that cache (--question-after for that line, whatever the flag), one line per question.",
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
@chat_option
@click.option(
    "--template",
    default=None,
    metavar="FILE",
    help="Own prompt template with a {document} slot and an optional {question} slot.",
)
@question_after_option
@click.option(
    "--kv-cache-dir",
    default=None,
    metavar="DIR",
    help='Keep the compressed documents of "questions" lines as .kvc files in DIR (made if '
    "missing); a later run with the same model, --kv, template and document loads them "
    "instead of prefilling.",
)
@ray_options
@click.pass_context
def longdoc(
    ctx,
    files,
    question,
    summarize,
    jsonl,
    out,
    resume,
    truncate,
    n_predict,
    chat,
    template,
    question_after,
    kv_cache_dir,
    model: ModelOptions,
    kv: KVOptions,
    parallel: ParallelOptions,
    sampling: SamplingOptions,
    ray: RayOptions,
):
    """Answer a question about long documents, or summarize them, on a fresh KV cache each.

    Documents longer than the context (minus the prompt and -n) are cut on tokens by
    --truncate; the prompt template and question are never cut. With FILEs, each answer is
    printed under a header with its stats line on stderr. With --jsonl (or --out), each
    document gives one JSON line (answer, tokens, stats, truncated/dropped_tokens, kv, error),
    written as soon as it is done; every line repeats the run's settings (model, seed,
    n_predict, truncate, sampling, ...) under "settings" (with FILEs they go once to stderr).
    A failing document gets a line with its error and the batch goes on; the exit status is 1
    when any failed. --resume skips ids already answered in OUT. Greedy (--temp 0) by default.

    A --jsonl line may carry "questions": [...] instead of "question": its document is
    prefilled and compressed once with --question-after semantics (implied for that line),
    and every question (the template's part after the document) is a turn of its own, on a
    fork of the compressed cache, that selects nothing. Each gives a line with
    "question_index" and "question" (a bad entry gets its own error line); prompt_tokens and
    prefill_s are the question's turn, document_tokens and document_prefill_s the shared
    prefill. The document is cut (--truncate) to leave room for the longest question.
    --resume skips the (id, index) pairs already answered. -q and --summarize apply only to
    lines with neither field; "question" and "questions" on one line is an error; a
    --template must put {question} after {document}. --kv-cache-dir DIR keeps each such
    compressed document as a .kvc file (kvrun prefill's format) and later runs load it
    (document_kvc: "saved" or "loaded"; a damaged file fails its lines in one line).
    --parallel N answers N documents at once (lines are written as each finishes, so not in
    input order; with FILEs each answer is printed whole when it is done). --ray runs a --jsonl
    batch on Ray workers, each with its own model and --parallel sessions; a worker that dies
    has its documents sent again (--retries), and every line gets the worker's "node".

    \b
    kvrun longdoc report.txt -q "Who signed the contract?"
    kvrun longdoc --summarize --kv snapkv --kv-budget 0.25 a.txt b.txt
    kvrun longdoc --jsonl docs.jsonl --out answers.jsonl --summarize --truncate left
    kvrun longdoc --jsonl docs.jsonl --out answers.jsonl --resume
    kvrun longdoc --jsonl qs.jsonl -o a.jsonl --kv snapkv --kv-budget 0.25 --parallel 4
      (qs.jsonl: {"id": 1, "path": "report.txt", "questions": ["Who?", "When?"]})
    kvrun longdoc --jsonl docs.jsonl --out answers.jsonl -q "..." --parallel 8 --kv-mem 2G
    kvrun longdoc report.txt -q "Who signed?" --kv snapkv --question-after
    kvrun longdoc --jsonl docs.jsonl --out answers.jsonl -q "..." --ray   (on a Ray cluster)
    cat docs.jsonl | kvrun longdoc --jsonl - -q "What is the main claim?" > answers.jsonl
    """
    out = None if out == "-" else out
    _check_args(files, jsonl, question, summarize, out, resume, kv_cache_dir, ray, model)
    docs = None if ray.address else _read_docs(files, jsonl)
    done, note = task.prepare_results(Path(out), resume) if out else (set(), None)
    config, seed = sampling.resolve()
    opts = LongdocOptions(
        templates={t: task.load_template(t, template) for t in ("question", "summarize")},
        question=question, summarize=summarize, chat=chat, template=template,
        n_predict=n_predict, truncate=truncate, sampling=config, seed=seed,
        question_after=question_after,
    )  # fmt: skip
    spec = kv.spec()
    if ray.address:
        if note:
            click.echo(note, err=True)
        return _longdoc_ray(ctx, jsonl, out, done, opts, model, kv, parallel, ray)
    rt = load_with_progress(model)
    make_session = lambda kv, first: new_session(rt, kv, model, note=first)  # noqa: E731
    run, job, settings = start_local(
        rt, spec, parallel, opts, debugging(ctx), kv_cache_dir, make_session
    )
    if note:
        click.echo(note, err=True)
    total = sum(len(d.items()) for d in docs)
    if jsonl or out:
        failed = _run_records(ctx, run, docs, job, out, done, model.quiet, total)
    else:
        click.echo("settings: " + json.dumps({"kv": job.kv, **settings}), err=True)
        failed = _run_text(run, docs, job)
    summary = run.summary()
    if summary is not None:
        click.echo(summary, err=True)
    if failed:
        what = "documents" if total == len(docs) else "answers"
        raise KvrunError(f"{failed} of {total} {what} failed (their errors are above)")
    return None


def _check_args(files, jsonl, question, summarize, out, resume, kv_cache_dir, ray, model):
    """The options that go together, checked before anything is read or loaded."""
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
    if kv_cache_dir and ray.address:
        raise KvrunError("--kv-cache-dir runs locally, not with --ray")
    if kv_cache_dir:
        try:
            Path(kv_cache_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KvrunError(f"cannot make --kv-cache-dir {kv_cache_dir}: {e.strerror}") from None
    if ray.address and not jsonl:
        raise KvrunError("--ray runs a batch: give --jsonl IN (and --out OUT)")
    if ray.address:
        from ..run.cluster import import_ray

        import_ray()  # missing Ray is said before anything else is read
        needs_text(model.name)


def _longdoc_ray(ctx, jsonl, out, done, opts, model, kv, parallel, ray) -> None:
    """The --jsonl batch on Ray workers: documents streamed to them, lines written as they
    come back, in the local run's format (plus "node")."""
    if jsonl == "-":
        lines, total = (line.rstrip("\n") for line in sys.stdin), None
    else:  # an unreadable input fails before any worker starts
        try:
            total = task.count_docs(jsonl)
        except OSError as e:
            raise KvrunError(f"cannot read --jsonl {jsonl}: {e.strerror}") from None
        lines = task.jsonl_lines(jsonl)
    echo = lambda m: click.echo(m, err=True)  # noqa: E731
    run, job = start_ray(ray, model, kv, parallel, opts, debugging(ctx), echo)
    try:
        docs = absolute_paths(task.iter_docs(lines))
        failed = _run_records(ctx, run, docs, job, out, done, model.quiet, total)
    finally:
        run.close()
    click.echo(run.summary(), err=True)
    if not run.done and not done:
        raise KvrunError(f"--jsonl {jsonl} holds no documents")
    if failed:
        raise KvrunError(f"{failed} of {run.done} documents failed (their errors are above)")


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
    from ..run.session import Stats

    return Stats(**{f.name: rec[f.name] for f in dataclasses.fields(Stats)})


def _run_text(run, docs, job) -> int:
    """Answers streamed to stdout under a header (with --parallel: printed whole as each
    document finishes); stats (or the error) on stderr."""
    prefill = PrefillBar(run.sessions[0].ubatch)

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


def _run_records(ctx, run, docs, job, out, done, quiet: bool, total: int | None) -> int:
    """One JSON line per document to OUT (appended, flushed each) or stdout; a bar over the
    `total` documents (None: not known, a stream on stdin; no lines off a terminal when quiet)."""
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

    with progress_bar("documents", quiet=quiet) as bar:
        docs_task = bar.add_task("documents", total=total)
        prefill_task = bar.add_task("prefill", total=None, visible=False)

        def start(doc):
            return None, lambda n, t: bar.update(prefill_task, completed=n, total=t, visible=True)

        def finish(doc, rec):
            bar.update(prefill_task, visible=False)
            bar.advance(docs_task)
            label = run.describe()
            if label:
                bar.update(docs_task, description=label)
            if rec is not None:
                line = f"error: {rec['error']}" if rec["error"] else stats_line(_stats(rec))
                name = doc.id if doc.id is not None else f"line {doc.line}"
                if rec["question_index"] is not None:
                    name = f"{name} [{rec['question_index']}]"
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
