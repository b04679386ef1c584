"""The full (uncompressed) KV cache: every token's K and V, post-RoPE, in the compute dtype."""

from __future__ import annotations

import torch

from ..kernels import use_triton
from ..kernels.dense_decode import dense_decode
from .attention import dense_attention, sdpa
from .cache import KVCache
from .dense import DenseSeg


class FullKV(KVCache):
    """Keeps everything; the reference every compressed method is measured against.

    Each layer holds a DenseSeg (kvrun/kv/dense.py): slot = position, no positions or scores
    stored. Decode steps have two forms. The dynamic one (the default) slices the segment to
    the tokens seen, with Python integers. The static one (`make_static(capacity)`, for CUDA
    graphs) never reads a number back from the device: the buffers keep room for `capacity`
    tokens, the new K and V are written at the position tensor, and attention reads the whole
    buffer with the length as a device tensor, so one captured step replays at every position.
    The segments keep their room across sequences (`reset` rewinds them), so a captured graph
    stays valid from one document to the next.
    """

    name = "full"

    def __init__(self, config, rope, device, dtype):
        super().__init__(config, rope, device, dtype)
        c = config
        self.layers = [DenseSeg(c.n_kv_heads, c.head_dim, dtype, device) for _ in range(c.n_layers)]
        for seg in self.layers:
            seg.reserve(256)

    def reset(self) -> None:
        super().reset()
        for seg in self.layers:
            seg.rewind()

    def stores(self) -> list:
        return list(self.layers)

    # ---------------------------------------------------------------- static decode
    def static_unsupported(self) -> str | None:
        return None

    @property
    def capacity(self) -> int:
        """Tokens the buffers hold room for."""
        return self.layers[0].capacity

    def make_static(self, capacity: int) -> None:
        """Decode with static shapes from now on, with room for at least `capacity` tokens
        (the buffers keep their size across sequences; a longer prefill still grows them)."""
        for seg in self.layers:
            seg.reserve(capacity)
        self.rope.reserve(self.capacity)
        self.static = True

    def static_buffers(self) -> tuple[int, ...]:
        """What a captured step depends on: buffer addresses and size (recapture on change)."""
        return (self.capacity, *(x for seg in self.layers for x in seg.static_key()))

    def decode_static(self, layer, q, k, v, positions):
        """One decode token with no host sync: write at `positions`, attend up to it.
        The caller keeps positions below the capacity (Session checks the context)."""
        (part,) = self.layers[layer].attend_static(q, k, v, positions[-1:])
        return part.out.to(self.dtype)

    def after_static_step(self) -> None:
        for seg in self.layers:  # the step wrote its token at slot `seen`
            seg.advance()

    # ------------------------------------------------------------------------ attend
    def _over_cache(self, seg: DenseSeg, q, positions):
        """Attention over every key of the layer, masked by position (causal, window)."""
        k_pos = torch.arange(seg.length, device=positions.device)
        return dense_attention(q, seg.k, seg.v, positions, k_pos, self.config.sliding_window)

    def prefill(self, layer, q, k, v, positions):
        seg = self.layers[layer]
        seg.append(k, v, positions)
        return self._over_cache(seg, q, positions)

    def decode(self, layer, q, k, v, positions):
        seg = self.layers[layer]
        seg.append(k, v, positions)
        if k.shape[2] == 1 and not self.config.sliding_window:  # the token sees every key
            if use_triton(q):  # GQA-native split-K: SDPA has no fast path for one query
                return dense_decode(q, seg.k, seg.v)[0].to(self.dtype)
            return sdpa(q, seg.k, seg.v)
        return self._over_cache(seg, q, positions)

    def nbytes(self) -> int:
        return sum(seg.nbytes() for seg in self.layers)
