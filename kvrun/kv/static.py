"""The static decode form of the composed manager (CompressedKV), for CUDA graphs.

Methods whose decode steps only append (no eviction at steps) decode statically: the new
token goes to slot position + (end - seen) of its layer's decode segment (the KIVI tail,
MiniKV's held turns, or the dense store), a Python constant between compressions, and the
segment is attended up to that slot as a device tensor (the StaticSegment protocol,
kvrun/kv/protocol.py). A KIVI body keeps its length until the next flush, which changes the
captured step's key, so the graph is recaptured once per residual of R steps. The runner
(kvrun/graph.py) owns the graph and calls these through the KVManager contract.
"""

from __future__ import annotations

import torch

from .attention import combine
from .protocol import StaticSegment


class StaticDecode:
    """Mixin of CompressedKV: its layers (`layers`, each with dense / kivi / held), `seen`,
    `rope`, `dtype`, `decode_time`, `prompt_only` and `kivi_cfg` are the manager's."""

    _cap = 0

    def static_unsupported(self) -> str | None:
        if self.decode_time:
            return f"{self.name} evicts at every decode step"
        st = self.layers[0]
        if (
            st.kivi is None
            and st.held is None
            and (st.dense.pos is not None or st.dense.acc is not None)
        ):
            return f"{self.name} keeps positions or scores per slot"
        return None

    def _decode_seg(self, st) -> StaticSegment:
        """The segment a decode token of this layer goes to: KIVI store or a DenseSeg."""
        if st.kivi is not None:
            return st.kivi
        return st.held if st.held is not None else st.dense

    @property
    def capacity(self) -> int:
        return self._cap

    def make_static(self, capacity: int) -> None:
        self._cap = max(self._cap, capacity)
        for st in self.layers:
            self._decode_seg(st).room(self._cap - self.seen)  # positions up to cap - 1
        self.rope.reserve(self._cap)
        self.static = True

    def static_buffers(self) -> tuple:
        segs = (self._decode_seg(st) for st in self.layers)
        return (self._cap, *(seg.static_key() + (seg.end - self.seen,) for seg in segs))

    def static_step_ok(self) -> bool:
        """MiniKV flushes a full residual before it attends (Alg. 1): that step runs eagerly."""
        if not self.prompt_only or self.kivi_cfg is None:
            return True
        r = self.kivi_cfg["residual"]
        return all(st.kivi.tail_len + 1 < r for st in self.layers)

    def after_static_step(self) -> None:
        for st in self.layers:  # the step wrote its token at the segment's end
            self._decode_seg(st).advance()

    def decode_static(self, layer, q, k, v, positions) -> torch.Tensor:
        """KVCache's static step (q, k rotated by the driver within the capacity)."""
        seg = self._decode_seg(self.layers[layer])
        slot = positions + (seg.end - self.seen)  # (1,) this token's slot in the segment
        return combine(seg.attend_static(q, k, v, slot), self.dtype)
