"""Fuzzing .kvc files from strangers (kvrun/run/kvc.py, kvrun/kv/state.py): seeded mutations of real
files of every kind of store. Each case is a one-line error, or a load whose continuation (a
question turn and decode steps) gives the unmodified file's logits bit for bit; never another
exception, and no file created or removed in the watched folder but the case's own.

The mutations: kinds swapped, class and function names put where values go, fields added and
removed, numbers out of range, tensors reshaped, retyped, narrowed or grown, header fields
changed, bytes of the header flipped, and the file cut anywhere. The fast tier runs a few
hundred cases; `slow` a few thousand; the table of counts:

    python tests/test_kvc_fuzz.py --cases 3000 [--seed 0]
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import traceback
from collections import Counter
from pathlib import Path

import pytest
import test_kv_methods
import torch
from test_kvc import DOC, QUESTION, STEPS, TinyRuntime, _continue, rewrite

import tiny_families
from kvrun.errors import KvrunError
from kvrun.kv import check
from kvrun.run import kvc
from kvrun.run.session import Session

# every kind of store: dense (scores, positions), KIVI, merged pairs (dense E and on KIVI),
# codebooks, XKV's allocation and turn, KVzip, and Gemma 3's local layers (MiniKV's windows)
SEEDS = [
    ("llama", "h2o"),
    ("llama", "snapkv+kivi2"),
    ("llama", "minicache"),
    ("llama", "minicache+kivi4"),
    ("llama", "spindlekv"),
    ("llama", "xkv"),
    ("llama", "kvzip"),
    ("gemma3", "minikv"),
]
NAMES = ["os:system", "builtins:eval", "torch:load", "subprocess:Popen", "shutil:rmtree",
         "kvrun.kv.protocol:copy.weakref.finalize", "pickle:loads", "importlib:import_module"]  # fmt: skip
OTHER_KINDS = [None, True, 0, 7, -1, 1.5, "x", "t0", [], [0], {}, {"a": 1}, [[1, 2]], "nan"]
OUT_OF_RANGE = [-1, -(2**63), 2**31, 2**64, 10**30]
DTYPES = [torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.uint8, torch.bool, torch.float32]  # fmt: skip


class Seed:
    """A real file of one method, its runtime and its continuation's logits."""

    def __init__(self, root: Path, family: str, text: str):
        torch.manual_seed(0)
        model = (
            test_kv_methods.tiny()
            if family == "llama"
            else test_kv_methods.random_transformer(tiny_families.kv_config(family), 11)
        )
        self.name = f"{family}:{text}"
        model_file = root / f"{family}.gguf"
        model_file.write_bytes(family.encode())
        self.rt = TinyRuntime(model, model_file)
        s = Session(model, None, self.rt.new_kv(check(text)), ubatch=64)
        s.prefill(test_kv_methods.prompt(DOC, seed=3))
        self.path = kvc.save(
            root / f"{family}-{text.replace('+', '_')}.kvc", s.kv, s.tokens, self.rt
        )
        self.question = test_kv_methods.prompt(QUESTION, seed=5)
        self.want = self.continue_from(*kvc.load(self.path, self.rt)[:2])

    def continue_from(self, kv, tokens) -> torch.Tensor:
        return _continue(self.rt.model, kv, tokens, self.question, STEPS)


# ------------------------------------------------------------------------ mutations
def _nodes(x, path=()):
    """(path, value) of every value in a JSON tree, the tree itself first."""
    yield path, x
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in items:
        yield from _nodes(v, (*path, k))


def _set(tree, path, value):
    if not path:
        return value
    node = tree
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return tree


def _pick(rng, tree, want):
    found = [(p, v) for p, v in _nodes(tree) if want(v)]
    return rng.choice(found) if found else (None, None)


def _kind(v) -> str:
    return "int" if type(v) is int else type(v).__name__


