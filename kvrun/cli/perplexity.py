"""kvrun perplexity: NLL, perplexity, KL and top-1 agreement of a KV method against the full cache."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from ..progress import progress_bar
from ..report import human_bytes
from ..run.options import KVOptions, ModelOptions
from ..tasks.perplexity import Report, check_context, check_file, evaluate, file_tokens
from .common import (
    dump_json,
    kv_options,
    load_with_progress,
    model_options,
    parallel_option,
    read_text,
)


@click.command()
@model_options
@kv_options()
@parallel_option
@click.option("-f", "--file", required=True, help="Text file to score ('-' = stdin).")
@click.option(
    "--context",
    default=1024,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens prefilled through the KV method before scoring (N).",
)
@click.option(
    "--eval-tokens",
    default=256,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens scored one at a time through decode after the context (E).",
)
@click.option(
    "--windows",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Non-overlapping windows of N+E tokens spread evenly over the file (K).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def perplexity(
    file, context, eval_tokens, windows, as_json, parallel, model: ModelOptions, kv: KVOptions
):
    """Perplexity of a text file through a KV method, with KL and top-1 agreement to the full cache.

    Each window prefills N tokens through the method (prefill-time compression runs, in
    --ubatch chunks), then feeds the next E true tokens one at a time through decode, as
    generation sees them; each token is scored from the logits that predicted it. A full
    cache runs beside the method on the same windows for KL(P_full || P_method) and top-1
    agreement. With --kv full this is plain perplexity of the file. Unlike llama.cpp's
    perplexity, which scores the second half of each window, kvrun scores E tokens after N.
    Timings include the full-cache reference.

    \b
    kvrun perplexity -f wiki.test.raw
    kvrun perplexity -f wiki.test.raw --kv snapkv --kv-budget 0.2 --windows 8
    kvrun perplexity -f book.txt --kv streaming --kv-budget 256 --context 2048 --json
    kvrun perplexity -f wiki.test.raw --windows 8 --parallel 4   (4 windows per decode step)
    """
    text = read_text(file)
    spec = kv.spec()
    if model.ctx_size:
        check_context(context, eval_tokens, model.ctx_size, True)
    rt = load_with_progress(model)
    tok = rt.tokenizer
    # checked after the load: reading a GGUF's metadata twice would cost as much as failing late
    check_context(
        context, eval_tokens, model.ctx_size or rt.config.context_length, bool(model.ctx_size)
    )
    tokens = file_tokens(tok, text)
    check_file(len(tokens), context, eval_tokens, windows, "stdin" if file == "-" else file)

    def pair():
        """A session through the method, and one through the full cache in the model's dtype
        (None where the method is that cache: --kv full --kv-dtype of the model's)."""
        kv = rt.new_kv(spec)
        exact = spec.is_full and kv.kv_type is None
        return model.session(rt, kv), None if exact else model.session(rt, rt.new_kv())

    method, ref = pair()
    more = [pair() for _ in range(min(parallel, windows) - 1)]
    bos = tok.bos_id if tok.add_bos else None
    with progress_bar("perplexity", quiet=model.quiet) as bar:
        task = bar.add_task(f"window 1/{windows}", total=windows * (context + eval_tokens))

        def on_window(w):
            bar.update(task, description=f"window {min(w.index + 2, windows)}/{windows}")

        report = evaluate(
            method,
            ref,
            tokens,
            context,
            eval_tokens,
            windows,
            bos_id=bos,
            step=lambda n: bar.advance(task, n),
            on_window=on_window,
            more=more,
        )
    settings = {
        "file": file,
        "kv_budget": kv.budget,
        "context": context,
        "eval_tokens": eval_tokens,
        "windows": windows,
        "bos": bos is not None,
        "ctx_size": method.context,
        "ubatch": method.ubatch,
        "dtype": str(rt.model.dtype).removeprefix("torch."),
        "wtype": rt.weights.wtype,
        "device": str(rt.model.device),
    }
    kv = method.kv.describe()
    if as_json:
        out = {"model": str(rt.path), "model_name": rt.config.name, "kv": kv}
        out.update(settings=settings, file_tokens=report.file_tokens, **report.summary())
        out["per_window"] = [w.as_dict() for w in report.windows]
        out.update(
            prefill_s=round(report.prefill_s, 3),
            decode_s=round(report.decode_s, 3),
            peak_mem_bytes=report.peak_mem_bytes,
        )
        dump_json(out)
    else:
        print_report(report, kv, settings)
    click.echo(timing_line(report, windows, ref is not None), err=True)


def print_report(report: Report, kv: dict, settings: dict) -> None:
    """One row per window, then mean, std, min and max, and a summary line."""
    s = report.summary()
    budget = f" (budget {kv['budget']})" if "budget" in kv else ""
    table = Table(
        title=f"{kv['method']}{budget}: {settings['windows']} window(s) of "
        f"{report.context} + {report.eval_tokens} tokens ({report.file_tokens} in the file)"
    )
    for name in ("window", "start", "NLL", "PPL", "PPL full", "KL", "top-1", "KV held"):
        table.add_column(name, justify="right")
    for w in report.windows:
        kv_share = w.kv_bytes / w.kv_bytes_full if w.kv_bytes_full else 1.0
        scores = _scores(w.nll, w.ppl, w.ppl_full, w.kl, w.top1)
        table.add_row(str(w.index), str(w.start), *scores, f"{kv_share:.1%}")
    table.add_section()
    mean = _scores(*(s[k] for k in _SCORES))
    table.add_row("mean", "", *mean, f"{s['kv_ratio']:.1%}")
    for stat in ("std", "min", "max"):
        table.add_row(stat, "", *_scores(*(s["spread"][k][stat] for k in _SCORES)), "")
    out = Console(highlight=False, soft_wrap=True)
    out.print(table, soft_wrap=False)
    out.print(
        f"ppl {s['ppl']:.4f} (full {s['ppl_full']:.4f}) | NLL {s['nll']:.4f} nats | "
        f"KL {s['kl']:.5f} nats | top-1 {s['top1']:.2%} | KV {human_bytes(s['kv_bytes'])} held / "
        f"{human_bytes(s['kv_bytes_full'])} full ({s['kv_ratio']:.1%})"
    )


_SCORES = ("nll", "ppl", "ppl_full", "kl", "top1")


def _scores(nll: float, ppl: float, ppl_full: float, kl: float, top1: float) -> list[str]:
    """A row's NLL, PPL, PPL full, KL and top-1 cells."""
    return [f"{nll:.4f}", f"{ppl:.3f}", f"{ppl_full:.3f}", f"{kl:.5f}", f"{top1:.1%}"]


def timing_line(r: Report, windows: int, with_ref: bool) -> str:
    """The closing stats line on stderr: prefill and decode speed (method and reference)."""
    pre = windows * r.context
    dec = windows * (r.eval_tokens - 1)
    pre_s = pre / r.prefill_s if r.prefill_s > 0 else 0.0
    dec_s = dec / r.decode_s if r.decode_s > 0 else 0.0
    note = " (method and full-cache reference together)" if with_ref else ""
    return (
        f"prefill {pre} tok, {pre_s:.1f} tok/s | decode {dec} tok, {dec_s:.1f} tok/s{note} | "
        f"peak mem {human_bytes(r.peak_mem_bytes)}"
    )
