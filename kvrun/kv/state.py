"""What a .kvc file may hold of a cache (kvrun/run/kvc.py), declared by each class that holds it.

A file is loaded into a fresh manager that the loading run builds from its own spec and model:
what that manager builds stays as built (config, RoPE, options, the layout of every store), and
only the fields a class declares with `@state` come from the file, each checked against the
kind of value it takes before it is set. The file names no class and no function: an object is
either the fresh manager's own, restored in place (`Into`, `ListInto`, `DictInto`), or made
anew as its declaration says (`New`, for classes that declare every field). Tensors are checked
for dtype and every dimension: against the fresh tensor they replace (`Like`) or against sizes
named by the model (H, Hq, D, L), the file's token count (T) and the object itself. A class may
add a `kvc_check(self, loader) -> str | None` for what kinds cannot say (indices in range).
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import KvrunError
from .stores.buffer import Buffer


class DamagedKvcFile(KvrunError):
    """A .kvc file that cannot be read as one (cut, overwritten, not a .kvc, or a state that is
    not what this spec's cache holds)."""


@dataclass(frozen=True)
class Decl:
    fields: dict[str, Kind]  # in the order they are read
    complete: bool  # every attribute of an instance is declared: `New` may make one


REGISTRY: dict[type, Decl] = {}


def state(complete: bool = False, **fields: Kind):
    """Class decorator: the fields a .kvc file holds of the class (a subclass adds to its
    bases'); complete=True when they are all of an instance's attributes."""

    def register(cls: type) -> type:
        inherited: dict[str, Kind] = {}
        for base in reversed(cls.__mro__[1:]):
            if base in REGISTRY:
                inherited.update(REGISTRY[base].fields)
        REGISTRY[cls] = Decl({**inherited, **fields}, complete)
        return cls

    return register


def declared(obj: Any) -> Decl:
    decl = REGISTRY.get(type(obj))
    if decl is None:  # kvrun's own bug: a class that holds state but declares none
        raise KvrunError(f"a .kvc file cannot keep a {type(obj).__name__} (no @state)")
    return decl


# --------------------------------------------------------------------------- writing
class Writer:
    """Turns a manager's declared state into JSON and a dict of tensors."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.ids: dict[int, str] = {}
        self.alive: list = []  # keeps every stored tensor's id valid to the end

    def tensor(self, t: torch.Tensor) -> str:
        key = self.ids.get(id(t))
        if key is None:
            key = self.ids[id(t)] = f"t{len(self.tensors)}"
            self.tensors[key] = t.detach().to("cpu").contiguous().clone()
            self.alive.append(t)
        return key

    def obj(self, obj: Any) -> dict:
        decl = declared(obj)
        if decl.complete:
            extra = set(fields_of(obj)) - set(decl.fields)
            if extra:
                raise KvrunError(f"{type(obj).__name__} holds undeclared state: {sorted(extra)}")
        return {name: kind.write(self, getattr(obj, name)) for name, kind in decl.fields.items()}


def fields_of(v: Any) -> dict:
    """An object's attributes: its __dict__ and every __slots__ entry set on it."""
    out = dict(getattr(v, "__dict__", {}))
    for klass in type(v).__mro__:
        for s in getattr(klass, "__slots__", ()):
            if s not in ("__dict__", "__weakref__") and hasattr(v, s):
                out[s] = getattr(v, s)
    return out


# --------------------------------------------------------------------------- reading
class Loader:
    """Reads a file's state into a fresh manager. `symbols`: sizes the model and the file name
    (H, Hq, D, L, T); `kv`: the manager being restored (for `kvc_check`)."""

    def __init__(self, tensors: dict[str, torch.Tensor], device, symbols: dict[str, int], kv):
        self.tensors, self.device, self.symbols, self.kv = tensors, device, symbols, kv
        self.used: set[str] = set()
        self.made: dict[str, torch.Tensor] = {}

    def tensor(self, data: Any, path: str) -> torch.Tensor:
        if not isinstance(data, str) or data not in self.tensors or data == "tokens":
            raise DamagedKvcFile(f"{path} names no tensor of the file ({_short(data)})")
        self.used.add(data)
        if data not in self.made:
            self.made[data] = self.tensors[data].to(self.device)
        return self.made[data]

    def restore(self, obj: Any, data: Any, path: str) -> Any:
        """obj's declared fields from data, in place; obj is the fresh manager's or new."""
        decl = declared(obj)
        if not isinstance(data, dict):
            raise DamagedKvcFile(f"{path} is not an object's state ({_short(data)})")
        if set(data) != set(decl.fields):
            missing, extra = set(decl.fields) - set(data), set(data) - set(decl.fields)
            what = (
                f"lacks its field {sorted(missing)[0]!r}"
                if missing
                else f"has {_short(sorted(extra)[0])}, not a field of its state"
            )
            raise DamagedKvcFile(f"{path} ({type(obj).__name__}) {what}")
        env = Env(self, obj)
        for name, kind in decl.fields.items():
            fresh = getattr(obj, name, None)
            object.__setattr__(obj, name, kind.read(self, data[name], fresh, env, f"{path}.{name}"))
        env.settle(path)
        check = getattr(type(obj), "kvc_check", None)
        why = check(obj, self) if check is not None else None
        if why:
            raise DamagedKvcFile(f"{path} ({type(obj).__name__}): {why}")
        return obj


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv}  # fmt: skip


