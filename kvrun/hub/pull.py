"""`kvrun pull` from Hugging Face: what kvrun/hub/names.py names, downloaded into the HF cache with
huggingface_hub; a pull cut short goes on where it stopped, and every way it can fail is one
line that says what to do."""

from __future__ import annotations

import errno
import glob
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from ..errors import DiskFull, GatedRepo, HubError, HubOffline, QuantNotFound, RepoNotFound
from ..report import human_bytes
from .names import (
    FOLDER_FILES,
    HubRef,
    endpoint,
    find_local,
    gguf_entries,
    hub_cache,
    offline,
    pick,
)


def pull(ref: HubRef, log: Callable[[str], None] = print, quiet: bool = False, label=None) -> Path:
    """What a ref names, from the HF cache or else downloaded into it (a partial download goes
    on where it stopped); the path of the GGUF (part 1) or of the folder."""
    label = label or str(ref)
    found = find_local(ref)
    if found is not None:
        log(f"{label} is already in {found}")
        return found
    if offline():
        raise HubOffline(
            f"{label} is not in the Hugging Face cache ({hub_cache()}) and HF_HUB_OFFLINE is "
            "set: unset it to download, or pull it where the hub can be reached"
        )
    with _hub_errors(ref, label):
        path, size = _download(ref, label, log, quiet)
    log(f"saved {path} ({human_bytes(size)})")
    return path


def _download(ref: HubRef, label: str, log, quiet: bool) -> tuple[Path, int]:
    """The files a ref names at main: their blobs fetched here (resumable), then linked into
    the snapshot by snapshot_download; the path kvrun loads and the bytes pulled."""
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url, snapshot_download
    from huggingface_hub.utils import filter_repo_objects

    info = HfApi(endpoint=endpoint()).model_info(ref.repo, revision="main")
    names = [s.rfilename for s in info.siblings or []]
    entries = gguf_entries(names)
    if entries or ref.quant or ref.file:
        if not entries and "config.json" in names:
            raise QuantNotFound(
                f"{ref.repo} holds no GGUF files but an HF safetensors model: "
                f"pull it with no quant, as hf:{ref.repo}"
            )
        files, patterns = list(pick(entries, ref).files), None
    else:
        files, patterns = (
            list(filter_repo_objects(names, allow_patterns=FOLDER_FILES)),
            FOLDER_FILES,
        )
        if "config.json" not in files or not any(f.endswith(".safetensors") for f in files):
            raise HubError(
                f"{ref.repo} holds neither GGUF files nor an HF safetensors model "
                "(config.json and *.safetensors)"
            )
    metas = {
        f: get_hf_file_metadata(hf_hub_url(ref.repo, f, revision=info.sha, endpoint=endpoint()))
        for f in files
    }
    storage = hub_cache() / f"models--{ref.repo.replace('/', '--')}"
    _check_space(storage, metas, label)
    with download_bar(quiet) as bar:
        for f in files:
            _fetch_blob(ref.repo, f, info.sha, metas[f], storage, bar, log)
    # the blobs are in place: huggingface_hub links them into the snapshot, writes refs/main
    # and the repo's listing (which find_local reads offline)
    folder = snapshot_download(
        ref.repo,
        revision="main",
        cache_dir=hub_cache(),
        endpoint=endpoint(),
        allow_patterns=patterns or [glob.escape(f) for f in files],
        tqdm_class=_silent_tqdm(),
    )
    size = sum(m.size or 0 for m in metas.values())
    return (Path(folder) / files[0] if patterns is None else Path(folder)), size


