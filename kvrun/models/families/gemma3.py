"""Gemma 3: the embedding scaled by sqrt(dim), GeGLU (tanh), norms after attention and after
the MLP too (sandwich norms), per-head Q/K norms, local sliding-window layers beside global
ones with their own RoPE base, a softmax scale of its own (27B), soft-capped logits. Its HF
files hold RMSNorm weights w for a scale of 1 + w; a multimodal checkpoint's text model is
read, its vision tower skipped."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ...errors import UnsupportedModel
from ..fields import MAX_COUNT, Fields
from .family import Family

if TYPE_CHECKING:
    from ..config import ModelConfig

SWA_PATTERN = 6  # llama.cpp's default for Gemma 3: every 6th layer is global


def _shared(dim: int) -> dict:
    return dict(qk_norm=True, sandwich_norms=True, act="gelu_tanh", embed_scale=math.sqrt(dim))


def _gguf(f: Fields, seen: dict) -> dict:
    dim, n_heads, n_layers = seen["dim"], seen["n_heads"], seen["n_layers"]
    out = _shared(dim) | dict(
        # llama.cpp's rule: Gemma 3 27B scales by its query_pre_attn_scalar, dim / heads
        attn_scale=(dim / n_heads) ** -0.5 if n_layers == 62 else None,
        rope_local_theta=f.real("rope.freq_base_swa", 10000.0, positive=True),
    )
    if seen["window"]:
        pattern = f.get("attention.sliding_window_pattern", SWA_PATTERN)
        if isinstance(pattern, list):  # one flag per layer: local or not
            local = (i for i, x in enumerate(pattern[:n_layers]) if x)
        else:
            p = f.whole("attention.sliding_window_pattern", SWA_PATTERN, hi=MAX_COUNT)
            local = (i for i in range(n_layers) if i % p < p - 1)
        out["local_layers"] = tuple(local)
    return out


def _hf(f: Fields, seen: dict) -> dict:
    n_layers, head_dim = seen["n_layers"], seen["head_dim"]
    if f.get("attn_logit_softcapping"):
        raise UnsupportedModel("attention logit soft-capping (Gemma 2) is not supported")
    types = f.get("layer_types")
    if types is None:
        p_default = f.get("_sliding_window_pattern", 6)
        p = f.whole("sliding_window_pattern", p_default, hi=MAX_COUNT)
        types = ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(n_layers)]
    elif not isinstance(types, list):
        raise f.fail("layer_types", types, "a list of layer types")
    scalar = f.real("query_pre_attn_scalar", head_dim, positive=True)
    local_theta = f.get("rope_local_base_freq") or seen["local"].get("rope_theta")
    local_f = Fields({"rope_local_base_freq": local_theta or 10000.0}, f.where, nest=f.nest)
    out = _shared(seen["dim"]) | dict(
        sliding_window=f.get("sliding_window"),
        attn_scale=scalar**-0.5,
        local_layers=tuple(i for i, t in enumerate(types[:n_layers]) if t == "sliding_attention"),
        rope_local_theta=local_f.real("rope_local_base_freq", positive=True),
    )
    if out["attn_scale"] == head_dim**-0.5:
        out["attn_scale"] = None
    return out


def _out(c: ModelConfig) -> dict:
    scalar = c.head_dim if c.attn_scale is None else c.attn_scale**-2
    return dict(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=round(scalar, 6),
        sliding_window=c.sliding_window,
        layer_types=[
            "sliding_attention" if c.window(i) else "full_attention" for i in range(c.n_layers)
        ],
        rope_local_base_freq=c.rope_local_theta,
        attn_logit_softcapping=None,
    )


GEMMA3 = Family(
    arch="gemma3",
    # gemma3: Gemma3ForConditionalGeneration, whose text model's config is text_config
    hf_types=("gemma3_text", "gemma3"),
    hf_class="Gemma3ForCausalLM",
    hf_model_type="gemma3_text",
    hf_nested={"gemma3": "text_config"},
    hf_tied=True,
    block_parts={
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    norms_plus_one=True,
    text_names=(
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ),
    other_towers=(
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    ),
    spm_space_prefix=False,
    gguf_fields=_gguf,
    hf_fields=_hf,
    hf_out=_out,
)
