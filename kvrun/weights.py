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
from .quant import (
    DENSE_WTYPES,
    GROUP,
    Packed,
    dense_name,
    from_gguf,
    nearest_bits,
    quantize_rows,
    requantize_bits,
)

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
_LINEAR = re.compile(r"(_proj|lm_head|embed_tokens)\.weight$")  # the weights that may be packed
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


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
    wtype: str = "f32"  # what --wtype resolved to: a dense dtype name or "packed"/"q4"/"q8"
    wtype_note: str = ""  # why --wtype auto chose what it did


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


def unpermute_qk(w: torch.Tensor | Packed, n_head: int) -> torch.Tensor | Packed:
    """Undo llama.cpp's Q/K row permutation (interleaved -> rotate-half RoPE layout)."""
    if isinstance(w, Packed):  # whole rows move, so codes, scales and zeros move alike
        rows = w.shape[0]
        order = unpermute_qk(torch.arange(rows), n_head)
        return w.rows(order)
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def target_bits(wtype: str, source: str, name: str) -> int | None:
    """The width a weight is packed to under a resolved --wtype (None: kept dense).

    'packed' (what auto resolves to on a GGUF) keeps each quantized tensor at its nearest
    width and float tensors dense. 'q4' and 'q8' pack every linear weight and the embeddings
    to at most that many bits: q4 re-quantizes wider tensors, q8 keeps 4-bit ones as they are
    (widening them would cost memory and give the same values).
    """
    if not _LINEAR.search(name) or wtype in DENSE_WTYPES:
        return None
    native = None if source in FLOAT_TYPES else nearest_bits(source)
    if wtype == "packed":
        return native
    return 4 if wtype == "q4" else min(8, native or 8)


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
        return _checked_reader(gguf)(str(path), "r")
    except _Damaged as e:
        raise KvrunError(f"{path} is a damaged GGUF file: {e}") from None
    except Exception as e:  # gguf raises bare ValueError/IndexError on damaged headers
        raise KvrunError(f"{path} is a damaged or truncated GGUF file ({e})") from None


class _Damaged(Exception):
    """A GGUF whose tensor table points outside the file (the message names the tensor)."""


def _checked_reader(gguf):
    """gguf.GGUFReader that checks every tensor's data lies inside the file before mapping
    it, so a truncated download names the tensor and the missing bytes instead of numpy's
    reshape error."""

    class Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            for info in fields:
                name = bytes(info.parts[1]).decode("utf-8", "replace")
                dims, raw, offset = info.parts[3], info.parts[4], info.parts[5]
                try:
                    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw[0])]
                except (ValueError, KeyError):
                    raise _Damaged(f"tensor {name} has an unknown type {int(raw[0])}") from None
                n_bytes = int(np.prod(dims)) * type_size // block
                start = int(start_offs + offset[0])
                if start >= size and n_bytes:
                    raise _Damaged(
                        f"tensor {name}'s data starts at byte {start:,}, past the end of the "
                        f"file ({size:,} bytes); download it again"
                    )
                if start + n_bytes > size:
                    raise _Damaged(
                        f"tensor {name} is cut short: {start + n_bytes - size:,} of its "
                        f"{n_bytes:,} bytes are missing (the file has {size:,} bytes); "
                        "download it again"
                    )
            super()._build_tensors(start_offs, fields)

    return Reader


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
    return w.to(dtype) if hf != "rope_freqs" else w.float()


