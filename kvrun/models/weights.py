"""Weights: GGUF and HF safetensors -> (ModelConfig, canonical state dict, Tokenizer).

The canonical state dict uses HF Llama names and HF's RoPE layout (rotate-half), so the
model never branches on where its weights came from.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import KvrunError, ModelNotFound, UnsupportedModel
from ..quant.blocks import Blocks
from ..quant.blocks import from_gguf as blocks_from_gguf
from ..quant.formats import FLOAT_TYPES, GROUP, holds_blocks, target_bits
from ..quant.packed import (
    DENSE_WTYPES,
    Packed,
    dense_name,
    from_gguf,
    quantize_rows,
    requantize_bits,
)
from .config import ModelConfig
from .file_headers import (
    GGUF_BLOCK,
    ROPE_TENSORS,
    gguf_metadata,
    gguf_name_to_hf,
    open_gguf,
    safetensors_damage,
    shard_paths,
)

Progress = Callable[[int, int], None]  # (done, total) tensors


@dataclass
class LoadedWeights:
    """Everything a model file gives: config, tensors, tokenizer and facts for `kvrun info`."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Any  # kvrun.models.tokenizer.Tokenizer
    path: Path
    format: str  # "gguf" | "safetensors"
    tensor_types: Counter = field(default_factory=Counter)
    meta: dict = field(default_factory=dict)
    wtype: str = "f32"  # what --wtype resolved to: a dense dtype name or "packed"/"q4"/"q8"
    wtype_note: str = ""  # why --wtype auto chose what it did
    model: Any = None  # the packed model, mapped from its cache entry (then no tensors)
    cache_entry: Path | None = None  # where the packed model is kept (kvrun/models/model_cache.py)
    cache_note: str = ""  # a damaged entry, in words


def _cached(
    files: list[Path], config: ModelConfig, dtype: torch.dtype, wtype: str, device
) -> tuple[Any, Path | None, str]:
    """(model mapped from the packed cache or None, its entry, a note) for packed CPU loads;
    (None, None, "") for the others, which the cache does not keep."""
    from . import model_cache

    if wtype in DENSE_WTYPES or (device is not None and device.type != "cpu"):
        return None, None, ""
    where = model_cache.entry(files, dtype, wtype)
    if where is None:
        return None, None, ""
    try:
        return model_cache.load(where, config), where, ""
    except model_cache.UnreadableCacheEntry as e:
        return None, where, f"packed cache entry damaged ({e}); building the model again"


def unpermute_qk(w: torch.Tensor | Packed | Blocks, n_head: int) -> torch.Tensor | Packed | Blocks:
    """Undo llama.cpp's Q/K row permutation (interleaved -> rotate-half RoPE layout)."""
    if isinstance(w, (Packed, Blocks)):  # whole rows move: codes, scales and zeros alike
        rows = w.shape[0]
        order = unpermute_qk(torch.arange(rows), n_head)
        return w.rows(order)
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def check_group(name: str, shape: tuple[int, ...], bits: int, path: Path) -> None:
    if shape[-1] % GROUP:
        raise KvrunError(
            f"--wtype q{bits}: {path.name} tensor {name} has {shape[-1]} columns, not a multiple "
            f"of the group size {GROUP}; use --wtype f32, f16 or bf16"
        )


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation (rotate-half -> interleaved), as its converter does."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------- GGUF
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


@functools.cache
def _dequantizable(kind) -> bool:
    """Whether gguf dequantizes a GGUF type (not Q8_1, Q8_K, the integer types, F64)."""
    import gguf

    try:
        gguf.quants.dequantize(np.zeros(gguf.GGML_QUANT_SIZES[kind][1], np.uint8), kind)
    except NotImplementedError:
        return False
    return True


def read_gguf_tensor(t, hf: str, dtype: torch.dtype, bits: int | None) -> torch.Tensor | Packed:
    """One GGUF tensor, packed to `bits` from its blocks or dequantized to dtype (bits None)."""
    if bits is not None:
        try:
            p = from_gguf(t) if t.tensor_type.name not in FLOAT_TYPES else None
        except NotImplementedError:
            raise UnsupportedModel(
                f"tensor {t.name} has type {t.tensor_type.name}, which gguf cannot dequantize"
            ) from None
        if p is None:  # a float tensor asked to be quantized (--wtype q4/q8)
            return quantize_rows(torch.from_numpy(dequantize_tensor(t).copy()), bits)
        return requantize_bits(p, bits)
    arr = dequantize_tensor(t)
    # F32/F16 come back as views of the read-only memory map; copy those few tensors
    w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
    return w.to(dtype) if hf not in ROPE_TENSORS else w.float()


