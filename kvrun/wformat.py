"""Weight formats without torch: the --wtype names, the packed width each GGUF type maps to,
and the bytes a model's weights take under a --wtype (what `kvrun info` shows before any
tensor is read). kvrun.quant builds the packed tensors these formulas count."""

from __future__ import annotations

import re
from collections import Counter
from math import prod

# elements per scale/zero: llama.cpp's block size for Q4_0/Q4_1/Q8_0 and Q4_K's sub-blocks
GROUP = 32
WTYPES = ("auto", "f32", "f16", "bf16", "q8", "q4")
DENSE_NAMES = ("f32", "f16", "bf16")
EXACT_Q4 = ("Q4_0", "Q4_1", "Q4_K")
EXACT_Q8 = ("Q8_0",)
# bits per weight of the GGUF types that are re-quantized: <= 4.5 go to q4, the rest to q8
_TYPE_BITS = {
    "Q2_K": 2.6, "Q3_K": 3.4, "IQ2_XXS": 2.1, "IQ2_XS": 2.3, "IQ2_S": 2.5, "IQ3_XXS": 3.1,
    "IQ3_S": 3.4, "IQ1_S": 1.6, "IQ1_M": 1.8, "IQ4_NL": 4.5, "IQ4_XS": 4.3, "TQ1_0": 1.7,
    "TQ2_0": 2.1, "Q5_0": 5.5, "Q5_1": 6.0, "Q5_K": 5.5, "Q6_K": 6.6, "Q8_K": 8.1,
}  # fmt: skip

_LINEAR = re.compile(r"(_proj|lm_head|embed_tokens)\.weight$")  # the weights that may be packed
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def nearest_bits(type_name: str) -> int:
    """The packed width a GGUF type maps to (4 for Q4 types and below, else 8)."""
    if type_name in EXACT_Q4:
        return 4
    if type_name in EXACT_Q8:
        return 8
    return 4 if _TYPE_BITS.get(type_name, 8.0) <= 4.5 else 8


def target_bits(wtype: str, source: str, name: str) -> int | None:
    """The width a weight is packed to under a resolved --wtype (None: kept dense).

    'packed' (what auto resolves to on a GGUF) keeps each quantized tensor at its nearest
    width and float tensors dense. 'q4' and 'q8' pack every linear weight and the embeddings
    to at most that many bits: q4 re-quantizes wider tensors, q8 keeps 4-bit ones as they are
    (widening them would cost memory and give the same values).
    """
    if not _LINEAR.search(name) or wtype in DENSE_NAMES:
        return None
    native = None if source in FLOAT_TYPES else nearest_bits(source)
    if wtype == "packed":
        return native
    return 4 if wtype == "q4" else min(8, native or 8)


def packed_nbytes(bits: int, n: int, k: int, scale_bytes: int, symmetric: bool) -> int:
    """Bytes of a Packed of this shape (what `Packed.nbytes` will measure)."""
    groups = n * (k // GROUP)
    return n * k * bits // 8 + groups * scale_bytes * (1 if symmetric else 2)


def plan_nbytes(type_name: str, n: int, k: int, bits: int, planes: bool = False) -> int:
    """Bytes a GGUF tensor of type_name takes once packed to `bits` (for `kvrun info`).

    planes: held in the CPU int4 planes (kvrun/int4mm.py): the same code bytes, bfloat16
    scales and zeros (4 bytes per group and plane), and the float16 ones only where the
    mapping is exact (kept for exact prefill products)."""
    base = _canonical_nbytes(type_name, n, k, bits)
    if not planes:
        return base
    codes = n * k * bits // 8
    exact = type_name in EXACT_Q4 or (type_name in EXACT_Q8 and bits == 8)
    return codes + n * (k // GROUP) * 4 * (bits // 4) + (base - codes if exact else 0)


def _canonical_nbytes(type_name: str, n: int, k: int, bits: int) -> int:
    if type_name == "Q8_0" and bits == 8:
        return packed_nbytes(8, n, k, 2, True)
    if type_name in ("Q4_0", "Q4_1"):
        return packed_nbytes(bits, n, k, 2, False)
    if type_name == "Q4_K":
        return packed_nbytes(bits, n, k, 4, False)
    if bits == 8:  # quantize() makes symmetric q8, requantize_bits keeps q4's zero
        return packed_nbytes(8, n, k, 2, True)
    return packed_nbytes(4, n, k, 2, False)


def weights_plan(
    tensors: list[tuple[str, str, tuple[int, ...]]],
    wtype: str,
    planes: bool = False,
    tied: bool = True,
) -> tuple[int, Counter]:
    """Bytes the weights take in memory under a resolved --wtype, and a count per form
    ('q4 from Q4_1', 'f32', ...), from (hf name, source type, torch shape) triples.

    Dense tensors count at the named width (f32 for 'packed', 'q4', 'q8'), as loaded on CPU.
    planes: packed matrices sit in the CPU int4 planes where their shape allows (whole
    64-row blocks), except an untied embedding table, which only gathers rows.
    """
    elem = {"f16": 2, "bf16": 2}.get(wtype, 4)
    total, forms = 0, Counter()
    for hf, source, shape in tensors:
        bits = target_bits(wtype, source, hf) if len(shape) == 2 else None
        if bits is None:
            total += prod(shape) * elem
            forms[wtype if wtype in DENSE_NAMES else "f32"] += 1
            continue
        src = source if source not in FLOAT_TYPES else "F32"
        on_planes = planes and shape[0] % 64 == 0 and (tied or "embed_tokens" not in hf)
        total += plan_nbytes(src, shape[0], shape[1], bits, on_planes)
        forms[f"q{bits} from {source}"] += 1
    return total, forms
