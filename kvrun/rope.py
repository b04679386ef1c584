"""Rotary position embeddings (rotate-half layout), with linear and Llama-3 scaling."""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inverse_frequencies(
    config: ModelConfig, rope_freqs: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-pair inverse frequencies (D/2,), float32, after the model's scaling."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if rope_freqs is not None:  # GGUF Llama 3.1+: precomputed divisors
        return inv / rope_freqs.float()
    s = config.rope_scaling
    if s is None:
        return inv
    if s.kind == "linear":
        return inv / s.factor
    # llama3: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between
    low_wavelen = s.original_context / s.low_freq_factor
    high_wavelen = s.original_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_context / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rope:
    """Applies RoPE at given positions; tables grow on demand and live on the model's device."""

    def __init__(self, inv_freq: torch.Tensor, device: torch.device, dtype: torch.dtype):
        self.inv_freq = inv_freq.to(device)  # (D/2,) float32
        self.dtype = dtype
        self._cos = torch.empty(0, inv_freq.numel() * 2, device=device, dtype=dtype)
        self._sin = self._ssin = self._cos
        # the rows of the last positions tensor asked for: every layer of a forward pass
        # passes the same (fresh) tensor, so rows are gathered once a pass, not twice a layer
        self._last: tuple[torch.Tensor, ...] | None = None
        # the native CPU step kernels of a model whose products run natively: decode rows
        # rotate in one op, and KV stores attend with them (kernels/cpu/qstep.h); else None
        self.kernels = None
        self._last_pos: tuple[torch.Tensor, int] | None = None  # `position`'s last answer

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self._cos.shape[0], 256)
        pos = torch.arange(n, device=self.inv_freq.device, dtype=torch.float32)
        ang = pos[:, None] * self.inv_freq[None, :]  # (n, D/2)
        emb = torch.cat([ang, ang], dim=-1)  # (n, D)
        self._cos, self._sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        # sin with the rotation's sign folded in: rotate_half(x) * sin = roll(x) * ssin
        self._ssin = torch.cat([-ang.sin(), ang.sin()], dim=-1).to(self.dtype)

    def reserve(self, n: int) -> None:
        """Tables for positions 0..n-1, built now (a captured CUDA graph cannot grow them)."""
        if n > self._cos.shape[0]:
            self._grow(n)

    def static_key(self) -> tuple:
        """What a captured step depends on: the tables' addresses (they move when they grow)."""
        return (self._cos.data_ptr(), self._sin.data_ptr(), self._ssin.data_ptr())

    def tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos, sin tables (>= n, D), covering positions below n, for kernels that
        read rows by position themselves (kernels.codebook_decode)."""
        self.reserve(n)
        return self._cos, self._sin

    def signed_tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos and signed-sin tables (>= n, D), covering positions below n (the
        native step kernels read a row by position themselves)."""
        self.reserve(n)
        return self._cos, self._ssin

    def position(self, positions: torch.Tensor) -> int:
        """The one position of a decode row's positions tensor (1,), read once per tensor:
        every layer of a forward pass passes the same one."""
        last = self._last_pos
        if last is not None and last[0] is positions:
            return last[1]
        pos = int(positions)
        self._last_pos = (positions, pos)
        return pos

    def cos_sin(
        self, positions: torch.Tensor, bound: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin tables (T, D) for integer positions (T,).

        `bound`: the caller's promise that every position is below it, so the tables are
        sized without reading the positions back from the device (no host sync: the static
        decode step of a CUDA graph passes its capacity).
        """
        return self._rows(positions, bound)[:2]

    def _rows(self, positions: torch.Tensor, bound: int | None) -> tuple[torch.Tensor, ...]:
        """cos, sin and signed sin rows (T, D) at positions, gathered once per positions tensor."""
        last = self._last
        if bound is None and last is not None and last[0] is positions:
            return last[1:]
        if bound is not None:
            self.reserve(bound)
        elif positions.numel() and int(positions.max()) >= self._cos.shape[0]:
            self._grow(int(positions.max()) + 1)
        rows = self._cos[positions], self._sin[positions], self._ssin[positions]
        # static steps (bound given) rewrite their positions tensor in place: never cached
        self._last = (positions, *rows) if bound is None else None
        return rows

    def apply_rows(self, x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """Rotate x (B, H, T, D) where row b has its own positions: flat (B * T,) is the
        (B, T) positions flattened (pass the same tensor for q and k: its rows are gathered
        once). The same arithmetic as `apply`, element for element."""
        cos, _, ssin = self._rows(flat, None)
        B, _, T, D = x.shape
        if self._native(x):
            return self.kernels.rope(x, cos.view(B, T, D), ssin.view(B, T, D))
        cos, ssin = cos.view(B, 1, T, D), ssin.view(B, 1, T, D)
        rolled = torch.roll(x, D // 2, dims=-1)
        return torch.addcmul(x * cos, rolled, ssin)

    def apply(
        self, x: torch.Tensor, positions: torch.Tensor, bound: int | None = None
    ) -> torch.Tensor:
        """Rotate x (B, H, T, D) at positions (T,) (`bound` as in cos_sin)."""
        cos, _, ssin = self._rows(positions, bound)
        if self._native(x):
            return self.kernels.rope(x, cos.unsqueeze(0), ssin.unsqueeze(0))
        rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)  # (x2, x1): rotate_half(x) * sin
        return torch.addcmul(x * cos, rolled, ssin)

    def _native(self, x: torch.Tensor) -> bool:
        """Decode rows (one token each) of float32 on CPU, where native kernels are set."""
        return (
            self.kernels is not None
            and x.shape[2] == 1
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.stride(-1) == 1
        )
