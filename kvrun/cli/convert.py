"""kvrun convert: GGUF -> HF safetensors directory, and HF directory -> GGUF."""

from __future__ import annotations

from pathlib import Path

import click

from ..hub.model_store import resolve
from ..progress import err_console, progress_bar
from .common import quiet_option


@click.command()
@click.argument("src")
@click.argument("dst", type=click.Path(path_type=Path))
@click.option(
    "--outtype",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "f32", "f16", "bf16", "q8_0"]),
    help="Tensor type written (auto: f32 safetensors, f16 GGUF).",
)
@click.option("--force", is_flag=True, help="Overwrite DST if it exists.")
@quiet_option
def convert(src, dst, outtype, force, quiet):
    """Convert a GGUF model to an HF safetensors directory, or an HF directory to GGUF.

    \b
    kvrun convert smollm2 ./smollm2-hf
    kvrun convert ./smollm2-hf smollm2-f16.gguf --outtype f16
    """
    path = resolve(src)
    from ..convert import convert as run_convert  # torch, once SRC is known to exist

    with progress_bar("convert", quiet=quiet) as bar:
        task = bar.add_task("converting", total=None)
        out = run_convert(
            path,
            dst,
            outtype=outtype,
            overwrite=force,
            progress=lambda d, t: bar.update(task, completed=d, total=t),
        )
    err_console.print(f"wrote {out}", style="dim")
