"""The package list in pyproject.toml names every package directory, so `pip install .` (not
only an editable install) ships all of kvrun."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def _requirements() -> dict[str, str]:
    """{name: requirement} of kvrun and its test extra, as pyproject.toml gives them."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["test"]
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-"): r for r in reqs}


def test_every_dependency_is_tested_at_its_lower_bound():
    """Each direct dependency has a lower bound and no cap (CI tests the newest release; one
    that breaks kvrun may be excluded with !=), and .ci/oldest.txt, which `.ci/run oldest`
    installs, holds each at exactly that bound."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    lines = (ROOT / ".ci" / "oldest.txt").read_text().splitlines()
    pins = dict(line.lower().replace("_", "-").split("==") for line in lines if line[:1].isalpha())
    floors = {}
    for name, text in _requirements().items():
        spec = {s.operator: s.version for s in Requirement(text).specifier}
        assert ">=" in spec and set(spec) <= {">=", "!="}, f"{text}: a lower bound, no cap (README)"
        floors[name] = spec[">="]
    assert set(pins) == set(floors), (
        sorted(set(floors) - set(pins)),
        sorted(set(pins) - set(floors)),
    )
    wrong = {n: (floors[n], pins[n]) for n in floors if Version(floors[n]) != Version(pins[n])}
    assert not wrong, f"pyproject.toml's lower bound vs .ci/oldest.txt: {wrong}"


def test_the_floors_are_those_that_last_passed():
    """.ci/oldest.passed holds the fingerprint of the floors `.ci/run oldest` last passed with:
    a bound moved (pyproject.toml, .ci/oldest.txt) without that run is refused here."""
    import runpy

    now = runpy.run_path(str(ROOT / ".ci" / "floors.py"))["fingerprint"]()
    passed = (ROOT / ".ci" / "oldest.passed").read_text().split()[0]
    assert now == passed, (
        "the dependency floors changed since `.ci/run oldest` last passed: run it (it rewrites "
        ".ci/oldest.passed) and commit that file"
    )


def _module_names(folder: Path) -> set[str]:
    """The names a script run from `folder` (or from one below it) can import from there."""
    names = set()
    for path in folder.rglob("*"):
        if any(p.startswith(".") for p in path.relative_to(folder).parts[:-1]):
            continue  # a hidden folder (bench/.venv-llamacpp) is nobody's import path
        if path.suffix == ".py" or (path.is_dir() and not path.name.startswith((".", "_"))):
            names.add(path.stem)
    return names


def test_no_script_folder_holds_a_module_named_like_an_installed_package():
    """`python bench/X.py` puts bench/ first on sys.path (pytest puts tests/): a file or folder
    there named like a package that transformers or another dependency imports would be
    imported instead (bench/kernels.py once shadowed Hugging Face's `kernels`)."""
    import importlib.metadata

    installed = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    clash = {
        f"{folder}/{name}"
        for folder in ("bench", "tests")
        for name in _module_names(ROOT / folder) & installed
        if name != "conftest"  # pytest's own name for it
    }
    assert not clash, f"rename these (a package of that name is installed): {sorted(clash)}"


def test_the_suite_imports_nothing_of_the_checkout_by_a_bare_name():
    """conftest.py keeps the checkout's root off sys.path (`python -m pytest` and pytest-xdist
    put the current folder there): kvrun is the installed one, and no module of the checkout is
    imported under another name than kvrun's (tests/' and bench/'s own modules aside)."""
    import kvrun.kernels  # noqa: F401 - imported by now in any run; here in a run of one file

    # (bench/ may be there: bench scripts imported by path put it there for their siblings, whose
    # names no installed package has; see the test above)
    assert str(ROOT) not in {str(Path(p or ".").resolve()) for p in sys.path}
    stray = {
        name
        for name, module in list(sys.modules.items())
        if isinstance(f := getattr(module, "__file__", None), str)
        and os.path.isabs(f)
        and Path(f).resolve().is_relative_to(ROOT)
        and not Path(f).resolve().is_relative_to(ROOT / "tests")
        and not Path(f).resolve().is_relative_to(ROOT / "bench")
        and name.split(".")[0] != "kvrun"
    }
    assert not stray, f"imported from the checkout by a bare name: {sorted(stray)}"


SHADOW_CHECK = """
import importlib, importlib.metadata, json
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, vocab_size=32))
out = {}
for name in ("kernels", "convert", "prompts"):
    try:
        importlib.metadata.distribution(name)
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    try:
        out[name] = [installed, getattr(importlib.import_module(name), "__file__", None)]
    except ModuleNotFoundError:  # nothing by that name where this runs
        out[name] = [installed, None]
print(json.dumps(out))
"""


@pytest.mark.slow  # subprocesses, transformers' import
@pytest.mark.parametrize("where", [".", "bench"])
def test_bare_names_run_from_the_checkout_are_the_installed_packages(where):
    """`python -c` from the checkout's root (or `python bench/X.py`, bench/ first on sys.path):
    transformers builds a model (it imports Hugging Face's `kernels`), and `kernels`, `convert`,
    `prompts` are the packages installed by those names, or empty where none is (kvrun.top_level),
    never the checkout's folders of those names."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", SHADOW_CHECK], cwd=ROOT / where, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    for name, (installed, file) in json.loads(r.stdout.splitlines()[-1]).items():
        if installed:
            assert file and not Path(file).resolve().is_relative_to(ROOT), (name, file)
        else:
            assert file is None, (name, file)