def load_gguf(
    path: Path,
    dtype: torch.dtype,
    progress: Progress | None = None,
    wtype: str = "f32",
    device: torch.device | None = None,
) -> LoadedWeights:
    """Load a GGUF model: metadata, canonical tensors (packed or dense per --wtype), tokenizer.

    Tensors are read one at a time from the memory map, and each one's file pages are
    unmapped once it is read, so a packed load never holds more than the packed model plus
    one tensor's pages and scratch.
    """
    from .tokenizer import Tokenizer

    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    names = {t.name for t in reader.tensors}
    has_output = "output.weight" in names
    config = ModelConfig.from_gguf(meta, has_output=has_output, names=names, where=str(path))
    arch = config.arch
    factors = [n for n in names if n.startswith("rope_factors_")]
    if factors:  # Phi-3's LongRoPE: the factors are tensors
        if sorted(factors) != ["rope_factors_long.weight", "rope_factors_short.weight"]:
            raise KvrunError(f"{path} has LongRoPE factors {sorted(factors)}, not long and short")
        small = {t.name: t for t in reader.tensors if t.name in factors}
        long, short = (
            dequantize_tensor(small[f"rope_factors_{k}.weight"]).ravel().tolist()
            for k in ("long", "short")
        )
        config = config.with_rope_factors(meta, long, short, where=str(path))
    tokenizer = Tokenizer.from_gguf(meta)
    _check_vocab(tokenizer, config, path)
    note = ""
    if wtype == "auto" and all(t.tensor_type.name in FLOAT_TYPES for t in reader.tensors):
        wtype = dense_name(dtype)  # nothing to keep packed
    elif wtype == "auto":
        from ..quant.choice import auto_wtype

        elem = torch.empty(0, dtype=dtype).element_size()
        wtype, note = auto_wtype(config.n_params() * elem, device or torch.device("cpu"), dtype)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    native = wtype == "packed" and _native_here(device)
    model, entry, cache_note = _cached([path], config, dtype, wtype, device)
    if model is not None:
        return LoadedWeights(
            config, {}, tokenizer, path, "gguf", types, meta, wtype, note, model, entry
        )
    tensors: dict[str, torch.Tensor | Packed | Blocks] = {}
    for i, t in enumerate(reader.tensors):
        hf = gguf_name_to_hf(t.name, arch)
        if hf is None or hf.startswith("rope_factors_"):
            continue
        _check_shape(hf, tuple(int(d) for d in reversed(t.shape.tolist())), config, path, t.name)
        if not _dequantizable(t.tensor_type):  # kept as blocks, it would fail at the first product
            raise UnsupportedModel(
                f"tensor {_shown(t.name)} has type {t.tensor_type.name}, which gguf cannot "
                "dequantize"
            )
        if holds_blocks(wtype, t.tensor_type.name, hf, native):
            # the file's own blocks, whatever their type; Q and K rows in RoPE's order, and
            # interleaved at once where the native kernels multiply by them (an untied
            # embedding table only gathers rows)
            heads = _qk_heads(hf, config)
            order = None if heads is None else unpermute_qk(torch.arange(t.data.shape[0]), heads)
            # fused weights are split by rows first; they interleave in the model
            x8 = native and ("embed_tokens" not in hf or config.tie_embeddings)
            x8 = x8 and _fused_key(hf, config) is None
            tensors[hf] = blocks_from_gguf(t, order, interleave=x8)
            reader.release(t)
            if progress:
                progress(i + 1, len(reader.tensors))
            continue
        else:
            bits = target_bits(wtype, t.tensor_type.name, hf)
            if bits is not None and wtype != "packed":
                check_group(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), bits, path)
            w = read_gguf_tensor(t, hf, dtype, bits)
        reader.release(t)  # w is a copy: the file's pages of it leave the process's memory
        heads = _qk_heads(hf, config)
        if heads is not None:
            w = unpermute_qk(w, heads)
        tensors[hf] = w
        if progress:
            progress(i + 1, len(reader.tensors))
    split_fused(tensors, config)
    _check_tensors(tensors, config, path)
    return LoadedWeights(
        config, tensors, tokenizer, path, "gguf", types, meta, wtype, note, None, entry, cache_note
    )


