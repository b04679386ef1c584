"""kvrun kv list: every KV method, its axes, options and defaults."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from ..kv import REGISTRY


@click.group()
def kv():
    """KV cache methods."""


@kv.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_methods(as_json):
    """Every KV method with its axes (scorer, selector, allocator, store), options and defaults.

    \b
    Stack a selection method with a store: --kv snapkv+kivi2
    Set options after a colon:            --kv snapkv:window=64,kernel=5+kivi4:group=16
    Budget (selecting methods):           --kv-budget 0.25 (fraction) or 1024 (tokens per layer)
    """
    rows = []
    for p in REGISTRY.values():
        rows.append(
            {
                "name": p.name,
                "kind": p.kind,
                "summary": p.summary,
                "scorer": p.axes[0],
                "selector": p.axes[1],
                "allocator": p.axes[2],
                "store": p.axes[3],
                "runs_at": p.runs_at,
                "options": {
                    o.name: {
                        "default": o.default,
                        "help": o.help,
                        **({"choices": list(o.choices)} if o.choices else {}),
                    }
                    for o in p.options
                },
            }
        )
    if as_json:
        click.echo(json.dumps(rows))
        return
    console = Console()
    if not console.is_terminal or console.width < 120:  # a pipe, a file or a narrow terminal
        click.echo(plain(rows))
        return
    t = Table(title="KV methods (stack a selection and a store with +)", show_lines=True)
    for col in (
        "method",
        "what",
        "scorer / selector / allocator / store",
        "runs at",
        "options (default)",
    ):
        t.add_column(col)
    for r in rows:
        opts = "\n".join(f"{k}={v['default']}: {v['help']}" for k, v in r["options"].items()) or "-"
        axes = f"{r['scorer']} / {r['selector']} / {r['allocator']} / {r['store']}"
        t.add_row(r["name"], r["summary"], axes, r["runs_at"], opts)
    console.print(t)


def plain(rows: list[dict]) -> str:
    """The table as text blocks: nothing cut, whatever the width (pipes, files, grep)."""
    out = ["KV methods (stack a selection and a store with +):"]
    for r in rows:
        out += [
            "",
            f"{r['name']}  {r['summary']}",
            f"  scorer / selector / allocator / store: {r['scorer']} / {r['selector']} / "
            f"{r['allocator']} / {r['store']}",
            f"  runs at: {r['runs_at']}",
        ]
        out += [f"  {k}={v['default']}  {v['help']}" for k, v in r["options"].items()]
    return "\n".join(out)
