"""The contract between the model and a KV cache, the per-layer Store protocol, and what the
driver hands a method. The model calls, for one sequence (kvrun/run/step.py runs B):

    kv.begin_prefill(n)                       # a prompt (or a new chat turn) of n tokens
    for each chunk of at most --ubatch tokens:
        out = kv.attend(layer, q, k, v, pos)  # every layer, in order: prefill(...)
        kv.end_chunk(n_chunk)
    kv.end_prefill()
    for each generated token:
        out = kv.attend(layer, q, k, v, pos)  # every layer, one token: decode(...)
        kv.end_step()

One method per event: a cache that acts at an event overrides it and calls super() first
(KVManager keeps the counters there).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import torch

from . import attention
from .attention import Partial
from .state import Bool, Int, state

_SHARED = (MappingProxyType, frozenset)  # a spec's options, a method's declared points


@dataclass(slots=True)
class Pass:
    """A planning pass: `ids` at positions start, start + 1, ... with `kv` as the cache, in
    --ubatch chunks; a `whole` pass runs only when the ids fit one chunk."""

    ids: list[int]
    kv: KVManager
    start: int
    whole: bool = False


@state(seen=Int(0, "T"), select_turn=Bool())
class KVManager:
    """The contract and its bookkeeping; subclasses store, compress and attend."""

    name = "base"
    keys_pre_rope = False  # True: `prefill`/`decode` receive k before RoPE
    static = False  # decoding statically (after make_static): positions only as a tensor

    def __init__(self, config, rope, device, dtype, on_select=None):
        self.config, self.rope, self.device, self.dtype = config, rope, device, dtype
        # on_select(layer, point, positions (Hkv, T)): a debug hook outside the cache, not in nbytes
        self.on_select = on_select
        self.seen = 0  # tokens seen so far in this sequence (all turns)
        self.in_prefill = False
        self.select_turn = True  # False: this turn's prefill compresses nothing (question-after)

    def reset(self) -> None:
        """Forget the sequence; the next call starts at position 0."""
        self.seen = 0
        self.in_prefill = False

    def fork(self) -> KVManager:
        """An independent copy of this cache as it stands: what it holds and its bookkeeping
        copied, so the two go on apart (a kept prefix, a compressed document asked several
        questions). What never changes is shared, not copied: the model's config and RoPE,
        the spec and its options, the native kernels, the debug hook."""
        from ..quant import native  # the typed stores' kernels (kvrun.kv.stores.kvtypes)

        shared = [self.config, self.rope, getattr(self.rope, "kernels", None), self.on_select]
        shared.append(native.ops() if native.ops.cache_info().currsize else None)
        for v in vars(self).values():
            # what a model lends a cache (the output projection's weights) is shared too
            lent = getattr(type(v), "shared_by_forks", False)
            if isinstance(v, _SHARED) or type(v).__module__.endswith("kv.spec") or lent:
                shared.append(v)
        memo = {id(v): v for v in shared if v is not None}
        return copy.deepcopy(self, memo)

    def begin_prefill(self, n_tokens: int, select: bool = True) -> None:
        """A prefill of n_tokens starts; select=False stores its tokens but selects nothing (a
        question arriving on an already compressed document)."""
        self.in_prefill = True
        self.select_turn = select

    # Each event is one method. A cache that acts at an event overrides it and calls super()
    # first: the base keeps the counters, so every override sees them the same way (`seen`
    # includes the chunk or step just attended; `in_prefill` is False at the prefill's end;
    # `select_turn` is the turn's until the next begin_prefill).
    def end_chunk(self, n_tokens: int) -> None:
        """All layers have attended over the last prefill chunk of `n_tokens`."""
        self.seen += n_tokens

    def end_prefill(self) -> None:
        """The prefill is complete: prefill-time selection, merging and coding happen here."""
        self.in_prefill = False

    def end_step(self) -> None:
        """All layers have attended over one decode token (decode-time eviction, flushes)."""
        self.seen += 1

    def planning_pass(self, when: str, ids: Sequence[int], tokenizer) -> list[Pass]:
        """Passes to run "before" the turn `ids`' prefill or "after" it (XKV's scoring pass, a
        context reconstruction): prefills with a manager of their own that keep nothing."""
        return []

    def report(self, layer: int, point: str, positions: torch.Tensor) -> None:
        """The debug hook: the positions (1 or Hkv, T) a layer keeps after a point."""
        if self.on_select is not None:
            self.on_select(layer, point, positions.expand(self.config.n_kv_heads, -1).clone())

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # (1, Hq, T, D) pre-RoPE
        k: torch.Tensor,  # (1, Hkv, T, D) pre-RoPE
        v: torch.Tensor,  # (1, Hkv, T, D)
        positions: torch.Tensor,  # (T,) int64
    ) -> torch.Tensor:  # (1, Hq, T, D)
        """Store the new k, v as the method says and attend over everything the layer keeps."""
        rope = self.rope.at(layer)  # Gemma 3: the local layers' own
        if self.static and not self.in_prefill and k.shape[2] == 1:
            cap = self.capacity  # no host sync: RoPE tables bounded by the static room
            qr = rope.apply(q, positions, bound=cap)
            kr = k if self.keys_pre_rope else rope.apply(k, positions, bound=cap)
            return self.decode_static(layer, qr, kr, v, positions)
        qr = rope.apply(q, positions)
        kr = k if self.keys_pre_rope else rope.apply(k, positions)
        if self.in_prefill:
            return self.prefill(layer, qr, kr, v, positions)
        return self.decode(layer, qr, kr, v, positions)

    def prefill(self, layer, q, k, v, positions) -> torch.Tensor:
        """A prefill chunk in one layer: q (1, Hq, T, D) and k (1, Hkv, T, D) post-RoPE (k
        pre-RoPE where keys_pre_rope), v, positions (T,); store them as the method says and
        return the attention output (1, Hq, T, D) over everything the layer keeps."""
        raise NotImplementedError

    def decode(self, layer, q, k, v, positions) -> torch.Tensor:
        """One decode token in one layer (T = 1), as `prefill`."""
        raise NotImplementedError

    # A static decode form (CUDA graphs) adds make_static, capacity, decode_static,
    # static_buffers, static_step_ok and after_static_step (kvrun/kv/cache.py).
    def static_unsupported(self) -> str | None:
        """Why decode steps cannot be static (captured in a CUDA graph), or None when they can."""
        return f"the {self.name} cache has no static decode form"

    def stores(self) -> list:
        """The per-layer stores the cache holds (Store below)."""
        return []

    def nbytes(self) -> int:
        """Exact bytes held: every stored tensor (values, scales, positions, indices...)."""
        raise NotImplementedError

    kv_type = None  # the dense store's KVType where --kv-dtype differs from the model's dtype
    # the KVType `full` would keep under the same --kv-dtype where kv_type is None but the store
    # follows it otherwise (KIVI's scales, zeros and tail): what nbytes_full counts
    full_kv_type = None

    def held_kv_type(self):
        """The KVType the cache's stores follow (dense rows, or KIVI's scales and zeros), None
        where they are the model's dtype: what describe(), nbytes_full and a .kvc record."""
        return self.kv_type or self.full_kv_type

    def kivi_scales(self, spec, dtype, device):
        """The dtype a KIVI store's scales and zeros (and its tail on the CPU) take under
        --kv-dtype (f32 or f16; None: the model's), setting full_kv_type to it (baselines.md §5:
        they are kept in the KV dtype)."""
        kt = spec.kivi() and self.f16_kv_type(spec, dtype, device, "KIVI scales and zeros")
        self.full_kv_type = kt or None
        return kt.storage if kt else None

    def dense_kv_type(self, spec, dtype, device):
        """The KVType (stores.kvtypes) --kv-dtype gives the rows this cache keeps dense, or None
        where it is the model's dtype. Typed rows are the CPU's (CUDA's kernels read the
        model's dtype); block types are checked against the head size."""
        from ..errors import KvrunError
        from .stores import kvtypes

        name = spec.dtype_on(device)
        if name is None:
            return None
        t = kvtypes.of(name, dtype)
        if t.storage == dtype:
            return None
        if torch.device(device).type != "cpu":
            raise KvrunError(
                f"--kv-dtype {name} runs on the CPU; on {device} the cache keeps the model's "
                "dtype (drop --kv-dtype, or --kv-dtype auto)"
            )
        t.check_dim(self.config.head_dim, "this model")
        return t

    def f16_kv_type(self, spec, dtype, device, what: str):
        """dense_kv_type for a store of its own that keeps `what` in f32 or f16 only (MiniCache's
        pairs, SpindleKV's codebooks): another --kv-dtype is a one-line error."""
        from ..errors import KvrunError

        t = self.dense_kv_type(spec, dtype, device)
        if t is not None and t.name != "f16":
            raise KvrunError(
                f"--kv {spec.name} keeps its {what} in f32 or f16, not {t.name}: use "
                "--kv-dtype f16 (the CPU's default) or f32"
            )
        return t

    def nbytes_full(self) -> int:
        """Bytes an uncompressed cache in the same KV type would hold for the tokens seen."""
        c = self.config
        t = self.held_kv_type()
        if t is not None:
            return int(self.seen * 2 * c.n_layers * c.n_kv_heads * t.row_bytes(c.head_dim))
        return self.seen * c.kv_bytes_per_token(self.dtype.itemsize)

    def describe(self) -> dict:
        """The method and its settings, as --json reports them."""
        return {"method": self.name}


