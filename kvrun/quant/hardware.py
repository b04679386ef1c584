"""Facts about this machine that loading choices depend on: free memory on a device, and
whether a bfloat16 GEMM beats float32 on this CPU. Imports no other kvrun module but the
probe record, so the weight formats (kvrun/quant/linear.py), their path choice
(kvrun/quant/choice.py) and the loaders can all ask it."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import probes


def available_bytes(device: torch.device) -> int | None:
    """Free memory on the device: CUDA free bytes, or MemAvailable from /proc/meminfo."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None  # unknown (not Linux): let the allocator decide


def faster(a, b, reps: int = 15) -> bool:
    """Whether `a` beats `b`: best of `reps` calls each, alternating a and b, so a busy
    machine slows both alike (timed one after the other, load spikes picked the winner)."""
    best = [float("inf"), float("inf")]
    for r in range(reps + 1):
        for i, fn in enumerate((a, b)):
            t = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if r:  # round 0 warms up
                best[i] = min(best[i], time.perf_counter() - t)
    return best[0] < best[1]


@functools.cache
def bf16_gemm_faster() -> bool:
    """Whether a bfloat16 GEMM beats float32 on this CPU (oneDNN on AMX or AVX512-BF16),
    timed once per machine on a 128 x 2048 x 2048 product (~0.4 s; kvrun/quant/probes.py)."""
    ok = ("yes", "no")
    return probes.measured("bf16_gemm_faster", _time_bf16_gemm, ok.__contains__) == "yes"


def _time_bf16_gemm() -> str:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(128, 2048, generator=g), torch.randn(2048, 2048, generator=g)
    xb, wb = x.bfloat16(), w.bfloat16()
    try:
        return "yes" if faster(lambda: F.linear(xb, wb), lambda: F.linear(x, w), reps=5) else "no"
    except RuntimeError:  # no bf16 GEMM in this build
        return "no"
