"""kvrun's command line: a thin shell that dispatches to one module per job."""

from __future__ import annotations

import sys

import click

from ..errors import KvrunError

# name -> (module in kvrun.cli, attribute, the line `kvrun --help` shows). A command's module
# (and torch, for commands that run a model) is imported only when that command runs, so
# `kvrun --help`, `kvrun kv list`, `kvrun models` and option errors answer at once.
COMMANDS = {
    "bench": ("bench", "bench", "Measure prefill and decode speed, KV bytes and memory per KV method."),
    "calibrate": ("calibrate", "calibrate", "Fit a KV method's per-model calibration (kvzap, duo) into the model cache."),
    "chat": ("chat", "chat", "Chat with a model, streaming replies; history stays in the KV cache."),
    "convert": ("convert", "convert", "Convert GGUF <-> HF safetensors directory."),
    "generate": ("generate", "generate", "Generate text from a prompt."),
    "info": ("info", "info", "Architecture, sizes, tensor types, weights in memory, KV bytes."),
    "kv": ("kv", "kv", "KV cache methods."),
    "longdoc": ("longdoc", "longdoc", "Answer or summarize long documents, one by one or in batches."),
    "models": ("info", "models", "List the models in the models folder and the HF cache; the short names."),
    "needle": ("needle", "needle", "Needle retrieval accuracy over lengths x depths x KV methods."),
    "perplexity": ("perplexity", "perplexity", "Perplexity, KL and top-1 agreement of a KV method."),
    "prefill": ("prefill", "prefill", "Prefill and compress a document once; keep its KV cache in a .kvc file."),
    "profile": ("profile", "profile", "Plan XKV's per-layer KV budgets on sample texts and save them."),
    "pull": ("info", "pull", "Fetch a model: a short name, or REPO[:QUANT] from Hugging Face."),
    "ruler": ("ruler", "ruler", "RULER's synthetic long-context tasks per KV method, scored as RULER and kvpress do."),
    "serve": ("serve", "serve", "Serve a model over OpenAI's HTTP API, with a KV method per request."),
}  # fmt: skip


class KvrunGroup(click.Group):
    """Turns errors into one line on stderr and a non-zero exit (--debug shows the traceback);
    commands listed in COMMANDS load on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | (set(COMMANDS) if self is cli else set()))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        cmd = super().get_command(ctx, name)
        if cmd is None and self is cli and name in COMMANDS:
            import importlib

            module, attr, _ = COMMANDS[name]
            cmd = getattr(importlib.import_module(f"kvrun.cli.{module}"), attr)
            self.add_command(cmd, name)
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if self is not cli:
            return super().format_commands(ctx, formatter)
        rows = [(name, COMMANDS[name][2]) for name in sorted(COMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)
        return None

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KvrunError as e:
            if _debug(ctx):
                raise
            click.echo(f"error: {e}", err=True)
            ctx.exit(e.exit_code)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except MemoryError:
            click.echo("error: out of memory; try a smaller -c/--ctx-size or --ubatch", err=True)
            ctx.exit(1)
        except Exception as e:  # noqa: BLE001 - last resort: still one line, not a traceback
            if _debug(ctx):
                raise
            click.echo(
                f"error: {type(e).__name__}: {e} (this is a bug in kvrun; --debug shows the traceback)",
                err=True,
            )
            ctx.exit(1)


def _debug(ctx: click.Context) -> bool:
    return bool((ctx.obj or {}).get("debug")) or "--debug" in sys.argv


@click.group(cls=KvrunGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvrun")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """kvrun: run Llama-family models offline with compressed KV caches.

    \b
    Quick start:
      kvrun pull smollm2
      kvrun generate -p "Write a haiku about the sea." -n 64
      kvrun chat
      kvrun chat -m llama3.2-1b
      kvrun generate -m hf:bartowski/Llama-3.2-1B-Instruct-GGUF:Q8_0 -p "Hello"
    """
    ctx.ensure_object(dict)["debug"] = debug


def main() -> None:
    """Console entry point."""
    cli(prog_name="kvrun")
