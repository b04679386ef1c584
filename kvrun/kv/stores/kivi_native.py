"""KiviLayer's attention on the native CPU kernels (kernels/cpu/kivi_ops.h). A decode row, or a
few query rows, attends over the packed body and the dense tail in one call (`kivi_attn`: the
codes decoded inside the dot products, both segments merged exactly). A prefill chunk's many
rows go to attn_colsum (kvrun.kv.attention.native_attention; torch's CPU flash attention where
that does not apply), which multiplies them in tiles: over the body dequantized a bounded range
at a time, the tail's older tokens, and the chunk's own (causal)."""

from __future__ import annotations

import torch

from ..attention import Partial, native_attention

# query rows per KV head from which flash attention over dequantized ranges is the faster
# (bench/kivi_attention.py measures both sides)
FLASH_ROWS = 48
BODY_RANGE = 2048  # body tokens dequantized at once for a prefill chunk: O(range) scratch


def partials(kernels, layer, q: torch.Tensor, n_new: int) -> list[Partial]:
    """KiviLayer.partials on the native kernels: q (1, Hq, Tq, D) float32, n_new 0 or Tq."""
    Tq, D = q.shape[2], q.shape[3]
    own0 = layer.length - n_new  # first own slot
    rows = q.shape[1] // layer.H * Tq
    if rows >= FLASH_ROWS and layer.body_len <= own0:  # own tokens (if any) all in the tail
        return _flash(kernels, layer, q, n_new)
    kc, ks, kz, vc, vs, vz, tk, tv = layer.rooms()
    out, lse = kernels.kivi_attn(
        q,
        kc,
        ks,
        kz,
        vc,
        vs,
        vz,
        layer.body_len,
        tk,
        tv,
        layer.tail_len,
        layer.bits,
        layer.G,
        n_new,
        D**-0.5,
    )  # fmt: skip  (1, Hq, Tq, D), (1, Hq, Tq)
    return [Partial(out, lse)]


def _flash(kernels, layer, q: torch.Tensor, n_new: int) -> list[Partial]:
    """Many query rows: flash attention over the body a range at a time, the tail's older
    tokens, then the queries' own tokens (causal), one partial each."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    _, Hq, Tq, D = q.shape
    H = layer.H
    q = q.contiguous()
    qg = q.view(1, H, Hq // H * Tq, D)  # every body and older key is seen by every row

    def grouped(k: torch.Tensor, v: torch.Tensor) -> Partial:
        part = native_attention(kernels, q, k, v, causal=False)  # every key seen
        if part is not None:
            return part
        out, lse = flash(qg, k, v)  # (1, Hkv, g*Tq, D), (1, Hkv, g*Tq)
        return Partial(out.view(1, Hq, Tq, D), lse.reshape(1, Hq, Tq))

    parts = []
    body = layer.rooms()[:6]
    for t0 in range(0, layer.body_len, BODY_RANGE):
        t1 = min(t0 + BODY_RANGE, layer.body_len)
        k, v = kernels.kivi_dequant(*body, layer.bits, layer.G, t0, t1)  # (1, Hkv, n, D)
        parts.append(grouped(k, v))
    tk, tv = (x.float() for x in layer.tail())  # (Hkv, Tt, D); an f16 tail's < R + Tq rows
    older = layer.tail_len - n_new
    if older:
        parts.append(grouped(tk[None, :, :older], tv[None, :, :older]))
    own = native_attention(kernels, q, tk[None, :, older:], tv[None, :, older:]) if n_new else None
    if own is not None:  # the chunk's own tokens, causal by slot
        parts.append(own)
    elif n_new:  # the chunk's own tokens, causal: each query head its own K/V rows
        g = Hq // H
        k = tk[:, older:].repeat_interleave(g, 0)[None]  # (1, Hq, Tq, D)
        v = tv[:, older:].repeat_interleave(g, 0)[None]
        out, lse = flash(q, k, v, is_causal=True)
        parts.append(Partial(out, lse))
    if not parts:  # nothing held: an empty segment
        parts.append(Partial(q.new_zeros(q.shape), q.new_full(q.shape[:3], float("-inf"))))
    return parts
