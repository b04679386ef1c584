"""kvrun needle: pass-key / needle-in-a-haystack accuracy over lengths x depths x KV methods."""

from __future__ import annotations

import click
from rich.columns import Columns
from rich.console import Console
from rich.table import Table

from ..errors import KvrunError
from ..kv import check
from ..progress import err_console, progress_bar
from ..run.options import KVGridOptions, ModelOptions, RayOptions
from ..tasks import needle as nd
from ..tasks.passkey import filler_units, read_haystack
from .common import (
    kv_options,
    load_with_progress,
    model_options,
    needs_text,
    parallel_option,
    question_after_option,
    ray_options,
)


def _haystack_units(mode, haystack, needle_text, question, answer) -> list[str]:
    """Validate the niah flags and read the haystack (before the model loads)."""
    if mode == "niah":
        missing = [
            flag
            for flag, v in [("--haystack", haystack), ("--needle", needle_text)]
            + [("--question", question), ("--answer", answer)]
            if not (v and v.strip())
        ]
        if missing:
            raise KvrunError(f"--mode niah needs {', '.join(missing)} (see kvrun needle --help)")
    else:
        given = [f for f, v in [("--needle", needle_text), ("--question", question)] if v]
        given += ["--answer"] if answer else []
        if given:
            raise KvrunError(f"{', '.join(given)} only apply to --mode niah")
    return read_haystack(haystack) if haystack else filler_units()


def _color(acc: float) -> str:
    r, g = round(210 * min(1.0, 2 * (1 - acc))), round(190 * min(1.0, 2 * acc))
    return f"bold black on rgb({r},{g},60)"


def heat_table(records, cfg, lengths, depths) -> Table:
    """Rows = depths, columns = lengths, cells = accuracy coloured red -> green."""
    cells = nd.heat(records, cfg)
    t = Table(title=cfg.label, title_justify="left")
    t.add_column("depth", justify="right")
    for n in lengths:
        t.add_column(nd.fmt_length(n), justify="center")
    for d in depths:
        row = [nd.fmt_depth(d)]
        for n in lengths:
            c, k = cells.get((d, n), (0, 0))
            row.append(f"[{_color(c / k)}] {c / k:4.0%} [/]" if k else "[dim]-[/]")
        t.add_row(*row)
    return t


def budget_text(cfg) -> str:
    """The budget a column ran at: the one given, or the method's default, said as such."""
    if cfg.budget is not None:
        return str(cfg.budget)
    if not cfg.spec.takes_budget:
        return "-"
    d = cfg.spec.select.default_budget
    return f"{d} (default)" if d is not None else "own (default)"


def summary_table(summary: list[dict], trials: int, configs=None) -> Table:
    per = f"{trials} trial{'s' if trials > 1 else ''} per cell"
    t = Table(title=f"summary  [dim]({per})[/]", title_justify="left")
    for col in ["method", "budget", "accuracy", "KV held/full", "prefill tok/s", "decode tok/s"]:
        left = col in ("method", "budget")
        t.add_column(
            col, justify="left" if left else "right", overflow="fold" if left else "ellipsis"
        )
    t.add_column("trials", justify="right")
    labels = [budget_text(c) for c in configs] if configs else [s["budget"] or "-" for s in summary]
    for s, budget in zip(summary, labels, strict=True):
        acc = f"[{_color(s['accuracy'])}] {s['accuracy']:.1%} [/]" if s["trials"] else "-"
        rates = f"{s['prefill_tok_s']:.1f}", f"{s['decode_tok_s']:.1f}"
        t.add_row(s["method"], budget, acc, f"{s['kv_ratio']:.1%}", *rates, str(s["trials"]))
    return t


