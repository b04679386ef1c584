"""kvrun chat: a multi-turn REPL whose history stays in the KV cache."""

from __future__ import annotations

import signal
import sys

import click

from ..errors import ContextOverflow, KvrunError
from ..progress import err_console
from ..report import stats_line
from ..run.options import KVOptions, ModelOptions, SamplingOptions
from .common import (
    graph_option,
    kv_cache_option,
    kv_options,
    load_with_progress,
    model_options,
    new_session,
    sampling_options,
    session_from_kvc,
)

HELP = "commands: /reset (new conversation), /stats (last reply's numbers), /exit; Ctrl-C stops a reply"


class _StopFlag:
    """SIGINT during a reply sets a flag checked between tokens, so the cache stays consistent."""

    def __init__(self):
        self.hit = False

    def __enter__(self):
        self.hit = False
        self._old = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, *_):
        self.hit = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._old)
        return False

    def __call__(self) -> bool:
        return self.hit


@click.command()
@model_options
@graph_option
@kv_options()
@sampling_options
@click.option("--system", default=None, help="System message for the conversation.")
@click.option(
    "-n",
    "--n-predict",
    default=-1,
    show_default=True,
    type=click.IntRange(min=-1),
    help="Max tokens per reply (-1 = until the model ends its turn).",
)
@kv_cache_option(
    "the first message completes the user's turn that holds it (made with --chat); --system too"
)
def chat(
    system, n_predict, kv_cache, model: ModelOptions, kv: KVOptions, sampling: SamplingOptions
):
    """Chat with a model, streaming replies; history is kept in the KV cache.

    \b
    kvrun chat
    kvrun chat -m llama3-8b --system "Answer briefly." --temp 0.7
    kvrun chat --kv-cache report.kvc
    """
    config, seed = sampling.resolve()
    spec = kv.spec()
    rt = load_with_progress(model)
    from ..run.chat import Conversation

    if kv_cache is not None:
        from ..run import kvc

        session, header = session_from_kvc(rt, kv_cache, kv, model)
        turns = header["turns"]
        if not turns.get("chat"):
            raise KvrunError(f"{kv_cache} was prefilled --raw; chat needs one made with --chat")
        conv = Conversation(session, turns.get("system"))
        conv.continue_document(turns["head"], f"{kvc.DOC_SLOT}\n\n")
    else:
        session = new_session(rt, rt.new_kv(spec), model)
        conv = Conversation(session, system)
    interactive = sys.stdin.isatty()
    if interactive:
        err_console.print(f"[bold]{rt.config.name or rt.path.name}[/] ready. {HELP}", style="dim")
    _repl(conv, interactive, n_predict, config, seed)


def _repl(conv, interactive: bool, n_predict: int, config, seed: int) -> None:
    """Read a line, answer it (streamed to stdout) or run its /command, until /exit or EOF."""
    session = conv.session
    last = None
    turn = 0
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            click.echo("\n(/exit or Ctrl-D to quit)", err=True)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            break
        if text == "/reset":
            conv.reset()
            last = None  # /stats speaks of the new conversation
            err_console.print("conversation reset", style="dim")
            continue
        if text == "/stats":
            msg = stats_line(last) if last else "no reply yet"
            err_console.print(
                f"{msg} | cache holds {len(session.tokens)}/{session.context} tokens",
                style="dim",
                soft_wrap=True,  # one line, as the other commands print it
            )
            continue
        if text in ("/help", "/?"):
            err_console.print(HELP, style="dim")
            continue
        try:
            with _StopFlag() as stop:
                result = conv.reply(
                    text,
                    n_predict=n_predict,
                    sampling=config,
                    seed=seed + turn,
                    on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()),
                    should_stop=stop,
                )
        except ContextOverflow as e:
            err_console.print(f"error: {e}; /reset starts a new conversation", style="red")
            continue
        turn += 1
        last = result.stats
        sys.stdout.write("\n")
        sys.stdout.flush()
        if result.stats.stop_reason == "interrupt":
            err_console.print("(stopped)", style="dim")
        elif result.stats.stop_reason == "context":
            err_console.print("(context full: /reset to start over)", style="yellow")
