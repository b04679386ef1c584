"""MiniCache (§4 of the paper): pairs (l-1, l), odd l >= S, keep per token and KV head one
SLERP-merged direction E for K and for V, each layer's norms, and the most distinct rows exact;
other layers keep a plain cache; E and they may sit in KIVI (minicache+kivi4). kvrun's decisions
beyond the paper: norm, angle and retention per (token, KV head) (scope=layer: per token);
decode tokens merged, never retained (decode_retain=1: beyond the prefill threshold); merging in
fp32, E quantized after it. Slot index = position (nothing is evicted)."""

from __future__ import annotations

import math

import torch

from ...attention import combine, dense_attention
from ...protocol import KVManager
from ...state import DictInto, ListInto, state
from ...stores import kvtypes
from ...stores.dense import DenseSeg
from ...stores.kivi import KiviLayer
from .store import Layout, Pair, PairLayer, Scratch, merge, pairing, retention


# a .kvc file holds the pairs and the layers kept plain; the views onto them are the run's
@state(pairs=ListInto(), plain=DictInto())
class MiniCacheKV(KVManager):
    """Cross-layer merged KV cache (MiniCache §4), optionally on a KIVI store."""

    def __init__(self, spec, config, rope, device, dtype, on_select=None):
        super().__init__(config, rope, device, dtype, on_select)  # it selects no tokens
        self.spec, self.name = spec, spec.name  # the spec refuses a budget
        o = spec.select_opts
        self.t, self.gamma, self.sin_eps = float(o["slerp_t"]), float(o["gamma"]), o["sin_eps"]
        self.rule, self.retain = o["retain_rule"], o["retain"]
        self.decode_retain = bool(o["decode_retain"])
        self.kivi_layout = spec.kivi()
        # --kv-dtype: f16 (the CPU's default) halves the pairs' E, norms and retained rows and
        # the plain layers; the merge runs in fp32 and rounds after it (as E under KIVI)
        self.kv_type = (
            None if self.kivi_layout else self.f16_kv_type(spec, dtype, device, "merged pairs")
        )
        self.store_dtype = self.kv_type.storage if self.kv_type else dtype  # pairs' rows
        self.kivi_scale_dtype = self.kivi_scales(spec, dtype, device)  # under store=kivi4
        c = config
        self.H, self.D = c.n_kv_heads, c.head_dim
        self.layout = Layout(o["scope"] == "layer", self.H, self.D)
        self.pair_list = pairing(c.n_layers, o["start"], c.window)
        self.role = {}  # layer -> (pair number, is the later layer l)
        for i, (a, b) in enumerate(self.pair_list):
            self.role[a], self.role[b] = (i, False), (i, True)
        self.reset()

    def _kivi(self) -> KiviLayer | None:
        lay = self.kivi_layout
        return lay and KiviLayer.of(
            lay, self.config, self.dtype, self.device, self.name, self.rope.kernels,
            self.kivi_scale_dtype,
        )  # fmt: skip

    def reset(self) -> None:
        super().reset()
        # the model's native CPU step kernels (kvrun.models.rope.Rope.kernels): pairs attend and merge
        # natively (merged_attn, minicache_merge); None: torch
        self.kernels = kernels = self.rope.kernels
        plain = [i for i in range(self.config.n_layers) if i not in self.role]
        window = self.config.window
        # dense K, V (1, Hkv, T, D), as `full` keeps them; KIVI with store=kivi4, except where a
        # sliding window drops the oldest tokens (a KIVI body cannot: as the driver's local layers)
        self.plain = {
            i: self._kivi()
            if self.kivi_layout and not window(i)
            else DenseSeg(
                self.H, self.D, self.dtype, self.device, kernels=kernels, kv_type=self.kv_type
            )
            for i in plain
        }
        self.pairs = [Pair(a, b, None if window(a) else self._kivi()) for a, b in self.pair_list]
        scratch = Scratch(self.H, self.D, self.dtype, self.device)  # shared by every pair
        self.views = {
            layer: PairLayer(self.pairs[i], second, self.layout, scratch, kernels)
            for layer, (i, second) in self.role.items()
        }  # the pair as each of its layers' Store

    def attend(self, layer, q, k, v, positions):
        """A decode row on the native kernels in one call where it can: a plain layer's
        (rotate, store, attend: DenseSeg.rotate_append_attend, as `full`'s; KIVI's under
        store=kivi4), a pair layer's over a dense E (rotate, attend: PairLayer.
        rope_attend_native); the rest as KVManager.attend (a pair over KIVI: `decode`)."""
        st, window = self.plain.get(layer), self.config.window(layer)
        row = k.shape[2] == 1 and not (self.in_prefill or self.static) and not window
        if row and isinstance(st, DenseSeg) and st.kernels is not None:
            return st.rotate_append_attend(
                self.rope.at(layer), q, k, v, self.rope.position(positions)
            )
        if (
            row
            and isinstance(st, KiviLayer)
            and st.kernels is not None
            and q.dtype == torch.float32
        ):
            # store=kivi4's plain layer: rotate, append to the tail, attend (as kivi's own rows)
            return st.rotate_append_attend(
                self.rope.at(layer), q, k, v, self.rope.position(positions)
            )
        role = self.role.get(layer) if row else None
        if role is not None:
            out = self._step(layer, role, q, k, v, positions)
            if out is not None:
                return out
            pair, second, view = self.pairs[role[0]], role[1], self.views[layer]
            if pair.kivi is not None:  # E in KIVI: rotated and restored inside the call
                pos = self.rope.position(positions)
                res = view.attend_kivi_native(q, k, v, self.rope.at(layer), pos)
                if res is not None:
                    return self._decoded(pair, second, res[0].to(self.dtype), res[1], v)
            if self._native(pair, view, q) and self._fuse(pair, 1):
                out, kr = view.rope_attend_native(
                    self.rope.at(layer), q, k, v, self.rope.position(positions)
                )
                return self._decoded(pair, second, out.to(self.dtype), kr, v)
        return super().attend(layer, q, k, v, positions)

    def _step(self, layer, role, q, k, v, positions) -> torch.Tensor | None:
        """A pair layer's decode row in one native call on the pair's buffers (minicache_step:
        rotate, attend over the merged tokens and the row's own; at layer b the token's merge
        into the buffers after): what the general path below computes, with no views built and
        no second call a layer. None where that path must run."""
        pair, second = self.pairs[role[0]], role[1]
        if self.kernels is None or self.dtype != torch.float32 or pair.kivi is not None:
            return None
        bufs = self.layout.step_buffers(pair)
        if bufs is None or (second and pair.pending is None) or not self._fuse(pair, 1):
            return None
        n = pair.length
        if second:
            for b in bufs:
                b.reserve(n + 1)
        ka, va = pair.pending if second else (None, None)
        ridx = self.layout.retained_args(pair.k, second) + self.layout.retained_args(pair.v, second)
        rope = self.rope.at(layer)
        pos = self.rope.position(positions)
        cos, ssin = rope.signed_tables(pos + 1)
        out, kr = self.kernels.minicache_step(
            q, k, v, cos, ssin, pos, [b.buf for b in bufs], n, second, ka, va, *ridx,
            int(not self.layout.token), self.layout.g, self.t, self.sin_eps, q.shape[-1] ** -0.5,
        )  # fmt: skip
        if not second:
            pair.pending = (kr, v)
            return out
        for b in bufs:
            b.advance()
        pair.pending = None
        pair.release()
        self._merged(pair, 1)
        return out

    def begin_prefill(self, n_tokens: int, select: bool = True) -> None:
        super().begin_prefill(n_tokens, select)
        for p in self.pairs:
            p.begin_prefill(n_tokens, self.H, self.D, self.dtype, self.device)

    def prefill(self, layer, q, k, v, positions):
        """Exact attention; a pair keeps the turn's K, V exact until end_prefill merges them."""
        role = self.role.get(layer)
        if role is None:
            return self._attend_plain(layer, q, k, v, positions)
        pair, second = self.pairs[role[0]], role[1]
        kb, vb = pair.exact[layer]
        kb.append(k)
        vb.append(v)
        window = self.config.window(layer)
        if pair.length == 0:  # first turn: exact attention over the buffer, as `full`
            k_pos = pair.first + torch.arange(kb.n, device=self.device)
            return dense_attention(q, kb.data, vb.data, positions, k_pos, window, self.kernels)
        out = self.views[layer].attend(q, kb.data, vb.data, positions, window)  # turn exact
        if second:  # layer a computed the directions, layer b used them
            pair.release()
        return out

    def decode(self, layer, q, k, v, positions):
        """The restored pair plus the step's exact tokens, merged at layer l with l-1's."""
        role = self.role.get(layer)
        if role is None:
            return self._attend_plain(layer, q, k, v, positions)
        pair, second, view = self.pairs[role[0]], role[1], self.views[layer]
        if pair.kivi is not None:  # E in KIVI: restored inside the products, where it can
            res = view.attend_kivi_native(q, k, v)
            if res is not None:
                return self._decoded(pair, second, res[0].to(self.dtype), k, v)
        if self._native(pair, view, q) and self._fuse(pair, k.shape[2]):
            out = view.attend_native(q, k, v).to(self.dtype)  # merged and own tokens, one op
        elif self._fuse(pair, k.shape[2]):  # merged tokens in the kernel, the step's own exact
            parts = view.partials(q, positions, 0, None) + [self.layout.own(q, k, v)]
            out = combine(parts, self.dtype)
        else:  # the new tokens exact, after the restored ones
            out = view.attend(q, k, v, positions, self.config.window(layer))
        return self._decoded(pair, second, out, k, v)

    @staticmethod
    def _native(pair: Pair, view: PairLayer, q) -> bool:
        """Whether a pair layer's decode attends on the native kernels (merged_attn)."""
        return view.kernels is not None and pair.k is not None and q.dtype == torch.float32

    def _decoded(self, pair: Pair, second: bool, out, k, v) -> torch.Tensor:
        """After a pair layer's decode row: layer a keeps its k, v (post-RoPE) for b, which
        merges both into the pair."""
        if not second:
            pair.pending = (k, v)
            return out
        pair.release()
        if pair.pending is None:
            raise RuntimeError(f"minicache: layer {pair.b} ran without layer {pair.a}")
        (ka, va), pair.pending = pair.pending, None
        self.merge(pair, ka[0], va[0], k[0], v[0], prefill=False)
        return out

    def _fuse(self, pair: Pair, T: int) -> bool:
        """Whether a step runs merged_decode: a dense E (KIVI's E restores into the scratch), no
        masking window, something to restore (all retained: SDPA keeps step 1 equal to full).
        A window's pair holds only what the step's queries see (end of merge), so it fuses."""
        window = self.config.window(pair.a)  # a pair's layers share it (pairing)
        if pair.kivi is not None or (
            window and pair.length and pair.first < self.seen + T - window
        ):
            return False
        g = self.layout.g
        return pair.length == 0 or pair.k.ridx.numel() + pair.v.ridx.numel() < 2 * g * pair.length

    def _attend_plain(self, layer, qr, kr, v, positions) -> torch.Tensor:
        window = self.config.window(layer)
        st = self.plain[layer]
        if isinstance(st, KiviLayer):
            st.append(kr[0], v[0])
            k_pos = torch.arange(st.length, device=self.device)
            if st.body_len == 0:  # only the dense tail (a one-chunk prefill): as `full`
                tk, tv = (x[None].to(qr.dtype) for x in st.tail())  # the f16 tail: one chunk's
                return dense_attention(qr, tk, tv, positions, k_pos, window, self.kernels)
            if not window or self.seen + kr.shape[2] <= window:
                return combine(st.partials(qr, positions, kr.shape[2], window), self.dtype)
            kd, vd = st.dequantized()  # a sliding window: mask by position over the dequantized
            return dense_attention(
                qr, kd[None].to(self.dtype), vd[None].to(self.dtype), positions, k_pos, window
            )
        st.append(kr, v, positions)  # a DenseSeg: consecutive positions up to the queries'
        end = int(positions[-1]) + 1
        k_pos = torch.arange(end - st.length, end, device=self.device)
        out = dense_attention(qr, st.k, st.v, positions, k_pos, window, self.kernels)
        if window and st.length > window - 1:  # hold what the next query can see (a ring's
            st.drop_front(st.length - (window - 1))  # bound: the window's newest, W - 1 held)
        return out

    def end_chunk(self, n_tokens: int) -> None:
        super().end_chunk(n_tokens)
        if self.kivi_layout is not None:  # prefill flush unit U = G, after the chunk's attention
            for st in self._kivi_stores(pairs=False):
                st.flush(self.kivi_layout["group"])

    def end_prefill(self) -> None:
        """A turn's tokens are merged at the end of its prefill."""
        super().end_prefill()
        for p in self.pairs:
            if p.exact is not None:
                (ka, va), (kb, vb) = p.exact[p.a], p.exact[p.b]
                self.merge(p, ka.data[0], va.data[0], kb.data[0], vb.data[0], prefill=True)
                p.exact = None  # free the exact buffers
                self._decode_ready(p)
            p.release()

    def _decode_ready(self, pair: Pair) -> None:
        """What a pair's native decode rows read beside its store, made as the turn is merged
        (compression's work, not the first decode step's): both layers' factors n / ||E|| of a
        dense E, the inverse norms of a KIVI E's body."""
        view = self.views[pair.a]
        if view.kernels is None or pair.k is None or self.dtype != torch.float32:
            return
        if pair.kivi is None:
            self.layout.native_factors(pair, False)
        elif not self.layout.token:
            view.inverse_norms()

    def merge(self, pair: Pair, ka, va, kb, vb, prefill: bool) -> None:
        """Merge layers a's and b's tokens (Hkv, n, D) into the pair, choosing retained rows."""
        n, start = ka.shape[1], pair.length
        if n == 0:
            return
        lay = self.layout
        if (
            not prefill
            and n == 1
            and lay.merge_token(pair, (ka, va), (kb, vb), self.t, self.sin_eps, self.kernels)
        ):  # a decode token: one native call
            self._merged(pair, 1)
            return
        if pair.k is None:
            never = -math.inf if self.rule == "paper" else math.inf
            thr = never if self.decode_retain else None
            args = (pair.kivi is None, thr, self.store_dtype, self.device)
            pair.k, pair.v = lay.half(*args), lay.half(*args)
        dirs = []
        for half, xa, xb in ((pair.k, ka, kb), (pair.v, va, vb)):
            ga, gb = lay.groups(xa), lay.groups(xb)  # (g, n, m)
            fn = merge if self.kernels is None else self.kernels.minicache_merge
            e, na, nb, d, *factors = fn(ga, gb, self.t, self.sin_eps)
            keep = None
            if prefill:  # retention over this turn's tokens
                keep, thr = retention(d, self.gamma, self.rule, self.retain)
                if half.thr is not None:
                    half.thr = thr
            elif half.thr is not None:  # decode_retain: beyond the prefill threshold
                thr = half.thr.unsqueeze(-1)
                keep = d < thr if self.rule == "paper" else d > thr
            e = lay.heads(e)  # (Hkv, n, D) fp32
            half.append(e, na, nb, keep, ga, gb, start)
            dirs.append(e)
            if factors:  # the native kernel's per-key factors, kept up to date
                lay.extend_factors(pair, len(dirs) - 1, start, factors)
        if pair.kivi is not None:
            pair.kivi.append(dirs[0].to(self.dtype), dirs[1].to(self.dtype))
            if prefill:
                pair.kivi.flush(self.kivi_layout["group"])  # prefill flush unit U = G
        self._merged(pair, n)

    def _merged(self, pair: Pair, n: int) -> None:
        """n more tokens merged; a window's pair keeps what the next query can see."""
        pair.length += n
        window = self.config.window(pair.a)
        if window and pair.length > window - 1:  # the next query sees the newest W - 1 merged
            pair.drop_front(pair.length - (window - 1))

    def _kivi_stores(self, pairs: bool = True) -> list[KiviLayer]:
        """The plain layers' (and pairs') KIVI stores (store=kivi4; none on a window's layers)."""
        stores = list(self.plain.values()) + ([p.kivi for p in self.pairs] if pairs else [])
        return [st for st in stores if isinstance(st, KiviLayer)]

    def kept_counts(self) -> list[int]:
        """Tokens held per layer (a pair's merged tokens count for both of its layers)."""
        counts = [0] * self.config.n_layers
        for i, st in self.plain.items():
            counts[i] = st.length
        for p in self.pairs:
            counts[p.a] = counts[p.b] = p.length
        return counts

    def end_step(self) -> None:
        super().end_step()
        if self.kivi_layout is not None:
            r = self.kivi_layout["residual"]
            for st in self._kivi_stores():
                if st.tail_len >= r:
                    st.flush(r)

    def nbytes(self) -> int:
        total = 0
        for st in self.plain.values():
            total += st.nbytes()
        return total + sum(p.nbytes() for p in self.pairs)  # exact buffers of a prefill count

    def stores(self) -> list:
        return list(self.plain.values()) + list(
            self.views.values()
        )  # a pair's KIVI store of E is inside its view

    def describe(self) -> dict:
        t = self.held_kv_type()
        name = t.name if t else kvtypes.of(None, self.dtype).name
        return {**self.spec.describe(), "kv_dtype": name}
