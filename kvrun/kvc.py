"""Compressed KV caches on disk (`.kvc`): a document compressed once, asked again tomorrow.

A .kvc file is a safetensors file: every tensor the cache holds (the used part of each
buffer, never its spare room), the token ids as int32, and one JSON header in the file's
metadata with

- the format and its version;
- the model's identity: its file's name, size and a fingerprint of its first and last MiB,
  its shapes, and the KV dtype. The packed-model cache keys on the file's path, inode and
  time instead; a .kvc is meant to travel with its model, so it keys on content;
- the KV spec (`--kv` and `--kv-budget` as given, and the options they resolve to);
- the cache's own state: the manager's fields, walked as an object graph. Tensors are
  named in the header and stored beside it; numbers, strings, lists, dicts and the like are
  JSON; objects are kvrun's own KV classes only (a fixed list of modules), rebuilt without
  running code from the file; what a run supplies (the model's config and RoPE, the native
  kernels) is named, never stored. No pickle.

`load` checks every part of the header against the model and spec it is given and says in
one line what does not match; a damaged or cut file is one line too.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import os
import zlib
from fractions import Fraction
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from .errors import KvrunError

FORMAT, VERSION = "kvrun-kvc", 1
_ALLOWED = ("kvrun.kv.", "kvrun.kv")  # the modules whose classes a file may name
_META_KEY, _STATE_KEY = "kvrun_kvc", "kvrun_kvc_state"


class Damaged(KvrunError):
    """A .kvc file that cannot be read as one (cut, overwritten, not a .kvc)."""


# ------------------------------------------------------------------------- identity
def _fingerprint(path: Path) -> str:
    """sha256 of a file's size, first and last MiB: cheap on an 8B model, and it changes with
    any re-quantization or conversion (the header and the last tensors differ)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:32]


