"""The native CPU kernels (kernels/cpu/): compiled on first use, loaded as torch ops.

`ops()` gives `torch.ops.kvrun_cpu` (qmm, dequant, repack, unpack, isa, set_isa, ...; see
kernels/cpu/qops.cpp), or None where they cannot run here: no C++ compiler, a failed build,
a CPU other than x86-64 or aarch64 Linux/macOS builds we have not tried, or
KVRUN_NATIVE=off. Then `note()` says why in one line and kvrun runs PyTorch's path.

The first use on a machine compiles the sources into
`$KVRUN_CACHE/native/<key>/kvrun_cpu.so` (default ~/.cache/kvrun; KVRUN_NATIVE_DIR moves it),
saying so in one line on stderr (~20 s on 2 cores). qkernels.cpp is compiled once per
instruction set: portable C++ always, and on x86-64 the AVX2, AVX-512 VNNI and AVX-VNNI
builds this CPU can run (explicit flags, never -march=native); qops.cpp picks the best at run
time (KVRUN_NATIVE_ISA=portable|avx2|avx512vnni|avxvnni forces one). The key hashes the
sources, the compiler, torch's version and the CPU, so a new kvrun, torch or machine builds
afresh; a lock makes concurrent processes wait for one build instead of racing.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

_NOTE = {"text": ""}
NAME = "kvrun_cpu.so"
FAILED = "build-failed.txt"  # a failed build's first error, beside where the library would be
# instruction sets beside the portable build: (name, compiler flags, /proc/cpuinfo flags needed)
X86_ISAS = (
    ("avx2", ["-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"}),
    (
        "avx512vnni",
        ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
    ),
    ("avxvnni", ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"], {"avx2", "fma", "f16c", "avx_vnni"}),
)
COMMON = ["-O3", "-std=c++17", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-DNDEBUG"]
# how the library is put together beyond COMMON (bumped when that changes, so old builds are
# not reused): 2 = qops.cpp with OpenMP, linked to torch's own runtime
RECIPE = 2


def source_dir() -> Path:
    """kernels/cpu, where the package's kernels live (installed as kvrun.kernels.cpu), found
    without importing kvrun.kernels (which imports torch)."""
    from importlib.util import find_spec

    return Path(find_spec("kvrun.kernels").submodule_search_locations[0]) / "cpu"


def note() -> str:
    """Why the native kernels are not in use ('' where they are)."""
    return _NOTE["text"]


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isas_to_build() -> list[tuple[str, list[str]]]:
    """The instruction sets compiled here: portable, and the x86 ones this CPU runs."""
    out = [("portable", [])]
    if platform.machine() in ("x86_64", "AMD64"):
        have = cpu_flags()
        out += [(name, flags) for name, flags, need in X86_ISAS if need <= have]
    return out


def build_dir() -> Path:
    root = os.environ.get("KVRUN_NATIVE_DIR")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("KVRUN_CACHE") or "~/.cache/kvrun").expanduser() / "native"


def compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _key(cxx: str, isas: list[tuple[str, list[str]]]) -> str:
    h = hashlib.sha256()
    for f in sorted(source_dir().iterdir()):
        if f.suffix in (".cpp", ".h"):
            h.update(f.name.encode() + f.read_bytes())
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    except OSError:
        version = cxx
    h.update(version.encode())
    h.update(_torch_version().encode())
    h.update(repr(isas).encode())
    h.update(repr((COMMON, RECIPE)).encode())
    h.update(str(sorted(cpu_flags())).encode())
    return h.hexdigest()[:16]


def build_key() -> str:
    """The key of the native build this machine uses ('' without a compiler): what a measured
    crossover depends on beside torch and the CPU."""
    cxx = compiler()
    return _key(cxx, isas_to_build()) if cxx else ""


def _torch_version() -> str:
    """torch's version without importing it (`kvrun info` imports no torch)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "?"


