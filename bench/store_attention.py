"""A decode step's attention over MiniCache's and SpindleKV's stores on the CPU: the native ops
(kernels/cpu/merged_attn.h) against the torch path the stores take without them, side by side.

    python bench/store_attention.py [--keys 8000] [--threads 2] [--reps 7]

The default model's shapes (30 layers, 9 query heads over 3 KV heads, head dim 64), one query
row, `keys` tokens seen, each layer's tensors distinct (its bytes come from memory, as in a
decode step). Per store, what one step attends over, alternated, median of --reps:

- minicache: 8 pairs of layers 14..29 (a merged E per token and KV head, each layer's norms,
  ~5% of the rows retained exact) attended by both layers of a pair, and the step's own exact
  token: `merged_attn` against `merged_decode_ref` + the own token + `combine`; the 14 plain
  layers: `attn_decode` against SDPA;
- spindlekv (--kv-budget 0.1): 30 layers of ~1,100 slots per KV head over codebooks of
  ~2,200 K and ~2,600 V rows, partial keep masks; the step's token coded (`codebook_assign`
  against `assign`, K and V) and the slots attended (`codebook_attn` against
  `codebook_decode_ref`).

Prints ms per step of each and the ratio torch / native.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_harness import alternate, clock, md_head, md_row

from kvrun.kernels.codebook_decode import codebook_decode_ref
from kvrun.kernels.merged_decode import merged_decode_ref
from kvrun.kv.attention import Partial, combine, sdpa
from kvrun.kv.methods.spindlekv.store import assign, pack_bits
from kvrun.quant import native

HQ, HKV, D, LAYERS, PAIRS = 9, 3, 64, 30, 8
G = HQ // HKV


def minicache(T: int, gen: torch.Generator) -> dict:
    """The step's attention over minicache's layers, native and torch."""
    ops = native.ops()
    scale = D**-0.5
    q = torch.randn(1, HQ, 1, D, generator=gen)
    kn, vn = torch.randn(2, 1, HKV, 1, D, generator=gen)
    plain = [torch.randn(2, 1, HKV, T, D, generator=gen) for _ in range(LAYERS - 2 * PAIRS)]
    pairs = []
    for _ in range(PAIRS):
        halves = []
        for _ in range(2):  # K, V
            e = torch.nn.functional.normalize(torch.randn(HKV, T, D, generator=gen), dim=-1)
            na, nb = 1 + torch.rand(2, HKV, T, generator=gen)
            keep = torch.rand(HKV, T, generator=gen) < 0.05
            h, t = keep.nonzero(as_tuple=True)
            roff = torch.zeros(HKV + 1, dtype=torch.int64)
            roff[1:] = torch.bincount(h, minlength=HKV).cumsum(0)
            ov = torch.full((HKV, T), -1, dtype=torch.int32)
            ov[h, t] = torch.arange(len(t), dtype=torch.int32)
            rows = torch.randn(2, len(t), D, generator=gen)
            halves.append((e, (na, nb), t.to(torch.int32), roff, rows, ov))
        pairs.append(halves)

    def own() -> Partial:  # the step's own token (Layout.own)
        qg = q.reshape(1, HKV, G, D)
        s = (qg * kn.reshape(1, HKV, 1, D)).sum(-1) * scale
        return Partial(vn.repeat_interleave(G, dim=1), s.reshape(1, HQ, 1))

    def run_native() -> None:
        for k, v in plain:
            ops.attn_decode(q, k, v, scale)
        for (ek, nk, ik, ok, rk, _), (ev, nv, iv, ovv, rv, _) in pairs:
            for b in (0, 1):
                ops.merged_attn(q, ek, nk[b], ev, nv[b], True, ik, ok, rk[b], iv, ovv, rv[b], 1,
                                kn, vn, scale)  # fmt: skip

    def run_torch() -> None:
        for k, v in plain:
            sdpa(q, k, v)
        for (ek, nk, _, _, rk, mk), (ev, nv, _, _, rv, mv) in pairs:
            for b in (0, 1):
                part = merged_decode_ref(q, ek, nk[b], ev, nv[b], True, mk, rk[b], mv, rv[b])
                combine([Partial(*part), own()], torch.float32)

    return {"native": run_native, "torch": run_torch}


def spindlekv(T: int, gen: torch.Generator) -> dict:
    """The step's coding and attention over spindlekv's layers at --kv-budget 0.1."""
    ops = native.ops()
    scale = D**-0.5
    S, CK, CV = max(T * 11 // 80, 1), max(T * 22 // 80, 1), max(T * 26 // 80, 1)
    q = torch.randn(1, HQ, 1, D, generator=gen)
    ang = torch.arange(T + 1)[:, None].float() * (1e4 ** -(torch.arange(0, D, 2) / D))[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    layers = []
    for _ in range(LAYERS):
        room = 64  # the shelf's spare rows for the step's new entries
        shelves = [torch.zeros(1, c + room, D) for c in (CK, CV)]
        for sh, c in zip(shelves, (CK, CV), strict=True):
            sh[0, :c] = torch.nn.functional.normalize(torch.randn(c, D, generator=gen), dim=-1)
        idx = [torch.randint(0, c, (HKV, S), generator=gen, dtype=torch.int16) for c in (CK, CV)]
        mags = [0.5 + 3 * torch.rand(HKV, S, generator=gen) for _ in range(2)]
        pos = torch.sort(torch.randperm(T, generator=gen)[: HKV * S].view(HKV, S) % T).values
        bits = torch.rand(HKV, S, G, generator=gen) < 0.7
        x = torch.randn(2, HKV, D, generator=gen)
        layers.append((shelves, (CK, CV), idx, mags, pos.int(), pack_bits(bits), x))

    def run_native() -> None:
        for shelves, counts, idx, mags, pos, mask, x in layers:
            for sh, c, xi, th in zip(shelves, counts, x, (0.98, 0.95), strict=True):
                ops.codebook_assign(xi, sh, torch.tensor([c]), th)
            ops.codebook_attn(q, shelves[0][0], idx[0], mags[0], shelves[1][0], idx[1], mags[1],
                              pos, cos, sin, mask, None, None, scale)  # fmt: skip

    def run_torch() -> None:
        for shelves, counts, idx, mags, pos, mask, x in layers:
            for sh, c, xi, th in zip(shelves, counts, x, (0.98, 0.95), strict=True):
                assign(sh[0, :c], xi, th)
            codebook_decode_ref(q, shelves[0][0], idx[0], mags[0], shelves[1][0], idx[1],
                                mags[1], pos, cos, sin, mask)  # fmt: skip

    return {"native": run_native, "torch": run_torch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=8000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if native.ops() is None:
        raise SystemExit(f"native kernels unavailable: {native.note()}")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"ms per decode step ({LAYERS} layers) at {args.keys} tokens, {args.threads} threads, "
          f"{native.ops().isa()}, median of {args.reps}")  # fmt: skip
    print("\n".join(md_head(["store", "native", "torch", "torch / native"], "lrrr")))
    for name, make in (("minicache", minicache), ("spindlekv 0.1", spindlekv)):
        forms = make(args.keys, gen)
        with torch.inference_mode():
            for f in forms.values():
                f()  # warm-up
            times = alternate({n: (lambda f=f: clock(f)) for n, f in forms.items()}, args.reps)
        ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        row = [name, f"{ms['native']:.2f}", f"{ms['torch']:.2f}"]
        print(md_row([*row, f"{ms['torch'] / ms['native']:.2f}x"]))


if __name__ == "__main__":
    main()
