"""Decode steps captured in a CUDA graph: one replay launches a whole token's forward pass.

A small model is launch-bound on a GPU: a decode step is hundreds of tiny kernels, each paying
CPU-side launch latency. Captured once, the step replays with one launch. That needs static
shapes and no host syncs inside the step, so the KV manager decodes in its static form
(`kv.make_static`: buffers preallocated to a capacity, new K and V written at a position
*tensor*, attention bounded by a length *tensor*), and the token and position are copied into
fixed input tensors before each replay. Managers without a static form decode eagerly.

`capture=False` runs the same static step without a graph: that is how CPU tests check it.

A batch of sequences (the engine's `--parallel N`) decodes through `BatchGraph`: one step for
B sequences padded to a bucket size (1, 2, 4, 8, then multiples of 8, as nano-vllm buckets),
captured over its members' static buffers. Each sequence keeps its own store, so a captured
step is specific to its members: it is keyed by the bucket, the members in slot order and
their buffers, captured when the same members decode two steps in a row, and kept (the 16
most recently replayed). A full cache keeps its buffers from one document to the next, so a
slot's next document replays its predecessor's graph. Padding rows write and attend in a
small scratch cache of their own, at position 0, and are dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from contextlib import contextmanager

import torch

from .step import BatchKV

ROUND = 256  # capacities are multiples of this, so nearby lengths share one capture
KEEP = 16  # captured batch steps kept (least recently replayed dropped first)


def static_unsupported(kv) -> str | None:
    """Why `kv` cannot decode in a graph, or None when it can. Static steps attend over every
    slot up to a length, so a sliding window that masks by position rules them out for all."""
    if kv.config.any_window:
        return "a sliding-window model masks by position"
    return kv.static_unsupported()


def room(kv, need: int, limit: int) -> None:
    """Static form with room for positions below `need`, rounded up to ROUND within `limit`."""
    kv.make_static(max(need, min(-(-need // ROUND) * ROUND, limit)))


def make_ready(kv, position: int, limit: int) -> None:
    """Room for a static token at `position`: doubled when it is past the capacity, else the
    same (a prefill since the last step may have used the room the manager reserved)."""
    if position >= kv.capacity:
        room(kv, max(min(2 * position + 1, limit), position + 1), limit)
    else:
        kv.make_static(kv.capacity)


@contextmanager
def dynamic(kvs):
    """The managers decode in their eager (dynamic) form for one step."""
    flags = [kv.static for kv in kvs]
    for kv in kvs:
        kv.static = False
    try:
        yield
    finally:
        for kv, flag in zip(kvs, flags, strict=True):
            kv.static = flag


def capture_graph(forward, warmup: int):
    """(graph, output) of `forward` captured on CUDA after `warmup` runs on a side stream
    (Triton compiles, cuBLAS picks kernels). The warm-up and capture runs write K and V at the
    current positions, which the real replay overwrites before any layer reads them."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    return graph, out


