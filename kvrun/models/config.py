"""ModelConfig: the canonical description of a model, built from GGUF or HF.

One decoder runs every family registered in kvrun/models/families/. The fields below say
which features a model's blocks have (q/k/v biases, q/k norms, sandwich norms, GeGLU, a scaled
embedding, local sliding-window layers, soft-capped logits, partial rotary, scaled RoPE); the
forward pass reads them, never the family's name. What is shared by every family's files is
read here; what a family's metadata adds, its file in families/ reads.
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
from . import families
from .families import Family
from .fields import MAX_CONTEXT, MAX_COUNT, Fields


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling, as HF names its kinds: 'linear' (position interpolation),
    'llama3' (wavelength bands), 'yarn' or 'longrope' ('su': per-pair short and long
    factors)."""

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


def _scaling_from_hf(f: Fields, max_pos: int) -> RopeScaling | None:
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
            f.whole("original_max_position_embeddings", hi=MAX_CONTEXT),
        )
    if kind == "yarn":
        orig_value = f.get("original_max_position_embeddings") or max_pos
        orig = f.whole("original_max_position_embeddings", hi=MAX_CONTEXT, value=orig_value)
        return RopeScaling(
            "yarn",
            f.real("factor", positive=True) if f.get("factor") else max_pos / orig,
            original_context=orig,
            beta_fast=f.real("beta_fast", 32.0) if f.get("beta_fast") else 32.0,
            beta_slow=f.real("beta_slow", 1.0) if f.get("beta_slow") else 1.0,
            attention_factor=_optional(f, "attention_factor"),
        )
    if kind in ("longrope", "su"):
        orig = f.whole("original_max_position_embeddings", hi=MAX_CONTEXT)
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


