"""Damaged model files give one line that names the problem (the tensor cut short and the
bytes missing, the file that is not JSON) and a non-zero exit, never numpy's or serde's
text alone (the GGUF cases are in test_cli.py::test_truncated_gguf)."""

from __future__ import annotations

import shutil

import pytest
from cli_checks import one_error_line
from click.testing import CliRunner

import tiny_models
from kvrun.cli.main import cli


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return tiny_models.build(tmp_path_factory.mktemp("tiny")).hf_dir


def damaged(hf, tmp_path, name: str, data: bytes):
    d = tmp_path / "model"
    shutil.copytree(hf, d)
    (d / name).write_bytes(data)
    return d


def generate(model):
    return CliRunner().invoke(cli, ["generate", "-m", str(model), "-p", "hi", "-n", "1"],
                              catch_exceptions=False)  # fmt: skip


def test_safetensors_cut_short_names_the_tensor(hf, tmp_path):
    raw = (hf / "model.safetensors").read_bytes()
    d = damaged(hf, tmp_path, "model.safetensors", raw[: len(raw) // 2])
    one_error_line(generate(d), "model.safetensors", "is cut short", "bytes are missing",
                   "more tensors lie past the end")  # fmt: skip


def test_safetensors_bad_header(hf, tmp_path):
    raw = bytearray((hf / "model.safetensors").read_bytes())
    raw[8:12] = b"{{{{"
    d = damaged(hf, tmp_path, "model.safetensors", bytes(raw))
    one_error_line(generate(d), "header is not valid JSON")
    raw[:8] = (10**12).to_bytes(8, "little")
    (d / "model.safetensors").write_bytes(bytes(raw))
    one_error_line(generate(d), "header claims 1,000,000,000,000 bytes")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_tokenizer_files_that_are_not_json(hf, tmp_path, name):
    d = damaged(hf, tmp_path, name, b"not json {")
    one_error_line(generate(d), name, "is not valid JSON")
