"""Packed models kept on disk: a load maps the layout an earlier load made instead of making it again.

Building a packed model (GGUF blocks copied into the native kernels' 8-row interleaving,
kvrun/quant/blocks.py, or the int4 op's planes, kvrun/quant/int4mm.py) takes ~12 s of an 8B
Q4_0 file's load on a 2-core machine, against 0.4 s to map the kept one (the default model:
~0.5 s either way), and the result depends only on the file, the compute dtype, --wtype, the
torch build and the CPU. So the first packed load of a file
on a machine writes the built model's tensors (`Transformer.state`) to

    $KVRUN_CACHE/packed/<file stem>-<source>-<key>.safetensors   ($KVRUN_CACHE: ~/.cache/kvrun)

(in the background while the first load goes on), and later loads map that file
copy-on-write: nothing is read or copied until a product touches it, and the pages are the
OS page cache's, shared by every process that maps the model.

KVRUN_PACKED_CACHE=pages (for long sessions: kvrun serve, chat) then has a background thread
read each packed buffer of 2 MiB or more into memory of its own that asks the kernel for
2 MiB pages (transparent huge pages, "madvise" mode); the model takes those copies at the
start of its next forward pass (`Adopt`), in the thread that runs it, so no product ever
sees a tensor change under it. Decode streams every weight once a token, and the mapping's
4 KiB pages cost TLB misses: the 8B-shape Q4_0 file's step took 190-250 ms mapped against
185-246 ms in 2 MiB pages (five alternated runs, 0-20 % apart as the host drifted). Not the
default: until the copies are in, the process holds both (peak RSS 5.4 against 4.1 GiB on
that file) and the copying competes with the first prompt (first token 3.4 against 2.7 s;
34 s once, where the VM's memory was touched for the first time).
<source> names the model file by its real path; <key> hashes the file's identity (size,
mtime, inode) and the facts above, so a changed model file, torch build or CPU misses and is
built again; writing an entry removes the older ones of the same source.

The file is plain safetensors (any safetensors tool reads it), each tensor 64-byte aligned
(zero-filled `__pad` tensors fill the gaps, as the format allows no holes), its metadata
holding the format version, the key's facts and the layout. An entry is written under a
temporary name and renamed, so a reader never sees half of one; an entry that does not read
back whole (cut short, a header that does not parse or does not match the digest kept in
it, a layout outside the explicit list of what kvrun packs, tensors that do not fit the
model) is deleted and the model built again, never used. Only the header is hashed: hashing
the tensors' bytes would cost what the cache saves. KVRUN_PACKED_CACHE=off turns the cache off; an entry is not
written where it would leave less than 1 GiB of the disk free.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import mmap
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from ..quant.formats import BLOCK_SIZES, X8_BYTES
from ..quant.probes import cache_file
from .config import ModelConfig

FORMAT = 3  # bump when the layout of what is kept changes (2: GGUF blocks; 3: header digest)
ALIGN = 64
KEEP_FREE = 1 << 30
_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.uint8: "U8",
    torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
}  # fmt: skip
_BY_NAME = {v: k for k, v in _DTYPES.items()}


class UnreadableCacheEntry(Exception):
    """An entry that does not read back whole (the message says how)."""


HUGE = 2 << 20  # tensors this large are copied into memory of their own, in 2 MiB pages


def enabled() -> bool:
    return os.environ.get("KVRUN_PACKED_CACHE", "on").lower() not in ("0", "off", "no", "false")


def own_pages() -> bool:
    """KVRUN_PACKED_CACHE=pages: large tensors copied into 2 MiB pages after the load."""
    return os.environ.get("KVRUN_PACKED_CACHE", "on").lower() == "pages"


class Adopt:
    """Copies of a mapped entry's large tensors, read on a background thread into anonymous
    memory that asks for huge pages; `take()`, called by the model's forward pass, puts each
    finished copy in place of its mapped tensor (`Tensor.set_`: every holder of that tensor
    sees it) and lets the mapping's pages go. Returns None once all are taken."""

    PIECE = 64 << 20

    def __init__(self, fd: int, mapping: mmap.mmap, items: list[tuple[torch.Tensor, int]]):
        self.mapping, self.items = mapping, items  # (mapped tensor, its offset in the file)
        self.ready: list[tuple[int, torch.Tensor]] = []  # appended by the thread
        self.left = len(items)
        self.thread = threading.Thread(target=self._read, args=(os.dup(fd),), daemon=True)
        self.thread.start()

    def _read(self, fd: int) -> None:
        try:
            for i, (t, offset) in enumerate(self.items):
                nbytes = t.numel() * t.element_size()
                mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere ordinary pages
                    mem.madvise(mmap.MADV_HUGEPAGE)
                with memoryview(mem) as view:
                    done = 0
                    while done < nbytes:  # in pieces: one read returns at most ~2 GiB
                        n = os.preadv(fd, [view[done : done + self.PIECE]], offset + done)
                        if n <= 0:
                            raise OSError("the entry ended early")
                        done += n
                copy = torch.frombuffer(mem, dtype=t.dtype, count=t.numel()).view(t.shape)
                self.ready.append((i, copy))
        except OSError:  # the mapped tensors stay in use
            self.left = -1
        finally:
            os.close(fd)

    def take(self) -> Adopt | None:
        while self.ready:
            i, copy = self.ready.pop()
            t, offset = self.items[i]
            with torch.inference_mode(t.is_inference()), torch.no_grad():
                t.set_(copy)
            self._release(offset, copy.numel() * copy.element_size())
            self.left -= 1
        return None if self.left <= 0 and not self.thread.is_alive() else self

    def _release(self, offset: int, nbytes: int) -> None:
        """The mapped pages of a tensor now copied: out of the process (the file keeps them)."""
        page = mmap.PAGESIZE
        a, b = -(-offset // page) * page, (offset + nbytes) // page * page
        if b > a and hasattr(mmap, "MADV_DONTNEED"):
            self.mapping.madvise(mmap.MADV_DONTNEED, a, b - a)


def entry(files: list[Path], dtype: torch.dtype, wtype: str) -> Path | None:
    """Where the packed model built from `files` (the model file, or an HF folder's config and
    shards) with this dtype and wtype is kept on this machine; None with the cache off."""
    if not enabled():
        return None
    from ..quant import int4mm, native
    from ..quant.choice import matmul_path

    real = [os.path.realpath(f) for f in files]
    ident = []
    for f in real:
        st = os.stat(f)
        ident.append([f, st.st_size, st.st_mtime_ns, st.st_ino])
    facts = {
        "format": FORMAT,
        "files": ident,
        "dtype": str(dtype),
        "wtype": wtype,
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "block_rows": int4mm.block_rows(),
        "path": matmul_path("cpu", dtype),
        "native": native.ops() is not None,  # GGUF blocks interleaved for the native kernels
    }
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    source = hashlib.sha256(real[0].encode()).hexdigest()[:8]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(real[0]).stem)[:48]
    return cache_file().parent / "packed" / f"{stem}-{source}-{key}.safetensors"


