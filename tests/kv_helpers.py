"""Test-only views of KV stores (what attention sees) and the reference schedules of the specs;
none of this runs in kvrun itself."""

from __future__ import annotations

import torch

from kvrun.kernels.kivi_pack import pack_codes, quantize_groups
from kvrun.kv.methods.minicache.store import direction
from kvrun.kv.stores.kivi import KiviLayer


def restore(e: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """MiniCache Eq. 2: x_hat = e * n / ||e|| per row (fp32); e (..., m), norms (...)."""
    return direction(e) * norms.float().unsqueeze(-1)


def restored(kv, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A MiniCache layer's cache as attention sees it, (Hkv, T, D) fp32 K and V."""
    role = kv.role.get(layer)
    if role is None:
        st = kv.plain[layer]
        if isinstance(st, KiviLayer):
            return st.dequantized()
        return st.k[0].float(), st.v[0].float()
    pair, second, lay = kv.pairs[role[0]], role[1], kv.layout
    out_k = torch.zeros(lay.H, pair.length, lay.D, device=kv.device)
    out_v = torch.zeros_like(out_k)
    if pair.length:
        lay.restore_into(pair, second, lay.directions(pair), out_k, out_v)
    return out_k, out_v


def codebook_sizes(kv) -> list[tuple[int, int]]:
    """SpindleKV's (|C_K|, |C_V|) per layer (summed over heads with codebook_scope=head)."""
    return [(sum(b.n for b in st.books_k), sum(b.n for b in st.books_v)) for st in kv.layers]


def unfused(kv):
    """The cache's decode through the restore / rebuild path instead of its fused kernel."""
    kv._fuse = lambda *a: False
    return kv


def pyramid_budgets_compat(B: int, n: int, window: int, n_layers: int, beta: int) -> list[int]:
    """KVCache-Factory's integer schedule (the golden row of the PyramidKV spec)."""
    w, L = window, n_layers
    if n < B:
        return [n] * L
    min_num = (B - w) // beta
    max_num = 2 * (B - w) - min_num
    if max_num >= n - w:
        max_num = n - w
        min_num = 2 * (B - w) - max_num
    if n < 2 * (B - w):
        return [B] * L
    step = (max_num - min_num) // (L - 1)
    return [max_num - layer * step + w for layer in range(L)]


# --- KIVI's quantization as the public code writes it (kernels.kivi_pack is its mirror) ---
def quantize(
    x: torch.Tensor, bits: int, dim: int, group: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of groups of `group` consecutive elements along `dim`.

    Returns uint8 codes (x's shape) and scale, zero (x's shape with `dim` cut to n/group) in
    `dtype`. Scale and zero are rounded to `dtype` first and the codes computed from the
    rounded values (fp32, round half-to-even); a flat group gets code 0, so x_hat = z exactly.
    The arithmetic is kernels.kivi_pack's reference, which the Triton kernel matches bit
    for bit.
    """
    xt = x.movedim(dim, -1)
    if xt.shape[-1] % group:
        raise ValueError(
            f"kivi: length {xt.shape[-1]} along dim {dim} is not a multiple of group {group}"
        )
    codes, scale, zero = quantize_groups(xt, bits, group, dtype)
    return codes.to(torch.uint8).movedim(-1, dim), scale.movedim(-1, dim), zero.movedim(-1, dim)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes along the last dim into int32 words, 32/bits per word, first code lowest."""
    if codes.shape[-1] % (32 // bits):
        raise ValueError(f"kivi: cannot pack {codes.shape[-1]} codes into words of {32 // bits}")
    return pack_codes(codes, bits)
