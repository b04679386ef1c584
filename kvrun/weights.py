"""Weights: GGUF and HF safetensors -> (ModelConfig, canonical state dict, Tokenizer).

The canonical state dict uses HF Llama names and HF's RoPE layout (rotate-half), so the
model never branches on where its weights came from.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ModelConfig
from .errors import KvrunError, ModelNotFound, UnsupportedModel

Progress = Callable[[int, int], None]  # (done, total) tensors

GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "rope_freqs": "rope_freqs",
}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


@dataclass
class LoadedWeights:
    """Everything a model file gives: config, tensors, tokenizer and facts for `kvrun info`."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Any  # kvrun.tokenizer.Tokenizer
    path: Path
    format: str  # "gguf" | "safetensors"
    tensor_types: Counter = field(default_factory=Counter)
    meta: dict = field(default_factory=dict)


def gguf_name_to_hf(name: str) -> str | None:
    """Map a llama.cpp tensor name to the canonical (HF) name; None when unknown."""
    m = _BLK.match(name)
    if m:
        block, part, kind = m.groups()
        hf = GGUF_BLOCK.get(part)
        return f"model.layers.{block}.{hf}.{kind}" if hf else None
    stem, _, kind = name.rpartition(".")
    hf = GGUF_TOP.get(stem)
    return f"{hf}.{kind}" if hf and hf != "rope_freqs" else hf


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved -> rotate-half RoPE layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation (rotate-half -> interleaved), as its converter does."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------- GGUF
def open_gguf(path: Path):
    """Open a GGUF file (memory-mapped) with a clear error for anything that is not one."""
    import gguf

    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelNotFound(f"cannot read {path}: {e.strerror}") from None
    if magic != b"GGUF":
        raise KvrunError(f"{path} is not a GGUF file (bad magic {magic!r})")
    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as e:  # gguf raises bare ValueError/IndexError on damaged files
        raise KvrunError(f"{path} is a damaged or truncated GGUF file ({e})") from None


def gguf_metadata(reader) -> dict[str, Any]:
    """GGUF key/value metadata as plain Python values."""
    meta = {}
    for name, f in reader.fields.items():
        try:
            meta[name] = f.contents()
        except Exception:  # noqa: BLE001 - an odd field must not stop the load
            continue
    return meta


def dequantize_tensor(t) -> np.ndarray:
    """One GGUF tensor as float32 numpy in torch (row-major) shape."""
    import gguf

    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise UnsupportedModel(
            f"tensor {t.name} has type {t.tensor_type.name}, which gguf cannot dequantize"
        ) from None
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return arr.reshape(shape)


def load_gguf(path: Path, dtype: torch.dtype, progress: Progress | None = None) -> LoadedWeights:
    """Load a GGUF model: metadata, dequantized tensors in canonical form, tokenizer."""
    from .tokenizer import Tokenizer

    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = ModelConfig.from_gguf(meta, has_output="output.weight" in names)
    tokenizer = Tokenizer.from_gguf(meta)
    tensors: dict[str, torch.Tensor] = {}
    types: Counter = Counter()
    for i, t in enumerate(reader.tensors):
        hf = gguf_name_to_hf(t.name)
        types[t.tensor_type.name] += 1
        if hf is None:
            continue
        arr = dequantize_tensor(t)
        # F32/F16 come back as views of the read-only memory map; copy those few tensors
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        if hf.endswith("q_proj.weight"):
            w = unpermute_qk(w, config.n_heads)
        elif hf.endswith("k_proj.weight"):
            w = unpermute_qk(w, config.n_kv_heads)
        tensors[hf] = w.to(dtype) if hf != "rope_freqs" else w.float()
        if progress:
            progress(i + 1, len(reader.tensors))
    _check_tensors(tensors, config, path)
    return LoadedWeights(config, tensors, tokenizer, path, "gguf", types, meta)


# --------------------------------------------------------------------- safetensors
def shard_paths(root: Path) -> list[Path]:
    """The safetensors files of an HF directory (from the index when sharded)."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise KvrunError(f"{index} is not a valid safetensors index ({e})") from None
        return [root / s for s in sorted(set(weight_map.values()))]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"{root} has config.json but no *.safetensors weights")
    return files


def load_safetensors(
    root: Path, dtype: torch.dtype, progress: Progress | None = None
) -> LoadedWeights:
    """Load an HF directory: config.json, (sharded) safetensors, tokenizer files."""
    from safetensors import safe_open

    from .tokenizer import Tokenizer

    config = ModelConfig.from_hf(root / "config.json")
    tensors: dict[str, torch.Tensor] = {}
    types: Counter = Counter()
    shards = shard_paths(root)
    for n, shard in enumerate(shards):
        if not shard.exists():
            raise ModelNotFound(f"missing weight shard {shard}")
        try:
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if key.endswith("rotary_emb.inv_freq"):  # older checkpoints; we compute it
                        continue
                    w = f.get_tensor(key)
                    types[str(w.dtype).removeprefix("torch.")] += 1
                    tensors[key] = w.to(dtype)
        except KvrunError:
            raise
        except Exception as e:  # safetensors raises its own error type on bad headers
            raise KvrunError(f"{shard} is not a valid safetensors file ({e})") from None
        if progress:
            progress(n + 1, len(shards))
    if config.tie_embeddings or "lm_head.weight" not in tensors:
        config = config.replace(tie_embeddings=True)
        tensors.pop("lm_head.weight", None)
    _check_tensors(tensors, config, root)
    return LoadedWeights(config, tensors, Tokenizer.from_hf_dir(root), root, "safetensors", types)


def _check_tensors(tensors: Mapping[str, torch.Tensor], config: ModelConfig, path: Path) -> None:
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config.n_layers):
        need += [f"model.layers.{i}.{p}.weight" for p in GGUF_BLOCK.values()]
    if not config.tie_embeddings:
        need.append("lm_head.weight")
    missing = [k for k in need if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise KvrunError(f"{path} lacks tensor {missing[0]}{more}")


def load(path: str | Path, dtype: torch.dtype, progress: Progress | None = None) -> LoadedWeights:
    """Load a model from a GGUF file or an HF safetensors directory."""
    path = Path(path)
    if not path.exists():
        raise ModelNotFound(f"no such file or directory: {path}")
    if path.is_dir():
        if (path / "config.json").exists():
            return load_safetensors(path, dtype, progress)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return load_gguf(ggufs[0], dtype, progress)
        raise ModelNotFound(f"{path} holds neither config.json nor a single .gguf file")
    if path.suffix == ".safetensors" and (path.parent / "config.json").exists():
        return load_safetensors(path.parent, dtype, progress)
    return load_gguf(path, dtype, progress)
