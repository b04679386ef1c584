"""A batch of independent sequences through one forward pass, a KV manager per sequence: the
linear layers run once over every row, attention per sequence, so B sequences give what B single
runs give (up to float reordering; tests/test_kv_contract.py). Not B > 1 inside a store: sequences
differ in length, in what they kept and when they compress, and several methods are ragged per
KV head; padding would need masks everywhere for no gain on the CPU."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kv.protocol import KVManager


class BatchKV:
    """The model's call (`attend`) for one decode step of B sequences, each with its own cache;
    the sequence points go to each cache (Session.decode_batch)."""

    def __init__(self, kvs: Sequence):
        if not kvs:
            raise ValueError("a batch needs at least one sequence")
        self.kvs = list(kvs)
        self._flat = None  # (positions, flattened, rows) of the current forward pass

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # (B, Hq, T, D) pre-RoPE
        k: torch.Tensor,  # (B, Hkv, T, D)
        v: torch.Tensor,  # (B, Hkv, T, D)
        positions: torch.Tensor,  # (B, T) each sequence's positions, or (T,) shared
    ) -> torch.Tensor:  # (B, Hq, T, D)
        if q.shape[0] != len(self.kvs):
            raise ValueError(f"batch of {q.shape[0]} rows for {len(self.kvs)} sequences")
        if positions.dim() == 2 and self._decoding():
            return self._decode(layer, q, k, v, positions)
        outs = []
        for b, kv in enumerate(self.kvs):
            pos = positions[b] if positions.dim() == 2 else positions
            s = slice(b, b + 1)
            outs.append(kv.attend(layer, q[s], k[s], v[s], pos))
        return torch.cat(outs, dim=0)

    def _decoding(self) -> bool:
        """Every sequence is a KVManager in an eager decode step (RoPE can be batched)."""
        return all(
            isinstance(kv, KVManager) and not kv.in_prefill and not kv.static for kv in self.kvs
        )

    def _decode(self, layer, q, k, v, positions) -> torch.Tensor:
        """A decode step of every sequence, RoPE applied once for the whole batch (or, where
        every cache takes its row in one native call, `plain_decode`, there)."""
        if self._flat is None or self._flat[0] is not positions:  # once per forward pass
            flat = positions.reshape(-1)
            self._flat = (positions, flat, list(positions), flat.tolist())
        rope, flat, rows, ints = self.kvs[0].rope.at(layer), *self._flat[1:]
        if rope.kernels is not None and all(hasattr(kv, "plain_decode") for kv in self.kvs):
            outs = [
                kv.plain_decode(layer, q[b : b + 1], k[b : b + 1], v[b : b + 1], rows[b], ints[b])
                for b, kv in enumerate(self.kvs)
            ]
            if all(o is not None for o in outs):
                return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
            if any(o is not None for o in outs):  # some rows went through: the rest as usual
                for b, kv in enumerate(self.kvs):
                    if outs[b] is None:
                        s = slice(b, b + 1)
                        qb, kb = rope.apply_rows(q[s], rows[b]), k[s]
                        kb = kb if kv.keys_pre_rope else rope.apply_rows(kb, rows[b])
                        outs[b] = kv.decode(layer, qb, kb, v[s], rows[b])
                return torch.cat(outs, dim=0)
        qr = rope.apply_rows(q, flat)
        kr = rope.apply_rows(k, flat) if not all(kv.keys_pre_rope for kv in self.kvs) else k
        outs = []
        for b, kv in enumerate(self.kvs):
            s = slice(b, b + 1)
            outs.append(kv.decode(layer, qr[s], k[s] if kv.keys_pre_rope else kr[s], v[s], rows[b]))
        return torch.cat(outs, dim=0)
