"""Mutations of the files kvrun reads from strangers, for tests/test_fuzz_files.py (and the
regression cases in tests/test_damaged_files.py): a GGUF header's fields found and written
again, JSON documents with fields of the wrong type or removed, a SentencePiece protobuf
taken apart, hostile chat templates and damaged packed-cache entries. Every mutation draws
from the `random.Random` it is given, so a run is seeded."""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass

NAN, INF = float("nan"), float("inf")

# ---------------------------------------------------------------------------------- GGUF

# GGUF value type -> struct code (8 is a string, 9 an array)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}  # fmt: skip


@dataclass
class TensorRow:
    """One row of a GGUF tensor table."""

    name: str
    dims: list[int]
    type: int
    offset: int
    at: int  # where its n_dims field lies


@dataclass
class GGUFLayout:
    """Where each field of a GGUF header lies, and its parts to write it again."""

    version: int
    kvs: list[tuple[str, int, bytes]]  # (key, value type, raw value bytes)
    kv_types: list[int]  # offsets of the value-type fields
    strings: list[int]  # offsets of string lengths (keys, values, array items)
    arrays: list[int]  # offsets of array item types (the count follows)
    tensors: list[TensorRow]
    header_end: int
    data: bytes  # from the aligned data start


def walk_gguf(raw: bytes) -> GGUFLayout:
    """Read a well-formed GGUF's header layout (the seeds only)."""
    kv_types, strings, arrays = [], [], []

    def u(code, pos):
        return struct.unpack_from("<" + code, raw, pos)[0]

    def string(pos):
        strings.append(pos)
        n = u("Q", pos)
        return raw[pos + 8 : pos + 8 + n].decode(), pos + 8 + n

    def value(t, pos):
        if t == 8:
            return string(pos)[1]
        if t == 9:
            arrays.append(pos)
            item, count = u("I", pos), u("Q", pos + 4)
            pos += 12
            for _ in range(count):
                pos = value(item, pos)
            return pos
        return pos + struct.calcsize(_SCALAR[t])

    n_tensors, n_kv = u("Q", 8), u("Q", 16)
    pos, kvs, tensors = 24, [], []
    for _ in range(n_kv):
        key, pos = string(pos)
        kv_types.append(pos)
        t = u("I", pos)
        end = value(t, pos + 4)
        kvs.append((key, t, raw[pos + 4 : end]))
        pos = end
    for _ in range(n_tensors):
        name, pos = string(pos)
        at, n = pos, u("I", pos)
        dims = [u("Q", pos + 4 + 8 * i) for i in range(n)]
        pos += 4 + 8 * n
        tensors.append(TensorRow(name, dims, u("I", pos), u("Q", pos + 4), at))
        pos += 12
    start = -(-pos // 32) * 32
    return GGUFLayout(u("I", 4), kvs, kv_types, strings, arrays, tensors, pos, raw[start:])


def gguf_string(s: str) -> bytes:
    """A GGUF string: its 8-byte length, then its UTF-8 bytes."""
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _enc_value(t: int, v) -> bytes:
    if t == 8:
        return gguf_string(v)
    if t == 9:
        item, items = v
        return struct.pack("<IQ", item, len(items)) + b"".join(_enc_value(item, x) for x in items)
    return struct.pack("<" + _SCALAR[t], v)


def write_gguf(lay: GGUFLayout, align: int = 32) -> bytes:
    """A GGUF file from a layout's parts (its counts follow the lists; its data is padded
    to `align` after the header, as the seeds' are)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", lay.version, len(lay.tensors), len(lay.kvs)))
    for key, t, raw in lay.kvs:
        out += gguf_string(key) + struct.pack("<I", t) + raw
    for r in lay.tensors:
        out += gguf_string(r.name) + struct.pack("<I", len(r.dims))
        out += b"".join(struct.pack("<Q", d) for d in r.dims) + struct.pack("<IQ", r.type, r.offset)
    out += bytes(-len(out) % align)
    return bytes(out) + lay.data


def _typed(v) -> tuple[int, object]:
    """A Python value as a GGUF (type, value)."""
    if isinstance(v, bool):
        return 7, v
    if isinstance(v, str):
        return 8, v
    if isinstance(v, float):
        return 6, v
    if isinstance(v, list):
        typed = [_typed(x) for x in v]
        return 9, (typed[0][0] if typed else 4, [x[1] for x in typed])
    if isinstance(v, tuple):  # (type, value): an exact type
        return v
    return (5 if v >= -(2**31) else 11) if v < 0 else (4 if v < 2**32 else 10), v


_ODD_VALUES = [
    "", "x" * 40, "llama", "gpt2", 0, 1, 3, 2**31, 2**32 - 1, -1, -(2**40), 2**63, (10, 2**64 - 1),
    NAN, INF, -1.0, 0.0, 1e30, (12, 1e300), True, False, [], [0, 1], ["a", ""], [NAN], [[1], [2]],
]  # fmt: skip
_ADD_KEYS = {  # keys a seed lacks that change what kvrun builds
    "general.alignment": [0, 1, 3, 7, 64, 2**32 - 1, (10, 2**63), "x", [32]],
    "llama.rope.scaling.type": ["yarn", "linear", "bogus", 5],
    "llama.rope.scaling.factor": [0.0, -1.0, NAN, INF, 1e30, "x"],
    "llama.rope.scaling.original_context_length": [0, 1, 2**32 - 1, -5, "x"],
    "llama.attention.sliding_window": [0, 1, 2**32 - 1, -1, "x", 2.5],
    "llama.final_logit_softcapping": [0.0, NAN, -1.0, INF, "x"],
    "split.count": [0, 2, 2**32 - 1, "x"],
    "tokenizer.ggml.eot_token_id": [-1, 2**32 - 1, "x", 2.5, [1]],
    "tokenizer.ggml.add_eos_token": [True, "x", 5],
    "tokenizer.chat_template": [5, ["x"], "{% for %}", "{{ 'a' * 10**10 }}", "{{ x.__class__ }}"],
}
_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "gpt2", "", "bert"]
_TYPES = [0, 1, 2, 3, 6, 7, 8, 10, 12, 14, 24, 26, 28, 30, 31, 39, 41, 255, 2**32 - 1]


def gguf_mutation(raw: bytes, lay: GGUFLayout, rng: random.Random) -> tuple[str, bytes]:
    """One structured or random mutation of a seed GGUF: (what, bytes)."""
    size, buf = len(raw), bytearray(raw)

    def put(code, pos, v):
        struct.pack_into("<" + code, buf, pos, v)

    huge = [2**31, 2**32 - 1, 2**40, 2**62, 2**63, 2**64 - 1]
    kind = rng.choice(
        ["count", "version", "value_type", "string_len", "array", "n_dims", "dim", "type",
         "offset", "metadata", "add_key", "table", "truncate", "flip", "splice"]
    )  # fmt: skip
    if kind == "count":
        at = rng.choice([8, 16])
        n = struct.unpack_from("<Q", raw, at)[0]
        put("Q", at, rng.choice([0, n - 1, n + 1, *huge]))
    elif kind == "version":
        put("I", 4, rng.choice([0, 1, 4, 2**24 * 3, 2**32 - 1]))
    elif kind == "value_type":
        put("I", rng.choice(lay.kv_types), rng.choice([9, 8, 4, 10, 13, 255, 2**32 - 1]))
    elif kind == "string_len":
        at = rng.choice(lay.strings)
        n = struct.unpack_from("<Q", raw, at)[0]
        put("Q", at, rng.choice([0, n + 1, n - 1 if n else 1, size - at, size, *huge]))
    elif kind == "array":
        at = rng.choice(lay.arrays)
        if rng.random() < 0.5:
            put("I", at, rng.choice([9, 8, 0, 12, 13, 2**32 - 1]))
        else:
            n = struct.unpack_from("<Q", raw, at + 4)[0]
            put("Q", at + 4, rng.choice([0, n + 1, max(n - 1, 0), size, *huge]))
    elif kind == "n_dims":
        put("I", rng.choice(lay.tensors).at, rng.choice([0, 3, 5, 64, 2**32 - 1]))
    elif kind == "dim":
        r = rng.choice(lay.tensors)
        i = rng.randrange(len(r.dims))
        d = r.dims[i]
        put("Q", r.at + 4 + 8 * i, rng.choice([0, 1, d + 1, d - 1, 2 * d, d // 2, *huge]))
    elif kind == "type":
        r = rng.choice(lay.tensors)
        put("I", r.at + 4 + 8 * len(r.dims), rng.choice(_TYPES))
    elif kind == "offset":
        r, other = rng.choice(lay.tensors), rng.choice(lay.tensors)
        data = len(lay.data)
        to = [other.offset, other.offset + 32, r.offset + 1, r.offset + 4, data, data + 32,
              max(data - 32, 0), *huge]  # fmt: skip
        put("Q", r.at + 12 + 8 * len(r.dims), rng.choice(to))
    elif kind in ("metadata", "add_key", "table"):
        kvs = list(lay.kvs)
        rows = [TensorRow(r.name, list(r.dims), r.type, r.offset, r.at) for r in lay.tensors]
        if kind == "metadata":
            i = rng.randrange(len(kvs))
            key = kvs[i][0]
            how = rng.random()
            if how < 0.15:
                del kvs[i]
                kind = f"metadata: drop {key}"
            elif how < 0.2:
                kvs.insert(i, kvs[i])
                kind = f"metadata: twice {key}"
            else:
                v = rng.choice(_ARCHS if key == "general.architecture" else _ODD_VALUES)
                t, v = _typed(v)
                kvs[i] = (key, t, _enc_value(t, v))
                kind = f"metadata: {key} = {v!r:.40}"
        elif kind == "add_key":
            key = rng.choice(sorted(_ADD_KEYS))
            t, v = _typed(rng.choice(_ADD_KEYS[key]))
            kvs = [kv for kv in kvs if kv[0] != key] + [(key, t, _enc_value(t, v))]
            kind = f"add_key: {key} = {v!r:.40}"
        else:
            r = rng.choice(rows)
            how = rng.choice(["drop", "twice", "rename", "transpose", "extra_dim", "swap"])
            if how == "drop":
                rows.remove(r)
            elif how == "twice":
                rows.append(TensorRow(r.name, r.dims, r.type, rng.choice(rows).offset, 0))
            elif how == "rename":
                r.name = rng.choice(["", "blk.0.bogus.weight", "blk.99.attn_q.weight",
                                     "blk.4294967295.attn_q.weight", "output.weight",
                                     "rope_freqs.weight", "x" * 300, rng.choice(rows).name])  # fmt: skip
            elif how == "transpose":
                r.dims = r.dims[::-1]
            elif how == "extra_dim":
                r.dims = rng.choice([[*r.dims, 1], [1, *r.dims], [*r.dims, 2]])
            else:
                o = rng.choice(rows)
                r.dims, o.dims = o.dims, r.dims
            kind = f"table: {how} {r.name[:40]}"
        lay2 = GGUFLayout(lay.version, kvs, [], [], [], rows, 0, lay.data)
        return kind, write_gguf(lay2)
    elif kind == "truncate":
        end = lay.header_end + 64 if rng.random() < 0.6 else size
        return kind, raw[: rng.randrange(0, end)]
    elif kind == "flip":
        end = lay.header_end if rng.random() < 0.8 else size
        for _ in range(rng.randint(1, 16)):
            buf[rng.randrange(4, end)] ^= rng.randint(1, 255)
    else:  # splice: bytes inserted into or cut from the header
        at = rng.randrange(4, lay.header_end)
        n = rng.randint(1, 16)
        if rng.random() < 0.5:
            return kind, raw[:at] + rng.randbytes(n) + raw[at:]
        return kind, raw[:at] + raw[at + n :]
    return kind, bytes(buf)


# ------------------------------------------------------------------------- HF JSON files

_ODD_JSON = [None, "x", "", [], {}, [1], [None], -1, 0, 1, 1.5, -0.5, 10**12, 2**64, 10**400,
             True, False, "NaN", {"a": 1}, "llama"]  # fmt: skip
CONFIG_ADD = {
    "sliding_window": [0, -1, 4, "x", 10**12],
    "partial_rotary_factor": [0.0, -1.0, 0.3, 2.0, "x"],
    "rope_scaling": [
        {"rope_type": "llama3"}, {"rope_type": 5}, {"rope_type": "yarn", "factor": "x"},
        {"rope_type": "longrope", "short_factor": "abc", "long_factor": [1.0],
         "original_max_position_embeddings": 0},
        {"rope_type": "linear", "factor": 0}, {"type": "dynamic", "factor": 2.0}, "linear", [1],
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
    ],
    "layer_types": ["x", [1, 2], ["sliding_attention"] * 100],
    "final_logit_softcapping": [0, -1.0, "x", 1e30],
    "use_sliding_window": [True, "x"],
    "attention_bias": [True, "x"],
    "original_max_position_embeddings": [0, -1, "x"],
    "text_config": [None, "x", {"hidden_size": 64}],
    "head_dim": [0, 1, 3, 15, 17, 32, -16, "x", 10**9],
    "model_type": ["gemma3", "gemma3_text", "qwen2", "qwen3", "phi3", "mistral", "bert", 5],
    "rope_parameters": [{"rope_type": "llama3"}, {"full_attention": "x"}, "x", {"rope_theta": "x"}],
}  # fmt: skip


def json_mutation(
    obj, rng: random.Random, extra: dict[str, list] | None = None
) -> tuple[str, object]:
    """One mutation of a parsed JSON document: a field of the wrong type or removed (at any
    depth), a field added, or the whole document of another type."""
    obj = json.loads(json.dumps(obj))
    if extra and rng.random() < 0.3:
        key = rng.choice(sorted(extra))
        obj[key] = rng.choice(extra[key])
        return f"{key} = {json.dumps(obj[key])[:40]}", obj
    if rng.random() < 0.03:
        return "not an object", rng.choice([[], 1, "x", None, [obj]])
    # a random path into the document
    node, path = obj, []
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        k = rng.choice(keys)
        path.append(k)
        child = node[k]
        if not isinstance(child, (dict, list)) or not child or rng.random() < 0.4:
            break
        node = child
    if not path:
        return "empty", obj
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    k = path[-1]
    where = ".".join(str(p) for p in path)[:60]
    if rng.random() < 0.25:
        del parent[k]
        return f"drop {where}", obj
    value = rng.choice(_ODD_JSON)
    if isinstance(parent[k], int) and not isinstance(parent[k], bool) and rng.random() < 0.5:
        value = rng.choice([-parent[k], parent[k] + 1, parent[k] * 1000, 2**31, 2**63, 0])
    parent[k] = value
    return f"{where} = {json.dumps(value)[:40]}", obj


def text_mutation(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
    """A file cut at a random point, or a few of its bytes overwritten."""
    if rng.random() < 0.5:
        return "truncate", raw[: rng.randrange(len(raw))]
    buf = bytearray(raw)
    for _ in range(rng.randint(1, 8)):
        buf[rng.randrange(len(buf))] = rng.randrange(256)
    return "flip", bytes(buf)


TOKENIZER_ADD = {
    "padding": [{"strategy": {"Fixed": 10**9}, "pad_id": 0, "pad_token": "x", "pad_type_id": 0,
                 "direction": "Right", "pad_to_multiple_of": None}, {"strategy": "x"}],
    "truncation": [{"max_length": 0, "strategy": "LongestFirst", "stride": 0,
                    "direction": "Right"}, {"max_length": -1}],
    "normalizer": [{"type": "Precompiled", "precompiled_charsmap": "AAAA"},
                   {"type": "Replace", "pattern": {"Regex": "("}, "content": "x"}, {"type": 5}],
    "pre_tokenizer": [{"type": "Split", "pattern": {"Regex": "(" * 50}, "behavior": "Isolated",
                       "invert": False}, {"type": "Bogus"}],
    "added_tokens": [[{"id": 2**40, "content": "x", "special": True}],
                     [{"id": -1, "content": "y"}], [{"id": 5, "content": ""}],
                     [{"id": 10**6, "content": "zz", "special": False, "single_word": False,
                       "lstrip": False, "rstrip": False, "normalized": True}]],
    "post_processor": [{"type": "TemplateProcessing", "single": [{"SpecialToken": {
        "id": "<bogus>", "type_id": 0}}], "pair": [], "special_tokens": {}}],
    "decoder": [{"type": "Bogus"}, None],
}  # fmt: skip


TOKCONFIG_ADD = {
    "bos_token": [5, ["<s>"], {"content": 5}, {"x": 1}, None, "<|im_start|>"],
    "eos_token": [5, ["</s>"], {"content": None}, "nope"],
    "add_bos_token": ["false", 5, None],
    "add_eos_token": [True, "x"],
    "chat_template": [5, ["x"], [{"name": 5}], [{"name": "default", "template": 5}],
                      [{"template": "x"}], {"default": "x"}, "", [], "{% for %}"],
}  # fmt: skip
GENERATION_CONFIGS = [
    {"eos_token_id": v}
    for v in ["x", ["x"], [[1]], {"a": 1}, 2**40, -1, 1.5, None, [2, 10**9], True]
]


# ---------------------------------------------------------------------- tokenizer.model


def _pb_read(buf: bytes) -> list[tuple[int, int, object]]:
    """(field, wire type, value) of one protobuf message (the seed's: well formed)."""
    out, i = [], 0

    def varint(i):
        v = s = 0
        while True:
            b = buf[i]
            v |= (b & 0x7F) << s
            s, i = s + 7, i + 1
            if b < 0x80:
                return v, i

    while i < len(buf):
        key, i = varint(i)
        f, w = key >> 3, key & 7
        if w == 0:
            v, i = varint(i)
        elif w == 2:
            n, i = varint(i)
            v, i = buf[i : i + n], i + n
        elif w == 5:
            v, i = buf[i : i + 4], i + 4
        else:
            v, i = buf[i : i + 8], i + 8
        out.append((f, w, v))
    return out


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _pb_write(fields: list[tuple[int, int, object]]) -> bytes:
    out = bytearray()
    for f, w, v in fields:
        out += _varint(f << 3 | w)
        if w == 0:
            out += _varint(v)
        elif w == 2:
            out += _varint(len(v)) + v
        else:
            out += v
    return bytes(out)


def spm_mutation(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
    """A SentencePiece ModelProto, damaged: pieces (text, score, type), the trainer's ids and
    model type, the normalizer's charsmap, lengths out of range; cuts and flips."""
    top = _pb_read(raw)
    how = rng.choice(["piece", "piece", "drop_pieces", "trainer", "normalizer", "length",
                      "truncate", "flip"])  # fmt: skip
    if how in ("truncate", "flip"):
        return text_mutation(raw, rng)
    if how == "length":  # a length prefix that runs past the end
        buf = bytearray(raw)
        i = rng.randrange(len(buf) - 1)
        return how, bytes(buf[:i]) + _varint(rng.choice([2**31, 2**63, len(buf)])) + raw[i:]
    pieces = [i for i, (f, _, _) in enumerate(top) if f == 1]
    if how == "drop_pieces":
        keep = set(rng.sample(pieces, rng.choice([0, 1, 3, len(pieces) // 2])))
        top = [x for i, x in enumerate(top) if i not in pieces or i in keep]
    elif how == "piece":
        i = rng.choice(pieces)
        sub = _pb_read(top[i][2])
        f = rng.choice([1, 2, 3])
        sub = [x for x in sub if x[0] != f]
        if f == 1:
            text = rng.choice(["", "<s>", "▁", "a" * 1000, "\x00", "<0xZZ>"]).encode()
            sub.append((1, 2, text))
        elif f == 2:
            sub.append((2, 5, struct.pack("<f", rng.choice([NAN, INF, -INF, 1e30]))))
        else:
            sub.append((3, 0, rng.choice([0, 4, 5, 6, 7, 99, 2**31, 2**64 - 1])))
        top[i] = (1, 2, _pb_write(sub))
        how = f"piece {i} field {f}"
    else:
        field_no = 2 if how == "trainer" else 3
        at = next((i for i, x in enumerate(top) if x[0] == field_no), None)
        sub = _pb_read(top[at][2]) if at is not None else []
        if how == "trainer":  # model_type 3, vocab_size 4, byte_fallback 35, unk/bos/eos/pad 40-43
            f = rng.choice([3, 4, 35, 40, 41, 42, 43])
            v = rng.choice([0, 1, 2, 5, 99, 2**31, 2**64 - 1])
        else:  # precompiled_charsmap 2, add_dummy_prefix 3, remove_extra_whitespaces 4
            f = rng.choice([2, 2, 3, 4])
            v = rng.choice([rng.randbytes(rng.choice([1, 4, 64, 1000])), b"\xff" * 8, b""])
            v = v if f == 2 else rng.choice([0, 1, 2**63])
        sub = [x for x in sub if x[0] != f] + [(f, 2 if isinstance(v, bytes) else 0, v)]
        new = (field_no, 2, _pb_write(sub))
        top = [*top[:at], new, *top[at + 1 :]] if at is not None else [*top, new]
        how = f"{how} field {f} = {v!r:.30}"
    return how, _pb_write(top)


# ------------------------------------------------------------------------- chat templates

# Each tries to leave the sandbox, to run a command that leaves a file behind (the case's
# folder is watched), or to take unbounded memory or time.
HOSTILE_TEMPLATES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch {pwned}').read() }}",
    "{{ joiner.__init__.__globals__.os.system('touch {pwned}') }}",
    "{{ namespace.__init__.__globals__['os'].system('touch {pwned}') }}",
    "{{ self._TemplateReference__context.environment }}",
    "{{ self._TemplateReference__context.parent }}",
    "{{ self.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{{ strftime_now.__globals__['datetime'] }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ ''.format.__globals__ }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ ''|attr('__class__') }}",
    "{{ messages|map(attribute='__class__')|list }}",
    "{{ lipsum.__globals__['os'].system('touch {pwned}') }}",
    "{{ range.__self__ }}",
    "{% set x = messages.append({'role': 'x'}) %}",
    "{% set x = messages[0].update({'role': 'x'}) %}",
    "{% include '/etc/passwd' %}",
    "{% import 'os' as os %}",
    "{% extends '/etc/passwd' %}",
    "{{ 'a' * 10**10 }}",
    "{{ [0] * 10**9 }}",
    "{{ 'a' * 1000000 * 1000000 }}",
    "{{ 2 ** 100000000 }}",
    "{% set ns = namespace(x=10) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
    "{% endfor %}",
    "{% set ns = namespace(x=10) %}{% for i in range(8) %}{% set ns.x = ns.x ** 4096 %}"
    "{% endfor %}",
    "{{ '{:>5.100000000000f}'.format(1.0) }}",
    "{% for i in range(10**9) %}{% endfor %}",
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{% set s = 'x' * 99999 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "{% set x = 'a' * 1000000 %}{{ ([x] * 1000000)|join }}",
    "{% set x = 'a' * 1000000 %}{{ [x] * 1000000 }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}",
    "{% set ns = namespace(s=['a']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}",
    "{{ 'a'|center(10**10) }}",
    "{{ 'a'.center(10**10) }}",
    "{{ 'a'.ljust(10**10) }}",
    "{{ 'a'.zfill(10**10) }}",
    "{{ 'a\tb'.expandtabs(10**10) }}",
    "{{ '{:>10000000000}'.format('a') }}",
    "{{ '{:>{w}}'.format('a', w=10**10) }}",
    "{{ '%10000000000d' % 1 }}",
    "{{ '%*d' % (10**10, 1) }}",
    "{{ '%10000000000d'|format(1) }}",
    "{{ 'x\ny'|indent(10**10, true) }}",
    "{{ ('a' * 1000000)|replace('', 'b' * 1000000) }}",
    "{{ ('a' * 1000000).replace('', 'b' * 1000000) }}",
    "{{ ('a' * 1000000)|wordwrap(1, true, 'b' * 1000000) }}",
    "{{ messages|tojson(indent=10**9) }}",
    "{{ lipsum(10**6) }}",
    "{{ range(10)|batch(10**9, 'x')|list }}",
    "{{ range(10)|slice(10**9, 'x')|list }}",
    "{{ ('a' * 1000000)|join('b' * 1000000) }}",
    "{{ ['a' * 1000000] * 1000000|sum(start='') }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    "{% set a = ['a' * 1000000] * 8 %}{% set b = [a, a, a, a, a, a, a, a] %}"
    "{% set c = [b, b, b, b, b, b, b, b] %}{{ [c, c, c, c, c, c, c, c] }}",
    "{% set a = ['a' * 100000] * 8 %}{% set b = [a, a, a, a, a, a, a, a] %}"
    "{% set c = [b, b, b, b, b, b, b, b] %}{{ c|string|length }}{{ c|tojson|length }}",
    "{% set d = {} %}{{ d.fromkeys(range(99999), 'a' * 1000000) }}",
    "{{ ''.maketrans({'a': 'b' * 1000000}) }}",
    "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
]
# pieces random templates are made of
_SNIPPETS = [
    "{% for m in messages %}", "{% endfor %}", "{{ m['content'] }}", "{{ m.role }}",
    "{% if add_generation_prompt %}", "{% endif %}", "{% else %}", "{{ bos_token }}",
    "{{ eos_token }}", "{{ raise_exception('no') }}", "{{ messages|length }}", "{{ loop.index }}",
    "{% set ns = namespace(x=0) %}", "{% set ns.x = ns.x + 1 %}", "{{ ns.x }}",
    "{{ messages[0]['content']|trim }}", "{{ messages|tojson }}", "{{ undefined_thing }}",
    "{{ messages[99] }}", "{{ 1 / 0 }}", "{{ 'a' ~ 1 }}", "{{ range(3)|list }}", "{{ x.y.z }}",
    "{%", "}}", "{{", "%}", "{# c #}", "{% raw %}", "{% endraw %}", "{% break %}",
    "{% generation %}", "{% endgeneration %}", "{{ strftime_now('%Y') }}", "{{ 'x' * 1000 }}",
    "{{ messages|selectattr('role', 'equalto', 'user')|list }}", "{{ '%s' % 5 }}",
    "{{ [1, 2] + [3] }}", "{{ {'a': 1}.items()|list }}", "{{ 'x'|center(30) }}",
]  # fmt: skip


def template_case(i: int, rng: random.Random) -> tuple[str, str]:
    """(what, template) of case i: every other case the next hostile template, until all have
    come; the others one of them before the tiny models' own, or random pieces in and
    around it."""
    from tiny_models import CHAT_TEMPLATE

    if i % 2 == 0 and i // 2 < len(HOSTILE_TEMPLATES):
        return f"hostile {i // 2}", HOSTILE_TEMPLATES[i // 2]
    if rng.random() < 0.3:
        return "hostile+", rng.choice(HOSTILE_TEMPLATES) + CHAT_TEMPLATE
    parts = [CHAT_TEMPLATE] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 6)):
        parts.insert(rng.randint(0, len(parts)), rng.choice(_SNIPPETS))
    return "random", "".join(parts)


# -------------------------------------------------------------------- packed-model cache


def cache_mutation(raw: bytes, rng: random.Random) -> tuple[str, bytes, bool]:
    """(what, bytes, strict) of a damaged cache entry; strict: its header changed but not its
    digest, so it must not be used as it is. Half the header edits are signed again (a
    hostile entry): those must give no traceback, and may load (the data is not hashed)."""
    from kvrun.models.model_cache import _digest

    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    how = rng.random()
    if how < 0.1:
        return "truncate", raw[: rng.randrange(len(raw))], False
    if how < 0.2:
        buf = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(8 + n, len(buf))] ^= rng.randint(1, 255)
        return "flip data", bytes(buf), False
    if how < 0.3:
        buf = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(0, 8 + n)] = rng.randrange(256)
        return "flip header", bytes(buf), True
    if how < 0.35:
        v = rng.choice([0, 7, n - 1, n + 1, len(raw), 2**63, 2**64 - 1])
        return f"header length {v}", v.to_bytes(8, "little") + raw[8:], True
    meta = json.loads(header["__metadata__"]["kvrun"])
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if how < 0.45:
        what, meta = json_mutation(meta, rng, {"format": [1, 2, "3", None]})
    elif how < 0.7:  # the layout: packed layers' facts, the slots stacking empties
        what, meta["layout"] = json_mutation(meta["layout"], rng, _LAYOUT_ADD)
    else:  # a tensor's dtype, shape or offsets
        what, tensors = json_mutation(tensors, rng)
    header = {"__metadata__": {"kvrun": json.dumps(meta)}}
    header = {**header, **tensors} if isinstance(tensors, dict) else tensors
    strict = rng.random() < 0.5 or not isinstance(header, dict)
    if not strict:
        header["__metadata__"]["digest"] = _digest(header)
        what = f"signed: {what}"
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 64)
    return what, len(text).to_bytes(8, "little") + text + data, strict


_LAYOUT_ADD = {
    "empty": [["model.layers"], ["model"], ["model.embed_tokens"], ["lm_head"],
              ["model.layers.0.self_attn.forward"], ["model.__class__"], [""], "x", [5], []],
    "packed": ["x", {}, {"model.layers.0.mlp.down_proj": {"kind": "os.system"}},
               {"model.norm": {"kind": "linear"}}, {"__class__": {}}],
}  # fmt: skip
