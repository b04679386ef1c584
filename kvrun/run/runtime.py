"""Load a model by name or path onto a device, and build its KV manager."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import openmp

openmp.tune()  # before torch loads: OpenMP reads its spin count once

import torch

from ..errors import KvrunError
from ..hub.model_store import resolve
from ..kv import FULL, KVSpec, build
from ..kv.protocol import KVManager
from ..models import model_cache
from ..models.config import ModelConfig
from ..models.weights import LoadedWeights, load
from ..quant.formats import WTYPES
from ..quant.packed import DENSE_WTYPES, dense_name

DTYPES = {
    "float32": torch.float32,
    "f32": torch.float32,
    "float16": torch.float16,
    "f16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def pick_device(name: str = "auto") -> torch.device:
    """'auto' is CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise KvrunError(
            "--device cuda was asked for but no CUDA GPU is available; use --device cpu"
        )
    try:
        return torch.device(name)
    except RuntimeError:
        raise KvrunError(f"unknown device {name!r} (use auto, cpu or cuda)") from None


def pick_dtype(name: str, device: torch.device, wtype: str = "auto") -> torch.dtype:
    """'auto' is float32 on CPU and bfloat16 on CUDA, or the dtype a dense --wtype names."""
    check_wtype(wtype)
    dense = DENSE_WTYPES.get(wtype)
    if name == "auto":
        if dense is not None:
            return dense
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise KvrunError(f"unknown dtype {name!r} (use auto, float32, float16 or bfloat16)")
    if dense is not None and DTYPES[name] != dense:
        raise KvrunError(
            f"--wtype {wtype} keeps dense weights in the compute dtype, which --dtype {name} "
            f"sets otherwise; drop one of them (--dtype auto follows --wtype)"
        )
    return DTYPES[name]


def check_wtype(wtype: str) -> None:
    if wtype not in WTYPES:
        raise KvrunError(f"unknown --wtype {wtype!r} (use {', '.join(WTYPES)})")


@dataclass
class Runtime:
    """A loaded model with its tokenizer, ready for Sessions."""

    model: object  # kvrun.models.model.Transformer
    tokenizer: object  # kvrun.models.tokenizer.Tokenizer
    config: ModelConfig
    path: Path
    weights: LoadedWeights  # tensors dropped after the model is built
    load_s: float = 0.0  # wall time of load_runtime (resolve, read, build)

    def new_kv(self, spec: KVSpec | None = None, **kw) -> KVManager:
        """A fresh KV manager for this model from a validated spec (kvrun.kv.check); None: full.
        A spec that weighs values by the output projection (critical=1) is lent it."""
        if spec is not None and spec.select.critical:
            kw.setdefault("out_proj", self.out_proj)
        kv = build(
            spec or FULL, self.config, self.model.rope, self.model.device, self.model.dtype, **kw
        )
        if hasattr(kv, "use_model_file"):  # a calibrated method (kvzap, duo) finds its own
            kv.use_model_file(self.path)
        return kv

    def out_proj(self, layer: int):
        """Layer `layer`'s attention output projection (dense or packed): lent to a cache that
        weighs values by it (critical=1)."""
        return self.model.model.layers[layer].self_attn.o_proj


def load_runtime(
    spec: str | None,
    dtype: str = "auto",
    device: str = "auto",
    pull_missing: bool = False,
    log: Callable[[str], None] = print,
    progress: Callable[[int, int], None] | None = None,
    wtype: str = "auto",
) -> Runtime:
    """Resolve, load and place a model; wtype: auto | f32 | f16 | bf16 | q8 | q4 (see
    kvrun/models/weights.py, kvrun/quant/linear.py and kvrun/quant/choice.py)."""
    from ..models.model import Transformer

    t0 = time.perf_counter()
    if openmp.NOTE["text"]:
        log(openmp.NOTE["text"])
        openmp.NOTE["text"] = None  # said once
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev, wtype)
    from ..models.presets import is_preset

    if is_preset(spec):  # `llama3-8b-synthetic` etc.: real shapes, random weights
        rt = preset_runtime(spec, dt, dev, progress, wtype)
        rt.load_s = time.perf_counter() - t0
        return rt
    path = resolve(spec, pull_missing=pull_missing, log=log)
    w = load(path, dt, progress, wtype, dev)
    if w.wtype in DENSE_WTYPES and w.wtype_note:  # auto chose dense for a quantized file
        log(w.wtype_note)
    if w.cache_note:
        log(w.cache_note)
    if dev.type == "cpu" and w.format == "gguf" and w.wtype == "packed":
        from ..quant import native

        if native.note():  # no compiler, a failed build, KVRUN_NATIVE=off: said once
            log(native.note())
    model = w.model
    if model is None:
        model = Transformer.from_weights(w.config, w.tensors, dev, consume=True)
        w.tensors = {}
        if w.cache_entry is not None:
            model_cache.save(w.cache_entry, model, log)
    w.model = None  # the Runtime holds it
    return Runtime(model, w.tokenizer, w.config, path, w, time.perf_counter() - t0)


def preset_runtime(
    spec: str,
    dtype: torch.dtype,
    device: torch.device,
    progress: Callable[[int, int], None] | None = None,
    wtype: str = "auto",
) -> Runtime:
    """A Runtime for a shape preset: random weights (dense in dtype, or packed for --wtype
    q4/q8, made as codes without a float copy), a SyntheticTokenizer, format 'synthetic'."""
    from ..models.model import Transformer
    from ..models.presets import preset_config
    from ..models.synthetic import INIT_STD, SyntheticTokenizer, check_fits, random_weights

    config = preset_config(spec)
    bits = {"q4": 4, "q8": 8}.get(wtype)  # auto: dense, the dtype asked for is what is measured
    check_fits(spec.lower(), config, dtype, device, bits)
    tensors = random_weights(config, dtype, device, progress=progress, bits=bits)
    model = Transformer.from_weights(config, tensors, device, consume=True)
    tok = SyntheticTokenizer(config.vocab_size)
    path = Path(spec.lower())
    meta = {"synthetic": True, "preset": spec.lower(), "init_std": INIT_STD}
    wt = f"q{bits}" if bits else dense_name(dtype)
    w = LoadedWeights(config, {}, tok, path, "synthetic", meta=meta, wtype=wt)
    return Runtime(model, tok, config, path, w)
