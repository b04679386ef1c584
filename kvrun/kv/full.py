"""The full (uncompressed) KV cache: every token's K and V, post-RoPE, in the compute dtype."""

from __future__ import annotations

import torch

from .attention import dense_attention
from .base import KVManager


class FullKV(KVManager):
    """Keeps everything; the reference every compressed method is measured against."""

    name = "full"

    def __init__(self, config, rope, device, dtype):
        super().__init__(config, rope, device, dtype)
        self._alloc(256)

    def _alloc(self, capacity: int) -> None:
        c = self.config
        shape = (c.n_layers, 1, c.n_kv_heads, capacity, c.head_dim)  # (L, B, Hkv, cap, D)
        k = torch.empty(shape, device=self.device, dtype=self.dtype)
        v = torch.empty(shape, device=self.device, dtype=self.dtype)
        if hasattr(self, "k"):
            k[..., : self.k.shape[3], :] = self.k
            v[..., : self.v.shape[3], :] = self.v
        self.k, self.v = k, v

    def attend(self, layer, q, k, v, positions):
        start, T = self.seen, k.shape[2]
        end = start + T
        if end > self.k.shape[3]:
            self._alloc(max(end, 2 * self.k.shape[3]))
        self.k[layer, :, :, start:end] = self.rope.apply(k, positions)
        self.v[layer, :, :, start:end] = v
        q = self.rope.apply(q, positions)
        k_pos = torch.arange(end, device=positions.device)
        return dense_attention(
            q,
            self.k[layer, :, :, :end],
            self.v[layer, :, :, :end],
            positions,
            k_pos,
            self.config.sliding_window,
        )

    def nbytes(self) -> int:
        c = self.config
        return 2 * c.n_layers * c.n_kv_heads * self.seen * c.head_dim * self.k.element_size()
