"""kvrun's rooms say what they hold (docs/architecture.md): few modules at the top level, the
old import paths are the moved modules themselves, and imports between the layers run one way,
down (a static check over the source, as tests/test_imports.py reads it)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from test_imports import import_graph

ROOT = Path(__file__).resolve().parent.parent
# top to bottom: a layer imports only the layers after it (and the shared modules)
LAYERS = [
    ("kvrun.cli", "kvrun.convert", "kvrun.__main__"),
    ("kvrun.server", "kvrun.tasks"),
    ("kvrun.run", "kvrun.generate", "kvrun.runtime"),
    ("kvrun.hub",),
    ("kvrun.models", "kvrun.model"),
    ("kvrun.kv",),
    ("kvrun.quant",),
    ("kvrun.kernels", "kvrun.prompts"),
    ("kvrun.errors", "kvrun.report", "kvrun.progress", "kvrun.top_level"),
]


def _layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_layout.py")


def test_at_most_ten_modules_at_the_top_level():
    top = sorted(p.name for p in (ROOT / "kvrun").glob("*.py"))
    assert len(top) <= 10, top


@pytest.mark.parametrize(
    "old,new",
    [
        ("kvrun.generate", "kvrun.run.session"),
        ("kvrun.runtime", "kvrun.run.runtime"),
        ("kvrun.model", "kvrun.models.model"),
    ],
)
def test_old_import_paths_are_the_moved_modules(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


def test_imports_between_layers_run_down():
    graph = import_graph()
    up = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        if a != "kvrun"
        for b in targets
        if b != "kvrun" and _layer(b) < _layer(a)
    ]
    assert not up, up


def test_the_layers_name_every_module():
    for module in import_graph():
        if module != "kvrun":
            _layer(module)
