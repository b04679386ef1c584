"""Model file headers, read without torch: GGUF metadata and tensor tables (with checks that
name a damaged tensor), safetensors headers and shards. `kvrun info` and `kvrun models` need no
more than this; kvrun.models.weights loads the tensors."""

from __future__ import annotations

import json
import math
import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import KvrunError, ModelNotFound
from .families import FAMILIES

GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# parts some families' blocks add (HF's names; a family's own names are in its file in
# kvrun/models/families/); the fused ones are split at load
GGUF_BLOCK_MORE = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # Q, K, V in one weight
}
GGUF_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "rope_freqs": "rope_freqs",
    "rope_factors_long": "rope_factors_long",  # Phi-3's LongRoPE factors
    "rope_factors_short": "rope_factors_short",
}
ROPE_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")  # not the model's own
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def block_parts(arch: str) -> dict[str, str]:
    """llama.cpp block part -> HF part for a family (an unknown arch: the shared names)."""
    fam = FAMILIES.get(arch)
    return {**GGUF_BLOCK, **GGUF_BLOCK_MORE, **(fam.block_parts if fam else {})}


def gguf_name_to_hf(name: str, arch: str = "llama") -> str | None:
    """Map a llama.cpp tensor name to the canonical (HF) name; None when unknown."""
    m = _BLK.match(name)
    if m:
        block, part, kind = m.groups()
        hf = block_parts(arch).get(part)
        return f"model.layers.{block}.{hf}.{kind}" if hf else None
    stem, _, kind = name.rpartition(".")
    hf = GGUF_TOP.get(stem)
    return f"{hf}.{kind}" if hf and hf not in ROPE_TENSORS else hf


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: the fields kvrun reads of a gguf.ReaderTensor."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order (innermost first), as gguf gives it
    data_offset: int
    data: np.ndarray  # a view of the memory map: elements for float types, block bytes else


@dataclass
class GGUFFile:
    """A GGUF file's metadata and tensor table, its tensors left in the memory map."""

    meta: dict[str, Any]
    tensors: list[GGUFTensor]
    mapping: mmap.mmap | None = None
    # a model split in parts (`-00001-of-00003.gguf`): the part's mapping of each tensor
    part_maps: dict[str, mmap.mmap] = field(default_factory=dict)

    def release(self, t: GGUFTensor) -> None:
        """Unmap a tensor's pages from this process once it has been read. They stay in the
        OS page cache (a later read maps them again), but no longer count in the process's
        memory: loading an 8B Q4 file otherwise ends with the whole 4.2 GB file resident
        beside the converted model."""
        mapping = self.part_maps.get(t.name, self.mapping)
        if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return  # platforms without madvise keep the pages mapped
        start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        mapping.madvise(mmap.MADV_DONTNEED, start, t.data_offset + t.data.nbytes - start)


# GGUF value types: (struct code, numpy dtype) of the scalar types; 8 is a string, 9 an array
_SCALARS = {
    0: ("B", np.uint8), 1: ("b", np.int8), 2: ("H", np.uint16), 3: ("h", np.int16),
    4: ("I", np.uint32), 5: ("i", np.int32), 6: ("f", np.float32), 7: ("?", np.bool_),
    10: ("Q", np.uint64), 11: ("q", np.int64), 12: ("d", np.float64),
}  # fmt: skip
_ELEMENT_DTYPE = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                  "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


_SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def split_parts(path: Path) -> list[Path]:
    """The files of a model split in parts (llama.cpp's gguf-split names), in order, given any
    one of them; [path] for a whole file."""
    m = _SPLIT.match(Path(path).name)
    if not m:
        return [Path(path)]
    stem, n = m.group(1), int(m.group(3))
    return [Path(path).with_name(f"{stem}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def open_gguf(path: Path) -> GGUFFile:
    """A GGUF model's header and mapped tensors: a whole file, or every part of a split one
    (the first part holds the metadata; each part's tensors are mapped from that part)."""
    path = Path(path)
    parts = split_parts(path)
    first = _open_one(parts[0])
    count = first.meta.get("split.count", 1) or 1
    if not isinstance(count, int) or not 1 <= count <= 99999:  # part names have 5 digits
        raise KvrunError(f"{path} is a damaged GGUF file: its split.count is {count!r:.40}")
    if len(parts) == 1 and count == 1:
        return first
    if count != len(parts):
        raise KvrunError(f"{path} says it is one of {count} parts; its name says {len(parts)}")
    for p in parts[1:]:
        if not p.exists():
            raise ModelNotFound(f"{path} is part of a split model, and {p.name} is missing")
        part = _open_one(p)
        first.tensors += part.tensors
        first.part_maps.update({t.name: part.mapping for t in part.tensors})
    return first


def _open_one(path: Path) -> GGUFFile:
    """Read a GGUF file's header (metadata and tensor table) and map its tensors, with a clear
    error for anything that is not a whole GGUF file.

    The header is parsed here, following the GGUF specification (little-endian, versions 2
    and 3), not by gguf.GGUFReader: that reader makes a numpy view for every string of the
    tokenizer's vocabulary and merges, about 2 s for a 49k-token vocabulary, where this
    takes a few hundredths. gguf still supplies the type table and the tensor layouts.
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelNotFound(f"cannot read {path}: {e.strerror}") from None
    if magic != b"GGUF":
        raise KvrunError(f"{path} is not a GGUF file (bad magic {magic!r})")
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    data = np.frombuffer(mapping, dtype=np.uint8)  # read-only: views of it are never written
    try:
        reader = _Header(data).read()
    except _Damaged as e:
        raise KvrunError(f"{path} is a damaged GGUF file: {e}") from None
    except (struct.error, IndexError, ValueError, OverflowError, UnicodeDecodeError) as e:
        raise KvrunError(f"{path} is a damaged or truncated GGUF file ({e})") from None
    reader.mapping = mapping
    return reader


_U64 = struct.Struct("<Q")
_MAX_DIMS = 4  # GGML_MAX_DIMS: a tensor of the table has at most 4 dimensions
_MAX_NESTING = 8  # arrays of arrays: real files nest one level at most


class _Damaged(Exception):
    """A GGUF whose header or tensor table is inconsistent (the message says where)."""


class _Header:
    def __init__(self, data: np.ndarray):
        self.data, self.buf, self.pos, self.depth = data, memoryview(data), 4, 0

    def room(self, count: int, item_bytes: int, what: str) -> None:
        """A declared count of items of at least `item_bytes` each must fit in what is left of
        the file, checked before anything is allocated for them."""
        left = len(self.buf) - self.pos
        if count * item_bytes > left:
            raise _Damaged(
                f"{what} at byte {self.pos:,} runs past the end: it declares {count:,} items, "
                f"more than the {left:,} bytes left hold; download it again"
            )

    def take(self, code: str):
        size = struct.calcsize(code)
        if self.pos + size > len(self.buf):
            raise _Damaged(
                f"its header is cut short at byte {len(self.buf):,} (inside the metadata or "
                "tensor table); download it again"
            )
        (value,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise _Damaged(f"a string at byte {self.pos:,} runs past the end; download it again")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8")

    def strings(self, count: int) -> list[str]:
        """An array of `count` strings (a vocabulary: ~50k-150k of them, so one tight loop)."""
        self.room(count, 8, "a string array")  # each string takes its 8-byte length at least
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = _U64.unpack_from
        out = [""] * count
        for i in range(count):
            if pos + 8 > end:
                raise _Damaged(
                    f"a string array at byte {self.pos:,} runs past the end; download it again"
                )
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > end:
                raise _Damaged(f"a string at byte {pos:,} runs past the end; download it again")
            out[i] = str(buf[pos : pos + n], "utf-8")
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind == 9:
            item, count = self.take("I"), self.take("Q")
            if item == 8:
                return self.strings(count)
            if item == 9:  # arrays of arrays, each 12 bytes at least (type and count)
                if self.depth >= _MAX_NESTING:
                    raise _Damaged(f"arrays at byte {self.pos:,} are nested too deep")
                self.room(count, 12, "an array of arrays")
                self.depth += 1
                out = [self.value(item) for _ in range(count)]
                self.depth -= 1
                return out
            if item not in _SCALARS:
                raise _Damaged(f"an array at byte {self.pos:,} has unknown item type {item}")
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            self.room(count, dtype.itemsize, "an array")
            arr = np.frombuffer(self.buf, dtype, count, self.pos)
            self.pos += arr.nbytes
            return arr.tolist()
        if kind not in _SCALARS:
            raise _Damaged(f"unknown value type {kind} at byte {self.pos:,}")
        return self.take(_SCALARS[kind][0])

    def read(self) -> GGUFFile:
        import gguf

        version = self.take("I")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            why = "a big-endian GGUF (not supported)" if swapped in (2, 3) else f"version {version}"
            raise KvrunError(f"unsupported GGUF: {why}; kvrun reads little-endian GGUF v2 and v3")
        n_tensors, n_kv = self.take("Q"), self.take("Q")
        # each entry takes a key (8 bytes or more), a type (4) and a value (1 or more)
        self.room(n_kv, 13, "the metadata")
        meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors}
        meta["GGUF.kv_count"] = n_kv
        for _ in range(n_kv):
            at, key = self.pos, self.string()
            if key in meta:
                raise _Damaged(f"metadata key {_printable(key)!r} at byte {at:,} appears twice")
            meta[key] = self.value(self.take("I"))
        # each tensor: a name (8 bytes or more), a dimension count (4), a type (4), an offset (8)
        self.room(n_tensors, 24, "the tensor table")
        table, names = [], set()
        for _ in range(n_tensors):
            name = self.string()
            n_dims = self.take("I")
            if n_dims > _MAX_DIMS:
                raise _Damaged(
                    f"tensor {_printable(name)} has {n_dims:,} dimensions (GGUF allows 4)"
                )
            if name in names:
                raise _Damaged(f"tensor {_printable(name)} appears twice in the tensor table")
            names.add(name)
            dims = [self.take("Q") for _ in range(n_dims)]
            table.append((name, dims, self.take("I"), self.take("Q")))
        align = meta.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or align < 1 or align & align - 1:
            raise _Damaged(f"its general.alignment {align!r:.40} is not a power of two")
        start = -(-self.pos // align) * align
        tensors = [self.tensor(gguf, start, align, *row) for row in table]
        _check_overlaps(tensors)
        return GGUFFile(meta, tensors)

    def tensor(
        self, gguf, start: int, align: int, name: str, dims: list[int], raw: int, offset: int
    ):
        shown = _printable(name)  # a name is the file's: any text, newlines too
        try:
            kind = gguf.GGMLQuantizationType(raw)
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise _Damaged(f"tensor {shown} has an unknown type {raw}") from None
        if offset % align:
            raise _Damaged(f"tensor {shown}'s data offset {offset:,} is not a multiple of {align}")
        if dims and dims[0] % block:
            raise _Damaged(
                f"tensor {shown} has rows of {dims[0]:,} elements, not whole {kind.name} "
                f"blocks of {block}"
            )
        n_elems = math.prod(dims)  # Python ints: a huge dimension must not wrap around
        n_bytes = n_elems * type_size // block
        first, size = start + offset, len(self.data)
        if first >= size and n_bytes:
            raise _Damaged(
                f"tensor {shown}'s data starts at byte {first:,}, past the end of the "
                f"file ({size:,} bytes); download it again"
            )
        if first + n_bytes > size:
            raise _Damaged(
                f"tensor {shown} is cut short: {first + n_bytes - size:,} of its "
                f"{n_bytes:,} bytes are missing (the file has {size:,} bytes); download it again"
            )
        shape = tuple(reversed(dims))
        dtype = _ELEMENT_DTYPE.get(kind.name)
        if dtype is None:  # block-quantized (and BF16): rows of block bytes
            dtype, shape = np.uint8, gguf.quant_shape_to_byte_shape(shape, kind)
        data = self.data[first : first + n_bytes].view(dtype).reshape(shape)
        return GGUFTensor(name, kind, np.array(dims, dtype=np.uint64), first, data)


def _printable(text: str, n: int = 80) -> str:
    """A name read from a file, for a one-line message: cut short, anything but printable
    ASCII escaped."""
    return text[:n].encode("unicode_escape").decode("ascii")


def _check_overlaps(tensors: list[GGUFTensor]) -> None:
    """Two tensors of a table must not share bytes (a hostile file could alias them)."""
    spans = sorted((t.data_offset, t.data_offset + t.data.nbytes, t.name) for t in tensors)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise _Damaged(f"tensors {_printable(a)} and {_printable(b)} overlap at byte {start:,}")


def gguf_metadata(reader: GGUFFile) -> dict[str, Any]:
    """GGUF key/value metadata as plain Python values (with GGUF.version, .tensor_count and
    .kv_count, as gguf.GGUFReader names them)."""
    return reader.meta


def safetensors_damage(path: Path) -> str | None:
    """What is wrong with a safetensors file, in words (its layout: an 8-byte header length,
    a JSON header, then the data each tensor's data_offsets point into), or None."""
    try:
        raw_size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > raw_size - 8:
                return (
                    f"its header claims {n:,} bytes but the file has {raw_size:,}; "
                    "it is cut short or not a safetensors file"
                )
            header = json.loads(f.read(n))
    except OSError as e:
        return f"cannot read it ({e.strerror})"
    except ValueError as e:
        return f"its header is not valid JSON ({e})"
    data = raw_size - 8 - n
    cut = sorted(
        (tuple(info["data_offsets"][:2]), name)
        for name, info in header.items()
        if isinstance(info, dict)
        and len(info.get("data_offsets") or ()) == 2
        and info["data_offsets"][1] > data
    )
    if not cut:
        return None
    (start, end), name = cut[0]
    more = f"; {len(cut) - 1} more tensors lie past the end" if len(cut) > 1 else ""
    return (
        f"tensor {_printable(name)} is cut short: {end - max(start, data):,} of its "
        f"{end - start:,} bytes "
        f"are missing (the file has {raw_size:,} bytes){more}; download it again"
    )


def shard_paths(root: Path) -> list[Path]:
    """The safetensors files of an HF directory (from the index when sharded)."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise KvrunError(f"{index} is not a valid safetensors index ({e})") from None
        return [root / s for s in sorted(set(weight_map.values()))]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"{root} has config.json but no *.safetensors weights")
    return files