def _optional(f: Fields, key: str) -> float | None:
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

    arch: str  # a family's name (kvrun.models.families.FAMILIES)
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
    sliding_window: int | None = None  # a query sees the last `sliding_window` keys
    tie_embeddings: bool = False
    context_length: int = 4096
    name: str = ""
    # what a family adds to the plain pre-norm blocks (all off: the plain ones)
    qkv_bias: bool = False  # biases on the Q, K and V products
    qk_norm: bool = False  # RMSNorm over each head of Q and K before RoPE
    sandwich_norms: bool = False  # norms after attention and after the MLP too
    act: str = "silu"  # the gate's activation: "silu" | "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # the embedding times this (sqrt(dim) where scaled)
    attn_scale: float | None = None  # softmax scale (None: 1/sqrt(head_dim))
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    # the layers whose attention is local (a window of `sliding_window` keys); None: all
    # layers alike (one window for all, or none); e.g. 5 local layers to 1 global
    local_layers: tuple[int, ...] | None = None
    rope_local_theta: float | None = None  # the local layers' RoPE base (unscaled)
    rotary_dim: int | None = None  # the head dims RoPE turns (None: all; e.g. 3/4 of them)

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
        """What this model adds to the plain blocks, in words (`kvrun info`)."""
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
    def family(self) -> Family:
        """This model's family (kvrun/models/families/)."""
        return families.family(self.arch)

    @property
    def norms_plus_one(self) -> bool:
        """Whether the HF files keep RMSNorm weights as w for a scale of (1 + w); kvrun, as
        llama.cpp's files, holds 1 + w."""
        return self.family.norms_plus_one

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
        fam = families.from_gguf_arch(meta.get("general.architecture"))
        arch = fam.arch
        f = Fields(meta, where, f"{arch}.")
        get = f.get
        n_heads = f.whole("attention.head_count", hi=MAX_COUNT)
        dim = f.whole("embedding_length")
        rot = get("rope.dimension_count")
        rot = None if rot is None else f.whole("rope.dimension_count")
        key_length = get("attention.key_length") or (rot if fam.permuted_qk else None)
        head_dim = f.whole("attention.key_length", value=key_length or dim // n_heads)
        n_kv_value = get("attention.head_count_kv") or n_heads
        n_kv = f.whole("attention.head_count_kv", hi=MAX_COUNT, value=n_kv_value)
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab_value = get("vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
        vocab = f.whole("vocab_size", value=vocab_value)
        n_layers = f.whole("block_count", hi=MAX_COUNT)
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
                original_context=f.whole("rope.scaling.original_context_length", hi=MAX_CONTEXT),
                beta_fast=f.real("rope.scaling.yarn_beta_fast", 32.0),
                beta_slow=f.real("rope.scaling.yarn_beta_slow", 1.0),
                attention_factor=_optional(f, "rope.scaling.attn_factor"),
            )
        # GGUFs may carry the llama3 scaling as a `rope_freqs` tensor instead, and LongRoPE's
        # factors as `rope_factors_long` / `rope_factors_short`: the loader reads those
        # (`with_rope_factors`) and the model divides its frequencies by them.
        window = get("attention.sliding_window")
        window = f.whole("attention.sliding_window", hi=MAX_CONTEXT) if window else None
        extra: dict[str, Any] = {}
        if "blk.0.attn_q_norm.weight" in names:
            extra["qk_norm"] = True
        seen = dict(dim=dim, n_heads=n_heads, n_layers=n_layers, head_dim=head_dim, rot=rot)
        extra.update(fam.gguf_fields(f, {**seen, "window": window, "names": names}))
        if get("final_logit_softcapping"):
            extra["final_softcap"] = f.real("final_logit_softcapping", positive=True)
        config = cls(
            **cfg,
            rope_theta=f.real("rope.freq_base", 10000.0, positive=True),
            rope_scaling=scaling,
            norm_eps=f.real("attention.layer_norm_rms_epsilon", 1e-5, lo=0.0),
            sliding_window=window,
            tie_embeddings=not has_output,
            context_length=f.whole("context_length", 4096, hi=MAX_CONTEXT),
            name=str(meta.get("general.name", ""))[:200],
            **extra,
        )
        return _checked(config, where)

    def with_rope_factors(
        self, meta: Mapping[str, Any], long: list, short: list, where: str = "the GGUF"
    ) -> ModelConfig:
        """LongRoPE from a GGUF's `rope_factors_long` / `_short` tensors and its
        metadata (the original context and the attention factor)."""
        f = Fields(meta, where, f"{self.arch}.")
        orig = f.whole("rope.scaling.original_context_length", self.context_length, hi=MAX_CONTEXT)
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
                f", not a model type (kvrun runs: {', '.join(families.hf_types())})"[:300]
            )
        fam = families.from_hf_type(model_type)
        if fam is None:
            archs = c.get("architectures")
            name = archs[0] if isinstance(archs, list) and archs else model_type
            have = ", ".join(f.hf_class for f in families.FAMILIES.values())
            raise UnsupportedModel(
                f"architecture {name!r:.60} is not supported (kvrun runs: {have})"
            )
        f = Fields(c, where)
        if model_type in fam.hf_nested:  # a multimodal checkpoint: its text model's config
            key = fam.hf_nested[model_type]
            c = f.table(key)
            f = Fields(c, where, nest=f"{key}.")
        arch = fam.arch
        n_heads = f.whole("num_attention_heads", hi=MAX_COUNT)
        dim = f.whole("hidden_size")
        n_layers = f.whole("num_hidden_layers", hi=MAX_COUNT)
        max_pos = f.whole("max_position_embeddings", 4096, hi=MAX_CONTEXT)
        rope = f.inner("rope_parameters")
        # rope_parameters may hold one RoPE per layer type (full and sliding attention)
        full = rope.inner("full_attention") if "full_attention" in rope.src else rope
        local = rope.table("sliding_attention")
        scaling = f.inner("rope_scaling")
        scaling = scaling if scaling.src else full
        orig = "original_max_position_embeddings"
        if orig in c and orig not in scaling.src:
            scaling = Fields({**scaling.src, orig: c[orig]}, where, nest=scaling.nest)
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
        seen = dict(dim=dim, n_layers=n_layers, head_dim=head_dim, local=local)
        extra.update(fam.hf_fields(f, {**seen, "model_type": model_type}))
        window = extra.pop("sliding_window", None)
        if f.get("final_logit_softcapping"):
            extra["final_softcap"] = f.real("final_logit_softcapping", positive=True)
        config = cls(
            arch=arch,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=f.whole(
                "num_key_value_heads", hi=MAX_COUNT, value=f.get("num_key_value_heads") or n_heads
            ),
            head_dim=head_dim,
            ffn_dim=f.whole("intermediate_size"),
            vocab_size=f.whole("vocab_size"),
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=f.real("rms_norm_eps", 1e-5, lo=0.0),
            sliding_window=f.whole("sliding_window", hi=MAX_CONTEXT) if window else None,
            tie_embeddings=bool(f.get("tie_word_embeddings", fam.hf_tied)),
            context_length=max_pos,
            name=str(f.get("_name_or_path", "") or Path(config_path).parent.name)[:200],
            **extra,
        )
        return _checked(config, where)

    def to_hf(self, bos_id: int | None = None, eos_id: int | None = None) -> dict:
        """An HF config.json dict for this model (used by `kvrun convert`)."""
        out = {
            "architectures": [self.family.hf_class],
            "model_type": self.family.hf_model_type or self.arch,
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
            "pad_token_id": None,  # some config classes default it to 32000, past small vocabularies
        }
        out.update(self.family.hf_out(self))
        if self.rotary_dim is not None:
            out["partial_rotary_factor"] = self.rotary_dim / self.head_dim
        if self.final_softcap is not None:
            out["final_logit_softcapping"] = self.final_softcap
        if self.rope_scaling is not None:
            out["rope_scaling"] = self.rope_scaling.to_hf()
            if self.rope_scaling.kind == "longrope":  # LongRoPE configs read it at the top level
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
    """How tokens are drawn (llama.cpp's flags and defaults; kvrun/run/sampling.py draws)."""

    temp: float = 0.8
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1.0 = off
    min_p: float = 0.05  # 0.0 = off
    repeat_penalty: float = 1.0  # 1.0 = off
    repeat_last_n: int = 64  # 0 = off, -1 = whole context
    ignore_eos: bool = (
        False  # stop tokens never drawn (llama.cpp's --ignore-eos: their logits -inf)
    )
