"""OpenMP's spinning, set before torch loads, for machines other jobs keep busy.

PyTorch's CPU kernels run in GNU OpenMP regions; at the end of each region a thread spins
(GOMP_SPINCOUNT, 300,000 polls by default) before it sleeps. On a machine of its own that is
fastest. Beside another job that keeps the cores busy, a thread spins while the one it waits
for is not even scheduled, and every short region (a decode step has hundreds; packing
weights at load has many) costs a scheduler time slice: measured on 2 cores with another
2-thread job, the default model loaded in 4-22 s and decoded 3.4 tok/s, against 1.9-2.2 s
and 18 tok/s with 1,000 polls (and 1.4 s, 27-31 tok/s on the quiet machine, where 1,000
polls would cost ~30 % of decode speed). So the spin count is lowered only when other
processes are found busy at normal priority in a short sample of /proc/stat before torch
loads (nice time is not counted: low-priority jobs yield). GOMP_SPINCOUNT or OMP_WAIT_POLICY
set by the user, or KVRUN_OPENMP=keep, leave it alone; so does torch loaded already.
"""

from __future__ import annotations

import os
import sys
import time

SHARED_SPINCOUNT = "1000"
SAMPLE_S = 0.04
BUSY_CPUS = 0.5  # CPUs kept busy by others from which the machine counts as shared

NOTE: dict[str, str | None] = {"text": None}  # what tune() did, for the load log


def busy_cpus(sample_s: float = SAMPLE_S) -> float | None:
    """CPUs kept busy at normal priority by other processes over a short sample (this one
    sleeps meanwhile): user + system + irq + softirq + steal time of the whole machine."""

    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        user, _nice, system, _idle, _iowait, irq, softirq, steal = v + [0] * (8 - len(v))
        return user + system + irq + softirq + steal, sum(v)

    try:
        b0, t0 = read()
        time.sleep(sample_s)
        b1, t1 = read()
    except (OSError, ValueError):
        return None
    return (os.cpu_count() or 1) * (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


def tune() -> str | None:
    """Lower OpenMP's spin count when other jobs keep this machine busy (before torch loads).
    Returns what was done, or None."""
    if "torch" in sys.modules or os.environ.get("KVRUN_OPENMP") == "keep":
        return None
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return None
    busy = busy_cpus()
    if busy is None or busy < BUSY_CPUS:
        return None
    os.environ["GOMP_SPINCOUNT"] = SHARED_SPINCOUNT
    NOTE["text"] = (
        f"{busy:.1f} CPUs busy with other jobs: OpenMP threads spin {SHARED_SPINCOUNT} times "
        "at barriers, not 300,000 (GOMP_SPINCOUNT; KVRUN_OPENMP=keep leaves the default)"
    )
    return NOTE["text"]
