"""Batch commands on a Ray cluster: `kvrun longdoc --ray` and `kvrun needle --ray`.

Each worker is a Ray actor holding one loaded model (resolved on its own node) and the
sessions of the command line; the driver (the kvrun process) streams work items to the
workers, at most IN_FLIGHT calls per worker, and hands each result back as it arrives. A
worker that dies (process killed, node lost) has its calls' items sent again, to a new actor
or to the others, each item at most `retries` times; an item that fails by itself (a document
too long for the context) comes back as that item's error and is not sent again. Ray is an
optional dependency (`pip install 'kvrun[ray]'`), imported only here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import KvrunError
from .options import ModelOptions, RayOptions

if TYPE_CHECKING:
    from .runtime import Runtime

IN_FLIGHT = 2  # calls queued per worker: the next one waits on the worker, not on the driver
RAY_MISSING = "--ray needs Ray: pip install 'kvrun[ray]' (or pip install ray)"


def import_ray():
    try:
        import ray
    except ImportError:
        raise KvrunError(RAY_MISSING) from None
    return ray


def connect(address: str):
    """Join or start Ray: 'local' starts an instance for this run, 'auto' joins the running
    cluster (RAY_ADDRESS or `ray start --head` on this machine), anything else is an address."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    quiet = {"logging_level": logging.ERROR, "log_to_driver": False}
    if address == "local":  # Ray starts workers at niceness 15; ours compute: the local run's
        os.environ.setdefault("RAY_worker_niceness", str(os.getpriority(os.PRIO_PROCESS, 0)))
    if address not in ("local", "auto"):
        reachable(address)  # Ray itself retries an unreachable address for minutes, loudly
    try:
        if address == "local":
            ray.init(address="local", include_dashboard=False, **quiet)
        else:
            ray.init(address=address, **quiet)
    except ConnectionError as e:
        if address == "auto":
            raise KvrunError(
                "no running Ray cluster found: start one with `ray start --head` (and `ray "
                "start --address HEAD:6379` on the other nodes), set RAY_ADDRESS, or use "
                "--ray local"
            ) from None
        raise KvrunError(f"cannot join the Ray cluster at {address}: {e}") from None
    return ray


