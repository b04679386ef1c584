"""Qwen 2 / 2.5: Llama's blocks with biases on the Q, K and V products, NEOX-style RoPE."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import UnsupportedModel
from .family import Family

if TYPE_CHECKING:
    from ..fields import Fields


def _gguf(f: Fields, seen: dict) -> dict:
    # a GGUF read without its tensor names (a header alone) has them, as every Qwen 2 does
    return {"qkv_bias": "blk.0.attn_q.bias" in seen["names"] or not seen["names"]}


def _hf(f: Fields, seen: dict) -> dict:
    if f.get("use_sliding_window"):
        raise UnsupportedModel(f"{seen['model_type']} with use_sliding_window is not supported")
    return {"qkv_bias": True}


QWEN2 = Family(
    arch="qwen2",
    hf_types=("qwen2",),
    hf_class="Qwen2ForCausalLM",
    pre_tokenizers=dict.fromkeys(["qwen2", "deepseek-r1-qwen"], ("qwen2", False)),
    gguf_fields=_gguf,
    hf_fields=_hf,
)
