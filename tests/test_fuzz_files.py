"""Seeded fuzzing of the files kvrun reads from strangers (issue 46): GGUF files, an HF
folder's config.json, tokenizer.json, tokenizer_config.json (with generation_config.json),
tokenizer.model, chat templates and the packed-model cache. Each case mutates a tiny model's
real file (tests/fuzz_mutations.py: counts, offsets, dims, types and lengths out of range,
fields of the wrong type or removed, hostile templates; then cuts and byte flips), loads it
as the CLI does (in-process: `load_runtime`, the chat template, one short forward pass) and
sorts the outcome: a load, or one KvrunError line. Anything else fails the test: another
exception (a traceback at the CLI), a hang, a file created, changed or removed outside the
case's own, a GGUF header parse that allocates more than the file could hold, or a damaged
packed-cache entry used as it is.

    python tests/test_fuzz_files.py --cases 1000    # the counts per kind, as a table
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
import tracemalloc
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fuzz_mutations import (
    CONFIG_ADD,
    GENERATION_CONFIGS,
    TOKCONFIG_ADD,
    TOKENIZER_ADD,
    cache_mutation,
    gguf_mutation,
    gguf_string,
    json_mutation,
    spm_mutation,
    template_case,
    text_mutation,
    walk_gguf,
    write_gguf,
)

FAST, LONG = 40, 250  # cases per kind: the fast tier, and the slow one
# A header parse builds Python objects for what the file holds (a float: 32 bytes for 4 in
# the file), never anything for what a count or length declares beyond it.
ALLOC_FACTOR, ALLOC_SLACK = 10, 1 << 20
CASE_SECONDS = 30  # a case that runs longer hangs
MEMORY_CAP = 3 << 30  # address space the cases may add to the process's

# ------------------------------------------------------------------------------ outcomes


@dataclass
class Tally:
    """The counts of one kind's run and its first failures, in words."""

    kind: str
    cases: int = 0
    loaded: int = 0
    errors: int = 0  # one-line KvrunErrors
    tracebacks: int = 0  # another exception, a multi-line error, a hang, a large allocation
    side_effects: int = 0  # files created, changed or removed; a damaged cache entry used
    panics: int = 0  # of the errors: a tokenizers panic caught (Rust prints its own note too)
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(what)

    @property
    def clean(self) -> bool:
        return self.tracebacks == 0 and self.side_effects == 0

    def row(self) -> str:
        c = (self.cases, self.loaded, self.errors, self.tracebacks, self.side_effects, self.panics)
        return f"{self.kind:<22}" + "".join(f"{n:>9}" for n in c)


HEADER = f"{'kind':<22}" + "".join(
    f"{h:>9}" for h in ("cases", "loaded", "errors", "tracebk", "side-eff", "panics")
)


class _Hang(Exception):
    pass


class _Trusted(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: int):
    """A case that runs past `seconds` raises _Hang (in the main thread; elsewhere no limit)."""

    def on_alarm(*_):
        raise _Hang(f"ran past {seconds} s")

    try:
        old = signal.signal(signal.SIGALRM, on_alarm)
    except ValueError:
        yield
        return
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _classify(tally: Tally, label: str, run: Callable[[], object]) -> None:
    """Run one case and count its outcome."""
    from kvrun.errors import KvrunError

    tally.cases += 1
    try:
        with _deadline(CASE_SECONDS):
            run()
        tally.loaded += 1
    except _Trusted as e:
        tally.side_effects += 1
        tally.fail(f"{label}: {e}")
    except KvrunError as e:
        text = str(e)
        if "\n" in text or not text.strip() or len(text) > 2000:
            tally.tracebacks += 1
            tally.fail(f"{label}: not one line: {text[:300]!r}")
        else:
            tally.errors += 1
            tally.panics += type(e.__context__).__name__ == "PanicException"
    except BaseException as e:  # anything else is what the fuzzer looks for
        if isinstance(e, KeyboardInterrupt):
            raise
        tally.tracebacks += 1
        where = traceback.extract_tb(e.__traceback__)[-1]
        at = f"{Path(where.filename).name}:{where.lineno}"
        tally.fail(f"{label}: {type(e).__name__} at {at}: {str(e)[:300]}")


def _snapshot(dirs: list[Path]) -> dict[str, tuple[int, int]]:
    """Every file under `dirs`: path -> (size, mtime)."""
    out = {}
    for d in dirs:
        for root, _, files in os.walk(d):
            for f in files:
                p = os.path.join(root, f)
                with contextlib.suppress(OSError):
                    st = os.stat(p)
                    out[p] = (st.st_size, st.st_mtime_ns)
    return out


