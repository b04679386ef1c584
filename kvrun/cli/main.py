"""kvrun's command line: a thin shell that dispatches to one module per job."""

from __future__ import annotations

import sys

import click

from ..errors import KvrunError


class KvrunGroup(click.Group):
    """Turns errors into one line on stderr and a non-zero exit (--debug shows the traceback)."""

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
    """
    ctx.ensure_object(dict)["debug"] = debug


def _register() -> None:
    from . import bench, chat, convert, generate, info, kv, longdoc, needle, perplexity, profile

    cli.add_command(generate.generate)
    cli.add_command(chat.chat)
    cli.add_command(info.info)
    cli.add_command(info.models)
    cli.add_command(info.pull)
    cli.add_command(convert.convert)
    cli.add_command(kv.kv)
    cli.add_command(bench.bench)
    cli.add_command(perplexity.perplexity)
    cli.add_command(longdoc.longdoc)
    cli.add_command(needle.needle)
    cli.add_command(profile.profile)


_register()


def main() -> None:
    """Console entry point."""
    cli(prog_name="kvrun")