def load_gguf(
    path: Path,
    dtype: torch.dtype,
    progress: Progress | None = None,
    wtype: str = "f32",
    device: torch.device | None = None,
) -> LoadedWeights:
    """Load a GGUF model: metadata, canonical tensors (packed or dense per --wtype), tokenizer.

    Tensors are read one at a time from the memory map, so a packed load never holds more
    than the packed model plus one tensor's scratch.
    """
    from .tokenizer import Tokenizer

    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = ModelConfig.from_gguf(meta, has_output="output.weight" in names)
    tokenizer = Tokenizer.from_gguf(meta)
    note = ""
    if wtype == "auto" and all(t.tensor_type.name in FLOAT_TYPES for t in reader.tensors):
        wtype = dense_name(dtype)  # nothing to keep packed
    elif wtype == "auto":
        from .packed import auto_wtype

        elem = torch.empty(0, dtype=dtype).element_size()
        wtype, note = auto_wtype(config.n_params() * elem, device or torch.device("cpu"), dtype)
    tensors: dict[str, torch.Tensor | Packed] = {}
    types: Counter = Counter()
    for i, t in enumerate(reader.tensors):
        hf = gguf_name_to_hf(t.name)
        types[t.tensor_type.name] += 1
        if hf is None:
            continue
        bits = target_bits(wtype, t.tensor_type.name, hf)
        if bits is not None and wtype != "packed":
            check_group(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), bits, path)
        w = read_gguf_tensor(t, hf, dtype, bits)
        if hf.endswith("q_proj.weight"):
            w = unpermute_qk(w, config.n_heads)
        elif hf.endswith("k_proj.weight"):
            w = unpermute_qk(w, config.n_kv_heads)
        tensors[hf] = w
        if progress:
            progress(i + 1, len(reader.tensors))
    _check_tensors(tensors, config, path)
    return LoadedWeights(config, tensors, tokenizer, path, "gguf", types, meta, wtype, note)


# --------------------------------------------------------------------- safetensors
def safetensors_damage(path: Path) -> str | None:
    """What is wrong with a safetensors file, in words (its layout: an 8-byte header length,
    a JSON header, then the data each tensor's data_offsets point into), or None."""
    try:
        raw_size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > raw_size - 8:
                return (
                    f"its header claims {n:,} bytes but the file has {raw_size:,}; "
                    "it is cut short or not a safetensors file"
                )
            header = json.loads(f.read(n))
    except OSError as e:
        return f"cannot read it ({e.strerror})"
    except ValueError as e:
        return f"its header is not valid JSON ({e})"
    data = raw_size - 8 - n
    cut = sorted(
        (tuple(info["data_offsets"][:2]), name)
        for name, info in header.items()
        if isinstance(info, dict) and len(info.get("data_offsets") or ()) == 2
        and info["data_offsets"][1] > data
    )  # fmt: skip
    if not cut:
        return None
    (start, end), name = cut[0]
    more = f"; {len(cut) - 1} more tensors lie past the end" if len(cut) > 1 else ""
    return (
        f"tensor {name} is cut short: {end - max(start, data):,} of its {end - start:,} bytes "
        f"are missing (the file has {raw_size:,} bytes){more}; download it again"
    )


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
    root: Path, dtype: torch.dtype, progress: Progress | None = None, wtype: str = "f32"
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
    _check_tensors(tensors, config, root)
    wtype = "f32" if wtype in ("auto", "packed") else wtype  # float files stay in the compute dtype
    tok = Tokenizer.from_hf_dir(root)
    return LoadedWeights(config, tensors, tok, root, "safetensors", types, {}, wtype)


def _check_tensors(
    tensors: Mapping[str, torch.Tensor | Packed], config: ModelConfig, path: Path
) -> None:
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config.n_layers):
        need += [f"model.layers.{i}.{p}.weight" for p in GGUF_BLOCK.values()]
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


def weights_plan(
    tensors: list[tuple[str, str, tuple[int, ...]]],
    wtype: str,
    planes: bool = False,
    tied: bool = True,
) -> tuple[int, Counter]:
    """Bytes the weights take in memory under a resolved --wtype, and a count per form
    ('q4 from Q4_1', 'f32', ...), from (hf name, source type, torch shape) triples.

    Dense tensors count at the named width (f32 for 'packed', 'q4', 'q8'), as loaded on CPU.
    planes: packed matrices sit in the CPU int4 planes where their shape allows (whole
    64-row blocks), except an untied embedding table, which only gathers rows.
    """
    from .quant import plan_nbytes

    elem = {"f16": 2, "bf16": 2}.get(wtype, 4)
    total, forms = 0, Counter()
    for hf, source, shape in tensors:
        bits = target_bits(wtype, source, hf) if len(shape) == 2 else None
        if bits is None:
            total += int(np.prod(shape)) * elem
            forms[wtype if wtype in DENSE_WTYPES else "f32"] += 1
            continue
        src = source if source not in FLOAT_TYPES else "F32"
        on_planes = planes and shape[0] % 64 == 0 and (tied or "embed_tokens" not in hf)
        total += plan_nbytes(src, shape[0], shape[1], bits, on_planes)
        forms[f"q{bits} from {source}"] += 1
    return total, forms
