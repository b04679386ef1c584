"""PyTorch's weight-only int4 ops as a packed matmul: their layouts, and q8 as two 4-bit planes.

The ops compute y = x @ W^T with W = (q - 8) * scale + zero' per group, q in 0..15, the
scales-and-zeros given as a (G, N, 2) tensor in the activations' dtype.

- CPU (`_weight_int4pack_mm_for_cpu`): vectorized for bfloat16 activations only; float32
  activations run a scalar loop (~100x slower at 512 rows, bench/README.md). So the CPU path
  casts the activations to bfloat16 and the product back to the compute dtype. Its layout is
  blocks of 64 rows: byte (b, k, i) holds row 64b + i in its low nibble and row 64b + i + 32
  in its high nibble (found by packing known codes; `unpack_cpu` inverts it and a test checks
  it against the op), so the codes can be read back exactly for dequantization and gathers.
- CUDA (`_weight_int4pack_mm`): bfloat16, q4 only, tensor-core tiles; never read back.

Not exact: the products see bfloat16 activations and bfloat16 scales and zeros (Q4_1's fp16
scales lose 3 mantissa bits), about 3e-3 relative on a product. Callers that need the exact
product dequantize instead (kvrun/packed.py does for more than a few rows on CPU).

q8 on CPU: a code c in -128..127 is 16 * hi + lo - 128 with hi, lo in 0..15, so
W = (hi - 8) * 16s + [(lo - 8) * s + 8s]: two int4 products with the same activations
(the second plane's zero' is 8s; the first's is 0). Bytes: one byte a weight plus 8 bytes of
bfloat16 scales and zeros per group of 32, against Q8_0's 34 per 32.
"""

from __future__ import annotations

import torch

from .quant import Packed

BLOCK_N = 64  # rows per block in the CPU layout


def cpu_supported(n: int, k: int, group: int) -> bool:
    """Shapes the CPU op and `unpack_cpu` take: whole 64-row blocks, whole groups."""
    return n % BLOCK_N == 0 and k % group == 0 and group in (32, 64, 128, 256)


