"""A dense segment of one layer: K (post-RoPE) and V in the KV type (--kv-dtype: the model's
float dtype, f16, bf16, or llama.cpp's q8_0 / q4_0 blocks), slots in position order (or in any
order where positions are held and a step wrote over a slot: an eviction, a window's ring)."""

from __future__ import annotations

import torch

from ...kernels import use_triton
from ...kernels.dense_decode import dense_decode
from ..attention import (
    Partial,
    by_slot,
    native_attention,
    position_mask,
    sdpa,
    segment_attention,
)
from ..state import Like, state
from .buffer import Buffer
from .kvtypes import KVType

# the position of a padding slot (a head holding fewer slots than its layer's largest,
# scope=adaptive and the like): after every query, so no mask lets one see it
PAD = 2**31 - 1


# a .kvc file holds the slots (the kernels, count_pos and every size but T are the run's)
@state(_k=Like({2: "slots"}), _v=Like({2: "slots"}), pos=Like({1: "slots"}), acc=Like({1: "slots"}))
class DenseSeg:
    """K/V slots per KV head, with optional int32 positions (pos_rows: 0 none, 1 shared by every
    head, Hkv one per head) and accumulated fp32 scores."""

    def __init__(
        self,
        n_kv: int,
        head_dim: int,
        dtype,
        device,
        pos_rows: int = 0,
        scores: bool = False,
        score_rows: int | None = None,
        count_pos: bool = True,
        kernels=None,
        kv_type: KVType | None = None,
    ):
        # the model's native CPU step kernels (kvrun.models.rope.Rope.kernels): a decode row attends
        # in one op over float32 K/V; None: SDPA
        self.kernels = kernels
        self.dtype, self.head_dim = dtype, head_dim
        # K/V held in another type than the model's (None: the model's dtype, as ever): rows
        # encoded on the way in, read through the native kernels' tiles or decoded for torch
        self.kv_type = kv_type if kv_type is not None and kv_type.storage != dtype else None
        if self.kv_type is not None:
            from ...quant import native

            # the typed rows' kernels: native wherever they are built (the exact path is f32)
            self.codec = kernels or (native.ops() if torch.device(device).type == "cpu" else None)
        else:
            self.codec = None
        store_dtype = self.kv_type.storage if self.kv_type else dtype
        row = self.kv_type.row(head_dim) if self.kv_type else head_dim
        # (1, Hkv, cap, row) with room: a decode step writes one slot, copying nothing
        self._k = Buffer((1, n_kv, 0, row), 2, store_dtype, device)
        self._v = Buffer((1, n_kv, 0, row), 2, store_dtype, device)
        self.pos = torch.empty(pos_rows, 0, dtype=torch.int32, device=device) if pos_rows else None
        # False: positions held only for a debug hook outside the cache (not counted in nbytes)
        self.count_pos = count_pos
        # (Hkv or score_rows, T) fp32 accumulated attention (H2O, MiniKV; gqa_agg=max: Hq rows)
        self.acc = torch.empty(score_rows or n_kv, 0, device=device) if scores else None

    @property
    def k(self) -> torch.Tensor:  # (1, Hkv, T, D) post-RoPE, in the model's dtype
        return self._float(self._k.data)

    @property
    def v(self) -> torch.Tensor:  # (1, Hkv, T, D)
        return self._float(self._v.data)

    def widened(
        self, scratch: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`k` and `v` of f16 / bf16 rows written into `scratch` (2, 1, Hkv, >= T, D) in the model's
        dtype, a new one of this store's capacity where it is None or short: (k, v, scratch).
        A caller that reads the whole turn every chunk keeps one scratch: a fresh copy a call
        too large for malloc to reuse takes new pages each time, which cost more than the copy."""
        if self.kv_type is None or self.kv_type.blocks:
            return self.k, self.v, scratch
        n = self.length
        if scratch is None or scratch.shape[3] < n:
            shape = (2, *self._k.buf.shape[:2], self._k.capacity, self.head_dim)
            scratch = torch.empty(shape, dtype=self.dtype, device=self._k.buf.device)
        k, v = scratch[0, :, :, :n], scratch[1, :, :, :n]
        k.copy_(self._k.data)
        v.copy_(self._v.data)
        return k, v, scratch

    def rows(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of slots [lo, hi) (1, Hkv, hi - lo, D) in the model's dtype: only those decoded
        (`k` and `v` decode every slot where the KV type is another)."""
        return self._float(self._k.data[:, :, lo:hi]), self._float(self._v.data[:, :, lo:hi])

    def _float(self, x: torch.Tensor) -> torch.Tensor:
        """Stored rows as the model's dtype (a copy where the KV type is another)."""
        if self.kv_type is None:
            return x
        return self.kv_type.decode(x, self.head_dim, self.codec, self.dtype)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.kv_type is None else self.kv_type.encode(x, self.codec)

    def _attend_typed(self, q: torch.Tensor) -> Partial | None:
        """Every slot visible to q on the native kernels, reading the stored rows (None where
        they do not apply: no kernels, another device or dtype)."""
        ops = self.codec if self.kv_type is not None else self.kernels
        if ops is None or q.dtype != torch.float32 or q.device.type != "cpu":
            return None
        return Partial(
            *ops.attn_typed(q, self._k.data, self._v.data, q.shape[-1] ** -0.5, self._code())
        )

    @property
    def length(self) -> int:
        return self._k.n

    @property
    def n_kv(self) -> int:
        """KV heads held."""
        return self._k.buf.shape[1]

    @property
    def capacity(self) -> int:
        """Slots the buffers have room for."""
        return self._k.capacity

    def reserve(self, n: int) -> None:
        """Room for n slots."""
        self._k.reserve(n)
        self._v.reserve(n)

    def rewind(self) -> None:
        """Empty, keeping the room (a captured CUDA graph reading the buffers stays valid)."""
        self._k.rewind()
        self._v.rewind()
        self._empty_rows()

    def _empty_rows(self) -> None:
        if self.pos is not None:
            self.pos = self.pos[:, :0]
        if self.acc is not None:
            self.acc = self.acc[:, :0]

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Add new tokens (1, Hkv, T, D) at the end; positions (T,)."""
        self._k.append(self._encode(k))
        self._v.append(self._encode(v))
        if self.pos is not None:
            new = positions.to(torch.int32).expand(self.pos.shape[0], -1)
            self.pos = torch.cat([self.pos, new], dim=1)
        if self.acc is not None:
            self.acc = torch.cat(
                [self.acc, self.acc.new_zeros(self.acc.shape[0], k.shape[2])], dim=1
            )

    def rotate_append_attend(self, rope, q, k, v, pos: int) -> torch.Tensor:
        """A decode row at position `pos` on the native step kernels (`kernels` set; no
        positions or scores held): q and k rotated, k and v stored in the next slot, q
        attending over every slot, in one call; the arithmetic of `rope.apply`, `append` and
        `attend`. RoPE's rows are read from its whole tables."""
        n = self._k.n
        self.reserve(n + 1)
        cos, ssin = rope.signed_tables(pos + 1)
        out = self.kernels.rope_append_attend(
            q, k, v, cos, ssin, pos, self._k.buf, self._v.buf, n, q.shape[-1] ** -0.5, self._code()
        )
        self._k.n = self._v.n = n + 1
        return out

    def native_scores(self, q: torch.Tensor) -> bool:
        """Whether the native kernels attend here with the probabilities they used: set, q
        float32, and the rows float32 or held in a KV type (read through its tiles)."""
        return (
            self.kernels is not None
            and q.dtype == torch.float32
            and (self.kv_type is not None or self._k.buf.dtype == torch.float32)
        )

    def _code(self) -> int:
        """The native kernels' code of the stored rows' type (0: float32)."""
        return self.kv_type.code if self.kv_type is not None else 0

    def attend_probs(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode row q (1, Hq, 1, D) over every slot on the native kernels
        (`native_scores`), reading the stored rows: out (1, Hq, 1, D) fp32 and the
        probabilities it used (Hq, T); accumulated scores (acc) get them added, each KV head's
        group summed, in the same pass (H2O §3)."""
        scale = q.shape[-1] ** -0.5
        return self.kernels.attn_probs(q, self._k.data, self._v.data, scale, self.acc, self._code())

    def evict_one(self, scores: torch.Tensor, first: int, last: int) -> bool:
        """One slot out per row of scores (H, C), ranked as `cache.keep_indices` ranks in
        position order (`first` lowest and `last` highest positions protected, ties to the lower
        position); the last slot is written over it: slots leave position order (`pos` keeps
        it), nothing is compacted. Only on the native kernels, with positions of the scores'
        rows; False (nothing done) elsewhere."""
        n = self.length
        if (
            self.kernels is None
            or self.pos is None
            or scores.dtype != torch.float32
            or scores.shape[0] != self.pos.shape[0]
            or self.pos.stride(1) != 1
            or n < 2
        ):
            return False
        buf_k, buf_v = self._k.buf, self._v.buf
        self.kernels.evict_one(scores, self.pos, first, last, buf_k, buf_v, n, self.acc)
        self._k.n = self._v.n = n - 1
        self.pos = self.pos[:, : n - 1]
        if self.acc is not None:
            self.acc = self.acc[:, : n - 1]
        return True

    def in_order(self) -> bool:
        """Whether the slots are in position order (`evict_one` moves them out of it)."""
        p = self.pos
        return p is None or p.shape[1] < 2 or bool((p[:, 1:] > p[:, :-1]).all())

    def rotate_append_probs(self, rope, q, k, v, pos: int) -> tuple[torch.Tensor, ...]:
        """`rotate_append_attend` that also gives (out, the probabilities it used (Hq, T), q
        rotated): the position joins `pos`, acc gets a 0 for the new slot and then the
        probabilities (each KV head's group summed), all in the one native call."""
        n = self._k.n
        self.reserve(n + 1)
        cos, ssin = rope.signed_tables(pos + 1)
        out, p, qr, rows, acc = self.kernels.rope_append_probs(
            q, k, v, cos, ssin, pos, self._k.buf, self._v.buf, n, q.shape[-1] ** -0.5,
            self.pos, self.acc, self._code(),
        )  # fmt: skip
        self._k.n = self._v.n = n + 1
        if self.pos is not None:
            self.pos = rows
        if self.acc is not None:
            self.acc = acc
        return out, p, qr

    def keep(self, idx: torch.Tensor) -> None:
        """Keep slots idx (Hkv, T') or (1, T') (same for every head), in the order given
        (position order: the selection's)."""
        _, Hkv, _, row = self._k.buf.shape
        full = idx.expand(Hkv, -1)
        gather = full[None, :, :, None].expand(1, Hkv, full.shape[1], row)
        self._k.replace(torch.gather(self._k.data, 2, gather))
        self._v.replace(torch.gather(self._v.data, 2, gather))
        if self.pos is not None:
            self.pos = torch.gather(self.pos, 1, idx.expand(self.pos.shape[0], -1))
        if self.acc is not None:
            rows = full.repeat_interleave(len(self.acc) // Hkv, dim=0)  # per query head rows
            self.acc = torch.gather(self.acc, 1, rows)

    def drop_front(self, n: int) -> None:
        """Forget the n oldest slots (a sliding window's, where slots are in position order)."""
        self._k.drop_front(n)
        self._v.drop_front(n)
        if self.pos is not None:
            self.pos = self.pos[:, n:]
        if self.acc is not None:
            self.acc = self.acc[:, n:]

    def overwrite(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: int):
        """One token (1, Hkv, 1, D) written over slots (R,) (R = position rows: one per KV head,
        or one for all) instead of appended: a sliding window's ring, where the slot held the
        oldest position. Its position is set and its score restarts at 0."""
        Hkv = self._k.buf.shape[1]
        heads = torch.arange(Hkv, device=slots.device)
        at = slots.expand(Hkv)  # (Hkv,) the slot each head writes
        self._k.buf[0, heads, at] = self._encode(k)[0, :, 0]
        self._v.buf[0, heads, at] = self._encode(v)[0, :, 0]
        self.pos[torch.arange(len(slots), device=slots.device), slots] = position
        if self.acc is not None:
            rows = at.repeat_interleave(len(self.acc) // Hkv)
            self.acc[torch.arange(len(self.acc), device=slots.device), rows] = 0

    def zero(self, mask: torch.Tensor) -> None:
        """K and V of the slots mask (Hkv, T) set to 0 (zero bytes are 0 in every KV type)."""
        self._k.data[0].masked_fill_(mask[..., None], 0)
        self._v.data[0].masked_fill_(mask[..., None], 0)

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove and return all K, V (1, Hkv, T, D) (the segment starts a new buffer)."""
        k, v = self.k, self.v  # the model's dtype
        self._k.clear()
        self._v.clear()
        self._empty_rows()
        return k, v

    @property
    def end(self) -> int:
        """The slot the next decode token goes to."""
        return self._k.n

    def room(self, n_more: int) -> None:
        """Room for n_more static steps."""
        self.reserve(self._k.n + n_more)

    def attend_static(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor
    ) -> list[Partial]:
        """StaticSegment's; only without positions or scores (their rows grow)."""
        self._k.write_at(slot, k)
        self._v.write_at(slot, v)
        lengths = (slot + 1).to(torch.int32)  # (B=1,)
        return [Partial(*dense_decode(q, self._k.buf, self._v.buf, lengths))]

    def advance(self) -> None:
        self._k.advance()
        self._v.advance()

    def static_key(self) -> tuple:
        """The buffers' addresses."""
        return (self._k.buf.data_ptr(), self._v.buf.data_ptr())

    def mask(self, q_pos: torch.Tensor, n_new: int, window: int | None) -> torch.Tensor | None:
        """Visibility (Tq, T) or (Hkv, Tq, T): by positions when held, else by slot order
        (the last n_new slots are the queries' own tokens, causal among themselves)."""
        if self.pos is not None:
            pos = self.pos.long()
            return position_mask(q_pos, pos[0] if pos.shape[0] == 1 else pos, window)
        if n_new <= 1:
            return None
        T = self.length
        rows = torch.arange(T - n_new, T, device=q_pos.device)
        return torch.arange(T, device=q_pos.device)[None, :] <= rows[:, None]

    def _as_slots(self, q_pos: torch.Tensor, n_new: int, window: int | None) -> bool:
        """Whether a chunk's rows see by slot what they see by position: no positions held, or
        the chunk's own n_new tokens as kvrun.kv.attention.by_slot asks (a prefill before any
        eviction, or a later turn's)."""
        if self.pos is None:
            return True
        return n_new == q_pos.numel() and by_slot(q_pos, self.pos, window)

    def attend(
        self, q: torch.Tensor, q_pos: torch.Tensor, n_new: int, window: int | None
    ) -> torch.Tensor:
        """The fast path for a lone segment, in the KV dtype: SDPA, or for one unmasked query on
        CUDA the split-K decode kernel (SDPA has no fast path there)."""
        if q.shape[2] > 1 and self.kernels is not None and (self.pos is not None or n_new > 1):
            # a prefill chunk: causal by slot where positions see as slots do, else by them (no
            # mask built: the kernel compares positions itself)
            by_pos = not self._as_slots(q_pos, n_new, window)
            kp, qp, w = (self.pos, q_pos, window) if by_pos else (None, None, None)
            part = native_attention(self.kernels, q, self.k, self.v, qp, kp, w)
            if part is not None:
                return part.out
        m = self.mask(q_pos, n_new, window)
        if m is None and q.shape[2] == 1 and use_triton(q):
            return dense_decode(q, self.k, self.v)[0].to(q.dtype)
        if m is None and q.shape[2] == 1:
            part = self._attend_typed(q)
            if part is not None:
                return part.out
        if m is not None and m.dim() == 3:  # per-KV-head mask -> per query head
            m = m.repeat_interleave(q.shape[1] // self._k.buf.shape[1], dim=0)
        return sdpa(q, self.k, self.v, m)

    def partials(
        self, q: torch.Tensor, q_pos: torch.Tensor, n_new: int, window: int | None
    ) -> list[Partial]:
        """The Store protocol's: one partial."""
        mask = self.mask(q_pos, n_new, window)
        part = self._attend_typed(q) if mask is None and self.length else None
        return [part or segment_attention(q, self.k, self.v, mask)]

    def nbytes(self) -> int:
        n = self._k.nbytes() + self._v.nbytes()
        if self.pos is not None and self.count_pos:
            n += self.pos.numel() * 4
        if self.acc is not None:
            n += self.acc.numel() * 4
        return n
