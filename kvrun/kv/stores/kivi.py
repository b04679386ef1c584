"""KIVI store (KIVI §3): per layer a packed 2/4-bit body and a dense tail. Keys are quantized per
channel (groups of G tokens), values per token (groups of G channels), asymmetric min/max, codes
packed into int32 words as the public KIVI code packs them; the manager decides when to flush.

The body's keys are kept block-major, a group of G tokens of every channel together
(kernels.kivi_pack.keys_by_group), where the public layout keeps each channel's row of all
tokens: a decode step then reads the body as a few sequential streams instead of D rows far
apart (bench/README.md, "KIVI's keys block-major"). The values are the public layout."""

from __future__ import annotations

import torch

from ...errors import KvrunError
from ...kernels.dense_decode import dense_decode
from ...kernels.kivi_decode import kivi_decode
from ...kernels.kivi_pack import keys_by_channel, kivi_pack, unpack_codes
from ..attention import Partial, segment_attention
from ..state import Like, state
from . import kivi_native
from .buffer import Buffer


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dim: int, group: int
) -> torch.Tensor:
    """x_hat = code * scale + zero in fp32, each group's scale and zero repeated along `dim`."""
    s = scale.float().repeat_interleave(group, dim=dim)
    z = zero.float().repeat_interleave(group, dim=dim)
    return codes.float() * s + z


def unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: uint8 codes, 32/bits per word along the last dim."""
    return unpack_codes(words, bits).to(torch.uint8)


# a .kvc file holds the body (tq tokens) and the tail (tr); H, D, bits, G, R and the kernels are
# the run's
@state(
    _vq=Like({1: "tq"}),
    _vs=Like({1: "tq"}),
    _vz=Like({1: "tq"}),
    _kq=Like({1: "tq // G"}),
    _ks=Like({1: "tq // G"}),
    _kz=Like({1: "tq // G"}),
    # the tail in the KV dtype (f16) or, from files written before it was, float32
    _tk=Like({1: "tr"}, dtypes=("float32", "float16")),
    _tv=Like({1: "tr"}, dtypes=("float32", "float16")),
)
class KiviLayer:
    """One layer's KIVI store: a packed body (oldest Tq tokens), a dense tail (newest Tr)."""

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        bits: int,
        group: int,
        residual: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kernels=None,
        scale_dtype: torch.dtype | None = None,
    ):
        if bits not in (1, 2, 4, 8):
            raise ValueError(f"kivi: bits {bits} must be 1, 2, 4 or 8 (32/bits codes per int32)")
        per = 32 // bits
        if group <= 0 or group % per:
            raise ValueError(f"kivi: group {group} must be a positive multiple of 32/bits = {per}")
        if residual <= 0 or residual % group:
            raise ValueError(
                f"kivi: residual {residual} must be a positive multiple of group {group}"
            )
        if head_dim % group:
            raise ValueError(f"kivi: head_dim {head_dim} must be a multiple of group {group}")
        self.H, self.D, self.bits, self.G, self.R = n_kv_heads, head_dim, bits, group, residual
        self.dtype, self.device = dtype, torch.device(device)
        # scales and zeros: the KV dtype (baselines.md §5; f16 on the CPU under --kv-dtype auto),
        # the model's where none is given; the tail too on the CPU, whose model dtype is float32
        # (the spec's fp16 tail); elsewhere (CUDA) the tail keeps the model's f16 / bf16, which
        # the Triton kernels read
        sdt = self.scale_dtype = scale_dtype or dtype
        tdt = self._own_tail_dtype()
        # the model's native CPU step kernels (kvrun.models.rope.Rope.kernels): attention and flushes
        # in C++, the scales and the tail float32 or float16 (kivi_native); None: the torch path
        # (Triton on CUDA)
        native = dtype == torch.float32 and sdt in (torch.float32, torch.float16)
        self.kernels = kernels if self.device.type == "cpu" and native else None
        H, D, dev, i32 = n_kv_heads, head_dim, self.device, torch.int32
        self._kq = Buffer((H, 0, D, group * bits // 32), 1, i32, dev)  # (Hkv, Tq/G, D, G*b/32)
        self._ks = Buffer((H, 0, D), 1, sdt, dev)  # (Hkv, Tq/G, D)
        self._kz = Buffer((H, 0, D), 1, sdt, dev)  # (Hkv, Tq/G, D)
        self._vq = Buffer((H, 0, D * bits // 32), 1, i32, dev)  # (Hkv, Tq, D*b/32)
        self._vs = Buffer((H, 0, D // group), 1, sdt, dev)  # (Hkv, Tq, D/G)
        self._vz = Buffer((H, 0, D // group), 1, sdt, dev)  # (Hkv, Tq, D/G)
        self._tk = Buffer((H, 0, D), 1, tdt, dev)  # (Hkv, Tr, D) dense tail
        self._tv = Buffer((H, 0, D), 1, tdt, dev)  # (Hkv, Tr, D)

    @classmethod
    def of(
        cls, layout: dict, config, dtype, device, where: str, kernels=None, scale_dtype=None
    ) -> KiviLayer:
        """A layer's store in a spec's KIVI layout; a misfit is a one-line error naming `where`."""
        try:
            return cls(
                config.n_kv_heads,
                config.head_dim,
                layout["bits"],
                layout["group"],
                layout["residual"],
                dtype,
                device,
                kernels,
                scale_dtype,
            )
        except ValueError as e:
            raise KvrunError(f"{where}: {e}") from None

    def kvc_check(self, loader) -> str | None:
        """What a .kvc file's sizes cannot say (kvrun.kv.state): the body is whole groups; the
        tail's K and V in one dtype, this store's or (on the CPU, from a file written before the
        tail took the KV dtype) float32."""
        if self.body_len % self.G:
            return f"a body of {self.body_len} tokens is not whole groups of {self.G}"
        own = self._own_tail_dtype()
        ok = {own, torch.float32} if self._cpu_f32() else {own}
        tk, tv = self._tk.buf.dtype, self._tv.buf.dtype
        if tk != tv or tk not in ok:
            name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
            return f"a KIVI tail of {name(tk)} keys and {name(tv)} values, not {name(own)}"
        return None

    def _cpu_f32(self) -> bool:
        """The CPU with a float32 model: the tail takes the KV dtype (the scales')."""
        return self.device.type == "cpu" and self.dtype == torch.float32

    def _own_tail_dtype(self) -> torch.dtype:
        """The dtype this store makes its tail in: the scales' on the CPU, the model's elsewhere."""
        return self.scale_dtype if self._cpu_f32() else self.dtype

    @property
    def body_len(self) -> int:
        """Tq, a multiple of G."""
        return self._vq.n

    @property
    def tail_len(self) -> int:
        """Tr."""
        return self._tk.n

    @property
    def length(self) -> int:
        """Tokens held: body plus tail."""
        return self.body_len + self.tail_len

    def body(self) -> tuple[torch.Tensor, ...]:
        """(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero) of the occupied body, the keys
        block-major (the module's docstring)."""
        return tuple(b.data for b in (self._kq, self._ks, self._kz, self._vq, self._vs, self._vz))

    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense tail K, V, (Hkv, Tr, D) each, newest last, as held (`tail_dtype`)."""
        return self._tk.data, self._tv.data

    @property
    def tail_dtype(self) -> torch.dtype:
        """The tail's dtype: the KV dtype on the CPU (f16 under auto), the model's on CUDA."""
        return self._tk.buf.dtype

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append (Hkv, T, D) post-RoPE keys and values, newest last, to the dense tail (rounded
        to its dtype, to nearest even)."""
        self._tk.append(k)
        self._tv.append(v)

    def flush(self, unit: int) -> int:
        """Quantize the oldest tail tokens, the largest multiple of `unit`, into the body; count."""
        if unit <= 0 or unit % self.G:
            raise ValueError(
                f"kivi: flush unit {unit} must be a positive multiple of group {self.G}"
            )
        n = self.tail_len // unit * unit
        if n == 0:
            return 0
        tk, tv = self.tail()
        tk, tv = tk[:, :n], tv[:, :n]
        if tk.dtype != self.dtype:  # the CPU's f16 tail: its values, quantized in fp32
            tk, tv = tk.float(), tv.float()
        # (Hkv, n/G, D, G*b/32), (Hkv, n/G, D) x2, (Hkv, n, D*b/32), (Hkv, n, D/G) x2; Triton on
        # CUDA, the native kernels on CPU (bit for bit the reference)
        if self.kernels is None:
            packed = kivi_pack(tk, tv, self.bits, self.G, self.scale_dtype)
        else:
            half = self.scale_dtype == torch.float16
            packed = self.kernels.kivi_pack(tk, tv, self.bits, self.G, half)
        for buf, x in zip(
            (self._kq, self._ks, self._kz, self._vq, self._vs, self._vz), packed, strict=True
        ):
            buf.append(x)
        self._tk.drop_front(n)
        self._tv.drop_front(n)
        return n

    def _mask(self, start: int, stop: int, Tq: int, n_new: int) -> torch.Tensor | None:
        """(Tq, stop - start) visibility of slots [start, stop): own token j seen by query i >= j."""
        own0 = self.length - n_new  # first own token's slot
        if n_new == 0 or stop <= own0:
            return None
        j = torch.arange(start, stop, device=self.device) - own0  # own index, < 0 for older
        i = torch.arange(Tq, device=self.device)
        return j[None, :] <= i[:, None]

    def partials(self, q: torch.Tensor, q_pos, n_new: int, window: int | None) -> list[Partial]:
        """[body partial (if any), tail partial]; n_new is 0 or Tq. KIVI holds no positions: q_pos
        and window are not read (callers mask a sliding window over `dequantized()`)."""
        Tq = q.shape[2]
        if n_new not in (0, Tq) or n_new > self.length:
            raise ValueError(f"kivi: n_new {n_new} must be 0 or Tq={Tq}, at most {self.length}")
        if self.kernels is not None and q.dtype == torch.float32:  # body and tail merged
            return kivi_native.partials(self.kernels, self, q, n_new)
        parts = []
        if self.body_len:
            parts.append(self._attend_body(q, n_new))
        tk, tv = (x.to(q.dtype) for x in self.tail())
        mask = self._mask(self.body_len, self.length, Tq, n_new)
        parts.append(segment_attention(q, tk[None], tv[None], mask))
        return parts

    def rooms(self) -> tuple[torch.Tensor, ...]:
        """The body's six buffers and the tail's two, room included: the native kernels read
        body_len and tail_len slots of them (no views made per call)."""
        return (
            self._kq.buf, self._ks.buf, self._kz.buf, self._vq.buf, self._vs.buf, self._vz.buf,
            self._tk.buf, self._tv.buf,
        )  # fmt: skip

    def rotate_append_attend(self, rope, q, k, v, pos: int) -> torch.Tensor:
        """A decode row at position `pos` on the native kernels: q and k (1, H, 1, D) rotated,
        k and v appended to the tail, q attending over the body and the tail, in one call
        (rope.apply, append and partials' arithmetic) -> (1, Hq, 1, D) float32."""
        tk, tv = self._tk, self._tv
        n = tk.n
        if n >= tk.buf.shape[1]:
            tk.reserve(n + 1)
            tv.reserve(n + 1)
        cos, ssin = rope.signed_tables(pos + 1)
        out = self.kernels.kivi_rope_append_attend(
            q, k, v, cos, ssin, pos, self._kq.buf, self._ks.buf, self._kz.buf, self._vq.buf,
            self._vs.buf, self._vz.buf, self._vq.n, tk.buf, tv.buf, n, self.bits, self.G,
            self.D**-0.5,
        )  # fmt: skip
        tk.n = tv.n = n + 1
        return out

    @property
    def end(self) -> int:
        """The tail's end."""
        return self.tail_len

    def room(self, n_more: int) -> None:
        """Room for the static steps to come: the tail never exceeds R between flushes."""
        self._tk.reserve(self.R + 1)
        self._tv.reserve(self.R + 1)

    def attend_static(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor
    ) -> list[Partial]:
        """StaticSegment's, `slot` in the tail; the body is read at its Python-known length
        (constant until the next flush)."""
        self._tk.write_at(slot, k[0])
        self._tv.write_at(slot, v[0])
        parts = [self._attend_body(q, 0)] if self.body_len else []
        lengths = (slot + 1).to(torch.int32)  # (B=1,) tail slots 0..slot
        tk, tv = (b.buf[None].to(q.dtype) for b in (self._tk, self._tv))  # CUDA: as held
        out, lse = dense_decode(q, tk, tv, lengths)
        return parts + [Partial(out, lse)]

    def advance(self) -> None:
        self._tk.advance()
        self._tv.advance()

    def static_key(self) -> tuple:
        """Buffer addresses and the body length."""
        bufs = (self._kq, self._ks, self._kz, self._vq, self._vs, self._vz, self._tk, self._tv)
        return (*(t.buf.data_ptr() for t in bufs), self.body_len)

    def _attend_body(self, q: torch.Tensor, n_new: int) -> Partial:
        """Body attention, dequantized inside the dot products (kernels.kivi_decode)."""
        own0 = self.length - n_new  # first own token's slot
        off = None if n_new == 0 or self.body_len <= own0 else own0
        return Partial(*kivi_decode(q, *self.body(), self.bits, self.G, off))

    def nbytes(self) -> int:
        """Occupied slots: packed codes, scales, zeros and the dense tail."""
        return sum(t.numel() * t.element_size() for t in (*self.body(), *self.tail()))

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(Hkv, length, D) fp32 K and V: the body dequantized, then the tail."""
        if self.kernels is not None:  # the same products, then sums, in C++
            k, v = self.kernels.kivi_dequant(*self.body(), self.bits, self.G, 0, self.body_len)
            k, v = k[0], v[0]  # (Hkv, Tq, D)
        else:
            kq, ks, kz, vq, vs, vz = self.body()
            kq, ks, kz = keys_by_channel(kq, ks, kz)
            k = dequantize(unpack(kq, self.bits), ks, kz, -1, self.G).transpose(1, 2)
            v = dequantize(unpack(vq, self.bits), vs, vz, -1, self.G)  # (Hkv, Tq, D)
        tk, tv = self.tail()
        return torch.cat([k, tk.float()], 1), torch.cat([v, tv.float()], 1)
