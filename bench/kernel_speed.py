"""Decode-attention kernel speed: dense vs KIVI-2 (and KIVI-4) at long contexts, Llama-3-8B shapes.

    python bench/kernel_speed.py [--contexts 8192,32768,131072] [--dtype bf16] [--reps 50] [--json]
    python bench/kernel_speed.py --check          # Triton vs torch reference on the GPU
    python bench/kernel_speed.py --tune           # sweep tile / warps of the decode kernels
    python bench/kernel_speed.py --compile 90     # compile every kernel for sm_90, no GPU needed

On CUDA it times one decode step's attention for one layer (B=1, Tq=1, Hq 32, Hkv 8, D 128)
with CUDA events around CUDA-graph replays (so Python launch overhead is not counted),
after a warm-up, and reports the median over --reps. Each replay walks through enough
distinct copies of the cache (>= 256 MiB together) that L2 never holds the data, as in a
real model where every layer has its own cache. Achieved bandwidth = bytes the kernel must
read (K, V or codes + scales + zeros, plus q) / time; peak from --peak-gbps (default by GPU
name: H100 SXM 3350, H200 4800 GB/s). Without CUDA it times the torch references on small
shapes on the CPU and says so: those are not kernel figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when imported by path (gpu_smoke)
from bench_harness import timed  # noqa: E402

PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0}  # HBM peak by GPU name (SXM parts)
L2_DEFEAT_BYTES = 256 * 2**20


def _peak(name: str, flag: float | None) -> float | None:
    if flag is not None:
        return flag
    return next((v for k, v in PEAK_GBPS.items() if k in name), None)


def dense_bytes(Hq: int, Hkv: int, T: int, D: int, e: int) -> int:
    """K and V read once, plus q (the output and lse writes are negligible and not counted)."""
    return 2 * Hkv * T * D * e + Hq * D * e


def kivi_bytes(Hq: int, Hkv: int, T: int, D: int, e: int, bits: int, G: int) -> int:
    """Packed K and V codes, their scales and zeros (KV dtype), plus q."""
    codes = 2 * Hkv * T * D * bits // 8
    scales = 2 * 2 * Hkv * T * (D // G) * e  # K: (D, T/G), V: (T, D/G); scale + zero each
    return codes + scales + Hq * D * e


# ----------------------------------------------------------------------------- inputs
def make_inputs(T, Hq, Hkv, D, dtype, device, bits_list, G, dense_copies, kivi_copies):
    """A query, `dense_copies` independent dense caches and `kivi_copies[b]` KIVI bodies of T
    tokens for each bits b (distinct copies so that replays do not hit in L2)."""
    from kvrun.kernels.kivi_pack import kivi_pack

    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, Hq, 1, D, device=device, dtype=dtype, generator=gen)
    dense, kivi = [], {b: [] for b in bits_list}
    for i in range(max([dense_copies, *kivi_copies.values()])):
        k = torch.randn(1, Hkv, T, D, device=device, dtype=dtype, generator=gen)
        v = torch.randn(1, Hkv, T, D, device=device, dtype=dtype, generator=gen)
        for b in bits_list:
            if i < kivi_copies[b]:
                kivi[b].append(kivi_pack(k[0], v[0], b, G))
        if i < dense_copies:
            dense.append((k, v))
    return q, dense, kivi


# ----------------------------------------------------------------------------- timing
def time_cuda(calls: list, reps: int, warmup: int, graph: bool) -> float:
    """Median ms of one call: each rep replays all `calls` (distinct caches) between events."""
    for _ in range(warmup):
        for c in calls:
            c()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for c in calls:  # warm the allocator on the side stream before capture
                c()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for c in calls:
                c()
        run = g.replay
    else:

        def run():
            for c in calls:
                c()

    run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return statistics.median(times)


def time_cpu(call, reps: int, warmup: int) -> float:
    return timed(call, reps, warmup).median * 1e3


# ----------------------------------------------------------------------------- modes
def bench(a, cuda: bool) -> dict:
    from kvrun.kernels import dense_decode as dd
    from kvrun.kernels import kivi_decode as kd

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    e = torch.finfo(dtype).bits // 8
    Hq, Hkv, D, G = a.hq, a.hkv, a.head_dim, a.group
    device = "cuda" if cuda else "cpu"
    gpu = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    peak = _peak(gpu, a.peak_gbps) if cuda else None
    bits_list = [int(b) for b in a.bits.split(",")]
    rows = []
    for T in (int(x) for x in a.contexts.split(",")):
        nbytes = {"dense": dense_bytes(Hq, Hkv, T, D, e)}
        nbytes.update({f"kivi{b}": kivi_bytes(Hq, Hkv, T, D, e, b, G) for b in bits_list})
        copies = {
            k: max(1, math.ceil(L2_DEFEAT_BYTES / n)) if cuda else 1 for k, n in nbytes.items()
        }
        kivi_copies = {b: copies[f"kivi{b}"] for b in bits_list}
        q, dense, kivi = make_inputs(
            T, Hq, Hkv, D, dtype, device, bits_list, G, copies["dense"], kivi_copies
        )
        dense_fn = dd.dense_decode_triton if cuda else dd.dense_decode_ref
        kivi_fn = kd.kivi_decode_triton if cuda else kd.kivi_decode_ref
        calls = {"dense": [partial(dense_fn, q, k, v) for k, v in dense]}
        for b in bits_list:
            calls[f"kivi{b}"] = [partial(kivi_fn, q, *body, b, G) for body in kivi[b]]
        ms = {
            name: time_cuda(c, a.reps, a.warmup, not a.no_graph)
            if cuda
            else time_cpu(c[0], a.reps, a.warmup)
            for name, c in calls.items()
        }
        for name, t in ms.items():
            gbps = nbytes[name] / (t * 1e-3) / 1e9
            rows.append(
                {
                    "kernel": name,
                    "context": T,
                    "us": round(t * 1e3, 2),
                    "bytes": nbytes[name],
                    "gbps": round(gbps, 1),
                    "pct_peak": round(100 * gbps / peak, 1) if peak else None,
                    "speedup_vs_dense": round(ms["dense"] / t, 2),
                    "copies": copies[name],
                }
            )
        del q, dense, kivi, calls
        if cuda:
            torch.cuda.empty_cache()
    return {
        "figures": "cuda-triton" if cuda else "cpu-torch-reference",
        "device": gpu,
        "peak_gbps": peak,
        "dtype": a.dtype,
        "shape": {"B": 1, "Tq": 1, "Hq": Hq, "Hkv": Hkv, "D": D, "group": G},
        "reps": a.reps,
        "cuda_graph": cuda and not a.no_graph,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "rows": rows,
    }


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def check(a, cuda: bool) -> bool:
    """Triton vs reference on every kernel; True when all agree within tolerance."""
    from kvrun.kernels import codebook_decode as cb_
    from kvrun.kernels import colsum as cs
    from kvrun.kernels import dense_decode as dd
    from kvrun.kernels import kivi_decode as kd
    from kvrun.kernels import kivi_pack as kp
    from kvrun.kernels import merged_decode as md

    dev = "cuda" if cuda else "cpu"
    dtypes = (
        [torch.float16, torch.bfloat16, torch.float32] if cuda else [torch.float16, torch.float32]
    )
    scale = 1 if cuda else 0  # the interpreter is slow: small shapes on CPU
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=gen)

    tol = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
    ok = True

    def report(name, got, ref, dtype, exact=False):
        nonlocal ok
        errs = []
        for x, y in zip(got, ref, strict=True):
            if exact:
                errs.append(0.0 if torch.equal(x, y) else float("inf"))
                continue
            fin = torch.isfinite(y)
            same_inf = bool((torch.isfinite(x) == fin).all())
            err = ((x - y).abs() / (1 + y.abs()))[fin].max().item() if fin.any() else 0.0
            errs.append(err if same_inf else float("inf"))
        worst = max(errs)
        good = worst == 0.0 if exact else worst <= tol[dtype]
        ok &= good
        print(
            f"{'ok  ' if good else 'FAIL'} {name:<48} {str(dtype)[6:]:<9} max rel err {worst:.2e}"
        )

    Hkv, g, D = 8, 4, 128
    for dtype in dtypes:
        T = 5000 if cuda else 300
        q = rnd(2, Hkv * g, 1, D, dtype=dtype)
        k, v = rnd(2, Hkv, T, D, dtype=dtype), rnd(2, Hkv, T, D, dtype=dtype)
        lens = torch.tensor([T, T // 3], device=dev, dtype=torch.int32)
        report(f"dense_decode T={T} lengths probs", dd.dense_decode_triton(q, k, v, lens, True),
               dd.dense_decode_ref(q, k, v, lens, True), dtype)  # fmt: skip
        q4 = rnd(1, Hkv * g, 4, D, dtype=dtype)
        report(f"dense_decode T={T} Tq=4 causal", dd.dense_decode_triton(q4, k[:1], v[:1], None, False, T - 4),
               dd.dense_decode_ref(q4, k[:1], v[:1], None, False, T - 4), dtype)  # fmt: skip
        for bits, G in ((2, 32), (4, 32), (2, 16)):
            n = 8192 * scale + 256
            kk, vv = rnd(Hkv, n, D, dtype=dtype) * 3, rnd(Hkv, n, D, dtype=dtype)
            body = kp.kivi_pack_ref(kk, vv, bits, G)
            report(
                f"kivi_pack n={n} bits={bits} G={G}",
                kp.kivi_pack_triton(kk, vv, bits, G),
                body,
                dtype,
                exact=True,
            )
            report(f"kivi_decode Tb={n} bits={bits} G={G}", kd.kivi_decode_triton(q[:1], *body, bits, G),
                   kd.kivi_decode_ref(q[:1], *body, bits, G), dtype)  # fmt: skip
        T = 2048 if cuda else 130
        for Tq in (T, T // 4):
            qc = rnd(1, Hkv * g, Tq, D, dtype=dtype)
            kc, vc = rnd(1, Hkv, T, D, dtype=dtype), rnd(1, Hkv, T, D, dtype=dtype)
            for per_head in (False, True):
                report(f"colsum T={T} Tq={Tq} per_head={per_head}", cs.colsum_triton(qc, kc, vc, per_head),
                       cs.colsum_ref(qc, kc, vc, per_head), dtype)  # fmt: skip
        S, n_rows = (6000, 4096) if cuda else (200, 64)
        ang = torch.arange(2 * S, device=dev)[:, None] * 10000.0 ** (
            -torch.arange(0, D, 2, device=dev) / D
        )
        cos, sin = (
            torch.cat([ang, ang], 1).cos().to(dtype),
            torch.cat([ang, ang], 1).sin().to(dtype),
        )
        books = [
            torch.nn.functional.normalize(rnd(n_rows, D, dtype=torch.float32), dim=-1).to(dtype)
            for _ in "kv"
        ]
        idx = [
            torch.randint(0, n_rows, (Hkv, S), device=dev, generator=gen).to(torch.int16)
            for _ in "kv"
        ]
        mag = [rnd(Hkv, S, dtype=dtype).abs() * 4 for _ in "kv"]
        pos = torch.randperm(2 * S, device=dev, generator=gen)[:S].sort().values.to(torch.int32)
        pos = pos.expand(Hkv, S).contiguous()
        mask = torch.randint(0, 1 << g, (Hkv, S, 1), device=dev, generator=gen).to(torch.uint8)
        args = (q[:1], books[0], idx[0], mag[0], books[1], idx[1], mag[1], pos, cos, sin)
        for m in (None, mask):
            report(f"codebook_decode S={S} mask={m is not None}", cb_.codebook_decode_triton(*args, m),
                   cb_.codebook_decode_ref(*args, m), dtype)  # fmt: skip
        T = 5000 if cuda else 200
        ek, ev = rnd(Hkv, T, D, dtype=dtype), rnd(Hkv, T, D, dtype=dtype)
        nk, nv = rnd(Hkv, T, dtype=dtype).abs() * 8, rnd(Hkv, T, dtype=dtype).abs() * 2
        keep = torch.rand(Hkv, T, device=dev, generator=gen) < 0.05  # ~5% rows retained
        ov = torch.full((Hkv, T), -1, device=dev, dtype=torch.int32)
        ov[keep] = torch.arange(int(keep.sum()), device=dev, dtype=torch.int32)
        rk, rv = rnd(int(keep.sum()), D, dtype=dtype), rnd(int(keep.sum()), D, dtype=dtype)
        for over in (False, True):
            extra = (ov, rk, ov, rv) if over else ()
            margs = (q[:1], ek, nk, ev, nv, True, *extra)
            report(f"merged_decode T={T} retained={over}", md.merged_decode_triton(*margs),
                   md.merged_decode_ref(*margs), dtype)  # fmt: skip
    return ok


def compile_only(arch: int) -> bool:
    """Compile every kernel (fp16 and bf16, typical tiles) for sm_`arch` without a GPU, with
    the specialisation a real launch gets (unit strides constant, aligned pointers, strides
    multiples of 16),
    and print registers and spills: catches errors that the interpreter forgives."""
    import subprocess
    import tempfile

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvrun.kernels import codebook_decode as cb_
    from kvrun.kernels import colsum as cs
    from kvrun.kernels import dense_decode as dd
    from kvrun.kernels import kivi_decode as kd
    from kvrun.kernels import kivi_pack as kp
    from kvrun.kernels import merged_decode as md

    unit = {"sqd", "skd", "svd", "ssn", "skc_w", "sks_d", "svc_w", "svs_g"}
    unit |= {"sbk_d", "sbv_d", "sik_s", "siv_s", "smk_s", "smv_s", "sp_s", "sc_d", "sm_b"}
    unit |= {"sek_d", "sev_d", "ssk_t", "ssv_t", "sok_t", "srk_d", "sov_t", "srv_d"}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    ok = True

    def build(
        fn, consts: dict, dt: str, types: dict | None = None, hints: bool = True, warps: int = 4
    ) -> None:
        """types: pointer types by argument name; hints=False: no divisibility claimed for
        integer arguments (strides of ragged tensors)."""
        nonlocal ok
        sig, const, attrs = {}, {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in unit:
                sig[name], const[name] = "constexpr", 1
            elif name in consts:
                sig[name], const[name] = "constexpr", consts[name]
            elif name.endswith("_ptr"):
                sig[name] = (types or {}).get(name) or (
                    "*i32"
                    if name[:2] in ("kc", "vc") or name == "len_ptr"
                    else (
                        "*fp32"
                        if name[:2] in ("po", "pl", "s_", "o_", "ls", "co", "ou")
                        else f"*{dt}"
                    )
                )
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[name] = "fp32" if name == "sm_scale" else "i32"
                # strides: multiples of D, but a KIVI key group's words per channel (skc_d)
                if hints and name.startswith("s") and name not in ("split", "sm_scale", "skc_d"):
                    attrs[(i,)] = [["tt.divisibility", 16]]
        keys = ("BITS", "GROUP", "HAS_LEN", "PER_HEAD", "CODED", "HAS_MASK", "UNIT", "OV_K")
        label = f"{fn.__name__} {dt} " + " ".join(f"{k}={consts[k]}" for k in keys if k in consts)
        try:
            k = triton.compile(
                ASTSource(fn, sig, const, attrs),
                target=GPUTarget("cuda", arch, 32),
                options={"num_warps": warps},
            )
        except Exception as e:  # report every kernel, then fail
            ok = False
            print(f"FAIL {label}: {str(e).splitlines()[0]}")
            return
        usage = ""
        if os.path.exists(cuobjdump):
            with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                out = subprocess.run(
                    [cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True
                ).stdout
                usage = next((ln.strip()[:32] for ln in out.splitlines() if "REG:" in ln), "")
        print(f"ok   {label}: {usage} shared {k.metadata.shared} B")

    for dt in ("fp16", "bf16"):
        tdt = {"fp16": tl.float16, "bf16": tl.bfloat16}[dt]
        base = dict(G=4, BLOCK_M=16, BLOCK_N=64, BLOCK_D=128, PREC="tf32")
        build(dd._dense_decode_kernel, dict(base, HAS_LEN=False, CAUSAL=False, WRITE_S=False), dt)
        build(dd._dense_decode_kernel, dict(base, HAS_LEN=True, CAUSAL=True, WRITE_S=True), dt)
        for bits, G in ((2, 32), (4, 32), (2, 16)):
            build(kd._kivi_decode_kernel, dict(base, BITS=bits, GROUP=G, CAUSAL=False), dt)
            build(kp._pack_keys_kernel, dict(BITS=bits, GROUP=G, BLOCK_D=128, DT=tdt), dt)
            build(
                kp._pack_values_kernel,
                dict(BITS=bits, GROUP=G, NGP=128 // G, BLOCK_T=32, DT=tdt),
                dt,
            )
        build(cs._attn_fwd_kernel, dict(base, BLOCK_M=64), dt)
        build(cs._colsum_kernel, dict(base, BLOCK_M=64, PER_HEAD=False), dt)
        build(cs._colsum_kernel, dict(base, BLOCK_M=64, PER_HEAD=True), dt)
        cb = dict(base, BLOCK_H=64, BLOCK_N=32, OFF_K=False, OFF_V=False)
        types = {"ik_ptr": "*i16", "iv_ptr": "*i16", "pos_ptr": "*i32", "msk_ptr": "*u8",
                 "ok_ptr": "*i32", "ov_ptr": "*i32", "cos_ptr": f"*{dt}", "sin_ptr": f"*{dt}"}  # fmt: skip
        build(cb_._codebook_decode_kernel, dict(cb, CODED=True, HAS_MASK=False), dt, types, False)
        build(cb_._codebook_decode_kernel, dict(cb, CODED=True, HAS_MASK=True, OFF_K=True,
                                               OFF_V=True), dt, types, False)  # fmt: skip
        build(cb_._codebook_decode_kernel, dict(cb, CODED=False, HAS_MASK=True), dt, types, False)
        mtypes = {"ok_ptr": "*i32", "ov_ptr": "*i32"}
        for unit_, ovr in ((True, False), (True, True), (False, True)):
            mb = dict(base, BLOCK_N=32, UNIT=unit_, OV_K=ovr, OV_V=ovr)
            build(md._merged_decode_kernel, mb, dt, mtypes, False, warps=8)
    build(dd._combine_kernel, dict(BLOCK_S=64, BLOCK_D=128), "fp32")
    return ok


def tune(a) -> None:
    """Sweep tile and warps of the two decode kernels at one context (CUDA only)."""
    from kvrun.kernels import dense_decode as dd
    from kvrun.kernels import kivi_decode as kd

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    e = torch.finfo(dtype).bits // 8
    T = int(a.contexts.split(",")[-1])
    Hq, Hkv, D, G = a.hq, a.hkv, a.head_dim, a.group
    q, dense, kivi = make_inputs(T, Hq, Hkv, D, dtype, "cuda", [2], G, 2, {2: 2})
    for bn in (32, 64, 128):
        for nw in (4, 8):
            for split in (None, 512, 1024, 2048):
                if split is not None and split % bn:
                    continue
                kw = dict(block_n=bn, num_warps=nw, split=split)
                cd = [partial(dd.dense_decode_triton, q, k, v, **kw) for k, v in dense]
                ck = [partial(kd.kivi_decode_triton, q, *body, 2, G, **kw) for body in kivi[2]]
                td = time_cuda(cd, a.reps, a.warmup, True)
                tk = time_cuda(ck, a.reps, a.warmup, True)
                gd = dense_bytes(Hq, Hkv, T, D, e) / td / 1e6
                gk = kivi_bytes(Hq, Hkv, T, D, e, 2, G) / tk / 1e6
                print(
                    f"T={T} block_n={bn} warps={nw} split={split}: dense {td * 1e3:.1f} us ({gd:.0f} GB/s), kivi2 {tk * 1e3:.1f} us ({gk:.0f} GB/s)"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--contexts",
        default=None,
        help="comma list (default 8192,32768,131072 on CUDA, 1024,4096 on CPU)",
    )
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--bits", default="2,4", help="KIVI bits to time (comma list)")
    ap.add_argument("--group", type=int, default=32, help="KIVI group size G")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--peak-gbps", type=float, default=None, help="HBM peak (default by GPU name)")
    ap.add_argument("--no-graph", action="store_true", help="time plain launches, not CUDA graphs")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--check", action="store_true", help="compare Triton with the references")
    ap.add_argument("--tune", action="store_true", help="sweep decode tiles and warps (CUDA)")
    ap.add_argument("--compile", type=int, metavar="SM", help="only compile the kernels for sm_SM")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    if a.compile:
        # compile for real (TRITON_INTERPRET=0), and have kvrun.kernels import triton without a
        # GPU (KVRUN_KERNELS=triton), both before the kernels are defined
        os.environ["TRITON_INTERPRET"] = "0"
        os.environ["KVRUN_KERNELS"] = "triton"
        sys.exit(0 if compile_only(a.compile) else 1)
    if a.check:
        if not cuda:  # the Triton interpreter must be chosen before any kernel is defined
            os.environ.setdefault("TRITON_INTERPRET", "1")
            print("no CUDA: checking in the Triton interpreter on small CPU shapes")
        sys.exit(0 if check(a, cuda) else 1)
    if a.tune:
        if not cuda:
            sys.exit("--tune needs a CUDA GPU")
        a.contexts = a.contexts or "32768"
        tune(a)
        return
    if not cuda:
        a.dtype = "fp32" if a.dtype == "bf16" else a.dtype  # CPU matmuls in bf16 are slow and rare
        a.reps = min(a.reps, 5)
    a.contexts = a.contexts or ("8192,32768,131072" if cuda else "1024,4096")
    res = bench(a, cuda)
    if a.json:
        print(json.dumps(res, indent=2))
        return
    if not cuda:
        print(
            "CPU REFERENCE FIGURES: no CUDA device, so these time the torch reference path on the"
        )
        print("CPU (no Triton kernel ran); they say nothing about GPU kernel speed.")
    print(
        f"{res['device']}, {res['dtype']}, B=1 Tq=1 Hq={a.hq} Hkv={a.hkv} D={a.head_dim} G={a.group}, "
        f"median of {res['reps']} reps{', CUDA graphs' if res['cuda_graph'] else ''}, "
        f"peak {res['peak_gbps'] or 'unknown'} GB/s"
    )
    print("| kernel | context | time (us) | bytes read | GB/s | % of peak | speedup vs dense |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in res["rows"]:
        pct = f"{r['pct_peak']:.1f}" if r["pct_peak"] is not None else "-"
        print(
            f"| {r['kernel']} | {r['context']} | {r['us']:.1f} | {r['bytes']:,} | "
            f"{r['gbps']:.1f} | {pct} | {r['speedup_vs_dense']:.2f}x |"
        )


if __name__ == "__main__":
    main()