def cuda_supported(n: int, k: int, group: int, dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and k % 1024 == 0 and n % 8 == 0 and group in (32, 64, 128, 256)


def scales_zeros(
    scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """(N, G) scale and zero (None: 0) -> the ops' (G, N, 2) in dtype: zero' = zero + 8 scale."""
    s = scale.float()
    z = zero.float() if zero is not None else torch.zeros_like(s)
    return torch.stack([s, z + 8 * s], dim=-1).transpose(0, 1).contiguous().to(dtype)


def pack_cpu(q: torch.Tensor) -> torch.Tensor:
    """Codes (N, K) in 0..15 -> (N, K // 2) uint8 in the CPU op's layout, built with byte ops
    (N a multiple of BLOCK_N). PyTorch's own conversion
    (`_convert_weight_to_int4pack_for_cpu`) takes int32 codes, 4 bytes a weight; loading an
    8B Q4 model spent ~20 s there (tests check both give the same bytes)."""
    n, k = q.shape
    b = q.to(torch.uint8).view(n // BLOCK_N, 2, BLOCK_N // 2, k)  # rows 64b + 32h + i
    return (b[:, 0] | (b[:, 1] << 4)).transpose(1, 2).reshape(n, k // 2)


def pack_cpu_nibbles(codes: torch.Tensor, group: int) -> torch.Tensor:
    """`pack_cpu` of a q4 Packed's canonical bytes (N, K // 2), without unpacking them: byte j
    of a group holds element j (low nibble) and j + group / 2 (high), so the low nibbles of
    rows 64b + i and 64b + 32 + i make one byte of the op's layout, and their high nibbles
    another (the byte ops below; 2-3x faster than unpacking to codes first)."""
    n, half = codes.shape
    c = codes.view(n // BLOCK_N, 2, BLOCK_N // 2, half // (group // 2), group // 2)
    lo, hi = c[:, 0], c[:, 1]  # (blocks, 32, G, group / 2): rows 64b + i and 64b + 32 + i
    both = torch.stack([(lo & 15) | (hi << 4), (lo >> 4) | (hi & 0xF0)], dim=3)
    return both.permute(0, 2, 3, 4, 1).reshape(n, half)  # (blocks, K, 32)


def pack_cuda(q: torch.Tensor) -> torch.Tensor:
    u8 = ((q[:, ::2].to(torch.int32) << 4) | q[:, 1::2].to(torch.int32)).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(u8, 8)


def unpack_cpu(w: torch.Tensor, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
    """Codes (R, K) uint8 of the rows asked (a slice of whole blocks, an index tensor, or all)
    from a CPU-layout (N, K // 2) tensor."""
    n, k = w.shape[0], w.shape[1] * 2
    b = w.view(n // BLOCK_N, k, BLOCK_N // 2)  # (blocks, K, 32)
    if isinstance(rows, torch.Tensor):
        half = b[rows // BLOCK_N, :, rows % (BLOCK_N // 2)]  # (R, K)
        return torch.where((rows % BLOCK_N >= BLOCK_N // 2).unsqueeze(-1), half >> 4, half & 15)
    if rows is not None:
        b = b[rows.start // BLOCK_N : -(-rows.stop // BLOCK_N)]
    both = torch.cat([b & 15, b >> 4], dim=2)  # (blocks, K, 64)
    return both.transpose(1, 2).reshape(-1, k)


SLAB_ROWS = 8192  # rows packed at a time (the codes and the packing's scratch: 2 bytes a weight)


def planes_cpu(p: Packed) -> list[torch.Tensor]:
    """A packed weight's codes as CPU-layout 4-bit planes (one for q4, two for q8), a slab
    of rows at a time (the scratch stays bounded for any matrix size)."""
    (n, k), bits = p.shape, p.bits
    out = [p.codes.new_empty(n, k // 2, dtype=torch.uint8) for _ in range(bits // 4)]
    for r in range(0, n, SLAB_ROWS):
        if bits == 4:
            out[0][r : r + SLAB_ROWS] = pack_cpu_nibbles(p.codes[r : r + SLAB_ROWS], p.group)
            continue
        c = p.codes[r : r + SLAB_ROWS]  # (R, K) int8
        u = c.view(torch.uint8) ^ 0x80  # int8 c -> c + 128 in 0..255
        out[0][r : r + SLAB_ROWS] = pack_cpu(u >> 4)
        out[1][r : r + SLAB_ROWS] = pack_cpu(u & 15)
    return out


def plane_scales(scale: torch.Tensor, zero, bits: int, dtype) -> list[torch.Tensor]:
    """The (G, N, 2) scales-and-zeros of each plane made by `planes_cpu`."""
    if bits == 4:
        return [scales_zeros(scale, zero, dtype)]
    s = scale.float()
    z = zero.float() if zero is not None else torch.zeros_like(s)
    return [scales_zeros(16 * s, -8 * 16 * s, dtype), scales_zeros(s, z, dtype)]


def codes_cpu(planes: list[torch.Tensor], rows=None) -> torch.Tensor:
    """The integer codes back from `planes_cpu`'s planes (uint8 q4, int16 q8)."""
    if len(planes) == 1:
        return unpack_cpu(planes[0], rows)
    hi, lo = (unpack_cpu(p, rows).to(torch.int16) for p in planes)
    return hi * 16 + lo - 128


# the torch.* binding: ~1 us a call less than torch.ops' (a decode step makes ~120)
_MM_CPU = getattr(torch, "_weight_int4pack_mm_for_cpu", None) or (
    torch.ops.aten._weight_int4pack_mm_for_cpu.default
)
_MM_CUDA = torch.ops.aten._weight_int4pack_mm.default


def mm(x: torch.Tensor, planes, sz, group: int) -> torch.Tensor:
    """x (..., K) @ W^T through the int4 op(s), in x's dtype (no cast for bfloat16 x)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x.device.type == "cuda":
        y = _MM_CUDA(x2, planes[0], group, sz[0])
    else:
        xb = x2 if x2.dtype == torch.bfloat16 else x2.to(torch.bfloat16)
        y = _MM_CPU(xb, planes[0], group, sz[0])
        for p, s in zip(planes[1:], sz[1:], strict=True):
            y += _MM_CPU(xb, p, group, s)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y.view(*shape[:-1], y.shape[-1])
