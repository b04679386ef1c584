"""The per-layer store protocol: what a method's cache asks of the stores that hold its tokens.

A store holds one layer's kept K and V of one sequence, in its own representation, and
attends in that representation:

- DenseSeg (kvrun.kv.dense): post-RoPE K and V in the KV dtype, with optional positions
  and accumulated scores (full, StreamingLLM, H2O, SnapKV, PyramidKV, XKV, MiniKV's staging);
- KiviLayer (kvrun.kv.kivi): a 2/4-bit quantized body and a dense residual tail (KIVI,
  MiniKV, and the store of any `+kivi` stack);
- CodedLayer (kvrun.kv.coded): SpindleKV's codebook indices and magnitudes over pre-RoPE
  vectors, rotated at each slot's own position inside the attention;
- PairLayer (kvrun.kv.merged): one layer's view of a MiniCache pair, the merged directions,
  magnitudes and retained rows that both layers of the pair share, restored inside the
  attention.

Every store answers `partials`: the attention of post-RoPE queries as log-sum-exp partials
(kvrun.kv.attention.Partial), so a cache merges the segments it holds exactly with
`combine`, and `nbytes`: every byte it holds. Stores whose decode step can run with no host
sync (a CUDA graph replays it) also follow StaticSegment.

Batches: a store belongs to one sequence. A batch of sequences is a batch of caches
(kvrun.kv.batch.BatchKV routes each row of a step to its own cache), so each sequence keeps
its own length, selections and bytes.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .attention import Partial


@runtime_checkable
class Store(Protocol):
    """One layer's stored K and V of one sequence."""

    @property
    def length(self) -> int:
        """Slots held (tokens, or merged tokens for a pair)."""
        ...

    def partials(
        self, q: torch.Tensor, q_pos: torch.Tensor, n_new: int, window: int | None
    ) -> list[Partial]:
        """Attention of q (1, Hq, Tq, D), post-RoPE, at positions q_pos (Tq,) over the stored
        slots, the last n_new of which are the queries' own tokens (causal among themselves);
        window: the model's sliding window, or None. One Partial per segment the store keeps."""
        ...

    def nbytes(self) -> int:
        """Every byte the store holds: slots, positions, scores, codebooks, staging."""
        ...


@runtime_checkable
class StaticSegment(Store, Protocol):
    """A store whose decode step runs with no host sync, so the step can be captured in a CUDA
    graph (kvrun/graph.py): DenseSeg and KiviLayer (its dense tail behind the quantized body).
    CompressedKV's static step (kvrun.kv.static) drives either through this alone."""

    @property
    def end(self) -> int:
        """The slot the next decode token goes to (a Python int, constant within a step)."""
        ...

    def room(self, n_more: int) -> None:
        """Make room for n_more static steps (buffers never move while a graph replays)."""
        ...

    def attend_static(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor
    ) -> list[Partial]:
        """Write k, v (1, Hkv, 1, D) at `slot` (a (1,) device tensor inside the room) and
        attend q (1, Hq, 1, D) over every slot up to it: partials merged by log-sum-exp."""
        ...

    def advance(self) -> None:
        """The Python side of the write: one more slot occupied."""
        ...

    def static_key(self) -> tuple:
        """What a captured step depends on (buffer addresses, lengths fixed between flushes)."""
        ...
