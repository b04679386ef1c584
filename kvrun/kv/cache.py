"""KVCache: the one driver every method's cache runs under.

The model calls `attend` and the sequence points of the contract (kvrun/kv/base.py); the
driver applies RoPE once, routes the step to the method's `prefill` or `decode` path (or
`decode_static`, the CUDA-graph form, with RoPE bounded by the static capacity) and calls
the method's compression hooks at each point:

    end_chunk(n)   -> at_chunk(n)    after the base bookkeeping (tokens seen include the chunk)
    end_prefill()  -> at_prefill()   while the turn is still the prefill, then the phase ends
    end_step()     -> at_step()      after the base bookkeeping

A method's cache (FullKV, CompressedKV and XKV, MiniCacheKV, SpindleKV) supplies those parts
and its stores; it never re-derives the phase inside a step and never applies RoPE to the
step's queries itself. A store that keeps keys before RoPE (SpindleKV's codebooks, which
rotate at each slot's own position) declares `keys_pre_rope` and gets the keys unrotated.
"""

from __future__ import annotations

import torch

from .base import KVManager


class KVCache(KVManager):
    """The driver: RoPE once, prefill / decode routing, compression hooks."""

    keys_pre_rope = False  # True: `prefill`/`decode` receive k before RoPE

    def attend(self, layer, q, k, v, positions):
        if self.static and not self.in_prefill and k.shape[2] == 1:
            cap = self.capacity  # no host sync: RoPE tables bounded by the static room
            qr = self.rope.apply(q, positions, bound=cap)
            kr = k if self.keys_pre_rope else self.rope.apply(k, positions, bound=cap)
            return self.decode_static(layer, qr, kr, v, positions)
        qr = self.rope.apply(q, positions)
        kr = k if self.keys_pre_rope else self.rope.apply(k, positions)
        if self.in_prefill:
            return self.prefill(layer, qr, kr, v, positions)
        return self.decode(layer, qr, kr, v, positions)

    # --- the method's paths (q, k post-RoPE unless keys_pre_rope; (1, H, T, D)) -----------
    def prefill(self, layer: int, q, k, v, positions: torch.Tensor) -> torch.Tensor:
        """A prefill chunk of T tokens: store as the method says, attend causally."""
        raise NotImplementedError

    def decode(self, layer: int, q, k, v, positions: torch.Tensor) -> torch.Tensor:
        """A decode step (T new tokens, usually 1) in eager form."""
        raise NotImplementedError

    def decode_static(self, layer: int, q, k, v, positions: torch.Tensor) -> torch.Tensor:
        """The static decode step (after make_static): no host sync, fixed shapes."""
        raise NotImplementedError

    def stores(self) -> list:
        """The per-layer stores the cache holds (kvrun/kv/protocol.py's Store), for tests and
        accounting."""
        return []

    # --- compression hooks --------------------------------------------------------------
    def at_chunk(self, n_tokens: int) -> None:
        """After every layer attended over a prefill chunk of n_tokens."""

    def at_prefill(self) -> None:
        """The prefill of a turn is complete (prefill-time selection, merging, coding)."""

    def at_step(self) -> None:
        """After every layer attended over one decode token (decode-time eviction, flushes)."""

    # --- the contract's sequence points, routed to the hooks -----------------------------
    def end_chunk(self, n_tokens: int) -> None:
        super().end_chunk(n_tokens)
        self.at_chunk(n_tokens)

    def end_prefill(self) -> None:
        self.at_prefill()
        super().end_prefill()

    def end_step(self) -> None:
        super().end_step()
        self.at_step()
