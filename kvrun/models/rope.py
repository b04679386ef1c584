"""Rotary position embeddings (rotate-half layout), with linear, Llama 3, YaRN and LongRoPE
scaling, partial rotary, and Gemma 3's two RoPEs (local and global layers)."""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inverse_frequencies(
    config: ModelConfig,
    rope_freqs: torch.Tensor | None = None,
    local: bool = False,
    long: bool = False,
) -> torch.Tensor:
    """Per-pair inverse frequencies (D/2,), float32, after the model's scaling.

    local: the local (sliding-window) layers' RoPE of Gemma 3: their own base, unscaled.
    long: LongRoPE's long factors (kvrun rotates with the short ones, as transformers does
    for sequences within the original context; see `Rope.magnitudes`).
    Partial rotary (Phi-4-mini): the pairs past `rotary_dim / 2` get frequency 0 (cos 1, sin
    0: they pass unrotated), and the model orders Q and K's head dims so those pairs are
    the trailing ones of each half (`rotary_order`).
    """
    d = config.head_dim
    rd = config.rotary_dim or d
    theta = config.rope_local_theta if local else config.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.int64).float() / rd))
    s = None if local else config.rope_scaling
    if rope_freqs is not None and not local:  # GGUF Llama 3.1+: precomputed divisors
        inv = inv / rope_freqs.float()
    elif s is not None:
        inv = _scaled(inv, s, rd, theta, long)
    return torch.cat([inv, inv.new_zeros((d - rd) // 2)])


def _scaled(inv: torch.Tensor, s, rd: int, theta: float, long: bool) -> torch.Tensor:
    if s.kind == "linear":
        return inv / s.factor
    if s.kind == "longrope":
        factors = s.long_factor if long else s.short_factor
        return inv / torch.tensor(factors, dtype=torch.float32)
    if s.kind == "yarn":
        # YaRN: long wavelengths interpolated (/ factor), short ones kept, a linear ramp over
        # the pairs between the two correction dims (transformers' rule, truncated bounds)
        def dim_of(rotations: float) -> float:
            return (
                rd
                * math.log(s.original_context / (rotations * 2 * math.pi))
                / (2 * math.log(theta))
            )

        low = max(math.floor(dim_of(s.beta_fast)), 0)
        high = min(math.ceil(dim_of(s.beta_slow)), rd - 1)
        high = high + 0.001 if low == high else high
        ramp = ((torch.arange(rd // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp
        return inv / s.factor * (1 - keep) + inv * keep
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


def magnitudes(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Per-pair factor on cos and sin (D/2,): YaRN's and LongRoPE's attention factor on the
    rotated pairs, 1 elsewhere (a pair that passes unrotated keeps cos 1)."""
    d, rd = config.head_dim, config.rotary_dim or config.head_dim
    s = None if local else config.rope_scaling
    mag = torch.ones(d // 2)
    if s is not None:
        mag[: rd // 2] = s.magnitude()
    return mag


def rotary_order(config: ModelConfig) -> torch.Tensor | None:
    """The order of Q and K's head dims under partial rotary (None: all dims rotate): HF
    rotates the first rotary_dim dims as halves (i, i + rd/2); kvrun's RoPE pairs (i, i +
    D/2), so the rotated halves go first in each half of the head and the others after them.
    Attention is a dot product over the head dims, so ordering Q and K alike changes nothing."""
    d, rd = config.head_dim, config.rotary_dim
    if rd is None or rd == d:
        return None
    h, rest = rd // 2, d - rd
    first = [*range(h), *range(rd, rd + rest // 2)]
    second = [*range(h, rd), *range(rd + rest // 2, d)]
    return torch.tensor(first + second)


class RopeSet:
    """Gemma 3's two RoPEs, one per kind of layer (local: its own base; global: the scaled
    one). Callers ask for a layer's (`at`); what covers every layer (`reserve`, `static_key`,
    the native kernels) goes to both."""

    def __init__(self, global_rope: Rope, local_rope: Rope, local_layers: tuple[int, ...]):
        self.ropes = (global_rope, local_rope)
        self.local = frozenset(local_layers)
        self.inv_freq = global_rope.inv_freq  # what `Transformer.state` keeps, with `local_inv`
        self.local_inv = local_rope.inv_freq

    def at(self, layer: int) -> Rope:
        return self.ropes[1] if layer in self.local else self.ropes[0]

    @property
    def kernels(self):
        return self.ropes[0].kernels

    @kernels.setter
    def kernels(self, k) -> None:
        for r in self.ropes:
            r.kernels = k

    def reserve(self, n: int) -> None:
        for r in self.ropes:
            r.reserve(n)

    def static_key(self) -> tuple:
        return self.ropes[0].static_key() + self.ropes[1].static_key()

    def position(self, positions: torch.Tensor) -> int:
        return self.ropes[0].position(positions)


class Rope:
    """Applies RoPE at given positions; tables grow on demand and live on the model's device."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype,
        magnitude: torch.Tensor | None = None,
    ):
        self.inv_freq = inv_freq.to(device)  # (D/2,) float32
        # (D/2,) the factor on cos and sin per pair (YaRN, LongRoPE); None: 1
        self.magnitude = None if magnitude is None else magnitude.float().to(device)
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
        cos, sin = ang.cos(), ang.sin()
        if self.magnitude is not None:
            cos, sin = cos * self.magnitude, sin * self.magnitude
        self._cos = torch.cat([cos, cos], dim=-1).to(self.dtype)  # (n, D)
        self._sin = torch.cat([sin, sin], dim=-1).to(self.dtype)
        # sin with the rotation's sign folded in: rotate_half(x) * sin = roll(x) * ssin
        self._ssin = torch.cat([-sin, sin], dim=-1).to(self.dtype)

    def at(self, layer: int) -> Rope:
        """The RoPE of layer `layer`: this one (Gemma 3's two are a RopeSet)."""
        return self

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