def _torch_flags() -> tuple[list[str], list[str]]:
    import torch
    from torch.utils import cpp_extension

    inc = [f"-I{p}" for p in cpp_extension.include_paths()]
    lib = Path(torch.__file__).parent / "lib"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    link = [f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
    omp = _torch_openmp(lib)
    if omp is None:
        return [*inc, abi], link
    # at::parallel_for is inline: under torch's OpenMP backend it is an `omp parallel` region
    # compiled into qops.cpp itself, which runs on one thread unless qops.cpp is built with
    # OpenMP. The region must run on torch's pool, so the runtime linked is the one torch
    # loads (by path, never the compiler's own copy: two runtimes would be two pools).
    return [*inc, abi, "-fopenmp"], [*link, str(omp)]


def _torch_openmp(lib: Path) -> Path | None:
    """The OpenMP runtime torch's parallel_for runs on (libgomp / libomp / libiomp5 beside
    libtorch, or the one libtorch_cpu names), or None where torch's backend is not OpenMP."""
    import torch

    if "OpenMP" not in torch.__config__.parallel_info().split("backend:", 1)[-1].split("\n")[0]:
        return None
    for pattern in ("libgomp*.so*", "libiomp5*.so*", "libomp*.so*", "libomp*.dylib"):
        found = sorted(lib.glob(pattern))
        if found:
            return found[0]
    try:  # a torch that uses the system's runtime (distribution builds)
        out = subprocess.run(["ldd", str(lib / "libtorch_cpu.so")], capture_output=True, text=True)
    except OSError:
        return None
    for line in out.stdout.splitlines():
        name, _, rest = line.strip().partition(" => ")
        if "omp" in name and rest.split(" (")[0].startswith("/"):
            return Path(rest.split(" (")[0])
    return None


def _compile(cxx: str, isas, out: Path) -> None:
    """Compile every object in parallel, then link `out` (raises RuntimeError with the log)."""
    src = source_dir()
    tflags, link = _torch_flags()
    work = Path(tempfile.mkdtemp(prefix="build-", dir=out.parent))
    try:
        jobs, objs = [], []
        for name, flags in isas:
            obj = work / f"qkernels_{name}.o"
            table = f"-DKVQ_TABLE=kvq_table_{'generic' if name == 'portable' else name}"
            cmd = [cxx, *COMMON, *flags, table, "-c", str(src / "qkernels.cpp"), "-o", str(obj)]
            jobs.append(cmd)
            objs.append(obj)
        have = [f"-DKVQ_HAVE_{name.upper()}" for name, _ in isas if name != "portable"]
        ops_obj = work / "qops.o"
        jobs.append(
            [
                cxx,
                *COMMON,
                "-std=c++20",
                *tflags,
                *have,
                "-c",
                str(src / "qops.cpp"),
                "-o",
                str(ops_obj),
            ]
        )
        procs = [
            subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for c in jobs
        ]
        for cmd, p in zip(jobs, procs, strict=True):
            log, _ = p.communicate()
            if p.returncode:
                raise RuntimeError(f"{Path(cmd[-3]).name}: {_first_error(log)}")
        tmp = work / NAME
        res = subprocess.run(
            [cxx, "-shared", *map(str, objs), str(ops_obj), "-o", str(tmp), *link],
            capture_output=True,
            text=True,
        )
        if res.returncode:
            raise RuntimeError(f"link: {_first_error(res.stdout + res.stderr)}")
        tmp.replace(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _first_error(log: str) -> str:
    lines = [ln for ln in log.splitlines() if "error" in ln.lower()]
    return (lines[0] if lines else log.strip().splitlines()[-1] if log.strip() else "failed")[:300]


@functools.cache
def ops():
    """torch.ops.kvrun_cpu once the library is built and loaded, else None (`note()` says why)."""
    import torch

    if _off():
        _NOTE["text"] = "native CPU kernels off (KVRUN_NATIVE=off): PyTorch's products"
        return None
    if hasattr(torch.ops, "kvrun_cpu") and hasattr(torch.ops.kvrun_cpu, "qmm"):
        return _chosen(torch.ops.kvrun_cpu)
    cxx = compiler()
    if cxx is None:
        where = f" at CXX={os.environ['CXX']}" if os.environ.get("CXX") else " found"
        _NOTE["text"] = (  # one line, under 80 columns where it can be
            f"no C++ compiler{where}: PyTorch's slower products run; install g++ or set CXX"
        )
        return None
    isas = isas_to_build()
    where = build_dir() / _key(cxx, isas)
    lib, failed = where / NAME, where / FAILED
    try:
        if failed.exists():  # built and failed with these sources, compiler and torch
            raise RuntimeError(failed.read_text().strip())
        where.mkdir(parents=True, exist_ok=True)
        if not lib.exists():
            _build_locked(cxx, isas, lib)
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as e:
        _NOTE["text"] = f"native CPU kernels unavailable ({e}); PyTorch's products instead"
        return None
    return _chosen(torch.ops.kvrun_cpu)


def _build_locked(cxx: str, isas, lib: Path) -> None:
    import fcntl

    with open(lib.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait for it
        if lib.exists():
            return
        names = ", ".join(n for n, _ in isas)
        print(
            f"kvrun: building the native CPU kernels ({names}) into {lib.parent}, once...",
            file=sys.stderr,
            flush=True,
        )
        try:
            _compile(cxx, isas, lib)
        except RuntimeError as e:  # kept, so later runs say why without building again
            (lib.parent / FAILED).write_text(f"{e}\n")
            raise


def _chosen(mod):
    want = os.environ.get("KVRUN_NATIVE_ISA")
    if want:
        try:
            mod.set_isa(want)
        except RuntimeError as e:
            from ..errors import KvrunError

            raise KvrunError(f"KVRUN_NATIVE_ISA: {str(e).splitlines()[0]}") from None
    return mod


def expected() -> tuple[bool, str]:
    """Whether a model loaded here will run on the native kernels, and in words, without
    building them or importing torch (`kvrun info`): built already, or buildable (a compiler
    is present)."""
    if _off():
        return False, "off (KVRUN_NATIVE=off)"
    torch = sys.modules.get("torch")
    if (
        torch is not None
        and hasattr(torch.ops, "kvrun_cpu")
        and hasattr(torch.ops.kvrun_cpu, "qmm")
    ):
        return True, torch.ops.kvrun_cpu.isa()
    cxx = compiler()
    if cxx is None:
        return False, "no C++ compiler (g++): PyTorch's products"
    isas = isas_to_build()
    names = ", ".join(n for n, _ in isas)
    if (build_dir() / _key(cxx, isas) / NAME).exists():
        return True, f"built ({names})"
    return True, f"built on the first load ({names})"


def _off() -> bool:
    return os.environ.get("KVRUN_NATIVE", "on").lower() in ("0", "off", "no", "false")


def isa() -> str | None:
    """The instruction set the native products run on here, or None without them."""
    mod = ops()
    return None if mod is None else mod.isa()
