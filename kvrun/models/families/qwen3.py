"""Qwen 3: Llama's blocks with an RMSNorm over each head of Q and K before RoPE (its GGUFs
name those norms, which the shared reader sees); NEOX-style RoPE; Qwen 2's pre-tokenizer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import UnsupportedModel
from .family import Family

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..fields import Fields


def _hf(f: Fields, seen: dict) -> dict:
    if f.get("use_sliding_window"):
        raise UnsupportedModel(f"{seen['model_type']} with use_sliding_window is not supported")
    if f.get("attention_bias"):
        raise UnsupportedModel("a Qwen 3 model with attention biases is not supported")
    return {"qk_norm": True}


def _out(c: ModelConfig) -> dict:
    return {"attention_bias": False}


QWEN3 = Family(
    arch="qwen3",
    hf_types=("qwen3",),
    hf_class="Qwen3ForCausalLM",
    hf_fields=_hf,
    hf_out=_out,
)
