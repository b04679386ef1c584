"""kvrun bench: llama-bench style prefill / decode speed, KV bytes and memory per KV method."""

from __future__ import annotations

import click

from ..kv import check
from ..models.presets import is_preset, preset_config
from ..progress import progress_bar
from ..report import human_bytes
from ..run.options import KVGridOptions, ModelOptions
from ..tasks.bench_settings import (
    BenchSettings,
    cases,
    check_settings,
    parse_budgets,
    parse_counts,
)
from .common import (
    dump_json,
    graph_option,
    kv_options,
    load_with_progress,
    model_options,
    parallel_option,
)


def _ts(mean, std) -> str:
    return "-" if mean is None else f"{mean:.2f} ± {std:.2f}"


def markdown(result: dict) -> str:
    """The rows as a llama-bench table: one line for pp and one for tg per row."""
    lines = [
        "| model | kv | budget | test | t/s | KV held / full | peak mem | GB/s |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        budget = "-" if r["budget"] is None else str(r["budget"])
        kv = f"{human_bytes(r['kv_bytes'])} / {human_bytes(r['kv_bytes_full'])}"
        graph = " (graph)" if r.get("cuda_graph") else ""
        head = f"| {r['model']} | {r['kv']}{graph} | {budget} |"
        tail = f"{kv} | {human_bytes(r['peak_mem_bytes'])} |"
        if r["test_pp"]:
            t = _ts(r["prefill_tok_s"], r["prefill_tok_s_std"])
            lines.append(f"{head} {r['test_pp']} | {t} | {tail} - |")
        if r["test_tg"]:
            t = _ts(r["decode_tok_s"], r["decode_tok_s_std"])
            bw = _ts(r["bandwidth_gb_s"], r["bandwidth_gb_s_std"])
            lines.append(f"{head} {r['test_tg']} | {t} | {tail} {bw} |")
    s, m = result["settings"], result["machine"]
    lines += [
        "",
        f"{m['device_name']} ({s['device']}), {s['dtype']}, {m['threads']} threads, torch "
        f"{m['torch']}; seed {s['seed']}, {s['reps']} reps after 1 warm-up, ubatch {s['ubatch']}; "
        f"peak mem: {result['peak_mem_kind']}",
    ]
    if result["synthetic"]:
        lines.append("synthetic: random weights; the numbers measure speed and memory only")
    return "\n".join(lines)


@click.command()
@model_options
@graph_option
@kv_options(multiple=True)
@parallel_option
@click.option(
    "-p", "--n-prompt", default=512, show_default=True, help="Prompt tokens to time (0 = skip)."
)
@click.option("-n", "--n-gen", default=128, show_default=True, help="Tokens to decode (0 = skip).")
@click.option(
    "-d",
    "--n-depth",
    "depths",
    default="0",
    show_default=True,
    metavar="D[,D...]",
    help="Tokens already in the cache before the timed prompt (comma list).",
)
@click.option("-r", "--reps", default=5, show_default=True, help="Timed reps per row.")
@click.option("-s", "--seed", default=0, show_default=True, help="Seed of the random token ids.")
@click.option(
    "--ignore-eos",
    is_flag=True,
    help="Greedy picks skip the end-of-generation tokens (llama.cpp's flag; -n steps are "
    "decoded either way).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (settings + rows).")
def bench(
    n_prompt,
    n_gen,
    depths,
    reps,
    seed,
    ignore_eos,
    as_json,
    parallel,
    model: ModelOptions,
    kv: KVGridOptions,
):
    """Measure prefill and decode speed, KV bytes and memory for KV methods and depths.

    For every method x budget x depth: fill a fresh cache with D random tokens (one
    prefill, not timed; selecting methods compress it as they would a first chat turn),
    time a prompt of P tokens (pp, prefill tok/s), then N greedy decode steps (tg, decode
    tok/s, at depth D+P); mean ± std over --reps after one warm-up rep. D+P+N must fit
    the context. Tokens are random ids from --seed, never text. --kv repeats; --kv-budget
    is a comma list that multiplies the rows of selecting methods only.

    \b
    GB/s is achieved bandwidth ~ (weight bytes + KV bytes held during decode) x decode
    tok/s: an approximation that ignores activations. Peak mem: CUDA max allocated (reset
    per row) or the process's peak RSS on CPU.

    \b
    Shape presets with random weights (output labelled synthetic):
      llama3-8b-synthetic, mistral-7b-synthetic, llama2-7b-synthetic, tiny-synthetic

    \b
    kvrun bench -p 512 -n 128 -d 0,4096 --reps 5 --kv full --kv kivi2 --kv snapkv
    kvrun bench -m llama3-8b-synthetic --dtype bfloat16 --kv full --kv snapkv --kv-budget 0.1,0.25
    kvrun bench -m tiny-synthetic -p 64 -n 16 -r 2 --json
    kvrun bench -p 0 -n 128 --kv full --cuda-graph        # decode steps as one CUDA graph
    kvrun bench -p 0 -n 64 -d 1000 --kv full --parallel 8 # tg: 8 sequences' aggregate tok/s
    """
    settings = BenchSettings(
        n_prompt=n_prompt,
        n_gen=n_gen,
        depths=parse_counts(depths, "-d/--n-depth"),
        reps=reps,
        methods=tuple(kv.methods),
        budgets=parse_budgets(kv.budgets),
        seed=seed,
        ubatch=model.ubatch,
        ctx_size=model.ctx_size,
        cuda_graph=model.cuda_graph,
        specs=tuple(check(m).with_dtype(kv.dtype) for m in kv.methods),
        parallel=parallel,
        ignore_eos=ignore_eos,
    )
    _check_before_loading(settings, model)
    # the common loader checks a single --kv; ours were checked above
    from ..tasks.bench import run_bench

    rt = load_with_progress(model, text=False)
    from ..models import model_cache

    model_cache.settle(rt.model)  # time the weights as a long session holds them
    with progress_bar("bench", quiet=model.quiet) as bar:
        total = len(cases(settings)) * (settings.reps + 1)
        task = bar.add_task("bench", total=total)
        result = run_bench(
            rt, settings, lambda label: bar.update(task, advance=1, description=label)
        )
    if as_json:
        dump_json(result)
    else:
        click.echo(markdown(result))


def _check_before_loading(s: BenchSettings, model: ModelOptions) -> None:
    """Every input error in one line before the model loads (presets know their context)."""
    context = model.ctx_size or None
    if context is None and is_preset(model.name):
        context = preset_config(model.name).context_length
    check_settings(s, context)
