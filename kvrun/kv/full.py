"""The full (uncompressed) KV cache: every token's K and V, post-RoPE, in the compute dtype."""

from __future__ import annotations

import torch

from ..kernels import use_triton
from ..kernels.dense_decode import dense_decode
from .attention import dense_attention, sdpa
from .cache import KVCache


class FullKV(KVCache):
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

    def decode_static(self, layer, q, k, v, positions):
        """One decode token with no host sync: write at `positions`, attend up to it.
        The caller keeps positions below the capacity (Session checks the context)."""
        self.k[layer].index_copy_(2, positions, k)
        self.v[layer].index_copy_(2, positions, v)
        lengths = (positions[-1:] + 1).to(torch.int32)  # (B=1,) keys 0..pos
        out, _ = dense_decode(q, self.k[layer], self.v[layer], lengths, causal_offset=None)
        return out.to(self.dtype)

    # ------------------------------------------------------------------------ attend
    def _write(self, layer, k, v) -> int:
        """Store the step's K, V after the tokens seen; the new end."""
        start, end = self.seen, self.seen + k.shape[2]
        if end > self.k.shape[3]:
            self._alloc(max(end, 2 * self.k.shape[3]))
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return end

    def _over_cache(self, layer, q, end: int, positions):
        """Attention over keys 0..end-1 of the layer, masked by position (causal, window)."""
        k_pos = torch.arange(end, device=positions.device)
        return dense_attention(q, self.k[layer, :, :, :end], self.v[layer, :, :, :end], positions,
                               k_pos, self.config.sliding_window)  # fmt: skip

    def prefill(self, layer, q, k, v, positions):
        return self._over_cache(layer, q, self._write(layer, k, v), positions)

    def decode(self, layer, q, k, v, positions):
        end = self._write(layer, k, v)
        if k.shape[2] == 1 and not self.config.sliding_window:  # the token sees every key
            ks, vs = self.k[layer, :, :, :end], self.v[layer, :, :, :end]
            if use_triton(q):  # GQA-native split-K: SDPA has no fast path for one query
                return dense_decode(q, ks, vs)[0].to(self.dtype)
            return sdpa(q, ks, vs)
        return self._over_cache(layer, q, end, positions)

    def nbytes(self) -> int:
        c = self.config
        return 2 * c.n_layers * c.n_kv_heads * self.seen * c.head_dim * self.k.element_size()
