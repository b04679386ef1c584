"""The registry of KV methods, in `kvrun kv list` order; a new method is one module declaring a
`Method` subclass and one line below (docs/writing-a-kv-method.md)."""

from __future__ import annotations

from ..spec import Method
from .duo import Duo
from .expected_attention import ExpectedAttention
from .full import Full
from .h2o import H2O
from .keydiff import KeyDiff
from .kivi import KIVI2, KIVI4
from .knorm import KNorm
from .kvzap import KVzap
from .kvzip import KVzip
from .minicache import MiniCache
from .minikv import MiniKV, MiniKVPyramid
from .pyramidkv import PyramidKV
from .snapkv import SnapKV
from .spindlekv import SpindleKV
from .streaming import Streaming
from .tova import TOVA
from .xkv import XKV

REGISTRY: dict[str, type[Method]] = {
    m.name: m
    for m in (
        Full,
        Streaming,
        H2O,
        SnapKV,
        PyramidKV,
        TOVA,
        KNorm,
        KVzip,
        KVzap,
        Duo,
        KeyDiff,
        ExpectedAttention,
        MiniKV,
        MiniKVPyramid,
        XKV,
        MiniCache,
        SpindleKV,
        KIVI2,
        KIVI4,
    )
}
