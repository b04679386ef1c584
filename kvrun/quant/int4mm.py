"""PyTorch's weight-only int4 ops as a packed matmul: their layouts, and q8 as two 4-bit planes.

The ops compute y = x @ W^T with W = (q - 8) * scale + zero' per group, q in 0..15, the
scales-and-zeros given as a (G, N, 2) tensor in the activations' dtype.

- CPU (`_weight_int4pack_mm_for_cpu`): vectorized for bfloat16 activations only; float32
  activations run a scalar loop (~100x slower at 512 rows, bench/README.md). So the CPU path
  casts the activations to bfloat16 and the product back to the compute dtype. Its layout is
  blocks of B rows, B = 64 where PyTorch's CPU kernels are built for AVX-512 and 32 elsewhere
  (AVX2): byte (b, k, i) holds row Bb + i in its low nibble and row Bb + i + B/2 in its high
  nibble (found by packing known codes; `block_rows` asks the op which B this machine uses,
  `unpack_cpu` inverts the layout and a test checks it against the op), so the codes can be
  read back exactly for dequantization and gathers.
- CUDA (`_weight_int4pack_mm`): bfloat16, q4 only, tensor-core tiles; never read back.

Not exact: the products see bfloat16 activations and bfloat16 scales and zeros (Q4_1's fp16
scales lose 3 mantissa bits), about 3e-3 relative on a product. Callers that need the exact
product dequantize instead (kvrun/quant/linear.py does for more than a few rows on CPU).

q8 on CPU: a code c in -128..127 is 16 * hi + lo - 128 with hi, lo in 0..15, so
W = (hi - 8) * 16s + [(lo - 8) * s + 8s]: two int4 products with the same activations
(the second plane's zero' is 8s; the first's is 0). Bytes: one byte a weight plus 8 bytes of
bfloat16 scales and zeros per group of 32, against Q8_0's 34 per 32.
"""

from __future__ import annotations

import functools

import torch

from .packed import Packed


@functools.cache
def block_rows() -> int:
    """Rows per block in the CPU op's layout on this machine (64 with AVX-512 kernels, 32 with
    AVX2 ones): asked of the op itself, by packing a code of 1 in row 32 of a 64-row matrix.
    In 64-row blocks it lands in the high nibble of row 0; in 32-row blocks it opens block 1."""
    q = torch.zeros(64, 2, dtype=torch.int32)
    q[32, 0] = 1
    w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return 64 if w[0, 0] == 16 else 32


def cpu_supported(n: int, k: int, group: int) -> bool:
    """Shapes the CPU op and `unpack_cpu` take: whole row blocks, whole groups."""
    return n % block_rows() == 0 and k % group == 0 and group in (32, 64, 128, 256)


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
    (N a multiple of `block_rows()`). PyTorch's own conversion
    (`_convert_weight_to_int4pack_for_cpu`) takes int32 codes, 4 bytes a weight; loading an
    8B Q4 model spent ~20 s there (tests check both give the same bytes)."""
    n, k = q.shape
    bn = block_rows()
    b = q.to(torch.uint8).view(n // bn, 2, bn // 2, k)  # rows B b + B/2 h + i
    return (b[:, 0] | (b[:, 1] << 4)).transpose(1, 2).reshape(n, k // 2)


def pack_cpu_nibbles(codes: torch.Tensor, group: int) -> torch.Tensor:
    """`pack_cpu` of a q4 Packed's canonical bytes (N, K // 2), without unpacking them: byte j
    of a group holds element j (low nibble) and j + group / 2 (high), so the low nibbles of
    rows Bb + i and Bb + B/2 + i make one byte of the op's layout, and their high nibbles
    another (the byte ops below; 2-3x faster than unpacking to codes first)."""
    n, half = codes.shape
    bn = block_rows()
    c = codes.view(n // bn, 2, bn // 2, half // (group // 2), group // 2)
    lo, hi = c[:, 0], c[:, 1]  # (blocks, B/2, G, group / 2): rows Bb + i and Bb + B/2 + i
    both = torch.stack([(lo & 15) | (hi << 4), (lo >> 4) | (hi & 0xF0)], dim=3)
    return both.permute(0, 2, 3, 4, 1).reshape(n, half)  # (blocks, K, B/2)


def pack_cuda(q: torch.Tensor) -> torch.Tensor:
    u8 = ((q[:, ::2].to(torch.int32) << 4) | q[:, 1::2].to(torch.int32)).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(u8, 8)


def unpack_cpu(w: torch.Tensor, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
    """Codes (R, K) uint8 of the rows asked (a slice of whole blocks, an index tensor, or all)
    from a CPU-layout (N, K // 2) tensor."""
    n, k = w.shape[0], w.shape[1] * 2
    bn = block_rows()
    b = w.view(n // bn, k, bn // 2)  # (blocks, K, B/2)
    if isinstance(rows, torch.Tensor):
        half = b[rows // bn, :, rows % (bn // 2)]  # (R, K)
        return torch.where((rows % bn >= bn // 2).unsqueeze(-1), half >> 4, half & 15)
    if rows is not None:
        b = b[rows.start // bn : -(-rows.stop // bn)]
    both = torch.cat([b & 15, b >> 4], dim=2)  # (blocks, K, B)
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
