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

from ..errors import KvrunError, UnsupportedModel

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


_MAX_COUNT = 1 << 16  # layers and heads: no model comes near
_MAX_SIZE = 1 << 24  # widths, head sizes and vocabularies
_MAX_CONTEXT = 1 << 31  # contexts and windows
_UNSET = object()


class _Fields:
    """Checked reads of a model's metadata: a GGUF's keys (`prefix`: its architecture's) or a
    config.json's fields. A value of the wrong type or out of range is a one-line error that
    names the file and the field."""

    def __init__(self, src: Mapping[str, Any], where: str, prefix: str = "", nest: str = ""):
        # prefix: part of every key (GGUF's); nest: where src lies in its file (for messages)
        self.src, self.where, self.prefix, self.nest = src, where, prefix, nest

    def get(self, key: str, default: Any = None) -> Any:
        return self.src.get(self.prefix + key, default)

    def inner(self, key: str) -> _Fields:
        """The object field `key`, as fields of their own."""
        return _Fields(self.table(key), self.where, nest=f"{self.nest}{key}.")

    def fail(self, key: str, value: Any, want: str) -> KvrunError:
        shown = "missing" if value is None else f"{value!r:.40}"
        return KvrunError(f"{self.where}: {self.nest}{self.prefix}{key} is {shown}, not {want}")

    def whole(
        self, key: str, default: Any = None, lo: int = 1, hi: int = _MAX_SIZE, value: Any = _UNSET
    ) -> int:
        """An integer field (or `value`, a fallback standing for it) within [lo, hi]."""
        v = self.get(key, default) if value is _UNSET else value
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self.fail(key, v, f"a whole number from {lo:,} to {hi:,}")
        return v

    def real(
        self, key: str, default: Any = None, lo: float = -math.inf, positive: bool = False
    ) -> float:
        """A finite number field, >= lo (> 0 where positive)."""
        v = self.get(key, default)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e300
        if not ok or v < lo or (positive and v <= 0):
            raise self.fail(key, v, "a positive number" if positive else f"a number >= {lo}")
        return float(v)

    def reals(self, key: str) -> tuple[float, ...]:
        """A list of finite numbers (LongRoPE's factors)."""
        v = self.get(key)
        if not isinstance(v, list):
            raise self.fail(key, v, "a list of numbers")
        return tuple(
            _Fields({key: x}, self.where, nest=self.nest).real(key, positive=True) for x in v
        )

    def table(self, key: str) -> dict:
        """An object field ({} when absent or null)."""
        v = self.get(key)
        if v is not None and not isinstance(v, dict):
            raise self.fail(key, v, "an object")
        return v or {}


def _scaling_from_hf(f: _Fields, max_pos: int) -> RopeScaling | None:
    """RopeScaling from an HF `rope_scaling` / `rope_parameters` dict (None: plain RoPE)."""
    kind = f.get("rope_type", f.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind == "linear":
        return RopeScaling("linear", f.real("factor", positive=True))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            f.real("factor", positive=True),
            f.real("low_freq_factor", positive=True),
            f.real("high_freq_factor", positive=True),
            f.whole("original_max_position_embeddings", hi=_MAX_CONTEXT),
        )
    if kind == "yarn":
        orig_value = f.get("original_max_position_embeddings") or max_pos
        orig = f.whole("original_max_position_embeddings", hi=_MAX_CONTEXT, value=orig_value)
        return RopeScaling(
            "yarn",
            f.real("factor", positive=True) if f.get("factor") else max_pos / orig,
            original_context=orig,
            beta_fast=f.real("beta_fast", 32.0) if f.get("beta_fast") else 32.0,
            beta_slow=f.real("beta_slow", 1.0) if f.get("beta_slow") else 1.0,
            attention_factor=_optional(f, "attention_factor"),
        )
    if kind in ("longrope", "su"):
        orig = f.whole("original_max_position_embeddings", hi=_MAX_CONTEXT)
        return RopeScaling(
            "longrope",
            f.real("factor", positive=True) if f.get("factor") else max_pos / orig,
            original_context=orig,
            attention_factor=_optional(f, "attention_factor"),
            short_factor=f.reals("short_factor"),
            long_factor=f.reals("long_factor"),
        )
    raise UnsupportedModel(
        f"RoPE scaling {kind!r:.40} is not supported (linear, llama3, yarn, longrope)"
    )


