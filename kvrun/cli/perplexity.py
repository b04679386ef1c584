"""kvrun perplexity: NLL, perplexity, KL and top-1 agreement of a KV method against the full cache."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from ..tasks.perplexity import Report, check_context, check_file, evaluate, file_tokens
from .common import (
    check_kv,
    dump_json,
    human_bytes,
    kv_options,
    load_with_progress,
    model_options,
    parallel_option,
    progress_bar,
    read_text,
    set_debug,
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
@click.pass_context
def perplexity(ctx, file, context, eval_tokens, windows, as_json, **kw):
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
    set_debug(ctx, kw.pop("debug"))
    parallel = kw.pop("parallel")
    text = read_text(file)
    spec = check_kv(kw)
    if kw["ctx_size"]:
        check_context(context, eval_tokens, kw["ctx_size"], True)
    rt = load_with_progress(kw)
    tok = rt.tokenizer
    # checked after the load: reading a GGUF's metadata twice would cost as much as failing late
    check_context(
        context, eval_tokens, kw["ctx_size"] or rt.config.context_length, bool(kw["ctx_size"])
    )
    tokens = file_tokens(tok, text)
    check_file(len(tokens), context, eval_tokens, windows, "stdin" if file == "-" else file)

    from ..generate import Session

    def pair() -> tuple[Session, Session | None]:
        new = lambda kv: Session(rt.model, tok, kv, ubatch=kw["ubatch"], context=kw["ctx_size"])  # noqa: E731
        return new(rt.new_kv(spec)), None if spec.is_full else new(rt.new_kv())

    method, ref = pair()
    more = [pair() for _ in range(min(parallel, windows) - 1)]
    bos = tok.bos_id if tok.add_bos else None
    with progress_bar("perplexity") as bar:
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
        "kv_budget": kw["kv_budget"],
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
        table.add_row(
            str(w.index), str(w.start), f"{w.nll:.4f}", f"{w.ppl:.3f}", f"{w.ppl_full:.3f}",
            f"{w.kl:.5f}", f"{w.top1:.1%}", f"{kv_share:.1%}",
        )  # fmt: skip
    table.add_section()
    table.add_row(
        "mean", "", f"{s['nll']:.4f}", f"{s['ppl']:.3f}", f"{s['ppl_full']:.3f}",
        f"{s['kl']:.5f}", f"{s['top1']:.1%}", f"{s['kv_ratio']:.1%}",
    )  # fmt: skip
    sp = s["spread"]
    for stat in ("std", "min", "max"):
        table.add_row(
            stat, "", f"{sp['nll'][stat]:.4f}", f"{sp['ppl'][stat]:.3f}",
            f"{sp['ppl_full'][stat]:.3f}", f"{sp['kl'][stat]:.5f}", f"{sp['top1'][stat]:.1%}", "",
        )  # fmt: skip
    out = Console(highlight=False, soft_wrap=True)
    out.print(table, soft_wrap=False)
    out.print(
        f"ppl {s['ppl']:.4f} (full {s['ppl_full']:.4f}) | NLL {s['nll']:.4f} nats | "
        f"KL {s['kl']:.5f} nats | top-1 {s['top1']:.2%} | KV {human_bytes(s['kv_bytes'])} held / "
        f"{human_bytes(s['kv_bytes_full'])} full ({s['kv_ratio']:.1%})"
    )


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
