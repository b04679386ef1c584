"""Which matmul path packed weights take on a device, measured once per process.

`matmul_path(device, dtype)` times PyTorch's int4 op against dequantize + F.linear on a probe
(kvrun/quant/linear.py holds both paths) and keeps the faster; the answer is recorded
(kvrun/quant/probes.py) so `kvrun info` can report it without torch. `auto_wtype` decides what
`--wtype auto` means for a GGUF here (the bfloat16 prefill of large layers is
kvrun.quant.hardware.bf16_gemm_faster's to decide).
"""

from __future__ import annotations

import functools

import torch

from . import hardware, probes
from .linear import PackedLinear
from .packed import dense_name, quantize


def _probe(n: int, k: int, device: torch.device, dtype: torch.dtype) -> PackedLinear:
    g = torch.Generator().manual_seed(0)
    return PackedLinear(quantize(torch.randn(n, k, generator=g) * 0.02, 4).to(device), dtype)


@functools.cache
def matmul_path(device_type: str, dtype: torch.dtype) -> str:
    """'int4pack' or 'dequant': the path that measures faster for a decode-step product here
    (one row; a 1536 x 576 probe, the default model's FFN, on CPU; 2048 x 4096 on CUDA,
    whose op takes K in multiples of 1024); the int4 op must also agree with the exact
    product to 1e-2. Timed once per machine and torch build (kvrun/quant/probes.py)."""
    probe = probes.matmul(device_type, str(dtype).removeprefix("torch."))
    paths = ("int4pack", "dequant")
    return probes.measured(probe, lambda: measure_path(device_type, dtype), paths.__contains__)


def measure_path(device_type: str, dtype: torch.dtype, timed: bool = True) -> str:
    """The probe itself; timed=False: 'int4pack' wherever the op is present and exact,
    whatever its speed (the test suite pins its packed models to the op this way)."""
    device = torch.device(device_type)
    n, k = (2048, 4096) if device.type == "cuda" else (1536, 576)
    lin, deq = _probe(n, k, device, dtype), _probe(n, k, device, dtype)
    x = torch.randn(1, k, device=device, dtype=dtype)
    try:
        if not lin.use_int4pack():
            return "dequant"
        got, ref = lin(x).float(), deq(x).float()
    except (RuntimeError, NotImplementedError):  # op missing in this build
        return "dequant"
    if (got - ref).abs().max() > 1e-2 * ref.abs().max():
        return "dequant"
    faster = not timed or hardware.faster(lambda: lin(x), lambda: deq(x))
    return "int4pack" if faster else "dequant"


def auto_wtype(dense_bytes: int, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """What `--wtype auto` means for a quantized GGUF here: ('packed' | dense name, why).

    Packed, every tensor in its GGUF type, wherever the native CPU kernels run
    (kvrun/quant/native.py). Otherwise packed where PyTorch's int4 op serves decode steps
    here (`matmul_path`), or where the dense weights would not fit in 60% of the free
    memory; else dense in the compute
    dtype: without the op a packed decode step dequantizes every weight, slower than
    reading dense ones. (A probe that times packed against dense products cannot decide
    this: its weights sit in cache, the model's do not.)
    """
    if device.type == "cpu":
        from . import native

        if native.ops() is not None:
            return "packed", f"weights in their GGUF types (native kernels, {native.isa()})"
    free = hardware.available_bytes(device)
    if free is not None and dense_bytes > 0.6 * free:
        return "packed", (
            f"weights packed: dense {dense_name(dtype)} would take {dense_bytes / 2**30:.1f} GiB "
            f"of {free / 2**30:.1f} GiB free"
        )
    if matmul_path(device.type, dtype) == "int4pack":
        return "packed", "weights packed (int4 op path)"
    return dense_name(dtype), (
        f"weights dense {dense_name(dtype)}: PyTorch's int4 op is missing or slow on this "
        f"{device.type} and the dense model fits; --wtype q4 keeps them packed"
    )
