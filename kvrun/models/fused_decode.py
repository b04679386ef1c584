"""A CPU decode step's blocks fused into one flat loop over prebound products.

A decode step of the default model makes 120 products of ~40 us each; through the modules it
also pays ~150 us a layer of Python around them (module calls, dtype and path checks made
anew for every product). This loop is bound once per model: each layer's norms and the int4
op's arguments of its four products sit in one tuple, and the step does the same arithmetic
as `Block.forward`, op for op (the test checks the logits bit for bit), with none of the
checks. It serves the rows of a decode step (up to DECODE_ROWS, one token each) on a float32
model whose products all run through the CPU int4 op (bfloat16 in and out) or all through the
native kernels over GGUF blocks (float32 in and out); anything else takes the modules.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..quant import blocks as qblocks
from ..quant import int4mm
from ..quant.blocks import BlockLinear
from ..quant.linear import DECODE_ROWS, PackedLinear

_MM = int4mm._MM_CPU
# where `rms_norm` may read a number back: free on CPU; on CUDA a sync a graph cannot capture
READ_BACK = ("cpu",)


class Product(NamedTuple):
    """One int4 product: y (R, N) = x (R, K) @ W^T, bfloat16 in and out."""

    planes: tuple[torch.Tensor, ...]
    sz: tuple[torch.Tensor, ...]
    group: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.planes) == 1:
            return _MM(x, self.planes[0], self.group, self.sz[0])
        return int4mm.mm(x, self.planes, self.sz, self.group)


class NativeProduct(NamedTuple):
    """One product of a BlockLinear through the native kernels: float32 in and out."""

    qmm: object  # torch.ops.kvrun_cpu.qmm
    ws: list[torch.Tensor]
    codes: list[int]
    rows: list[int]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.qmm(x if x.is_contiguous() else x.contiguous(), self.ws, self.codes, self.rows)


class FusedLayer(NamedTuple):
    norm1: torch.Tensor  # (dim,) input_layernorm
    qkv: Product | NativeProduct  # dim -> (Hq + 2 Hkv) D
    o: Product | NativeProduct  # Hq D -> dim
    norm2: torch.Tensor  # (dim,) post_attention_layernorm
    gate_up: Product | NativeProduct  # dim -> 2 ffn
    down: Product | NativeProduct  # ffn -> dim
    dt: torch.dtype  # the products' input: bfloat16 (int4 op) or float32 (native)
    kernels: object | None  # the native step kernels (norms, SiLU x up) with native products
    bias: torch.Tensor | None = None  # Qwen 2: Q, K, V biases stacked ((Hq + 2 Hkv) D,)
    q_norm: torch.Tensor | None = None  # Qwen 3: RMSNorm weights over each head (D,)
    k_norm: torch.Tensor | None = None


def _product(mod) -> Product | NativeProduct | None:
    if type(mod) is BlockLinear:
        if not mod.takes_native(1):
            return None
        from ..quant import native

        return NativeProduct(native.ops().qmm, mod._ws, mod._codes, mod.ns)
    op = mod.cpu_op() if type(mod) is PackedLinear else None
    return None if op is None else Product(op.planes, op.sz, mod.group)


def bind(model) -> list[FusedLayer] | None:
    """The flat layers of `model`, or None where the loop does not apply (dense or CUDA
    products, Q/K/V or gate/up not stacked, a compute dtype other than float32)."""
    if model.dtype != torch.float32 or model.device.type != "cpu" or not plain(model.config):
        return None
    layers = []
    for block in model.model.layers:
        a, mlp = block.self_attn, block.mlp
        prods = [_product(m) for m in (a.qkv, a.o_proj, mlp.gate_up, mlp.down_proj)]
        if any(p is None for p in prods) or len({type(p) for p in prods}) > 1:
            return None
        qkv, o, gate_up, down = prods
        norm1, norm2 = block.input_layernorm.weight, block.post_attention_layernorm.weight
        native = type(qkv) is NativeProduct
        dt = torch.float32 if native else torch.bfloat16
        kernels = block.mlp.kernels if native else None
        qn, kn = a.q_norm, a.k_norm
        qn, kn = (None, None) if qn is None else (qn.weight, kn.weight)
        extra = (a.bias, qn, kn)
        layers.append(FusedLayer(norm1, qkv, o, norm2, gate_up, down, dt, kernels, *extra))
    return layers


def plain(c) -> bool:
    """Whether a model's blocks are the ones the loop does: Llama's, with Qwen's Q/K/V biases
    and Q/K norms (Gemma 3's sandwich norms, GeGLU and softmax scale take the modules)."""
    return not (c.sandwich_norms or c.act != "silu" or c.attn_scale)


def _qk_extras(L: FusedLayer, q, k, v, eps: float, kernels):
    """The biases and per-head norms of Q and K (V's bias) after the Q/K/V product, as the
    modules do them (kvrun.models.model.Attention)."""
    if L.bias is not None:
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
        bq, bk, bv = L.bias.split([hq * d, hkv * d, hkv * d])
        q, k, v = q + bq.view(hq, 1, d), k + bk.view(hkv, 1, d), v + bv.view(hkv, 1, d)
    if L.q_norm is not None:
        q = rms_norm(q.contiguous(), L.q_norm, eps, kernels=kernels)
        k = rms_norm(k.contiguous(), L.k_norm, eps, kernels=kernels)
    return q, k, v


def takes(x: torch.Tensor, layers: list[FusedLayer] | None = None) -> bool:
    """Whether the loop serves these embeddings (B, T, dim): decode rows, float32; up to a
    decode step's rows (int4 op), or as many as the native products take (native)."""
    B, T, _ = x.shape
    rows = qblocks.native_rows() if layers and layers[0].kernels is not None else DECODE_ROWS
    return T == 1 and B <= rows and x.dtype == torch.float32


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out=None, kernels=None) -> torch.Tensor:
    """RMSNorm of float32 x (..., dim) (into `out` when given: the cast to its dtype is the
    product's own). The rows of a decode step on CPU take their sums of squares as numbers:
    3 ops where F.rms_norm makes ~7 (~0.5 ms a step of the default model, 61 norms), or one
    native op where the model's products run natively (`kernels`). A row comes out the same
    alone and among others (`--parallel` keeps the tokens of N = 1)."""
    dim = x.shape[-1]
    rows = x.numel() // dim
    if kernels is not None and rows <= qblocks.native_rows() and x.device.type == "cpu":
        y = kernels.rmsnorm(x.contiguous(), w, eps)
        return y if out is None else out.copy_(y)
    if rows > DECODE_ROWS or x.device.type not in READ_BACK:
        y = F.rms_norm(x, (dim,), w, eps)
        return y if out is None else out.copy_(y)
    x2 = x.reshape(rows, dim)  # 2-D for any row count: a 1-D vecdot sums in another order
    ms = [s / dim + eps for s in torch.linalg.vecdot(x2, x2).tolist()]
    scale = [m**-0.5 if m > 0 else math.inf for m in ms]  # 0 ** -0.5 raises in Python
    if rows > 1:  # each factor rounded to float32 as a number is when it multiplies
        scale = torch.tensor(scale, dtype=x.dtype).view(*x.shape[:-1], 1)
    else:
        scale = scale[0]
    return torch.mul(torch.mul(x, w), scale, out=out)


