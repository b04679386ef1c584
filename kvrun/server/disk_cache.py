"""kvrun serve's prefix cache on disk (--cache-dir DIR, --cache-disk SIZE): the caches the
in-memory prefix cache keeps, also written as .kvc files (kvrun/kvc.py), so a restarted server
goes on from them.

Files live in DIR/<model>/, one folder per model file's identity (kvc.model_identity: name,
size, a fingerprint of its content, the shapes), named by a hash of the KV spec and the token
ids they hold. A writer thread saves them off the request's path (a kept cache is never fed
again, only forked, so reading it while the engine runs is safe); the total is held within
the size limit, least recently used (file times) first out. At start the folder is scanned:
each file's header and token ids (not its tensors). The engine thread finds in that index
the longest file whose tokens are a proper prefix of the prompt (`longest`); a loader thread
reads it with the same checks as `--kv-cache` (kvc.load: model, spec, format, every tensor)
while the engine goes on with the other requests, and hands the cache back (`load_async`).
A file that fails the checks is deleted and the lookup is a miss, not an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import KvrunError

log = logging.getLogger("kvrun.serve")


@dataclass(slots=True)
class DiskEntry:
    spec: str  # spec_key of the request that kept it (its name's prefix)
    tokens: tuple[int, ...]
    nbytes: int  # the file's size


def spec_key(spec) -> str:
    """A request's KV spec (with its --kv-dtype) as the prefix of its files' names."""
    from ..run import kvc

    text = json.dumps({**kvc.spec_text(spec), "dtype": spec.dtype}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class DiskCache:
    """Kept caches as .kvc files under `root`, at most `limit` bytes of them."""

    def __init__(self, root: str | Path, limit: int):
        self.root, self.limit = Path(root), limit
        self.rt = None
        self.dir: Path | None = None
        self.entries: OrderedDict[Path, DiskEntry] = OrderedDict()  # oldest use first
        self.bytes = 0
        self.hits = self.misses = self.writes = self.evictions = 0
        self.hit_bytes = 0  # bytes read from hits
        self._lock = threading.Lock()  # entries: the engine thread and the writer
        self._todo: queue.Queue = queue.Queue(maxsize=64)
        self._thread: threading.Thread | None = None
        # loads, one at a time: a second would only share the disk with the first
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvrun-kvc-load")

    # ------------------------------------------------------------ the engine thread
    def attach(self, rt) -> None:
        """Open the model's folder and index its files (after the model loaded)."""
        from ..run import kvc

        self.rt = rt
        ident = json.dumps(kvc.model_identity(rt), sort_keys=True)
        self.dir = self.root / hashlib.sha256(ident.encode()).hexdigest()[:16]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KvrunError(f"--cache-dir {self.root}: {e.strerror or e}") from None
        found = []
        for path in self.dir.glob("*.kvc"):
            entry = self._index(path)
            if entry is not None:
                found.append((path.stat().st_mtime, path, entry))
        for _, path, entry in sorted(found, key=lambda x: x[0]):
            self.entries[path] = entry
            self.bytes += entry.nbytes
        self._evict()
        self._thread = threading.Thread(target=self._write_loop, name="kvrun-kvc", daemon=True)
        self._thread.start()

    def _index(self, path: Path) -> DiskEntry | None:
        """A file's spec and tokens, without its tensors; None (and the file deleted) when
        it is not a .kvc of this model."""
        from safetensors import safe_open

        from ..run import kvc

        try:
            header = kvc.read_header(path)
            kvc.check_model(header, self.rt, path)
            with safe_open(str(path), framework="pt") as f:
                tokens = f.get_tensor("tokens").tolist()
            if len(tokens) != header["tokens"] or "-" not in path.stem:
                raise KvrunError(f"{path}: its token count or its name is not the cache's")
            return DiskEntry(path.stem.split("-")[0], tuple(tokens), path.stat().st_size)
        except Exception as e:  # noqa: BLE001 - a stranger's or a cut file: not ours to use
            log.warning("prefix cache on disk: dropping %s (%s)", path.name, e)
            path.unlink(missing_ok=True)
            return None

    def _candidates(self, spec, ids: Sequence[int], longer_than: int) -> list[tuple[int, Path]]:
        """(tokens, path) of the files of spec holding a proper prefix of ids, longer than
        `longer_than` tokens, longest first."""
        key = spec_key(spec)
        with self._lock:
            cands = [
                (len(e.tokens), p)
                for p, e in self.entries.items()
                if e.spec == key
                and longer_than < len(e.tokens) < len(ids)
                and tuple(ids[: len(e.tokens)]) == e.tokens
            ]
        return sorted(cands, reverse=True)

    def longest(self, spec, ids: Sequence[int], longer_than: int = 0) -> int:
        """Tokens of the longest file `lookup` would try first (0: none), from the index
        alone: no file is read (the engine thread asks)."""
        cands = self._candidates(spec, ids, longer_than)
        return cands[0][0] if cands else 0

    def miss(self) -> None:
        """A lookup that found no file to try (counted as lookup's misses are)."""
        with self._lock:
            self.misses += 1

    def load_async(self, spec, ids: Sequence[int], longer_than: int, done: Callable) -> None:
        """`lookup` on the loader thread, then done(its result) there: reading and checking
        a file (a second or more for a long cache) never holds the engine thread."""

        def run() -> None:
            try:
                got = self.lookup(spec, ids, longer_than)
            except Exception as e:  # noqa: BLE001 - the request goes on without the file
                log.warning("prefix cache on disk: a load failed (%s)", e)
                self.miss()
                got = None
            done(got)

        self._loader.submit(run)

    def lookup(self, spec, ids: Sequence[int], longer_than: int = 0):
        """(kv, tokens) of the longest file of spec holding a proper prefix of ids, longer
        than `longer_than` tokens; None when there is none. Reads files: off the engine
        thread (load_async)."""
        from ..run import kvc

        want = kvc.spec_text(spec)
        for _, path in self._candidates(spec, ids, longer_than):
            try:  # the file's own spec and dtype, checked against the request's below
                kv, tokens, _ = kvc.load(path, self.rt)
                got = kvc.spec_text(kv.spec)
                if (got["kv"], got["budget"]) != (want["kv"], want["budget"]):
                    raise KvrunError(f"{path} holds --kv {got['kv']}, not {want['kv']}")
            except Exception as e:  # noqa: BLE001 - damaged, cut, renamed: not used again
                log.warning("prefix cache on disk: dropping %s (%s)", path.name, e)
                self._drop(path)
                continue
            with self._lock:
                if path in self.entries:
                    self.entries.move_to_end(path)
                    self.hit_bytes += self.entries[path].nbytes
                self.hits += 1
            try:
                os.utime(path)  # its use, for the LRU after a restart
            except OSError:  # evicted meanwhile: the cache is loaded all the same
                pass
            return kv, tokens
        self.miss()
        return None

    def keep(self, spec, tokens: Sequence[int], kv) -> None:
        """Write kv (kept, never fed again; a request of `spec` made it) holding tokens, off
        the request's path."""
        try:
            self._todo.put_nowait((spec_key(spec), list(tokens), kv))
        except queue.Full:  # the disk is slower than the requests: this one is skipped
            log.warning("prefix cache on disk: the writer is behind; a cache was not written")

    def close(self) -> None:
        """Finish the writes queued so far (a load in progress is left to end on its own)."""
        self._loader.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None and self._thread.is_alive():
            self._todo.put(None)
            self._thread.join(30)

    # ----------------------------------------------------------------- the writer
    def _name(self, key: str, tokens: list[int]) -> Path:
        h = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:32]
        return self.dir / f"{key}-{h}.kvc"

    def _write_loop(self) -> None:
        from ..run import kvc

        while True:
            item = self._todo.get()
            if item is None:
                return
            key, tokens, kv = item
            path = self._name(key, tokens)
            with self._lock:
                known = path in self.entries
            if known:
                os.utime(path)
                continue
            try:
                kvc.save(path, kv, tokens, self.rt)
                size = path.stat().st_size
            except Exception as e:  # noqa: BLE001 - a full disk must not stop the server
                log.warning("prefix cache on disk: cannot write %s (%s)", path.name, e)
                continue
            with self._lock:
                self.entries[path] = DiskEntry(key, tuple(tokens), size)
                self.bytes += size
                self.writes += 1
                self._evict()

    def _evict(self) -> None:
        while self.bytes > self.limit and self.entries:
            path, e = self.entries.popitem(last=False)
            self.bytes -= e.nbytes
            self.evictions += 1
            path.unlink(missing_ok=True)

    def _drop(self, path: Path) -> None:
        with self._lock:
            e = self.entries.pop(path, None)
            if e is not None:
                self.bytes -= e.nbytes
        path.unlink(missing_ok=True)

    def stats(self) -> dict[str, Any]:
        """Counters for /metrics."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "bytes": self.bytes,
                    "files": len(self.entries), "writes": self.writes,
                    "evictions": self.evictions, "hit_bytes": self.hit_bytes}  # fmt: skip