def _check_space(storage: Path, metas: dict, label: str) -> None:
    """Refuse a download that cannot fit, before it starts."""
    need = 0
    for meta in metas.values():
        blob = storage / "blobs" / meta.etag
        part = blob.with_name(blob.name + ".incomplete")
        if not blob.exists():
            need += (meta.size or 0) - (part.stat().st_size if part.exists() else 0)
    where = next(p for p in (storage, *storage.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if need > free:
        raise DiskFull(
            f"no room for {label}: it needs {human_bytes(need)} in {storage.parent}, which has "
            f"{human_bytes(free)} free; free some space or set HF_HOME (or HF_HUB_CACHE) to a "
            "disk with room"
        )


def _fetch_blob(repo: str, file: str, commit: str, meta, storage: Path, bar, log) -> None:
    """One file into the cache's blobs/ under its etag, appended to `<etag>.incomplete` and
    moved in place when whole. huggingface_hub 2.x starts every download afresh in a file of
    its own; this name, the one older versions resumed from, lets a pull stopped by Ctrl-C, a
    kill or a cut go on where it stopped (its own retries resume within one process)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    blob = storage / "blobs" / meta.etag
    if blob.exists():
        return
    blob.parent.mkdir(parents=True, exist_ok=True)
    part = blob.with_name(blob.name + ".incomplete")
    lock = storage.parent / ".locks" / storage.name / f"{meta.etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):  # the lock huggingface_hub takes for this blob
        if blob.exists():
            return
        have = part.stat().st_size if part.exists() else 0
        if meta.size is not None and have > meta.size:
            part.unlink()
            have = 0
        task = bar.add_task(file.rsplit("/", 1)[-1], total=meta.size)
        url = hf_hub_url(repo, file, revision=commit, endpoint=endpoint())
        try:
            with open(part, "ab") as f:
                http_get(
                    url,
                    f,
                    resume_size=have,
                    headers=build_hf_headers(),
                    expected_size=meta.size,
                    displayed_filename=file,
                    tqdm_class=_tqdm_on(bar, task),
                )
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            kept = part.stat().st_size
            raise DiskFull(
                f"the disk of {storage.parent} is full: {file} needs "
                f"{human_bytes((meta.size or kept) - kept)} more ({human_bytes(kept)} kept; "
                "`kvrun pull` goes on from there); free some space or set HF_HOME (or "
                "HF_HUB_CACHE) to a disk with room"
            ) from None
        except KeyboardInterrupt:
            kept = part.stat().st_size if part.exists() else 0
            log(f"stopped: {human_bytes(kept)} of {file} kept; pulling again goes on from there")
            raise
        os.replace(part, blob)


def http_get(*args, **kw):
    """huggingface_hub's streaming GET (Range from resume_size, retries on a cut connection)."""
    from huggingface_hub.file_download import http_get as get

    return get(*args, **kw)


@contextmanager
def _hub_errors(ref: HubRef, label: str):
    """huggingface_hub's and the network's errors as one line that says what to do."""
    import httpx2
    from huggingface_hub import errors as hf

    page = f"https://huggingface.co/{ref.repo}"
    try:
        yield
    except hf.GatedRepoError:
        raise GatedRepo(
            f"{ref.repo} is gated: accept its licence at {page}, then set HF_TOKEN to a token "
            "of that account or log in (`hf auth login`, or `huggingface-cli login`)"
        ) from None
    except hf.RepositoryNotFoundError:
        raise RepoNotFound(
            f"no model repo {ref.repo} on {endpoint()}: check the name at {page} (a private "
            "repo also needs HF_TOKEN or `hf auth login`)"
        ) from None
    except (hf.RevisionNotFoundError, hf.RemoteEntryNotFoundError) as e:
        raise HubError(f"{label}: {_first_line(e)}") from None
    except (hf.OfflineModeIsEnabled, hf.LocalEntryNotFoundError, httpx2.TransportError) as e:
        raise HubOffline(
            f"{label} is not in the Hugging Face cache ({hub_cache()}) and the hub "
            f"({endpoint()}) cannot be reached ({type(e).__name__}): check the network or "
            "proxy, or set HF_HUB_OFFLINE=1 to use only what the cache holds"
        ) from None
    except hf.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise HubError(f"the hub answered {status} for {label}; try again later") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DiskFull(f"the disk of {hub_cache()} is full while pulling {label}") from None
        raise HubError(f"could not pull {label} into {hub_cache()}: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ------------------------------------------------------------------------------ progress
def download_bar(quiet: bool = False):
    """kvrun's progress convention (kvrun.progress) for downloads: on a terminal a transient
    bar with bytes, rate and time left; elsewhere LineProgress lines every few seconds."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from ..progress import LineProgress, err_console

    if not sys.stderr.isatty():
        return LineProgress(bytes_mode=True, quiet=quiet)
    cols = [TextColumn("{task.description}"), BarColumn(), DownloadColumn()]
    cols += [TransferSpeedColumn(), TimeRemainingColumn()]
    return Progress(*cols, console=err_console, transient=True)


def _tqdm_on(bar, task: int):
    """A class with the part of tqdm that http_get drives, moving `task` on a kvrun bar."""

    class Tqdm:
        def __init__(self, total=None, initial=0, **_):
            bar.update(task, total=total, completed=initial)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n=1):
            bar.update(task, advance=n)

        def close(self):
            pass

    return Tqdm


def _silent_tqdm():
    """tqdm switched off: snapshot_download only links blobs already fetched, nothing to show."""
    from tqdm.auto import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kw):
            kw["disable"] = True
            super().__init__(*args, **kw)

    return Silent
