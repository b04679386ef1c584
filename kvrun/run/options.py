"""The command line's option groups as typed objects: click builds each once (kvrun/cli/common.py)
and the commands pass them on, to kvrun.tasks and to Ray workers (kvrun.run.cluster) alike.

Nothing here imports torch at import time: option errors answer before any model loads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import KvrunError
from ..models.config import SamplingConfig

if TYPE_CHECKING:
    from ..kv import KVSpec
    from .runtime import Runtime
    from .session import Session


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """-m, --dtype, --wtype, --device: the model and how it loads; -c, --ubatch, --cuda-graph:
    how its sessions run; --quiet: no progress lines off a terminal."""

    name: str | None = None  # -m: a name in the models folder or a path (None: the default)
    dtype: str = "auto"
    wtype: str = "auto"
    device: str = "auto"
    ctx_size: int = 0  # 0: the model's context
    ubatch: int = 512
    cuda_graph: bool = False
    quiet: bool = False

    def session(self, rt: Runtime, kv) -> Session:
        """A Session over kv with -c, --ubatch and --cuda-graph (its graph_note says why a
        requested graph is not used)."""
        from .session import Session

        graph = "on" if self.cuda_graph else "off"
        return Session(
            rt.model, rt.tokenizer, kv, ubatch=self.ubatch, context=self.ctx_size, graph=graph
        )


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """llama.cpp's sampling flags; seed -1 draws one (resolve)."""

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = -1
    ignore_eos: bool = False

    def resolve(self) -> tuple[SamplingConfig, int]:
        """The SamplingConfig and a concrete seed (a random one is drawn for -1)."""
        cfg = SamplingConfig(
            self.temp,
            self.top_k,
            self.top_p,
            self.min_p,
            self.repeat_penalty,
            self.repeat_last_n,
            self.ignore_eos,
        )
        seed = self.seed
        if seed < 0:
            import random

            seed = random.SystemRandom().randrange(2**31)
        return cfg, seed


@dataclass(frozen=True, slots=True)
class KVOptions:
    """--kv METHOD and --kv-budget B, as given."""

    method: str = "full"
    budget: str | None = None
    dtype: str = "auto"  # --kv-dtype

    def spec(self) -> KVSpec:
        """Validated into the spec every later step receives (a bad method, budget or
        --kv-dtype costs no model load)."""
        from ..kv import check

        return check(self.method, self.budget).with_dtype(self.dtype)


@dataclass(frozen=True, slots=True)
class KVGridOptions:
    """--kv repeated and --kv-budget as a comma list (the grids of needle and bench)."""

    methods: tuple[str, ...] = ("full",)
    budgets: str | None = None
    dtype: str = "auto"  # --kv-dtype, for every row


@dataclass(frozen=True, slots=True)
class ParallelOptions:
    """--parallel N sequences at once (kvrun.run.engine) and --kv-mem, their admission limit."""

    n: int = 1
    kv_mem: str | None = None  # as given: bytes (512M, 4G) or a fraction of free memory

    def kv_mem_bytes(self, device) -> int | None:
        """--kv-mem in bytes on device (None: no limit)."""
        return parse_mem(self.kv_mem, device)


@dataclass(frozen=True, slots=True)
class RayOptions:
    """--ray [ADDRESS], --workers, --cpus-per-worker, --retries: a batch on a Ray cluster."""

    address: str | None = None  # None: no Ray; local, auto or HOST:PORT
    workers: int | None = None
    cpus_per_worker: int | None = None
    retries: int = 2


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _size(text: str) -> tuple[float, str]:
    """(number, unit) of a size like 512M, 2GiB, 1000 or 0.5 (number -1 when not one)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    try:
        return float(t[: len(t) - len(unit)]), unit
    except ValueError:
        return -1.0, unit


def size_bytes(text: str, flag: str) -> int:
    """A size in bytes with an optional K/M/G/T suffix (1024-based): 512M, 2G, 0."""
    value, unit = _size(text)
    if value < 0:
        raise KvrunError(f"{flag} {text}: give a size (512M, 2G, 1000000) or 0")
    return int(value * _UNITS[unit])


def parse_mem(text: str | None, device) -> int | None:
    """--kv-mem: None, bytes with an optional K/M/G/T suffix, or a fraction (0, 1] of the
    memory free now (CUDA: the device's; CPU: MemAvailable)."""
    if text is None:
        return None
    value, unit = _size(text)
    if value <= 0 or (not unit and value != int(value) and value > 1):
        raise KvrunError(f"--kv-mem {text}: give bytes (512M, 4G, 1000000) or a fraction (0.5)")
    if unit or value > 1:
        return int(value * _UNITS[unit])
    return int(value * free_memory(device))


def free_memory(device) -> int:
    """Bytes free for new allocations: the CUDA device's, or the system's MemAvailable."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise KvrunError("--kv-mem as a fraction needs /proc/meminfo; give bytes (4G) instead")