def eager_rows(model, kvs, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """Logits (B, V) of one eager decode token per sequence (kvrun.run.step.BatchKV)."""
    dev = model.device
    tok = torch.tensor([[t] for t in tokens], device=dev)  # (B, 1)
    pos = torch.tensor([[p] for p in positions], device=dev)  # (B, 1)
    with dynamic(kvs):
        return model(tok, pos, BatchKV(kvs))[:, -1]


def bucket(n: int) -> int:
    """The batch size a step of n sequences is padded to."""
    return next((b for b in (1, 2, 4, 8) if n <= b), -(-n // 8) * 8)


class DecodeGraph:
    """One decode token of `model` over `kv` as a replayable step (see the module docstring)."""

    def __init__(self, model, kv, capacity: int, limit: int, capture: bool = True, warmup: int = 2):
        self.model, self.kv = model, kv
        self.limit = limit  # the context: capacities never go beyond it
        self.capture = capture
        self.warmup = warmup
        dev = model.device
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)  # (B=1, T=1) input
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # (T=1,) its position
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # (V,) output of the captured step
        self.key: tuple | None = None
        self.reserve(capacity)

    def reserve(self, capacity: int) -> None:
        """Make room for `capacity` tokens; the graph is recaptured when the buffers move."""
        room(self.kv, capacity, self.limit)

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def _forward(self) -> torch.Tensor:
        return self.model(self.tok, self.pos, self.kv)[0, -1]

    def _capture(self) -> None:
        self.graph = self.logits = None
        self.graph, self.logits = capture_graph(self._forward, self.warmup)
        self.key = self.kv.static_buffers()

    def ready(self, position: int) -> None:
        """Room for a token at `position`, and a graph captured over the current buffers
        (when the next step can be static at all)."""
        make_ready(self.kv, position, self.limit)
        stale = self.graph is None or self.key != self.kv.static_buffers()
        if self.capture and stale and self.kv.static_step_ok():
            self.pos.fill_(position)
            self._capture()
            self.warmup = 1  # recaptures (after a KIVI flush) need no compile warm-up

    def step(self, token: int, position: int) -> torch.Tensor:
        """Logits (V,) after feeding `token` at `position` (the caller then calls end_step)."""
        self.ready(position)
        self.tok.fill_(token)
        self.pos.fill_(position)
        if not self.kv.static_step_ok():  # e.g. MiniKV flushing before it attends: eager
            with dynamic([self.kv]):
                return self._forward()
        if self.capture:
            self.graph.replay()
            out = self.logits.clone()
        else:
            out = self._forward()
        self.kv.after_static_step()
        return out


class BatchGraph:
    """Decode steps of a batch of sequences as replayable steps (see the module docstring):
    one per bucket and members, captured on the members' second step in a row and replayed
    while they and their buffers stay. A step with a member that cannot be static (or is
    flushing before it attends) runs eagerly."""

    def __init__(self, model, limit: int, capture: bool = True):
        self.model, self.limit, self.capture = model, limit, capture
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()  # key -> (graph, logits)
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> tok, pos
        self.pad = None  # the padding rows' scratch cache, made on first use
        self.last: tuple | None = None  # the previous static step's key
        self.captures = 0  # graphs captured (a figure for the stats)
        self.static_steps = 0
        self.eager_steps = 0

    def reserve(self, kv, need: int) -> None:
        """Room for positions below `need` in kv (the engine calls it once a prefill ends, with
        the tokens the sequence may still generate), so the buffers need not grow mid-run."""
        if static_unsupported(kv) is None:
            room(kv, min(need, self.limit), self.limit)

    def step(self, kvs: Sequence, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Logits (B, V) after feeding tokens[b] at positions[b] to kvs[b] (the caller then
        calls each manager's end_step)."""
        static = self._static(kvs, tokens, positions)
        if static is None:
            self.eager_steps += 1
            return eager_rows(self.model, kvs, tokens, positions)
        rows, forward = static
        n = len(kvs)
        out = self._graph(rows, forward)[:n].clone() if self.capture else forward()[:n]
        for kv in kvs:
            kv.after_static_step()
        self.static_steps += 1
        return out

    def prepare(self, kvs: Sequence, tokens: Sequence[int], positions: Sequence[int]) -> None:
        """Capture the step these arguments would run, without running it (callers that time
        decode steps, as kvrun bench does, leave the capture out)."""
        static = self._static(kvs, tokens, positions)
        if static is not None and self.capture:
            self._graph(*static, replay=False)

    def _static(self, kvs, tokens, positions):
        """(rows, forward) of the static step, its inputs filled and its rows padded to the
        bucket; None when a member needs an eager step (no static form, or a MiniKV flush)."""
        if any(static_unsupported(kv) for kv in kvs):
            return None
        for kv, p in zip(kvs, positions, strict=True):
            make_ready(kv, p, self.limit)
        if not all(kv.static_step_ok() for kv in kvs):
            return None
        n, b = len(kvs), bucket(len(kvs))
        rows = [*kvs, *[self._pad()] * (b - n)]
        tok, pos = self._inputs(b)
        tok.copy_(torch.tensor([[t] for t in tokens] + [[0]] * (b - n)))
        pos.copy_(torch.tensor([[p] for p in positions] + [[0]] * (b - n)))

        def forward() -> torch.Tensor:
            return self.model(tok, pos, BatchKV(rows))[:, -1]

        return rows, forward

    def _graph(self, rows, forward, replay: bool = True) -> torch.Tensor:
        """The step's output, replayed from the graph captured over these rows' buffers. A
        member set is captured on its second step in a row (or by `prepare`): under
        continuous batching a set that lasts one step (a sequence joining as another leaves)
        would cost a capture for one replay, so its first step runs uncaptured."""
        key = (self.model.rope.static_key(), *(kv.static_buffers() for kv in rows))
        hit = self.graphs.pop(key, None)
        last, self.last = self.last, key
        if hit is None and replay and key != last:
            return forward()
        if hit is None:
            hit = capture_graph(forward, warmup=2 if not self.captures else 1)
            self.captures += 1
            while len(self.graphs) >= KEEP:
                self.graphs.popitem(last=False)
        self.graphs[key] = hit  # most recently used last
        graph, logits = hit
        if replay:
            graph.replay()
        return logits

    def _inputs(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        if b not in self.inputs:
            z = torch.zeros(b, 1, dtype=torch.long, device=self.model.device)
            self.inputs[b] = (z, z.clone())  # (B, T=1) tokens and positions
        return self.inputs[b]

    def _pad(self):
        """A full cache at position 0 that every padding row writes to and attends over."""
        if self.pad is None:
            from ..kv import FULL, build

            m = self.model
            self.pad = build(FULL, m.config, m.rope, m.device, m.dtype)
            self.pad.make_static(1)
        return self.pad
