"""llama-bench style speed and memory measurements over KV methods, budgets and depths.

For every (method, budget, depth) row and every rep: a fresh cache is filled with `depth`
random tokens (one prefill, not timed), then a prompt of `n_prompt` tokens is prefilled
(timed: pp) and `n_gen` tokens are decoded greedily one at a time (timed: tg). The first
rep of each row warms up and is dropped.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch

from ..kv import KVSpec
from ..run.graph import BatchGraph
from ..run.sampling import ban
from ..run.session import Session, peak_memory_bytes
from .bench_settings import BenchSettings, cases, check_settings, row_labels

BANDWIDTH_NOTE = (
    "achieved bandwidth ~ (weight bytes + KV bytes read per token) x decode tok/s / 1e9, where "
    "weight bytes = sum of parameter numel x element size in the compute dtype, and KV bytes "
    "read per token ~ the bytes the cache held during decode (mean of before and after); "
    "an approximation: it ignores activations, and caches or kernels that skip bytes"
)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and packed-weight buffer (tied tensors counted once)."""
    ts = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in ts)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rep_stats(key: str, xs: list[float]) -> dict:
    """{key: mean, key_std: sample std (0 for one rep), key_reps: xs}; None when not measured."""
    mean = statistics.mean(xs) if xs else None
    std = (statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else None
    return {key: mean, f"{key}_std": std, f"{key}_reps": xs}


def _one_rep(rt, spec: KVSpec, fill, prompt, first, s: BenchSettings) -> dict:
    """One fill + timed prompt + timed decode on a fresh cache (s.parallel caches: each is
    filled and prompted in turn, then all decode together in batched steps, and tg is the
    aggregate rate of the batch)."""
    dev = rt.model.device
    graph = "on" if s.cuda_graph else "off"
    sessions = [
        Session(
            rt.model,
            rt.tokenizer,
            rt.new_kv(spec),
            ubatch=s.ubatch,
            context=s.ctx_size,
            graph=graph,
        )
        for _ in range(s.parallel)
    ]
    sess, kv = sessions[0], sessions[0].kv
    logits = [x.prefill(fill) if fill else None for x in sessions]
    _sync(dev)
    t0 = time.perf_counter()
    if prompt:
        logits = [x.prefill(prompt) for x in sessions]
    _sync(dev)
    t1 = time.perf_counter()
    held_before = kv.nbytes()
    toks = [int(x.argmax()) if x is not None else first for x in logits]
    batch = BatchGraph(rt.model, sess.context) if graph == "on" and len(sessions) > 1 else None
    if s.n_gen:  # a CUDA graph is captured once per sequence (or batch), untimed
        if batch is None:
            sess.prepare_decode(s.n_gen)
        else:
            kvs = [x.kv for x in sessions]
            for x in sessions:
                batch.reserve(x.kv, len(x.tokens) + s.n_gen)
            batch.prepare(kvs, toks, [len(x.tokens) for x in sessions])
    _sync(dev)
    t2 = time.perf_counter()
    stops = rt.tokenizer.stop_ids if s.ignore_eos else ()
    for _ in range(s.n_gen):  # greedy, with the per-token sync a runner pays
        if len(sessions) == 1:
            toks = [int(ban(sess.decode(toks[0]), stops).argmax())]
        else:
            toks = ban(Session.decode_batch(sessions, toks, batch), stops).argmax(-1).tolist()
    _sync(dev)
    t3 = time.perf_counter()
    return {
        "pp": len(prompt) * len(sessions) / (t1 - t0) if prompt else None,
        "tg": s.n_gen * len(sessions) / (t3 - t2) if s.n_gen else None,
        "kv_bytes": kv.nbytes(),
        "kv_bytes_full": kv.nbytes_full(),
        "kv_read": (held_before + kv.nbytes()) / 2,
        "describe": kv.describe(),
        "cuda_graph": sess.graph_mode == "on",
    }


def bench_row(
    rt, kv: str, spec: KVSpec, depth: int, s: BenchSettings, on_rep=None, warmup: bool = True
) -> dict:
    """Measure one (method, budget, depth) row: one warm-up rep (unless warmup is False),
    then s.reps timed reps (kv: the --kv text the row is labelled with; spec: it validated,
    at the row's budget)."""
    dev = rt.model.device
    gen = torch.Generator().manual_seed(s.seed)  # the same tokens for every method
    ids = torch.randint(0, rt.config.vocab_size, (depth + s.n_prompt + 1,), generator=gen).tolist()
    fill, prompt, first = ids[:depth], ids[depth : depth + s.n_prompt], ids[-1]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    reps = []
    for r in range(0 if warmup else 1, s.reps + 1):
        out = _one_rep(rt, spec, fill, prompt, first, s)
        if r:  # rep 0 warms up
            reps.append(out)
        if on_rep:
            on_rep(r)
    last = reps[-1]
    pp = [x["pp"] for x in reps if x["pp"] is not None]
    tg = [x["tg"] for x in reps if x["tg"] is not None]
    wb = weight_bytes(rt.model)
    kv_read = statistics.mean(x["kv_read"] for x in reps)
    bw = [(wb + kv_read) * t / 1e9 for t in tg]
    test_pp, test_tg = row_labels(s, depth)
    desc = last["describe"]
    return {
        "kv": kv,
        "kv_method": desc,
        "budget": desc.get("budget"),
        "depth": depth,
        "n_prompt": s.n_prompt,
        "n_gen": s.n_gen,
        "reps": len(reps),
        "test_pp": test_pp,
        "test_tg": test_tg,
        **rep_stats("prefill_tok_s", pp),
        **rep_stats("decode_tok_s", tg),
        "cuda_graph": last["cuda_graph"],
        "kv_bytes": last["kv_bytes"],
        "kv_bytes_full": last["kv_bytes_full"],
        "kv_ratio": last["kv_bytes"] / last["kv_bytes_full"] if last["kv_bytes_full"] else 1.0,
        "kv_bytes_read_per_token": kv_read if tg else None,
        "weight_bytes": wb,
        **rep_stats("bandwidth_gb_s", bw),
        "peak_mem_bytes": peak_memory_bytes(dev),
    }


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> dict:
    """Where the numbers were taken."""
    cuda = device.type == "cuda"
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else _cpu_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def run_bench(rt, s: BenchSettings, on_rep: Callable[[str], None] | None = None) -> dict:
    """Every row of the grid, plus the settings, machine and model facts, as one JSON object."""
    from ..models.synthetic import is_synthetic

    check_settings(s, s.ctx_size or rt.config.context_length)
    synthetic = is_synthetic(rt)
    name = rt.config.name or rt.path.name
    dev = rt.model.device
    grid = cases(s)
    for _, _, spec, _ in grid:
        rt.new_kv(spec)  # a method that cannot run on this model fails before timing
    rows = []
    for kv, budget, spec, depth in grid:
        pp, tg = row_labels(s, depth)
        label = f"{kv}{f' {budget}' if budget else ''} {pp or tg}"
        cb = (lambda r, label=label: on_rep(f"{label} rep {r}/{s.reps}")) if on_rep else None
        row = bench_row(rt, kv, spec, depth, s, cb)
        rows.append({"model": name, "synthetic": synthetic, **row})
    return {
        "model": name,
        "model_path": str(rt.path),
        "synthetic": synthetic,
        "weight_bytes": weight_bytes(rt.model),
        "settings": {
            **s.record(),
            "ctx_size": s.ctx_size or rt.config.context_length,
            "warmup_reps": 1,
            "dtype": str(rt.model.dtype).removeprefix("torch."),
            "wtype": rt.weights.wtype,
            "device": str(dev),
            "tokens": "random ids from torch.Generator(seed), the same for every method",
            "decode": "greedy; tg tok/s = n_gen decode steps / their time (a CUDA graph's "
            "capture, once per sequence, is not timed)",
        },
        "peak_mem_kind": "cuda max allocated, reset per row"
        if dev.type == "cuda"
        else "process peak RSS (not reset per row)",
        "bandwidth_note": BANDWIDTH_NOTE,
        "machine": machine(dev),
        "rows": rows,
    }
