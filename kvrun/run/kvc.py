"""Compressed KV caches on disk (`.kvc`): a document compressed once, asked again tomorrow.

A .kvc file is a safetensors file: every tensor the cache holds (the used part of each
buffer, never its spare room), the token ids as int32, and one JSON header in the file's
metadata with

- the format and its version;
- the model's identity: its file's name, size and a fingerprint of its first and last MiB,
  its shapes, and the KV dtype. The packed-model cache keys on the file's path, inode and
  time instead; a .kvc is meant to travel with its model, so it keys on content;
- the KV spec (`--kv` and `--kv-budget` as given, and the options they resolve to);
- the cache's own state: the fields each class declares for a file (kvrun.kv.state), as
  JSON beside the tensors. A load restores them into a fresh manager that the loading run
  builds from its own spec and model, each checked against the kind of value it takes: the
  file names no class or function, so it can build nothing but this spec's cache. No pickle.

`load` checks every part of the header against the model and spec it is given and says in
one line what does not match; a damaged, cut or crafted file is one line too, before anything
from it reaches the run.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import zlib
from pathlib import Path
from typing import Any

import torch

from ..errors import KvrunError
from ..kv.state import DamagedKvcFile, Loader, Writer
from ..kv.stores import kvtypes

# 2: the state as each class declares it (kvrun.kv.state); 3: KIVI's keys block-major
FORMAT, VERSION = "kvrun-kvc", 3
_META_KEY, _STATE_KEY = "kvrun_kvc", "kvrun_kvc_state"


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


# ------------------------------------------------------------------------ save, load
MAX_STATE = 64 << 20  # bytes of a state's JSON, inflated: a zlib bomb stops here


def save(path: str | Path, kv, tokens: list[int], rt, turns: dict | None = None) -> Path:
    """Write kv (after a prefill: a document's turn, compressed) and the tokens it holds;
    `turns`: how a question continues them (`document_turn`)."""
    from safetensors.torch import save_file

    if kv.in_prefill:
        raise KvrunError("a cache is saved between turns, not inside a prefill")
    if kv.seen != len(tokens):
        raise KvrunError(f"the cache has seen {kv.seen} tokens, the session {len(tokens)}")
    path = Path(path)
    w = Writer()
    state = w.obj(kv)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "model": model_identity(rt),
        "spec": {**spec_text(kv.spec), "dtype": (t := kv.held_kv_type()) and t.name},
        "class": _class_name(kv),
        "tokens": len(tokens),
        "turns": turns or {"chat": False},
        "kv_bytes": kv.nbytes(),
    }
    tensors = dict(w.tensors)
    tensors["tokens"] = torch.tensor(tokens, dtype=torch.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    try:
        # the state's JSON repeats its keys layer after layer: zlib makes it ~10x smaller
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


def _class_name(kv) -> str:
    return f"{type(kv).__module__}:{type(kv).__qualname__}"


def _inflate(text: str) -> Any:
    """The state's JSON from base64 + zlib, at most MAX_STATE bytes of it."""
    d = zlib.decompressobj()
    raw = d.decompress(base64.b64decode(text, validate=True), MAX_STATE)
    if d.unconsumed_tail or not d.eof:
        raise ValueError("the state is cut, or larger than a cache's state can be")
    return json.loads(raw)


def _damaged_header(path: Path, why: str) -> DamagedKvcFile:
    return DamagedKvcFile(f"{path} has a damaged header ({why})")


def read_header(path: str | Path) -> dict:
    """The JSON header of a .kvc file, every field of the kind it takes (DamagedKvcFile, in one line,
    when it is not one)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise KvrunError(f"no such .kvc file: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise DamagedKvcFile(f"{path} is not a readable .kvc file ({_first_line(e)})") from None
    if _META_KEY not in meta:
        raise DamagedKvcFile(f"{path} is a safetensors file but not a kvrun .kvc file")
    try:
        header = json.loads(meta[_META_KEY])
    except (ValueError, RecursionError):
        raise _damaged_header(path, "not JSON") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DamagedKvcFile(f"{path} is not a kvrun .kvc file")
    if header.get("version") != VERSION:
        raise KvrunError(
            f"{path} is .kvc format version {_short(header.get('version'))}; this kvrun reads "
            f"version {VERSION}: prefill the document again (kvrun prefill)"
        )
    _check_header(header, path)
    try:
        header["state"] = _inflate(meta.get(_STATE_KEY, ""))
    except (ValueError, TypeError, RecursionError, zlib.error):
        raise _damaged_header(path, "its cache's state") from None
    return header


def _short(v: Any) -> str:
    """A value from a file, in a message of one line: strings as they read, others as repr."""
    text = "".join(c if c.isprintable() else "?" for c in v) if isinstance(v, str) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


_HEADER = {"model": dict, "spec": dict, "class": str, "tokens": int, "turns": dict, "kv_bytes": int}
_SPEC = {"kv": str, "name": str, "budget": (str, type(None)), "describe": dict}


def _check_header(h: dict, path: Path) -> None:
    """Each field of the header of the kind `save` writes (what follows reads them as such)."""
    for fields, where in ((_HEADER, h), (_SPEC, h.get("spec"))):
        for key, kind in fields.items():
            if not isinstance(where, dict) or key not in where or not isinstance(where[key], kind):
                raise _damaged_header(path, f"{key!r} is {_short(where and where.get(key))}")
            if isinstance(where[key], bool) and kind is int:
                raise _damaged_header(path, f"{key!r} is {where[key]!r}")
    dtype = h["spec"].get("dtype")
    if dtype is not None and dtype not in kvtypes.NAMES:
        raise _damaged_header(path, f"'dtype' is {_short(dtype)}")
    if h["tokens"] < 0 or h["kv_bytes"] < 0:
        raise _damaged_header(path, "a negative count")
    t = h["turns"]
    if not isinstance(t.get("chat"), bool) or (
        t["chat"]
        and not (isinstance(t.get("head"), str) and isinstance(t.get("system"), (str, type(None))))
    ):
        raise _damaged_header(path, f"'turns' is {_short(t)}")


def check_model(header: dict, rt, path: Path) -> None:
    want, have = header["model"], model_identity(rt)
    if want != have:
        diff = next((k for k in have if want.get(k) != have.get(k)), "the model")
        raise KvrunError(
            f"{path} was written for model {_short(want.get('name'))} ({diff} differs from "
            f"{have['name']}'s); load it with that model, or prefill the document again"
        )


def _budget(text: str | None) -> str:
    return f" --kv-budget {text}" if text else ""


def check_dtype(path: Path, saved: str | None, asked: str | None) -> str | None:
    """The dense store's type to load with: the file's (None: the model's dtype) where the run
    asks none or auto; another is one line."""
    if asked in (None, "auto") or asked == saved:
        return saved
    held = f"an {saved} cache" if saved else "a cache in the model's dtype"
    raise KvrunError(
        f"{path} holds {held}, not --kv-dtype {asked}; drop --kv-dtype to use the file's, or "
        "prefill the document again with it"
    )


def check_spec(path: Path, saved: dict, spec=None, budget: str | None = None, dtype=None):
    """The spec to load with: the file's where the run asks none; the run's (spec, or the
    file's method with `budget`) where it is the file's. Anything else is one line naming what
    the file holds and what was asked. dtype: --kv-dtype where no spec is given."""
    from ..kv import check

    try:
        mine = check(saved["kv"], saved["budget"])
    except KvrunError as e:
        raise DamagedKvcFile(f"{path} holds a spec this kvrun does not take ({e})") from None
    # the header names its method three times: they must agree (an edited `kv` must not load
    # the state under another method whose store reads alike, e.g. snapkv+kivi2 as kivi2)
    names = {saved["name"], saved["describe"].get("method"), mine.name}
    if len(names) != 1:
        raise DamagedKvcFile(
            f"{path} names its KV method inconsistently ({', '.join(sorted(map(str, names)))})"
        )
    held_dtype = check_dtype(path, saved.get("dtype"), spec.dtype if spec is not None else dtype)
    mine = mine.with_dtype(held_dtype)
    if spec is not None:
        spec = spec.with_dtype(held_dtype)
    if spec is None and budget is None:
        return mine
    asked = spec if spec is not None else check(saved["kv"], budget).with_dtype(held_dtype)
    a, b = spec_text(asked), spec_text(mine)
    ba, bb = asked.budget_or_default(), mine.budget_or_default()
    same_budget = (ba.value if ba else None) == (bb.value if bb else None)
    if a["name"] == b["name"] and a["kv"] == b["kv"] and same_budget:
        return asked
    held = f"a --kv {b['name']}{_budget(bb and bb.text)} cache"
    if a["name"] != b["name"]:
        what = f"{held}, not --kv {a['name']}{_budget(a['budget'])}"
    elif a["kv"] != b["kv"]:
        what = f"--kv {b['kv']}, whose options differ from {a['kv']}"
    else:
        what = f"{held}, not --kv-budget {ba.text if ba else 'none'}"
    raise KvrunError(
        f"{path} holds {what}; drop --kv and --kv-budget to use the file's, or prefill the "
        "document again with these"
    )


def load(path: str | Path, rt, spec=None, budget: str | None = None, dtype: str | None = None):
    """(kv, tokens, header) from a .kvc file for runtime rt. spec: the run's KV spec (None: the
    file's); budget, dtype: --kv-budget and --kv-dtype given without --kv. A spec, model or format that does not
    match, and a file that does not hold this spec's cache as this kvrun makes it, is one line
    (KvrunError, DamagedKvcFile) before anything from the file reaches the run."""
    from safetensors import safe_open

    path = Path(path)
    header = read_header(path)
    check_model(header, rt, path)
    spec = check_spec(path, header["spec"], spec, budget, dtype)
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a mapping
    except Exception as e:  # noqa: BLE001
        raise DamagedKvcFile(f"{path} is damaged or cut ({_first_line(e)})") from None
    tokens = _tokens(tensors.get("tokens"), header["tokens"], rt.config.vocab_size, path)
    fresh = rt.new_kv(spec)  # the run's own config, RoPE, kernels and stores' layouts
    if _class_name(fresh) != header["class"]:
        raise DamagedKvcFile(f"{path} holds a {_short(header['class'])}, not this spec's cache")
    c = rt.config
    sizes = {"H": c.n_kv_heads, "Hq": c.n_heads, "D": c.head_dim, "L": c.n_layers, "T": len(tokens)}
    loader = Loader(tensors, rt.model.device, sizes, fresh)
    try:
        loader.restore(fresh, header["state"], "state")
    except DamagedKvcFile as e:
        raise DamagedKvcFile(f"{path}: {e}") from None
    unused = set(tensors) - loader.used - {"tokens"}
    if unused:
        raise DamagedKvcFile(
            f"{path} holds tensors its state does not name ({_short(sorted(unused))})"
        )
    if fresh.seen != len(tokens):
        raise DamagedKvcFile(f"{path} holds {len(tokens)} tokens; its cache has seen {fresh.seen}")
    if fresh.nbytes() != header["kv_bytes"]:
        raise DamagedKvcFile(f"{path}: the cache holds {fresh.nbytes()} bytes, its header says "
                      f"{header['kv_bytes']}")  # fmt: skip
    return fresh, tokens, header


def _tokens(t, n: int, vocab: int, path: Path) -> list[int]:
    """The token ids: int32, one dimension, as many as the header says, each in the vocabulary."""
    if t is None or t.dtype != torch.int32 or t.dim() != 1 or t.numel() != n:
        raise DamagedKvcFile(f"{path} holds no {n} token ids (int32) beside its cache")
    if n and (int(t.min()) < 0 or int(t.max()) >= vocab):
        raise DamagedKvcFile(f"{path} holds a token id outside the model's vocabulary of {vocab}")
    return t.tolist()


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