def swap_kind(rng, st):
    path, v = _pick(rng, st, lambda v: True)
    other = rng.choice([x for x in OTHER_KINDS if _kind(x) != _kind(v)])
    return _set(st, path, copy.deepcopy(other))


def put_name(rng, st):
    name = rng.choice(NAMES)
    value = rng.choice([name, {"$obj": name, "n": 1, "state": {}}, {"$fn": name},
                        {"$ctx": name}, {"$ref": 0}])  # fmt: skip
    path, v = _pick(rng, st, lambda v: not isinstance(v, (dict, list)) or not v)
    if path is None or rng.random() < 0.3:  # a new field holding it
        dpath, d = _pick(rng, st, lambda v: isinstance(v, dict))
        d[rng.choice(["attend", "__class__", "hook", name])] = value
        return st
    return _set(st, path, value)


def add_or_remove_field(rng, st):
    path, d = _pick(rng, st, lambda v: isinstance(v, dict) and v)
    if rng.random() < 0.5:
        del d[rng.choice(list(d))]
    else:
        d[rng.choice(["extra", "__dict__", "reset", list(d)[0] + "_"])] = rng.choice(OTHER_KINDS)
    return st


def out_of_range(rng, st):
    path, v = _pick(rng, st, lambda v: type(v) is int or (isinstance(v, str) and _is_float(v)))
    if path is None:
        return swap_kind(rng, st)
    new = (
        rng.choice(OUT_OF_RANGE) if type(v) is int else rng.choice(["nan", "inf", "-inf", "1e309"])
    )
    return _set(st, path, new)


