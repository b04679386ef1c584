"""HF -> GGUF with the real tokenizers in ../shared/tokenizers: a Llama 2 / Mistral style folder
that carries only tokenizer.json (SentencePiece BPE with byte fallback) becomes a 'llama'
vocabulary, a Llama 3.1 folder a byte-level BPE ('gpt2', llama-bpe). Checked against the
folder's own tokenizer (tokenizers), llama.cpp's ids (golden ids in
tests/data/tokenizer_golden.json, and live where llama-cpp-python is in bench/.venv-llamacpp)
and the metadata keys llama.cpp's convert_hf_to_gguf.py writes (tests/llamacpp_peer.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer

import llamacpp_peer
import tiny_models
from kvrun.convert import convert
from kvrun.models.file_headers import gguf_metadata, open_gguf
from kvrun.models.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("KVRUN_SHARED", ROOT.parent / "shared")) / "tokenizers"
GOLDEN = Path(__file__).resolve().parent / "data" / "tokenizer_golden.json"
TEXTS = [
    "Hello world",
    "  two  spaces\tand\ttabs\n\nnew lines   ",
    "12345 67.89 1,000,000 and 2024-11-27",
    "Привет мир, 你好世界, こんにちは, مرحبا, नमस्ते",
    "emoji 🦙🚀 and a family 👩‍👩‍👧",
    "ÜnïcÖdé ✓ naïve café",
    "def f(x):\n    return x**2  # a comment",
    "a </s> in the middle and <s> too",
    "specials <|begin_of_text|> and <|eot_id|> as text",
]
FOLDERS = {  # name -> (shared folder, vocab size, bos, eos)
    "llama2": ("llama2", 32000, 1, 2),
    "llama3_1": ("llama3_1", 128256, 128000, [128001, 128008, 128009]),
}


def hf_folder(name: str, dest: Path) -> Path:
    """A tiny random-weight Llama HF folder with the real tokenizer files of `name`."""
    sub, vocab, bos, eos = FOLDERS[name]
    src = SHARED / sub
    if not (src / "tokenizer.json").exists():
        pytest.skip(f"no {src}/tokenizer.json (the shared tokenizers folder)")
    model = tiny_models.make_hf_model("llama", None, True, 4, 2, None, 0, vocab)
    model.config.bos_token_id, model.config.eos_token_id = bos, eos
    model.save_pretrained(dest, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dest / f)
    return dest


@pytest.fixture(scope="module", params=list(FOLDERS))
def folder(request, tmp_path_factory):
    """A tiny random-weight HF folder with the real tokenizer files, converted to GGUF."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    hf = hf_folder(name, root / "hf")
    out = convert(hf, root / "m.gguf", outtype="f32")
    gold = json.loads(GOLDEN.read_text("utf-8"))["families"][name]
    return {
        "name": name,
        "hf": hf,
        "gguf": out,
        "meta": gguf_metadata(open_gguf(out)),
        "gold": gold,
    }


def _hf_ids(folder) -> list[list[int]]:
    tok = HFTokenizer.from_file(str(folder["hf"] / "tokenizer.json"))
    return [tok.encode(t).ids for t in TEXTS]


def test_the_vocabulary_kind(folder):
    meta = folder["meta"]
    if folder["name"] == "llama2":
        assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.pre"] == "default"
        types = meta["tokenizer.ggml.token_type"]
        assert types.count(gguf.TokenType.BYTE) == 256
        assert types[:3] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        assert meta["tokenizer.ggml.unknown_token_id"] == 0
        scores = meta["tokenizer.ggml.scores"]
        assert len(scores) == len(meta["tokenizer.ggml.tokens"]) and len(set(scores)) > 1000
        assert "tokenizer.ggml.merges" not in meta
    else:
        assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "llama-bpe"
        assert len(meta["tokenizer.ggml.merges"]) > 100_000


def test_kvrun_tokens_from_the_gguf_equal_the_folders(folder):
    tok = Tokenizer.from_gguf(folder["meta"])
    for text, want in zip(TEXTS, _hf_ids(folder), strict=True):
        assert tok.encode(text) == want, text


def test_kvrun_tokens_from_the_gguf_equal_llama_cpp_golden(folder):
    gold, tok = folder["gold"], Tokenizer.from_gguf(folder["meta"])
    assert gold["texts"] == TEXTS, "rerun tests/data/make_tokenizer_golden.py"
    assert [tok.encode(t, add_bos=False) for t in TEXTS] == gold["special"]
    assert [tok.encode(t, add_bos=False, special=False) for t in TEXTS] == gold["plain"]
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (gold["bos"], gold["eos"], gold["add_bos"])
    assert tok.stop_ids == set(gold["eog"])
    want = _hf_ids(folder)  # and llama.cpp agrees with the folder's own tokenizer here
    assert [[gold["bos"]] * gold["add_bos"] + ids for ids in gold["special"]] == want


@pytest.mark.slow  # a subprocess
@pytest.mark.skipif(
    not llamacpp_peer.PYTHON.exists(), reason=f"no llama-cpp-python at {llamacpp_peer.PYTHON}"
)
def test_llama_cpp_reads_the_gguf_and_gives_the_same_tokens(folder):
    live = llamacpp_peer.tokenize(folder["gguf"], TEXTS)
    for key in ("add_bos", "bos", "eos", "eog", "special", "plain"):
        assert live[key] == folder["gold"][key], key


@pytest.mark.slow  # a subprocess
def test_metadata_keys_equal_llama_cpp_converters(folder, tmp_path):
    ref = llamacpp_peer.convert(folder["hf"], tmp_path / "ref.gguf", "f32")
    theirs = gguf_metadata(open_gguf(ref))
    ours = folder["meta"]
    assert set(ours) == set(theirs)
    same = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")  # fmt: skip
    for key in same:
        assert ours[key] == theirs[key], key
    if folder["name"] == "llama3_1":
        assert ours["tokenizer.ggml.merges"] == theirs["tokenizer.ggml.merges"]
        assert ours["tokenizer.ggml.token_type"] == theirs["tokenizer.ggml.token_type"]