# --------------------------------------------------------------------- safetensors
def load_safetensors(
    root: Path, dtype: torch.dtype, progress: Progress | None = None, wtype: str = "f32"
) -> LoadedWeights:
    """Load an HF directory: config.json, (sharded) safetensors, tokenizer files."""
    from safetensors import safe_open

    from .tokenizer import Tokenizer

    config = ModelConfig.from_hf(root / "config.json")
    tensors: dict[str, torch.Tensor] = {}
    types: Counter = Counter()
    shards = shard_paths(root)
    if wtype in ("q4", "q8") and all(s.exists() for s in shards):  # packed at load: cacheable
        model, entry, cache_note = _cached(
            [root / "config.json", *shards], config, dtype, wtype, None
        )
    else:
        model, entry, cache_note = None, None, ""
    if model is not None:
        config = model.config
        tok = Tokenizer.from_hf_dir(root)
        _check_vocab(tok, config, root)
        return LoadedWeights(
            config, {}, tok, root, "safetensors", types, {}, wtype, "", model, entry
        )
    for n, shard in enumerate(shards):
        if not shard.exists():
            raise ModelNotFound(f"missing weight shard {shard}")
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    key = config.family.text_name(name)
                    if key is None or key.endswith("rotary_emb.inv_freq"):
                        continue  # another tower's, or what we compute (older checkpoints)
                    _check_shape(key, tuple(f.get_slice(name).get_shape()), config, shard)
                    w = f.get_tensor(name)
                    types[str(w.dtype).removeprefix("torch.")] += 1
                    if config.norms_plus_one and key.endswith("norm.weight"):
                        w = w.float() + 1.0  # the file's w scales by 1 + w; kvrun holds 1 + w
                    bits = target_bits(wtype, "F32", key)
                    if bits is not None:
                        check_group(key, tuple(w.shape), bits, root)
                        tensors[key] = quantize_rows(w, bits)
                    else:
                        tensors[key] = w.to(dtype)
        except KvrunError:
            raise
        except Exception as e:  # safetensors raises its own error type on bad headers
            why = safetensors_damage(shard) or str(e)
            raise KvrunError(f"{shard} is not a valid safetensors file: {why}") from None
        if progress:
            progress(n + 1, len(shards))
    if config.tie_embeddings or "lm_head.weight" not in tensors:
        config = config.replace(tie_embeddings=True)
        tensors.pop("lm_head.weight", None)
    split_fused(tensors, config)
    _check_tensors(tensors, config, root)
    wtype = "f32" if wtype in ("auto", "packed") else wtype  # float files stay in the compute dtype
    tok = Tokenizer.from_hf_dir(root)
    _check_vocab(tok, config, root)
    return LoadedWeights(
        config, tensors, tok, root, "safetensors", types, {}, wtype, "", None, entry, cache_note
    )


def _fused_rows(part: str, config: ModelConfig) -> int:
    """Rows of one part of a fused weight (q/k/v_proj, gate/up_proj)."""
    heads = config.n_heads if part == "q_proj" else config.n_kv_heads
    return (
        heads * config.head_dim if part.endswith(("q_proj", "k_proj", "v_proj")) else config.ffn_dim
    )


def _fused_key(name: str, config: ModelConfig) -> tuple[str, str, str] | None:
    """(prefix, layer, key) of a fused weight of this family ("model", "3",
    "self_attn.qkv_proj"), else None."""
    pre, _, stem = name.removesuffix(".weight").rpartition(".layers.")
    layer, _, key = stem.partition(".")
    ok = name.endswith(".weight") and key in config.family.fused
    return (pre, layer, key) if ok else None


def split_fused(tensors: dict, config: ModelConfig) -> None:
    """A family's fused weights (Phi-3's qkv_proj, gate_up_proj: in its HF files and GGUFs
    alike) as the canonical parts, by rows (dense, packed or GGUF blocks)."""
    fused = config.family.fused
    for name in [n for n in tensors if _fused_key(n, config)]:
        pre, layer, key = _fused_key(name, config)
        w = tensors.pop(name)
        ends = list(itertools.accumulate(_fused_rows(p, config) for p in fused[key]))
        if w.shape[0] != ends[-1]:
            raise KvrunError(f"tensor {name} has {w.shape[0]} rows, not what the config says")
        module = key.rpartition(".")[0]
        for part, a, b in zip(fused[key], [0, *ends[:-1]], ends, strict=True):
            rows = w.rows(slice(a, b)) if isinstance(w, (Packed, Blocks)) else w[a:b].clone()
            tensors[f"{pre}.layers.{layer}.{module}.{part}.weight"] = rows


def fuse(tensors: dict, config: ModelConfig) -> None:
    """The inverse of split_fused: a family's parts as its files' fused weights (`kvrun
    convert` writes them so)."""
    for i in range(config.n_layers):
        for key, parts in config.family.fused.items():
            module = key.rpartition(".")[0]
            stem = f"model.layers.{i}.{module}."
            tensors[f"model.layers.{i}.{key}.weight"] = torch.cat(
                [tensors.pop(f"{stem}{p}.weight") for p in parts]
            )


def _qk_heads(hf: str, config: ModelConfig) -> int | None:
    """The heads a Q or K weight's rows are permuted over in GGUF (else None: the families
    with NEOX-style RoPE keep HF's order)."""
    if not config.family.permuted_qk:
        return None
    if hf.endswith("q_proj.weight"):
        return config.n_heads
    if hf.endswith("k_proj.weight"):
        return config.n_kv_heads
    return None