class Env:
    """One object's sizes: free names bound by the first dimension that uses them, expressions
    (kvrun's declarations, never the file's) checked once all its fields are read."""

    def __init__(self, loader: Loader, obj: Any):
        self.loader, self.obj = loader, obj
        self.bound: dict[str, int] = {}
        self.pending: list[tuple[str, int, str]] = []

    def dim(self, spec: int | str, size: int, path: str) -> None:
        if isinstance(spec, int):
            if size != spec:
                raise DamagedKvcFile(f"{path} has size {size} where {spec} is due")
        elif spec.isidentifier() and self.lookup(spec) is None:
            self.bound[spec] = size
        else:
            self.pending.append((spec, size, path))

    def lookup(self, name: str) -> int | None:
        if name in self.bound:
            return self.bound[name]
        own = getattr(self.obj, name, None)
        if type(own) is int:
            return own
        return self.loader.symbols.get(name)

    def settle(self, where: str) -> None:
        for spec, size, path in self.pending:
            want = self.eval(ast.parse(spec, mode="eval").body, where)
            if size != want:
                raise DamagedKvcFile(f"{path} has size {size} where {spec} = {want} is due")

    def eval(self, node: ast.AST, where: str) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            v = self.lookup(node.id)
            if v is None:
                raise DamagedKvcFile(f"{where}: no size {node.id!r} to check its tensors against")
            return v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = self.eval(node.left, where), self.eval(node.right, where)
            if isinstance(node.op, ast.FloorDiv) and b == 0:
                raise DamagedKvcFile(f"{where}: a size divides by zero")
            return _OPS[type(node.op)](a, b)
        raise KvrunError(f"a .kvc declaration's size {ast.dump(node)} is not arithmetic")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


# ----------------------------------------------------------------------------- kinds
class Kind:
    """The kind of value a field takes: how it is written and how it is read and checked."""

    def write(self, w: Writer, v: Any) -> Any:
        return v

    def read(self, r: Loader, data: Any, fresh: Any, env: Env, path: str) -> Any:
        raise NotImplementedError


class Int(Kind):
    """An int in [lo, hi]; hi an int or a symbol (T: the file's tokens)."""

    def __init__(self, lo: int = 0, hi: int | str | None = None):
        self.lo, self.hi = lo, hi

    def read(self, r, data, fresh, env, path):
        hi = r.symbols[self.hi] if isinstance(self.hi, str) else self.hi
        if type(data) is not int or data < self.lo or (hi is not None and data > hi):
            raise DamagedKvcFile(f"{path} is {_short(data)}, not an integer in [{self.lo}, {hi}]")
        return data


class Bool(Kind):
    def read(self, r, data, fresh, env, path):
        if type(data) is not bool:
            raise DamagedKvcFile(f"{path} is {_short(data)}, not true or false")
        return data


class Flt(Kind):
    """A finite float, written as its repr (exact)."""

    def write(self, w, v):
        return repr(float(v))

    def read(self, r, data, fresh, env, path):
        try:
            x = float(data) if isinstance(data, str) and len(data) < 40 else None
        except ValueError:
            x = None
        if x is None or x != x or x in (float("inf"), float("-inf")):
            raise DamagedKvcFile(f"{path} is {_short(data)}, not a finite number")
        return x


class Str(Kind):
    """One of the given strings."""

    def __init__(self, *choices: str):
        self.choices = choices

    def read(self, r, data, fresh, env, path):
        if data not in self.choices or not isinstance(data, str):
            raise DamagedKvcFile(f"{path} is {_short(data)}, not one of {list(self.choices)}")
        return data


