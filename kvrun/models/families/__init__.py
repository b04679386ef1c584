"""Model families: what kvrun knows of each, one file per family and one line in FAMILIES.

A family says how its files name things (GGUF architecture, HF model_type and class, tensor
names, fused tensors, pre-tokenizers) and which ModelConfig fields its metadata sets; the one
decoder (kvrun/models/model.py) then reads those fields, never the family's name. Adding one
is docs/adding-a-family.md.
"""

from __future__ import annotations

from typing import Any

from ...errors import UnsupportedModel
from . import gemma3, llama, phi3, qwen2, qwen3
from .family import Family

# arch -> family, in the order error messages list them; a new family is one more entry
FAMILIES: dict[str, Family] = {
    f.arch: f
    for f in (llama.LLAMA, llama.MISTRAL, qwen2.QWEN2, qwen3.QWEN3, gemma3.GEMMA3, phi3.PHI3)
}


def family(arch: str) -> Family:
    """The family of a ModelConfig.arch."""
    try:
        return FAMILIES[arch]
    except KeyError:
        raise UnsupportedModel(f"architecture {arch!r:.40} is not a kvrun family") from None


def from_gguf_arch(arch: Any) -> Family:
    """The family a GGUF's general.architecture names, else UnsupportedModel."""
    if isinstance(arch, str) and arch in FAMILIES:
        return FAMILIES[arch]
    raise UnsupportedModel(
        f"architecture {arch!r:.40} is not supported (kvrun runs: {', '.join(FAMILIES)})"
    )


def from_hf_type(model_type: str) -> Family | None:
    """The family an HF model_type names (None: none does)."""
    return next((f for f in FAMILIES.values() if model_type in f.hf_types), None)


def hf_types() -> list[str]:
    """Every HF model_type kvrun reads."""
    return [t for f in FAMILIES.values() for t in f.hf_types]


def pre_tokenizer(pre: str) -> tuple[str, bool] | None:
    """(regex set, ignore_merges) of a family's tokenizer.ggml.pre (None: no family's)."""
    return next((f.pre_tokenizers[pre] for f in FAMILIES.values() if pre in f.pre_tokenizers), None)