def load(path: Path, config: ModelConfig):
    """The model kept at `path`, its tensors mapped from the file; None where there is no
    entry. Raises UnreadableCacheEntry (after deleting the entry) where it does not read back whole."""
    from .model import Transformer

    try:
        f = open(path, "rb")  # noqa: SIM115 - the mapping outlives the with-block
    except FileNotFoundError:
        return None
    try:
        with f:
            tensors, meta, mapping, offsets = _read(f)
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                raise UnreadableCacheEntry(f"format {meta.get('format')!r:.20}, not {FORMAT}")
            _check_layout(meta.get("layout"), tensors, config)
            model = Transformer.from_state(config, tensors, meta["layout"])
            held = {id(b) for b in model.buffers()}  # the packed layers' own (not parameters)
            big = [
                (tensors[k], offsets[k])
                for k in offsets
                if tensors[k].nbytes >= HUGE and id(tensors[k]) in held
            ]
            if big and hasattr(os, "preadv") and own_pages():
                model.adopt = Adopt(f.fileno(), mapping, big)
        return model
    except Exception as e:  # noqa: BLE001 - an entry that does not read back is built again
        path.unlink(missing_ok=True)
        raise UnreadableCacheEntry(f"{path.name}: {str(e)[:200]}") from None


_WRITING: list[threading.Thread] = []


