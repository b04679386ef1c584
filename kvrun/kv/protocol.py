"""The protocols KV stores implement (typing only; nothing here runs).

A `StaticSegment` is a per-layer store a decode step can write to and attend over with no
host sync, so the step can be captured in a CUDA graph (kvrun/graph.py): DenseSeg
(kvrun/kv/dense.py) and KiviLayer (kvrun/kv/kivi.py, the dense tail behind a quantized
body) implement it, and CompressedKV's static step drives either through it alone.
Every store keeps its tensors in kvrun.kv.buffer.Buffer and reports `nbytes` of occupied
slots only.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .attention import Partial


class StaticSegment(Protocol):
    @property
    def length(self) -> int:
        """Tokens held."""

    @property
    def end(self) -> int:
        """The slot the next decode token goes to (a Python int, constant within a step)."""

    def room(self, n_more: int) -> None:
        """Make room for n_more static steps now (a captured step cannot allocate)."""

    def attend_static(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor
    ) -> list[Partial]:
        """Write k, v (1, Hkv, 1, D) at `slot` (a (1,) device tensor inside the room) and
        attend q (1, Hq, 1, D) over every slot up to it: partials merged by log-sum-exp."""

    def advance(self) -> None:
        """The Python side of the step's write (after the step ran)."""

    def static_key(self) -> tuple:
        """What a captured step depends on (buffer addresses, lengths): recapture on change."""

    def nbytes(self) -> int:
        """Exact bytes held by the occupied slots."""
