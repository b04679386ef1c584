"""MiniCache's pair store (§3.2-3.3, §4.2): the SLERP merge math (fp32), a merged pair's storage,
the Layout that restores X_hat = E * n / ||E||, and PairLayer, each layer's Store view of a pair."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from ....kernels import use_triton
from ....kernels.dense_decode import dense_decode
from ....kernels.merged_decode import merged_decode
from ...attention import Partial, dense_attention, segment_attention
from ...state import Buf, Int, Into, Maybe, New, Tensor, state
from ...stores.buffer import Buffer
from ...stores.kivi import KiviLayer


def pairing(n_layers: int, start: int = -1, window=None) -> list[tuple[int, int]]:
    """Merged pairs (l-1, l) for every odd l with S <= l <= L-1; S = L // 2 when start < 0.
    window(layer) -> int | None (the sliding window): kvrun pairs only layers of one window
    (a local layer's pair drops what its window cannot see; a global one keeps every token), so
    on Gemma 3 a pair that would join a local and a global layer leaves both plain."""
    s = n_layers // 2 if start < 0 else start
    pairs = [(ly - 1, ly) for ly in range(max(s | 1, 1), n_layers, 2)]
    return [(a, b) for a, b in pairs if window is None or window(a) == window(b)]


def merge(
    xa: torch.Tensor,  # (..., m) x^{l-1}
    xb: torch.Tensor,  # (..., m) x^l
    t: float = 0.6,
    sin_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec's MERGE per row -> (E (..., m), n_a, n_b, d (...)) fp32, d = Omega / pi with Omega =
    2 atan2(||u_b - u_a||, ||u_b + u_a||) (stable near 0 and pi); SLERP with weight t on layer l
    (Eq. 3) where sin(Omega) >= sin_eps, else normalised LERP (u_b if shorter than 1e-6); zero rows
    give u = 0, never NaN. kvrun's decisions: t weights layer l as in Eq. 3 (Alg. 2 swaps them;
    t=0.4 reproduces it), and the LERP fallback (the paper has no rule for sin(Omega) ~ 0)."""
    xa, xb = xa.float(), xb.float()
    na = torch.linalg.vector_norm(xa, dim=-1)  # (...)
    nb = torch.linalg.vector_norm(xb, dim=-1)
    ua = xa / torch.where(na > 0, na, 1.0).unsqueeze(-1)  # (..., m); 0 for a zero row
    ub = xb / torch.where(nb > 0, nb, 1.0).unsqueeze(-1)
    omega = 2 * torch.atan2(
        torch.linalg.vector_norm(ub - ua, dim=-1), torch.linalg.vector_norm(ub + ua, dim=-1)
    )  # (...) in [0, pi]
    s = torch.sin(omega)
    slerp = (s >= sin_eps) & (s > 0)  # s > 0 too: sin_eps=0 must not divide by zero
    s = torch.where(slerp, s, 1.0)
    wa = (torch.sin((1 - t) * omega) / s).unsqueeze(-1)
    wb = (torch.sin(t * omega) / s).unsqueeze(-1)
    lerp = (1 - t) * ua + t * ub  # (..., m)
    ln = torch.linalg.vector_norm(lerp, dim=-1, keepdim=True)
    lerp = torch.where(ln >= 1e-6, lerp / torch.where(ln > 0, ln, 1.0), ub)
    e = torch.where(slerp.unsqueeze(-1), wa * ua + wb * ub, lerp)
    return e, na, nb, omega / math.pi


def direction(e: torch.Tensor) -> torch.Tensor:
    """e / ||e|| per row in fp32, ||e|| recomputed (a dequantized row too); 0 where ||e|| = 0."""
    e = e.float()
    n = torch.linalg.vector_norm(e, dim=-1, keepdim=True)
    return e / torch.where(n > 0, n, 1.0)


def retention(
    d: torch.Tensor,  # (G, T) angular distances of one turn's tokens, per group
    gamma: float = 0.05,
    rule: str = "distinct",
    retain: str = "range",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens kept unmerged: (mask (G, T) bool, threshold (G,) fp32, which decode_retain=1 applies).
    range: d > d_max - (d_max - d_min) gamma, or d < d_min + (...) gamma with rule=paper (empty when
    d_max = d_min); topk:F: the ceil(F T) largest d (paper: smallest), ties to the lower index.
    kvrun's decision: Eq. 4 and Alg. 2 print `d < ...`, keeping the most *similar* pairs, while the
    text keeps the distinct; kvrun keeps the distinct, gamma a fraction of the distance range."""
    d = d.float()
    G, T = d.shape
    paper = rule == "paper"
    if retain == "range":
        if T == 0:
            never = d.new_full((G,), -math.inf if paper else math.inf)
            return d.new_zeros(G, 0, dtype=torch.bool), never
        lo, hi = d.amin(-1), d.amax(-1)  # (G,)
        if paper:
            thr = lo + (hi - lo) * gamma
            return d < thr.unsqueeze(-1), thr
        thr = hi - (hi - lo) * gamma
        return d > thr.unsqueeze(-1), thr
    k = min(T, math.ceil(Fraction(retain.partition(":")[2]) * T))  # exact from the decimal
    order = torch.sort(d, dim=-1, descending=not paper, stable=True).indices  # (G, T)
    mask = torch.zeros_like(d, dtype=torch.bool).scatter_(1, order[:, :k], True)
    if k == 0:
        return mask, d.new_full((G,), -math.inf if paper else math.inf)
    return mask, d.gather(1, order[:, k - 1 : k]).squeeze(1)


# all of a Half is in a .kvc file (made at a pair's first merge); g, m are Pair.kvc_check's
@state(
    complete=True,
    e=Maybe(Buf("kv", ("H", "n", "D"), 1)),
    na=Buf("kv", ("g", "n"), 1),
    nb=Buf("kv", ("g", "n"), 1),
    ridx=Tensor("int32", ("rows",)),
    ra=Tensor("kv", ("rows", "m")),
    rb=Tensor("kv", ("rows", "m")),
    roff=Tensor("int64", ("g + 1",)),
    thr=Maybe(Tensor("float32", ("g",))),
)
class Half:
    """One pair's merged K (or V): E, both norms and the retained rows, sorted by (group, index)."""

    def __init__(
        self, g: int, m: int, hkv: int, d: int, dense_e: bool, thr: float | None, dtype, device
    ):
        self.e = Buffer((hkv, 0, d), 1, dtype, device) if dense_e else None  # (Hkv, T, D)
        self.na = Buffer((g, 0), 1, dtype, device)  # (g, T) norms of layer l-1
        self.nb = Buffer((g, 0), 1, dtype, device)  # (g, T) norms of layer l
        self.ridx = torch.empty(0, dtype=torch.int32, device=device)  # (N_r,) token indices
        self.ra = torch.empty(0, m, dtype=dtype, device=device)  # (N_r, m) exact rows, l-1
        self.rb = torch.empty(0, m, dtype=dtype, device=device)  # (N_r, m) exact rows, l
        self.roff = torch.zeros(g + 1, dtype=torch.int64, device=device)  # (g+1,) group starts
        # decode_retain: the last prefill threshold per group (fp32, counted); at first none passes
        self.thr = torch.full((g,), thr, device=device) if thr is not None else None

    def kvc_check(self, loader) -> str | None:
        """Group starts from 0 to the retained rows, each row a token held (kvrun.kv.state)."""
        off, n = self.roff, self.na.n
        if int(off[0]) != 0 or int(off[-1]) != self.ridx.numel() or bool((off.diff() < 0).any()):
            return "its group starts are not an ascending count of its retained rows"
        if self.ridx.numel() and (int(self.ridx.min()) < 0 or int(self.ridx.max()) >= n):
            return f"a retained row names a token outside its {n}"
        return None

    def groups(self) -> torch.Tensor:
        """(N_r,) int64 group of each retained row (a search: CPU repeat_interleave wakes the
        thread pool, milliseconds on a busy machine)."""
        r = torch.arange(self.ridx.numel(), device=self.roff.device)
        return torch.searchsorted(self.roff[1:], r, right=True)

    def add(self, gid: torch.Tensor, idx: torch.Tensor, ra: torch.Tensor, rb: torch.Tensor) -> None:
        """Insert retained rows (group gid, token idx, exact rows ra, rb), keeping the order."""
        g = self.roff.numel() - 1
        allg = torch.cat([self.groups(), gid])
        alli = torch.cat([self.ridx.long(), idx])
        order = torch.argsort(allg * (1 << 32) + alli)  # (group, index) pairs are unique
        self.ridx = alli[order].to(torch.int32)
        self.ra = torch.cat([self.ra, ra.to(self.ra.dtype)])[order]
        self.rb = torch.cat([self.rb, rb.to(self.rb.dtype)])[order]
        counts = torch.bincount(allg, minlength=g)
        self.roff = torch.cat([self.roff[:1], counts.cumsum(0)])

    def append(self, e, na, nb, keep, ra, rb, start: int) -> None:
        """n merged tokens: E (Hkv, n, D) if dense, norms (g, n), rows `keep` (g, n) of ra, rb."""
        if self.e is not None:
            self.e.append(e)
        self.na.append(na)
        self.nb.append(nb)
        if keep is not None and bool(keep.any()):
            gid, j = keep.nonzero(as_tuple=True)
            self.add(gid, j + start, ra[gid, j], rb[gid, j])

    def drop_front(self, n: int) -> None:
        """Forget the first n merged tokens (a window's oldest): E, norms and their retained rows;
        the rest move to slot 0 on (slot = position - Pair.first)."""
        if self.e is not None:
            self.e.drop_front(n)
        self.na.drop_front(n)
        self.nb.drop_front(n)
        if self.ridx.numel():
            live = self.ridx >= n
            gid = self.groups()[live]
            self.ridx = (self.ridx[live] - n).to(torch.int32)
            self.ra, self.rb = self.ra[live], self.rb[live]
            counts = torch.bincount(gid, minlength=self.roff.numel() - 1)
            self.roff = torch.cat([self.roff[:1], counts.cumsum(0)])

    def nbytes(self) -> int:
        ts = [self.ridx, self.ra, self.rb, self.roff] + ([self.thr] if self.thr is not None else [])
        total = sum(t.numel() * t.element_size() for t in ts)
        return total + self.na.nbytes() + self.nb.nbytes() + (self.e.nbytes() if self.e else 0)


# a .kvc file holds the merged halves, the KIVI store of E and the length; layers a, b and the
# scratch are the run's, and a prefill's exact buffers are gone between turns
@state(k=Maybe(New(Half)), v=Maybe(New(Half)), kivi=Into(), length=Int(0, "T"), first=Int(0, "T"))
class Pair:
    """Layers (a, b) = (l-1, l): merged halves, exact buffers during a prefill, pending slot."""

    def __init__(self, a: int, b: int, kivi: KiviLayer | None):
        self.a, self.b = a, b
        self.k: Half | None = None  # created at the first merge
        self.v: Half | None = None
        self.kivi = kivi  # holds E_K as keys and E_V as values (KIVI store)
        self.exact: dict[int, tuple[Buffer, Buffer]] | None = None  # this turn's K, V per layer
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # layer a's new (k, v)
        self.length = 0  # merged tokens
        # the position of slot 0: 0, unless a sliding window dropped the oldest (slot = position
        # - first; the merged tokens are consecutive positions, nothing else is evicted)
        self.first = 0
        # what layer a computes for a step and layer b reuses, then releases (scratch, not in
        # nbytes): unit directions (uK, uV) of the dense restore, merged_decode's override maps
        self.work: tuple[torch.Tensor, torch.Tensor] | None = None
        self.fwork: list | None = None
        # the native kernel's per-key factors n / ||E|| (g, T) fp32 of layers a (False) and b
        # (True), for E_K and E_V: derived from E and the norms, which never change once merged,
        # so kept and extended as tokens merge (8 bytes per token and group a half, beside E's
        # 4 * D; scratch as the restore workspace is, not in nbytes; rebuilt after a .kvc load)
        self.factors: dict[bool, list[Buffer]] | None = None
        # under KIVI (minicache+kivi4): 1 / ||E|| (Hkv, body) fp32 of E_K's and E_V's dequantized
        # body rows (0 for a zero row), for kivi_merged_attn; extended as the store flushes
        # (scratch as the factors are: not in nbytes, rebuilt after a .kvc load)
        self.kivi_inv: list[Buffer] | None = None

    def kvc_check(self, loader) -> str | None:
        """The halves as this spec's MiniCache makes them (kvrun.kv.state)."""
        kv, halves = loader.kv, [h for h in (self.k, self.v) if h is not None]
        if not halves:
            return None if self.length == 0 else f"{self.length} merged tokens but no halves"
        if len(halves) == 1:
            return "one half without the other"
        w = kv.config.window(self.a)
        if self.first and not w:
            return f"a pair that dropped {self.first} tokens without a sliding window"
        if w and self.length >= w:
            return f"a pair of {self.length} tokens under a window of {w}"
        lay = kv.layout
        for h in halves:
            if (h.na.buf.shape[0], h.ra.shape[1]) != (lay.g, lay.m):
                return f"a half of {h.na.buf.shape[0]} groups of {h.ra.shape[1]}, not {lay.g} of {lay.m}"
            if h.na.n != self.length or (h.e is None) != (self.kivi is not None):
                return "a half that does not hold the pair's merged tokens"
            if (h.thr is None) == kv.decode_retain:
                return "a half whose thresholds do not follow decode_retain"
        return None

    def drop_front(self, n: int) -> None:
        """Forget the n oldest merged tokens (positions first .. first + n - 1)."""
        if n <= 0:
            return
        for half in (self.k, self.v):
            half.drop_front(n)
        for bufs in (self.factors or {}).values():
            for b in bufs:
                b.drop_front(min(n, b.n))
        self.length -= n
        self.first += n

    def release(self) -> None:
        """Drop the step's shared scratch."""
        self.work = self.fwork = None

    def begin_prefill(self, n_tokens: int, hkv: int, d: int, dtype, device) -> None:
        """A new turn: empty exact K, V buffers (1, Hkv, T, D) per layer."""
        self.pending = None
        new = lambda: Buffer((1, hkv, 0, d), 2, dtype, device, n_tokens)  # noqa: E731
        self.exact = {ly: (new(), new()) for ly in (self.a, self.b)}

    def nbytes(self) -> int:
        """The halves, the KIVI store of E and a prefill's exact buffers."""
        total = self.kivi.nbytes() if self.kivi is not None else 0
        if self.exact is not None:
            total += sum(b.nbytes() for kv in self.exact.values() for b in kv)
        if self.k is not None:
            total += self.k.nbytes() + self.v.nbytes()
        return total


@dataclass
class Layout:
    """A pair's groups g: the KV heads (scope=head, m = D) or one per token for the whole layer
    (scope=layer, m = Hkv*D)."""

    token: bool
    H: int
    D: int
    g: int = field(init=False)  # groups per token
    m: int = field(init=False)  # length of one group's vector

    def __post_init__(self):
        self.g, self.m = (1, self.H * self.D) if self.token else (self.H, self.D)

    def half(self, dense_e: bool, thr: float | None, dtype, device) -> Half:
        """An empty merged K or V (E dense unless a KIVI store holds it)."""
        return Half(self.g, self.m, self.H, self.D, dense_e, thr, dtype, device)

    def groups(self, x: torch.Tensor) -> torch.Tensor:
        """(Hkv, T, D) -> (g, T, m)."""
        return x.transpose(0, 1).reshape(1, x.shape[1], -1) if self.token else x

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """(g, T, m) -> (Hkv, T, D)."""
        return x.reshape(x.shape[1], self.H, self.D).transpose(0, 1) if self.token else x

    def directions(self, pair: Pair) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit directions (g, T, m) fp32 of the pair's merged K and V (dequantized for KIVI)."""
        if pair.kivi is not None:
            ek, ev = pair.kivi.dequantized()  # (Hkv, T, D) fp32 each
        else:
            ek, ev = pair.k.e.data, pair.v.e.data
        return direction(self.groups(ek)), direction(self.groups(ev))

    def restore_into(self, pair: Pair, second: bool, dirs, out_k, out_v) -> None:
        """X_hat of layer b (second) or a into out_k, out_v (Hkv, T, D), retained rows exact."""
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

    def own(self, qr, kr, v) -> Partial:
        """The step's queries over their own exact tokens, causal (one token: out = v, lse = s)."""
        if kr.shape[2] > 1:
            return Partial(*dense_decode(qr, kr, v, causal_offset=0))
        g = qr.shape[1] // self.H
        qg = qr.float().reshape(1, self.H, g, self.D)  # (1, Hkv, g, D)
        s = (qg * kr.float().reshape(1, self.H, 1, self.D)).sum(-1) / math.sqrt(self.D)
        out = v.float().repeat_interleave(g, dim=1)  # (1, Hq, 1, D)
        return Partial(out, s.reshape(1, self.H * g, 1))

    def override(self, half: Half, T: int):
        """(map (Hkv, T) int32 | None, 1/||E|| fp32 | None) of one half, once for layers a and b:
        each retained (head, token)'s row (-1: restore); 1/||E|| per token (scope=layer) or
        (Hkv, T) where the torch reference runs. Step scratch, not in nbytes."""
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

    def native_factors(self, pair: Pair, second: bool) -> list[torch.Tensor]:
        """n / ||E|| (g, T) fp32 of layer b (second) or a for E_K and E_V (0 where ||E|| = 0,
        as `override`'s and fused_args' arithmetic), the pair's kept factors extended to its
        merged tokens: both layers' at once, 1 / ||E|| computed once for the two."""
        if pair.factors is None:
            pair.factors = {}
        for i, half in enumerate((pair.k, pair.v)):
            inv, at = None, -1  # 1 / ||E|| of the tokens from `at` on
            for layer_b in (False, True):
                bufs = pair.factors.setdefault(layer_b, [])
                if len(bufs) == i:
                    bufs.append(Buffer((self.g, 0), 1, torch.float32, half.na.buf.device))
                n0 = bufs[i].n
                if n0 >= pair.length:
                    continue
                if at != n0:
                    e = self.groups(half.e.data[:, n0:].float())  # (g, n, m) the new tokens
                    norm = torch.linalg.vector_norm(e, dim=-1)
                    inv, at = 1 / torch.where(norm > 0, norm, 1.0), n0
                bufs[i].append((half.nb if layer_b else half.na).data[:, n0:].float() * inv)
        return [b.data for b in pair.factors[second]]

    def merge_token(self, pair: Pair, xa, xb, t: float, sin_eps: float, kernels) -> bool:
        """A decode token's K and V rows of layers a (xa) and b (xb), each (Hkv, 1, D), merged
        straight into the pair's buffers (E, norms, the native factors) in one native call
        (minicache_merge_into: what `merge`, each append and extend_factors store); False where
        the general path must run (no kernels, KIVI's E, decode retention, factors not kept)."""
        if kernels is None or pair.kivi is not None or pair.k is None or pair.k.thr is not None:
            return False
        if any(x.dtype != torch.float32 for x in (*xa, *xb)):
            return False
        n, f, halves = pair.length, pair.factors or {}, (pair.k, pair.v)
        if len(f.get(False, ())) != 2 or len(f.get(True, ())) != 2:
            return False
        bufs = [h.e for h in halves] + [h.na for h in halves] + [h.nb for h in halves]
        bufs += f[False] + f[True]
        if any(b.n != n for b in bufs):
            return False
        for buf in bufs:
            buf.reserve(n + 1)
        e, na, nb, fa, fb = ([x.buf for x in bufs[i : i + 2]] for i in range(0, 10, 2))
        kernels.minicache_merge_into(list(xa), list(xb), self.g, t, sin_eps, e, na, nb, fa, fb, n)
        for buf in bufs:
            buf.advance()
        return True

    def step_buffers(self, pair: Pair) -> list[Buffer] | None:
        """minicache_step's ten buffers of a pair (E_K, E_V, na_K, na_V, nb_K, nb_V, fa_K, fa_V,
        fb_K, fb_V), each holding the pair's merged tokens; None where a decode row takes the
        general path (KIVI's E, decode retention, factors not kept)."""
        k, v, f = pair.k, pair.v, pair.factors
        if k is None or k.e is None or k.thr is not None or not f:
            return None
        fa, fb = f.get(False, ()), f.get(True, ())
        if len(fa) != 2 or len(fb) != 2:
            return None
        bufs = [k.e, v.e, k.na, v.na, k.nb, v.nb, fa[0], fa[1], fb[0], fb[1]]
        n = pair.length
        return bufs if all(b.n == n for b in bufs) else None

    def extend_factors(self, pair: Pair, i: int, start: int, factors) -> None:
        """The factors (g, n) of layers a and b that minicache_merge gave for tokens from `start`
        on, onto the pair's kept ones of half i (0 K, 1 V) where those end there."""
        for second, f in zip((False, True), factors, strict=True):
            bufs = (pair.factors or {}).get(second)
            if bufs is not None and len(bufs) > i and bufs[i].n == start:
                bufs[i].append(f)

    def native_args(self, half: Half, second: bool, factors: torch.Tensor) -> tuple:
        """merged_attn's (E, factors (Hkv, T), ridx, roff, rows) of a half for layer b (second)
        or a."""
        scale = factors.expand(self.H, -1) if self.token else factors
        return half.e.data, scale, *self.retained_args(half, second)

    @staticmethod
    def retained_args(half: Half, second: bool) -> tuple:
        """The native kernels' (ridx, roff, rows) of a half's retained rows for layer b (second)
        or a; three Nones where it retains none."""
        if half.ridx.numel() == 0:
            return None, None, None
        return half.ridx, half.roff, half.rb if second else half.ra

    def fused_args(self, half: Half, work, second: bool):
        """merged_decode's (scale (Hkv, T), map, rows (N, D), unit) of a half; work: override's."""
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
    """Layer a (second=False) or b of a pair as a Store; the pair's bytes count once, at a."""

    def __init__(self, pair: Pair, second: bool, layout: Layout, scratch: Scratch, kernels=None):
        self.pair, self.second, self.layout, self.scratch = pair, second, layout, scratch
        # the model's native CPU step kernels (kvrun.models.rope.Rope.kernels): a decode step attends
        # over the merged tokens in one op (merged_attn); None: merged_decode or the restore
        self.kernels = kernels

    @property
    def length(self) -> int:
        return self.pair.length

    def nbytes(self) -> int:
        return 0 if self.second else self.pair.nbytes()

    def partials(self, q, q_pos, n_new: int, window: int | None) -> list[Partial]:
        """q (1, Hq, Tq, D) over the merged tokens, all visible (the step's own are not merged
        yet): in merged_decode over a dense E, else over the restore."""
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

    def _native_halves(self) -> tuple[tuple, tuple]:
        """merged_attn's arguments of the K and V halves for this layer."""
        pair, lay = self.pair, self.layout
        fk, fv = lay.native_factors(pair, self.second)
        return lay.native_args(pair.k, self.second, fk), lay.native_args(pair.v, self.second, fv)

    def attend_native(self, q, k_new, v_new) -> torch.Tensor:
        """q (1, Hq, T, D) over the merged tokens (a dense E) and the step's own exact k_new,
        v_new (1, Hkv, T, D), causal among themselves, in one native call (merged_attn)."""
        ka, va = self._native_halves()
        out, _ = self.kernels.merged_attn(
            q, ka[0], ka[1], va[0], va[1], False, *ka[2:], *va[2:], int(not self.layout.token),
            k_new, v_new, q.shape[-1] ** -0.5,
        )  # fmt: skip
        return out

    def rope_attend_native(self, rope, q, k, v, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode row at position `pos`, q and k pre-RoPE: rotated and attended over the
        merged tokens and the step's own k, v in one native call (rope_merged_attn; the
        arithmetic of `rope.apply` and attend_native) -> (out, k rotated)."""
        ka, va = self._native_halves()
        cos, ssin = rope.signed_tables(pos + 1)
        out, kr = self.kernels.rope_merged_attn(
            q, k, v, cos, ssin, pos, ka[0], ka[1], va[0], va[1], *ka[2:], *va[2:],
            int(not self.layout.token), q.shape[-1] ** -0.5,
        )  # fmt: skip
        return out, kr

    def attend_kivi_native(
        self, q, k_new, v_new, rope=None, pos: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode row over the pair's E in its KIVI store (minicache+kivi4) and the step's own
        exact k_new, v_new (1, Hkv, 1, D), in one native call (kivi_merged_attn: X_hat = E * n /
        ||E|| applied inside the products, the retained rows in place, nothing restored) ->
        (out, k_new rotated); with `rope` q and k_new are pre-RoPE and rotated at `pos` in the
        call. None where it does not apply (no kernels, scope=layer, not one float32 row,
        nothing merged)."""
        pair, st = self.pair, self.pair.kivi
        if (
            self.kernels is None
            or self.layout.token
            or pair.k is None
            or q.shape[2] != 1
            or q.dtype != torch.float32
            or pair.k.na.buf.dtype != torch.float32
            or st.length != pair.length
        ):
            return None
        kinv, vinv = self.inverse_norms()
        norms = [(h.nb if self.second else h.na).buf for h in (pair.k, pair.v)]
        ret = self.layout.retained_args(pair.k, self.second)
        ret += self.layout.retained_args(pair.v, self.second)
        cos, ssin = rope.signed_tables(pos + 1) if rope is not None else (None, None)
        out, kr = self.kernels.kivi_merged_attn(
            q, *st.rooms()[:6], st.body_len, *st.rooms()[6:], st.tail_len, st.bits, st.G,
            *norms, kinv, vinv, *ret, k_new, v_new, q.shape[-1] ** -0.5, cos, ssin, pos,
        )  # fmt: skip
        return out, kr

    def inverse_norms(self) -> list[torch.Tensor]:
        """Pair.kivi_inv brought up to the body's length: the new groups dequantized once."""
        pair, st = self.pair, self.pair.kivi
        tb = st.body_len
        if pair.kivi_inv is None or pair.kivi_inv[0].n > tb:
            dev = st.rooms()[0].device
            pair.kivi_inv = [Buffer((st.H, 0), 1, torch.float32, dev) for _ in range(2)]
        n0 = pair.kivi_inv[0].n
        if n0 < tb:
            rows = self.kernels.kivi_dequant(*st.body(), st.bits, st.G, n0, tb)  # (1, Hkv, n, D)
            for buf, x in zip(pair.kivi_inv, rows, strict=True):
                norm = torch.linalg.vector_norm(x[0], dim=-1)  # (Hkv, n)
                buf.append(torch.where(norm > 0, 1 / norm, 0.0))
        return [b.buf for b in pair.kivi_inv]

    def restore(self, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch views (1, Hkv, T + extra, D): the restored tokens, then room for `extra`."""
        n, pair = self.pair.length, self.pair
        ks, vs = self.scratch.views(n + extra)
        if n:
            if pair.work is None:  # layer a computes, b reuses
                pair.work = self.layout.directions(pair)
            self.layout.restore_into(pair, self.second, pair.work, ks[0, :, :n], vs[0, :, :n])
        return ks, vs

    def attend(self, q, k_new, v_new, positions, window: int | None) -> torch.Tensor:
        """SDPA over the restored tokens and the exact k_new, v_new (1, Hkv, n, D) after them."""
        ks, vs = self.restore(k_new.shape[2])
        ks[:, :, self.pair.length :], vs[:, :, self.pair.length :] = k_new, v_new
        k_pos = self.pair.first + torch.arange(ks.shape[2], device=ks.device)
        return dense_attention(q, ks, vs, positions, k_pos, window, self.kernels)