def blocks(model, layers: list[FusedLayer], x: torch.Tensor, positions, kv) -> torch.Tensor:
    """x (B, 1, dim) through every block: the arithmetic of Block.forward (float32 residual
    and norms; bfloat16 into and out of the int4 op, as `PackedLinear.matmul` casts; float32
    through the native kernels)."""
    c = model.config
    B, T, dim = x.shape
    hq, hkv, d = c.n_heads, c.n_kv_heads, c.head_dim
    eps = c.norm_eps
    dt, kernels = layers[0].dt, layers[0].kernels
    if kernels is not None:
        return _native_blocks(model, layers, x, positions, kv, kernels)
    h = torch.empty(B, T, dim, dtype=dt)  # each norm's output, the products' input
    h2 = h.view(B * T, dim)
    for i, L in enumerate(layers):
        rms_norm(x, L.norm1, eps, out=h)
        heads = L.qkv(h2).to(torch.float32).view(B, T, -1, d).transpose(1, 2)  # (B, H, T, D)
        q, k, v = heads[:, :hq], heads[:, hq : hq + hkv], heads[:, hq + hkv :]  # Hq, Hkv, Hkv
        if L.bias is not None or L.q_norm is not None:
            q, k, v = _qk_extras(L, q, k, v, eps, None)
        out = kv.attend(i, q, k, v, positions)  # (B, Hq, T, D)
        out = out.transpose(1, 2).reshape(B * T, hq * d).to(dt)
        x = torch.add(x, L.o(out).view(B, T, dim))  # float32 + bfloat16 -> float32
        rms_norm(x, L.norm2, eps, out=h)
        gate, up = L.gate_up(h2).chunk(2, dim=-1)  # (B T, ffn) each, bfloat16
        x = torch.add(x, L.down(F.silu(gate).mul_(up)).view(B, T, dim))
    return x


def _native_blocks(model, layers: list[FusedLayer], x: torch.Tensor, positions, kv, kernels):
    """`blocks` for native products: a layer is two native calls around the KV manager's
    attention (kernels/cpu/qops.cpp attn_in, attn_out), doing Block.forward's arithmetic op for
    op (the modules call the same native norms, products and SiLU x up)."""
    c = model.config
    B, T, dim = x.shape
    hq, hkv = c.n_heads, c.n_kv_heads
    eps = c.norm_eps
    x2 = x.view(B * T, dim)
    attn_in, attn_out = kernels.attn_in, kernels.attn_out
    for i, L in enumerate(layers):
        qkv, o, gu, dn = L.qkv, L.o, L.gate_up, L.down
        q, k, v = attn_in(x2, L.norm1, eps, qkv.ws, qkv.codes, qkv.rows, hq, hkv)
        if L.bias is not None or L.q_norm is not None:
            q, k, v = _qk_extras(L, q, k, v, eps, kernels)
        out = kv.attend(i, q, k, v, positions)  # (B, Hq, 1, D)
        mlp = (gu.ws, gu.codes, gu.rows, dn.ws, dn.codes, dn.rows)
        x2 = attn_out(x2, out, o.ws, o.codes, o.rows, L.norm2, eps, *mlp)
    return x2.view(B, T, dim)
