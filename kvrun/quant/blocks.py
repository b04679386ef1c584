"""Weights held as GGUF blocks of their own type: the file's numbers, never re-quantized.

`Blocks` is one (N, K) tensor's blocks as the file stores them (row-major), or, where the
native kernels run, interleaved 8 rows at a time (kernels/cpu/qlayout.h: the same bytes,
moved; a few percent more for K-types, whose scales are kept decoded). `BlockLinear`
multiplies through the native kernels (kvrun/quant/native.py) up to `native_rows()` rows,
with the activations quantized to 8 bits per block as llama.cpp does; longer products (and
every product where the native kernels cannot run) dequantize a slab of rows at a time to
exactly the values `gguf.quants.dequantize` gives and multiply with F.linear. Every type the
`gguf` package reads is held this way; Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K..Q6_K and
IQ4_XS dequantize natively, the others through `gguf` (numpy, slower).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import native, probes
from .linear import DECODE_ROWS, REFINE, REFINE_MARGIN, SLAB_ELEMS, DequantBuffers

X8_FLAG = 256  # kernels/cpu/qtypes.h: a type code plus this names the interleaved layout


def type_id(name: str) -> int:
    import gguf

    return int(gguf.GGMLQuantizationType[name])


def block_size(name: str) -> tuple[int, int]:
    """(elements, bytes) of one block of a GGUF type."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]


