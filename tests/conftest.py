"""Shared fixtures: the default model (pulled by `kvrun pull smollm2` before the tests)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _outside_checkout(entries: list[str]) -> list[str]:
    """sys.path / PYTHONPATH entries less the checkout's root and bench/."""
    root = Path(__file__).resolve().parent.parent
    drop = {root, root / "bench"}
    return [p for p in entries if Path(p or os.curdir).resolve() not in drop]


# The suite imports the installed kvrun and the installed third-party packages, never the
# checkout's folders by their bare names: `python -m pytest` puts the current folder first on
# sys.path, and pytest-xdist puts its own on each worker's sys.path and PYTHONPATH (which the
# suite's subprocesses inherit). From the checkout's root, `kernels/` would shadow Hugging
# Face's `kernels` (kvrun.top_level hands such imports over; this keeps them from starting).
# This runs before any test module, and so before transformers, is imported.
sys.path[:] = _outside_checkout(sys.path)
if os.environ.get("PYTHONPATH"):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        _outside_checkout(os.environ["PYTHONPATH"].split(os.pathsep))
    )

import pytest
import torch

# Triton kernels run in the interpreter on CPU tensors unless a GPU is present; the variable
# must be set before any @triton.jit function is defined, so it is set here, first.
if os.environ.get("TRITON_INTERPRET") is None and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kvrun.hub.model_store import REGISTRY, models_dir

# Tests build their packed models afresh (some patch how they are built); the packed cache's
# own tests (tests/test_packed_cache.py) turn it on with a cache folder of their own.
os.environ["KVRUN_PACKED_CACHE"] = "off"

# The matmul path (PyTorch's int4 op or dequantize + F.linear) is a timing probe whose answer
# is recorded per machine (kvrun/quant/probes.py): one timed beside other jobs can say 'dequant' on a
# machine where the op works, and the packed tests would then run another path than they
# check. The suite records its own answer in a folder of its own (also for the kvrun
# subprocesses it starts): the int4 op wherever it is present and exact, whatever its speed.
# The native CPU kernels are built once per machine and source (kvrun/quant/native.py): the
# suite's own KVRUN_CACHE below must not make every run compile them again.
os.environ.setdefault(
    "KVRUN_NATIVE_DIR",
    os.path.join(os.environ.get("KVRUN_CACHE") or os.path.expanduser("~/.cache/kvrun"), "native"),
)


def pytest_configure(config):
    """The suite's cache folder and its probe record, made once before the tests (and before
    pytest-xdist starts its workers, which inherit the folder); nothing at import."""
    if os.environ.get("KVRUN_CACHE"):
        return
    import atexit
    import shutil
    import tempfile

    from kvrun.quant import choice as matmul_choice
    from kvrun.quant import probes

    os.environ["KVRUN_CACHE"] = tempfile.mkdtemp(prefix="kvrun-tests-")
    atexit.register(shutil.rmtree, os.environ["KVRUN_CACHE"], ignore_errors=True)
    path = matmul_choice.measure_path("cpu", torch.float32, timed=False)
    probes.record(probes.matmul("cpu", "float32"), path)


# Under pytest-xdist (`-n 2`, the README's test command) each worker computes on one thread:
# two workers on a 2-core machine, each with two threads, would run far slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


# The fast loop (`python -m pytest -q -m "not slow"`) runs on tiny models in this process
# only: a test that takes the pulled default model is slow wherever it is; files that start
# processes, servers or Ray say so with `pytestmark = pytest.mark.slow`.
SLOW_FIXTURES = {"default_gguf", "default_runtime"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason="no CUDA device: compiled Triton runs need a GPU",
            ),
        ),
    ]
)
def device(request):
    """The kernel tests' devices: cpu (Triton interpreted) and cuda (compiled Triton)."""
    if request.param == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "Triton on CPU tensors needs TRITON_INTERPRET=1 (conftest sets it without a GPU)"
        )
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: on a busy 2-core machine, two threads run far slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def default_gguf():
    """Path of the default model's GGUF; skips (with the command to fix it) when absent."""
    path = models_dir() / REGISTRY["smollm2"].filename
    if not path.exists():
        pytest.skip(f"default model not pulled: run `kvrun pull smollm2` (looked for {path})")
    return path


@pytest.fixture(scope="session")
def default_runtime(default_gguf):
    """The default model loaded once on CPU with dense float32 weights (the reference path)."""
    from kvrun.run.runtime import load_runtime

    return load_runtime(str(default_gguf), "float32", "cpu", log=lambda m: None, wtype="f32")


@pytest.fixture
def no_native(monkeypatch):
    """PyTorch's path for quantized products, as where kvrun cannot build its native CPU
    kernels (no compiler): GGUF's Q4/Q8 types through the int4 op, the rest dequantized."""
    from kvrun.quant import native

    monkeypatch.setattr(native, "ops", lambda: None)


@pytest.fixture
def sdpa_prefill(monkeypatch):
    """A prefill chunk's attention through SDPA even where the native kernels are set (as on the
    torch path), for tests that compare the native decode or build bit for bit from the same
    prefill; kvrun.kv.attention.native_attention has its own tests."""
    import importlib

    for name in (
        "kvrun.kv.attention",
        "kvrun.kv.stores.dense",
        "kvrun.kv.stores.kivi_native",
        "kvrun.kv.methods.spindlekv.cache",
        "kvrun.kv.methods.kvzip.native",
    ):
        monkeypatch.setattr(importlib.import_module(name), "native_attention", lambda *a, **k: None)
