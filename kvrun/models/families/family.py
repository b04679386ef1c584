"""What a model family is: its names and rules (kvrun/models/families/__init__.py registers one
per family file)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..fields import Fields


def _nothing(*_: Any) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    """One family's names and rules. The callables return ModelConfig fields (or HF
    config.json fields, for `hf_out`); `seen` holds what the shared reader already read:
    dim, n_heads, n_layers, head_dim, rot (GGUF's rope.dimension_count), window (GGUF's
    sliding window), names (the GGUF's tensor names), local (HF's sliding-attention RoPE)."""

    arch: str  # ModelConfig.arch, and the GGUF general.architecture read as this family
    hf_types: tuple[str, ...]  # HF model_type values read as this family
    hf_class: str  # the transformers class `kvrun convert` writes
    hf_model_type: str = ""  # the model_type `kvrun convert` writes ("": arch)
    gguf_writes: str = ""  # the general.architecture `kvrun convert` writes ("": arch)
    windowed: str = ""  # the family a GGUF of this one with a sliding window is, in HF terms
    hf_nested: Mapping[str, str] = field(default_factory=dict)  # model_type -> its text config
    hf_tied: bool = False  # tie_word_embeddings where config.json does not say
    permuted_qk: bool = False  # GGUF keeps Q and K rows permuted for interleaved-pair RoPE
    block_parts: Mapping[str, str] = field(default_factory=dict)  # GGUF part -> HF, not Llama's
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # one weight -> its parts
    norms_plus_one: bool = False  # HF files hold RMSNorm weights w for a scale of 1 + w
    text_names: tuple[tuple[str, str], ...] = ()  # multimodal checkpoint prefix -> text model's
    other_towers: tuple[str, ...] = ()  # checkpoint prefixes of towers kvrun does not run
    pre_tokenizers: Mapping[str, tuple[str, bool]] = field(default_factory=dict)
    spm_space_prefix: bool | None = None  # convert: add_space_prefix written (None: the default)
    gguf_fields: Callable[[Fields, dict], dict] = _nothing  # GGUF metadata -> config fields
    hf_fields: Callable[[Fields, dict], dict] = _nothing  # config.json -> config fields
    hf_out: Callable[[ModelConfig], dict] = _nothing  # config -> config.json fields

    def text_name(self, name: str) -> str | None:
        """The canonical name of a checkpoint tensor (a multimodal checkpoint's text model
        as a text model's); None for another tower's."""
        for pre, to in self.text_names:
            if name.startswith(pre):
                return to + name.removeprefix(pre)
        return None if name.startswith(self.other_towers) else name
