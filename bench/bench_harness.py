"""What bench scripts share: the machine, timing, alternation, markdown tables, README sections.

A sibling module, not a package: a script run as `python bench/X.py` has bench/ on sys.path and
imports it as `from bench_harness import ...`. Nothing here imports torch or kvrun at import time, so
`--help` stays fast and a parent that only spawns measured subprocesses stays light.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
# the x86 extensions kvrun's native kernels and llama.cpp's builds choose between
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


# ---------------------------------------------------------------- the machine


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def utc_now() -> str:
    """The date line of a recorded table: 2026-11-28 09:29 UTC."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model(default: str = "unknown CPU") -> str:
    m = re.search(r"^model name\s*:\s*(.*)$", _cpuinfo(), re.M)
    return m.group(1).strip() if m else default


def cpu_flags() -> set[str]:
    """The CPU's flags from /proc/cpuinfo; empty where they cannot be read (not Linux)."""
    m = re.search(r"^flags\s*:(.*)$", _cpuinfo(), re.M)
    return set(m.group(1).split()) if m else set()


def torch_version() -> str:
    """torch's version without importing it (a parent that only spawns runs stays light)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "unknown"


def ram_gib() -> float | None:
    try:
        m = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) / 2**20 if m else None


def machine(gpu: bool = True) -> dict:
    """Where the figures were taken; gpu=False leaves torch unimported."""
    flags = cpu_flags()
    out = {"cpu": cpu_model(platform.processor() or platform.machine()),
           "cores": os.cpu_count(), "isa": [f for f in ISA_FLAGS if f in flags],
           "ram_gib": ram_gib(), "torch": torch_version(), "platform": platform.platform(),
           "gpu": None}  # fmt: skip
    if gpu:
        import torch

        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name()
    return out


def describe(m: dict) -> str:
    """One line: AMD EPYC 9R14, 2 cores (avx2 fma f16c avx512f), 7.7 GiB RAM, torch 2.13.0+cpu."""
    isa = f" ({' '.join(m['isa'])})" if m["isa"] else ""
    ram = f", {m['ram_gib']:.1f} GiB RAM" if m["ram_gib"] else ""
    gpu = f", {m['gpu']}" if m["gpu"] else ""
    return f"{m['cpu']}, {m['cores']} cores{isa}{ram}, torch {m['torch']}{gpu}"


# ---------------------------------------------------------------- timing and alternation


@dataclass(frozen=True, slots=True)
class Timing:
    reps: list[float]  # seconds per call, one figure per rep

    @property
    def median(self) -> float:
        return statistics.median(self.reps)

    @property
    def best(self) -> float:
        return min(self.reps)


def clock(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def timed(fn: Callable[[], object], reps: int = 5, warmup: int = 1, inner: int = 1) -> Timing:
    """`warmup` untimed calls, then `reps` reps of `inner` calls each; a rep's figure is its
    mean seconds per call (inner > 1 for calls too short to time one by one)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t) / inner)
    return Timing(out)


def alternate(
    runners: dict[str, Callable[[], T]],
    reps: int,
    flip: bool = False,
    each: Callable[[str, int, T], None] | None = None,
) -> dict[str, list[T]]:
    """Each runner once per round, `reps` rounds, in the dict's order (flip: every other round
    reversed), so a machine whose speed drifts hits every runner alike. Returns each runner's
    results in round order; each(name, round, result) is called as they come."""
    out: dict[str, list[T]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(reps):
        for name in names[::-1] if flip and r % 2 else names:
            got = runners[name]()
            out[name].append(got)
            if each is not None:
                each(name, r, got)
    return out


# ---------------------------------------------------------------- markdown


def md_row(cells: Iterable) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_head(names: Sequence[str], align: str) -> list[str]:
    """The header and rule of a table; align has one letter per column, l(eft) or r(ight)."""
    rule = {"l": "---", "r": "---:"}
    return [md_row(names), md_row(rule[a] for a in align)]


def write_section(path: Path, body: str, begin: str, end: str) -> None:
    """Replace the text between the markers in path, or append the marked body."""
    old = path.read_text(encoding="utf-8") if path.exists() else "# kvrun benchmarks\n"
    section = f"{begin}\n{body}\n{end}"
    if begin in old and end in old:
        head, _, rest = old.partition(begin)
        new = head + section + rest.partition(end)[2]
    else:
        new = old.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(new, encoding="utf-8")
