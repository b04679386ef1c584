"""Model name resolution against the models folder and the Hugging Face cache (offline: a cache
laid out here as huggingface_hub lays it out; pulls themselves are in test_hub.py)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from kvrun.cli.main import cli
from kvrun.errors import KvrunError, ModelNotFound
from kvrun.hub.model_store import pull, resolve


@pytest.fixture(autouse=True)
def hf_home(tmp_path, monkeypatch):
    """An HF cache of the test's own, and no hub to reach (a closed port)."""
    for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    return tmp_path / "hf"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRUN_MODELS", str(tmp_path))
    return tmp_path


def test_name_matches_file_name(folder):
    target = folder / "Meta-Llama-3-8B-Instruct.Q4_K_M.gguf"
    target.write_bytes(b"GGUF")
    (folder / "Mistral-7B-v0.1.Q8_0.gguf").write_bytes(b"GGUF")
    assert resolve("llama3-8b") == target
    assert resolve("mistral-7b") == folder / "Mistral-7B-v0.1.Q8_0.gguf"


def test_name_matches_gguf_metadata(folder):
    path = folder / "model-a.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("Very Special Model")
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert resolve("very-special-model") == path


def test_hf_directory_by_name(folder):
    d = folder / "tiny-llama-hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert resolve("tiny-llama") == d


def test_unknown_name_lists_folder(folder):
    (folder / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFound, match="other.gguf"):
        resolve("llama2-7b")


def test_default_missing_says_pull(folder):
    with pytest.raises(ModelNotFound, match="kvrun pull smollm2"):
        resolve(None)


def test_path_wins(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF")
    assert resolve(str(f)) == f
    with pytest.raises(ModelNotFound, match="no such file"):
        resolve(str(tmp_path / "missing.gguf"))


def cache_file(hf_home, repo: str, name: str, data: bytes = b"GGUF") -> str:
    """A file in the HF cache as hf_hub_download leaves it: a blob, a snapshot link, refs/main."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / name).write_bytes(data)
    snap = root / "snapshots" / commit / name
    snap.parent.mkdir(parents=True, exist_ok=True)
    snap.symlink_to(f"../../blobs/{name}")
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return str(snap)


def test_what_other_tools_downloaded_is_found_offline(folder, hf_home):
    repo = "bartowski/Meta-Llama-3-8B-Instruct-GGUF"
    path = cache_file(hf_home, repo, "Meta-Llama-3-8B-Instruct-Q4_K_M.gguf")
    cache_file(hf_home, "o/split", "m-Q8_0-00001-of-00002.gguf")  # a part missing: not listed
    assert str(resolve("llama3-8b")) == path  # the short name's pinned file
    assert str(resolve(f"hf:{repo}")) == str(resolve(f"hf:{repo}:q4_k_m")) == path
    assert (
        str(pull("llama3-8b", log=lambda m: None)) == path
    )  # no hub reached: HF_ENDPOINT is closed
    with pytest.raises(ModelNotFound, match="kvrun pull hf:o/split:Q8_0"):
        resolve("hf:o/split:Q8_0")
    listing = json.loads(CliRunner().invoke(cli, ["models", "--json"]).stdout)
    assert listing["hf_cached"] == [{"name": f"hf:{repo}:Q4_K_M", "path": path, "bytes": 4}]
    assert {p["name"]: p["downloaded"] for p in listing["pullable"]}["llama3-8b"] is True


def test_short_names_pull_from_the_hub_and_names_fail_clearly(folder):
    with pytest.raises(ModelNotFound, match=r"`kvrun pull llama3-8b` \(4.92 GB"):
        resolve("llama3-8b")
    with pytest.raises(ModelNotFound, match=r"smollm2.*llama3-8b.*REPO\[:QUANT\]"):
        pull("nonexistent")
    with pytest.raises(KvrunError, match="not a Hugging Face repo"):
        resolve("hf:nonsense")
