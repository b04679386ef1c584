"""Llama (1, 2, 3.x), SmolLM and Mistral: the blocks every other family starts from.

llama.cpp keeps Q and K rows permuted for its interleaved-pair RoPE and files Mistral as
"llama" (its sliding window marks it); Mistral's own GGUF architecture name reads the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .family import Family

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..fields import Fields


def _window_hf(f: Fields, seen: dict) -> dict:
    return {"sliding_window": f.get("sliding_window")}


def _window_out(c: ModelConfig) -> dict:
    return {"sliding_window": c.sliding_window}


LLAMA = Family(
    arch="llama",
    hf_types=("llama",),
    hf_class="LlamaForCausalLM",
    windowed="mistral",
    permuted_qk=True,
    pre_tokenizers={
        **dict.fromkeys(["llama3", "llama-v3", "llama-bpe"], ("llama3", True)),  # Llama 3
        "smollm": ("digits", False),  # SmolLM: digits one by one
    },
)
MISTRAL = Family(
    arch="mistral",
    hf_types=("mistral",),
    hf_class="MistralForCausalLM",
    gguf_writes="llama",
    permuted_qk=True,
    pre_tokenizers={"tekken": ("tekken", True)},  # Mistral Nemo's
    hf_fields=_window_hf,
    hf_out=_window_out,
)
