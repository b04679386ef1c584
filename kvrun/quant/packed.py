"""Packed weights: group-wise 4- and 8-bit tensors, made from GGUF blocks or from floats.

One packed form for every source: `w[n, k] = codes[n, k] * scale[n, g] + zero[n, g]` with
g = k // group. 4-bit codes are unsigned (0..15) and two share a byte in llama.cpp's Q4_0
order (byte j of a group holds element j in its low nibble and element j + 16 in its
high nibble), so Q4_0 and Q4_1 blocks become codes without moving a nibble. 8-bit codes
are int8 and `zero` is None when the format is symmetric (Q8_0).

Exact mappings (the packed tensor dequantizes to what `gguf.quants.dequantize` gives):
Q4_0, Q4_1, Q4_K -> q4 (group 32) and Q8_0 -> q8 (group 32). Scales and zeros are kept
in float16 where the GGUF fields are float16 (Q4_0, Q4_1, Q8_0) and in float32 where they
are products of two fields (Q4_K: d x 6-bit scale needs 17 bits of mantissa). Every other
quantized type is dequantized (by `gguf`, a slab of rows at a time) and quantized again to
the nearest form (`nearest_bits`): not exact, and `Packed.exact` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .formats import DENSE_NAMES, GROUP, nearest_bits

DENSE_WTYPES = dict(zip(DENSE_NAMES, (torch.float32, torch.float16, torch.bfloat16), strict=True))


def dense_name(dtype: torch.dtype) -> str:
    """The --wtype that names dense weights in dtype ('f32', 'f16', 'bf16')."""
    return next(k for k, v in DENSE_WTYPES.items() if v == dtype)


@dataclass
class Packed:
    """A (N, K) weight as group-wise integer codes with a scale and a zero per group."""

    bits: int  # 4 | 8
    codes: torch.Tensor  # q4: (N, K // 2) uint8, two codes a byte; q8: (N, K) int8
    scale: torch.Tensor  # (N, K // group) float16 | float32
    zero: torch.Tensor | None  # (N, K // group) like scale; None: symmetric (zero = 0)
    group: int = GROUP
    source: str = ""  # the GGUF type or dtype it was made from
    exact: bool = True  # dequantizes to exactly the source's values

    @property
    def shape(self) -> tuple[int, int]:
        n, c = self.codes.shape
        return n, c * 2 if self.bits == 4 else c

    @property
    def nbytes(self) -> int:
        ts = [self.codes, self.scale] + ([self.zero] if self.zero is not None else [])
        return sum(t.numel() * t.element_size() for t in ts)

    def rows(self, idx: torch.Tensor | slice) -> Packed:
        """The rows idx (an index tensor or a slice) as a Packed of their own."""
        zero = None if self.zero is None else self.zero[idx]
        return Packed(
            self.bits, self.codes[idx], self.scale[idx], zero, self.group, self.source, self.exact
        )

    def to(self, device: torch.device) -> Packed:
        zero = None if self.zero is None else self.zero.to(device)
        return Packed(
            self.bits,
            self.codes.to(device),
            self.scale.to(device),
            zero,
            self.group,
            self.source,
            self.exact,
        )

    def int_codes(self) -> torch.Tensor:
        """Codes as one integer per element (N, K // group, group) in uint8 (q4) or int8 (q8)."""
        n = self.codes.shape[0]
        if self.bits == 8:
            return self.codes.view(n, -1, self.group)
        c = self.codes.view(n, -1, self.group // 2)  # (N, G, 16)
        return torch.cat([c & 15, c >> 4], dim=-1)  # (N, G, 32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense (N, K) weight in dtype (scale x code in float32, then the zero added)."""
        n, k = self.shape
        w = self.int_codes().to(torch.float32) * self.scale.float().unsqueeze(-1)
        if self.zero is not None:
            w += self.zero.float().unsqueeze(-1)
        return w.view(n, k).to(dtype)


def pack_nibbles(q: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """Codes 0..15 (N, K) -> (N, K // 2) uint8 in Q4_0's order within each group."""
    n, k = q.shape
    g = q.to(torch.uint8).view(n, k // group, 2, group // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)


# --------------------------------------------------------------- from float weights
def quantize(w: torch.Tensor, bits: int, group: int = GROUP) -> Packed:
    """Round-to-nearest group-wise quantization of a float (N, K) weight.

    q4: asymmetric (scale and zero from each group's min and max); q8: symmetric absmax, as
    Q8_0. Scales and zeros are rounded to float16 first and the codes computed against the
    rounded values, so the packed tensor dequantizes to the nearest point of its own grid.
    """
    n, k = w.shape
    if k % group:
        raise ValueError(f"{k} columns are not a multiple of the group size {group}")
    g = w.float().view(n, k // group, group)
    if bits == 8:
        scale = (g.abs().amax(-1) / 127).half()
        inv = torch.where(
            scale > 0, 1 / scale.float(), torch.zeros_like(scale, dtype=torch.float32)
        )
        codes = (g * inv.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
        return Packed(8, codes.view(n, k), scale, None, group, str(w.dtype).removeprefix("torch."))
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).half()
    zero = lo.half()
    s = scale.float().unsqueeze(-1)
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    codes = ((g - zero.float().unsqueeze(-1)) * inv).round().clamp(0, 15)
    src = str(w.dtype).removeprefix("torch.")
    return Packed(4, pack_nibbles(codes.view(n, k), group), scale, zero, group, src, exact=False)


def requantize_bits(p: Packed, bits: int) -> Packed:
    """A packed tensor in the other width: q4 -> q8 keeps the codes (exact); q8 -> q4 does not."""
    if p.bits == bits:
        return p
    if bits == 8:
        n, k = p.shape
        codes = p.int_codes().to(torch.int8).view(n, k)
        return Packed(8, codes, p.scale, p.zero, p.group, p.source, p.exact)
    out = quantize(p.dequantize(torch.float32), 4, p.group)
    out.source = p.source
    return out


# ------------------------------------------------------------------ from GGUF blocks
def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row (..., 2) uint8 -> (...,) float16 (little-endian, as GGUF stores)."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _q4_0(blocks: torch.Tensor) -> Packed:
    # block: d (f16), 16 bytes of nibbles; w = d * (q - 8)
    d = _f16(blocks[..., 0:2])  # (N, G)
    codes = blocks[..., 2:18].reshape(blocks.shape[0], -1)  # (N, K // 2)
    return Packed(4, codes, d, d * -8, source="Q4_0")  # -8d is exact in float16


def _q4_1(blocks: torch.Tensor) -> Packed:
    # block: d (f16), m (f16), 16 bytes of nibbles; w = d * q + m
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    codes = blocks[..., 4:20].reshape(blocks.shape[0], -1)
    return Packed(4, codes, d, m, source="Q4_1")


def _q8_0(blocks: torch.Tensor) -> Packed:
    # block: d (f16), 32 int8; w = d * q
    d = _f16(blocks[..., 0:2])
    codes = blocks[..., 2:34].reshape(blocks.shape[0], -1).view(torch.int8)
    return Packed(8, codes, d, None, source="Q8_0")


def _q4_k(blocks: torch.Tensor) -> Packed:
    # super-block of 256: d, dmin (f16), 12 bytes of 6-bit scales/mins for 8 sub-blocks of
    # 32, 128 bytes of nibbles (64 elements per 32 bytes: low nibbles then high nibbles);
    # w = d * sc[j] * q - dmin * mn[j] for sub-block j
    n, nb = blocks.shape[:2]
    d = _f16(blocks[..., 0:2]).float().unsqueeze(-1)  # (N, nb, 1)
    dmin = _f16(blocks[..., 2:4]).float().unsqueeze(-1)
    s = blocks[..., 4:16].to(torch.int32)  # (N, nb, 12)
    lo4, hi4, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo4 & 63, (md & 15) | ((lo4 >> 6) << 4)], -1)  # (N, nb, 8)
    mn = torch.cat([hi4 & 63, (md >> 4) | ((hi4 >> 6) << 4)], -1)
    qs = blocks[..., 16:144].reshape(n, nb, 4, 1, 32)  # 4 chunks of 64 elements
    sub = torch.cat([qs & 15, qs >> 4], dim=3)  # (N, nb, 4, 2, 32): sub-block 2i, 2i + 1
    sub = sub.view(n, nb * 8, 2, 16)  # each sub-block into its two Q4_0-order halves
    codes = (sub[:, :, 0] | (sub[:, :, 1] << 4)).reshape(n, -1)
    scale = (d * sc).view(n, -1)  # float32, exact (11 x 6 bits)
    zero = (-(dmin * mn)).view(n, -1)
    return Packed(4, codes, scale, zero, source="Q4_K")


_CONVERT = {"Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1), "Q8_0": (34, _q8_0), "Q4_K": (144, _q4_k)}
_BLOCK_ELEMS = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256}


def from_gguf(t, rows_per_slab: int = 4096) -> Packed:
    """A GGUF tensor (a gguf ReaderTensor) as Packed, read from the memory map slab by slab.

    Exact for Q4_0, Q4_1, Q4_K, Q8_0; any other quantized type is dequantized by `gguf` a
    slab of rows at a time and re-quantized to the nearest packed width (exact=False).
    """
    name = t.tensor_type.name
    data = np.asarray(t.data)  # memory map: (N, bytes per row) for block-quantized types
    n = data.shape[0]
    parts = []
    for r in range(0, n, rows_per_slab):
        slab = torch.from_numpy(np.array(data[r : r + rows_per_slab]))  # a copy of the slab only
        parts.append(_slab(name, slab, t))
    return cat_rows(parts)


def cat_rows(parts: list[Packed]) -> Packed:
    """Packed slabs of rows (same width, group and source) as one Packed."""
    if len(parts) == 1:
        return parts[0]
    p0 = parts[0]
    zero = None if p0.zero is None else torch.cat([p.zero for p in parts])
    codes = torch.cat([p.codes for p in parts])
    scale = torch.cat([p.scale for p in parts])
    return Packed(p0.bits, codes, scale, zero, p0.group, p0.source, p0.exact)


def quantize_rows(w: torch.Tensor, bits: int, rows_per_slab: int = 4096) -> Packed:
    """`quantize` a slab of rows at a time (float32 scratch bounded by the slab)."""
    parts = [quantize(w[r : r + rows_per_slab], bits) for r in range(0, w.shape[0], rows_per_slab)]
    return cat_rows(parts)


def _slab(name: str, slab: torch.Tensor, t) -> Packed:
    if name in _CONVERT:
        size, fn = _CONVERT[name]
        return fn(slab.view(slab.shape[0], -1, size))
    import gguf

    w = gguf.quants.dequantize(slab.numpy(), t.tensor_type)  # (rows, K) float32
    p = quantize(torch.from_numpy(np.ascontiguousarray(w)), nearest_bits(name))
    p.source, p.exact = name, False
    return p
