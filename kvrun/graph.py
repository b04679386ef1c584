"""Decode steps captured in a CUDA graph: one replay launches a whole token's forward pass.

A small model is launch-bound on a GPU: a decode step is hundreds of tiny kernels, each paying
CPU-side launch latency. Captured once, the step replays with one launch. That needs static
shapes and no host syncs inside the step, so the KV manager decodes in its static form
(`kv.make_static`: buffers preallocated to a capacity, new K and V written at a position
*tensor*, attention bounded by a length *tensor*), and the token and position are copied into
fixed input tensors before each replay. Managers without a static form decode eagerly.

`capture=False` runs the same static step without a graph: that is how CPU tests check it.
"""

from __future__ import annotations

import torch

ROUND = 256  # capacities are multiples of this, so nearby lengths share one capture


def static_unsupported(kv) -> str | None:
    """Why `kv` cannot decode in a graph, or None when it can. Static steps attend over every
    slot up to a length, so a sliding window that masks by position rules them out for all."""
    if kv.config.sliding_window:
        return "a sliding-window model masks by position"
    return kv.static_unsupported()


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
        self.kv.make_static(max(capacity, min(-(-capacity // ROUND) * ROUND, self.limit)))

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def _forward(self) -> torch.Tensor:
        return self.model(self.tok, self.pos, self.kv)[0, -1]

    def _capture(self) -> None:
        """Warm up on a side stream (Triton compiles, cuBLAS picks kernels), then capture.

        The warm-up and capture runs write K and V at the current position, which the real
        replay overwrites before any layer reads it, and they touch no Python-side state.
        """
        self.graph = self.logits = None
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self._forward()
        self.graph = graph
        self.key = self.kv.static_buffers()

    def ready(self, position: int) -> None:
        """Room for a token at `position`, and a graph captured over the current buffers
        (when the next step can be static at all)."""
        if position >= self.capacity:
            self.reserve(2 * position + 1)
        else:  # a prefill since the last step may have used the room the manager reserved
            self.kv.make_static(self.capacity)
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
            self.kv.static = False
            try:
                return self._forward()
            finally:
                self.kv.static = True
        if self.capture:
            self.graph.replay()
            out = self.logits.clone()
        else:
            out = self._forward()
        self.kv.after_static_step()
        return out
