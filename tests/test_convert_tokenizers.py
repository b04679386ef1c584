"""HF -> GGUF with the real tokenizers in ../shared/tokenizers: a Llama 2 / Mistral style folder
that carries only tokenizer.json (SentencePiece BPE with byte fallback) becomes a 'llama'
vocabulary, a Llama 3.1 folder a byte-level BPE ('gpt2', llama-bpe). Checked against the
folder's own tokenizer (tokenizers), llama.cpp (llama-cpp-python in bench/.venv-llamacpp) and
the metadata keys llama.cpp's convert_hf_to_gguf.py writes (bench/.llama.cpp, from the
llama-cpp-python sdist's vendored llama.cpp); those two are skipped when absent."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer

import tiny_models
from kvrun.convert import convert
from kvrun.file_headers import gguf_metadata, open_gguf
from kvrun.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("KVRUN_SHARED", ROOT.parent / "shared")) / "tokenizers"
LLAMACPP_PY = ROOT / "bench" / ".venv-llamacpp" / "bin" / "python"
LLAMACPP_CONVERT = ROOT / "bench" / ".llama.cpp" / "convert_hf_to_gguf.py"
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


@pytest.fixture(scope="module", params=list(FOLDERS))
def folder(request, tmp_path_factory):
    """A tiny random-weight HF folder with the real tokenizer files, converted to GGUF."""
    name = request.param
    sub, vocab, bos, eos = FOLDERS[name]
    src = SHARED / sub
    if not (src / "tokenizer.json").exists():
        pytest.skip(f"no {src}/tokenizer.json (the shared tokenizers folder)")
    root = tmp_path_factory.mktemp(name)
    hf = root / "hf"
    model = tiny_models.make_hf_model("llama", None, True, 4, 2, None, 0, vocab)
    model.config.bos_token_id, model.config.eos_token_id = bos, eos
    model.save_pretrained(hf, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, hf / f)
    out = convert(hf, root / "m.gguf", outtype="f32")
    return {"name": name, "hf": hf, "gguf": out, "meta": gguf_metadata(open_gguf(out))}


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


@pytest.mark.slow  # a subprocess
@pytest.mark.skipif(not LLAMACPP_PY.exists(), reason=f"no llama-cpp-python at {LLAMACPP_PY}")
def test_llama_cpp_reads_the_gguf_and_gives_the_same_tokens(folder):
    code = (
        "import json, sys, llama_cpp\n"
        "m = llama_cpp.Llama(sys.argv[1], vocab_only=True, verbose=False)\n"
        "texts = json.loads(sys.stdin.read())\n"
        "print(json.dumps([m.tokenize(t.encode(), add_bos=True, special=True) for t in texts]))\n"
    )
    r = subprocess.run([str(LLAMACPP_PY), "-c", code, str(folder["gguf"])],
                       input=json.dumps(TEXTS), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout) == _hf_ids(folder)


@pytest.mark.skipif(
    not LLAMACPP_CONVERT.exists(),
    reason=f"no llama.cpp converter at {LLAMACPP_CONVERT} (extract vendor/llama.cpp/"
    "{convert_hf_to_gguf.py,gguf-py,conversion} from the llama-cpp-python sdist there)",
)
@pytest.mark.slow  # a subprocess
def test_metadata_keys_equal_llama_cpp_converters(folder, tmp_path):
    ref = tmp_path / "ref.gguf"
    env = dict(os.environ, PYTHONPATH=str(LLAMACPP_CONVERT.parent / "gguf-py"))
    r = subprocess.run([sys.executable, str(LLAMACPP_CONVERT), str(folder["hf"]), "--outfile",
                        str(ref), "--outtype", "f32"], capture_output=True, text=True, env=env,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
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
