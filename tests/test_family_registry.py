"""A family is one file and one registry line (kvrun/models/families/): a family made up here,
in the test alone, reads from HF, converts to a GGUF of its own architecture name, loads and
runs through the command line; the file that defines ModelConfig names no family."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import tiny_models
from kvrun.cli.main import cli
from kvrun.convert import convert
from kvrun.errors import UnsupportedModel
from kvrun.kv import FULL, build
from kvrun.models import families
from kvrun.models.config import ModelConfig
from kvrun.models.families import FAMILIES, Family
from kvrun.models.families.llama import LLAMA
from kvrun.models.file_headers import gguf_metadata, open_gguf
from kvrun.models.model import Transformer
from kvrun.models.weights import load

CLONE = dataclasses.replace(
    LLAMA, arch="llamaclone", hf_types=("llamaclone",), hf_class="LlamaCloneForCausalLM"
)


@torch.inference_mode()
def _logits(path: Path, ids: list[int]) -> torch.Tensor:
    """Our logits (T, V) of one prefill, fp32, from a model file."""
    w = load(path, torch.float32)
    model = Transformer.from_weights(w.config, w.tensors, "cpu")
    kv = build(FULL, w.config, model.rope, torch.device("cpu"), torch.float32)
    return model(torch.tensor([ids]), torch.arange(len(ids)), kv)[0]


def _generate(path: Path) -> dict:
    """`kvrun generate --json` on a model file, greedy."""
    args = ["generate", "-m", str(path), "-p", "Hello", "-n", "4", "--temp", "0", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama, and its HF folder again under the made-up model_type."""
    root = tmp_path_factory.mktemp("clone")
    t = tiny_models.build(root / "llama")
    clone = root / "clone-hf"
    shutil.copytree(t.hf_dir, clone)
    cfg = json.loads((clone / "config.json").read_text())
    cfg.update(model_type="llamaclone", architectures=["LlamaCloneForCausalLM"])
    (clone / "config.json").write_text(json.dumps(cfg))
    return t, clone


def test_a_made_up_family_runs_once_registered(tiny, tmp_path, monkeypatch):
    t, clone_hf = tiny
    with pytest.raises(UnsupportedModel, match="LlamaCloneForCausalLM"):
        ModelConfig.from_hf(clone_hf / "config.json")
    monkeypatch.setitem(FAMILIES, CLONE.arch, CLONE)  # the registry line, for this test only
    gguf_path = convert(clone_hf, tmp_path / "clone.gguf", outtype="f32")
    meta = gguf_metadata(open_gguf(gguf_path))
    assert meta["general.architecture"] == "llamaclone"
    assert meta["llamaclone.block_count"] == t.hf.config.num_hidden_layers
    ids = tiny_models.make_tokenizer().encode(tiny_models.TEXT).ids
    ours = _logits(gguf_path, ids)
    assert load(gguf_path, torch.float32).config.arch == "llamaclone"
    llama_path = convert(t.hf_dir, tmp_path / "llama.gguf", outtype="f32")
    assert torch.equal(ours, _logits(llama_path, ids))  # the same decoder, switched by fields
    back = tmp_path / "back-hf"
    convert(gguf_path, back, outtype="f32")
    assert json.loads((back / "config.json").read_text())["model_type"] == "llamaclone"
    runs = [_generate(p) for p in (gguf_path, llama_path)]
    assert runs[0]["tokens"] == runs[1]["tokens"] and runs[0]["generated_tokens"] >= 1

    monkeypatch.delitem(FAMILIES, CLONE.arch)
    with pytest.raises(UnsupportedModel, match="'llamaclone' is not supported"):
        load(gguf_path, torch.float32)


def test_every_family_is_found_by_its_names():
    for fam in FAMILIES.values():
        assert isinstance(fam, Family)
        assert families.from_gguf_arch(fam.arch) is fam
        for t in fam.hf_types:
            assert families.from_hf_type(t) is fam
    assert families.from_hf_type("gpt_neox") is None
    with pytest.raises(UnsupportedModel, match="kvrun runs: llama, mistral"):
        families.from_gguf_arch("gpt2")


def test_the_config_file_names_no_family():
    """ModelConfig's file reads what every family's files share; a family's own rules live in
    its file (a RoPE scaling kind named 'llama3' is a kind, not a family)."""
    import kvrun.models.config as config

    text = Path(config.__file__).read_text().lower().replace("llama3", "").replace("llama.cpp", "")
    names = {"llama", "mistral", "smollm", "qwen", "gemma", "phi"}
    names |= {re.sub(r"\d+$", "", f) for f in FAMILIES}
    assert not [n for n in names if n in text]