def model_identity(rt) -> dict:
    """What a cache depends on in the model: its file(s), shapes and the KV dtype."""
    path = Path(rt.path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    c = rt.config
    return {
        "name": path.name,
        "files": [[f.name, f.stat().st_size, _fingerprint(f)] for f in files],
        "arch": c.arch,
        "shape": [c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size],
        "dtype": str(rt.model.dtype).removeprefix("torch."),
    }


def spec_text(spec) -> dict:
    """The spec as --kv text with every option, its --kv-budget, and what they resolve to
    (compared on load)."""

    def part(m) -> str:
        opts = ",".join(f"{k}={v}" for k, v in m.values().items())
        return f"{m.name}:{opts}" if opts else m.name

    parts = [] if spec.keeps_all and spec.store else [part(spec.select)]
    text = "+".join(parts + ([part(spec.store)] if spec.store else []))
    budget = spec.budget.text if spec.budget is not None else None
    return {"kv": text, "name": spec.name, "budget": budget, "describe": spec.describe()}


# -------------------------------------------------------------------------- encoding
class _Writer:
    def __init__(self, context: dict[int, str], root: Any):
        self.context = context  # id(obj) -> name, for what a run supplies
        self.tensors: dict[str, torch.Tensor] = {}
        self.ids: dict[int, str] = {}  # one tensor object stored once
        self.objs: dict[int, int] = {id(root): 0}  # objects met, by number (cycles, sharing)
        self.alive: list = []  # everything whose id is a key above

    def tensor(self, t: torch.Tensor) -> dict:
        key = self.ids.get(id(t))
        if key is None:
            key = self.ids[id(t)] = f"t{len(self.tensors)}"
            self.tensors[key] = t.detach().to("cpu").contiguous().clone()
            self.alive.append(t)  # a view made for the write keeps its id to the end
        return {"$t": key}

    def enc(self, v: Any) -> Any:
        if id(v) in self.context:
            return {"$ctx": self.context[id(v)]}
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            return {"$f": repr(v)}  # inf and nan survive; JSON's floats would not
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if isinstance(v, list):
            return [self.enc(x) for x in v]
        if isinstance(v, tuple):
            return {"$tuple": [self.enc(x) for x in v]}
        if isinstance(v, (set, frozenset)):
            return {"$set": [self.enc(x) for x in v], "frozen": isinstance(v, frozenset)}
        if isinstance(v, (dict, MappingProxyType)):
            items = [[self.enc(k), self.enc(x)] for k, x in v.items()]
            return {"$dict": items, "proxy": isinstance(v, MappingProxyType)}
        if isinstance(v, Fraction):
            return {"$frac": [v.numerator, v.denominator]}
        if isinstance(v, torch.dtype):
            return {"$dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"$device": "cpu"}  # a cache is loaded where the run's model is
        if _is_function(v):
            return {"$fn": _where(v)}
        return self.obj(v)

    def obj(self, v: Any) -> dict:
        from .kv.stores.buffer import Buffer

        if id(v) in self.objs:
            return {"$ref": self.objs[id(v)]}
        cls = type(v)
        if cls is Buffer:  # the occupied slots only, never the spare room
            return {"$buffer": self.tensor(v.data), "dim": v.dim}
        where = _where(cls)
        n = self.objs[id(v)] = len(self.objs)
        self.alive.append(v)
        state = {k: self.enc(x) for k, x in _fields(v).items()}
        return {"$obj": where, "n": n, "state": state}


def _is_function(v) -> bool:
    return type(v).__name__ in ("function", "builtin_function_or_method")


def _where(x) -> str:
    mod, name = getattr(x, "__module__", "") or "", getattr(x, "__qualname__", "")
    if not mod.startswith(_ALLOWED) or "<" in name:
        raise KvrunError(f"the cache holds a {type(x).__name__} that a .kvc file cannot keep")
    return f"{mod}:{name}"


def _fields(v: Any) -> dict:
    """An object's attributes: its __dict__ and every __slots__ entry set on it."""
    out = dict(getattr(v, "__dict__", {}))
    for klass in type(v).__mro__:
        for s in getattr(klass, "__slots__", ()):
            if s not in ("__dict__", "__weakref__") and hasattr(v, s):
                out[s] = getattr(v, s)
    return out


class _Reader:
    def __init__(self, tensors: dict[str, torch.Tensor], context: dict[str, Any], device, root):
        self.tensors, self.context, self.device = tensors, context, device
        self.made: dict[str, torch.Tensor] = {}
        self.objs: dict[int, Any] = {0: root}

    def tensor(self, ref: dict) -> torch.Tensor:
        key = ref["$t"]
        if key not in self.made:
            if key not in self.tensors:
                raise Damaged(f"tensor {key} is named in the header but not in the file")
            self.made[key] = self.tensors[key].to(self.device)
        return self.made[key]

    def dec(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, list):
            return [self.dec(x) for x in v]
        if not isinstance(v, dict) or len(v) == 0:
            raise Damaged(f"unexpected value {v!r} in the header")
        tag = next(iter(v))
        if tag == "$ctx":
            if v["$ctx"] in ("hook", "kernels"):  # a debug hook, native kernels: the run's, or none
                return self.context.get(v["$ctx"])
            if v["$ctx"] not in self.context:
                raise Damaged(f"the header names {v['$ctx']!r}, which a run does not supply")
            return self.context[v["$ctx"]]
        if tag == "$t":
            return self.tensor(v)
        if tag == "$f":
            return float(v["$f"])
        if tag == "$tuple":
            return tuple(self.dec(x) for x in v["$tuple"])
        if tag == "$set":
            items = [self.dec(x) for x in v["$set"]]
            return frozenset(items) if v.get("frozen") else set(items)
        if tag == "$dict":
            d = {_hashable(self.dec(k)): self.dec(x) for k, x in v["$dict"]}
            return MappingProxyType(d) if v.get("proxy") else d
        if tag == "$frac":
            return Fraction(*v["$frac"])
        if tag == "$dtype":
            return getattr(torch, v["$dtype"])
        if tag == "$device":
            return torch.device(self.device)
        if tag == "$fn":
            return _resolve(v["$fn"])
        if tag == "$buffer":
            from .kv.stores.buffer import Buffer

            b = Buffer.__new__(Buffer)
            b.buf, b.dim = self.tensor(v["$buffer"]), int(v["dim"])
            b.n = b.buf.shape[b.dim]
            return b
        if tag == "$ref":
            if v["$ref"] not in self.objs:
                raise Damaged(f"the header refers to object {v['$ref']} before it is made")
            return self.objs[v["$ref"]]
        if tag == "$obj":
            cls = _resolve(v["$obj"])
            if not isinstance(cls, type):
                raise Damaged(f"{v['$obj']} is not a class")
            obj = self.objs[int(v["n"])] = cls.__new__(cls)
            for k, x in v["state"].items():
                object.__setattr__(obj, k, self.dec(x))
            return obj
        raise Damaged(f"unknown tag {tag!r} in the header")


def _hashable(k):
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def _resolve(where: str):
    mod, _, name = where.partition(":")
    if not mod.startswith(_ALLOWED):
        raise Damaged(f"the header names {where}, outside kvrun's KV classes")
    try:
        obj: Any = importlib.import_module(mod)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise Damaged(f"the header names {where}, which this kvrun does not have") from None
    return obj


def _context(kv) -> dict[str, Any]:
    """What a run supplies, by name: never stored, always the loading run's own."""
    ctx: dict[str, Any] = {"config": kv.config, "rope": kv.rope, "hook": kv.on_select}
    ctx["kernels"] = getattr(kv.rope, "kernels", None)
    for i, r in enumerate(getattr(kv.rope, "ropes", ())):  # Gemma 3's two
        ctx[f"rope{i}"] = r
    return {k: v for k, v in ctx.items() if v is not None}


# ------------------------------------------------------------------------ save, load
def save(path: str | Path, kv, tokens: list[int], rt, turns: dict | None = None) -> Path:
    """Write kv (after a prefill: a document's turn, compressed) and the tokens it holds;
    `turns`: how a question continues them (`document_turn`)."""
    from safetensors.torch import save_file

    if kv.in_prefill:
        raise KvrunError("a cache is saved between turns, not inside a prefill")
    if kv.seen != len(tokens):
        raise KvrunError(f"the cache has seen {kv.seen} tokens, the session {len(tokens)}")
    path = Path(path)
    ctx = _context(kv)
    w = _Writer({id(v): k for k, v in ctx.items()}, kv)
    state = {k: w.enc(v) for k, v in _fields(kv).items()}
    header = {
        "format": FORMAT,
        "version": VERSION,
        "model": model_identity(rt),
        "spec": spec_text(kv.spec),
        "class": _where(type(kv)),
        "tokens": len(tokens),
        "turns": turns or {"chat": False},
        "kv_bytes": kv.nbytes(),
    }
    tensors = dict(w.tensors)
    tensors["tokens"] = torch.tensor(tokens, dtype=torch.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    try:
        # the state's JSON repeats its keys and class names layer after layer: zlib makes it
        # ~10x smaller, so a deep model's header stays small
        packed = base64.b64encode(zlib.compress(json.dumps(state).encode(), 9)).decode()
        meta = {_META_KEY: json.dumps(header), _STATE_KEY: packed}
        save_file(tensors, str(part), metadata=meta)
        umask = os.umask(0)
        os.umask(umask)
        part.chmod(0o666 & ~umask)  # safetensors writes 0600; a .kvc is a file like others
        os.replace(part, path)  # never a half-written .kvc under the real name
    finally:
        part.unlink(missing_ok=True)
    return path


def read_header(path: str | Path) -> dict:
    """The JSON header of a .kvc file (Damaged, in one line, when it is not one)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise KvrunError(f"no such .kvc file: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise Damaged(f"{path} is not a readable .kvc file ({str(e).splitlines()[0]})") from None
    if _META_KEY not in meta:
        raise Damaged(f"{path} is a safetensors file but not a kvrun .kvc file")
    try:
        header = json.loads(meta[_META_KEY])
    except ValueError:
        raise Damaged(f"{path} has a damaged header") from None
    if header.get("format") != FORMAT:
        raise Damaged(f"{path} is not a kvrun .kvc file")
    if header.get("version") != VERSION:
        raise KvrunError(
            f"{path} is .kvc format version {header.get('version')}; this kvrun reads "
            f"version {VERSION}: prefill the document again (kvrun prefill)"
        )
    try:
        header["state"] = json.loads(zlib.decompress(base64.b64decode(meta[_STATE_KEY])))
    except (ValueError, KeyError, zlib.error):
        raise Damaged(f"{path} has a damaged header (its cache's state)") from None
    return header


def check_model(header: dict, rt, path: Path) -> None:
    want, have = header["model"], model_identity(rt)
    if want != have:
        diff = next(k for k in want if want.get(k) != have.get(k))
        raise KvrunError(
            f"{path} was written for model {want['name']} ({diff} differs from "
            f"{have['name']}'s); load it with that model, or prefill the document again"
        )


def load(path: str | Path, rt, spec=None):
    """(kv, tokens, header) from a .kvc file for runtime rt. spec: the run's KV spec (None: the
    file's); a spec, model or format that does not match is one line (KvrunError)."""
    from safetensors import safe_open

    from .kv import check

    path = Path(path)
    header = read_header(path)
    check_model(header, rt, path)
    saved = header["spec"]
    if spec is None:
        spec = check(saved["kv"], saved["budget"])
    elif (given := spec_text(spec))["describe"] != saved["describe"]:
        what = (
            f"a --kv {saved['name']} cache, not --kv {given['name']}"
            if saved["name"] != given["name"]
            else f"--kv {saved['kv']}, whose options differ from {given['kv']}"
        )
        if saved["name"] == given["name"] and saved["kv"] == given["kv"]:
            what = f"--kv-budget {saved['budget']}, not {given['budget']}"
        raise KvrunError(
            f"{path} holds {what}; drop --kv to use the file's, or prefill the document "
            "again with this one"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a mapping
    except Exception as e:  # noqa: BLE001
        raise Damaged(f"{path} is damaged or cut ({str(e).splitlines()[0]})") from None
    fresh = rt.new_kv(spec)  # the run's own config, RoPE and kernels
    if _where(type(fresh)) != header["class"]:
        raise Damaged(f"{path} holds a {header['class']}, not this spec's cache")
    r = _Reader(tensors, _context(fresh), rt.model.device, fresh)
    try:
        for k, v in header["state"].items():
            object.__setattr__(fresh, k, r.dec(v))
        tokens = tensors["tokens"].tolist()
    except Damaged:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise Damaged(f"{path} has a damaged state ({type(e).__name__}: {e})") from None
    if len(tokens) != header["tokens"] or fresh.seen != len(tokens):
        raise Damaged(f"{path} holds {len(tokens)} tokens; its header says {header['tokens']}")
    if fresh.nbytes() != header["kv_bytes"]:
        raise Damaged(f"{path}: the cache holds {fresh.nbytes()} bytes, its header says "
                      f"{header['kv_bytes']}")  # fmt: skip
    return fresh, tokens, header


# ------------------------------------------------------- a document's turn, its question
DOC_SLOT, Q_SLOT = "<<kvrun:document>>", "<<kvrun:question>>"


def document_turn(tokenizer, text: str, chat: bool, system: str | None) -> tuple[list[int], dict]:
    """(ids, turns) of a document's turn: raw, the document's text; with the chat template,
    the rendered conversation up to where the user's question will go (the document, then
    a blank line). `turns` goes into the file's header: how a question continues it."""
    if not chat:
        return tokenizer.encode(text), {"chat": False}
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": f"{DOC_SLOT}\n\n{Q_SLOT}"})
    rendered = tokenizer.render_chat(msgs, add_generation_prompt=True)
    head = rendered.split(Q_SLOT)[0]
    if rendered.count(Q_SLOT) != 1 or head.count(DOC_SLOT) != 1:
        raise KvrunError("the chat template does not keep the document in place; use --raw")
    before, after = head.split(DOC_SLOT)
    ids = tokenizer.encode(before) + tokenizer.encode(text + after, add_bos=False)
    return ids, {"chat": True, "system": system, "head": head}


def question_turn(tokenizer, question: str, turns: dict) -> list[int]:
    """The ids that follow a document's turn (`document_turn`) with this question: raw, a
    blank line and the question; with the chat template, the rest of the user's message and
    the assistant's header."""
    if not turns.get("chat"):
        return tokenizer.encode(f"\n\n{question}", add_bos=False)
    system = turns.get("system")
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": f"{DOC_SLOT}\n\n{question}"})
    rendered = tokenizer.render_chat(msgs, add_generation_prompt=True)
    if not rendered.startswith(turns["head"]):
        raise KvrunError("this model's chat template renders the document's turn otherwise")
    return tokenizer.encode(rendered[len(turns["head"]) :], add_bos=False)
