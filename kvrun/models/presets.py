"""Shape presets' configs: the names `-m *-synthetic` accepts and their model shapes. Torch-free,
so option checks run before anything loads; kvrun.models.synthetic builds the random weights."""

from __future__ import annotations

from pathlib import Path

from ..errors import KvrunError
from .config import ModelConfig

SUFFIX = "-synthetic"

PRESETS: dict[str, ModelConfig] = {
    "llama3-8b-synthetic": ModelConfig(
        arch="llama", n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, head_dim=128,
        ffn_dim=14336, vocab_size=128256, rope_theta=500000.0, context_length=8192,
    ),
    # Mistral-7B v0.2 shapes (v0.1's 4096-token sliding window dropped, 32k context)
    "mistral-7b-synthetic": ModelConfig(
        arch="mistral", n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, head_dim=128,
        ffn_dim=14336, vocab_size=32000, rope_theta=10000.0, context_length=32768,
        sliding_window=None,
    ),
    "llama2-7b-synthetic": ModelConfig(
        arch="llama", n_layers=32, dim=4096, n_heads=32, n_kv_heads=32, head_dim=128,
        ffn_dim=11008, vocab_size=32000, rope_theta=10000.0, context_length=4096,
    ),
    "tiny-synthetic": ModelConfig(
        arch="llama", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=32,
        ffn_dim=128, vocab_size=256, rope_theta=10000.0, context_length=2048,
    ),
}  # fmt: skip


def is_preset(spec: str | None) -> bool:
    """True for a name that asks for a shape preset (`*-synthetic`) rather than a file."""
    return bool(spec) and spec.lower().endswith(SUFFIX) and not Path(spec).expanduser().exists()


def preset_config(spec: str) -> ModelConfig:
    """The preset's ModelConfig (named '<preset> (random weights)'), or a one-line error."""
    name = spec.lower()
    if name not in PRESETS:
        raise KvrunError(f"unknown shape preset {spec!r} (available: {', '.join(PRESETS)})")
    return PRESETS[name].replace(name=f"{name} (random weights)")