def save(path: Path, model, log: Callable[[str], None]) -> None:
    """Keep `model` at `path`, written by a background thread (an 8B model's 5 GB take
    5-20 s to write, which the first load would otherwise wait for; the process waits for the
    thread at exit, and `wait()` does), then remove older entries of the same source. Says
    what it does through `log`; nothing is raised: the cache is an optimisation."""
    tensors, layout = model.state()  # the model's own tensors, which nothing writes to
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(path.parent).free
    except OSError as e:
        log(f"packed layout not kept in {path.parent}: {e.strerror or e}")
        return
    if free - size < KEEP_FREE:
        mib = f"{size / 2**20:,.0f} MiB"
        log(f"packed layout not kept: {mib} would leave less than 1 GiB free in {path.parent}")
        return
    meta = {"format": FORMAT, "layout": layout}
    thread = threading.Thread(target=_keep, args=(path, tensors, meta, log), name="packed-cache")
    thread.start()
    _WRITING.append(thread)
    log(f"keeping the packed layout in {path.parent} ({size / 2**20:,.0f} MiB): later loads map it")


def wait() -> None:
    """Wait for the entries being written."""
    while _WRITING:
        _WRITING.pop().join()


def _keep(path: Path, tensors: dict[str, torch.Tensor], meta: dict, log) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write(tmp, tensors, meta)
        tmp.replace(path)
    except OSError as e:
        log(f"packed layout not kept in {path.parent}: {e.strerror or e}")
        return
    finally:
        tmp.unlink(missing_ok=True)
    stem, source, _ = path.name.rsplit("-", 2)
    for old in path.parent.glob(f"{glob.escape(stem)}-{source}-*.safetensors"):
        if old != path:
            old.unlink(missing_ok=True)
    for tmp in path.parent.glob(".*.tmp"):  # left by a process killed while writing
        pid = tmp.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            tmp.unlink(missing_ok=True)


def _digest(header: dict) -> str:
    """A hash of an entry's header (every tensor's dtype, shape and offsets, and the layout):
    a header changed in any way is caught on reading, for hashing a few KiB (the data is not
    hashed: that would cost what the cache saves)."""
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()