def _is_float(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def change_tensor(rng, ts):
    key = rng.choice(sorted(ts))
    t = ts[key]
    op = rng.choice(["reshape", "transpose", "retype", "narrow", "grow"])
    if op == "reshape" and t.numel() > 1:
        sizes = [d for d in range(1, t.numel() + 1) if t.numel() % d == 0]
        a = rng.choice(sizes)
        t = t.reshape(rng.choice([(-1,), (a, -1), (1, *t.shape), (-1, a, 1)]))
    elif op == "transpose" and t.dim() >= 2:
        t = t.transpose(0, t.dim() - 1).contiguous()
    elif op == "retype":
        t = t.to(rng.choice([d for d in DTYPES if d != t.dtype]))
    elif op == "narrow" and t.dim() and t.shape[-1] > 0:
        t = t.narrow(-1, 0, rng.randrange(t.shape[-1])).contiguous()
    else:
        t = torch.cat([t, torch.zeros_like(t[..., :1])], dim=-1) if t.dim() else t[None]
    ts[key] = t.contiguous()
    return ts


def change_header(rng, h):
    key = rng.choice(["model", "spec", "class", "tokens", "turns", "kv_bytes", "format", "version"])
    if key in ("tokens", "kv_bytes") and rng.random() < 0.5:
        h[key] = h[key] + rng.choice([-1, 1, 10**9])
    elif key == "spec" and rng.random() < 0.5:
        h["spec"]["kv"] = rng.choice(["full", "h2o", "snapkv:window=1", "kivi2", "nope", ""])
    elif isinstance(h[key], dict) and h[key] and rng.random() < 0.5:
        h[key][rng.choice(list(h[key]))] = rng.choice(OTHER_KINDS + NAMES)
    else:
        h[key] = rng.choice(OTHER_KINDS + NAMES)
    return h


def flip_header_bytes(rng, data: bytes) -> bytes:
    n = int.from_bytes(data[:8], "little")
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(8, min(8 + n, len(out)))
        out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


STATE_OPS = {
    "kind": swap_kind,
    "name": put_name,
    "field": add_or_remove_field,
    "range": out_of_range,
}
KINDS = [*STATE_OPS, "tensor", "header", "flip", "cut"]


def make_case(rng, seed: Seed, kind: str, out: Path) -> Path:
    if kind in STATE_OPS:
        return rewrite(seed.path, out, state=lambda st: STATE_OPS[kind](rng, st))
    if kind == "tensor":
        return rewrite(seed.path, out, tensors=lambda ts: change_tensor(rng, ts))
    if kind == "header":
        return rewrite(seed.path, out, header=lambda h: change_header(rng, h))
    data = seed.path.read_bytes()
    if kind == "flip":
        out.write_bytes(flip_header_bytes(rng, data))
    else:
        out.write_bytes(data[: rng.randrange(len(data))])
    return out


# ----------------------------------------------------------------------------- runs
def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def run(root: Path, cases: int, seed: int = 0) -> dict[str, Counter]:
    """Cases spread over the seeds and the kinds of mutation: counts per kind (cases, errors,
    loaded, tracebacks, side effects) and the first few failures' texts under 'failures'."""
    rng = random.Random(seed)
    seeds = [Seed(root, f, t) for f, t in SEEDS]
    case_file = root / "case.kvc"
    before = _listing(root) | {case_file.name}
    counts: dict[str, Counter] = {k: Counter() for k in KINDS}
    failures: list[str] = []
    for i in range(cases):
        kind, s = KINDS[i % len(KINDS)], seeds[(i // len(KINDS)) % len(seeds)]
        c = counts[kind]
        c["cases"] += 1
        try:
            make_case(rng, s, kind, case_file)
        except Exception:  # noqa: BLE001 - a mutation that makes no file (safetensors refuses)
            c["not written"] += 1
            continue
        label = f"case {i} ({kind}, {s.name})"
        try:
            kv, tokens, _ = kvc.load(case_file, s.rt)
        except KvrunError as e:
            if "\n" in str(e):
                c["tracebacks"] += 1
                failures.append(f"{label}: an error of several lines: {e}")
            else:
                c["one-line errors"] += 1
        except Exception:  # noqa: BLE001 - what the test counts
            c["tracebacks"] += 1
            failures.append(f"{label}:\n{traceback.format_exc()}")
        else:
            try:
                same = torch.equal(s.continue_from(kv, tokens), s.want)
            except Exception:  # noqa: BLE001 - what the test counts
                c["tracebacks"] += 1
                failures.append(f"{label}: loaded, then:\n{traceback.format_exc()}")
            else:
                c["loaded, same tokens" if same else "loaded, other tokens"] += 1
                if not same:
                    failures.append(f"{label}: loaded, but its next tokens differ")
        if _listing(root) != before:
            c["side effects"] += 1
            failures.append(f"{label}: the folder changed: {sorted(_listing(root) ^ before)}")
    counts["failures"] = failures  # type: ignore[assignment]
    return counts


def table(counts: dict) -> str:
    cols = ["cases", "one-line errors", "loaded, same tokens", "loaded, other tokens",
            "not written", "tracebacks", "side effects"]  # fmt: skip
    rows = [f"| mutation | {' | '.join(cols)} |", "|---" * (len(cols) + 1) + "|"]
    total = Counter()
    for kind in KINDS:
        total.update(counts[kind])
        rows.append(f"| {kind} | " + " | ".join(str(counts[kind][c]) for c in cols) + " |")
    rows.append("| all | " + " | ".join(str(total[c]) for c in cols) + " |")
    return "\n".join(rows)


def _check(counts):
    failures = counts["failures"]
    assert not failures, "\n\n".join(failures[:5])
    assert sum(counts[k]["cases"] for k in KINDS) > 0


@pytest.mark.usefixtures("one_thread")
def test_fuzz_fast(tmp_path):
    _check(run(tmp_path, 800, seed=1))


@pytest.mark.slow  # a longer run of the same
@pytest.mark.usefixtures("one_thread")
def test_fuzz_long(tmp_path):
    _check(run(tmp_path, 4000, seed=2))


if __name__ == "__main__":
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="kvc-fuzz-") as d:
        result = run(Path(d), args.cases, args.seed)
    print(table(result))
    for f in result["failures"][:10]:
        print("\n" + f, file=sys.stderr)
    sys.exit(1 if result["failures"] else 0)
