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
the codebooks and their coding are kvrun.kv.codebook; the selection and the schedule are
recipe parts (kvrun.kv.selection: QHeadUnion, SpindleSchedule). This file routes the steps.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from ..kernels import use_triton
from .attention import combine
from .cache import KVCache
from .coded import CodedLayer, paper_ratios
from .recipe import recipe_of
from .select_qhead import pack_bits
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
        self.recipe = recipe_of(spec.select, self.opt)  # window votes, per-query-head union
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
        self.plan: tuple[int, list[int] | None] | None = None  # the allocator's, per turn length

    def begin_prefill(self, n_tokens: int) -> None:
        super().begin_prefill(n_tokens)
        self.turn_start, self.turn_len = self.seen, n_tokens
        for st in self.layers:
            st.drop_turn()

    def at_prefill(self) -> None:
        self.recipe.selection.run(self, "prefill")

    # ---------------------------------------------------------------- attend
    # the driver passes keys before RoPE: the store rotates at each slot's own position
    keys_pre_rope = True

    def decode(self, layer, qr, k, v, positions):
        st = self.layers[layer]
        for i in range(k.shape[2]):  # each token coded, then attended over
            pos = positions[i : i + 1].to(torch.int32).expand(k.shape[1], 1)
            st.store_token(layer, k[0, :, i], v[0, :, i], pos, self.ones_mask, self.opt)
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
        self.recipe.scoring.observe(self, st, qr)  # the window's queries, for the selection
        if st.held_n == 0:  # compress now, so the peak is one layer of full KV
            self.recipe.selection.compress(self, layer, kp, vp, st.qwin)
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