def reachable(address: str, timeout: float = 5.0) -> None:
    """A HOST:PORT (or ray://HOST:PORT) that answers a TCP connect, else one line saying so."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise KvrunError(f"--ray {address}: give local, auto or HOST:PORT (the head's GCS port)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise KvrunError(
            f"cannot reach the Ray cluster at {address}: {e.strerror or e} (is `ray start "
            "--head` running there?)"
        ) from None


def start(
    opts: RayOptions, setup: Callable, model: ModelOptions, args: dict, echo: Callable[[str], None]
) -> tuple[Pool, dict]:
    """Join or start Ray, start the workers, wait for one: (pool, its facts). Each worker
    runs setup(model=model, **args); a model path that exists here goes to the workers as an
    absolute path."""
    ray = connect(opts.address)
    lay = layout(ray, opts.workers, opts.cpus_per_worker)
    if model.name and Path(model.name).exists():  # a path here: the same on the workers' nodes
        model = dataclasses.replace(model, name=str(Path(model.name).absolute()))
    each = f"{lay.num_cpus} CPUs" + (", 1 GPU" if lay.num_gpus else "")
    echo(f"ray: starting {lay.workers} workers ({each} each; cluster: {lay.cluster})")
    pool = Pool(ray, lay, setup, {"model": model, **args}, opts.retries, echo)
    try:
        return pool, pool.wait_ready()
    except BaseException:
        pool.close()
        raise


@dataclass(frozen=True)
class WorkerLayout:
    """How many workers, and what each asks of the cluster."""

    workers: int
    num_cpus: int
    num_gpus: int  # num_cpus is also each worker's torch threads
    cluster: str  # what the cluster has, for messages


def layout(ray, workers: int | None, cpus_per_worker: int | None) -> WorkerLayout:
    """One worker per GPU on a GPU cluster; on CPUs, one per --cpus-per-worker CPUs (default 2,
    or the CPUs shared out among --workers)."""
    res = ray.cluster_resources()
    cpus, gpus = int(res.get("CPU", 0)), int(res.get("GPU", 0))
    have = f"{cpus} CPUs" + (f" and {gpus} GPUs" if gpus else "")
    if gpus:
        n = workers or gpus
        if n > gpus:
            raise KvrunError(f"--workers {n}: the cluster has {gpus} GPUs (one worker per GPU)")
        per = cpus_per_worker or max(1, min(4, cpus // n))
        return WorkerLayout(n, per, 1, have)
    if cpus_per_worker is None:
        cpus_per_worker = max(1, cpus // workers) if workers else max(1, min(2, cpus))
    n = workers or max(1, cpus // cpus_per_worker)
    if n * cpus_per_worker > cpus:
        raise KvrunError(
            f"{n} workers x {cpus_per_worker} CPUs do not fit the cluster's {cpus} CPUs; "
            "lower --workers or --cpus-per-worker"
        )
    return WorkerLayout(n, cpus_per_worker, 0, have)


def load_model(model: ModelOptions) -> Runtime:
    """The command's model on a Ray worker, resolved on the worker's node, quietly; a model
    the node lacks says where it must be."""
    from ..hub.model_store import models_dir
    from .runtime import load_runtime

    try:
        return load_runtime(
            model.name,
            model.dtype,
            model.device,
            pull_missing=False,
            log=lambda m: None,
            wtype=model.wtype,
        )
    except KvrunError as e:
        raise KvrunError(
            f"{e} (each worker loads the model on its own node: give a path on storage every "
            f"node sees, or a name in that node's models folder, here {models_dir()})"
        ) from None


def node_ip() -> str:
    import ray

    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - only a label
        return "?"


class RayWorker:
    """One model and the command's sessions on a node (made a Ray actor by `Pool`).

    `setup(**args)` builds what the command needs (kvrun.tasks.longdoc_run.worker_setup or
    kvrun.tasks.needle_run.worker_setup): it returns (handler, facts), handler(items) -> results.
    A failure to load or set up is returned by `ready()` as text, not raised, so the driver can
    say which node it was."""

    def __init__(self, threads: int, nice: int, setup: Callable, args: dict):
        self._renice(nice)  # first: the OpenMP check below samples the machine as it runs
        from . import openmp

        openmp.tune()  # before torch loads in this process
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.node, self.pid = node_ip(), os.getpid()
        self.error, self.facts, self.handler = None, {}, None
        try:
            self.handler, self.facts = setup(**args)
        except KvrunError as e:
            self.error = str(e)

    note: str | None = None

    def _renice(self, nice: int) -> None:
        """Ray starts workers at niceness 15 (RAY_worker_niceness), to favour its own
        daemons: a kvrun worker then runs at half speed or less beside any other job on its
        node. Back to the driver's niceness where allowed; else a note says how."""
        now = os.getpriority(os.PRIO_PROCESS, 0)
        if now <= nice:
            return
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except OSError:
            self.note = (
                f"runs at niceness {now} (Ray's default for workers), slower beside other "
                "jobs; start the nodes with RAY_worker_niceness=0"
            )

    def ready(self) -> dict:
        facts = {"node": self.node, "pid": self.pid, "error": self.error, "facts": self.facts}
        return {**facts, "note": self.note}

    def run(self, items: list) -> list:
        return self.handler(items, self.node)


@dataclass
class _Slot:
    actor: object
    index: int
    ready_ref: object | None
    info: dict = field(default_factory=dict)
    calls: dict = field(default_factory=dict)  # ref -> items


@dataclass
class PoolStats:
    started: int = 0
    lost: int = 0
    resent: int = 0
    nodes: set = field(default_factory=set)
    wall_s: float = 0.0