def _watched(
    tally: Tally, label: str, dirs: list[Path], own: set[Path], run: Callable[[], object]
) -> None:
    """Run a case, counting a file created, changed or removed under `dirs` (other than the
    case's own files `own`) as a side effect."""
    before = _snapshot(dirs)
    _classify(tally, label, run)
    after = _snapshot(dirs)
    changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    changed -= {str(p) for p in own}
    if changed:
        tally.side_effects += 1
        tally.fail(f"{label}: files changed: {sorted(changed)[:3]}")


# ------------------------------------------------------------------------------- loading


def _exercise(rt):
    """What `kvrun generate` does after the load, briefly: the chat prompt, its ids (with the
    texts of the vocabulary's last ids, where a damaged file's odd ones are), a forward pass
    of the first of them, the text back. Returns the logits."""
    import torch

    tok = rt.tokenizer
    top = tok.id_limit()
    text = "Hello world, 12 keys." + "".join(tok.token_text(i) for i in range(top - 8, top))
    if tok.chat_template is not None:
        text = tok.render_chat([{"role": "user", "content": text}])
    ids = tok.encode(text)[:6] or [0]
    with torch.inference_mode():
        logits = rt.model(torch.tensor([ids]), torch.arange(len(ids)), rt.new_kv())
    tok.decode(ids)
    return logits


def _load(path: Path, wtype: str = "f32", log: Callable[[str], None] = lambda m: None):
    from kvrun.run.runtime import load_runtime

    return load_runtime(str(path), "float32", "cpu", log=log, wtype=wtype)


def _load_and_run(path: Path, wtype: str = "f32"):
    return _exercise(_load(path, wtype))


@dataclass
class Seeds:
    """The real files cases start from: tiny models (tests/tiny_models.py), under root."""

    root: Path
    hf: Path  # byte-level BPE tokenizer.json
    gguf: Path  # F32, gpt2 vocabulary
    spm_hf: Path  # tokenizer.model
    spm_gguf: Path  # F32, llama (SentencePiece) vocabulary
    q8_gguf: Path  # Q8_0 weights (packed at load)


def make_seeds(root: Path) -> Seeds:
    """Build the seed models under root."""
    import tiny_models
    from kvrun.convert import convert

    bpe = tiny_models.build(root / "bpe")
    spm = tiny_models.build(root / "spm", spm=True)
    q8 = convert(bpe.hf_dir, root / "q8" / "model-q8.gguf", outtype="q8_0")
    return Seeds(root, bpe.hf_dir, bpe.gguf_path, spm.hf_dir, spm.gguf_path, q8)


# ---------------------------------------------------------------------------------- kinds


def _parse_bounded(path: Path, tally: Tally, label: str) -> None:
    """kvrun's GGUF header parse alone, under tracemalloc: its peak must stay within what the
    file can hold (a declared count or length is checked before anything is allocated)."""
    from kvrun.models.file_headers import open_gguf

    size = path.stat().st_size
    tracemalloc.start()
    try:
        open_gguf(path)
    except Exception:  # noqa: BLE001, S110 - the whole load reports what it raises
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    if peak > ALLOC_FACTOR * size + ALLOC_SLACK:
        tally.tracebacks += 1
        tally.fail(f"{label}: the header parse allocated {peak:,} bytes for a {size:,}-byte file")


def fuzz_gguf(seeds: Seeds, tally: Tally, n: int, rng: random.Random, work: Path) -> None:
    """GGUF files through kvrun's parser and loader (F32 seeds, dense or packed at load; a
    Q8_0 seed, its blocks kept or dequantized)."""
    plans = [(seeds.gguf, ["f32", "f32", "q8"]), (seeds.spm_gguf, ["f32"]),
             (seeds.q8_gguf, ["auto", "f32"])]  # fmt: skip
    layouts = [(p.read_bytes(), walk_gguf(p.read_bytes()), w) for p, w in plans]
    path = work / "model.gguf"
    for i in range(n):
        raw, lay, wtypes = layouts[i % len(layouts)]
        what, data = gguf_mutation(raw, lay, rng)
        path.write_bytes(data)
        wtype = rng.choice(wtypes)
        label = f"gguf #{i} ({what}) [{wtype}]"
        _parse_bounded(path, tally, label)
        _watched(tally, label, [work, seeds.root], {path}, lambda w=wtype: _load_and_run(path, w))


def _fuzz_folder_file(
    seeds: Seeds,
    tally: Tally,
    n: int,
    rng: random.Random,
    work: Path,
    name: str,
    mutate: Callable[[bytes, random.Random], tuple[str, bytes]],
    folder: Path | None = None,
    wtypes: tuple[str, ...] = ("f32",),
) -> None:
    """Cases that each rewrite one file of a copy of an HF folder, then load the folder."""
    d = work / "hf"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(folder or seeds.hf, d)
    target = d / name
    original = target.read_bytes()
    for i in range(n):
        what, data = mutate(original, rng)
        target.write_bytes(data)
        wtype = rng.choice(wtypes)
        label = f"{name} #{i} ({what}) [{wtype}]"
        _watched(tally, label, [work, seeds.root], {target}, lambda w=wtype: _load_and_run(d, w))


