"""ModelConfig: the canonical description of a model, built from GGUF or HF.

One decoder runs every family: Llama, Mistral (and SmolLM), Qwen 2 / 2.5 (q/k/v biases), Qwen 3
(q/k norms), Gemma 3 (scaled embedding, GeGLU, sandwich norms, q/k norms, local sliding-window
layers beside global ones with their own RoPE base, soft-capped logits) and Phi-3 / 3.5 / 4-mini
(fused q/k/v and gate/up in the files, LongRoPE, partial rotary). The fields below say which
of these a model has; the forward pass reads them, never the family's name.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import KvrunError, UnsupportedModel

# GGUF `general.architecture` values and HF `model_type`s that run on our forward pass.
GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")
HF_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",  # Gemma3ForConditionalGeneration: its text model (text_config)
    "phi3": "phi3",
}
HF_CLASSES = {  # arch -> the transformers class `kvrun convert` writes
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# llama.cpp stores Q and K rows of these families permuted for interleaved-pair RoPE; the
# others (NEOX-style RoPE, as HF) keep HF's row order
PERMUTED_QK = ("llama", "mistral")
GEMMA_SWA_PATTERN = 6  # llama.cpp's default for Gemma 3: every 6th layer is global


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling: 'linear' (position interpolation), 'llama3', 'yarn' (Qwen 2.5's
    long context) or 'longrope' (Phi-3's LongRoPE, 'su': per-pair short and long factors)."""

    kind: str  # "linear" | "llama3" | "yarn" | "longrope"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn / longrope: cos and sin scale (None: derived)
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()  # longrope

    def magnitude(self) -> float:
        """The factor YaRN and LongRoPE multiply cos and sin by (1 for the others)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.kind == "yarn" and self.factor > 1:
            return 0.1 * math.log(self.factor) + 1.0
        if self.kind == "longrope" and self.factor > 1:
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_context))
        return 1.0

    def to_hf(self) -> dict:
        """This scaling as HF's `rope_scaling`."""
        orig = {"original_max_position_embeddings": self.original_context}
        fields = {
            "linear": {"factor": self.factor},
            "llama3": {
                "factor": self.factor,
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                **orig,
            },
            "yarn": {
                "factor": self.factor,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
                **orig,
            },
            "longrope": {
                "short_factor": list(self.short_factor),
                "long_factor": list(self.long_factor),
                **orig,
            },
        }[self.kind]
        out = {"rope_type": self.kind, **fields}
        if self.attention_factor is not None:
            out["attention_factor"] = self.attention_factor
        return out