@click.command()
@model_options
@kv_options(multiple=True)
@parallel_option
@click.option(
    "--mode",
    type=click.Choice(["passkey", "niah"]),
    default="passkey",
    show_default=True,
    help="passkey: find 'the pass key is N' in our filler. niah: your needle in your haystack.",
)
@click.option(
    "--lengths",
    default=None,
    metavar="N,N..",
    help="Prompt lengths in tokens (1k = 1000; 1k,2k,1500). Default: 1k,2k,4k,8k where they fit.",
)
@click.option(
    "--depths",
    default="0,25,50,75,100",
    show_default=True,
    metavar="P,P..",
    help="Needle depths, percent of the haystack before it.",
)
@click.option(
    "--trials", default=1, show_default=True, type=click.IntRange(min=1), help="Prompts per cell."
)
@click.option(
    "-s",
    "--seed",
    default=0,
    show_default=True,
    type=int,
    help="Seed of keys and haystack offsets.",
)
@click.option(
    "-n",
    "--n-predict",
    default=None,
    type=click.IntRange(min=1),
    help="Tokens to generate, greedy. Default: 12 (passkey), 32 (niah).",
)
@click.option(
    "--chat/--raw", "chat", default=False, help="Wrap prompts in the chat template (default: raw)."
)
@click.option(
    "--haystack",
    default=None,
    metavar="FILE",
    help="Text to hide the needle in, cut or repeated to each length (niah; in passkey mode it replaces our filler).",
)
@click.option(
    "--needle", "needle_text", default=None, metavar="TEXT", help="The sentence to hide (niah)."
)
@click.option(
    "--question", default=None, metavar="TEXT", help="The question asked after the haystack (niah)."
)
@click.option(
    "--answer",
    default=None,
    metavar="TEXT",
    help="Correct when this text is in the reply, any case (niah).",
)
@click.option(
    "--json",
    "json_path",
    default=None,
    metavar="FILE",
    help="Every trial and the settings, rewritten after each trial ('-' = stdout at the end).",
)
@click.option(
    "--plot", default=None, metavar="FILE.png", help="Heat maps as an image (needs matplotlib)."
)
@question_after_option
@ray_options
@click.pass_context
def needle(
    ctx,
    mode,
    lengths,
    depths,
    trials,
    seed,
    n_predict,
    chat,
    haystack,
    needle_text,
    question,
    answer,
    json_path,
    plot,
    question_after,
    parallel,
    model: ModelOptions,
    kv: KVGridOptions,
    ray: RayOptions,
):
    """Needle retrieval accuracy over prompt lengths x depths x KV methods.

    \b
    kvrun needle --lengths 1k,2k,4k --kv full --kv snapkv --kv-budget 0.1,0.25
    kvrun needle --kv full --kv snapkv+kivi2 --trials 3 --json needle.json --plot needle.png
    kvrun needle --kv full --kv snapkv --parallel 8   (trials decoded 8 at once, same results)
    kvrun needle --kv snapkv --kv-budget 0.25 --question-after   (haystack compressed first)
    kvrun needle --kv full --kv snapkv --ray   (trials spread over a Ray cluster, same results)
    kvrun needle --mode niah --haystack essay.txt --needle "The secret code is tulip." \\
        --question "What is the secret code?" --answer tulip --lengths 2k,4k
    """
    n_predict = n_predict or (12 if mode == "passkey" else 32)
    depth_list = nd.parse_depths(depths)
    if lengths is not None:
        nd.parse_lengths(lengths)
    units = _haystack_units(mode, haystack, needle_text, question, answer)
    configs = nd.kv_configs([(m, check(m).with_dtype(kv.dtype)) for m in kv.methods], kv.budgets)
    if plot:
        from ..tasks.needle_plot import require_matplotlib

        require_matplotlib()
    if lengths is not None and model.ctx_size:
        nd.pick_lengths(lengths, model.ctx_size, n_predict)
    grid = nd.GridOptions(
        mode,
        units,
        seed,
        lengths,
        n_predict,
        chat,
        parallel,
        needle=needle_text or "",
        question=question or "",
        answer=answer or "",
        question_after=question_after,
    )
    pool = None
    if ray.address:
        needs_text(model.name)
        pool, facts = _ray_pool(ray, model, kv, grid)
        context, length_list, about = facts["context"], facts["lengths"], facts["model"]
    else:
        rt = load_with_progress(model)
        context, length_list, task = grid.setup(rt, configs, model.ctx_size)
        about = nd.model_facts(rt)
    cells = nd.grid(length_list, depth_list, trials)
    niah = {"needle": needle_text, "question": question, "answer": answer}
    doc = {
        "task": "needle",
        "settings": nd.settings_from(
            about,
            mode=mode,
            seed=seed,
            lengths=length_list,
            depths=depth_list,
            trials=trials,
            n_predict=n_predict,
            decoding="greedy",
            chat=chat,
            question_after=question_after,
            kv=[{"method": c.method, "budget": c.budget} for c in configs],
            ctx_size=context,
            ubatch=model.ubatch,
            haystack=haystack,
            **(niah if mode == "niah" else {}),
        ),
        "complete": False,
        "summary": [],
        "trials": [],
    }
    records: list[dict] = doc["trials"]
    total = len(cells) * len(configs)

    def save(complete: bool) -> None:
        doc["complete"] = complete
        doc["summary"] = nd.summarize(records, configs)
        if json_path and json_path != "-":
            nd.write_json(json_path, doc)

    save(False)  # an unwritable --json fails now, before any trial
    interrupted = False
    try:
        with progress_bar("needle", quiet=model.quiet) as bar:
            task_id = bar.add_task("needle", total=total)

            def on_start(cell, cfg):
                where = f"{nd.fmt_length(cell.length)} @ {nd.fmt_depth(cell.depth)}"
                bar.update(task_id, description=f"{cfg.label}  {where}")

            if pool is None:
                source = nd.run_grid(
                    rt, task, configs, cells, n_predict, model.ubatch, context, on_start, parallel
                )
            else:
                source = _ray_grid(pool, cells, bar, task_id)
            for rec in source:
                records.append(rec)
                save(False)
                bar.advance(task_id)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if pool is not None:
            pool.close()
            err_console.print(pool.summary(len(records), "trials"), highlight=False)
    save(not interrupted)
    out = err_console if json_path == "-" else Console(highlight=False)
    out.print(Columns([heat_table(records, c, length_list, depth_list) for c in configs]))
    out.print(summary_table(doc["summary"], trials, configs))
    if json_path == "-":
        import json

        click.echo(json.dumps(doc, ensure_ascii=False))
    if plot and records:
        from ..tasks.needle_plot import plot_heatmaps

        plot_heatmaps(plot, records, configs, length_list, depth_list)
    if interrupted:
        where = f"; written to {json_path}" if json_path and json_path != "-" else ""
        click.echo(f"interrupted: {len(records)} of {total} trials done{where}", err=True)
        ctx.exit(130)
    if json_path and json_path != "-":
        err_console.print(f"[dim]trials written to {json_path}[/]")


