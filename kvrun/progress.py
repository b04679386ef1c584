"""Progress on stderr: a transient rich bar on a terminal; elsewhere (logs, pipes) a plain line
every few seconds, as llama.cpp logs, none with --quiet."""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from .report import human_bytes

err_console = Console(stderr=True, highlight=False)


def progress_bar(description: str, bytes_mode: bool = False, quiet: bool = False):
    """A transient progress bar on stderr when it is a terminal; else plain progress lines
    every few seconds (LineProgress), none when quiet (--quiet)."""
    if not sys.stderr.isatty():
        return LineProgress(bytes_mode, quiet)
    cols = [TextColumn("{task.description}"), BarColumn()]
    cols += [DownloadColumn()] if bytes_mode else [TextColumn("{task.completed}/{task.total}")]
    cols.append(TimeRemainingColumn())
    return Progress(*cols, console=err_console, transient=True)


@dataclass
class _Task:
    description: str
    total: float | None
    visible: bool
    t0: float  # when it was added
    shown: float  # when its last line was printed
    completed: float = 0
    ended: bool = False  # its closing line is printed


class LineProgress:
    """progress_bar off a terminal, as llama.cpp logs: for each visible task one plain line
    on stderr every EVERY seconds (what, how far, rate, time so far), and one when a task that
    ran that long ends; nothing when quiet. The subset of rich's Progress the commands use."""

    EVERY = 5.0

    def __init__(self, bytes_mode: bool = False, quiet: bool = False):
        self.bytes_mode, self.quiet = bytes_mode, quiet
        self.tasks: dict[int, _Task] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def add_task(self, description: str, total=None, visible: bool = True, **_) -> int:
        now = time.monotonic()
        i = len(self.tasks)
        self.tasks[i] = _Task(description, total, visible, t0=now, shown=now)
        return i

    def update(
        self,
        task: int,
        completed=None,
        total=None,
        description=None,
        visible=None,
        advance=None,
        **_,
    ) -> None:
        t = self.tasks[task]
        if completed is not None:
            t.completed = completed
        if total is not None:
            t.total = total
        if visible is not None:
            t.visible = visible
        if description is not None:
            t.description = description
        if advance:
            t.completed += advance
        self._report(t)

    def advance(self, task: int, advance: float = 1) -> None:
        self.update(task, advance=advance)

    def _report(self, t: _Task) -> None:
        if self.quiet or not t.visible:
            return
        now = time.monotonic()
        done = t.total is not None and t.completed >= t.total
        if done and (t.ended or now - t.t0 < self.EVERY):
            return
        if not done and now - t.shown < self.EVERY:
            return
        t.shown, t.ended = now, done
        print(self.line(t, now), file=sys.stderr, flush=True)

    def line(self, t: _Task, now: float) -> str:
        elapsed = max(now - t.t0, 1e-9)
        n, total = t.completed, t.total
        fmt = human_bytes if self.bytes_mode else (lambda x: f"{x:g}")
        where = f"{fmt(n)}/{fmt(total)} ({n / total:.0%})" if total else fmt(n)
        rate = f"{human_bytes(n / elapsed)}/s" if self.bytes_mode else f"{n / elapsed:.2f}/s"
        state = "done in" if total and n >= total else "elapsed"
        return f"{t.description}: {where}, {rate}, {state} {elapsed:.0f} s"


def prefill_progress(total_tokens: int, ubatch: int):
    """A context manager yielding a progress callback for long prefills (None for short ones)."""
    if total_tokens <= 2 * ubatch or not sys.stderr.isatty():
        return _NullProgress()
    return _PrefillProgress(total_tokens)


class _NullProgress:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class _PrefillProgress:
    def __init__(self, total: int):
        self.bar = progress_bar("prefill")
        self.total = total

    def __enter__(self):
        self.bar.__enter__()
        task = self.bar.add_task("prefill", total=self.total)
        return functools.partial(self._update, task)

    def _update(self, task, done, total):
        self.bar.update(task, completed=done, total=total)

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)


class PrefillBar:
    """A prefill progress callback for streamed answers: a bar on a terminal for long prompts,
    opened on the first call and gone (close) before the answer streams."""

    def __init__(self, ubatch: int):
        self.ubatch, self.bar = ubatch, None

    def __call__(self, n: int, total: int) -> None:
        if self.bar is None:
            if total <= 2 * self.ubatch or not sys.stderr.isatty():
                return
            self.bar = progress_bar("prefill").__enter__()
            self.task = self.bar.add_task("prefill", total=total)
        self.bar.update(self.task, completed=n)
        if n >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None