class Nothing(Kind):
    """None only: state that lives inside a prefill, and a cache is saved between turns."""

    def write(self, w, v):
        if v is not None:
            raise KvrunError("a .kvc file is written between turns, not inside a prefill")
        return None

    def read(self, r, data, fresh, env, path):
        if data is not None:
            raise DamagedKvcFile(f"{path} is {_short(data)}; a cache between turns holds none")
        return None


class Dtype(Kind):
    """One of the named torch dtypes."""

    def __init__(self, *names: str):
        self.names = {n: getattr(torch, n) for n in names}

    def write(self, w, v):
        return str(v).removeprefix("torch.")

    def read(self, r, data, fresh, env, path):
        if not isinstance(data, str) or data not in self.names:
            raise DamagedKvcFile(f"{path} is {_short(data)}, not one of {sorted(self.names)}")
        return self.names[data]


class Maybe(Kind):
    """None or the kind."""

    def __init__(self, kind: Kind):
        self.kind = kind

    def write(self, w, v):
        return None if v is None else self.kind.write(w, v)

    def read(self, r, data, fresh, env, path):
        return None if data is None else self.kind.read(r, data, fresh, env, path)


def _dtypes(names: tuple[str, ...], r: Loader) -> set[torch.dtype]:
    kv = getattr(r.kv, "store_dtype", r.kv.dtype)  # a cache whose rows take --kv-dtype's
    return {kv if n == "kv" else getattr(torch, n) for n in names}


class Tensor(Kind):
    """A tensor of dtype `dtype` ("kv": the cache's; a tuple: one of them) and sizes `dims`
    (ints, symbols, free names or expressions of them)."""

    def __init__(self, dtype: str | tuple[str, ...], dims: tuple[int | str, ...]):
        self.dtypes = (dtype,) if isinstance(dtype, str) else dtype
        self.dims = dims

    def write(self, w, v):
        return w.tensor(v)

    def read(self, r, data, fresh, env, path):
        t = r.tensor(data, path)
        want = _dtypes(self.dtypes, r)
        if t.dtype not in want or t.dim() != len(self.dims):
            names = " or ".join(sorted(_name(d) for d in want))
            raise DamagedKvcFile(f"{path} is a {_describe(t)}, not a {len(self.dims)}-d {names}")
        for i, (spec, size) in enumerate(zip(self.dims, t.shape, strict=True)):
            env.dim(spec, size, f"{path} dim {i}")
        return t


class Buf(Tensor):
    """A Buffer made anew (kvrun.kv.stores.buffer): its occupied slots, growing along `dim`."""

    def __init__(self, dtype: str, dims: tuple[int | str, ...], dim: int):
        super().__init__(dtype, dims)
        self.along = dim

    def write(self, w, v):
        return w.tensor(v.data)

    def read(self, r, data, fresh, env, path):
        return _buffer(super().read(r, data, fresh, env, path), self.along)


def _buffer(t: torch.Tensor, dim: int) -> Buffer:
    b = Buffer.__new__(Buffer)
    b.buf, b.dim, b.n = t, dim, t.shape[dim]
    return b


def _describe(t: torch.Tensor) -> str:
    return f"{t.dim()}-d {_name(t.dtype)} {tuple(t.shape)}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Like(Kind):
    """A tensor or Buffer like the fresh one it replaces: its dtype (or one of `dtypes` besides,
    which the owner's kvc_check narrows), its rank and its sizes, but for the dimensions `grow`
    names (dim -> free name or expression).
    Present exactly when the fresh one is."""

    def __init__(self, grow: dict[int, str] | None = None, dtypes: tuple[str, ...] = ()):
        self.grow, self.dtypes = grow or {}, dtypes

    def write(self, w, v):
        if v is None:
            return None
        return w.tensor(v.data if isinstance(v, Buffer) else v)

    def read(self, r, data, fresh, env, path):
        if fresh is None or data is None:
            if fresh is None and data is None:
                return None
            raise DamagedKvcFile(f"{path} is {'absent' if data is None else 'present'} in the file, "
                          f"{'present' if data is None else 'absent'} in this spec's cache")  # fmt: skip
        like = fresh.buf if isinstance(fresh, Buffer) else fresh
        t = r.tensor(data, path)
        if t.numel() == 0 and t.dim() == like.dim() and t.dtype != like.dtype:
            # no values to keep: an older file's empty buffer (a KIVI stack's staging area kept
            # the model's float32 before it took --kv-dtype) reads as the fresh one's dtype
            t = like.new_empty(t.shape)
        dtypes = _dtypes(self.dtypes, r) | {like.dtype}  # the fresh one's, or one named
        if t.dtype not in dtypes or t.dim() != like.dim():
            raise DamagedKvcFile(
                f"{path} is a {_describe(t)}, not a {like.dim()}-d {_name(like.dtype)}"
            )
        for i, size in enumerate(t.shape):
            env.dim(self.grow.get(i, like.shape[i]), size, f"{path} dim {i}")
        return _buffer(t, fresh.dim) if isinstance(fresh, Buffer) else t


