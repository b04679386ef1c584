"""The package list in pyproject.toml names every package directory, so `pip install .` (not
only an editable install) ships all of kvrun."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_directory_is_listed():
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(kvrun[\w.]*)"', re.search(r"packages = \[(.*?)\]", text)[1]))
    dirs = dict(re.findall(r'"(kvrun[\w.]*)" = "(\w+)"', text))  # package-dir mapping
    found = set()
    for package, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *rel)))
    assert found == listed, f"missing from pyproject packages: {sorted(found - listed)}"