@dataclass(slots=True)
class Ctx:
    """What the driver hands a method's score(): one layer at one compression point."""

    layer: int
    opt: Mapping[str, Any]
    config: Any  # the model's ModelConfig
    # the layer's dense store (stores.dense.DenseSeg): `keys` and `values` read from it only
    # when a method asks, so a score from the step's probabilities decodes no typed rows
    store: Any
    queries: torch.Tensor | None  # (Hq, w, D) post-RoPE newest queries (Method.queries)
    positions: torch.Tensor | None  # (1 or Hkv, T) int32, where the store keeps them
    attention: torch.Tensor | None  # (Hkv, T) fp32 column sums (Method.cumulative)
    n: int  # tokens seen
    budget: int  # B_l, the slots this layer keeps
    # (Hq, T) fp32 the probabilities the step's own attention used (the saved query's, over
    # every held slot), where the native step kept them; else None
    probs: torch.Tensor | None = None
    # heads padded to the layer's largest (scope=adaptive): the padding's position is PAD
    padded: bool = False
    rope: Any = None  # the layer's Rope (kvrun/models/rope.py): a method that unrotates queries

    @property
    def keys(self) -> torch.Tensor:  # (Hkv, T, D) post-RoPE keys of the held slots
        return self.store.k[0]

    @property
    def values(self) -> torch.Tensor:  # (Hkv, T, D)
        return self.store.v[0]

    def window_scores(self) -> torch.Tensor:  # (Hq, T - w) fp32
        """The saved queries' attention to the T - w older slots (attention.window_scores);
        the step's own probabilities where it kept them (no second pass over the keys)."""
        if self.probs is not None:
            return self.probs[:, : self.store.length - self.queries.shape[1]]
        sw = self.config.window(self.layer)
        at = self.positions if sw or self.padded else None  # padding: masked by its position
        return attention.window_scores(self.queries, self.keys, sw, at)

    def window_votes(self, kind: str, kernel: int) -> torch.Tensor:  # (Hkv, T - w) fp32
        """SnapKV's votes (§4.2): pooled per query head, then summed per KV head (max-pooling
        does not commute with the sum)."""
        return self.by_kv_head(attention.pool(self.window_scores(), kind, kernel))

    def by_kv_head(self, x: torch.Tensor) -> torch.Tensor:
        """(Hq, C) -> (Hkv, C): the query heads of each KV head summed
        (docs/methods/README.md §3)."""
        return attention.group_sum(x, self.store.n_kv)


