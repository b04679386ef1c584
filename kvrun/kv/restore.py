"""MiniCache's restore of merged tokens (MiniCache §4.2, Eq. 2): the Layout of a pair's
groups over the KV heads and what depends only on it and the pair: the dense restore
X_hat = E * n / ||E|| with the retained rows put back, and merged_decode's arguments (the
override maps and scales). PairLayer is one layer's view of a pair as a Store
(kvrun/kv/protocol.py): it attends over the merged tokens, restoring them inside
merged_decode or into a scratch shared by every pair; layer a's work is kept on the pair
for layer b. The merge math and the pair store are kvrun/kv/merged.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..kernels import use_triton
from ..kernels.dense_decode import dense_decode
from ..kernels.merged_decode import merged_decode
from .attention import Partial, dense_attention, segment_attention
from .merged import Half, Pair, direction


@dataclass
class Layout:
    """Groups g of a pair: the KV heads (granularity=head, m = D) or one group over all heads
    of a token (granularity=token, m = Hkv*D); H = n_kv_heads, D = head_dim."""

    token: bool
    H: int
    D: int
    g: int = field(init=False)  # groups per token
    m: int = field(init=False)  # length of one group's vector

    def __post_init__(self):
        self.g, self.m = (1, self.H * self.D) if self.token else (self.H, self.D)

    def half(self, dense_e: bool, thr: float | None, dtype, device) -> Half:
        """An empty merged K or V of this layout (E dense unless a KIVI store holds it)."""
        return Half(self.g, self.m, self.H, self.D, dense_e, thr, dtype, device)

    def groups(self, x: torch.Tensor) -> torch.Tensor:
        """(Hkv, T, D) -> (g, T, m): per head, or all heads of a token in one row."""
        return x.transpose(0, 1).reshape(1, x.shape[1], -1) if self.token else x

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """(g, T, m) -> (Hkv, T, D), the inverse of groups."""
        return x.reshape(x.shape[1], self.H, self.D).transpose(0, 1) if self.token else x

    # --------------------------------------------------------------- restore
    def directions(self, pair: Pair) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit directions (g, T, m) fp32 of the pair's merged K and V (dequantized for KIVI)."""
        if pair.kivi is not None:
            ek, ev = pair.kivi.dequantized()  # (Hkv, T, D) fp32 each
        else:
            ek, ev = pair.k.e.data, pair.v.e.data
        return direction(self.groups(ek)), direction(self.groups(ev))

    def restore_into(self, pair: Pair, second: bool, dirs, out_k, out_v) -> None:
        """Write X_hat of layer b (second) or a into out_k, out_v (Hkv, T, D): direction times
        the layer's own norm, then the retained rows put back exactly."""
        for half, u, out in ((pair.k, dirs[0], out_k), (pair.v, dirs[1], out_v)):
            n = (half.nb if second else half.na).data.unsqueeze(-1)  # (g, T, 1)
            if self.token:
                out.copy_(self.heads(u * n))
            else:
                torch.mul(u, n, out=out)
            rows = half.rb if second else half.ra  # (N_r, m)
            if rows.shape[0]:
                idx = half.ridx.long()
                if self.token:
                    out[:, idx] = rows.view(-1, self.H, self.D).transpose(0, 1).to(out.dtype)
                else:
                    out[half.groups(), idx] = rows.to(out.dtype)

    def restored(self, pair: Pair, second: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
        """X_hat of layer b (second) or a, (Hkv, T, D) fp32 K and V, in new tensors."""
        out_k = torch.zeros(self.H, pair.length, self.D, device=device)
        out_v = torch.zeros_like(out_k)
        if pair.length:
            self.restore_into(pair, second, self.directions(pair), out_k, out_v)
        return out_k, out_v

    # ------------------------------------------------------- merged_decode
    def own(self, qr, kr, v) -> Partial:
        """Attention of the step's queries over their own exact tokens, causal: a single token
        is its own softmax (out = v, lse = the score), several go through dense_decode."""
        if kr.shape[2] > 1:
            return Partial(*dense_decode(qr, kr, v, causal_offset=0))
        g = qr.shape[1] // self.H
        qg = qr.float().reshape(1, self.H, g, self.D)  # (1, Hkv, g, D)
        s = (qg * kr.float().reshape(1, self.H, 1, self.D)).sum(-1) / math.sqrt(self.D)
        out = v.float().repeat_interleave(g, dim=1)  # (1, Hq, 1, D)
        return Partial(out, s.reshape(1, self.H * g, 1))

    def override(self, half: Half, T: int):
        """(map (Hkv, T) int32 | None, 1/||E|| fp32 | None) of one half, for layers a and b:
        the map gives each retained (head, token) its row (-1: restore); 1/||E|| per token
        (T,) for granularity=token, per (head, token) (Hkv, T) where the torch reference runs
        (computed once here instead of in both layers). Scratch for a step, not in nbytes."""
        e, inv = half.e.data, None  # (Hkv, T, D)
        if self.token or not use_triton(e):
            n = torch.linalg.vector_norm(e.float(), dim=(0, 2) if self.token else -1)
            inv = 1 / torch.where(n > 0, n, 1.0)
        N = half.ridx.numel()
        if N == 0:
            return None, inv
        ov = torch.full((self.H, T), -1, dtype=torch.int32, device=e.device)
        r = torch.arange(N, dtype=torch.int32, device=e.device)
        idx = half.ridx.long()
        if self.token:  # row r of head h is r * Hkv + h
            h = torch.arange(self.H, dtype=torch.int32, device=e.device)
            ov[:, idx] = r[None, :] * self.H + h[:, None]
        else:
            ov[half.groups(), idx] = r
        return ov, inv

    def fused_args(self, half: Half, work, second: bool):
        """(scale (Hkv, T), map, rows (N, D), unit) of one half of layer b (second) or a, for
        merged_decode; work = (map, 1/||E|| or None) from override."""
        ov, inv = work
        norms = (half.nb if second else half.na).data  # (g, T)
        rows = (half.rb if second else half.ra) if ov is not None else None  # (N_r, m)
        if self.token:  # rows (N_r, Hkv*D) read as (N_r*Hkv, D)
            rows = rows.reshape(-1, self.D) if rows is not None else None
            return (norms[0].float() * inv).expand(self.H, -1), ov, rows, False
        if inv is None:  # the Triton kernel divides by ||E|| in registers
            return norms, ov, rows, True
        return norms.float() * inv, ov, rows, False  # (Hkv, T): n / ||E||


class Scratch:
    """The restore scratch K, V (1, Hkv, cap, D) in the KV dtype, reused by every pair."""

    def __init__(self, H: int, D: int, dtype, device):
        self.H, self.D, self.dtype, self.device = H, D, dtype, device
        self.k = self.v = None

    def views(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None or self.k.shape[2] < n:
            cap = max(n, 2 * (self.k.shape[2] if self.k is not None else 0), 256)
            self.k = torch.empty(1, self.H, cap, self.D, dtype=self.dtype, device=self.device)
            self.v = torch.empty_like(self.k)
        return self.k[:, :, :n], self.v[:, :, :n]


class PairLayer:
    """Layer a (second=False) or b of a MiniCache pair, as a Store: the pair's merged tokens
    restored with this layer's norms and retained rows. Both views share the pair, whose
    bytes count once, at layer a."""

    def __init__(self, pair: Pair, second: bool, layout: Layout, scratch: Scratch):
        self.pair, self.second, self.layout, self.scratch = pair, second, layout, scratch

    @property
    def length(self) -> int:
        return self.pair.length

    def nbytes(self) -> int:
        return 0 if self.second else self.pair.nbytes()

    def partials(self, q, q_pos, n_new: int, window: int | None) -> list[Partial]:
        """Attention of q (1, Hq, Tq, D) over the merged tokens, all visible (n_new = 0: the
        step's own tokens are not merged yet): restored inside merged_decode over a dense E,
        else over the dense restore."""
        pair, lay = self.pair, self.layout
        if pair.length == 0:
            return []
        if pair.kivi is not None:  # E dequantized into the scratch
            ks, vs = self.restore(0)
            return [segment_attention(q, ks, vs, None)]
        if pair.fwork is None:  # layer a builds, b reuses
            pair.fwork = [lay.override(h, pair.length) for h in (pair.k, pair.v)]
        wk, wv = pair.fwork
        sk, ok, rk, unit = lay.fused_args(pair.k, wk, self.second)
        sv, ov, rv, _ = lay.fused_args(pair.v, wv, self.second)
        return [
            Partial(*merged_decode(q, pair.k.e.data, sk, pair.v.e.data, sv, unit, ok, rk, ov, rv))
        ]

    def restore(self, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch views (1, Hkv, T + extra, D): the restored merged tokens, room for `extra`."""
        n, pair = self.pair.length, self.pair
        ks, vs = self.scratch.views(n + extra)
        if n:
            if pair.work is None:  # layer a computes, b reuses
                pair.work = self.layout.directions(pair)
            self.layout.restore_into(pair, self.second, pair.work, ks[0, :, :n], vs[0, :, :n])
        return ks, vs

    def attend(self, q, k_new, v_new, positions, window: int | None) -> torch.Tensor:
        """SDPA of q over the restored merged tokens and the exact k_new, v_new (1, Hkv, n, D)
        after them (slot index = position)."""
        ks, vs = self.restore(k_new.shape[2])
        ks[:, :, self.pair.length :], vs[:, :, self.pair.length :] = k_new, v_new
        k_pos = torch.arange(ks.shape[2], device=ks.device)
        return dense_attention(q, ks, vs, positions, k_pos, window)

    def restored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's cache as attention sees it, (Hkv, T, D) fp32 K and V (tests)."""
        return self.layout.restored(self.pair, self.second, self.scratch.device)
