"""The full (uncompressed) KV cache: every token's K and V, post-RoPE, in the compute dtype."""

from __future__ import annotations

import torch

from ..kernels import use_triton
from ..kernels.dense_decode import dense_decode
from .attention import dense_attention, sdpa
from .base import KVManager


class FullKV(KVManager):
    """Keeps everything; the reference every compressed method is measured against.

    Decode steps have two forms. The dynamic one (the default) slices the cache to the tokens
    seen, with Python integers. The static one (`make_static(capacity)`, for CUDA graphs) never
    reads a number back from the device: the buffers stay at `capacity` tokens, the new K and V
    are written at the position tensor, and attention reads the whole buffer with the length
    as a device tensor, so one captured step replays at every position.
    """

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
            n = min(self.k.shape[3], capacity)
            k[..., :n, :] = self.k[..., :n, :]
            v[..., :n, :] = self.v[..., :n, :]
        self.k, self.v = k, v

    # ---------------------------------------------------------------- static decode
    def static_unsupported(self) -> str | None:
        return None

    @property
    def capacity(self) -> int:
        """Tokens the buffers hold room for."""
        return self.k.shape[3]

    def make_static(self, capacity: int) -> None:
        """Decode with static shapes from now on, with room for at least `capacity` tokens
        (the buffers keep their size across sequences; a longer prefill still grows them)."""
        if capacity > self.capacity:
            self._alloc(capacity)
        self.rope.reserve(self.capacity)
        self.static = True

    def static_buffers(self) -> tuple[int, ...]:
        """What a captured step depends on: buffer addresses and size (recapture on change)."""
        return (self.k.data_ptr(), self.v.data_ptr(), self.capacity)

    def _attend_static(self, layer, q, k, v, positions):
        """One decode token with no host sync: write at `positions`, attend up to it.
        The caller keeps positions below the capacity (Session checks the context)."""
        cap = self.capacity
        self.k[layer].index_copy_(2, positions, self.rope.apply(k, positions, bound=cap))
        self.v[layer].index_copy_(2, positions, v)
        q = self.rope.apply(q, positions, bound=cap)
        lengths = (positions[-1:] + 1).to(torch.int32)  # (B=1,) keys 0..pos
        out, _ = dense_decode(q, self.k[layer], self.v[layer], lengths, causal_offset=None)
        return out.to(self.dtype)

    # ------------------------------------------------------------------------ attend
    def attend(self, layer, q, k, v, positions):
        if self.static and not self.in_prefill and k.shape[2] == 1:
            return self._attend_static(layer, q, k, v, positions)
        start, T = self.seen, k.shape[2]
        end = start + T
        if end > self.k.shape[3]:
            self._alloc(max(end, 2 * self.k.shape[3]))
        self.k[layer, :, :, start:end] = self.rope.apply(k, positions)
        self.v[layer, :, :, start:end] = v
        q = self.rope.apply(q, positions)
        window = self.config.sliding_window
        if not self.in_prefill and T == 1 and not window and use_triton(q):
            # GQA-native split-K kernel: SDPA has no fast path for one query over many keys
            out, _ = dense_decode(q, self.k[layer, :, :, :end], self.v[layer, :, :, :end])
            return out.to(self.dtype)
        if not self.in_prefill and T == 1 and not window:  # the newest token sees every key
            return sdpa(q, self.k[layer, :, :, :end], self.v[layer, :, :, :end])
        k_pos = torch.arange(end, device=positions.device)
        return dense_attention(
            q, self.k[layer, :, :, :end], self.v[layer, :, :, :end], positions, k_pos, window
        )

    def nbytes(self) -> int:
        c = self.config
        return 2 * c.n_layers * c.n_kv_heads * self.seen * c.head_dim * self.k.element_size()
