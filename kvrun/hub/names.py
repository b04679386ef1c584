"""Models on the Hugging Face hub, by name: short names pinned to a repo and file,
`hf:REPO[:QUANT]` and its quant picking, and what the HF cache (HF_HOME / HF_HUB_CACHE) holds,
found with no network call. Pulling is kvrun/hub/pull.py."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import KvrunError, QuantNotFound

DEFAULT_QUANT = "Q4_K_M"
# what kvrun reads of an HF safetensors repo (snapshot_download's allow_patterns)
FOLDER_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "*.safetensors",
    "*.safetensors.index.json",
]


@dataclass(frozen=True, slots=True)
class HubRef:
    """A model in a Hugging Face repo: a GGUF file pinned, or picked by its quant (default
    Q4_K_M, else the only GGUF); a repo without GGUF files is its safetensors folder."""

    repo: str  # owner/name
    quant: str | None = None  # Q4_K_M, q8_0, IQ4_XS, F16, ... or a file name
    file: str | None = None  # pinned (short names)

    def __str__(self) -> str:
        return f"hf:{self.repo}" + (
            f":{self.quant or self.file}" if self.quant or self.file else ""
        )


@dataclass(frozen=True, slots=True)
class HubModel:
    """A short name pinned to one GGUF file of a Hugging Face repo."""

    name: str
    repo: str
    file: str
    size_gb: float  # nominal, from the hub page

    @property
    def ref(self) -> HubRef:
        return HubRef(self.repo, file=self.file)


HUB_MODELS = {m.name: m for m in (
    HubModel("llama3-8b", "bartowski/Meta-Llama-3-8B-Instruct-GGUF", "Meta-Llama-3-8B-Instruct-Q4_K_M.gguf", 4.92),
    HubModel("llama3.1-8b", "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF", "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", 4.92),
    HubModel("llama3.2-1b", "bartowski/Llama-3.2-1B-Instruct-GGUF", "Llama-3.2-1B-Instruct-Q4_K_M.gguf", 0.81),
    HubModel("llama3.2-3b", "bartowski/Llama-3.2-3B-Instruct-GGUF", "Llama-3.2-3B-Instruct-Q4_K_M.gguf", 2.02),
    HubModel("mistral-7b", "bartowski/Mistral-7B-Instruct-v0.3-GGUF", "Mistral-7B-Instruct-v0.3-Q4_K_M.gguf", 4.37),
    HubModel("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q4_k_m.gguf", 0.49),
    HubModel("qwen2.5-7b", "bartowski/Qwen2.5-7B-Instruct-GGUF", "Qwen2.5-7B-Instruct-Q4_K_M.gguf", 4.68),
    HubModel("qwen3-0.6b", "Qwen/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q8_0.gguf", 0.64),
    HubModel("qwen3-8b", "Qwen/Qwen3-8B-GGUF", "Qwen3-8B-Q4_K_M.gguf", 5.03),
    HubModel("gemma3-1b", "bartowski/google_gemma-3-1b-it-GGUF", "google_gemma-3-1b-it-Q4_K_M.gguf", 0.81),
    HubModel("gemma3-4b", "bartowski/google_gemma-3-4b-it-GGUF", "google_gemma-3-4b-it-Q4_K_M.gguf", 2.49),
    HubModel("phi3-mini", "microsoft/Phi-3-mini-4k-instruct-gguf", "Phi-3-mini-4k-instruct-q4.gguf", 2.39),
    HubModel("phi3.5-mini", "bartowski/Phi-3.5-mini-instruct-GGUF", "Phi-3.5-mini-instruct-Q4_K_M.gguf", 2.39),
    HubModel("phi4-mini", "bartowski/microsoft_Phi-4-mini-instruct-GGUF", "microsoft_Phi-4-mini-instruct-Q4_K_M.gguf", 2.49),
)}  # fmt: skip


# --------------------------------------------------------------------------- the environment
# huggingface_hub reads these once, at import; kvrun reads them when asked and passes them on,
# so that a process whose environment changed (tests, the server) gets what it says.
def hub_cache() -> Path:
    """The HF cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(env["HF_HUB_CACHE"])).expanduser()
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def endpoint() -> str:
    """$HF_ENDPOINT, else huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def offline() -> bool:
    """HF_HUB_OFFLINE=1: use the cache, never the network."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


