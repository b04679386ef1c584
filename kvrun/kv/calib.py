"""Calibrations kept per model: what a KV method fits once on a model (KVzap's surrogate
scorers, DuoAttention's head pattern), made by `kvrun calibrate` and found again by the method.

    $KVRUN_CACHE/calib/<method>-<file stem>-<key>.safetensors   ($KVRUN_CACHE: ~/.cache/kvrun)

as the packed-model cache keeps built models (kvrun/models/model_cache.py): <key> hashes the
model file's identity (its real path, size and mtime; an HF folder's weight and config files),
so a changed file misses and must be calibrated again. A model with no file (the tests' tiny
models, shape presets) is keyed by its config. The file is plain safetensors (never pickle),
its metadata holding the method, the format and what the fit was made with; it is written
under a temporary name and renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import torch

from ..errors import KvrunError

FORMAT = 1


def root() -> Path:
    return Path(os.environ.get("KVRUN_CACHE") or "~/.cache/kvrun").expanduser() / "calib"


def _files(model_file: Path) -> list[Path]:
    """The files whose identity is the model's: the file, or an HF folder's weights and config."""
    if model_file.is_dir():
        return sorted(p for p in model_file.iterdir() if p.suffix in (".safetensors", ".json"))
    return [model_file]


def entry(method: str, config, model_file: Path | None) -> Path:
    """Where `method`'s calibration of this model is kept (config: the model's ModelConfig)."""
    if model_file is not None and Path(model_file).exists():
        real = os.path.realpath(model_file)
        ident = [
            [os.path.realpath(f), (st := os.stat(f)).st_size, st.st_mtime_ns]
            for f in _files(Path(real))
        ]
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(real).stem)[:48]
    else:  # an in-memory model: its shape and name are all that names it
        ident = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
        stem = "in-memory"
    key = hashlib.sha256(json.dumps({"format": FORMAT, "model": ident}).encode()).hexdigest()[:16]
    return root() / f"{method}-{stem}-{key}.safetensors"


def save(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write a calibration atomically (a temporary file renamed over the entry)."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        flat = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
        save_file(flat, str(tmp), metadata={"kvrun": json.dumps({"format": FORMAT, **meta})})
        os.replace(tmp, path)
    except OSError as e:
        raise KvrunError(f"cannot write the calibration {path}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def load(path: Path, method: str, command: str) -> tuple[dict[str, torch.Tensor], dict]:
    """A calibration's tensors and metadata; missing or unreadable is a one-line KvrunError
    naming the command that makes one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.exists():
        raise KvrunError(
            f"--kv {method} needs a calibration of this model, and none is kept "
            f"({path.name}); make one with `{command}`"
        )
    try:
        tensors = load_file(str(path))
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("kvrun", "{}"))
    except (SafetensorError, OSError, ValueError) as e:
        raise KvrunError(
            f"the {method} calibration {path} does not read back ({str(e)[:80]}); "
            f"make a new one with `{command}`"
        ) from None
    if meta.get("format") != FORMAT or meta.get("method") != method:
        raise KvrunError(
            f"{path} is not a {method} calibration of format {FORMAT}; make a new one with "
            f"`{command}`"
        )
    return tensors, meta
