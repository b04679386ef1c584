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


# GGUF types the native kernels read in the 8-row interleaved layout, and its bytes per
# 8 rows and block (kernels/cpu/qlayout.h); other types stay as the file lays them out
X8_BYTES = {
    "Q4_0": 144, "IQ4_NL": 144, "Q4_1": 160, "Q5_0": 176, "Q5_1": 192, "Q8_0": 272,
    "Q4_K": 1184, "Q5_K": 1440, "Q6_K": 1680, "IQ4_XS": 1104,
}  # fmt: skip
# (elements, bytes) per block of the quantized types (gguf.GGML_QUANT_SIZES, without torch)
BLOCK_SIZES = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q8_1": (32, 36), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144),
    "Q5_K": (256, 176), "Q6_K": (256, 210), "Q8_K": (256, 292), "IQ2_XXS": (256, 66),
    "IQ2_XS": (256, 74), "IQ3_XXS": (256, 98), "IQ1_S": (256, 50), "IQ4_NL": (32, 18),
    "IQ3_S": (256, 110), "IQ2_S": (256, 82), "IQ4_XS": (256, 136), "IQ1_M": (256, 56),
    "TQ1_0": (256, 54), "TQ2_0": (256, 66), "MXFP4": (32, 17),
}  # fmt: skip


def holds_blocks(wtype: str, source: str, name: str, native: bool) -> bool:
    """Whether a GGUF tensor is held as its own blocks (kvrun/quant/blocks.py) under a
    resolved --wtype. 'packed' keeps every quantized linear weight and embedding in its GGUF
    type: all of them where the native kernels run; without them, the types PyTorch's int4
    op cannot hold exactly (all but Q4_0, Q4_1, Q4_K and Q8_0, which keep the int4 path)."""
    if wtype != "packed" or source in FLOAT_TYPES or not _LINEAR.search(name):
        return False
    return native or source not in EXACT_Q4 + EXACT_Q8


def blocks_nbytes(source: str, n: int, k: int, interleaved: bool) -> int:
    """Bytes of a GGUF tensor held as blocks: interleaved (whole groups of 8 rows, where the
    native kernels have a layout for its type), else as the file stores them."""
    elems, size = BLOCK_SIZES.get(source, (32, 34))
    if interleaved and source in X8_BYTES:
        return -(-n // 8) * (k // elems) * X8_BYTES[source]
    return n * (k // elems) * size


def packed_nbytes(bits: int, n: int, k: int, scale_bytes: int, symmetric: bool) -> int:
    """Bytes of a Packed of this shape (what `Packed.nbytes` will measure)."""
    groups = n * (k // GROUP)
    return n * k * bits // 8 + groups * scale_bytes * (1 if symmetric else 2)


def plan_nbytes(type_name: str, n: int, k: int, bits: int, planes: bool = False) -> int:
    """Bytes a GGUF tensor of type_name takes once packed to `bits` (for `kvrun info`).

    planes: held in the CPU int4 planes (kvrun/quant/int4mm.py): the same code bytes, bfloat16
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
    native: bool = False,
) -> tuple[int, Counter]:
    """Bytes the weights take in memory under a resolved --wtype, and a count per form
    ('Q4_1 blocks', 'q4 from Q4_1', 'f32', ...), from (hf name, source type, torch shape)
    triples.

    Dense tensors count at the named width (f32 for 'packed', 'q4', 'q8'), as loaded on CPU.
    native: the native kernels run here (`holds_blocks`). planes: packed matrices sit in the
    CPU int4 planes where their shape allows (whole 64-row blocks), except an untied
    embedding table, which only gathers rows.
    """
    elem = {"f16": 2, "bf16": 2}.get(wtype, 4)
    total, forms = 0, Counter()
    for hf, source, shape in tensors:
        if len(shape) == 2 and holds_blocks(wtype, source, hf, native):
            # an untied embedding table only gathers rows: it stays as the file lays it out
            x8 = native and source in X8_BYTES and (tied or "embed_tokens" not in hf)
            total += blocks_nbytes(source, shape[0], shape[1], x8)
            layout = "interleaved" if x8 else "as in the file"
            forms[f"{source} blocks, {layout}"] += 1
            continue
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
