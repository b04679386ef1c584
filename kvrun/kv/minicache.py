"""MiniCache (methods/minicache.md): adjacent upper layers share one merged KV direction.

Pairs (l-1, l), odd l >= S, keep per token and KV head one SLERP-merged direction E (for K and
for V), each layer's own norm, and the most distinct rows of both layers exactly (retention).
Attention restores X_hat = E * n / ||E|| with the retained rows put back: at decode over a
dense E inside kernels.merged_decode, else into a scratch before SDPA. Other layers keep a
plain cache. Prefill attends exactly; each turn's tokens are merged at end_prefill; a decode
token is merged as soon as layer l has attended. E and the unpaired layers may sit in a KIVI
store (minicache+kivi4), norms and retained rows stay in the KV dtype.

Spec decisions beyond the paper: norm, angle and retention per (token, KV head) (granularity=
token: per token over all heads); decode tokens are merged with both norms appended and never
retained (decode_retain=1: beyond the prefill threshold); merging is fp32 and E is quantized
after it. Slot index = position (nothing is evicted), so a sliding window masks by position.
"""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig
from ..errors import KvrunError
from ..kernels import use_triton
from ..kernels.dense_decode import dense_decode
from ..kernels.merged_decode import merged_decode
from ..rope import Rope
from .attention import Partial, combine, dense_attention
from .base import KVManager
from .buffer import Buffer
from .kivi import KiviLayer
from .merged import Half, Pair, direction, merge, pairing, retention
from .spec import KVSpec

# --- the manager ---------------------------------------------------------------------------------


