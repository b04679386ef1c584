"""`convert`: the direction picked from the source (a GGUF file or an HF folder)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvrun.errors import KvrunError, ModelNotFound

from .gguf_to_hf import gguf_to_hf
from .hf_to_gguf import hf_to_gguf


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def convert(
    src: str | Path,
    dst: str | Path,
    outtype: str = "auto",
    progress: Callable[[int, int], None] | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert src to dst, the direction picked from src: a .gguf file becomes an HF
    directory at dst; an HF directory (config.json) becomes a GGUF file at dst.

    outtype: GGUF -> HF: auto (= f32) | f32 | f16 | bf16; HF -> GGUF: auto (the source
    precision) | f32 | f16 | bf16 | q8_0. Returns the path written.
    """
    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise ModelNotFound(f"no such file or directory: {src}")
    if src.resolve() == dst.resolve():
        raise KvrunError(f"source and destination are the same path: {src}")
    if src.is_file() and (src.suffix == ".gguf" or _is_gguf(src)):
        return gguf_to_hf(src, dst, outtype, progress, overwrite)
    if src.is_dir() and (src / "config.json").exists():
        return hf_to_gguf(src, dst, outtype, progress, overwrite)
    if src.suffix == ".safetensors" and (src.parent / "config.json").exists():
        return hf_to_gguf(src.parent, dst, outtype, progress, overwrite)
    if src.is_dir() and len(ggufs := sorted(src.glob("*.gguf"))) == 1:
        return gguf_to_hf(ggufs[0], dst, outtype, progress, overwrite)
    raise KvrunError(f"{src} is neither a GGUF file nor an HF model directory (config.json)")