class Into(Kind):
    """An object the fresh manager built (or None where it built none): restored in place."""

    def write(self, w, v):
        return None if v is None else w.obj(v)

    def read(self, r, data, fresh, env, path):
        if fresh is None or data is None:
            if fresh is None and data is None:
                return None
            raise DamagedKvcFile(f"{path} is {'absent' if data is None else 'present'} in the file but "
                          "not in this spec's cache")  # fmt: skip
        return r.restore(fresh, data, path)


class ListInto(Into):
    """The fresh manager's list of objects (or Nones), as many in the file, each in place."""

    def write(self, w, v):
        return [Into.write(self, w, x) for x in v]

    def read(self, r, data, fresh, env, path):
        if not isinstance(data, list) or len(data) != len(fresh):
            raise DamagedKvcFile(f"{path} is not a list of {len(fresh)} entries ({_short(data)})")
        for i, (x, d) in enumerate(zip(fresh, data, strict=True)):
            Into.read(self, r, d, x, env, f"{path}[{i}]")
        return fresh


class DictInto(Into):
    """The fresh manager's dict of objects: its values in its order, each in place."""

    def write(self, w, v):
        return [Into.write(self, w, x) for x in v.values()]

    def read(self, r, data, fresh, env, path):
        ListInto.read(self, r, data, list(fresh.values()), env, path)
        return fresh


class New(Kind):
    """An object of `cls` made anew (the fresh manager holds none yet); cls declares all."""

    def __init__(self, cls: type):
        self.cls = cls

    def write(self, w, v):
        if type(v) is not self.cls:
            raise KvrunError(f"a .kvc declaration expects a {self.cls.__name__}, not {type(v)}")
        return w.obj(v)

    def read(self, r, data, fresh, env, path):
        if not REGISTRY[self.cls].complete:
            raise KvrunError(f"{self.cls.__name__} does not declare all its fields")
        return r.restore(self.cls.__new__(self.cls), data, path)


class ListOf(Kind):
    """A list of at most `most` values of one kind (most: an int or a symbol)."""

    def __init__(self, kind: Kind, most: int | str, exactly: bool = False):
        self.kind, self.most, self.exactly = kind, most, exactly

    def write(self, w, v):
        return [self.kind.write(w, x) for x in v]

    def read(self, r, data, fresh, env, path):
        most = r.symbols[self.most] if isinstance(self.most, str) else self.most
        n = len(data) if isinstance(data, list) else -1
        if n < 0 or n > most or (self.exactly and n != most):
            size = f"{most}" if self.exactly else f"at most {most}"
            raise DamagedKvcFile(f"{path} is not a list of {size} entries ({_short(data)})")
        return [self.kind.read(r, x, None, env, f"{path}[{i}]") for i, x in enumerate(data)]


class Tuple2(Kind):
    """A tuple of two values of the given kinds (JSON: a list of two)."""

    def __init__(self, first: Kind, second: Kind):
        self.kinds = (first, second)

    def write(self, w, v):
        return [k.write(w, x) for k, x in zip(self.kinds, v, strict=True)]

    def read(self, r, data, fresh, env, path):
        if not isinstance(data, list) or len(data) != 2:
            raise DamagedKvcFile(f"{path} is not a pair ({_short(data)})")
        return tuple(k.read(r, x, None, env, path) for k, x in zip(self.kinds, data, strict=True))


class Record(Kind):
    """A dict whose keys are some of the declared ones, each with its kind."""

    def __init__(self, **kinds: Kind):
        self.kinds = kinds

    def write(self, w, v):
        return {k: self.kinds[k].write(w, x) for k, x in v.items()}

    def read(self, r, data, fresh, env, path):
        if not isinstance(data, dict) or not set(data) <= set(self.kinds):
            raise DamagedKvcFile(f"{path} is not a record of {sorted(self.kinds)} ({_short(data)})")
        return {k: self.kinds[k].read(r, x, None, env, f"{path}.{k}") for k, x in data.items()}