class Pool:
    """Workers as Ray actors; `stream` sends items through them, `chunk` per call.

    items: (key, item) pairs, key naming the item across resends; on_event(text) is told
    worker news (ready, failed to start, lost)."""

    def __init__(
        self,
        ray,
        lay: WorkerLayout,
        setup: Callable,
        args: dict,
        retries: int,
        on_event: Callable[[str], None],
    ):
        self.ray, self.lay, self.setup, self.args = ray, lay, setup, args
        self.retries, self.on_event = retries, on_event
        self.actor_cls = ray.remote(max_restarts=0, max_task_retries=0)(RayWorker)
        self.slots: list[_Slot] = []
        self.stats = PoolStats()
        self.facts: dict = {}
        self.t0: float | None = None  # when stream() began
        self._next = 0
        for _ in range(lay.workers):
            self._start()

    def _start(self) -> None:
        actor = self.actor_cls.options(num_cpus=self.lay.num_cpus, num_gpus=self.lay.num_gpus)
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        actor = actor.remote(self.lay.num_cpus, nice, self.setup, self.args)
        self.slots.append(_Slot(actor, self._next, actor.ready.remote()))
        self._next += 1
        self.stats.started += 1

    @property
    def alive(self) -> int:
        return len(self.slots)

    def wait_ready(self, timeout: float = 600.0) -> dict:
        """Block until one worker is ready; its facts (what only the model can tell)."""
        t0 = time.monotonic()
        while not self.facts:
            pending = [s.ready_ref for s in self.slots if s.ready_ref is not None]
            if not pending:
                raise KvrunError("no worker could start (their errors are above)")
            done, _ = self.ray.wait(pending, num_returns=1, timeout=5.0)
            for ref in done:
                self._on_ready(ref)
            if time.monotonic() - t0 > timeout:
                raise KvrunError(
                    f"no worker started in {timeout:.0f} s: does the cluster ({self.lay.cluster}) "
                    "have room for them?"
                )
        return self.facts

    def _slot_of(self, ref) -> _Slot | None:
        return next((s for s in self.slots if s.ready_ref == ref or ref in s.calls), None)

    def _on_ready(self, ref) -> None:
        slot = self._slot_of(ref)
        slot.ready_ref = None
        try:
            info = self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            info = {"node": "?", "pid": None, "error": f"the worker died while starting ({e})"}
        if info["error"]:
            self.slots.remove(slot)
            self.on_event(f"worker {slot.index} on node {info['node']}: {info['error']}")
            return
        slot.info = info
        self.stats.nodes.add(info["node"])
        self.facts = self.facts or info["facts"]
        note = f"; {info['note']}" if info.get("note") else ""
        self.on_event(f"worker {slot.index} ready: node {info['node']}, pid {info['pid']}{note}")

    def stream(self, items: Iterable, chunk: int) -> Iterator[tuple]:
        """(item, result, None) as calls finish, or (item, None, error text) for an item
        given up: its worker died more than `retries` times, or the call itself failed."""
        self.t0 = time.monotonic()
        source: Iterator = iter(items)
        again: deque = deque()  # items to send again, first
        tries: dict = {}  # key -> times sent
        exhausted = False

        def take() -> list:
            nonlocal exhausted
            out = []
            while len(out) < chunk and again:
                out.append(again.popleft())
            while len(out) < chunk and not exhausted:
                try:
                    out.append(next(source))
                except StopIteration:
                    exhausted = True
            return out

        budget = self.lay.workers * (self.retries + 1)  # replacement actors, at most
        while True:
            for slot in self.slots:
                while slot.ready_ref is None and len(slot.calls) < IN_FLIGHT:
                    batch = take()
                    if not batch:
                        break
                    for key, _ in batch:
                        tries[key] = tries.get(key, 0) + 1
                    slot.calls[slot.actor.run.remote([it for _, it in batch])] = batch
            calls = [r for s in self.slots for r in s.calls]
            starting = [s.ready_ref for s in self.slots if s.ready_ref is not None]
            if not calls:
                if exhausted and not again:
                    break
                if not starting:
                    raise KvrunError(
                        "every worker is lost; rerun with --resume (longdoc) once the cluster "
                        "is back"
                    )
            done, _ = self.ray.wait(calls + starting, num_returns=1, timeout=5.0)
            for ref in done:
                slot = self._slot_of(ref)
                if slot is None:
                    continue
                if ref == slot.ready_ref:
                    self._on_ready(ref)
                    continue
                batch = slot.calls.pop(ref)
                try:
                    results = self.ray.get(ref)
                except self.ray.exceptions.RayActorError as e:
                    yield from self._lost(slot, e, batch, tries, again)
                    if self.stats.started - self.lay.workers < budget:
                        self._start()
                    continue
                except self.ray.exceptions.RayTaskError as e:  # a bug in kvrun, not the input
                    msg = " ".join(str(getattr(e, "cause", None) or e).split())
                    for _, item in batch:
                        yield item, None, f"worker error: {msg}"
                    continue
                for (_, item), res in zip(batch, results, strict=True):
                    yield item, res, None
        self.stats.wall_s = time.monotonic() - self.t0

    def _lost(self, slot: _Slot, err, batch, tries, again) -> Iterator[tuple]:
        """A worker died: every call it had is lost; their items go again, unless sent too
        often already (those are yielded as given up)."""
        batches = [batch, *slot.calls.values()]
        slot.calls.clear()
        if slot in self.slots:
            self.slots.remove(slot)
            self.stats.lost += 1
            where = slot.info.get("node", "?")
            lost = f"worker {slot.index} on node {where} lost ({type(err).__name__})"
            self.on_event(f"{lost}; its documents go again")
            try:
                self.ray.kill(slot.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for b in batches:
            for key, item in b:
                if tries.get(key, 0) > self.retries:
                    yield item, None, f"its worker died {tries[key]} times while answering it"
                else:
                    again.append((key, item))
                    self.stats.resent += 1

    def close(self) -> None:
        for slot in self.slots:
            try:
                self.ray.kill(slot.actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.slots.clear()

    def summary(self, n_done: int, what: str) -> str:
        s = self.stats
        rate = 60 * n_done / s.wall_s if s.wall_s else 0.0
        nodes = len(s.nodes)
        line = (
            f"ray: {n_done} {what} on {self.lay.workers} workers ({nodes} "
            f"node{'s' * (nodes != 1)}) in {s.wall_s:.1f} s ({rate:.1f}/min)"
        )
        if s.lost:
            line += f"; {s.lost} workers lost and replaced, {s.resent} {what} sent again"
        return line
