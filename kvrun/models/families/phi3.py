"""Phi-3 / 3.5 / 4-mini: Q, K, V and gate, up each fused into one weight in its files (HF
and GGUF alike; split at load, fused again by `kvrun convert`), LongRoPE (its factors are
GGUF tensors, read by kvrun/models/weights.py), partial rotary (Phi-4-mini turns 3/4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .family import Family

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..fields import Fields


def _gguf(f: Fields, seen: dict) -> dict:
    rot, head_dim = seen["rot"], seen["head_dim"]
    return {"rotary_dim": rot} if rot and rot < head_dim else {}


def _hf(f: Fields, seen: dict) -> dict:
    return {"sliding_window": f.get("sliding_window")}


def _out(c: ModelConfig) -> dict:
    return {"sliding_window": c.sliding_window}


PHI3 = Family(
    arch="phi3",
    hf_types=("phi3",),
    hf_class="Phi3ForCausalLM",
    block_parts={"ffn_up": "mlp.gate_up_proj"},  # gate and up in one weight
    fused={
        "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    },
    gguf_fields=_gguf,
    hf_fields=_hf,
    hf_out=_out,
)
