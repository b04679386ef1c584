"""kvrun ruler: RULER's synthetic long-context tasks per KV method and budget, scored as RULER and
kvpress score them."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from ..errors import KvrunError
from ..progress import err_console, progress_bar
from ..run.options import KVGridOptions, ModelOptions, RayOptions
from ..tasks import ruler as ru
from ..tasks import ruler_run as rr
from ..tasks.needle import write_json
from ..tasks.ruler_tasks import LEFT_OUT, TASKS
from .common import (
    chat_option,
    kv_options,
    load_with_progress,
    model_options,
    needs_text,
    parallel_option,
    question_after_option,
    ray_options,
)
from .needle import budget_text

SHORT = {
    "niah_single_1": "s1", "niah_single_2": "s2", "niah_single_3": "s3",
    "niah_multikey_1": "mk1", "niah_multikey_2": "mk2", "niah_multikey_3": "mk3",
    "niah_multivalue": "mv", "niah_multiquery": "mq", "vt": "vt", "cwe": "cwe", "fwe": "fwe",
}  # fmt: skip


def score_table(rows: list[dict], configs, tasks: list[str], title: str) -> Table:
    """Rows = method x budget (with kvpress's compression ratio), columns = tasks + average."""
    t = Table(title=title, title_justify="left")
    for col in ["method", "budget", "kvpress ratio"]:
        t.add_column(col, justify="left" if col != "kvpress ratio" else "right")
    for task in tasks:
        t.add_column(SHORT.get(task, task), justify="right")
    for col in ["avg", "KV held", "n"]:
        t.add_column(col, justify="right")
    for row, cfg in zip(rows, configs, strict=True):
        ratio = "-" if row["kvpress_ratio"] is None else f"{row['kvpress_ratio']:g}"
        cells = [f"{row['tasks'][k]:.1f}" if k in row["tasks"] else "-" for k in tasks]
        avg = "-" if row["average"] is None else f"[bold]{row['average']:.1f}[/]"
        held = "-" if row["kv_ratio"] is None else f"{row['kv_ratio']:.0%}"
        t.add_row(cfg.method, budget_text(cfg), ratio, *cells, avg, held, str(row["samples"]))
    return t


@click.command()
@model_options
@kv_options(multiple=True)
@parallel_option
@click.option(
    "--tasks",
    default=None,
    metavar="T,T..",
    help=f"RULER tasks (default: all of them that run offline: {', '.join(TASKS)}). "
    f"{' and '.join(LEFT_OUT)} need SQuAD / HotpotQA, which kvrun does not download, and are "
    "left out.",
)
@click.option(
    "--length",
    default="4k",
    show_default=True,
    metavar="N",
    help="Tokens per sample: the prompt (chat template included) plus the task's answer "
    "tokens, as RULER's max_seq_length (k = 1024: 4k = 4096).",
)
@click.option(
    "--samples", default=10, show_default=True, type=click.IntRange(min=1), help="Samples per task."
)
@click.option("-s", "--seed", default=42, show_default=True, type=int, help="Seed of every sample.")
@chat_option
@click.option(
    "-o",
    "--out",
    default=None,
    metavar="FILE.jsonl",
    help="One JSON line per answer, appended as each is done.",
)
@click.option("--resume", is_flag=True, help="Go on with --out: skip the answers it holds.")
@click.option(
    "--json",
    "json_path",
    default=None,
    metavar="FILE",
    help="The settings and the score table as JSON ('-' = stdout).",
)
@click.option(
    "--plot", default=None, metavar="FILE.png", help="The scores as an image (matplotlib)."
)
@question_after_option
@ray_options
@click.pass_context
def ruler(ctx, tasks, length, samples, seed, chat, out, resume, json_path, plot, question_after,
          parallel, model: ModelOptions, kv: KVGridOptions, ray: RayOptions):  # fmt: skip
    """RULER's synthetic long-context tasks per KV method and budget (Hsieh et al. 2024).

    Eleven of RULER's thirteen tasks, made from --seed at --length tokens with the model's own
    tokenizer and chat template: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue,
    niah_multiquery, vt, cwe, fwe. qa_1 and qa_2 (SQuAD, HotpotQA) are left out: kvrun
    downloads no data sets. The "essay" haystack is the GNU GPL v3 text shipped with kvrun
    (RULER uses Paul Graham's essays); keys and words come from kvrun's own word lists. The
    samples depend on the tokenizer, --length and --seed only, never on --kv.

    Scored as RULER and kvpress score: a sample scores the fraction of its answers found in
    the reply (any case), a task the mean over its samples, 0..100; avg is the mean of the
    tasks. Replies are greedy, up to RULER's tokens for the task (niah 128, vt 30, cwe 120,
    fwe 50). kvpress's compression ratio (the fraction removed) is 1 - --kv-budget (the
    fraction kept). kvpress compresses the context alone: --question-after does the same.

    \b
    kvrun ruler --length 4k --kv full --kv snapkv --kv-budget 0.25,0.5 --question-after
    kvrun ruler --tasks niah_single_1,vt --length 2k --samples 20 --kv full
    kvrun ruler --kv snapkv --kv-budget 0.25 -o ruler.jsonl   (then --resume to go on)
    kvrun ruler --kv full --kv pyramidkv --parallel 4 --json scores.json --plot scores.png
    kvrun ruler --kv full --kv snapkv --ray   (samples spread over a Ray cluster)
    """
    task_list = ru.parse_tasks(tasks)
    n = ru.parse_length(length)
    configs = rr.configs_of(kv)
    if resume and not out:
        raise KvrunError("--resume needs --out FILE.jsonl (the file to go on with)")
    if out and not Path(out).absolute().parent.is_dir():
        raise KvrunError(f"cannot write --out {out}: its folder does not exist")
    if plot:
        from ..tasks.needle_plot import require_matplotlib

        require_matplotlib()
    opts = rr.RulerOptions(task_list, n, samples, seed, chat, question_after, parallel)
    if model.ctx_size:
        opts.check_context(model.ctx_size)
    pool = None
    if ray.address:
        needs_text(model.name)
        pool, facts = rr.start_ray(ray, model, kv, opts, lambda m: err_console.print(m))
        settings = facts["settings"]
    else:
        rt = load_with_progress(model)
        opts.check_context(model.ctx_size or rt.config.context_length)
        settings = rr.settings_of(rt, opts)
    try:
        records = rr.read_done(Path(out), resume, settings) if out else []
        have = {rr.key(r) for r in records}
        todo = [(t, i, c) for t in task_list for i in range(samples)
                for c, cfg in enumerate(configs) if (t, i, cfg.method, cfg.budget) not in have]  # fmt: skip
        if out and records:
            err_console.print(
                f"[dim]resuming {out}: {len(records)} answers done, {len(todo)} to go[/]"
            )
        interrupted = _run(records, todo, out, pool, rt if pool is None else None, opts, configs,
                           settings, model)  # fmt: skip
    finally:
        if pool is not None:
            pool.close()
    rows = rr.summary(records, configs, task_list)
    doc = {"task": "ruler", "settings": {**settings, "tasks": task_list, "samples": samples},
           "complete": not interrupted, "scores": rows}  # fmt: skip
    title = f"RULER {n} tokens, {samples} sample{'s' * (samples != 1)} per task"
    title += " (question after)" * question_after
    console = err_console if json_path == "-" else Console(highlight=False)
    console.print(score_table(rows, configs, task_list, title))
    if json_path == "-":
        click.echo(json.dumps(doc, ensure_ascii=False))
    elif json_path:
        write_json(json_path, doc)
    if plot and records:
        from ..tasks.ruler_plot import plot_scores

        plot_scores(plot, rows, configs, task_list, title)
    if interrupted:
        where = f"; rerun with --out {out} --resume to go on" if out else ""
        click.echo(f"interrupted: {len(records)} answers done{where}", err=True)
        ctx.exit(130)


def _run(records, todo, out, pool, rt, opts, configs, settings, model) -> bool:
    """Append each new record to `records` (and to --out); True when Ctrl-C stopped it."""
    sink = None
    if out:
        try:
            sink = open(out, "a", encoding="utf-8")  # noqa: SIM115
        except OSError as e:
            raise KvrunError(f"cannot write --out {out}: {e.strerror}") from None
    try:
        with progress_bar("ruler", quiet=model.quiet) as bar:
            task_id = bar.add_task("ruler", total=len(todo))

            def on_start(task, index, cfg):
                bar.update(task_id, description=f"{cfg.label}  {task} #{index}")

            if pool is not None:
                source = rr.run_ray(pool, todo)
            else:
                source = rr.run_local(rt, opts, configs, todo, settings, model, on_start)
            for rec in source:
                records.append(rec)
                if sink:
                    sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    sink.flush()
                bar.advance(task_id)
    except KeyboardInterrupt:
        return True
    finally:
        if sink:
            sink.close()
    return False
