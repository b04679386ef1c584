"""SpindleKV (§3.3-3.4 of the paper): linearly falling per-layer eviction budgets, per-query-head
selection stored once per KV head with a keep mask per query head, and per-layer codebooks
of pre-RoPE K and V (unit entries, one index and one magnitude per slot).

Per layer the store holds a *coded* segment (codebook indices and magnitudes) and a *dense*
segment (pre-RoPE K and V: codebook=off, or decode tokens with decode_codebook=off), each
with int32 positions and uint8 keep masks, slots padded so every KV head has the same count.
Attention sees K = RoPE(C_K[idx_K] * mag_K, pos) and V = C_V[idx_V] * mag_V and masks query
head j of group h to the slots of head h with bit j set. A decode step attends through
kernels.codebook_decode, which gathers and rotates inside the kernel (Triton on CUDA, a
torch reference elsewhere), one partial per segment merged by log-sum-exp; prefill, and
decode under a sliding window that may mask, rebuild the slots densely for SDPA.
The per-layer store, which attends in this representation, is kvrun.kv.coded (CodedLayer);
the codebooks and their coding are kvrun.kv.codebook. This file selects, codes and routes.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from ..kernels import use_triton
from .alloc.spindle import spindle_keep
from .attention import combine
from .cache import KVCache
from .codebook import assign_books, build_books
from .coded import CodedLayer, paper_ratios
from .scores import pool_scores, qhead_scores
from .select_qhead import pack_bits, select_keep, union_slots
from .spec import KVSpec


# --- the manager ------------------------------------------------------------------------------------
class SpindleKV(KVCache):
    """SpindleKV on kvrun's manager contract; options are declared in kvrun/kv/methods/spindlekv.py."""

    def __init__(
        self,
        spec: KVSpec,
        config,
        rope,
        device,
        dtype,
        on_select=None,
    ):
        super().__init__(config, rope, device, dtype)
        self.spec, self.name = spec, spec.name
        self.opt = dict(spec.select_opts)
        self.window = self.opt["window"]
        self.budget = spec.budget_or_default()  # checked against the window by the spec
        self.beta = Fraction(str(self.opt["beta"]))
        # accepted for the runtime's signature and unused: per-query-head unions have ragged
        # sizes, which the (Hkv, T) positions of the debug hook cannot carry
        self.on_select = on_select
        self.group = config.n_heads // config.n_kv_heads
        self.ones_mask = pack_bits(
            torch.ones(config.n_kv_heads, 1, self.group, dtype=torch.bool, device=device)
        )  # (Hkv, 1, ceil(g/8)) a decode slot: every query head sees it
        self._fused = True  # decode through kernels.codebook_decode (False: the old path, tests)
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        super().reset()
        c = self.config
        n_books = c.n_kv_heads if self.opt["codebook_scope"] == "head" else 1
        idx = torch.int32 if self.opt["index"] == "int32" else torch.int16
        self.layers = [
            CodedLayer(n_books, c.head_dim, self.dtype, self.device, idx, self.rope, self.group)
            for _ in range(c.n_layers)
        ]
        self.turn_start, self.turn_len = 0, 0
        self._plan: tuple[int, list[int] | None] | None = None

    def begin_prefill(self, n_tokens: int) -> None:
        super().begin_prefill(n_tokens)
        self.turn_start, self.turn_len = self.seen, n_tokens
        for st in self.layers:
            st.drop_turn()

    def at_prefill(self) -> None:
        for i, st in enumerate(self.layers):
            if st.held_n:  # chunked prefill: every layer compresses here (step 8)
                self._compress(i, st.held_k.data, st.held_v.data, st.qwin)
            st.drop_turn()

    # ---------------------------------------------------------------- attend
    # the driver passes keys before RoPE: the store rotates at each slot's own position
    keys_pre_rope = True

    def decode(self, layer, qr, k, v, positions):
        st = self.layers[layer]
        for i in range(k.shape[2]):  # each token coded, then attended over
            self._append_token(layer, k[0, :, i], v[0, :, i], positions[i : i + 1])
        if self._fuse(st, qr):  # the store's partials: gathered and rotated in the kernel
            return combine(st.partials(qr, positions, k.shape[2], None), qr.dtype)
        return st.attend(qr, positions, self.config.sliding_window)

    def prefill(self, layer, qr, k, v, positions):
        st, T = self.layers[layer], k.shape[2]
        if st.held_n == 0 and T == self.turn_len:  # the whole turn in one chunk (step 7)
            kp, vp = k[0], v[0]
        else:
            st.hold(k[0], v[0], self.turn_len)
            kp, vp = st.held_k.data, st.held_v.data
        n = kp.shape[1]
        tpos = torch.arange(self.turn_start, self.turn_start + n, device=positions.device)
        kr = self.rope.apply(kp[None], tpos)  # (1, Hkv, n, D) the turn so far, exact
        out = st.attend(qr, positions, self.config.sliding_window, kr, vp[None], tpos)
        prev = st.qwin if st.qwin is not None else qr.new_empty(qr.shape[1], 0, qr.shape[3])
        st.qwin = torch.cat([prev, qr[0]], dim=1)[:, -self.window :]
        if st.held_n == 0:  # compress now, so the peak is one layer of full KV
            self._compress(layer, kp, vp, st.qwin)
            st.drop_turn()
        return out

    def _fuse(self, st: CodedLayer, qr: torch.Tensor) -> bool:
        """Whether a decode step attends through kernels.codebook_decode: one new token (more
        would need causal masks among themselves); not when the model's sliding window may
        hide a slot (all positions up to the query's must fit in it); not for a layer of dense
        slots only (codebook=off) on the torch path, whose SDPA over the rotated slots equals
        `full` bit for bit (as kvrun's full-budget test checks)."""
        window = self.config.sliding_window
        if not self._fused or qr.shape[2] != 1:
            return False
        if window is not None and self.seen + 1 > window:
            return False
        return st.pos_c is not None or use_triton(qr)

    # ------------------------------------------------------------ compression
    def _keep_plan(self, t: int) -> list[int] | None:
        """k_lambda for a turn of t tokens; B from the turn's own length (later turns too)."""
        if self._plan is None or self._plan[0] != t:
            B = self.budget.tokens(t, self.window)
            L = self.config.n_layers
            self._plan = (t, spindle_keep(t, B, self.window, L, self.beta, self.opt["schedule"]))
        return self._plan[1]

    def _compress(self, layer: int, kp: torch.Tensor, vp: torch.Tensor, qwin) -> None:
        """Steps 2-7 for one layer over the turn's pre-RoPE K, V (Hkv, t, D).

        Later chat turns (kvrun's rule for stores that cannot re-select): only the new turn's
        tokens are compressed, with the same rule and fractions (B from the turn's length) and
        a softmax over the turn's own keys, as SnapKV does over a KIVI staging area; earlier
        turns stay as stored. The turn's kept vectors get their own greedy build, whose entries
        are appended to the layer's codebook (earlier entries and indices unchanged, as at
        decode).
        """
        st, o = self.layers[layer], self.opt
        Hkv, t, _ = kp.shape
        plan = self._keep_plan(t)
        if plan is None:
            keep = torch.ones(Hkv, self.group, t, dtype=torch.bool, device=kp.device)
        else:
            tpos = torch.arange(self.turn_start, self.turn_start + t, device=kp.device)
            kr = self.rope.apply(kp[None], tpos)[0]  # (Hkv, t, D) post-RoPE, transient
            sc = qhead_scores(qwin, kr, self.config.sliding_window, o["score_norm"] == "length")
            sc = pool_scores(sc, o["pool"])
            keep = select_keep(sc, plan[layer], t, Hkv, o["gqa"])
        sl = union_slots(keep)
        st.all_bits &= bool(sl.valid.all()) and bool(keep.all(1).eq(keep.any(1)).all())
        pos = torch.where(sl.valid, sl.rel + self.turn_start, 0).to(torch.int32)  # (Hkv, S)
        gather = sl.rel[..., None].expand(-1, -1, kp.shape[2])
        ks, vs = kp.gather(1, gather), vp.gather(1, gather)  # (Hkv, S, D) kept, in slot order
        if not o["codebook"]:
            z = sl.valid[..., None]
            st.append_dense(ks * z, vs * z, pos, sl.mask)  # padding slots hold zeros
            return
        ik, mk = build_books(st.books_k, ks, sl.valid, o["theta_k"], o["cb_block"], self.dtype)
        iv, mv = build_books(st.books_v, vs, sl.valid, o["theta_v"], o["cb_block"], self.dtype)
        st.widen(layer, o["index"] == "int16-strict")
        st.append_coded(ik.to(st.idx_dtype[0]), iv.to(st.idx_dtype[1]), mk, mv, pos, sl.mask)

    def _append_token(self, layer: int, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor):
        """Store one decode token, k and v (Hkv, D) pre-RoPE at position p (1,)."""
        st, Hkv = self.layers[layer], k.shape[0]
        pos = p.to(torch.int32).expand(Hkv, 1)
        o = self.opt
        if not (o["codebook"] and o["decode_codebook"]):
            st.append_dense(k[:, None], v[:, None], pos, self.ones_mask)
            return
        ik, mk = assign_books(st.books_k, k, o["theta_k"])
        iv, mv = assign_books(st.books_v, v, o["theta_v"])
        st.widen(layer, o["index"] == "int16-strict")
        st.append_coded(
            ik.to(st.idx_dtype[0])[:, None],
            iv.to(st.idx_dtype[1])[:, None],
            mk.to(self.dtype)[:, None],
            mv.to(self.dtype)[:, None],
            pos,
            self.ones_mask,
        )

    # ------------------------------------------------------------- accounting
    def nbytes(self) -> int:
        return sum(st.nbytes() for st in self.layers)

    def stores(self) -> list:
        return list(self.layers)

    def codebook_sizes(self) -> list[tuple[int, int]]:
        """(|C_K|, |C_V|) per layer (summed over heads with codebook_scope=head)."""
        return [(sum(b.n for b in st.books_k), sum(b.n for b in st.books_v)) for st in self.layers]

    def describe(self) -> dict:
        b = self.budget
        d = {"method": self.name, **self.opt}
        d["budget"] = float(b.value) if b.is_fraction else int(b.value)
        if self.opt["report"] == "paper":
            d["paper"] = paper_ratios(self)
        return d