def _native_here(device: torch.device | None) -> bool:
    """Whether the native CPU kernels run this load's products (built on first use)."""
    if device is not None and device.type != "cpu":
        return False
    from ..quant import native

    return native.ops() is not None


def _expected_shape(name: str, c: ModelConfig) -> tuple[int, ...] | None:
    """The shape of canonical tensor `name` in a model of config c; None where it has none."""
    d, f, hd = c.dim, c.ffn_dim, c.head_dim
    q, kv = c.n_heads * hd, c.n_kv_heads * hd
    top = {"model.embed_tokens.weight": (c.vocab_size, d), "lm_head.weight": (c.vocab_size, d),
           "model.norm.weight": (d,), "rope_freqs": ((c.rotary_dim or hd) // 2,)}  # fmt: skip
    if name in top:
        return top[name]
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) >= c.n_layers:
        return None
    parts = {
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
        "self_attn.qkv_proj.weight": (q + 2 * kv, d), "mlp.gate_up_proj.weight": (2 * f, d),
        "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f),
    }  # fmt: skip
    if c.qkv_bias:
        parts |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                  "self_attn.v_proj.bias": (kv,)}  # fmt: skip
    if c.qk_norm:
        parts |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    if c.sandwich_norms:
        parts |= {
            "pre_feedforward_layernorm.weight": (d,),
            "post_feedforward_layernorm.weight": (d,),
        }
    return parts.get(m.group(2))


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")


def _check_shape(
    name: str, shape: tuple[int, ...], config: ModelConfig, path: Path, label: str | None = None
) -> None:
    """A tensor the model takes, in the shape its config gives, before it is read (a damaged
    or hostile file must not reach the forward pass, or the native kernels, in other shapes).
    label: the tensor's name in the file, where it is not the canonical one."""
    want = _expected_shape(name, config)
    shown = _shown(label or name)
    if want is None:
        raise KvrunError(
            f"{path} holds tensor {shown}, which a {config.arch} model of "
            f"{config.n_layers} layers as its config describes does not have"
        )
    if shape != want:
        raise KvrunError(
            f"{path}: tensor {shown} has shape {list(shape)}; its config says {list(want)}"
        )


def _shown(name: str) -> str:
    """A tensor name from a file, for a one-line message (any text: escaped, cut short)."""
    return name[:80].encode("unicode_escape").decode("ascii")


def _check_vocab(tokenizer, config: ModelConfig, path: Path) -> None:
    """Every id the tokenizer gives (its vocabulary, BOS and EOS) must have a row in the
    embedding table."""
    n = max(tokenizer.id_limit(), *((tokenizer.bos_id or 0) + 1, (tokenizer.eos_id or 0) + 1))
    if n > config.vocab_size:
        raise KvrunError(
            f"{path}: the tokenizer gives ids up to {n - 1:,}, past the {config.vocab_size:,} "
            "rows of the embedding table"
        )


def _check_tensors(
    tensors: Mapping[str, torch.Tensor | Packed | Blocks], config: ModelConfig, path: Path
) -> None:
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    parts = list(GGUF_BLOCK.values())
    if config.qk_norm:
        parts += ["self_attn.q_norm", "self_attn.k_norm"]
    if config.sandwich_norms:
        parts += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(config.n_layers):
        need += [f"model.layers.{i}.{p}.weight" for p in parts]
        if config.qkv_bias:
            need += [f"model.layers.{i}.self_attn.{p}_proj.bias" for p in "qkv"]
    if not config.tie_embeddings:
        need.append("lm_head.weight")
    missing = [k for k in need if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise KvrunError(f"{path} lacks tensor {missing[0]}{more}")


def load(
    path: str | Path,
    dtype: torch.dtype,
    progress: Progress | None = None,
    wtype: str = "f32",
    device: torch.device | None = None,
) -> LoadedWeights:
    """Load a model from a GGUF file or an HF safetensors directory.

    wtype: auto | f32 | f16 | bf16 (dense in dtype, the reference path) | q8 | q4 (packed).
    """
    path = Path(path)
    if not path.exists():
        raise ModelNotFound(f"no such file or directory: {path}")
    if path.is_dir():
        if (path / "config.json").exists():
            return load_safetensors(path, dtype, progress, wtype)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return load_gguf(ggufs[0], dtype, progress, wtype, device)
        raise ModelNotFound(f"{path} holds neither config.json nor a single .gguf file")
    if path.suffix == ".safetensors" and (path.parent / "config.json").exists():
        return load_safetensors(path.parent, dtype, progress, wtype)
    return load_gguf(path, dtype, progress, wtype, device)
