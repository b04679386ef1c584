"""Linear layers and embeddings over packed 4/8-bit weights.

Two matmul paths:

- `dequant`: dequantize a slab of rows to the compute dtype and multiply with `F.linear`
  (MKL / cuBLAS); exact; the slab bounds the scratch memory. Any width, any device.
- `int4pack`: PyTorch's weight-only int4 ops (kvrun/quant/int4mm.py): q4 on CUDA; q4 and q8 (as
  two 4-bit planes) on CPU, where they run on bfloat16 activations and so are not exact
  (~3e-3 relative). On CPU they serve decode steps and prefill chunks of up to the rows where
  they beat the exact path here (~64 on AVX2); longer prefill chunks dequantize exactly.
  `_weight_int8pack_mm` is not used: it takes one scale per row, Q8_0 has one per 32.

Which path a device takes, and the CPU crossover (`int4_op_rows`), are measured once per machine
(kvrun/quant/choice.py).
PyTorch's CPU int4 kernel is vectorized for AVX-512 and bfloat16 only (bench/README.md).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import hardware, int4mm, probes
from .packed import Packed, cat_rows, pack_nibbles, quantize

NIBBLES = 0x0F0F0F0F
SLAB_ELEMS = 1 << 24  # rows dequantized at a time: at most 64 MiB of float32 scratch
DECODE_ROWS = 8  # CPU: a decode step's rows, which always take the int4 op (and the head's
# exact refinement, `logits`); longer products take it up to the measured `op_rows`
REFINE = 64  # head logits per row recomputed exactly after an int4 product, at most (`logits`)
REFINE_MARGIN = 6.0  # ... those within this many nats of the row's largest
# CPU prefill of layers with at least this many weights: dequantize to bfloat16 and multiply
# with oneDNN's bf16 GEMM where it beats float32 here (AMX / AVX512-BF16: ~5x). Below it the
# dequantized float32 slab stays in cache and the product is exact (the default model's
# layers, <= 1.8M weights; 1B-class models and up have layers of 6M-120M)
BF16_PREFILL_WEIGHTS = 1 << 23
BF16_OP_ROWS = (
    128  # such layers: the int4 op up to this many rows (it matches dequant + bf16 GEMM at 128)
)


class OpArgs(NamedTuple):
    """A PackedLinear's int4 op arguments, kept as plain attributes (a decode step makes ~120
    products, and module buffer lookups cost ~1 us each)."""

    planes: tuple[torch.Tensor, ...]
    sz: tuple[torch.Tensor, ...]  # the planes' scales-and-zeros
    cuda: bool


class DequantBuffers:
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
        return self.scaled(q, p.scale, p.zero, dtype)

    def scaled(self, q: torch.Tensor, scale, zero, dtype: torch.dtype) -> torch.Tensor:
        """Integer codes (N, K) or (N, G, group) x scale (N, G) + zero, into a reused buffer."""
        n, g = scale.shape
        w = self.get(q.numel(), torch.float32, q.device).view(n, g, -1)
        return _scale_into(w, q, scale, zero, dtype)

    @staticmethod
    def scaled_new(q: torch.Tensor, scale, zero, dtype: torch.dtype) -> torch.Tensor:
        """`scaled` into a fresh tensor (for results that outlive the next product)."""
        n, g = scale.shape
        w = torch.empty(n, g, q.numel() // (n * g), dtype=torch.float32, device=q.device)
        return _scale_into(w, q, scale, zero, dtype)


def _scale_into(w: torch.Tensor, q: torch.Tensor, scale, zero, dtype) -> torch.Tensor:
    n, g, _ = w.shape
    w.copy_(q.view(w.shape)).mul_(scale.unsqueeze(-1))  # exact: code x scale fits float32
    if zero is not None:
        w.add_(zero.unsqueeze(-1))
    w = w.view(n, -1)
    return w if dtype == torch.float32 else w.to(dtype)


class PackedLinear(nn.Module):
    """y = x W^T for a packed W (no bias: Llama's projections have none).

    Path 'dequant': the canonical codes, dequantized a slab at a time into F.linear (exact).
    Path 'int4pack' (`use_int4pack`): the codes live only in the int4 ops' layout
    (kvrun/quant/int4mm.py). On CUDA every product goes through the op. On CPU products of up to
    `op_rows()` rows (decode steps, short prefill chunks) do, and longer ones read the codes
    back and dequantize them exactly, since MKL on a dense slab beats the op there.
    """

    def __init__(self, p: Packed, dtype: torch.dtype, scratch: DequantBuffers | None = None):
        super().__init__()
        self.bits, self.group, self.source, self.exact = p.bits, p.group, p.source, p.exact
        self.out_features, self.in_features = p.shape
        self.dtype = dtype
        self.path = "dequant"
        self.scratch = scratch or DequantBuffers()
        self.register_buffer("codes", p.codes)
        self.register_buffer("scale", p.scale)
        self.register_buffer("zero", p.zero)
        self.n_planes = 0  # int4 planes held as buffers w0, sz0 (and w1, sz1 for q8)
        self._op: OpArgs | None = None  # set while path == "int4pack"

    def facts(self) -> dict:
        """What, beside its buffers (state_dict), rebuilds this layer (`restore`)."""
        return {
            "kind": "embedding" if isinstance(self, PackedEmbedding) else "linear",
            "bits": self.bits,
            "group": self.group,
            "source": self.source,
            "exact": self.exact,
            "shape": [self.out_features, self.in_features],
            "path": self.path,
            "planes": self.n_planes,
        }

    @staticmethod
    def restore(
        facts: dict, buffers: dict[str, torch.Tensor], dtype: torch.dtype, scratch: DequantBuffers
    ) -> PackedLinear:
        """The layer `facts()` and its buffers describe, as it was (kvrun/models/model_cache.py)."""
        cls = PackedEmbedding if facts["kind"] == "embedding" else PackedLinear
        n, k = facts["shape"]
        shell = torch.empty(n, k // 2 if facts["bits"] == 4 else k, device="meta")
        p = Packed(facts["bits"], shell, shell, None, facts["group"], facts["source"])
        mod = cls(p, dtype, scratch)
        mod.exact = facts["exact"]
        for name in ("codes", "scale", "zero"):
            setattr(mod, name, buffers.get(name))
        mod.n_planes = facts["planes"]
        for i in range(mod.n_planes):
            mod.register_buffer(f"w{i}", buffers[f"w{i}"])
            mod.register_buffer(f"sz{i}", buffers[f"sz{i}"])
        mod.path = facts["path"]
        mod._bind()
        return mod

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)  # .to() / .cuda(): the buffers are new tensors
        self._bind()
        return out

    def _bind(self) -> None:
        """Cache the op's arguments (after the buffers change)."""
        if self.path != "int4pack":
            self._op = None
            return
        planes, sz = self._planes()
        self._op = OpArgs(tuple(planes), tuple(sz), planes[0].device.type == "cuda")

    @property
    def packed(self) -> Packed:
        """The canonical form (rebuilt from the int4 planes on CPU)."""
        codes = self.codes
        if codes is None:
            if self.w0.device.type == "cuda":
                raise RuntimeError("the codes live only in the CUDA int4 layout")
            q = int4mm.codes_cpu(self._planes()[0])
            n, k = q.shape
            codes = pack_nibbles(q) if self.bits == 4 else q.to(torch.int8).view(n, k)
        scale, zero = self._scale_zero(slice(None))
        return Packed(self.bits, codes, scale, zero, self.group, self.source, self.exact)

    def _scale_zero(self, rows) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scale and zero (R, G) of the rows asked: the canonical ones, or (inexact weights on
        the CPU int4 path, which keep none) those of the int4 planes, whose weights are
        (q - 8) * s + z' = q * s + (z' - 8 s) for q4 and for q8's codes alike."""
        if self.scale is not None:
            return self.scale[rows], None if self.zero is None else self.zero[rows]
        sz = self.sz1 if self.bits == 8 else self.sz0  # (G, N, 2); q8: plane 1 has s and z'
        s = sz[:, rows, 0].float().T
        return s, sz[:, rows, 1].float().T - 8 * s

    @classmethod
    def stack(cls, mods: list[nn.Module]) -> PackedLinear | None:
        """One layer for several that read the same input (Q, K, V; gate, up): their rows
        stacked, so a decode step makes one product instead of several. None unless all are
        packed alike (width, group, scale dtype, zero or not) and not yet moved to int4."""
        if not all(type(m) is PackedLinear and m.path == "dequant" for m in mods):
            return None
        first = mods[0]
        like = (first.bits, first.group, first.scale.dtype, first.zero is None)
        if any((m.bits, m.group, m.scale.dtype, m.zero is None) != like for m in mods):
            return None
        p = cat_rows([m.packed for m in mods])
        p.exact = all(m.exact for m in mods)
        p.source = "+".join(sorted({m.source for m in mods}))
        return cls(p, first.dtype, first.scratch)

    def _planes(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [getattr(self, f"w{i}") for i in range(self.n_planes)], [
            getattr(self, f"sz{i}") for i in range(self.n_planes)
        ]

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, q{self.bits} from {self.source}, {self.path}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def matmul(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """x (..., K) @ W^T through this layer's path. exact: on CPU, products beyond a decode
        step's rows stay exact float32 (the output head: logits are what is measured)."""
        op = self._op
        if op is not None:
            if op.cuda or self._op_takes(x.numel() // self.in_features, exact):
                return int4mm.mm(x, op.planes, op.sz, self.group)
            if self.codes is None:
                return self._dequant_planes_linear(x, bf16=not exact and self.bf16_prefill())
        return dequant_linear(x, self.packed, self.dtype, self.scratch)

    def cpu_op(self) -> OpArgs | None:
        """The int4 op's arguments where this layer's decode products run through the CPU op
        (kvrun/models/fused_decode.py binds them), else None."""
        op = self._op
        return op if op is not None and not op.cuda else None

    def bf16_op(self, rows: int) -> bool:
        """Whether a product of `rows` rows runs through the CPU int4 op, which takes and
        gives bfloat16: callers chain such products without float32 round trips (`matmul`
        of a bfloat16 x returns bfloat16)."""
        return self._op is not None and not self._op.cuda and self._op_takes(rows)

    def _op_takes(self, rows: int, exact: bool = False) -> bool:
        """CPU: whether a product of `rows` rows goes through the int4 op."""
        return rows <= DECODE_ROWS or (not exact and rows <= self.op_rows())

    def rows_dense(self, idx: torch.Tensor) -> torch.Tensor:
        """The exact dense rows idx (R,) -> (R, K) in the compute dtype."""
        if self.codes is None:  # CPU int4 planes: gather the rows' codes from them
            q = int4mm.codes_cpu(self._planes()[0], idx)
            return DequantBuffers.scaled_new(q, *self._scale_zero(idx), self.dtype)
        return self.packed.rows(idx).dequantize(self.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T as the output head. Where the product went through the CPU int4 op (decode
        steps), the top logits of each row are recomputed from the exact weights: the op
        rounds the activations and the scales to bfloat16, which costs ~9e-4 nats of KL at
        the head alone (measured on the default model); sampling only reads the top of the
        distribution, and there the logits are now exact up to float32 products.

        The top: every logit within REFINE_MARGIN of the row's largest, at most REFINE of
        them. Logits further down hold < e^-6 of the largest's probability each; refining a
        fixed 64 instead reads ~1.7x the rows (each gathered from the op's interleaved
        layout: 18 KB a row) for a KL of 7.7e-5 against 9.1e-5 (bench/README.md)."""
        y = self.matmul(x, exact=True)
        rows = x.numel() // self.in_features
        op = self._op
        if self.codes is not None or rows > DECODE_ROWS or op is None or op.cuda:
            return y  # exact already, or CUDA (its layout is not read back; no host sync)
        y2, x2 = y.view(rows, -1), x.reshape(rows, -1)  # (R, N), (R, K)
        for r in range(rows):  # CPU: reading the counts back costs nothing
            row = y2[r]
            top = (row > row.max() - REFINE_MARGIN).nonzero().squeeze(1)  # (J,)
            if top.numel() > REFINE:
                top = row.topk(REFINE).indices
            row[top] = (self.rows_dense(top) @ x2[r]).to(row.dtype)
        return y

    def _dequant_planes_linear(self, x: torch.Tensor, bf16: bool = False) -> torch.Tensor:
        """x @ W^T on CPU from the int4 planes, whole row blocks a slab at a time: exact in the
        compute dtype, or in bfloat16 (large layers where its GEMM is faster: bf16_prefill)."""
        n, k = self.out_features, self.in_features
        bn = int4mm.block_rows()
        step = max(bn, SLAB_ELEMS // k // bn * bn)
        dt = torch.bfloat16 if bf16 else self.dtype
        xx = x.to(dt)
        planes, out = self._planes()[0], []
        for r in range(0, n, step):
            rows = slice(r, min(r + step, n))
            q = int4mm.codes_cpu(planes, rows)  # (R, K)
            w = self.scratch.scaled(q, *self._scale_zero(rows), dt)
            out.append(F.linear(xx, w))
        y = out[0] if len(out) == 1 else torch.cat(out, dim=-1)
        return y.to(x.dtype)

    def op_rows(self) -> int:
        """CPU: products of up to this many rows go through the int4 op: as many as it beats
        dequantize + MKL for on this machine (decode steps and short prefill chunks alike;
        `int4_op_rows`), and up to BF16_OP_ROWS for large layers whose longer
        products run in bfloat16 anyway."""
        rows = int4_op_rows(self.dtype)
        return max(rows, BF16_OP_ROWS) if self.bf16_prefill() else rows

    def bf16_prefill(self) -> bool:
        """Whether products of many rows run in bfloat16 (large layers, where bf16 GEMMs are
        faster on this CPU); inexact like the int4 op, ~3e-3 relative."""
        big = self.out_features * self.in_features >= BF16_PREFILL_WEIGHTS
        return big and self.dtype == torch.float32 and hardware.bf16_gemm_faster()

    def use_int4pack(self) -> bool:
        """Move the codes into the int4 ops' layout where this device and shape allow it (q4 on
        CUDA; q4 and q8 on CPU); the canonical codes are dropped. Whether it did."""
        n, k = self.out_features, self.in_features
        dev = self.scale.device
        if self.path == "int4pack":
            return True
        if dev.type == "cuda":
            if self.bits != 4 or not int4mm.cuda_supported(n, k, self.group, self.dtype):
                return False
            q = self.packed.int_codes().view(n, k)
            planes = [int4mm.pack_cuda(q)]
            sz = [int4mm.scales_zeros(self.scale, self.zero, self.dtype)]
        else:
            if not int4mm.cpu_supported(n, k, self.group):
                return False
            planes = int4mm.planes_cpu(self.packed)
            sz = int4mm.plane_scales(self.scale, self.zero, self.bits, torch.bfloat16)
        for i, (w, s) in enumerate(zip(planes, sz, strict=True)):
            self.register_buffer(f"w{i}", w)
            self.register_buffer(f"sz{i}", s)
        self.n_planes = len(planes)
        self.path = "int4pack"
        self._bind()
        if dev.type != "cuda" or not isinstance(self, PackedEmbedding):
            self.codes = None  # read back from the CPU planes; CUDA gathers keep the codes
        if dev.type != "cuda" and not self.exact:
            # nothing to be exact against (re-quantized or random weights): prefill and
            # gathers use the planes' own scales, and the canonical ones are dropped
            self.scale = self.zero = None
        return True


# row counts tried for the CPU crossover (`int4_op_rows`), after a decode step's
OP_ROW_STEPS = (16, 24, 32, 48, 64, 96, 128)


@functools.cache
def int4_op_rows(dtype: torch.dtype) -> int:
    """CPU: the most rows a product of a packed layer takes through the int4 op, decode steps
    and short prefill chunks alike: the largest of OP_ROW_STEPS where the op still beats
    dequantize + MKL on a 1536 x 576 probe (the default model's FFN), DECODE_ROWS if none.
    Both paths' costs grow with the layer's weights, so one probe shape stands for all
    (bench/op_rows.py: on a 2-core AVX2 EPYC the op wins up to ~96 rows on the default
    model's layers and on an 8B model's alike). Timed once per machine and torch build
    (kvrun/quant/probes.py)."""
    probe = f"int4 op rows cpu {str(dtype).removeprefix('torch.')}"
    return int(probes.measured(probe, lambda: str(_measure_op_rows(dtype)), str.isdigit))


def _measure_op_rows(dtype: torch.dtype) -> int:
    g = torch.Generator().manual_seed(0)
    lin = PackedLinear(quantize(torch.randn(1536, 576, generator=g) * 0.02, 4), dtype)
    try:
        if not lin.use_int4pack():
            return DECODE_ROWS
    except (RuntimeError, NotImplementedError):  # op missing in this build
        return DECODE_ROWS
    op, best = lin.cpu_op(), DECODE_ROWS
    for rows in OP_ROW_STEPS:
        x = torch.randn(rows, 576, dtype=dtype, generator=g)
        via_op = functools.partial(int4mm.mm, x, op.planes, op.sz, lin.group)
        exact = functools.partial(lin._dequant_planes_linear, x)
        if not hardware.faster(via_op, exact, reps=7):
            break
        best = rows
    return best


class PackedEmbedding(PackedLinear):
    """A packed (vocab, dim) table: rows gathered and dequantized on lookup; `logits` makes it
    the output head of a model with tied embeddings."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows_dense(ids.reshape(-1)).view(*ids.shape, self.in_features)


def dequant_linear(
    x: torch.Tensor, p: Packed, dtype: torch.dtype, scratch: DequantBuffers | None = None
) -> torch.Tensor:
    """x @ dequantize(p)^T, a slab of rows at a time (scratch <= SLAB_ELEMS elements)."""
    scratch = scratch or DequantBuffers()
    n, k = p.shape
    step = max(1, SLAB_ELEMS // k)
    if step >= n:
        return F.linear(x, scratch.dequantize(p, dtype))
    out = [
        F.linear(x, scratch.dequantize(p.rows(slice(r, r + step)), dtype))
        for r in range(0, n, step)
    ]
    return torch.cat(out, dim=-1)
