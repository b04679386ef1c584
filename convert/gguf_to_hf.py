"""GGUF file -> HF safetensors directory (config, weights, tokenizer, generation config)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from kvrun.errors import KvrunError
from kvrun.models.weights import fuse, load_gguf

Progress = Callable[[int, int], None]

DTYPES = {"auto": torch.float32, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


# Files a previous model in dst could leave behind that the loaders would pick up.
_STALE = ("*.safetensors", "model.safetensors.index.json", "tokenizer.model", "*.gguf")


def prepare_dir(dst: Path, overwrite: bool) -> None:
    """Make dst a directory to write into: a non-empty one only with overwrite, and then
    only stale model files are removed (the user's other files stay)."""
    if dst.exists() and not dst.is_dir():
        raise KvrunError(f"{dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()):
        if not overwrite:
            raise KvrunError(f"{dst} exists and is not empty (pass --overwrite to write into it)")
        for pattern in _STALE:
            for p in dst.glob(pattern):
                p.unlink()
    dst.mkdir(parents=True, exist_ok=True)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def gguf_to_hf(
    src: Path,
    dst: Path,
    outtype: str = "auto",
    progress: Progress | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert a GGUF model to an HF directory at dst (safetensors in f32 unless asked)."""
    from safetensors.torch import save_file

    if outtype not in DTYPES:
        raise KvrunError(
            f"unsupported outtype {outtype!r} for GGUF -> safetensors (choose: {', '.join(DTYPES)})"
        )
    dtype = DTYPES[outtype]
    w = load_gguf(Path(src), dtype, progress)  # tensors arrive in dtype one by one
    if "rope_freqs" in w.tensors:
        raise KvrunError(
            f"{src} carries a rope_freqs tensor (Llama 3.1-style RoPE scaling); "
            "converting such files to safetensors is not supported yet"
        )
    config = w.config
    if config.sliding_window and config.family.windowed:
        # llama.cpp files Mistral under "llama"; the window only survives as a Mistral config
        config = config.replace(arch=config.family.windowed)
    tok = w.tokenizer
    prepare_dir(dst, overwrite)

    hf_config = config.to_hf(tok.bos_id, tok.eos_id)
    hf_config["torch_dtype"] = DTYPE_NAMES[dtype]
    _write_json(dst / "config.json", hf_config)

    tensors = {k: v.contiguous() for k, v in w.tensors.items()}
    if config.norms_plus_one:  # kvrun (as llama.cpp) holds 1 + w; Gemma's files keep w
        for k in [k for k in tensors if k.endswith("norm.weight")]:
            tensors[k] = (tensors[k].float() - 1.0).to(dtype)
    fuse(tensors, config)  # the family's fused weights (Phi-3's), as its files keep them
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    _usual_mode(dst / "model.safetensors")

    tok.save_hf(dst)
    tc_path = dst / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    pre = w.meta.get("tokenizer.ggml.pre")
    if pre:
        tc["gguf_pre"] = str(pre)  # so hf -> gguf can restore llama.cpp's pre-tokenizer name
    _write_json(tc_path, tc)

    stops = sorted(int(i) for i in (getattr(tok, "stop_ids", None) or []))
    eos = stops if len(stops) > 1 else tok.eos_id
    gen = {"_from_model_config": True, "bos_token_id": tok.bos_id, "eos_token_id": eos}
    _write_json(dst / "generation_config.json", {k: v for k, v in gen.items() if v is not None})
    return dst


def _usual_mode(path: Path) -> None:
    """safetensors writes through a private temporary file (mode 0600): give the weights the
    mode every other written file gets (0666 less the umask, 0644 usually)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)