def _scaling_from_hf(src: dict, max_pos: int) -> RopeScaling | None:
    """RopeScaling from an HF `rope_scaling` / `rope_parameters` dict (None: plain RoPE)."""
    kind = src.get("rope_type", src.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(src["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(src["factor"]),
            float(src["low_freq_factor"]),
            float(src["high_freq_factor"]),
            int(src["original_max_position_embeddings"]),
        )
    if kind == "yarn":
        orig = int(src.get("original_max_position_embeddings") or max_pos)
        attn = src.get("attention_factor")
        return RopeScaling(
            "yarn",
            float(src.get("factor") or max_pos / orig),
            original_context=orig,
            beta_fast=float(src.get("beta_fast") or 32.0),
            beta_slow=float(src.get("beta_slow") or 1.0),
            attention_factor=float(attn) if attn is not None else None,
        )
    if kind in ("longrope", "su"):
        orig = int(src["original_max_position_embeddings"])
        attn = src.get("attention_factor")
        return RopeScaling(
            "longrope",
            float(src.get("factor") or max_pos / orig),
            original_context=orig,
            attention_factor=float(attn) if attn is not None else None,
            short_factor=tuple(float(f) for f in src["short_factor"]),
            long_factor=tuple(float(f) for f in src["long_factor"]),
        )
    raise UnsupportedModel(
        f"RoPE scaling {kind!r} is not supported (linear, llama3, yarn, longrope)"
    )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and hyper-parameters of one model; every field is what the forward pass needs."""

    arch: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma3" | "phi3"
    n_layers: int
    dim: int  # hidden size
    n_heads: int  # query heads
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    sliding_window: int | None = None  # Mistral: a query sees the last `sliding_window` keys
    tie_embeddings: bool = False
    context_length: int = 4096
    name: str = ""
    # what the families beside Llama add (all off for Llama / Mistral)
    qkv_bias: bool = False  # Qwen 2: biases on the Q, K and V products
    qk_norm: bool = False  # Qwen 3, Gemma 3: RMSNorm over each head of Q and K before RoPE
    sandwich_norms: bool = False  # Gemma 3: norms after attention and after the MLP too
    act: str = "silu"  # the gate's activation: "silu" | "gelu_tanh" (Gemma)
    embed_scale: float = 1.0  # Gemma: the embedding times sqrt(dim)
    attn_scale: float | None = None  # softmax scale (None: 1/sqrt(head_dim)); Gemma 3's own
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    # the layers whose attention is local (a window of `sliding_window` keys); None: all
    # layers alike (Mistral's window, or none). Gemma 3: 5 local layers to 1 global.
    local_layers: tuple[int, ...] | None = None
    rope_local_theta: float | None = None  # the local layers' RoPE base (unscaled)
    rotary_dim: int | None = None  # the head dims RoPE turns (None: all; Phi-4-mini 3/4)

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.n_heads // self.n_kv_heads

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it sees every key before it)."""
        if self.local_layers is not None and layer not in self.local_layers:
            return None
        return self.sliding_window

    @property
    def any_window(self) -> bool:
        """Whether any layer attends over a sliding window."""
        return bool(self.sliding_window) and (self.local_layers is None or bool(self.local_layers))

    def features(self) -> list[str]:
        """What this model adds to Llama's blocks, in words (`kvrun info`)."""
        out = []
        if self.qkv_bias:
            out.append("q/k/v biases")
        if self.qk_norm:
            out.append("q/k norms")
        if self.sandwich_norms:
            out.append("norms after attention and MLP")
        if self.act == "gelu_tanh":
            out.append("GeGLU (tanh)")
        if self.embed_scale != 1.0:
            out.append(f"embedding x {self.embed_scale:.4g}")
        if self.attn_scale is not None:
            out.append(f"softmax scale {self.attn_scale:.4g}")
        if self.final_softcap is not None:
            out.append(f"logits soft-capped at {self.final_softcap:g}")
        if self.local_layers is not None and self.sliding_window:
            n = len(self.local_layers)
            out.append(
                f"{n} local layers (window {self.sliding_window}, RoPE base "
                f"{self.rope_local_theta:g}) + {self.n_layers - n} global"
            )
        if self.rotary_dim is not None:
            out.append(f"partial rotary {self.rotary_dim}/{self.head_dim}")
        return out

    @property
    def gemma_norms(self) -> bool:
        """Whether the HF files keep RMSNorm weights as w for a scale of (1 + w) (Gemma); kvrun,
        as llama.cpp's files, holds 1 + w."""
        return self.arch == "gemma3"

    def kv_bytes_per_token(self, elem_bytes: int = 2) -> int:
        """Bytes one token occupies in a full (uncompressed) K+V cache over all layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * elem_bytes

    def n_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.ffn_dim
        norms = (4 if self.sandwich_norms else 2) * self.dim + (
            2 * self.head_dim if self.qk_norm else 0
        )
        bias = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim if self.qkv_bias else 0
        per_layer = attn + mlp + norms + bias
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * per_layer + self.vocab_size * self.dim + head + self.dim

    # ----------------------------------------------------------------- GGUF
    @classmethod
    def from_gguf(
        cls, meta: Mapping[str, Any], *, has_output: bool, names: Collection[str] = ()
    ) -> ModelConfig:
        """Build from GGUF metadata (`{key: field.contents()}`); `names`: the file's tensor
        names (which norms and biases a block has)."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHS:
            raise UnsupportedModel(
                f"architecture {arch!r} is not supported (kvrun runs: {', '.join(GGUF_ARCHS)})"
            )

        def get(key, default=None):
            return meta.get(f"{arch}.{key}", default)

        try:
            n_heads = int(get("attention.head_count"))
            dim = int(get("embedding_length"))
            rot = get("rope.dimension_count")
            head_dim = int(
                get("attention.key_length")
                or (rot if arch in PERMUTED_QK else None)
                or dim // n_heads
            )
            n_kv = int(get("attention.head_count_kv") or n_heads)
            vocab = int(get("vocab_size") or len(meta["tokenizer.ggml.tokens"]))
            n_layers = int(get("block_count"))
            cfg = dict(
                arch=arch,
                n_layers=n_layers,
                dim=dim,
                n_heads=n_heads,
                n_kv_heads=n_kv,
                head_dim=head_dim,
                ffn_dim=int(get("feed_forward_length")),
                vocab_size=vocab,
            )
        except (TypeError, KeyError) as e:
            raise KvrunError(f"GGUF metadata is incomplete for {arch!r}: missing {e}") from None
        scaling = None
        kind = get("rope.scaling.type")
        factor = get("rope.scaling.factor")
        if kind == "linear" and factor:
            scaling = RopeScaling("linear", float(factor))
        elif kind == "yarn" and factor:
            attn = get("rope.scaling.attn_factor")
            scaling = RopeScaling(
                "yarn",
                float(factor),
                original_context=int(get("rope.scaling.original_context_length")),
                beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
                attention_factor=float(attn) if attn is not None else None,
            )
        # Llama 3.1+ GGUFs carry the llama3 scaling as a `rope_freqs` tensor instead, Phi-3 its
        # LongRoPE factors as `rope_factors_long` / `rope_factors_short`: the loader reads those
        # (`with_rope_factors`) and the model divides its frequencies by them.
        window = get("attention.sliding_window")
        extra: dict[str, Any] = {}
        if arch == "qwen2":
            extra["qkv_bias"] = "blk.0.attn_q.bias" in names or not names
        if "blk.0.attn_q_norm.weight" in names:
            extra["qk_norm"] = True
        if arch == "phi3" and rot and int(rot) < head_dim:
            extra["rotary_dim"] = int(rot)
        if arch == "gemma3":
            extra.update(
                qk_norm=True,
                sandwich_norms=True,
                act="gelu_tanh",
                embed_scale=math.sqrt(dim),
                # llama.cpp's rule: Gemma 3 27B scales by its query_pre_attn_scalar, dim / heads
                attn_scale=(dim / n_heads) ** -0.5 if n_layers == 62 else None,
                rope_local_theta=float(get("rope.freq_base_swa", 10000.0)),
            )
            if window:
                pattern = get("attention.sliding_window_pattern", GEMMA_SWA_PATTERN)
                if isinstance(pattern, list):  # one flag per layer: local or not
                    extra["local_layers"] = tuple(i for i, f in enumerate(pattern) if f)
                else:
                    p = int(pattern)
                    extra["local_layers"] = tuple(i for i in range(n_layers) if i % p < p - 1)
        cap = get("final_logit_softcapping")
        if cap:
            extra["final_softcap"] = float(cap)
        return cls(
            **cfg,
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            sliding_window=int(window) if window else None,
            tie_embeddings=not has_output,
            context_length=int(get("context_length", 4096)),
            name=str(meta.get("general.name", "")),
            **extra,
        )

    def with_rope_factors(self, meta: Mapping[str, Any], long: list, short: list) -> ModelConfig:
        """Phi-3's LongRoPE from a GGUF's `rope_factors_long` / `_short` tensors and its
        metadata (the original context and the attention factor)."""
        orig = meta.get(f"{self.arch}.rope.scaling.original_context_length", self.context_length)
        attn = meta.get(f"{self.arch}.rope.scaling.attn_factor")
        return self.replace(
            rope_scaling=RopeScaling(
                "longrope",
                self.context_length / int(orig),
                original_context=int(orig),
                attention_factor=float(attn) if attn is not None else None,
                short_factor=tuple(float(f) for f in short),
                long_factor=tuple(float(f) for f in long),
            )
        )

    # ------------------------------------------------------------------- HF
    @classmethod
    def from_hf(cls, config_path: str | Path) -> ModelConfig:
        """Build from an HF `config.json`."""
        try:
            c = json.loads(Path(config_path).read_text())
        except (OSError, ValueError) as e:
            raise KvrunError(f"cannot read {config_path}: {e}") from None
        model_type = c.get("model_type")
        if model_type not in HF_TYPES:
            archs = c.get("architectures") or [model_type]
            have = ", ".join(HF_CLASSES.values())
            raise UnsupportedModel(
                f"architecture {archs[0]!r} is not supported (kvrun runs: {have})"
            )
        if model_type == "gemma3":  # the multimodal checkpoint: its text model's config
            c = {**c.get("text_config", {}), "model_type": "gemma3_text"}
        arch = HF_TYPES[model_type]
        n_heads = c["num_attention_heads"]
        dim = c["hidden_size"]
        max_pos = int(c.get("max_position_embeddings", 4096))
        rope = c.get("rope_parameters") or {}
        full = rope.get("full_attention", rope)  # Gemma 3: one entry per layer type
        local = rope.get("sliding_attention")
        scaling_src = c.get("rope_scaling") or full
        if (
            "original_max_position_embeddings" in c
            and "original_max_position_embeddings" not in scaling_src
        ):
            scaling_src = {
                **scaling_src,
                "original_max_position_embeddings": c["original_max_position_embeddings"],
            }
        theta = c.get("rope_theta", full.get("rope_theta", 10000.0))
        scaling = _scaling_from_hf(scaling_src, max_pos)
        head_dim = c.get("head_dim") or dim // n_heads
        extra: dict[str, Any] = {}
        partial = c.get("partial_rotary_factor", full.get("partial_rotary_factor", 1.0))
        if partial and float(partial) < 1.0:
            extra["rotary_dim"] = int(head_dim * float(partial)) // 2 * 2
        window = None
        if arch == "mistral" or arch == "phi3":
            window = c.get("sliding_window")
        elif arch in ("qwen2", "qwen3") and c.get("use_sliding_window"):
            raise UnsupportedModel(f"{model_type} with use_sliding_window is not supported")
        if arch == "qwen2":
            extra["qkv_bias"] = True
        if arch == "qwen3":
            if c.get("attention_bias"):
                raise UnsupportedModel("a Qwen 3 model with attention biases is not supported")
            extra["qk_norm"] = True
        if arch == "gemma3":
            if c.get("attn_logit_softcapping"):
                raise UnsupportedModel("attention logit soft-capping (Gemma 2) is not supported")
            window = c.get("sliding_window")
            types = c.get("layer_types")
            if types is None:
                p = int(c.get("sliding_window_pattern", c.get("_sliding_window_pattern", 6)))
                types = [
                    "sliding_attention" if (i + 1) % p else "full_attention"
                    for i in range(c["num_hidden_layers"])
                ]
            extra.update(
                qk_norm=True,
                sandwich_norms=True,
                act="gelu_tanh",
                embed_scale=math.sqrt(dim),
                attn_scale=float(c.get("query_pre_attn_scalar", head_dim)) ** -0.5,
                local_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
                rope_local_theta=float(
                    c.get("rope_local_base_freq", (local or {}).get("rope_theta", 10000.0))
                ),
            )
            if extra["attn_scale"] == head_dim**-0.5:
                extra["attn_scale"] = None
        if c.get("final_logit_softcapping"):
            extra["final_softcap"] = float(c["final_logit_softcapping"])
        return cls(
            arch=arch,
            n_layers=c["num_hidden_layers"],
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=c.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            ffn_dim=c["intermediate_size"],
            vocab_size=c["vocab_size"],
            rope_theta=float(theta),
            rope_scaling=scaling,
            norm_eps=float(c.get("rms_norm_eps", 1e-5)),
            sliding_window=int(window) if window else None,
            tie_embeddings=bool(c.get("tie_word_embeddings", arch == "gemma3")),
            context_length=max_pos,
            name=c.get("_name_or_path", "") or Path(config_path).parent.name,
            **extra,
        )

    def to_hf(self, bos_id: int | None = None, eos_id: int | None = None) -> dict:
        """An HF config.json dict for this model (used by `kvrun convert`)."""
        out = {
            "architectures": [HF_CLASSES[self.arch]],
            "model_type": "gemma3_text" if self.arch == "gemma3" else self.arch,
            "hidden_size": self.dim,
            "intermediate_size": self.ffn_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.context_length,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "gelu_pytorch_tanh" if self.act == "gelu_tanh" else "silu",
            "torch_dtype": "float32",
            "pad_token_id": None,  # Phi-3's config class defaults it to 32000, past small vocabularies
        }
        if self.arch in ("mistral", "phi3"):
            out["sliding_window"] = self.sliding_window
        if self.rotary_dim is not None:
            out["partial_rotary_factor"] = self.rotary_dim / self.head_dim
        if self.arch == "qwen3":
            out["attention_bias"] = False
        if self.arch == "gemma3":
            scalar = self.head_dim if self.attn_scale is None else self.attn_scale**-2
            out.update(
                hidden_activation="gelu_pytorch_tanh",
                query_pre_attn_scalar=round(scalar, 6),
                sliding_window=self.sliding_window,
                layer_types=[
                    "sliding_attention" if self.window(i) else "full_attention"
                    for i in range(self.n_layers)
                ],
                rope_local_base_freq=self.rope_local_theta,
                attn_logit_softcapping=None,
            )
        if self.final_softcap is not None:
            out["final_logit_softcapping"] = self.final_softcap
        if self.rope_scaling is not None:
            out["rope_scaling"] = self.rope_scaling.to_hf()
            if self.rope_scaling.kind == "longrope":  # Phi-3 reads it at the top level
                out["original_max_position_embeddings"] = self.rope_scaling.original_context
        if bos_id is not None:
            out["bos_token_id"] = bos_id
        if eos_id is not None:
            out["eos_token_id"] = eos_id
        return out

    def replace(self, **kw) -> ModelConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """How tokens are drawn (llama.cpp's flags and defaults; kvrun/sampling.py draws)."""

    temp: float = 0.8
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1.0 = off
    min_p: float = 0.05  # 0.0 = off
    repeat_penalty: float = 1.0  # 1.0 = off
    repeat_last_n: int = 64  # 0 = off, -1 = whole context
