"""Progress off a terminal: plain lines on stderr every few seconds (kvrun/progress.py's
LineProgress, what progress_bar gives when stderr is a pipe or a file); --quiet silences them."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kvrun import progress

pytestmark = pytest.mark.slow  # kvrun processes


@pytest.fixture
def lines(monkeypatch, capsys):
    monkeypatch.setattr(progress.LineProgress, "EVERY", 0.0)

    def read() -> list[str]:
        return [ln for ln in capsys.readouterr().err.splitlines() if ln]

    return read


def test_off_a_terminal_progress_bar_prints_lines(lines):
    bar = progress.progress_bar("needle")  # pytest's stderr is not a terminal
    assert isinstance(bar, progress.LineProgress)
    with bar:
        t = bar.add_task("needle", total=4)
        hidden = bar.add_task("prefill", total=None, visible=False)
        bar.update(hidden, completed=3)  # not shown
        bar.advance(t)
        bar.update(t, description="snapkv 2k @ 50%", advance=3)
        bar.advance(t)  # past the end: nothing more
    got = lines()
    assert got[0].startswith("needle: 1/4 (25%), ") and "/s, elapsed" in got[0]
    assert got[1].startswith("snapkv 2k @ 50%: 4/4 (100%), ") and ", done in " in got[1]
    assert len(got) == 2


def test_bytes_and_open_ended_tasks(lines):
    bar = progress.LineProgress(bytes_mode=True)
    t = bar.add_task("extract", total=None)
    bar.update(t, completed=3 * 2**20)
    got = lines()
    assert len(got) == 1 and got[0].startswith("extract: 3.00 MiB, ") and "iB/s, elapsed" in got[0]


def test_lines_come_at_most_every_few_seconds(capsys):
    bar = progress.LineProgress()
    t = bar.add_task("bench", total=100)
    for _ in range(50):
        bar.advance(t)  # well within EVERY seconds: silent
    assert capsys.readouterr().err == ""


def test_quiet_silences_them(lines):
    bar = progress.progress_bar("needle", quiet=True)
    t = bar.add_task("needle", total=2)
    bar.advance(t, 2)
    assert lines() == []


def test_quiet_reaches_the_bars_of_a_command(tmp_path):
    """--quiet on a command that loads a model: no progress line on stderr, where the same
    command without it prints the loading line (EVERY is 0 through the environment)."""
    code = (
        "import sys\nfrom kvrun import progress\nprogress.LineProgress.EVERY = 0.0\n"
        "from kvrun.cli.main import cli\ncli(sys.argv[1:], prog_name='kvrun')"
    )
    bench = ["bench", "-m", "tiny-synthetic", "-p", "8", "-n", "2", "-r", "1", "--json"]
    run = lambda *extra: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code, *bench, *extra], capture_output=True, text=True, cwd=tmp_path
    )
    loud, quiet = run(), run("--quiet")
    assert loud.returncode == 0 == quiet.returncode, loud.stderr + quiet.stderr
    line = re.compile(r": .*/s, (elapsed|done in) \d+ s$", re.M)
    assert line.search(loud.stderr), loud.stderr
    assert not line.search(quiet.stderr), quiet.stderr


def test_quiet_is_an_option_of_the_long_commands():
    for cmd in ("needle", "longdoc", "perplexity", "bench", "profile", "convert", "pull"):
        r = subprocess.run([sys.executable, "-m", "kvrun", cmd, "--help"], capture_output=True,
                           text=True)  # fmt: skip
        assert "--quiet" in r.stdout, cmd
