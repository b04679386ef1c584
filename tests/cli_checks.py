"""Assertions shared by the CLI tests."""

from __future__ import annotations


def one_error_line(result, *needles):
    """A failure: non-zero exit, one line on stderr starting with 'error:', naming the problem."""
    assert result.exit_code != 0, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in result.output
    for n in needles:
        assert n in lines[0], lines[0]
