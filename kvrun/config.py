"""ModelConfig: the canonical description of a Llama-family model, built from GGUF or HF."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import KvrunError, UnsupportedModel

# GGUF `general.architecture` values and HF `model_type`s that run on our Llama forward pass.
GGUF_ARCHS = ("llama", "mistral")
HF_TYPES = {"llama": "llama", "mistral": "mistral"}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling: 'linear' (position interpolation) or 'llama3'."""

    kind: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and hyper-parameters of one model; every field is what the forward pass needs."""

    arch: str  # "llama" | "mistral"
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

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, elem_bytes: int = 2) -> int:
        """Bytes one token occupies in a full (uncompressed) K+V cache over all layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * elem_bytes

    def n_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attn + mlp + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * per_layer + self.vocab_size * self.dim + head + self.dim

    # ----------------------------------------------------------------- GGUF
    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], *, has_output: bool) -> ModelConfig:
        """Build from GGUF metadata (`{key: field.contents()}`)."""
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
            head_dim = int(
                get("attention.key_length") or get("rope.dimension_count") or dim // n_heads
            )
            n_kv = int(get("attention.head_count_kv") or n_heads)
            vocab = int(get("vocab_size") or len(meta["tokenizer.ggml.tokens"]))
            cfg = dict(
                arch=arch,
                n_layers=int(get("block_count")),
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
        if kind == "linear" and get("rope.scaling.factor"):
            scaling = RopeScaling("linear", float(get("rope.scaling.factor")))
        # Llama 3.1+ GGUFs carry the llama3 scaling as a `rope_freqs` tensor instead; the
        # loader keeps it in the state dict and the model divides its frequencies by it.
        window = get("attention.sliding_window")
        return cls(
            **cfg,
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            sliding_window=int(window) if window else None,
            tie_embeddings=not has_output,
            context_length=int(get("context_length", 4096)),
            name=str(meta.get("general.name", "")),
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
            raise UnsupportedModel(
                f"architecture {archs[0]!r} is not supported (kvrun runs: LlamaForCausalLM, MistralForCausalLM)"
            )
        n_heads = c["num_attention_heads"]
        rope = c.get("rope_parameters") or {}
        scaling_src = c.get("rope_scaling") or rope
        theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
        kind = scaling_src.get("rope_type", scaling_src.get("type", "default"))
        scaling = None
        if kind == "linear":
            scaling = RopeScaling("linear", float(scaling_src["factor"]))
        elif kind == "llama3":
            scaling = RopeScaling(
                "llama3",
                float(scaling_src["factor"]),
                float(scaling_src["low_freq_factor"]),
                float(scaling_src["high_freq_factor"]),
                int(scaling_src["original_max_position_embeddings"]),
            )
        elif kind not in ("default", None):
            raise UnsupportedModel(f"RoPE scaling {kind!r} is not supported (linear, llama3)")
        window = c.get("sliding_window") if model_type == "mistral" else None
        return cls(
            arch=HF_TYPES[model_type],
            n_layers=c["num_hidden_layers"],
            dim=c["hidden_size"],
            n_heads=n_heads,
            n_kv_heads=c.get("num_key_value_heads") or n_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
            ffn_dim=c["intermediate_size"],
            vocab_size=c["vocab_size"],
            rope_theta=float(theta),
            rope_scaling=scaling,
            norm_eps=float(c.get("rms_norm_eps", 1e-5)),
            sliding_window=int(window) if window else None,
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            context_length=int(c.get("max_position_embeddings", 4096)),
            name=c.get("_name_or_path", "") or Path(config_path).parent.name,
        )

    def to_hf(self, bos_id: int | None = None, eos_id: int | None = None) -> dict:
        """An HF config.json dict for this model (used by `kvrun convert`)."""
        arch = "MistralForCausalLM" if self.arch == "mistral" else "LlamaForCausalLM"
        out = {
            "architectures": [arch],
            "model_type": self.arch,
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
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.arch == "mistral":
            out["sliding_window"] = self.sliding_window
        if self.rope_scaling is not None:
            s = self.rope_scaling
            out["rope_scaling"] = (
                {"rope_type": "linear", "factor": s.factor}
                if s.kind == "linear"
                else {
                    "rope_type": "llama3",
                    "factor": s.factor,
                    "low_freq_factor": s.low_freq_factor,
                    "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_context,
                }
            )
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
