"""Shared fixtures: the default model (pulled by `kvrun pull smollm2` before the tests)."""

from __future__ import annotations

import os

import pytest

# Triton kernels run in the interpreter on CPU tensors unless a GPU is present; the variable
# must be set before any @triton.jit function is defined, so it is set here, first.
if os.environ.get("TRITON_INTERPRET") is None:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass

from kvrun.models import REGISTRY, models_dir


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: on a busy 2-core machine, two threads run far slower."""
    import torch

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
    """The default model loaded once on CPU in float32."""
    from kvrun.runtime import load_runtime

    return load_runtime(str(default_gguf), "float32", "cpu", log=lambda m: None)