# ------------------------------------------------------------------------- names and quants
_REPO = re.compile(r"[\w.-]+/[\w.-]+")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})(\.gguf)$", re.I)
_QUANT = re.compile(
    r"(?<![a-z0-9])(i?q\d(?:_[a-z0-9]+)*|tq\d_\d|b?fp?(?:16|32)|mxfp4)(?![a-z0-9])", re.I
)


def parse_ref(text: str, bare: bool = False) -> HubRef | None:
    """`hf:REPO[:QUANT]` as a HubRef, None for anything else; with bare (`kvrun pull`), also
    `REPO[:QUANT]` where REPO is owner/name."""
    if text.startswith("hf:"):
        text = text[3:]
    elif not (bare and "/" in text):
        return None
    repo, _, quant = text.partition(":")
    if not _REPO.fullmatch(repo):
        raise KvrunError(
            f"{repo!r} is not a Hugging Face repo: give OWNER/NAME[:QUANT], e.g. "
            f"hf:{HUB_MODELS['llama3-8b'].repo}:Q4_K_M"
        )
    return HubRef(repo, quant or None)


def _stem(name: str) -> str:
    """A GGUF file name without its folder, split suffix and extension."""
    base = _SPLIT.sub("", name.rsplit("/", 1)[-1])
    return re.sub(r"\.gguf$", "", base, flags=re.I)


def quant_of(name: str) -> str | None:
    """The quant type a GGUF file name carries (Q4_K_M, IQ4_XS, F16, ...), upper case."""
    found = _QUANT.findall(_stem(name))
    return found[-1].upper() if found else None


@dataclass(frozen=True, slots=True)
class GGUFEntry:
    """One model of a repo: a GGUF file, or every part of a split one (part 1 is what loads)."""

    files: tuple[str, ...]
    quant: str | None


def gguf_entries(names: Iterable[str]) -> list[GGUFEntry]:
    """The GGUF models among a repo's file names, split parts as one entry naming all its
    parts (present or not); vision projectors (mmproj) left out."""
    out = {}
    for name in names:
        base = name.rsplit("/", 1)[-1].lower()
        if not base.endswith(".gguf") or "mmproj" in base:
            continue
        m = _SPLIT.search(name)
        if m is None:
            out[name] = GGUFEntry((name,), quant_of(name))
            continue
        n = int(m[2])
        parts = tuple(f"{name[: m.start()]}-{i:05d}-of-{n:05d}{m[3]}" for i in range(1, n + 1))
        out[parts[0]] = GGUFEntry(parts, quant_of(name))
    return [out[k] for k in sorted(out)]


def pick(entries: list[GGUFEntry], ref: HubRef) -> GGUFEntry:
    """The GGUF a ref names: its pinned file, the file or quant asked for, else Q4_K_M, else
    the repo's only GGUF; where none or several match, the error lists the repo's quants."""
    if ref.file or (ref.quant or "").lower().endswith(".gguf"):
        want = ref.file or ref.quant
        hits = [e for e in entries if want in e.files or e.files[0].rsplit("/", 1)[-1] == want]
    else:
        want = (ref.quant or DEFAULT_QUANT).upper()
        ends = tuple(sep + want for sep in "-._")
        hits = [e for e in entries if e.quant == want or _stem(e.files[0]).upper().endswith(ends)]
        if not hits and ref.quant is None and len(entries) == 1:
            hits = entries
    if len(hits) == 1:
        return hits[0]
    if not entries:
        raise QuantNotFound(f"{ref.repo} holds no GGUF files")
    names = ", ".join(e.files[0] for e in hits)
    if hits:
        raise QuantNotFound(
            f"{want} matches {len(hits)} files in {ref.repo} ({names}); name one: "
            f"`kvrun pull {ref.repo}:FILE.gguf`"
        )
    quants = sorted({e.quant or e.files[0] for e in entries})
    what = want if ref.quant or ref.file else f"{DEFAULT_QUANT} (the default) and several GGUFs"
    raise QuantNotFound(
        f"{ref.repo} has no {what}; its quants: {', '.join(quants)} "
        f"(e.g. `kvrun pull {ref.repo}:{quants[-1]}`)"
    )