def _json_file(extra: dict | None = None) -> Callable[[bytes, random.Random], tuple[str, bytes]]:
    """A mutation of a JSON file: mostly structured, sometimes cut or flipped."""

    def mutate(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
        if rng.random() < 0.15:
            return text_mutation(raw, rng)
        what, obj = json_mutation(json.loads(raw), rng, extra)
        return what, json.dumps(obj).encode()

    return mutate


def fuzz_config(seeds: Seeds, tally: Tally, n: int, rng: random.Random, work: Path) -> None:
    """An HF folder's config.json: fields of the wrong type, absent or added."""
    _fuzz_folder_file(seeds, tally, n, rng, work, "config.json", _json_file(CONFIG_ADD),
                      wtypes=("f32", "f32", "q4"))  # fmt: skip


def fuzz_tokenizer_json(seeds: Seeds, tally: Tally, n: int, rng: random.Random, work: Path):
    """tokenizer.json: the tokenizers library's document, damaged."""
    _fuzz_folder_file(seeds, tally, n, rng, work, "tokenizer.json", _json_file(TOKENIZER_ADD))


def fuzz_tokenizer_config(seeds: Seeds, tally: Tally, n: int, rng: random.Random, work: Path):
    """tokenizer_config.json, then generation_config.json, beside the tokenizer."""
    half = n // 2
    config = _json_file(TOKCONFIG_ADD)
    _fuzz_folder_file(seeds, tally, n - half, rng, work, "tokenizer_config.json", config)

    def generation(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
        if rng.random() < 0.6:
            v = rng.choice(GENERATION_CONFIGS)
            return json.dumps(v), json.dumps(v).encode()
        return _json_file()(raw, rng)

    _fuzz_folder_file(seeds, tally, half, rng, work, "generation_config.json", generation)


def fuzz_tokenizer_model(seeds: Seeds, tally: Tally, n: int, rng: random.Random, work: Path):
    """tokenizer.model (a SentencePiece ModelProto) in an HF folder without tokenizer.json."""
    _fuzz_folder_file(seeds, tally, n, rng, work, "tokenizer.model", spm_mutation,
                      folder=seeds.spm_hf)  # fmt: skip


def fuzz_chat_template(seeds: Seeds, tally: Tally, n: int, rng: random.Random, work: Path):
    """Chat templates from tokenizer_config.json and from a GGUF's tokenizer.chat_template:
    the hostile list first (escapes that would leave a file behind in the watched folder,
    memory and time bombs), then random ones; rendered as `kvrun generate` renders them."""
    d = work / "hf"
    shutil.copytree(seeds.hf, d)
    config_path = d / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    lay = walk_gguf(seeds.gguf.read_bytes())
    kvs = [kv for kv in lay.kvs if kv[0] != "tokenizer.chat_template"]
    gguf_path = work / "model.gguf"
    for i in range(n):
        what, template = template_case(i, rng)
        template = template.replace("{pwned}", str(work / "pwned"))
        if rng.random() < 0.75:
            config_path.write_text(json.dumps({**config, "chat_template": template}))
            model, own = d, config_path
        else:
            entry = ("tokenizer.chat_template", 8, gguf_string(template))
            gguf_path.write_bytes(write_gguf(dataclasses.replace(lay, kvs=[*kvs, entry])))
            model, own = gguf_path, gguf_path
        label = f"chat_template #{i} ({what}: {template[:60]!r})"
        _watched(tally, label, [work, seeds.root], {own}, lambda m=model: _load_and_run(m))


def fuzz_packed_cache(seeds: Seeds, tally: Tally, n: int, rng: random.Random, work: Path):
    """Entries of the packed-model cache (kvrun/models/model_cache.py), damaged: the header's
    tensors and layout, the kvrun metadata, the header length, cuts and flips. An entry that
    does not read back whole must be built again (or be one line); one whose header changed
    without its digest must never be used as it is; one signed again (hostile) may load."""
    import torch

    from kvrun.models import model_cache

    with _environ({"KVRUN_CACHE": str(work / "cache"), "KVRUN_PACKED_CACHE": "on"}):
        plans, seen = [], set()
        for path, wtype in ((seeds.gguf, "q4"), (seeds.q8_gguf, "auto"), (seeds.hf, "q8")):
            ref = _exercise(_load(path, wtype))
            model_cache.wait()
            (entry,) = set((work / "cache" / "packed").glob("*.safetensors")) - seen
            seen.add(entry)
            plans.append((path, wtype, entry, entry.read_bytes(), ref))
        for i in range(n):
            path, wtype, entry, raw, ref = plans[i % len(plans)]
            what, data, strict = cache_mutation(raw, rng)
            entry.write_bytes(data)

            def run(path=path, wtype=wtype, ref=ref, strict=strict):
                said: list[str] = []
                rt = _load(path, wtype, said.append)
                model_cache.wait()
                logits = _exercise(rt)
                built = any("keeping the packed layout" in s for s in said)
                if strict and not built and not torch.equal(logits, ref):
                    raise _Trusted("a damaged entry was used as it is: the logits differ")

            label = f"packed_cache #{i} ({what})"
            _watched(tally, label, [work, seeds.root], {entry}, run)
            entry.write_bytes(raw)


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


KINDS: dict[str, Callable] = {
    "gguf": fuzz_gguf,
    "config.json": fuzz_config,
    "tokenizer.json": fuzz_tokenizer_json,
    "tokenizer_config.json": fuzz_tokenizer_config,
    "tokenizer.model": fuzz_tokenizer_model,
    "chat_template": fuzz_chat_template,
    "packed_cache": fuzz_packed_cache,
}

# ------------------------------------------------------------------------------ the runs


@contextlib.contextmanager
def _memory_cap(extra: int = MEMORY_CAP):
    """Cap this process's address space at its present size plus `extra`: an allocation bomb
    that gets past kvrun's bounds is then a MemoryError, not the machine's OOM killer."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            now = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (ImportError, OSError, ValueError):  # not Linux: no cap
        yield
        return
    old = resource.getrlimit(resource.RLIMIT_AS)
    cap = now + extra if old[1] == resource.RLIM_INFINITY else min(now + extra, old[1])
    resource.setrlimit(resource.RLIMIT_AS, (cap, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


def run_kind(kind: str, seeds: Seeds, cases: int, seed: int = 0) -> Tally:
    """`cases` seeded cases of one kind, in a folder of their own."""
    import warnings

    tally = Tally(kind)
    rng = random.Random(seed * 1_000_003 + zlib.crc32(kind.encode()))
    with (
        tempfile.TemporaryDirectory(prefix=f"fuzz-{kind}-") as tmp,
        warnings.catch_warnings(),
        _memory_cap(),
    ):
        warnings.simplefilter("ignore")  # unknown pre-tokenizers and the like say so
        KINDS[kind](seeds, tally, cases, rng, Path(tmp))
    return tally


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return make_seeds(tmp_path_factory.mktemp("seeds"))


@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_fast(kind, seeds, one_thread):
    """A few dozen seeded cases per kind: each loads or is one KvrunError line."""
    tally = run_kind(kind, seeds, FAST)
    print(f"\n{HEADER}\n{tally.row()}")
    assert tally.clean, "\n".join([tally.row(), *tally.failures])


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_long(kind, seeds, one_thread):
    """Several hundred cases per kind, from another seed."""
    tally = run_kind(kind, seeds, LONG, seed=1)
    print(f"\n{HEADER}\n{tally.row()}")
    assert tally.clean, "\n".join([tally.row(), *tally.failures])


def main() -> None:
    """`python tests/test_fuzz_files.py [--cases N] [--seed S] [--kind K] [-v]`: the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=FAST, help="cases per kind")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kind", action="append", choices=list(KINDS), help="(default: all)")
    ap.add_argument("-v", "--verbose", action="store_true", help="list the failures")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="kvrun-fuzz-") as tmp:
        # as tests/conftest.py sets the suite up: a cache folder of its own (the native
        # kernels where they are built once), the matmul path recorded, not timed
        native = os.path.join(os.path.expanduser("~/.cache/kvrun"), "native")
        env = {"KVRUN_CACHE": os.path.join(tmp, "kvrun"), "KVRUN_PACKED_CACHE": "off"}
        env["KVRUN_NATIVE_DIR"] = os.environ.get("KVRUN_NATIVE_DIR", native)
        with _environ(env):
            from kvrun.quant import choice, probes

            path = choice.measure_path("cpu", torch.float32, timed=False)
            probes.record(probes.matmul("cpu", "float32"), path)
            t0 = time.perf_counter()
            seeds = make_seeds(Path(tmp) / "seeds")
            print(HEADER)
            tallies = []
            for kind in args.kind or KINDS:
                tallies.append(run_kind(kind, seeds, args.cases, args.seed))
                print(tallies[-1].row(), flush=True)
                for f in tallies[-1].failures if args.verbose else ():
                    print("   ", f)
            print(f"({time.perf_counter() - t0:.1f} s)")
    sys.exit(0 if all(t.clean for t in tallies) else 1)


if __name__ == "__main__":
    main()