def worker_setup(model: ModelOptions, kv: KVGridOptions, grid: nd.GridOptions):
    """On a Ray worker (kvrun.cluster): the model and the grid's task. Returns (handler,
    facts): handler(cells, node) -> each cell's records, every config, in grid order."""
    from ..run.cluster import load_model

    configs = nd.kv_configs([(m, check(m).with_dtype(kv.dtype)) for m in kv.methods], kv.budgets)
    rt = load_model(model)
    context, length_list, task = grid.setup(rt, configs, model.ctx_size)
    n, ubatch, parallel = grid.n_predict, model.ubatch, grid.parallel

    def handler(items: list, node: str) -> list[list[dict]]:  # items: (index, cell)
        return [
            list(nd.run_grid(rt, task, configs, [c], n, ubatch, context, None, parallel))
            for _, c in items
        ]

    facts = {"context": context, "lengths": length_list, "model": nd.model_facts(rt)}
    return handler, facts


def _ray_pool(ray: RayOptions, model: ModelOptions, kv: KVGridOptions, grid: nd.GridOptions):
    """Ray workers for the grid, started and one of them ready: (pool, its facts)."""
    from ..run import cluster

    echo = lambda m: err_console.print(m, highlight=False)  # noqa: E731
    return cluster.start(ray, worker_setup, model, {"kv": kv, "grid": grid}, echo)


def _ray_grid(pool, cells, bar, task_id):
    """The grid's records from the workers, one cell (every config) per call, yielded in grid
    order as soon as every earlier cell is in."""
    done: dict[int, list[dict]] = {}
    nxt = 0
    for (i, _), records, error in pool.stream(((i, (i, c)) for i, c in enumerate(cells)), 1):
        if error is not None:
            c = cells[i]
            raise KvrunError(f"needle trial {c.length} tokens at {c.depth:g}%: {error}")
        done[i] = records
        bar.update(task_id, description=f"needle  workers {pool.alive}/{pool.lay.workers}")
        while nxt in done:
            yield from done.pop(nxt)
            nxt += 1
