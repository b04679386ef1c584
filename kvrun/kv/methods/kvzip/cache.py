"""KVzip's cache (KVzip §3; kvpress's chunked scoring): the driver's store, a reconstruction pass
per chunk of each turn ("Repeat the previous context" and the chunk, after the turn), and top-B
per KV head (scope=head), the layer's Hkv * B best (head, slot) pairs (scope=layer) or the
model's L * Hkv * B best (layer, head, slot) triples (scope=model)."""

from __future__ import annotations

import math

import torch

from ....errors import KvrunError
from ...adaptive import keep_adaptive
from ...attention import combine, sdpa
from ...cache import KVCache, keep_indices
from ...protocol import KVManager, Pass
from ...state import Int, ListOf, Nothing, state
from ...stores.dense import PAD, DenseSeg
from . import native

FIRST = "\n\nRepeat the previous context exactly."
NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk repeated after NEXT
QUERY_BLOCK = 64  # pass queries scored at a time


# the last turn's length; its reconstruction scores are spent at the prefill's end
@state(turn=Int(0, "T"), scores=ListOf(Nothing(), "L", exactly=True))
class KVzipCache(KVCache):
    """KVzip on the driver: reconstruction scores, then top-k per KV head (or per layer)."""

    bound_in_prefill = False  # the reconstruction passes read the whole turn

    def __init__(self, spec, config, rope, device, dtype, on_select=None, out_proj=None):
        self.scope = spec.select.scope
        super().__init__(spec, config, rope, device, dtype, on_select, out_proj)

    def reset(self) -> None:
        super().reset()
        self.turn = 0
        self.scores: list[torch.Tensor | None] = [None] * self.config.n_layers  # (Hkv, t) fp32

    def position_rows(self) -> int:
        if self.scope != "head":
            return self.config.n_kv_heads  # padding is masked (in the method's formula)
        return super().position_rows()  # a sliding window's positions, where the model has one

    def begin_prefill(self, n_tokens: int, select: bool = True) -> None:
        super().begin_prefill(n_tokens, select)
        self.turn = n_tokens

    def planning_pass(self, when, ids, tokenizer) -> list[Pass]:
        """After the turn's prefill, one pass per chunk (a leading BOS is not repeated)."""
        if when != "after" or not self.select_turn or not ids:
            return []
        # Mistral's window hides the context from the repeat on every layer; Gemma 3's local
        # layers only: there the scores of what the window hides are 0, and it is never seen
        # again there, while the global layers score the whole context
        c = self.config
        sw = c.sliding_window if all(c.window(i) for i in range(c.n_layers)) else None
        if sw and self.seen > sw:
            raise KvrunError(
                f"--kv {self.name} cannot reconstruct past the model's sliding window of {sw} "
                "tokens; use a shorter input or another method"
            )
        enc = (lambda s: tokenizer.encode(s, add_bos=False, special=False)) if tokenizer else None
        ids = list(ids)
        lo = 1 if tokenizer is not None and ids[0] == tokenizer.bos_id and len(ids) > 1 else 0
        L, Hkv = self.config.n_layers, self.config.n_kv_heads
        self.scores = [torch.zeros(Hkv, len(ids), device=self.device) for _ in range(L)]
        passes, size = [], self.opt["chunk"]
        for a in range(lo, len(ids), size):
            b = min(a + size, len(ids))
            prompt = (
                [] if enc is None else enc(FIRST) if a == lo else enc(NEXT) + ids[a - OVERLAP : a]
            )
            passes.append(Pass(prompt + ids[a:b], Reconstruct(self, a, b), self.seen))
        return passes

    def select(self, point: str) -> None:
        """B best slots per KV head by the pass's scores; sinks and earlier turns' slots kept.
        scope=layer: the layer's Hkv * B best (head, slot) pairs; model: the model's L * Hkv * B
        best (layer, head, slot) triples, over the layers that hold more than B."""
        T = max(st.dense.length for st in self.layers)  # local layers hold at most a window
        B = self.budget.tokens(T if self.kivi_layout else self.seen, self.protected)
        start = self.seen - self.turn  # the turn's first position
        ranked: list[tuple[DenseSeg, torch.Tensor]] = []  # scope=model: ranked together
        for i, st in enumerate(self.layers):
            d, z = st.dense, self.scores[i]
            if d.length > B and z is not None:
                s = torch.full((d.k.shape[1], d.length), float("inf"), device=z.device)
                base = d.length - self.turn  # the turn's slots are the newest
                s[:, base:] = z
                s[:, base : base + max(0, self.opt["sinks"] - start)] = float("inf")
                if self.out_proj is not None:  # CriticalKV over the reconstruction scores
                    s = self.critical(i, d, s, B)
                if self.scope == "adaptive":  # sinks and earlier turns are already inf
                    keep_adaptive(d, s, B, self.spec.select.alpha)
                elif self.scope == "layer":
                    self._keep_layer(d, s, B)
                elif self.scope == "model":
                    ranked.append((d, s))
                else:
                    d.keep(keep_indices(s, None, B))
        if ranked:
            self._keep_model(ranked, B)
        for i, st in enumerate(self.layers):
            if st.dense.pos is not None:
                self.report(i, point, torch.where(st.dense.pos == PAD, -1, st.dense.pos))
        self.scores = [None] * len(self.layers)
        self.bound_windows()  # held back until the passes had the whole turn

    def _keep_model(self, ranked: list[tuple[DenseSeg, torch.Tensor]], B: int) -> None:
        """The len(ranked) * Hkv * B best (layer, head, slot) triples of the ranked layers
        (ties to the lower layer, then position, then head), each layer's heads padded to its
        largest count. Scores are softmax probabilities, alike across layers (KVzip §3.2)."""
        flat = torch.cat([s.t().reshape(-1) for _, s in ranked])  # layer-, then slot-major
        n = sum(s.shape[0] * B for _, s in ranked)
        order = torch.sort(flat, descending=True, stable=True).indices[:n]
        keep = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
        keep[order] = True
        at = 0
        for d, s in ranked:
            Hkv, T = s.shape
            self._keep_padded(d, keep[at : at + T * Hkv].view(T, Hkv).t())
            at += T * Hkv

    def _keep_layer(self, d: DenseSeg, s: torch.Tensor, B: int) -> None:
        """Hkv * B best (head, slot) pairs, heads padded to the largest count with zeros at PAD
        (a position no query sees, counted in nbytes)."""
        Hkv, T = s.shape
        flat = s.t().reshape(-1)  # slot-major: ties go to the lower position, then head
        order = torch.sort(flat, descending=True, stable=True).indices[: Hkv * B]
        keep = torch.zeros(T * Hkv, dtype=torch.bool, device=s.device)
        keep[order] = True
        self._keep_padded(d, keep.view(T, Hkv).t())

    def _keep_padded(self, d: DenseSeg, keep: torch.Tensor) -> None:
        """The slots of keep (Hkv, T) bool, each head padded to the largest count (KVzap's
        threshold mode keeps a mask of its own)."""
        count = keep.sum(1)  # (Hkv,)
        S = int(count.max())
        idx = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :S]  # kept first
        pad = torch.arange(S, device=keep.device)[None, :] >= count[:, None]  # (Hkv, S)
        d.keep(idx)
        d.pos.masked_fill_(pad, PAD)
        d.zero(pad)

    def nbytes(self) -> int:
        held = sum(z.numel() * z.element_size() for z in self.scores if z is not None)
        return super().nbytes() + held


