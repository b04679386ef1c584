"""llama.cpp's own GGUF writer for tests: `convert_hf_to_gguf.py` with its `conversion/` package
and `gguf-py/`, as vendored in the llama-cpp-python sdist.

The sdist is fetched once from the package index (`pip download`, the only network a test
run has) and the three parts are extracted into a cache folder that later runs reuse:
`$KVRUN_TEST_TOOLS`, else ~/.cache/kvrun/test-tools. A checkout that already holds them in
bench/.llama.cpp (bench/vs_llamacpp.py puts them there) is used as it is.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors llama.cpp
ROOT = Path(__file__).resolve().parents[1]
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def _cache() -> Path:
    env = os.environ.get("KVRUN_TEST_TOOLS")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "kvrun" / "test-tools"
    return base / f"llama.cpp-{VERSION}"


def _extract(sdist: Path, dest: Path) -> None:
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name.removeprefix(prefix)
            if m.name.startswith(prefix) and rel.startswith(PARTS) and (m.isfile() or m.isdir()):
                m.name = rel
                members.append(m)
        tar.extractall(dest, members=members, filter="data")


def converter() -> Path:
    """The path of llama.cpp's convert_hf_to_gguf.py, fetched and extracted on first use.
    Raises RuntimeError (with pip's last line) when the sdist cannot be had."""
    local = ROOT / "bench" / ".llama.cpp" / "convert_hf_to_gguf.py"
    if local.exists():
        return local
    dest = _cache()
    script = dest / "convert_hf_to_gguf.py"
    if script.exists():
        return script
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".llama.cpp-{VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest-xdist workers fetch it once between them
        if script.exists():
            return script
        with tempfile.TemporaryDirectory(prefix="kvrun-llamacpp-", dir=dest.parent) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            cmd += ["--disable-pip-version-check", "-q", "-d", tmp, f"llama-cpp-python=={VERSION}"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            if done.returncode != 0 or not sdists:
                last = (done.stderr.strip().splitlines() or ["no sdist"])[-1]
                raise RuntimeError(f"cannot fetch the llama-cpp-python {VERSION} sdist: {last}")
            staging = Path(tmp) / "llama.cpp"
            _extract(sdists[0], staging)
            staging.rename(dest)
    return script


def convert(hf_dir: Path, out: Path, outtype: str = "f32", *extra: str) -> Path:
    """Write hf_dir as GGUF with llama.cpp's converter; returns `out`."""
    cmd = [sys.executable, str(converter()), str(hf_dir), "--outfile", str(out)]
    cmd += ["--outtype", outtype, *extra]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # its own gguf-py
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out


PYTHON = ROOT / "bench" / ".venv-llamacpp" / "bin" / "python"  # llama-cpp-python, if set up
_TOKENIZE = """
import json, sys, llama_cpp
m = llama_cpp.Llama(sys.argv[1], vocab_only=True, verbose=False)
v = llama_cpp.llama_model_get_vocab(m._model.model)
texts = json.loads(sys.stdin.read())
print(json.dumps({
    "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(v)),
    "bos": llama_cpp.llama_vocab_bos(v), "eos": llama_cpp.llama_vocab_eos(v),
    "eog": [i for i in range(llama_cpp.llama_vocab_n_tokens(v)) if llama_cpp.llama_vocab_is_eog(v, i)],
    "special": [m.tokenize(t.encode(), add_bos=False, special=True) for t in texts],
    "plain": [m.tokenize(t.encode(), add_bos=False, special=False) for t in texts],
}))
"""


def tokenize(gguf_path: Path, texts: list[str]) -> dict:
    """llama.cpp's reading of a GGUF vocabulary (llama-cpp-python in bench/.venv-llamacpp):
    add_bos, bos, eos, the end-of-generation ids, and each text's ids without BOS, with
    control-token texts parsed as specials ("special") and as plain text ("plain")."""
    done = subprocess.run([str(PYTHON), "-c", _TOKENIZE, str(gguf_path)], input=json.dumps(texts),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"llama-cpp-python failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)