@dataclass
class Blocks:
    """A (N, K) weight as GGUF blocks of one type."""

    type: str  # the GGUF type name ("Q4_K", ...)
    n: int
    k: int
    data: torch.Tensor  # uint8 (N, row bytes) row-major; x8: (ceil(N / 8), group bytes)
    x8: bool = False  # interleaved 8 rows at a time (native kernels only)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def code(self) -> int:
        return type_id(self.type) | (X8_FLAG if self.x8 else 0)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, idx: torch.Tensor | slice) -> Blocks:
        """Rows idx of a row-major weight (Q and K's RoPE order, stacking)."""
        assert not self.x8, "rows of an interleaved weight: dequantize them instead"
        data = self.data[idx]
        return Blocks(self.type, data.shape[0], self.k, data)

    def slab(self, r0: int, r1: int) -> Blocks:
        """Rows r0..r1 (r0 a multiple of 8 where interleaved), sharing the storage."""
        if not self.x8:
            return Blocks(self.type, r1 - r0, self.k, self.data[r0:r1])
        return Blocks(self.type, r1 - r0, self.k, self.data[r0 // 8 : -(-r1 // 8)], True)

    def dequantize(
        self, idx: torch.Tensor | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows idx (or all) as float32 (R, K): exactly gguf.quants.dequantize's values (into
        `out`, a float32 buffer of R x K elements, where given and dequantized natively)."""
        ops = native.ops()
        if ops is not None and ops.has_dequant(type_id(self.type)):
            return ops.dequant(self.data, self.code, self.n, self.k, idx, out).view(-1, self.k)
        import gguf

        raw = self.data if idx is None else self.data[idx]
        w = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[self.type])
        return torch.from_numpy(np.ascontiguousarray(w)).view(-1, self.k)

    def interleaved(self) -> Blocks:
        """This weight in the 8-row interleaved layout where the native kernels have one."""
        ops = native.ops()
        if self.x8 or ops is None or not ops.has_x8(type_id(self.type)):
            return self
        return Blocks(
            self.type, self.n, self.k, ops.repack(self.data, type_id(self.type), self.k), True
        )


def from_gguf(t, order: torch.Tensor | None = None, interleave: bool = False) -> Blocks:
    """A GGUF tensor (gguf ReaderTensor) as its blocks, its rows in `order` (Q and K's RoPE
    layout) where given, copied out of the memory map once: straight into the interleaved
    layout where asked and the native kernels have one for the type."""
    import warnings

    k = int(t.shape[0])  # GGUF lists the fastest-varying dimension first
    arr = np.asarray(t.data)
    with warnings.catch_warnings():  # a read-only map: only read here, copied below
        warnings.simplefilter("ignore", UserWarning)
        view = torch.from_numpy(arr).view(arr.shape[0], -1)
    data = view if order is None else view[order]
    b = Blocks(t.tensor_type.name, data.shape[0], k, data)
    if interleave:
        x8 = b.interleaved()
        if x8 is not b:
            return x8
    return b if order is not None else Blocks(b.type, b.n, k, data.clone())


def native_dot(type_name: str) -> bool:
    """Whether products of this type run through the native kernels here."""
    ops = native.ops()
    return ops is not None and ops.has_gemm(type_id(type_name))


@functools.cache
def native_rows() -> int:
    """CPU: the most rows a product takes through the native kernels (decode steps and prefill
    chunks up to 512 rows, where they beat the exact path); longer ones dequantize and
    multiply with F.linear (MKL). Timed once per machine and native build on a 1536 x 576 Q4_0
    layer (kvrun/quant/probes.py)."""
    probe = f"native rows cpu {native.build_key()}"  # a new build measures again
    return int(probes.measured(probe, lambda: str(_measure_native_rows()), str.isdigit))


NATIVE_ROW_STEPS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def _measure_native_rows() -> int:
    import gguf

    from .hardware import faster

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1536, 576, generator=g) * 0.02).numpy()
    raw = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0))
    lin = BlockLinear([Blocks("Q4_0", 1536, 576, raw).interleaved()], torch.float32)
    best = DECODE_ROWS
    for rows in NATIVE_ROW_STEPS:
        x = torch.randn(rows, 576, generator=g)
        if not faster(lambda: lin._native(x), lambda: lin._exact(x), reps=7):  # noqa: B023
            break
        best = rows
    return best


class BlockLinear(nn.Module):
    """y = x W^T for W held as GGUF blocks: one part, or several stacked (Q, K, V; gate, up)
    whose types may differ (a Q4_K_M file's V is Q6_K beside Q4_K Q and K). One native call
    quantizes x once for all the parts."""

    def __init__(
        self, parts: list[Blocks], dtype: torch.dtype, scratch: DequantBuffers | None = None
    ):
        super().__init__()
        self.dtype = dtype
        self.scratch = scratch or DequantBuffers()  # the exact path's dequantized slabs, reused
        self.in_features = parts[0].k
        self.out_features = sum(p.n for p in parts)
        self.types = [p.type for p in parts]
        self.ns = [p.n for p in parts]
        self.x8s = [p.x8 for p in parts]
        for i, p in enumerate(parts):
            self.register_buffer(f"b{i}", p.data)
        self._bind()

    def _bind(self) -> None:
        """The native call's arguments, as plain attributes (a decode step makes ~120 calls)."""
        self._ws = [getattr(self, f"b{i}") for i in range(len(self.types))]
        self._codes = [p.code for p in self.parts()]
        self._native_ok = (
            all(native_dot(t) for t in self.types) and self._ws[0].device.type == "cpu"
        )

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._bind()
        return out

    def parts(self) -> list[Blocks]:
        return [
            Blocks(t, n, self.in_features, getattr(self, f"b{i}"), x8)
            for i, (t, n, x8) in enumerate(zip(self.types, self.ns, self.x8s, strict=True))
        ]

    @property
    def source(self) -> str:
        return "+".join(dict.fromkeys(self.types))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts())

    def interleave(self) -> None:
        """Move each part into the 8-row interleaved layout where the native kernels have one."""
        for i, p in enumerate(self.parts()):
            q = p.interleaved()
            if q is not p:
                setattr(self, f"b{i}", q.data)
                self.x8s[i] = True
        self._bind()

    @classmethod
    def stack(cls, mods: list[nn.Module]) -> BlockLinear | None:
        """One layer for several that read the same input, their parts in order; None unless
        all are BlockLinear of the same width."""
        if not all(type(m) is BlockLinear for m in mods):
            return None
        if len({m.in_features for m in mods}) != 1:
            return None
        return cls([p for m in mods for p in m.parts()], mods[0].dtype, mods[0].scratch)

    def facts(self) -> dict:
        """What, beside its buffers, rebuilds this layer (`restore`; kvrun/models/model_cache.py)."""
        kind = "block_embedding" if isinstance(self, BlockEmbedding) else "block_linear"
        return {
            "kind": kind,
            "types": self.types,
            "rows": self.ns,
            "x8": self.x8s,
            "k": self.in_features,
        }

    @staticmethod
    def restore(
        facts: dict, buffers: dict[str, torch.Tensor], dtype: torch.dtype, scratch: DequantBuffers
    ) -> BlockLinear:
        cls = BlockEmbedding if facts["kind"] == "block_embedding" else BlockLinear
        parts = [
            Blocks(t, n, facts["k"], buffers[f"b{i}"], x8)
            for i, (t, n, x8) in enumerate(
                zip(facts["types"], facts["rows"], facts["x8"], strict=True)
            )
        ]
        return cls(parts, dtype, scratch)

    def extra_repr(self) -> str:
        layout = "interleaved" if all(self.x8s) else "row-major" if not any(self.x8s) else "mixed"
        return f"{self.in_features} -> {self.out_features}, {self.source} blocks ({layout})"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def takes_native(self, rows: int, exact: bool = False) -> bool:
        """Whether a product of `rows` rows runs through the native kernels."""
        if not self._native_ok:
            return False
        return rows <= DECODE_ROWS or (not exact and rows <= native_rows())

    def matmul(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """x (..., K) @ W^T. exact: products beyond a decode step's rows dequantize (the output
        head: logits are what is measured)."""
        if self.takes_native(x.numel() // self.in_features, exact):
            return self._native(x)
        return self._exact(x)

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        y = native.ops().qmm(x2, self._ws, self._codes, self.ns)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y.view(*shape[:-1], self.out_features)

    def _exact(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T on the exact dequantized values, a slab of rows at a time."""
        k = self.in_features
        step = max(8, SLAB_ELEMS // k // 8 * 8)
        xx = x.to(self.dtype)
        out = []
        for p in self.parts():
            for r0 in range(0, p.n, step):
                r1 = min(r0 + step, p.n)
                buf = self.scratch.get((r1 - r0) * k, torch.float32, xx.device)
                w = p.slab(r0, r1).dequantize(out=buf)
                out.append(F.linear(xx, w if self.dtype == torch.float32 else w.to(self.dtype)))
        y = out[0] if len(out) == 1 else torch.cat(out, dim=-1)
        return y.to(x.dtype)

    def rows_dense(self, idx: torch.Tensor) -> torch.Tensor:
        """The exact dense rows idx (R,) -> (R, K) in the compute dtype (one part only)."""
        assert len(self.types) == 1, "rows of a stacked layer"
        w = self.parts()[0].dequantize(idx)
        return w if self.dtype == torch.float32 else w.to(self.dtype)

    def logits(self, x: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """x @ W^T as the output head: decode rows (a step's, `decode`: up to `native_rows()`
        sequences of a batch; else a decode step's few rows) through the native kernels, then
        each row's top logits (within REFINE_MARGIN of its largest, at most REFINE) recomputed
        from the exact weights, as kvrun.quant.linear.PackedLinear.logits does for the int4
        op. Prefill rows beyond that stay exact (their logits are measured)."""
        rows = x.numel() // self.in_features
        if not self.takes_native(rows, exact=not decode):
            return self._exact(x)
        y = self._native(x)
        y2 = y.view(rows, -1)  # (R, N)
        x2 = x.reshape(rows, -1).float().contiguous()  # (R, K)
        if y2.dtype == torch.float32 and len(self.types) == 1:  # one native call (double sums)
            n, k = self.out_features, self.in_features
            ws, codes = self._ws[0], self._codes[0]
            native.ops().refine_top(y2, x2, ws, codes, n, k, REFINE_MARGIN, REFINE)
            return y
        for r in range(rows):
            row = y2[r]
            top = (row > row.max() - REFINE_MARGIN).nonzero().squeeze(1)  # (J,)
            if top.numel() > REFINE:
                top = row.topk(REFINE).indices
            row[top] = (self.rows_dense(top) @ x2[r].to(self.dtype)).to(row.dtype)
        return y


class BlockEmbedding(BlockLinear):
    """A (vocab, dim) table of GGUF blocks: rows gathered and dequantized on lookup; `logits`
    makes it the output head of a model with tied embeddings."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows_dense(ids.reshape(-1)).view(*ids.shape, self.in_features)
