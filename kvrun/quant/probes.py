"""What the timing probes found on this machine, kept on disk: later processes take the
answer instead of timing again (a probe timed while other jobs share the CPU can flip, and
each costs start-up time: up to ~0.5 s), and commands which run no model (`kvrun info`)
report it without importing torch.

A probe (kvrun.quant.choice, kvrun.quant.hardware) records its answer under a key naming the
probe, the torch build and the CPU; a reader gets None for anything not yet probed with
this torch on this CPU. The file is a cache: losing it costs one probe, and a write that
fails is ignored. KVRUN_PROBES=fresh times every probe again (and records the answers).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from functools import cache
from importlib import metadata
from pathlib import Path


def cache_file() -> Path:
    """$KVRUN_CACHE/probes.json (default ~/.cache/kvrun/probes.json)."""
    root = os.environ.get("KVRUN_CACHE") or "~/.cache/kvrun"
    return Path(root).expanduser() / "probes.json"


@cache
def _machine() -> str:
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "?"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return f"torch {torch} | {cpu}"


def matmul(device_type: str, dtype: str) -> str:
    """The name kvrun.quant.choice.matmul_path records its answer under ('int4pack' | 'dequant')."""
    return f"matmul_path {device_type} {dtype}"


def _read() -> dict:
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def recorded(probe: str) -> str | None:
    """The recorded answer of `probe` for this torch and CPU, or None."""
    value = _read().get(f"{probe} | {_machine()}")
    return value if isinstance(value, str) else None


def record(probe: str, value: str) -> None:
    data = _read()
    key = f"{probe} | {_machine()}"
    if data.get(key) == value:
        return
    data[key] = value
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass


def measured(probe: str, measure: Callable[[], str], valid: Callable[[str], bool]) -> str:
    """The recorded answer of `probe` where it is a valid one, else `measure()` (recorded)."""
    if os.environ.get("KVRUN_PROBES") != "fresh":
        value = recorded(probe)
        if value is not None and valid(value):
            return value
    value = measure()
    record(probe, value)
    return value