@runtime_checkable
class Store(Protocol):
    """One layer's K, V, attending in its own form: DenseSeg, KiviLayer, CodedLayer, PairLayer."""

    @property  # slots held (tokens, or merged tokens for a pair)
    def length(self) -> int: ...

    # q (1, Hq, Tq, D) post-RoPE at q_pos (Tq,) over the slots, the last n_new the queries' own
    # (causal); window: the model's sliding window. One Partial (output, lse) per segment.
    def partials(self, q, q_pos, n_new: int, window: int | None) -> list[Partial]: ...

    # every byte the store holds: slots, positions, scores, codebooks, staging
    def nbytes(self) -> int: ...


@runtime_checkable
class StaticSegment(Store, Protocol):
    """A store whose decode step runs with no host sync, so a CUDA graph can capture it."""

    @property  # the slot the next decode token goes to (constant within a step)
    def end(self) -> int: ...

    # room for n_more static steps (buffers never move while a graph replays)
    def room(self, n_more: int) -> None: ...

    # write k, v (1, Hkv, 1, D) at slot ((1,) on device, in the room); attend q up to it
    def attend_static(self, q, k, v, slot: torch.Tensor) -> list[Partial]: ...

    def advance(self) -> None: ...  # the Python side of the write: one more slot occupied

    # what a captured step depends on (buffer addresses, lengths fixed between flushes)
    def static_key(self) -> tuple: ...
