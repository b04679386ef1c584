"""A dense segment of one layer: K (post-RoPE) and V in the KV dtype, slots in position order."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import Partial, position_mask, segment_attention


class DenseSeg:
    """K/V slots per KV head, with optional positions (int32) and accumulated scores (fp32).

    pos_rows: 0 = no positions held, 1 = one row shared by all heads (streaming),
    Hkv = one row per head (per-head eviction).
    """

    def __init__(
        self,
        n_kv: int,
        head_dim: int,
        dtype,
        device,
        pos_rows: int = 0,
        scores: bool = False,
        score_rows: int | None = None,
    ):
        self.k = torch.empty(1, n_kv, 0, head_dim, dtype=dtype, device=device)  # (1, Hkv, T, D)
        self.v = torch.empty_like(self.k)  # (1, Hkv, T, D)
        self.pos = torch.empty(pos_rows, 0, dtype=torch.int32, device=device) if pos_rows else None
        # (Hkv or score_rows, T) fp32 accumulated attention (H2O, MiniKV; MiniKV's gqa_agg=max
        # keeps one row per query head)
        self.acc = torch.empty(score_rows or n_kv, 0, device=device) if scores else None

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Add new tokens (1, Hkv, T, D) at the end; positions (T,)."""
        self.k = torch.cat([self.k, k], dim=2)
        self.v = torch.cat([self.v, v], dim=2)
        if self.pos is not None:
            new = positions.to(torch.int32).expand(self.pos.shape[0], -1)
            self.pos = torch.cat([self.pos, new], dim=1)
        if self.acc is not None:
            self.acc = torch.cat(
                [self.acc, self.acc.new_zeros(self.acc.shape[0], k.shape[2])], dim=1
            )

    def keep(self, idx: torch.Tensor) -> None:
        """Keep slots idx (Hkv, T') or (1, T') (same for every head), ascending."""
        Hkv, D = self.k.shape[1], self.k.shape[3]
        full = idx.expand(Hkv, -1)
        gather = full[None, :, :, None].expand(1, Hkv, full.shape[1], D)
        self.k = torch.gather(self.k, 2, gather)
        self.v = torch.gather(self.v, 2, gather)
        if self.pos is not None:
            self.pos = torch.gather(self.pos, 1, idx.expand(self.pos.shape[0], -1))
        if self.acc is not None:
            rows = full.repeat_interleave(len(self.acc) // Hkv, dim=0)  # per query head rows
            self.acc = torch.gather(self.acc, 1, rows)

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove and return all K, V (1, Hkv, T, D)."""
        k, v = self.k, self.v
        self.k, self.v = k[:, :, :0], v[:, :, :0]
        if self.pos is not None:
            self.pos = self.pos[:, :0]
        if self.acc is not None:
            self.acc = self.acc[:, :0]
        return k, v

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

    def attend(
        self, q: torch.Tensor, q_pos: torch.Tensor, n_new: int, window: int | None
    ) -> torch.Tensor:
        """Fast path when this is the only segment: SDPA, output in the KV dtype."""
        m = self.mask(q_pos, n_new, window)
        if m is not None and m.dim() == 3:  # per-KV-head mask -> per query head
            m = m.repeat_interleave(q.shape[1] // self.k.shape[1], dim=0)
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=m, enable_gqa=True)

    def partial(
        self, q: torch.Tensor, q_pos: torch.Tensor, n_new: int, window: int | None
    ) -> Partial:
        """Output and log-sum-exp, for combining with other segments."""
        return segment_attention(q, self.k, self.v, self.mask(q_pos, n_new, window))

    def nbytes(self, count_pos: bool) -> int:
        n = self.k.numel() * self.k.element_size() * 2
        if self.pos is not None and count_pos:
            n += self.pos.numel() * 4
        if self.acc is not None:
            n += self.acc.numel() * 4
        return n
