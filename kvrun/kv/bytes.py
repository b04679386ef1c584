"""The byte formulas of the methods' specs, from what a cache holds (token, slot, entry and row
counts), never its tensors: tests/test_kv_contract.py holds each cache's nbytes() to its method's
formula. `e` is the KV element size in bytes. Torch-free: the registry imports it."""

from __future__ import annotations

from fractions import Fraction


def elem(kv) -> int:
    """e: bytes per stored K or V element in the manager's dtype."""
    return kv.dtype.itemsize


def dense(c, tokens: int, e: int) -> int:
    """K and V of `tokens` tokens of one layer: 2 * Hkv * T * D * e."""
    return 2 * c.n_kv_heads * tokens * c.head_dim * e


def kivi(
    c, e: int, layout: dict, tq: int, tr: int, s: int | None = None, t: int | None = None
) -> int:
    """One layer's KIVI store (KIVI §3): Hkv * D * (Tq * (b/4 + 4s/G) + 2t * Tr), Tq quantized
    tokens (whole groups of G) with s-byte scales and zeros, Tr in the dense tail of t-byte
    elements: both the KV dtype's (2 under f16, the CPU's default; e, the model's, where s is
    not given), the tail s where t is not (CUDA keeps it in the model's f16 / bf16)."""
    b, g = layout["bits"], layout["group"]
    s = e if s is None else s
    t = s if t is None else t
    n = c.n_kv_heads * c.head_dim * (tq * (Fraction(b, 4) + Fraction(4 * s, g)) + 2 * t * tr)
    if n.denominator != 1:
        raise ValueError(f"KIVI body of {tq} tokens is not whole groups of {g}")
    return int(n)


def kivi_of(c, e: int, layout: dict, store) -> int:
    """`kivi` for a KiviLayer's current body and tail, their element sizes as held."""
    s, t = store.scale_dtype.itemsize, store.tail_dtype.itemsize
    return kivi(c, e, layout, store.body_len, store.tail_len, s, t)


def dense_slot(kv) -> int:
    """One dense slot's K and V in --kv-dtype's type: 2 * Hkv * row bytes (2 * Hkv * D * e in
    the model's dtype; q8_0: 34 bytes per 32 values)."""
    c = kv.config
    return (
        2 * c.n_kv_heads * kv.kv_type.row_bytes(c.head_dim) if kv.kv_type else dense(c, 1, elem(kv))
    )


def composed(kv, per_slot: int = 0) -> int:
    """A driver-run method's formula: per layer, dense slots at 2 * Hkv * D * e plus `per_slot`
    bytes (positions, scores), and a KIVI store by `kivi`."""
    c, e = kv.config, elem(kv)
    slot = dense_slot(kv)
    total = 0
    for st in kv.layers:
        total += st.dense.length * (slot + per_slot)
        if st.kivi is not None:
            total += kivi_of(c, e, kv.kivi_layout, st.kivi)
    return total