class MiniCacheKV(KVManager):
    """Cross-layer merged KV cache (methods/minicache.md), optionally on a KIVI store."""

    def __init__(
        self,
        spec: KVSpec,  # takes no budget (the spec refuses one)
        config: ModelConfig,
        rope: Rope,
        device: torch.device,
        dtype: torch.dtype,
        on_select=None,  # the selection debug hook: MiniCache selects no tokens, unused
    ):
        super().__init__(config, rope, device, dtype)
        self.spec, self.name = spec, spec.name
        o = spec.select_opts
        self.t, self.gamma, self.sin_eps = float(o["slerp_t"]), float(o["gamma"]), o["sin_eps"]
        self.rule, self.retain = o["retain_rule"], o["retain"]
        self.token = o["granularity"] == "token"
        self.decode_retain = bool(o["decode_retain"])
        kv = spec.kivi()
        self.kv_layout = kv if kv is not None and kv["bits"] != 16 else None
        c = config
        self.H, self.D = c.n_kv_heads, c.head_dim
        self.g, self.m = (1, self.H * self.D) if self.token else (self.H, self.D)
        self.pair_list = pairing(c.n_layers, o["start"])
        self.role = {}  # layer -> (pair number, is the later layer l)
        for i, (a, b) in enumerate(self.pair_list):
            self.role[a], self.role[b] = (i, False), (i, True)
        self._fused = True  # decode via merged_decode where it applies (False: tests, the check)
        self.reset()

    # ------------------------------------------------------------------ state
    def _kivi(self) -> KiviLayer | None:
        kv = self.kv_layout
        if kv is None:
            return None
        try:
            return KiviLayer(
                self.H, self.D, kv["bits"], kv["group"], kv["residual"], self.dtype, self.device
            )
        except ValueError as e:
            raise KvrunError(f"{self.name}: {e}") from None

    def reset(self) -> None:
        super().reset()
        plain = [i for i in range(self.config.n_layers) if i not in self.role]
        shape = (1, self.H, 0, self.D)
        if self.kv_layout is None:  # dense K, V (1, Hkv, T, D) each
            dense = lambda: Buffer(shape, 2, self.dtype, self.device)  # noqa: E731
            self.plain = {i: (dense(), dense()) for i in plain}
        else:
            self.plain = {i: self._kivi() for i in plain}
        self.pairs = [Pair(a, b, self._kivi()) for a, b in self.pair_list]
        self._work = None  # (pair, (uK, uV)): unit directions shared by layers a and b
        self._fwork = None  # (pair, [K, V] (map, 1/||E||)): merged_decode's, layers a and b
        self._sk = self._sv = None  # restore scratch (1, Hkv, cap, D), reused by every layer

    def begin_prefill(self, n_tokens: int) -> None:
        super().begin_prefill(n_tokens)
        shape, dt, dev = (1, self.H, 0, self.D), self.dtype, self.device
        for p in self.pairs:
            p.pending = None
            p.exact = {
                ly: (Buffer(shape, 2, dt, dev, n_tokens), Buffer(shape, 2, dt, dev, n_tokens))
                for ly in (p.a, p.b)
            }

    # ---------------------------------------------------------------- attend
    def attend(self, layer, q, k, v, positions):
        qr = self.rope.apply(q, positions)  # (1, Hq, T, D)
        kr = self.rope.apply(k, positions)  # (1, Hkv, T, D)
        role = self.role.get(layer)
        if role is None:
            return self._attend_plain(layer, qr, kr, v, positions)
        pair, second = self.pairs[role[0]], role[1]
        if not self.in_prefill and self._fuse(pair, kr.shape[2]):
            out = self._attend_fused(pair, second, qr, kr, v)
        else:
            out = self._attend_restored(pair, layer, second, qr, kr, v, positions)
        if second:
            self._work = self._fwork = None
            if not self.in_prefill:  # merge the pending tokens of layer l-1 with layer l's
                if pair.pending is None:
                    raise RuntimeError(f"minicache: layer {pair.b} ran without layer {pair.a}")
                (ka, va), pair.pending = pair.pending, None
                self._merge(pair, ka[0], va[0], kr[0], v[0], prefill=False)
        elif not self.in_prefill:
            pair.pending = (kr, v)
        return out

    def _attend_restored(self, pair, layer, second, qr, kr, v, positions) -> torch.Tensor:
        """A paired layer over its restored scratch (plus the exact tokens of this turn or
        step) with SDPA: prefill, the KIVI-E store and a sliding window that masks."""
        T, n = kr.shape[2], pair.length
        window = self.config.sliding_window
        if self.in_prefill:
            kb, vb = pair.exact[layer]
            kb.append(kr)
            vb.append(v)
            if n == 0:  # first turn: exact attention over the buffer, as `full`
                k_pos = torch.arange(kb.n, device=self.device)
                return dense_attention(qr, kb.data, vb.data, positions, k_pos, window)
            ks, vs = self._restored(pair, second, kb.n)
            ks[:, :, n:], vs[:, :, n:] = kb.data, vb.data  # this turn's tokens, exact
        else:
            ks, vs = self._restored(pair, second, T)
            ks[:, :, n:], vs[:, :, n:] = kr, v  # the new tokens, exact
        k_pos = torch.arange(ks.shape[2], device=self.device)
        return dense_attention(qr, ks, vs, positions, k_pos, window)

    def _fuse(self, pair: Pair, T: int) -> bool:
        """Whether a decode step of this pair runs merged_decode: a dense E (fusing the KIVI
        dequantization with the restore is not done, minicache+kivi4 restores into the
        scratch), no sliding window that masks (every merged token visible), and something
        to restore: with every row retained (retain=topk:1.0) SDPA over the exact rows keeps
        the spec's bit-exact decode step (minicache.md, "How to test it" 6)."""
        window = self.config.sliding_window
        if not self._fused or pair.kivi is not None or (window and self.seen + T > window):
            return False
        return (
            pair.length == 0 or pair.k.ridx.numel() + pair.v.ridx.numel() < 2 * self.g * pair.length
        )

    def _attend_fused(self, pair: Pair, second: bool, qr, kr, v) -> torch.Tensor:
        """Decode of a paired layer without the restore scratch: merged_decode restores the
        n merged tokens inside the attention, combined with the step's own exact tokens."""
        parts = [self._own(qr, kr, v)]
        if pair.length:
            if self._fwork is None or self._fwork[0] is not pair:  # layer a builds, b reuses
                self._fwork = (pair, [self._override(h, pair.length) for h in (pair.k, pair.v)])
            wk, wv = self._fwork[1]
            sk, ok, rk, unit = self._fused_args(pair.k, wk, second)
            sv, ov, rv, _ = self._fused_args(pair.v, wv, second)
            part = merged_decode(qr, pair.k.e.data, sk, pair.v.e.data, sv, unit, ok, rk, ov, rv)
            parts.insert(0, Partial(*part))
        return combine(parts, self.dtype)

    def _own(self, qr, kr, v) -> Partial:
        """Attention of the step's queries over their own exact tokens, causal: a single token
        is its own softmax (out = v, lse = the score), several go through dense_decode."""
        if kr.shape[2] > 1:
            return Partial(*dense_decode(qr, kr, v, causal_offset=0))
        g = qr.shape[1] // self.H
        qg = qr.float().reshape(1, self.H, g, self.D)  # (1, Hkv, g, D)
        s = (qg * kr.float().reshape(1, self.H, 1, self.D)).sum(-1) / math.sqrt(self.D)
        out = v.float().repeat_interleave(g, dim=1)  # (1, Hq, 1, D)
        return Partial(out, s.reshape(1, self.H * g, 1))

    def _fused_args(self, half: Half, work, second: bool):
        """(scale (Hkv, T), map, rows (N, D), unit) of one half of layer b (second) or a, for
        merged_decode; work = (map, 1/||E|| or None) from _override."""
        ov, inv = work
        norms = (half.nb if second else half.na).data  # (g, T)
        rows = (half.rb if second else half.ra) if ov is not None else None  # (N_r, m)
        if self.token:  # rows (N_r, Hkv*D) read as (N_r*Hkv, D)
            rows = rows.reshape(-1, self.D) if rows is not None else None
            return (norms[0].float() * inv).expand(self.H, -1), ov, rows, False
        if inv is None:  # the Triton kernel divides by ||E|| in registers
            return norms, ov, rows, True
        return norms.float() * inv, ov, rows, False  # (Hkv, T): n / ||E||

    def _override(self, half: Half, T: int):
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
        ov = torch.full((self.H, T), -1, dtype=torch.int32, device=self.device)
        r = torch.arange(N, dtype=torch.int32, device=self.device)
        idx = half.ridx.long()
        if self.token:  # row r of head h is r * Hkv + h
            h = torch.arange(self.H, dtype=torch.int32, device=self.device)
            ov[:, idx] = r[None, :] * self.H + h[:, None]
        else:
            ov[half.groups(), idx] = r
        return ov, inv

    def _attend_plain(self, layer, qr, kr, v, positions) -> torch.Tensor:
        """An unpaired layer: a plain cache (dense or KIVI), every token kept."""
        window = self.config.sliding_window
        st = self.plain[layer]
        if isinstance(st, KiviLayer):
            st.append(kr[0], v[0])
            k_pos = torch.arange(st.length, device=self.device)
            if st.body_len == 0:  # only the dense tail (a one-chunk prefill): as `full`
                tk, tv = st.tail()
                return dense_attention(qr, tk[None], tv[None], positions, k_pos, window)
            if not window or self.seen + kr.shape[2] <= window:
                return combine(st.attend(qr, kr.shape[2]), self.dtype)
            kd, vd = st.dequantized()  # a sliding window: mask by position over the dequantized
            return dense_attention(qr, kd[None].to(self.dtype), vd[None].to(self.dtype),
                                   positions, k_pos, window)  # fmt: skip
        kb, vb = st
        kb.append(kr)
        vb.append(v)
        k_pos = torch.arange(kb.n, device=self.device)
        return dense_attention(qr, kb.data, vb.data, positions, k_pos, window)

    # --------------------------------------------------------------- restore
    def _directions(self, pair: Pair) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit directions (g, T, m) fp32 of the pair's merged K and V (dequantized for KIVI)."""
        if pair.kivi is not None:
            ek, ev = pair.kivi.dequantized()  # (Hkv, T, D) fp32 each
        else:
            ek, ev = pair.k.e.data, pair.v.e.data
        return direction(self._groups(ek)), direction(self._groups(ev))

    def _groups(self, x: torch.Tensor) -> torch.Tensor:
        """(Hkv, T, D) -> (g, T, m): per head, or all heads of a token in one row."""
        return x.transpose(0, 1).reshape(1, x.shape[1], -1) if self.token else x

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """(g, T, m) -> (Hkv, T, D), the inverse of _groups."""
        return x.reshape(x.shape[1], self.H, self.D).transpose(0, 1) if self.token else x

    def _restore_into(self, pair: Pair, second: bool, dirs, out_k, out_v) -> None:
        """Write X_hat of layer b (second) or a into out_k, out_v (Hkv, T, D): direction times
        the layer's own norm, then the retained rows put back exactly."""
        for half, u, out in ((pair.k, dirs[0], out_k), (pair.v, dirs[1], out_v)):
            n = (half.nb if second else half.na).data.unsqueeze(-1)  # (g, T, 1)
            if self.token:
                out.copy_(self._heads(u * n))
            else:
                torch.mul(u, n, out=out)
            rows = half.rb if second else half.ra  # (N_r, m)
            if rows.shape[0]:
                idx = half.ridx.long()
                if self.token:
                    out[:, idx] = rows.view(-1, self.H, self.D).transpose(0, 1).to(out.dtype)
                else:
                    out[half.groups(), idx] = rows.to(out.dtype)

    def _restored(self, pair: Pair, second: bool, extra: int):
        """Scratch views (1, Hkv, T + extra, D): the restored merged tokens, room for `extra`."""
        n = pair.length
        if self._sk is None or self._sk.shape[2] < n + extra:
            cap = max(n + extra, 2 * (self._sk.shape[2] if self._sk is not None else 0), 256)
            self._sk = torch.empty(1, self.H, cap, self.D, dtype=self.dtype, device=self.device)
            self._sv = torch.empty_like(self._sk)
        ks, vs = self._sk[:, :, : n + extra], self._sv[:, :, : n + extra]
        if n:
            if self._work is None or self._work[0] is not pair:  # layer a computes, b reuses
                self._work = (pair, self._directions(pair))
            self._restore_into(pair, second, self._work[1], ks[0, :, :n], vs[0, :, :n])
        return ks, vs

    def restored(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's cache as attention sees it, (Hkv, T, D) fp32 K and V (tests, debugging)."""
        role = self.role.get(layer)
        if role is None:
            st = self.plain[layer]
            if isinstance(st, KiviLayer):
                return st.dequantized()
            return st[0].data[0].float(), st[1].data[0].float()
        pair = self.pairs[role[0]]
        out_k = torch.zeros(self.H, pair.length, self.D, device=self.device)
        out_v = torch.zeros_like(out_k)
        if pair.length:
            self._restore_into(pair, role[1], self._directions(pair), out_k, out_v)
        return out_k, out_v

    # ------------------------------------------------------------------ merge
    def _merge(self, pair: Pair, ka, va, kb, vb, prefill: bool) -> None:
        """Merge tokens of layers a and b, (Hkv, n, D) each, and append them to the pair."""
        n, start = ka.shape[1], pair.length
        if n == 0:
            return
        if pair.k is None:
            never = -math.inf if self.rule == "paper" else math.inf
            thr = never if self.decode_retain else None
            args = (self.g, self.m, self.H, self.D, pair.kivi is None, thr)
            pair.k = Half(*args, self.dtype, self.device)
            pair.v = Half(*args, self.dtype, self.device)
        dirs = []
        for half, xa, xb in ((pair.k, ka, kb), (pair.v, va, vb)):
            ga, gb = self._groups(xa), self._groups(xb)  # (g, n, m)
            e, na, nb, d = merge(ga, gb, self.t, self.sin_eps)
            keep = None
            if prefill:  # retention over this turn's tokens
                keep, thr = retention(d, self.gamma, self.rule, self.retain)
                if half.thr is not None:
                    half.thr = thr
            elif half.thr is not None:  # decode_retain: beyond the prefill threshold
                thr = half.thr.unsqueeze(-1)
                keep = d < thr if self.rule == "paper" else d > thr
            e = self._heads(e)  # (Hkv, n, D) fp32
            if half.e is not None:
                half.e.append(e)
            dirs.append(e)
            half.na.append(na)
            half.nb.append(nb)
            if keep is not None and bool(keep.any()):
                gid, j = keep.nonzero(as_tuple=True)
                half.add(gid, j + start, ga[gid, j], gb[gid, j])
        if pair.kivi is not None:
            pair.kivi.append(dirs[0].to(self.dtype), dirs[1].to(self.dtype))
            if prefill:
                pair.kivi.flush(self.kv_layout["group"])  # prefill flush unit U = G
        pair.length += n

    # ------------------------------------------------------- compression points
    def end_chunk(self, n_tokens: int) -> None:
        super().end_chunk(n_tokens)
        if self.kv_layout is not None:  # prefill flush unit U = G, after the chunk's attention
            for st in self.plain.values():
                st.flush(self.kv_layout["group"])

    def end_prefill(self) -> None:
        for p in self.pairs:
            if p.exact is not None:
                (ka, va), (kb, vb) = p.exact[p.a], p.exact[p.b]
                self._merge(p, ka.data[0], va.data[0], kb.data[0], vb.data[0], prefill=True)
                p.exact = None  # free the exact buffers
        self._work = self._fwork = None
        super().end_prefill()

    def end_step(self) -> None:
        super().end_step()
        if self.kv_layout is not None:
            r = self.kv_layout["residual"]
            stores = list(self.plain.values()) + [p.kivi for p in self.pairs]
            for st in stores:
                if st.tail_len >= r:
                    st.flush(r)

    # ------------------------------------------------------------- accounting
    def nbytes(self) -> int:
        total = 0
        for st in self.plain.values():
            total += st.nbytes() if isinstance(st, KiviLayer) else st[0].nbytes() + st[1].nbytes()
        for p in self.pairs:
            if p.exact is not None:  # exact buffers held during a prefill count
                total += sum(b.nbytes() for kv in p.exact.values() for b in kv)
            if p.k is not None:
                total += p.k.nbytes() + p.v.nbytes()
            if p.kivi is not None:
                total += p.kivi.nbytes()
        return total

    def describe(self) -> dict:
        return self.spec.describe()
