"""What every kernel family shares: whether Triton runs, `jit`, `use_triton`, `next_pow2`."""

from __future__ import annotations

import os

import torch

from kvrun.errors import KvrunError


def _kernels_can_run() -> bool:
    """Triton is imported only where a kernel can run (a CUDA GPU, the interpreter, or
    KVRUN_KERNELS=triton): elsewhere its import would add ~0.2 s to every start-up."""
    return (
        torch.cuda.is_available()
        or os.environ.get("TRITON_INTERPRET") == "1"
        or os.environ.get("KVRUN_KERNELS") == "triton"
    )


triton = None
if _kernels_can_run():
    try:
        import triton
    except ImportError:  # the torch references need no triton
        triton = None

# Forcing Triton without a GPU means the interpreter, which triton.jit picks when a kernel is
# defined, so the variable is set before any family module defines its kernels.
if (
    triton is not None
    and os.environ.get("KVRUN_KERNELS") == "triton"
    and "TRITON_INTERPRET" not in os.environ
    and not torch.cuda.is_available()
):
    os.environ["TRITON_INTERPRET"] = "1"

HAVE_TRITON = triton is not None


def jit(fn):
    """`triton.jit(fn)` when triton imports, else `fn` itself (the dispatchers never call it)."""
    return triton.jit(fn) if triton is not None else fn


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether a dispatcher runs its Triton kernel on these inputs (see the module docstring)."""
    mode = os.environ.get("KVRUN_KERNELS", "auto") or "auto"
    if mode == "torch":
        return False
    if mode == "triton":
        if triton is None:
            raise KvrunError("KVRUN_KERNELS=triton but triton is not installed: pip install triton")
        return True
    if mode != "auto":
        raise KvrunError(f"KVRUN_KERNELS={mode!r}: use auto, torch or triton")
    return triton is not None and all(t.is_cuda for t in tensors)


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1) (Triton block sizes must be powers of two)."""
    return 1 << max(n - 1, 0).bit_length()