class Reconstruct(KVManager):
    """A reconstruction pass over the turn's tokens [a, b), scoring their slots for its owner."""

    name = "kvzip-reconstruction"

    def __init__(self, owner: KVzipCache, a: int, b: int):
        super().__init__(owner.config, owner.rope, owner.device, owner.dtype)
        self.owner, self.a, self.b = owner, a, b
        c = owner.config
        self.own = [
            DenseSeg(c.n_kv_heads, c.head_dim, owner.dtype, owner.device) for _ in range(c.n_layers)
        ]

    def prefill(self, layer, q, k, v, positions):
        st, own, T = self.owner.layers[layer], self.own[layer], k.shape[2]
        own.append(k, v, positions)
        ops = self.rope.kernels  # the native CPU kernels, on float32 K/V
        if ops is not None and not q.dtype == st.dense.dtype == torch.float32:
            ops = None
        body = st.kivi is not None and st.kivi.length
        if ops is not None and not body and st.dense.mask(positions, 0, None) is None:
            return native.reconstruct(ops, self, layer, q, st.dense, own)
        self._score(layer, q, st.dense, own, T, ops)
        if body:  # a KIVI body: its partial, combined
            parts = st.kivi.partials(q, positions, 0, None)
            parts += st.dense.partials(q, positions, 0, None) + own.partials(q, positions, T, None)
            return combine(parts, self.dtype)
        return self._attend_dense(q, st.dense, own, positions, T)

    def _attend_dense(self, q, d: DenseSeg, own: DenseSeg, positions, T: int) -> torch.Tensor:
        """The pass's attention over the cache and its own tokens as one SDPA call with one
        mask (the cache's by position where it keeps them, causal over its own), not two
        materialised partials: the same softmax, ~6x less time for a 2k-token turn."""
        n_own = own.length
        rows = torch.arange(n_own - T, n_own, device=q.device)
        causal = torch.arange(n_own, device=q.device)[None, :] <= rows[:, None]  # (T, n_own)
        dm = d.mask(positions, 0, None)  # None, (T, n) or (Hkv, T, n): padding, positions
        if dm is None:
            dm = torch.ones(T, d.length, dtype=torch.bool, device=q.device)
        if dm.dim() == 3:  # per KV head, then per query head
            mask = torch.cat([dm, causal.expand(dm.shape[0], -1, -1)], dim=-1)
            mask = mask.repeat_interleave(q.shape[1] // dm.shape[0], dim=0)
        else:
            mask = torch.cat([dm, causal], dim=-1)
        k = torch.cat([d.k, own.k], dim=2)
        v = torch.cat([d.v, own.v], dim=2)
        return sdpa(q, k, v, mask).to(self.dtype)

    def _score(self, layer: int, q, d: DenseSeg, own: DenseSeg, T: int, ops=None) -> None:
        """Max over the group's query heads and pass rows of the softmax over the sinks, the
        chunk's slots and the pass's own tokens (causal); in one native pass where `ops`."""
        o = self.owner
        base = d.length - o.turn  # the turn's first slot
        a, b = base + self.a, base + self.b  # the chunk's slots
        s0 = min(o.opt["sinks"], self.a)  # the turn's sinks before the chunk
        sinks, chunk = d.rows(base, base + s0)[0], d.rows(a, b)[0]
        keys = torch.cat([sinks[0], chunk[0], own.k[0]], dim=1).float()
        z = o.scores[layer][:, self.a : self.b]
        if ops is not None:  # the pass rows are the last T keys: causal by slot
            col = ops.attn_colsum(q, keys[None], None, q.shape[-1] ** -0.5, mode=1)[2]
            torch.maximum(z, col[:, s0 : s0 + b - a], out=z)
            return
        Hkv, K, D = keys.shape
        Hq, n_own = q.shape[1], own.length
        qg = q[0].float().view(Hkv, Hq // Hkv, T, D) / math.sqrt(D)
        best = torch.zeros(Hkv, b - a, device=keys.device)
        col = torch.arange(K, device=keys.device) - (K - n_own)  # own index; < 0 for the store
        for r in range(0, T, QUERY_BLOCK):
            e = min(r + QUERY_BLOCK, T)
            rows = torch.arange(r, e, device=keys.device) + (n_own - T)  # own index of each row
            logits = torch.einsum("hgqd,hkd->hgqk", qg[:, :, r:e], keys)
            logits = logits.masked_fill(col[None, :] > rows[:, None], float("-inf"))
            p = torch.softmax(logits, dim=-1)[..., s0 : s0 + b - a]  # (Hkv, G, rows, b - a)
            best = torch.maximum(best, p.amax(dim=(1, 2)))
        torch.maximum(z, best, out=z)

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.own)

    def end_prefill(self) -> None:
        super().end_prefill()
        self.own = []  # the pass keeps nothing
