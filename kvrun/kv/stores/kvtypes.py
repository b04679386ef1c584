"""The element types a dense KV store keeps K and V in (--kv-dtype; llama.cpp's -ctk / -ctv):
f32, f16, bf16 as torch dtypes, and llama.cpp's q8_0 / q4_0 blocks of 32 values (an fp16 scale
and 8- or 4-bit codes, the bytes llama.cpp's cache holds) as uint8 rows. Encoding and decoding
run on the native kernels (kernels/cpu/kvrows.h) where they are built, else in torch with the
same arithmetic (ggml's reference quantizers)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from ...errors import KvrunError

NAMES = ("f32", "f16", "bf16", "q8_0", "q4_0")
SPELLINGS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "fp16": "f16", "fp32": "f32"}


@dataclass(frozen=True, slots=True)
class KVType:
    """One element type: its ggml number, what a row of D values is stored as, its bytes."""

    name: str
    code: int  # ggml's type number (kvrows.h KvType)
    storage: torch.dtype  # the store's tensor dtype (uint8 rows for block types)
    block: int = 1  # values per block (32 for q8_0 / q4_0)
    block_bytes: int = 0  # bytes per block (block types)

    @property
    def blocks(self) -> bool:
        return self.block > 1

    @property
    def float_dtype(self) -> torch.dtype | None:
        """The torch dtype the values are (None for block types)."""
        return None if self.blocks else self.storage

    def elem_bytes(self) -> Fraction:
        """Bytes per stored K or V value (q8_0: 34/32, q4_0: 18/32)."""
        if self.blocks:
            return Fraction(self.block_bytes, self.block)
        return Fraction(self.storage.itemsize)

    def row(self, d: int) -> int:
        """The store's last dimension for a row of d values."""
        return d // self.block * self.block_bytes if self.blocks else d

    def row_bytes(self, d: int) -> int:
        """Bytes of a row of d values."""
        return self.row(d) * self.storage.itemsize

    def check_dim(self, d: int, where: str) -> None:
        if self.blocks and d % self.block:
            raise KvrunError(
                f"--kv-dtype {self.name} needs head_dim a multiple of {self.block} "
                f"({where} has {d}); use f16 or bf16"
            )

    def encode(self, x: torch.Tensor, kernels=None) -> torch.Tensor:
        """(..., D) float -> (..., row(D)) in this type."""
        if not self.blocks:
            return x.to(self.storage)
        if kernels is not None and x.device.type == "cpu":
            return kernels.kv_encode(x.float().contiguous(), self.code)
        return _QUANT[self.name][0](x.float())

    def decode(self, x: torch.Tensor, d: int, kernels=None, dtype=torch.float32) -> torch.Tensor:
        """(..., row(D)) in this type -> (..., D) in `dtype`."""
        if not self.blocks:
            return x.to(dtype)
        if kernels is not None and x.device.type == "cpu":
            return kernels.kv_decode(x, self.code, d).to(dtype)
        return _QUANT[self.name][1](x, d).to(dtype)


TYPES = {
    "f32": KVType("f32", 0, torch.float32),
    "f16": KVType("f16", 1, torch.float16),
    "bf16": KVType("bf16", 30, torch.bfloat16),
    "q8_0": KVType("q8_0", 8, torch.uint8, 32, 34),
    "q4_0": KVType("q4_0", 2, torch.uint8, 32, 18),
}


def parse(text: str) -> str:
    """--kv-dtype's text -> one of NAMES (a one-line error names them)."""
    name = SPELLINGS.get(str(text).strip().lower(), str(text).strip().lower())
    if name not in TYPES:
        raise KvrunError(f"unknown --kv-dtype {text!r} (available: {', '.join(NAMES)})")
    return name


def of(name: str | None, model_dtype: torch.dtype) -> KVType:
    """The type a spec's dtype names; None: the model's own dtype (the exact path)."""
    if name is None:
        for t in TYPES.values():
            if t.storage == model_dtype:
                return t
        raise KvrunError(f"no KV type for the model dtype {model_dtype}")
    return TYPES[name]


# ------------------------------------------------- torch fallbacks (ggml's reference quantizers)
def _scale_bytes(d: torch.Tensor) -> torch.Tensor:  # (..., nb) fp32 -> (..., nb, 2) uint8
    return d.to(torch.float16).view(torch.uint8).reshape(*d.shape, 2)


def _scale_of(blocks: torch.Tensor) -> torch.Tensor:  # (..., nb, bytes) -> (..., nb, 1) fp32
    return blocks[..., :2].contiguous().view(torch.float16).float()


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (torch.round rounds them to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _q8_0_encode(x: torch.Tensor) -> torch.Tensor:
    xb = x.reshape(*x.shape[:-1], -1, 32)  # (..., nb, 32)
    d = xb.abs().amax(-1) / 127  # (..., nb)
    inv = torch.where(d != 0, 1 / torch.where(d == 0, torch.ones_like(d), d), torch.zeros_like(d))
    q = _round_away(xb * inv[..., None]).to(torch.int8).view(torch.uint8)
    return torch.cat([_scale_bytes(d), q], -1).reshape(*x.shape[:-1], -1)


def _q8_0_decode(x: torch.Tensor, d: int) -> torch.Tensor:
    b = x.reshape(*x.shape[:-1], d // 32, 34)
    return (b[..., 2:].view(torch.int8).float() * _scale_of(b)).reshape(*x.shape[:-1], d)


def _q4_0_encode(x: torch.Tensor) -> torch.Tensor:
    xb = x.reshape(*x.shape[:-1], -1, 32)  # (..., nb, 32)
    at = xb.abs().argmax(-1, keepdim=True)  # the first value of largest magnitude, signed
    d = torch.gather(xb, -1, at)[..., 0] / -8  # (..., nb)
    inv = torch.where(d != 0, 1 / torch.where(d == 0, torch.ones_like(d), d), torch.zeros_like(d))
    q = torch.clamp((xb * inv[..., None] + 8.5).to(torch.int8), max=15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([_scale_bytes(d), packed], -1).reshape(*x.shape[:-1], -1)


def _q4_0_decode(x: torch.Tensor, d: int) -> torch.Tensor:
    b = x.reshape(*x.shape[:-1], d // 32, 18)
    codes = torch.cat([b[..., 2:] & 15, b[..., 2:] >> 4], -1).float() - 8  # (..., nb, 32)
    return (codes * _scale_of(b)).reshape(*x.shape[:-1], d)


_QUANT = {"q8_0": (_q8_0_encode, _q8_0_decode), "q4_0": (_q4_0_encode, _q4_0_decode)}
