"""Synthetic models: random weights of real model shapes (the shape presets), for speed and
memory measurements.

`-m llama3-8b-synthetic` builds a Llama-3-8B-shaped model straight on the target device in
the compute dtype (never a float32 copy on the CPU first). Its output means nothing; every
number measured on it is labelled synthetic. kvrun.run.runtime.preset_runtime assembles the
Runtime from these parts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import KvrunError
from ..quant import hardware
from ..quant.formats import GROUP
from ..quant.packed import Packed
from .config import ModelConfig

INIT_STD = 0.02  # small normal init: activations stay finite through 32 layers in bf16


def weight_bytes(
    config: ModelConfig, dtype: torch.dtype, bits: int | None, planes: bool = False
) -> int:
    """Bytes of the preset's weights: dense in dtype, or matrices packed (codes plus a float16
    scale, and for q4 a zero, per group of 32) with the norms in dtype. planes: the matrices
    that multiply sit in the CPU int4 planes instead, with their bfloat16 scales and zeros
    (4 bytes per group and 4-bit plane, kvrun/quant/int4mm.py) in place of the float16 ones
    (random weights have nothing to be exact against); an untied embedding table only
    gathers, so it stays as it was."""
    elem = torch.empty(0, dtype=dtype).element_size()
    if bits is None:
        return config.n_params() * elem
    norms = (2 * config.n_layers + 1) * config.dim
    mats = config.n_params() - norms
    per_group = 2 if bits == 8 else 4
    total = norms * elem + mats * bits // 8 + mats // GROUP * per_group
    if planes:
        gather_only = 0 if config.tie_embeddings else config.vocab_size * config.dim
        total += (mats - gather_only) // GROUP * (4 * (bits // 4) - per_group)
    return total


def check_fits(
    spec: str,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    bits: int | None = None,
) -> None:
    """Refuse, in one line, a preset whose weights exceed the memory free on the device."""
    elem = torch.empty(0, dtype=dtype).element_size()
    need = weight_bytes(config, dtype, bits)
    free = hardware.available_bytes(device)
    if free is None or need <= free:
        return
    dt = f"q{bits}" if bits else str(dtype).removeprefix("torch.")
    hints = ["a smaller preset (tiny-synthetic)"]
    if bits != 4:
        hints.append("--wtype q4")
    if elem > 2 and bits is None:
        hints.append("--dtype bfloat16")
    if device.type != "cuda":
        hints.append("a GPU (--device cuda)")
    tries = hints[0] if len(hints) == 1 else ", ".join(hints[:-1]) + " or " + hints[-1]
    raise KvrunError(
        f"{spec} needs {need / 2**30:.1f} GiB of weights in {dt} but only "
        f"{free / 2**30:.1f} GiB is free on {device}; try {tries}"
    )


class SyntheticTokenizer:
    """Stands in for the tokenizer of a random-weight model: ids only, no text.

    `kvrun bench` never tokenizes; anything that does gets a clear error instead of a crash.
    """

    bos_id = eos_id = None
    stop_ids: frozenset[int] = frozenset()
    add_bos = add_eos = False
    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        raise KvrunError(
            "a synthetic model has random weights and no tokenizer; use it with `kvrun bench`"
        )

    def render_chat(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        return self.encode("")  # raises the same one-line error

    def decode(self, ids, skip_special: bool = False) -> str:
        return "".join(f"[{int(i)}]" for i in ids)

    def token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else f"[{int(token_id)}]"

    def stream(self, skip_special: bool = False, after: int | None = None):
        from .tokenizer import StreamDecoder

        return StreamDecoder(self, skip_special, after)


def random_weights(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    bits: int | None = None,
) -> dict[str, torch.Tensor | Packed]:
    """A canonical state dict of random tensors, each made on `device` in `dtype` directly;
    with bits, every matrix is made packed (random codes), never as floats."""
    from .model import Transformer

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(config).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        if bits is not None and len(shape) == 2:
            out[name] = random_packed(tuple(shape), bits, device, gen)
            if progress:
                progress(i + 1, len(shapes))
            continue
        t = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, INIT_STD, generator=gen)
        out[name] = t
        if progress:
            progress(i + 1, len(shapes))
    return out


def random_packed(shape: tuple[int, int], bits: int, device, gen) -> Packed:
    """A packed (N, K) matrix of uniform random codes whose weights have std ~INIT_STD and
    mean ~0 (one fp16 scale, and for q4 a zero, per group of 32)."""
    n, k = shape
    groups = (n, k // GROUP)
    # random bytes drawn 8 at a time (one 64-bit draw each: 4x faster than a draw per byte,
    # ~4 s of an 8B preset's load instead of ~16)
    nbytes = n * k // (2 if bits == 4 else 1)  # a multiple of 16: k is of the group
    raw = torch.randint(-(2**63), 2**63 - 1, (nbytes // 8,), device=device, generator=gen)
    if bits == 4:  # codes 0..15: std 4.61 steps, centred by zero = -7.5 steps
        scale = torch.full(groups, INIT_STD / 4.61, dtype=torch.float16, device=device)
        codes = raw.view(torch.uint8).view(n, k // 2)
        return Packed(4, codes, scale, scale * -7.5, source="random", exact=False)
    scale = torch.full(groups, INIT_STD / 73.9, dtype=torch.float16, device=device)  # -128..127
    return Packed(8, raw.view(torch.int8).view(n, k), scale, None, source="random", exact=False)


def is_synthetic(rt) -> bool:
    """True for a Runtime built from a shape preset."""
    return getattr(rt.weights, "format", "") == "synthetic"
