"""The command line only parses and prints (issue 48): a command's run logic lives in
kvrun/tasks/, so no function in kvrun/cli/ grows past MAX_LINES. A command's docstring is
its --help page, not logic, so it is not counted; nor are its click decorators."""

from __future__ import annotations

import ast
from pathlib import Path

CLI = Path(__file__).resolve().parent.parent / "kvrun" / "cli"
MAX_LINES = 60


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function in source longer than limit: from its `def` line to
    its last, less its docstring."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        n = node.end_lineno - node.lineno + 1
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            if isinstance(first.value.value, str):
                n -= first.end_lineno - first.lineno + 1
        if n > limit:
            out.append((node.name, n))
    return out


def test_no_cli_function_is_longer_than_sixty_lines():
    files = sorted(CLI.glob("*.py"))
    assert len(files) > 10
    found = {f.name: long_functions(f.read_text()) for f in files}
    assert not {k: v for k, v in found.items() if v}, (
        "move the run logic into kvrun/tasks/ (the command parses and prints)"
    )


def test_the_count_leaves_out_the_docstring_and_sees_a_long_body():
    doc = '    """' + "help\n" * 30 + '"""\n'
    body = "    x = 1\n" * 59
    assert long_functions("def f():\n" + doc + body) == []  # 60 lines without the docstring
    assert long_functions("def f():\n" + doc + body + "    x = 2\n") == [("f", 61)]
    nested = "def outer():\n    def inner():\n" + "        y = 1\n" * 70
    assert [name for name, _ in long_functions(nested)] == ["outer", "inner"]
