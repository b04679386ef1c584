"""Model name resolution against the models folder."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from kvrun.errors import ModelNotFound
from kvrun.model_store import resolve


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
