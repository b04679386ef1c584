"""The decoder: embed -> blocks -> norm -> head. Attention goes through a KV manager.

Llama's blocks, with what the other families add switched on by the config: Q/K/V biases
(Qwen 2), per-head Q/K norms (Qwen 3, Gemma 3), norms after attention and the MLP, GeGLU, a
scaled embedding, Gemma's softmax scale and soft-capped logits (Gemma 3), partial rotary
(Phi-4-mini), and one RoPE per kind of layer (Gemma 3's local and global layers)."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from ..quant import blocks
from ..quant.blocks import BlockEmbedding, BlockLinear, Blocks
from ..quant.choice import matmul_path
from ..quant.linear import DequantBuffers, PackedEmbedding, PackedLinear
from ..quant.packed import Packed
from . import fused_decode
from .config import ModelConfig
from .rope import Rope, RopeSet, inverse_frequencies, magnitudes, rotary_order

ROPE_KEY = "rope.inv_freq"  # RoPE's inverse frequencies among the tensors of `state()`
ROPE_LOCAL_KEY = "rope.local_inv_freq"  # Gemma 3's local layers' own


def release_freed_memory() -> None:
    """Hand memory freed by the conversion back to the OS (glibc keeps freed blocks under its
    mmap threshold in the heap: ~1.4 GB of them after packing an 8B model). No-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernels = None  # the native step kernels, in models whose products run natively

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 as the reference implementations do, then cast back.
        if x.dtype == torch.float32:  # as the fused decode does (a step runs 61 of these)
            return fused_decode.rms_norm(x, self.weight, self.eps, kernels=self.kernels)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _bf16_op(mod: nn.Module, x: torch.Tensor) -> bool:
    """Whether mod's product of x runs through the CPU int4 op and its bfloat16 result can
    go straight into the residual add (which promotes it to x's float32, or keeps bfloat16;
    a float16 x would be promoted to float32, so it keeps the cast)."""
    rows = x.numel() // x.shape[-1]
    ok = x.dtype in (torch.float32, torch.bfloat16)
    return ok and type(mod) is PackedLinear and mod.bf16_op(rows)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        self.c, self.layer = c, layer
        self.q_proj = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.qkv: PackedLinear | BlockLinear | None = None  # Q, K, V stacked (`fuse`)
        n_qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        # Qwen 2: the Q, K, V biases, stacked (the loaders' q/k/v_proj.bias, `from_weights`)
        self.bias = nn.Parameter(torch.zeros(n_qkv)) if c.qkv_bias else None
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else None
        # Gemma 3's softmax scale, folded into Q (the managers attend at 1/sqrt(head_dim))
        self.q_scale = None if c.attn_scale is None else c.attn_scale * c.head_dim**0.5

    def fuse(self) -> None:
        """Stack packed Q, K, V into one layer where they are packed alike (or all blocks)."""
        mods = [self.q_proj, self.k_proj, self.v_proj]
        self.qkv = PackedLinear.stack(mods) or BlockLinear.stack(mods)
        if self.qkv is not None:
            self.q_proj = self.k_proj = self.v_proj = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.c
        kvd = c.n_kv_heads * c.head_dim
        if self.qkv is not None:
            qkv = self.qkv(x)
            if self.bias is not None:
                qkv = qkv + self.bias
            q, k, v = qkv.split([c.n_heads * c.head_dim, kvd, kvd], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            if self.bias is not None:
                bq, bk, bv = self.bias.split([c.n_heads * c.head_dim, kvd, kvd])
                q, k, v = q + bq, k + bk, v + bv
        q = q.view(B, T, c.n_heads, c.head_dim)
        k = k.view(B, T, c.n_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.q_scale is not None:
            q = q * self.q_scale
        q = q.transpose(1, 2)  # (B, Hq, T, D)
        k = k.transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        out = kv.attend(self.layer, q, k, v, positions)  # (B, Hq, T, D)
        out = out.transpose(1, 2).reshape(B, T, c.n_heads * c.head_dim)
        if _bf16_op(self.o_proj, out):  # bfloat16 out: the residual add promotes it
            return self.o_proj.matmul(out.to(torch.bfloat16))
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.up_proj = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.down_proj = nn.Linear(c.ffn_dim, c.dim, bias=False)
        self.gate_up: PackedLinear | BlockLinear | None = None  # gate and up stacked (`fuse`)
        self.kernels = None  # the native step kernels, in models whose products run natively
        self.gelu = c.act == "gelu_tanh"  # Gemma's GeGLU (tanh GELU), else SiLU

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)

    def fuse(self) -> None:
        """Stack packed gate and up into one layer where they are packed alike (or all blocks)."""
        mods = [self.gate_proj, self.up_proj]
        self.gate_up = PackedLinear.stack(mods) or BlockLinear.stack(mods)
        if self.gate_up is not None:
            self.gate_proj = self.up_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up
        if gu is not None and _bf16_op(gu, x) and _bf16_op(self.down_proj, x):
            # both products through the CPU int4 op, which works in bfloat16 anyway: the
            # activation stays bfloat16 between them (silu and the product rounded there)
            # and the residual add promotes the bfloat16 result
            gate, up = gu.matmul(x.to(torch.bfloat16)).chunk(2, dim=-1)
            return self.down_proj.matmul(self.act(gate).mul_(up))
        rows = x.numel() // x.shape[-1]
        if gu is not None and self.kernels is not None and rows <= blocks.native_rows():
            return self.down_proj(self.kernels.silu_mul(gu(x)))  # as the fused decode does
        if gu is not None:
            gate, up = gu(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class Block(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.self_attn = Attention(c, layer)
        # Llama: the norm before the MLP; Gemma 3 (sandwich norms): the norm of attention's
        # output, with two more around the MLP (HF's names, each family's own meaning)
        self.post_attention_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.sandwich = c.sandwich_norms
        if c.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(c.dim, c.norm_eps)
            self.post_feedforward_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
        # the branches may return bfloat16 (products of the CPU int4 op): x keeps its dtype
        if self.sandwich:
            a = self.self_attn(self.input_layernorm(x), positions, kv)
            x = torch.add(x, self.post_attention_layernorm(a))
            m = self.mlp(self.pre_feedforward_layernorm(x))
            return torch.add(x, self.post_feedforward_layernorm(m))
        x = torch.add(x, self.self_attn(self.input_layernorm(x), positions, kv))
        return torch.add(x, self.mlp(self.post_attention_layernorm(x)))


class Decoder(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        # given a weight, nn.Embedding skips its normal_ init: on the meta device that init
        # goes through torch._refs and imports torch._dynamo (~1.5 s of every model load)
        self.embed_tokens = nn.Embedding(
            c.vocab_size, c.dim, _weight=torch.empty(c.vocab_size, c.dim)
        )
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)


class Transformer(nn.Module):
    """The one decoder every family runs on (switched by ModelConfig's fields), with HF
    parameter names."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.model = Decoder(c)
        self.lm_head = None if c.tie_embeddings else nn.Linear(c.dim, c.vocab_size, bias=False)
        self.rope: Rope | None = None
        self._fused: list | None | bool = False  # fused_decode.bind's layers; False: not bound
        # a packed-cache load's weights on their way into huge pages (kvrun.models.model_cache)
        self.adopt = None
        self.use_fused_decode = True  # False: decode steps go through the modules (to compare)

    def _apply(self, fn, recurse=True):
        self._fused = False  # .to() / .cuda(): the bound tensors are stale
        self.adopt = None  # and the mapped ones are no longer the model's
        return super()._apply(fn, recurse)

    @classmethod
    def from_weights(
        cls,
        config: ModelConfig,
        tensors: dict,
        device: str | torch.device = "cpu",
        consume: bool = False,
    ):
        """Build on `device` from a canonical state dict: dense tensors already in the compute
        dtype, linear weights and embeddings dense, `Packed` or `Blocks` (GGUF blocks, moved
        into the native kernels' interleaved layout here).

        consume: the dict is emptied as the model takes the tensors over, so nothing else
        holds the file's packed codes while they are converted block by block (the loaders
        pass it; without it a packed model sits in memory twice during the conversion)."""
        tensors = tensors if consume else dict(tensors)
        rope_freqs = tensors.pop("rope_freqs", None)
        _stack_biases(tensors, config)
        _rotary_rows(tensors, config)
        dtype = tensors["model.norm.weight"].dtype
        packed = [k for k in tensors if isinstance(tensors[k], (Packed, Blocks))]
        with torch.device("meta"):
            m = cls(config)
        scratch = DequantBuffers()  # one set of dequantization buffers for every packed layer
        for name in packed:  # popped one by one: the module holds the only reference
            parent, _, attr = name.removesuffix(".weight").rpartition(".")
            w = tensors.pop(name)
            if isinstance(w, Blocks):
                kind = BlockEmbedding if attr == "embed_tokens" else BlockLinear
                mod = kind([w], dtype, scratch)
            else:
                kind = PackedEmbedding if attr == "embed_tokens" else PackedLinear
                mod = kind(w, dtype, scratch)
            setattr(m.get_submodule(parent), attr, mod)
        missing, unexpected = m.load_state_dict(tensors, assign=True, strict=False)
        missing = [k for k in missing if k.rpartition(".")[0] + ".weight" not in packed]
        if missing or unexpected:
            raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        tensors.clear()
        m = m.to(device).eval().requires_grad_(False)
        device = torch.device(device)
        int4 = bool(packed) and matmul_path(device.type, dtype) == "int4pack"
        # stack and convert a block at a time, so the scratch of one conversion is all
        # that ever sits beside the packed model
        for block in m.model.layers if packed else []:
            block.self_attn.fuse()
            block.mlp.fuse()
            for mod in block.modules():
                if int4 and isinstance(mod, PackedLinear):
                    mod.use_int4pack()  # where the shape allows; the others stay 'dequant'
                elif isinstance(mod, BlockLinear):
                    mod.interleave()  # where the native kernels have a layout for the type
            release_freed_memory()
        # an untied embedding table only gathers rows, so it keeps the canonical codes
        head = m.model.embed_tokens if m.lm_head is None else m.lm_head
        if int4 and isinstance(head, PackedLinear):
            head.use_int4pack()
            release_freed_memory()
        elif isinstance(head, BlockLinear):
            head.interleave()
        m.rope = _ropes(config, inverse_frequencies(config, rope_freqs), None, device, dtype)
        m.use_native_step()
        return m

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Every tensor this model holds (its state dict and RoPE's inverse frequencies), and
        the layout that `from_state` rebuilds it from: each packed layer's facts and the
        submodules stacking emptied (kvrun/models/model_cache.py keeps the two on disk)."""
        tensors = {**self.state_dict(), ROPE_KEY: self.rope.inv_freq}
        if isinstance(self.rope, RopeSet):
            tensors[ROPE_LOCAL_KEY] = self.rope.local_inv
        packed = {
            n: m.facts()
            for n, m in self.named_modules()
            if isinstance(m, (PackedLinear, BlockLinear))
        }
        empty = [
            f"{name}.{attr}" if name else attr
            for name, mod in self.named_modules()
            for attr, child in mod._modules.items()
            if child is None
        ]
        return tensors, {"packed": packed, "empty": empty}

    @classmethod
    def from_state(cls, config: ModelConfig, tensors: dict[str, torch.Tensor], layout: dict):
        """The model `state()` gave these tensors and layout for (CPU, in their dtype; the
        tensors are taken as they are, e.g. views of a memory-mapped file). Raises KeyError,
        RuntimeError or ValueError where they do not fit the config."""
        tensors = dict(tensors)
        inv_freq = tensors.pop(ROPE_KEY)
        local_inv = tensors.pop(ROPE_LOCAL_KEY, None)
        if not any(k.startswith("lm_head.") for k in tensors):  # as the loaders decided
            config = config.replace(tie_embeddings=True)
        dtype = tensors["model.norm.weight"].dtype
        with torch.device("meta"):
            m = cls(config)
        for name in layout["empty"]:
            parent, _, attr = name.rpartition(".")
            setattr(m.get_submodule(parent), attr, None)
        scratch = DequantBuffers()
        for name, facts in layout["packed"].items():
            parent, _, attr = name.rpartition(".")
            prefix = f"{name}."
            bufs = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
            if facts["kind"].startswith("block"):
                mod = BlockLinear.restore(facts, bufs, dtype, scratch)
            else:
                mod = PackedLinear.restore(facts, bufs, dtype, scratch)
            setattr(m.get_submodule(parent), attr, mod)
        m.load_state_dict(tensors, assign=True, strict=True)
        m = m.eval().requires_grad_(False)
        for mod in m.modules():
            if isinstance(mod, (PackedLinear, BlockLinear)):
                mod._bind()  # the op's arguments from the buffers as assigned
        m.rope = _ropes(config, inv_freq, local_inv, torch.device("cpu"), dtype)
        m.use_native_step()
        return m

    def use_context(self, n: int) -> None:
        """LongRoPE (Phi-3): rotate with the long factors when the run's context exceeds the
        original one, else the short ones (llama.cpp's rule, by the context a run allows;
        transformers switches by the sequence's length instead). Call before any cache is
        filled: keys already in a cache keep the rotation they were stored with."""
        s = self.config.rope_scaling
        if s is None or s.kind != "longrope" or isinstance(self.rope, RopeSet):
            return
        inv = inverse_frequencies(self.config, long=n > s.original_context)
        if not torch.equal(inv.to(self.rope.inv_freq.device), self.rope.inv_freq):
            kernels = self.rope.kernels
            self.rope = _ropes(self.config, inv, None, self.device, self.dtype)
            self.rope.kernels = kernels

    def use_native_step(self) -> None:
        """Where every product runs through the native CPU kernels (GGUF blocks, float32), the
        rest of a decode step does too: RMSNorm, RoPE, SiLU x up and attention over dense
        float32 K/V (kernels/cpu/qstep.h). Other models (dense weights: the exact path; the
        int4 op) keep torch's ops, bit for bit as before."""
        mods = [m for m in self.modules() if isinstance(m, (nn.Linear, PackedLinear, BlockLinear))]
        native = (
            self.dtype == torch.float32
            and bool(mods)
            and all(type(m) in (BlockLinear, BlockEmbedding) and m._native_ok for m in mods)
        )
        from ..quant import native as native_kernels

        kernels = native_kernels.ops() if native else None
        self.rope.kernels = kernels
        for m in self.modules():
            if isinstance(m, RMSNorm) or (isinstance(m, MLP) and not m.gelu):
                m.kernels = kernels

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def head(self, x: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """The output projection (the embedding table when tied). decode: x holds one row per
        sequence of a decode step (a batch of them may take the fast products; prefill rows,
        whose logits are measured, stay exact beyond a decode step's rows)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        if isinstance(head, BlockLinear):
            logits = head.logits(x, decode)
        elif isinstance(head, PackedLinear):
            logits = head.logits(x)
        else:
            logits = F.linear(x, head.weight)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
        """The hidden states (B, T, dim) after the last block, before the final norm: the fused
        blocks for decode rows where they apply (kvrun/models/fused_decode.py), else the modules."""
        x = self.model.embed_tokens(tokens)  # (B, T, dim)
        if self.config.embed_scale != 1.0:  # Gemma: sqrt(dim), in the compute dtype as HF's
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        if self._fused is False:
            self._fused = fused_decode.bind(self)
        if self._fused and self.use_fused_decode and fused_decode.takes(x, self._fused):
            return fused_decode.blocks(self, self._fused, x, positions, kv)
        for block in self.model.layers:
            x = block(x, positions, kv)
        return x

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, kv, last_only: bool = False
    ) -> torch.Tensor:
        """Logits (B, T, V) for tokens (B, T) at positions (T,), or (B, T) when each row is its
        own sequence (kv is then a kvrun.run.step.BatchKV); only the last row if asked."""
        if self.adopt is not None:  # copies read since the last pass take their tensors' place
            self.adopt = self.adopt.take()
        x = self.hidden(tokens, positions, kv)
        if last_only:
            x = x[:, -1:]
        return self.head(self.model.norm(x), decode=tokens.shape[1] == 1).float()  # (B, T, V)


def _stack_biases(tensors: dict, c: ModelConfig) -> None:
    """The loaders' q/k/v_proj.bias of each layer as the one stacked `self_attn.bias`."""
    if not c.qkv_bias:
        return
    for i in range(c.n_layers):
        pre = f"model.layers.{i}.self_attn."
        if f"{pre}bias" in tensors:  # stacked already (a state dict of this model)
            continue
        parts = [tensors.pop(f"{pre}{p}_proj.bias") for p in "qkv"]
        tensors[f"{pre}bias"] = torch.cat(parts)


def _rotary_rows(tensors: dict, c: ModelConfig) -> None:
    """Under partial rotary, Q and K's head dims in the order kvrun's RoPE pairs them
    (kvrun.models.rope.rotary_order), in the weights, biases and norms alike."""
    order = rotary_order(c)
    if order is None:
        return
    for i in range(c.n_layers):
        pre = f"model.layers.{i}.self_attn."
        for part, heads in (("q", c.n_heads), ("k", c.n_kv_heads)):
            rows = (torch.arange(heads)[:, None] * c.head_dim + order[None, :]).flatten()
            name = f"{pre}{part}_proj.weight"
            w = tensors[name]
            tensors[name] = w.rows(rows) if isinstance(w, (Packed, Blocks)) else w[rows]
            if c.qk_norm:
                tensors[f"{pre}{part}_norm.weight"] = tensors[f"{pre}{part}_norm.weight"][order]
        if c.qkv_bias:
            b = tensors[f"{pre}bias"]
            hq, hk = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
            qr = (torch.arange(c.n_heads)[:, None] * c.head_dim + order[None, :]).flatten()
            kr = (torch.arange(c.n_kv_heads)[:, None] * c.head_dim + order[None, :]).flatten()
            tensors[f"{pre}bias"] = torch.cat([b[:hq][qr], b[hq : hq + hk][kr], b[hq + hk :]])


def _ropes(
    c: ModelConfig,
    inv: torch.Tensor,
    local_inv: torch.Tensor | None,
    device: torch.device | str,
    dtype: torch.dtype,
) -> Rope | RopeSet:
    """The model's RoPE, or Gemma 3's two (its local layers' own base, unscaled)."""
    device = torch.device(device)
    mag = magnitudes(c)
    rope = Rope(inv, device, dtype, None if bool((mag == 1).all()) else mag)
    if not c.local_layers or c.rope_local_theta is None:
        return rope
    if local_inv is None:
        local_inv = inverse_frequencies(c, local=True)
    return RopeSet(rope, Rope(local_inv, device, dtype), c.local_layers)
