"""MiniKV's cache (§3-4 of the paper): column sums over the turn's prompt queries (§3.1.1), heavy
hitters plus a recent window per KV head at each prefill's end (§3.1.2-3), whole groups quantized
to 2-bit KIVI (or held dense: quant=none), decode tokens flushed before they are attended (Alg. 1).
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import partial

import torch

from ....errors import KvrunError
from ....kernels.colsum import colsum, colsum_ref, colsum_triton
from ...attention import Partial, combine, group_sum
from ...cache import KVCache, Layer, keep_indices
from ...spec import largest_remainder
from ...state import ListInto, state
from ...stores.dense import DenseSeg


def pyramid_shares(n_layers: int, depth: int, direction: str = "down") -> list[Fraction]:
    """x_lambda / x of MiniKV's pyramid (§3.1.3, App. H): linear from 2 - 1/delta at layer
    0 to 1/delta at layer L-1, mean 1; `up` reverses it (the paper's App. H reading)."""
    L, top, bottom = n_layers, 2 - Fraction(1, depth), Fraction(1, depth)
    if L == 1:
        return [Fraction(1)]
    shares = [top + (bottom - top) * Fraction(layer, L - 1) for layer in range(L)]
    return shares if direction == "down" else shares[::-1]


def pyramid(n_hh: int, n_layers: int, depth: int, direction: str = "down") -> list[int]:
    """Heavy hitters per layer summing to L * n_hh (largest remainder, ties to the lower layer)."""
    shares = pyramid_shares(n_layers, depth, direction)
    return largest_remainder([n_hh * s for s in shares], n_layers * n_hh)


def budgets(o, budget, t: int, n_layers: int) -> tuple[list[int], int]:
    """(heavy hitters per layer, recent window) for a turn of t tokens: B(t) split evenly
    under a --kv-budget (protected minimum 0), else the heavy and recent fractions."""
    if budget is not None:
        B = budget.tokens(t, 0)
        n_rw = B // 2
        n_hh = B - n_rw
    else:
        n_rw = math.floor(Fraction(str(o["recent"])) * t)
        n_hh = math.floor(Fraction(str(o["heavy"])) * t)
    if o["alloc"] == "pyramid":
        hh = pyramid(n_hh, n_layers, o["depth"], o["pyramid_dir"])
    else:
        hh = [n_hh] * n_layers
    if o["align"]:  # round heavy hitters down so the kept count fills whole groups
        hh = [max(0, h - (h + n_rw) % o["align"]) for h in hh]
    return hh, n_rw


def heavy_recent(acc: torch.Tensor, heavy: int, recent: int, n_kv: int, length_norm: bool):
    """The `recent` newest plus the `heavy` best tokens per KV head by acc (Hkv or Hq, t); Hq rows
    (gqa_agg=max): a group's best query head; length_norm divides A[j] by t - j."""
    t = acc.shape[1]
    j = torch.arange(t, device=acc.device)
    if len(acc) != n_kv:
        acc = acc.view(n_kv, -1, t).amax(1)
    if length_norm:
        acc = acc / (t - j).float()
    protected = (j >= t - recent)[None].expand(n_kv, t)
    return keep_indices(acc, protected, heavy + recent)


def prompt_colsum(q, k, v, older: list[Partial], per_head: bool, mode: str, kernels=None):
    """(Partial, colsum (Hkv or Hq, T)): q (1, Hq, Tq, D) over the turn's k, v (1, Hkv, T, D),
    causal, each row normalised over all it sees (earlier turns' partials `older` too).
    kernels: the native CPU ones (colsum=auto on float32 K/V: one pass, kernels/cpu)."""
    if mode == "dense" and not older:
        return dense_colsum(q, k, v, per_head)
    other = torch.logsumexp(torch.stack([p.lse for p in older]), 0) if older else None
    if mode == "auto" and kernels is not None and q.dtype == k.dtype == torch.float32:
        out, lse, col = kernels.attn_colsum(
            q, k, v, q.shape[-1] ** -0.5, other=other, per_head=per_head
        )
        return Partial(out, lse), col
    # two launches on CUDA (Triton), blocks of 256 query rows in torch elsewhere
    fn = {"triton": colsum_triton, "chunked": colsum_ref}.get(mode, colsum)
    out, lse, col = fn(q, k, v, per_head, other)
    return Partial(out, lse[None]), col


def dense_colsum(q, k, v, per_head: bool = False):
    """The materialised reference of kernels.colsum (colsum=dense; small prompts)."""
    _, Hq, Tq, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    kf = k[0].float().repeat_interleave(Hq // Hkv, dim=0)  # (Hq, T, D)
    vf = v[0].float().repeat_interleave(Hq // Hkv, dim=0)
    s = torch.einsum("hqd,htd->hqt", q[0].float(), kf) / math.sqrt(D)  # (Hq, Tq, T)
    rows = torch.arange(T - Tq, T, device=q.device)
    s = s.masked_fill(torch.arange(T, device=q.device)[None, :] > rows[:, None], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("hqt,htd->hqd", p, vf)
    col = p.sum(1)  # (Hq, T)
    return Partial(out[None], lse[None]), (col if per_head else group_sum(col, Hkv))


@state(held=ListInto())  # the local layers' windows (Gemma 3), beside the driver's layers
class MiniKVCache(KVCache):
    """MiniKV on the driver: its own attention with column sums, selection and flushes."""

    def __init__(self, spec, config, rope, device, dtype, on_select=None):
        if spec.select_opts["colsum"] == "triton" and torch.device(device).type != "cuda":
            raise KvrunError(
                f"{spec.name}:colsum=triton needs a CUDA GPU; use colsum=auto or chunked on CPU"
            )
        self.held: list[DenseSeg | None] = []
        super().__init__(spec, config, rope, device, dtype, on_select)

    def reset(self) -> None:
        super().reset()
        self._scratch: torch.Tensor | None = None  # DenseSeg.widened's, while a prefill runs
        c, dense = self.config, self.kivi_layout is None  # quant=none: turns held dense
        # Gemma 3's local layers (no KIVI store there: KVCache.reset): the layer's window, held
        # dense with positions and cut to the window as it moves; MiniKV selects
        # and quantizes the global layers (Mistral's window on every layer is refused past it)
        self.local = frozenset(c.local_layers or ()) if c.sliding_window else frozenset()
        held = partial(DenseSeg, c.n_kv_heads, c.head_dim, self.dtype, self.device)
        self.held = [  # in the KV dtype, as every dense store
            held(1, kv_type=self.kv_type)
            if i in self.local
            else (held(kv_type=self.kv_type) if dense else None)
            for i in range(c.n_layers)
        ]

    def _dense(self) -> DenseSeg:
        c = self.config
        rows = c.n_heads if self.opt["gqa_agg"] == "max" else None
        return DenseSeg(
            c.n_kv_heads,
            c.head_dim,
            self.dtype,
            self.device,
            self.pos_rows,
            scores=True,
            score_rows=rows,
            count_pos=self.count_pos,
            kv_type=self.kv_type,
        )

    def _window_ok(self, st: Layer) -> bool:
        return False  # the store keeps no positions

    def _local(self, layer, q, k, v, positions) -> torch.Tensor:
        """A local layer's step: attend over its window, then drop what the next query cannot
        see (a key at p is seen from queries below p + window)."""
        held, window = self.held[layer], self.config.sliding_window
        held.append(k, v, positions)
        out = combine(held.partials(q, positions, k.shape[2], window), self.dtype)
        cut = int(positions[-1]) + 1 - window  # keys at or below it are out of every window
        pos = held.pos[0]
        if int(pos[0]) <= cut:
            held.keep(torch.nonzero(pos > cut).view(1, -1))
        return out

    def prefill(self, layer, q, k, v, positions):
        if layer in self.local:
            return self._local(layer, q, k, v, positions)
        st, held = self._layer(layer, k.shape[2]), self.held[layer]
        st.dense.append(k, v, positions)
        if st.kivi is not None and st.kivi.length:
            older = st.kivi.partials(q, positions, 0, None)
        elif held is not None and held.length:
            older = held.partials(q, positions, 0, None)
        else:
            older = []
        d = st.dense
        per_head, mode = self.opt["gqa_agg"] == "max", self.opt["colsum"]
        # the staged f16 rows widened into one scratch for every layer and chunk (262 MB of new
        # pages a call at 32,000 tokens of the Qwen3-0.6B shape otherwise)
        dk, dv, self._scratch = d.widened(self._scratch)
        part, col = prompt_colsum(q, dk, dv, older, per_head, mode, self.rope.kernels)
        d.acc += col
        return combine(older + [part], self.dtype)

    def decode(self, layer, q, k, v, positions):
        if layer in self.local:
            return self._local(layer, q, k, v, positions)
        st, held = self._layer(layer, k.shape[2]), self.held[layer]
        if st.kivi is None:
            held.append(k, v, positions)
            return combine(held.partials(q, positions, k.shape[2], None), self.dtype)
        st.kivi.append(k[0], v[0])
        r = self.kivi_layout["residual"]
        if st.kivi.tail_len >= r:  # a full residual is flushed before it is attended
            st.kivi.flush(r)
        return combine(st.kivi.partials(q, positions, k.shape[2], None), self.dtype)

    def _store_row_ok(self, st) -> bool:
        return st.kivi.tail_len + 1 < self.kivi_layout["residual"]  # no flush due before it

    def end_prefill(self) -> None:
        """The driver's: the selection, then the kept tokens into the 2-bit store in position
        order (in whole groups, `_flush_unit`); with quant=none they join the turns held."""
        super().end_prefill()
        self._scratch = None  # the column sums' float32 rows: the prefill's only
        for i, (st, held) in enumerate(zip(self.layers, self.held, strict=True)):
            if st.kivi is None and held is not None and st.dense.length and i not in self.local:
                held.append(*st.dense.take(), torch.empty(0))

    def _flush_unit(self) -> int:
        return self.kivi_layout["group"]  # whole groups (flush unit G)

    def select(self, point: str) -> None:
        """Heavy hitters and the recent window of the turn, per layer and KV head."""
        t = max(st.dense.length for st in self.layers)  # the turn (local layers hold none)
        hh, n_rw = budgets(self.opt, self.spec.budget, t, self.config.n_layers)
        norm = self.opt["score_norm"] == "length"
        for i, st in enumerate(self.layers):
            if i in self.local:
                continue
            d = st.dense
            if hh[i] + n_rw < t:
                d.keep(heavy_recent(d.acc, hh[i], n_rw, self.config.n_kv_heads, norm))
            if d.pos is not None:
                self.report(i, point, d.pos)

    def decode_segment(self, i: int):
        st = self.layers[i]
        return st.kivi if st.kivi is not None else self.held[i]

    def static_step_ok(self) -> bool:
        """A step that flushes a full residual before it attends (Alg. 1) runs eagerly."""
        if self.kivi_layout is None:
            return True
        r = self.kivi_layout["residual"]
        return all(st.kivi.tail_len + 1 < r for st in self.layers if st.kivi is not None)

    def stores(self) -> list:
        return super().stores() + [h for h in self.held if h is not None]

    def kept_counts(self) -> list[int]:
        held = [h.length if h is not None else 0 for h in self.held]
        return [a + b for a, b in zip(super().kept_counts(), held, strict=True)]

    def describe(self) -> dict:
        d = super().describe()
        if self.opt["report"] == "paper":
            # MiniKV App. I: (layers x hidden) bytes per kept or generated token, MHA, 2-bit,
            # residual ignored; logged beside the measured bytes for comparison only
            c = self.config
            d["bytes_paper"] = sum(self.kept_counts()) * c.n_heads * c.head_dim
        return d
