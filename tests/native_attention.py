"""What the native attention tests share (tests/test_native_*attention*.py): the shapes every
store's kernel is held to against the torch path, the instruction sets and thread counts."""

from __future__ import annotations

import pytest
import torch

from kvrun.quant import native

ops = native.ops()
needs_native = pytest.mark.skipif(
    ops is None, reason=f"native kernels unavailable: {native.note()}"
)

# (Hq, Hkv, D): GQA ratios 1..8, head_dim 64, 128 and 256
HEADS = [(4, 4, 64), (6, 3, 64), (9, 3, 64), (8, 2, 128), (16, 2, 128), (8, 1, 256), (5, 1, 64)]
LENGTHS = [1, 7, 33, 250, 1027]  # odd lengths, shorter and longer than a chunk of keys


def isas_here() -> list[str]:
    if ops is None:
        return []
    here = []
    # AVX-VNNI differs from AVX2 only in int8 dot products, which attention does not use
    for name in ("portable", "avx2", "avx512vnni"):
        try:
            ops.set_isa(name)
            here.append(name)
        except RuntimeError:
            pass
    ops.set_isa("best")
    return here


def _axis(values: list, fast) -> list:
    """Fixture params: `fast` runs in the fast loop, every other value in the slow tier only
    (the whole grid runs in CI; the fast loop keeps one point of each axis)."""
    return [v if v == fast else pytest.param(v, marks=pytest.mark.slow) for v in values]


_ISAS = isas_here()


# the fast loop: the best instruction set built here (the one kvrun runs); the rest are slow
@pytest.fixture(params=_axis(_ISAS, _ISAS[-1]) if _ISAS else ["none"])
def isa(request):
    if ops is None:
        pytest.skip(f"native kernels unavailable: {native.note()}")
    ops.set_isa(request.param)
    yield request.param
    ops.set_isa("best")


@pytest.fixture(params=_axis([1, 2], 2))  # 2 threads split the keys: the driver's merge
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)