def _optional(f: _Fields, key: str) -> float | None:
    return None if f.get(key) is None else f.real(key, positive=True)


def _checked(cfg: ModelConfig, where: str) -> ModelConfig:
    """What the forward pass needs of a config's shapes, else a one-line error."""
    if cfg.n_heads % cfg.n_kv_heads:
        raise KvrunError(
            f"{where}: {cfg.n_heads} query heads do not share {cfg.n_kv_heads} KV heads evenly"
        )
    if cfg.head_dim % 2:
        raise KvrunError(f"{where}: the head size {cfg.head_dim} is odd (RoPE turns pairs)")
    rd = cfg.rotary_dim
    if rd is not None and not (2 <= rd <= cfg.head_dim and rd % 2 == 0):
        raise KvrunError(f"{where}: {rd} rotary dims do not fit heads of {cfg.head_dim}")
    s, pairs = cfg.rope_scaling, (rd or cfg.head_dim) // 2
    if (
        s is not None
        and s.kind == "longrope"
        and {len(s.short_factor), len(s.long_factor)} != {pairs}
    ):
        raise KvrunError(
            f"{where}: LongRoPE has {len(s.short_factor)} short and {len(s.long_factor)} long "
            f"factors for {pairs} rotary pairs"
        )
    return cfg


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
        cls,
        meta: Mapping[str, Any],
        *,
        has_output: bool,
        names: Collection[str] = (),
        where: str = "the GGUF",
    ) -> ModelConfig:
        """Build from GGUF metadata (`{key: field.contents()}`); `names`: the file's tensor
        names (which norms and biases a block has); `where`: the file, for errors."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHS:
            raise UnsupportedModel(
                f"architecture {arch!r:.40} is not supported (kvrun runs: {', '.join(GGUF_ARCHS)})"
            )
        f = _Fields(meta, where, f"{arch}.")
        get = f.get
        n_heads = f.whole("attention.head_count", hi=_MAX_COUNT)
        dim = f.whole("embedding_length")
        rot = get("rope.dimension_count")
        rot = None if rot is None else f.whole("rope.dimension_count")
        key_length = get("attention.key_length") or (rot if arch in PERMUTED_QK else None)
        head_dim = f.whole("attention.key_length", value=key_length or dim // n_heads)
        n_kv_value = get("attention.head_count_kv") or n_heads
        n_kv = f.whole("attention.head_count_kv", hi=_MAX_COUNT, value=n_kv_value)
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab_value = get("vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
        vocab = f.whole("vocab_size", value=vocab_value)
        n_layers = f.whole("block_count", hi=_MAX_COUNT)
        cfg = dict(
            arch=arch,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            ffn_dim=f.whole("feed_forward_length"),
            vocab_size=vocab,
        )
        scaling = None
        kind = get("rope.scaling.type")
        factor = get("rope.scaling.factor")
        if kind == "linear" and factor:
            scaling = RopeScaling("linear", f.real("rope.scaling.factor", positive=True))
        elif kind == "yarn" and factor:
            scaling = RopeScaling(
                "yarn",
                f.real("rope.scaling.factor", positive=True),
                original_context=f.whole("rope.scaling.original_context_length", hi=_MAX_CONTEXT),
                beta_fast=f.real("rope.scaling.yarn_beta_fast", 32.0),
                beta_slow=f.real("rope.scaling.yarn_beta_slow", 1.0),
                attention_factor=_optional(f, "rope.scaling.attn_factor"),
            )
        # Llama 3.1+ GGUFs carry the llama3 scaling as a `rope_freqs` tensor instead, Phi-3 its
        # LongRoPE factors as `rope_factors_long` / `rope_factors_short`: the loader reads those
        # (`with_rope_factors`) and the model divides its frequencies by them.
        window = get("attention.sliding_window")
        window = f.whole("attention.sliding_window", hi=_MAX_CONTEXT) if window else None
        extra: dict[str, Any] = {}
        if arch == "qwen2":
            extra["qkv_bias"] = "blk.0.attn_q.bias" in names or not names
        if "blk.0.attn_q_norm.weight" in names:
            extra["qk_norm"] = True
        if arch == "phi3" and rot and rot < head_dim:
            extra["rotary_dim"] = rot
        if arch == "gemma3":
            extra.update(
                qk_norm=True,
                sandwich_norms=True,
                act="gelu_tanh",
                embed_scale=math.sqrt(dim),
                # llama.cpp's rule: Gemma 3 27B scales by its query_pre_attn_scalar, dim / heads
                attn_scale=(dim / n_heads) ** -0.5 if n_layers == 62 else None,
                rope_local_theta=f.real("rope.freq_base_swa", 10000.0, positive=True),
            )
            if window:
                pattern = get("attention.sliding_window_pattern", GEMMA_SWA_PATTERN)
                if isinstance(pattern, list):  # one flag per layer: local or not
                    local = (i for i, x in enumerate(pattern[:n_layers]) if x)
                else:
                    p = f.whole(
                        "attention.sliding_window_pattern", GEMMA_SWA_PATTERN, hi=_MAX_COUNT
                    )
                    local = (i for i in range(n_layers) if i % p < p - 1)
                extra["local_layers"] = tuple(local)
        if get("final_logit_softcapping"):
            extra["final_softcap"] = f.real("final_logit_softcapping", positive=True)
        config = cls(
            **cfg,
            rope_theta=f.real("rope.freq_base", 10000.0, positive=True),
            rope_scaling=scaling,
            norm_eps=f.real("attention.layer_norm_rms_epsilon", 1e-5, lo=0.0),
            sliding_window=window,
            tie_embeddings=not has_output,
            context_length=f.whole("context_length", 4096, hi=_MAX_CONTEXT),
            name=str(meta.get("general.name", ""))[:200],
            **extra,
        )
        return _checked(config, where)

    def with_rope_factors(
        self, meta: Mapping[str, Any], long: list, short: list, where: str = "the GGUF"
    ) -> ModelConfig:
        """Phi-3's LongRoPE from a GGUF's `rope_factors_long` / `_short` tensors and its
        metadata (the original context and the attention factor)."""
        f = _Fields(meta, where, f"{self.arch}.")
        orig = f.whole("rope.scaling.original_context_length", self.context_length, hi=_MAX_CONTEXT)
        config = self.replace(
            rope_scaling=RopeScaling(
                "longrope",
                self.context_length / orig,
                original_context=orig,
                attention_factor=_optional(f, "rope.scaling.attn_factor"),
                short_factor=tuple(float(x) for x in short),
                long_factor=tuple(float(x) for x in long),
            )
        )
        return _checked(config, where)

    # ------------------------------------------------------------------- HF
    @classmethod
    def from_hf(cls, config_path: str | Path) -> ModelConfig:
        """Build from an HF `config.json`."""
        try:
            c = json.loads(Path(config_path).read_text())
        except (OSError, ValueError) as e:
            raise KvrunError(f"cannot read {config_path}: {e}") from None
        where = str(config_path)
        if not isinstance(c, dict):
            raise KvrunError(f"{where} holds a JSON {type(c).__name__}, not an object")
        model_type = c.get("model_type")
        if not isinstance(model_type, str):
            raise KvrunError(
                f"{where}: model_type is {'missing' if model_type is None else repr(model_type)}"
                f", not a model type (kvrun runs: {', '.join(HF_TYPES)})"[:300]
            )
        if model_type not in HF_TYPES:
            archs = c.get("architectures")
            name = archs[0] if isinstance(archs, list) and archs else model_type
            have = ", ".join(HF_CLASSES.values())
            raise UnsupportedModel(
                f"architecture {name!r:.60} is not supported (kvrun runs: {have})"
            )
        f = _Fields(c, where)
        if model_type == "gemma3":  # the multimodal checkpoint: its text model's config
            c = {**f.table("text_config"), "model_type": "gemma3_text"}
            f = _Fields(c, where, nest="text_config.")
        arch = HF_TYPES[model_type]
        n_heads = f.whole("num_attention_heads", hi=_MAX_COUNT)
        dim = f.whole("hidden_size")
        n_layers = f.whole("num_hidden_layers", hi=_MAX_COUNT)
        max_pos = f.whole("max_position_embeddings", 4096, hi=_MAX_CONTEXT)
        rope = f.inner("rope_parameters")
        full = rope.inner("full_attention") if "full_attention" in rope.src else rope  # Gemma 3
        local = rope.table("sliding_attention")
        scaling = f.inner("rope_scaling")
        scaling = scaling if scaling.src else full
        orig = "original_max_position_embeddings"
        if orig in c and orig not in scaling.src:
            scaling = _Fields({**scaling.src, orig: c[orig]}, where, nest=scaling.nest)
        theta_f = f if c.get("rope_theta") is not None else full  # newer files: in rope_parameters
        theta = theta_f.real("rope_theta", 10000.0, positive=True)
        scaling = _scaling_from_hf(scaling, max_pos)
        head_value = f.get("head_dim") or dim // n_heads
        head_dim = f.whole("head_dim", value=head_value)
        extra: dict[str, Any] = {}
        partial_f = f if c.get("partial_rotary_factor") is not None else full
        if partial_f.get("partial_rotary_factor"):  # absent, null or 0: every head dim turns
            partial = partial_f.real("partial_rotary_factor", positive=True)
            if partial < 1.0:
                extra["rotary_dim"] = int(head_dim * partial) // 2 * 2
        window = None
        if arch == "mistral" or arch == "phi3":
            window = f.get("sliding_window")
        elif arch in ("qwen2", "qwen3") and f.get("use_sliding_window"):
            raise UnsupportedModel(f"{model_type} with use_sliding_window is not supported")
        if arch == "qwen2":
            extra["qkv_bias"] = True
        if arch == "qwen3":
            if f.get("attention_bias"):
                raise UnsupportedModel("a Qwen 3 model with attention biases is not supported")
            extra["qk_norm"] = True
        if arch == "gemma3":
            if f.get("attn_logit_softcapping"):
                raise UnsupportedModel("attention logit soft-capping (Gemma 2) is not supported")
            window = f.get("sliding_window")
            types = f.get("layer_types")
            if types is None:
                p_default = f.get("_sliding_window_pattern", 6)
                p = f.whole("sliding_window_pattern", p_default, hi=_MAX_COUNT)
                types = [
                    "sliding_attention" if (i + 1) % p else "full_attention"
                    for i in range(n_layers)
                ]
            elif not isinstance(types, list):
                raise f.fail("layer_types", types, "a list of layer types")
            scalar = f.real("query_pre_attn_scalar", head_dim, positive=True)
            local_theta = f.get("rope_local_base_freq") or local.get("rope_theta")
            local_f = _Fields({"rope_local_base_freq": local_theta or 10000.0}, where, nest=f.nest)
            extra.update(
                qk_norm=True,
                sandwich_norms=True,
                act="gelu_tanh",
                embed_scale=math.sqrt(dim),
                attn_scale=scalar**-0.5,
                local_layers=tuple(
                    i for i, t in enumerate(types[:n_layers]) if t == "sliding_attention"
                ),
                rope_local_theta=local_f.real("rope_local_base_freq", positive=True),
            )
            if extra["attn_scale"] == head_dim**-0.5:
                extra["attn_scale"] = None
        if f.get("final_logit_softcapping"):
            extra["final_softcap"] = f.real("final_logit_softcapping", positive=True)
        config = cls(
            arch=arch,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=f.whole(
                "num_key_value_heads", hi=_MAX_COUNT, value=f.get("num_key_value_heads") or n_heads
            ),
            head_dim=head_dim,
            ffn_dim=f.whole("intermediate_size"),
            vocab_size=f.whole("vocab_size"),
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=f.real("rms_norm_eps", 1e-5, lo=0.0),
            sliding_window=f.whole("sliding_window", hi=_MAX_CONTEXT) if window else None,
            tie_embeddings=bool(f.get("tie_word_embeddings", arch == "gemma3")),
            context_length=max_pos,
            name=str(f.get("_name_or_path", "") or Path(config_path).parent.name)[:200],
            **extra,
        )
        return _checked(config, where)

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
    ignore_eos: bool = (
        False  # stop tokens never drawn (llama.cpp's --ignore-eos: their logits -inf)
    )