def _write(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    header: dict = {"__metadata__": {"kvrun": json.dumps(meta, sort_keys=True)}}
    parts: list[torch.Tensor] = []
    offset = 0
    for name, t in tensors.items():
        if -offset % ALIGN:
            pad = -offset % ALIGN
            header[f"__pad{len(parts)}"] = _info("U8", [pad], offset, pad)
            parts.append(torch.zeros(pad, dtype=torch.uint8))
            offset += pad
        n = t.numel() * t.element_size()
        header[name] = _info(_DTYPES[t.dtype], list(t.shape), offset, n)
        parts.append(t)
        offset += n
    header["__metadata__"]["digest"] = _digest(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # the format allows trailing spaces
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in parts:
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _info(dtype: str, shape: list[int], offset: int, n: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}


def settle(model) -> None:
    """Wait for a mapped entry's copies (`Adopt`) and put them in place: what a long session
    runs on, before a benchmark times it."""
    if getattr(model, "adopt", None) is not None:
        model.adopt.thread.join()
        model.adopt = model.adopt.take()


def _read(f) -> tuple[dict[str, torch.Tensor], dict, mmap.mmap, dict[str, int]]:
    """The entry's tensors (mapped), its metadata, the mapping and each tensor's offset."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise UnreadableCacheEntry("cut short")
    # copy-on-write: writable for torch, and nothing written ever reaches the file
    mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    n = int.from_bytes(mapping[:8], "little")
    if 8 + n > size:
        raise UnreadableCacheEntry("its header runs past the end")
    try:
        header = json.loads(mapping[8 : 8 + n])
        digest = header["__metadata__"].pop("digest", None)
        if digest != _digest(header):
            raise UnreadableCacheEntry("its header does not match its digest")
        meta = json.loads(header.pop("__metadata__")["kvrun"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UnreadableCacheEntry(f"its header does not parse ({e})") from None
    start, end, tensors, offsets = 8 + n, 8 + n, {}, {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        dtype, shape = _BY_NAME[info["dtype"]], info["shape"]
        if not all(isinstance(x, int) and x >= 0 for x in (a, b, *shape)):
            raise UnreadableCacheEntry(f"tensor {name} has a shape or offsets that are not sizes")
        count = math.prod(shape)
        if b - a != count * dtype.itemsize or start + b > size:
            raise UnreadableCacheEntry(f"tensor {name} does not fit the file")
        end = max(end, start + b)
        if name.startswith("__pad"):
            continue
        if (start + a) % ALIGN:
            raise UnreadableCacheEntry(f"tensor {name} is not aligned")
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            flat = torch.frombuffer(mapping, dtype=dtype, count=count, offset=start + a)
            tensors[name], offsets[name] = flat.view(shape), start + a
    if end != size:
        raise UnreadableCacheEntry(f"{size - end:,} bytes more or fewer than its tensors take")
    return tensors, meta, mapping, offsets


_STACKED = {
    "self_attn.qkv": ("q_proj", "k_proj", "v_proj"),
    "mlp.gate_up": ("gate_proj", "up_proj"),
}
_INT4_PLANES = {4: 1, 8: 2}  # q8 runs as two 4-bit planes on CPU


def _check_layout(layout: object, tensors: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """An entry's layout against an explicit list: which layers may be packed (in the shapes
    the config gives, of the kinds kvrun makes, each buffer of the size its facts imply) and
    which slots stacking empties, before any object is built from it; else UnreadableCacheEntry."""
    if not isinstance(layout, dict) or set(layout) != {"packed", "empty"}:
        raise UnreadableCacheEntry("its layout is not kvrun's")
    packed, empty = layout["packed"], layout["empty"]
    if not isinstance(packed, dict) or not isinstance(empty, list):
        raise UnreadableCacheEntry("its layout is not kvrun's")
    shapes = _linear_shapes(config, tied=not any(k.startswith("lm_head.") for k in tensors))
    for name, facts in packed.items():
        if name not in shapes or not isinstance(facts, dict):
            raise UnreadableCacheEntry(f"it packs {name!r:.80}, which the model has no layer for")
        n, k = shapes[name]
        prefix = f"{name}."
        bufs = {t[len(prefix) :]: v for t, v in tensors.items() if t.startswith(prefix)}
        if facts.get("kind") in ("linear", "embedding"):
            want = _packed_buffers(facts, n, k)
        elif facts.get("kind") in ("block_linear", "block_embedding"):
            want = _block_buffers(facts, n, k)
        else:
            want = None
        embedding = name == "model.embed_tokens"
        if want is None or facts["kind"].endswith("embedding") != embedding:
            raise UnreadableCacheEntry(f"layer {name}'s facts are not kvrun's")
        may, must = want
        fits = all(b in may and _fits(v, *may[b]) for b, v in bufs.items())
        if not fits or not must <= set(bufs):
            raise UnreadableCacheEntry(f"layer {name}'s buffers do not match its facts")
    emptied = set(empty)
    for i in range(config.n_layers):
        for stack, parts in _STACKED.items():
            block, _ = stack.split(".")
            slots = {f"model.layers.{i}.{block}.{p}" for p in parts}
            fused = f"model.layers.{i}.{stack}" in packed
            if (slots <= emptied) != fused:
                raise UnreadableCacheEntry(f"layer {i}'s {stack} is stacked in part")
            emptied -= slots if fused else set()
    if emptied:
        raise UnreadableCacheEntry(
            f"it empties {sorted(map(str, emptied))[0][:80]!r}, which is no stacked slot"
        )


def _fits(t: torch.Tensor, shape: tuple[int, ...], dtypes: set) -> bool:
    return tuple(t.shape) == shape and t.dtype in dtypes


def _linear_shapes(c: ModelConfig, tied: bool) -> dict[str, tuple[int, int]]:
    """(out, in) of every layer of a model of config c that the cache may hold packed."""
    q, kv, d, f = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.dim, c.ffn_dim
    block = {"self_attn.q_proj": (q, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
             "self_attn.o_proj": (d, q), "self_attn.qkv": (q + 2 * kv, d),
             "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d), "mlp.down_proj": (d, f),
             "mlp.gate_up": (2 * f, d)}  # fmt: skip
    out = {"model.embed_tokens": (c.vocab_size, d)}
    if not tied:
        out["lm_head"] = (c.vocab_size, d)
    for i in range(c.n_layers):
        out |= {f"model.layers.{i}.{part}": shape for part, shape in block.items()}
    return out


def _packed_buffers(facts: dict, n: int, k: int) -> tuple[dict, set] | None:
    """What a PackedLinear of these facts may hold (buffer -> (shape, dtypes)) and must hold,
    or None where the facts are not ones kvrun writes for an (n, k) layer. The int4 layout
    drops the codes, and an inexact q4 layer its scales too."""
    bits, group, path, planes = (facts.get(x) for x in ("bits", "group", "path", "planes"))
    ok = (
        facts.get("shape") == [n, k]
        and bits in _INT4_PLANES
        and isinstance(group, int)
        and group > 0
        and k % group == 0
        and (bits == 8 or group % 2 == 0)
        and isinstance(facts.get("exact"), bool)
        and isinstance(facts.get("source"), str)
        and (path, planes) in (("dequant", 0), ("int4pack", _INT4_PLANES.get(bits)))
    )
    if not ok:
        return None
    g, floats = k // group, {torch.float16, torch.bfloat16, torch.float32}
    codes = ((n, k // 2), {torch.uint8}) if bits == 4 else ((n, k), {torch.int8})
    may = {"codes": codes, "scale": ((n, g), floats), "zero": ((n, g), floats)}
    for i in range(planes):
        may |= {f"w{i}": ((n, k // 2), {torch.uint8}), f"sz{i}": ((g, n, 2), {torch.bfloat16})}
    must = {"codes", "scale"} if path == "dequant" else {f"w{i}" for i in range(planes)}
    return may, must | {f"sz{i}" for i in range(planes)}


def _block_buffers(facts: dict, n: int, k: int) -> tuple[dict, set] | None:
    """What a BlockLinear of these facts holds (one uint8 buffer a part, row-major or in the
    native kernels' 8-row interleaving), as _packed_buffers."""
    types, rows, x8 = facts.get("types"), facts.get("rows"), facts.get("x8")
    if not (isinstance(types, list) and isinstance(rows, list) and isinstance(x8, list)):
        return None
    if not types or not len(types) == len(rows) == len(x8) or facts.get("k") != k:
        return None
    if not all(isinstance(r, int) and r > 0 for r in rows) or sum(rows) != n:
        return None
    out = {}
    for i, (t, r, il) in enumerate(zip(types, rows, x8, strict=True)):
        if t not in BLOCK_SIZES or not isinstance(il, bool) or (il and t not in X8_BYTES):
            return None
        elems, size = BLOCK_SIZES[t]
        if k % elems:
            return None
        shape = (-(-r // 8), k // elems * X8_BYTES[t]) if il else (r, k // elems * size)
        out[f"b{i}"] = (shape, {torch.uint8})
    return out, set(out)
