"""Linear layers and embeddings over packed 4/8-bit weights, and the matmul path per device.

Two matmul paths, both exact against the dense weights they stand for:

- `dequant`: dequantize a slab of rows to the compute dtype and multiply with `F.linear`
  (MKL / cuBLAS); the slab bounds the scratch memory. Works for q4 and q8 on any device.
- `int4pack`: PyTorch's weight-only int4 ops (`_weight_int4pack_mm_for_cpu` on CPU,
  `_weight_int4pack_mm` on CUDA, bfloat16), q4 only. `_weight_int8pack_mm` is not used:
  it takes one scale per row, and Q8_0's scales are per group of 32.

`matmul_path(device, dtype)` times both on a probe shape once per process and keeps the
faster (on CUDA the int4 op must also agree with `dequant`). On AVX2 CPUs without AVX-512
PyTorch's int4 op runs a scalar loop (~8x slower than fp32 at one row, ~50x at 512 rows,
see bench/README.md), so there `dequant` wins.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from torch import nn

from .quant import Packed

NIBBLES = 0x0F0F0F0F
SLAB_ELEMS = 1 << 24  # rows dequantized at a time: at most 64 MiB of float32 scratch


class Scratch:
    """Reused buffers for dequantized slabs: fresh multi-megabyte tensors per product cost
    more in page faults than the dequantization itself. One per model, shared by its layers."""

    def __init__(self):
        self.bufs: dict[tuple, torch.Tensor] = {}

    def get(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (dtype, device)
        buf = self.bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self.bufs[key] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]

    def dequantize(self, p: Packed, dtype: torch.dtype) -> torch.Tensor:
        """p.dequantize(dtype), into reused buffers (valid until the next call)."""
        n, k = p.shape
        g = k // p.group
        if p.bits == 4:
            # four code bytes as one int32: two int32 ops split eight nibbles at a time, and
            # the masked words, seen as bytes again, are the codes in order (little-endian)
            c = p.codes.view(n, g, p.group // 2).view(torch.int32)  # (N, G, 4)
            q32 = self.get(n * k // 4, torch.int32, p.codes.device).view(n, g, 2, -1)
            torch.bitwise_and(c, NIBBLES, out=q32[:, :, 0])
            torch.bitwise_right_shift(c, 4, out=q32[:, :, 1]).bitwise_and_(NIBBLES)
            q = q32.view(torch.uint8).view(n, g, p.group)
        else:
            q = p.codes.view(n, g, p.group)
        w = self.get(n * k, torch.float32, p.codes.device).view(n, g, p.group)
        w.copy_(q).mul_(p.scale.unsqueeze(-1))  # exact: code x scale fits float32
        if p.zero is not None:
            w.add_(p.zero.unsqueeze(-1))
        w = w.view(n, k)
        return w if dtype == torch.float32 else w.to(dtype)


class PackedLinear(nn.Module):
    """y = x W^T for a packed W (no bias: Llama's projections have none)."""

    def __init__(self, p: Packed, dtype: torch.dtype, scratch: Scratch | None = None):
        super().__init__()
        self.bits, self.group, self.source, self.exact = p.bits, p.group, p.source, p.exact
        self.out_features, self.in_features = p.shape
        self.dtype = dtype
        self.path = "dequant"
        self.scratch = scratch or Scratch()
        self.register_buffer("codes", p.codes)
        self.register_buffer("scale", p.scale)
        self.register_buffer("zero", p.zero)

    @property
    def packed(self) -> Packed:
        return Packed(self.bits, self.codes, self.scale, self.zero, self.group, self.source)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, q{self.bits} from {self.source}, {self.path}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "int4pack":
            return _int4pack_mm(x, self.codes, self.scale, self.group)
        return dequant_linear(x, self.packed, self.dtype, self.scratch)

    def use_int4pack(self) -> None:
        """Repack for PyTorch's int4 op (q4 only); the canonical codes are dropped."""
        if self.bits != 4 or self.path == "int4pack":
            return
        codes, sz = to_int4pack(self.packed, self.dtype)
        self.codes, self.scale, self.zero = codes, sz, None
        self.path = "int4pack"


class PackedEmbedding(PackedLinear):
    """A packed (vocab, dim) table: rows gathered and dequantized on lookup; `linear` makes it
    the output head of a model with tied embeddings."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.packed.rows(ids.reshape(-1))
        return rows.dequantize(self.dtype).view(*ids.shape, self.in_features)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return dequant_linear(x, self.packed, self.dtype, self.scratch)


def dequant_linear(
    x: torch.Tensor, p: Packed, dtype: torch.dtype, scratch: Scratch | None = None
) -> torch.Tensor:
    """x @ dequantize(p)^T, a slab of rows at a time (scratch <= SLAB_ELEMS elements)."""
    scratch = scratch or Scratch()
    n, k = p.shape
    step = max(1, SLAB_ELEMS // k)
    if step >= n:
        return F.linear(x, scratch.dequantize(p, dtype))
    out = [
        F.linear(x, scratch.dequantize(p.rows(slice(r, r + step)), dtype))
        for r in range(0, n, step)
    ]
    return torch.cat(out, dim=-1)


# ----------------------------------------------------------------- PyTorch int4 ops
def to_int4pack(p: Packed, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and (G, N, 2) scales-and-zeros of PyTorch's int4 ops.

    Their dequantization is (q - 8) * scale + zero', so zero' = zero + 8 * scale.
    """
    n, k = p.shape
    q = p.int_codes().view(n, k).to(torch.int32)
    zero = p.zero.float() if p.zero is not None else torch.zeros_like(p.scale, dtype=torch.float32)
    sz = torch.stack([p.scale.float(), zero + 8 * p.scale.float()], dim=-1)  # (N, G, 2)
    sz = sz.transpose(0, 1).contiguous().to(dtype)  # (G, N, 2)
    if q.device.type == "cuda":
        u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(u8, 8), sz
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz


def _int4pack_mm(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x.device.type == "cuda":
        y = torch.ops.aten._weight_int4pack_mm(x2, w, group, sz)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w, group, sz)
    return y.view(*shape[:-1], y.shape[-1])


def int4pack_supported(p: Packed, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether PyTorch's int4 op takes this weight on this device and dtype."""
    n, k = p.shape
    if p.bits != 4 or p.group not in (32, 64, 128, 256):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and k % 1024 == 0 and n % 8 == 0
    return k % 2 == 0


# ---------------------------------------------------------------- choosing the path
def _probe_weight(n: int, k: int, device: torch.device) -> Packed:
    from .quant import quantize

    g = torch.Generator().manual_seed(0)
    return quantize(torch.randn(n, k, generator=g) * 0.02, 4).to(device)


def _time(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


@functools.cache
def matmul_path(device_type: str, dtype: torch.dtype) -> str:
    """'int4pack' or 'dequant': the q4 path that measures faster here (1024 x 1024 probe
    at 1 and 128 rows); on CUDA the int4 op must also agree with 'dequant' to 1e-2."""
    device = torch.device(device_type)
    p = _probe_weight(1024, 1024, device)
    if not int4pack_supported(p, device, dtype):
        return "dequant"
    try:
        w, sz = to_int4pack(p, dtype)
        x1 = torch.randn(1, 1024, device=device, dtype=dtype)
        xb = torch.randn(128, 1024, device=device, dtype=dtype)
        ref = dequant_linear(xb, p, dtype).float()
        got = _int4pack_mm(xb, w, sz, p.group).float()
        if (got - ref).abs().max() > 1e-2 * ref.abs().max():
            return "dequant"
    except (RuntimeError, NotImplementedError):  # op missing in this build
        return "dequant"
    t_pack = _time(lambda: _int4pack_mm(x1, w, sz, 32)) + _time(lambda: _int4pack_mm(xb, w, sz, 32))
    t_deq = _time(lambda: dequant_linear(x1, p, dtype)) + _time(
        lambda: dequant_linear(xb, p, dtype)
    )
    return "int4pack" if t_pack < t_deq else "dequant"


@functools.cache
def packed_decode_pays(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a one-row product through the packed path is at least as fast as through a
    dense weight here (1536 x 576 probe, the default model's FFN shape): `--wtype auto`
    keeps dense weights where packing would only slow decoding and memory is no issue."""
    device = torch.device(device_type)
    p = _probe_weight(1536, 576, device)
    lin = PackedLinear(p, dtype)
    if matmul_path(device_type, dtype) == "int4pack" and int4pack_supported(p, device, dtype):
        lin.use_int4pack()
    dense = p.dequantize(dtype)
    x = torch.randn(1, 576, device=device, dtype=dtype)
    return _time(lambda: lin(x), 10) <= 1.1 * _time(lambda: F.linear(x, dense), 10)


def dense_name(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]


def auto_wtype(dense_bytes: int, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """What `--wtype auto` means for a quantized GGUF here: ('packed' | dense name, why).

    Packed when the dense weights would not fit in 60% of the free memory, or when the
    packed path decodes at least as fast as dense weights on this device (measured);
    dense in the compute dtype otherwise (packing would only slow decoding down).
    """
    from .presets import available_bytes

    free = available_bytes(device)
    if free is not None and dense_bytes > 0.6 * free:
        return "packed", (
            f"weights packed: dense {dense_name(dtype)} would take {dense_bytes / 2**30:.1f} GiB "
            f"of {free / 2**30:.1f} GiB free"
        )
    if packed_decode_pays(device.type, dtype):
        return "packed", f"weights packed ({matmul_path(device.type, dtype)} path)"
    return dense_name(dtype), (
        f"weights dense {dense_name(dtype)}: packed matmul measured slower than dense on this "
        f"{device.type} and the dense model fits; --wtype q4 keeps them packed"
    )
