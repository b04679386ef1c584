"""The growable buffer every KV store keeps its tensors in (mlx-lm's caches grow the same way)."""

from __future__ import annotations

import torch

MIN_ROOM = 64  # slots allocated at least, once anything is appended


class Buffer:
    """A tensor with room along `dim`, its first `n` slots occupied (only they count as bytes)."""

    __slots__ = ("buf", "dim", "n")

    def __init__(self, shape: tuple[int, ...], dim: int, dtype, device, reserve: int = 0):
        shape = list(shape)
        shape[dim] = reserve
        self.buf = torch.empty(shape, dtype=dtype, device=device)
        self.dim, self.n = dim, 0

    @property
    def data(self) -> torch.Tensor:
        """The occupied slots (a view)."""
        return self.buf.narrow(self.dim, 0, self.n)

    @property
    def capacity(self) -> int:
        return self.buf.shape[self.dim]

    def reserve(self, n: int) -> None:
        """Room for n slots; capacity at least doubles, so appends copy O(1) per slot amortised."""
        cap = self.capacity
        if n <= cap:
            return
        shape = list(self.buf.shape)
        shape[self.dim] = max(n, 2 * cap, MIN_ROOM)
        new = self.buf.new_empty(shape)
        new.narrow(self.dim, 0, self.n).copy_(self.data)
        self.buf = new

    def append(self, x: torch.Tensor) -> None:
        """x after the occupied slots (x matches the buffer outside `dim`)."""
        end = self.n + x.shape[self.dim]
        self.reserve(end)
        self.buf.narrow(self.dim, self.n, x.shape[self.dim]).copy_(x)
        self.n = end

    def replace(self, x: torch.Tensor) -> None:
        """x becomes the contents (a selection's gathered slots); no spare room is kept."""
        self.buf, self.n = x, x.shape[self.dim]

    def clear(self) -> None:
        """Empty, with a fresh zero-room buffer (the old one may still be referenced)."""
        shape = list(self.buf.shape)
        shape[self.dim] = 0
        self.buf, self.n = self.buf.new_empty(shape), 0

    def rewind(self) -> None:
        """Empty, keeping the room (and the address a captured CUDA graph reads)."""
        self.n = 0

    def drop_front(self, n: int) -> None:
        """Drop the first n occupied slots, moving the rest to the front (KIVI's tail, flushed)."""
        rest = self.n - n
        self.buf.narrow(self.dim, 0, rest).copy_(self.buf.narrow(self.dim, n, rest).clone())
        self.n = rest

    def write_at(self, slot: torch.Tensor, x: torch.Tensor) -> None:
        """x (one slot) at the slot a (1,) device tensor names, in the room: no host sync (x
        rounded to the buffer's dtype where it differs: a CPU KIVI tail's f16)."""
        self.buf.index_copy_(self.dim, slot, x.to(self.buf.dtype))

    def advance(self, n: int = 1) -> None:
        self.n += n

    def nbytes(self) -> int:
        """Bytes of the occupied slots (counted without a view: caches report every step)."""
        shape = self.buf.shape
        per_slot = (
            self.buf.numel() // shape[self.dim] if shape[self.dim] else _slot_elems(shape, self.dim)
        )
        return self.n * per_slot * self.buf.element_size()


def _slot_elems(shape, dim: int) -> int:
    n = 1
    for i, d in enumerate(shape):
        if i != dim:
            n *= d
    return n
