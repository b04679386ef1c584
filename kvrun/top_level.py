"""The checkout's top-level folders kernels/, convert/ and prompts/ are installed as
kvrun.kernels, kvrun.convert and kvrun.prompts. Python run from the checkout's root (`python -c`,
`python -m`) also finds them by their bare names, which are names of PyPI packages too
(transformers imports Hugging Face's `kernels`). Imported by a bare name, such a folder hands
the import over to the package installed under that name, or, where none is, to an empty module
that holds nothing, as a folder without `__init__.py` would (PEP 420): a try-import fails and
transformers' availability check says no.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types


def hand_over(name: str, folder: str) -> None:
    """Put in sys.modules[name] the package `name` found on sys.path outside the checkout that
    holds `folder` (the importing folder itself), or an empty module; the import statement that
    ran the folder's `__init__` then returns that module (importlib reads sys.modules after it)."""
    root = os.path.realpath(os.path.dirname(folder))
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        module = types.ModuleType(name, f"No package {name!r} is installed (see kvrun.top_level).")
        module.__path__ = []  # a package with nothing in it: `from name import x` is an ImportError
        sys.modules[name] = module
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