# ------------------------------------------------------------------------------- the cache
def _listing(repo: str) -> list[str] | None:
    """The repo's file names at main as the cache knows them: the whole listing where
    snapshot_download stored it, else the files present; None: nothing cached."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return [f.path for f in get_cached_repo_tree(repo, cache_dir=hub_cache())]
    except CachedRepoTreeNotFoundError:
        pass
    folder = hub_cache() / f"models--{repo.replace('/', '--')}"
    ref = folder / "refs" / "main"
    snap = folder / "snapshots" / (ref.read_text().strip() if ref.is_file() else "-")
    if not snap.is_dir():
        return None
    return [p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file()]


def find_local(ref: HubRef) -> Path | None:
    """The cached file (part 1 of a split one) or folder a ref names, with no network call;
    None when it is not all there."""
    from huggingface_hub import snapshot_download, try_to_load_from_cache
    from huggingface_hub.errors import LocalEntryNotFoundError

    if ref.file:
        entries = gguf_entries([ref.file]) or [GGUFEntry((ref.file,), None)]
    else:
        names = _listing(ref.repo)
        if names is None:
            return None
        entries = gguf_entries(names)
        if not entries and not ref.quant:
            try:
                folder = snapshot_download(
                    ref.repo,
                    cache_dir=hub_cache(),
                    local_files_only=True,
                    allow_patterns=FOLDER_FILES,
                )
            except LocalEntryNotFoundError:
                return None
            return Path(folder) if (Path(folder) / "config.json").is_file() else None
    try:
        entry = pick(entries, ref)
    except QuantNotFound:
        return None
    paths = [try_to_load_from_cache(ref.repo, f, cache_dir=hub_cache()) for f in entry.files]
    return Path(paths[0]) if all(isinstance(p, str) for p in paths) else None


@dataclass(frozen=True, slots=True)
class CachedModel:
    name: str  # what -m takes: hf:REPO:QUANT, hf:REPO for a folder; the path off main
    path: Path
    size: int


def cached_models() -> list[CachedModel]:
    """The GGUF models (all parts present) and safetensors folders in the HF cache."""
    from huggingface_hub import CacheNotFound, scan_cache_dir

    try:
        info = scan_cache_dir(hub_cache())
    except CacheNotFound:
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            sizes = {
                f.file_path.relative_to(rev.snapshot_path).as_posix(): f.size_on_disk
                for f in rev.files
            }
            entries = [e for e in gguf_entries(sizes) if all(f in sizes for f in e.files)]
            quants = [e.quant for e in entries]
            for e in entries:
                tag = e.quant if e.quant and quants.count(e.quant) == 1 else e.files[0]
                path = rev.snapshot_path / e.files[0]
                name = f"hf:{repo.repo_id}:{tag}" if "main" in rev.refs else str(path)
                out.append(CachedModel(name, path, sum(sizes[f] for f in e.files)))
            weights = [s for f, s in sizes.items() if f.endswith(".safetensors")]
            if not entries and "config.json" in sizes and weights:
                name = f"hf:{repo.repo_id}" if "main" in rev.refs else str(rev.snapshot_path)
                out.append(CachedModel(name, rev.snapshot_path, sum(weights)))
    return out
