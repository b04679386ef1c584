"""Tokenizer: GGUF BPE (SmolLM2) and SentencePiece paths against transformers / sentencepiece."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm
from tokenizers import pre_tokenizers

from kvrun.errors import KvrunError, UnsupportedModel
from kvrun.models.tokenizer import Tokenizer, _bpe_backend

DEFAULT_GGUF = Path.home() / ".cache" / "kvrun" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

MIXED = (
    "def fib(n: int) -> int:\n"
    "    if n < 2:\n"
    "        return n  # base case\n"
    "    return fib(n - 1) + fib(n - 2)\n\n"
    "Numbers: 12345, 3.14159, -0.5e10 and 2024-11-23.\n"
    "Unicode: café, naïve, Ωmega, 😀👍🏽, 中文字符, 日本語, العربية\n"
    "   leading spaces,\ttabs\r\nand  double  spaces   \n"
    "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\nI'm fine, you're kind.\n"
)
TEXTS = [MIXED, "", " ", "12345", "  x", "<|endoftext|>", "a<|im_end|>b", "don't WE'LL 'S"]


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    if not DEFAULT_GGUF.is_file():
        pytest.skip(f"default model GGUF not found at {DEFAULT_GGUF} (pull it first)")
    return DEFAULT_GGUF


@pytest.fixture(scope="module")
def smol(default_gguf: Path) -> Tokenizer:
    import gguf

    reader = gguf.GGUFReader(default_gguf)
    meta = {n: f.contents() for n, f in reader.fields.items() if n.startswith("tokenizer.")}
    return Tokenizer.from_gguf(meta)


@pytest.fixture(scope="module")
def hf_smol(default_gguf: Path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name
    )
    # transformers ignores tokenizer.ggml.pre == "smollm" and splits with the plain GPT-2
    # regex; llama.cpp (and SmolLM2's own tokenizer.json) split digits one by one first.
    # Give transformers SmolLM2's real pre-tokenizer so both sides mean the same thing.
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    return hf


def test_smollm2_ids_match_transformers(smol: Tokenizer, hf_smol) -> None:
    for text in TEXTS:
        assert smol.encode(text) == hf_smol.encode(text, add_special_tokens=False), text
    digits = smol.encode("12345")
    assert len(digits) == 5 and digits == [smol.encode(d)[0] for d in "12345"]


def test_smollm2_specials(smol: Tokenizer) -> None:
    assert {0, 2} <= smol.stop_ids  # <|endoftext|>, <|im_end|>
    assert (smol.bos_id, smol.eos_id, smol.add_bos, smol.vocab_size) == (1, 2, False, 49152)
    assert smol.encode("<|im_start|>user") == [1, *smol.encode("user")]
    plain = smol.encode("<|im_start|>user", special=False)
    assert 1 not in plain and smol.decode(plain) == "<|im_start|>user"
    assert smol.encode("hi", add_bos=True) == [1, *smol.encode("hi")]
    assert smol.encode("<|im_start|>hi", add_bos=True).count(1) == 1  # never a double BOS
    assert smol.decode(smol.encode("<|im_start|>hi<|im_end|>"), skip_special=True) == "hi"


@pytest.mark.parametrize("skip_special", [False, True])
def test_smollm2_roundtrip_and_stream(smol: Tokenizer, skip_special: bool) -> None:
    ids = smol.encode(MIXED)
    assert smol.decode(ids) == MIXED
    stream = smol.stream(skip_special=skip_special)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == smol.decode(ids, skip_special=skip_special)
    assert not any("\ufffd" in p for p in pieces)  # emoji / CJK bytes are held until complete
    assert sum(p == "" for p in pieces) > 0  # ...which this text does need


def test_save_hf_roundtrip(smol: Tokenizer, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    smol.save_hf(tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == smol.encode(text) == hf.encode(text), text
    assert ours.chat_template == smol.chat_template is not None
    assert (ours.bos_id, ours.eos_id, ours.add_bos, ours.stop_ids) == (1, 2, False, smol.stop_ids)
    msgs = [{"role": "user", "content": "Hi"}]
    assert ours.render_chat(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)  # fmt: skip


# --- SentencePiece ('llama') path, on a tiny model trained here --------------------------------

SPM_TEXTS = [
    "the quick brown fox",
    " leading space",
    "  two  spaces   and trailing ",
    "unseen: ✓ 中文 😀 Ωmega ½",
    "café naïve\nnew line\ttab",
    "",
    " ",
    "tokens<s>look</s>special",
    "ＡＢＣ ﬁ 12345",
]


def _train(directory: Path, name: str, **options) -> Path:
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog hello world piece merge café naïve 42".split()
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(1500)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(directory / name), model_type="bpe",
        vocab_size=400, byte_fallback=True, minloglevel=2, **options,
    )  # fmt: skip
    return directory / f"{name}.model"


@pytest.fixture(scope="module")
def llama_spm(tmp_path_factory) -> Path:
    """Llama-style: identity normalization, dummy prefix, whitespace kept as is."""
    return _train(
        tmp_path_factory.mktemp("spm"), "llama", normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, split_digits=True,
    )  # fmt: skip


def _gguf_meta(model: Path) -> dict:
    sp = spm.SentencePieceProcessor(model_file=str(model))
    ids = range(sp.get_piece_size())
    kinds = [(sp.is_control, 3), (sp.is_unknown, 2), (sp.is_byte, 6), (sp.is_unused, 5)]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in ids],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in ids],
        "tokenizer.ggml.token_type": [next((t for f, t in kinds if f(i)), 1) for i in ids],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
    }


def _hf_dir(model: Path, **files) -> Path:
    directory = model.parent / f"{model.stem}_hf"
    directory.mkdir(exist_ok=True)
    shutil.copy(model, directory / "tokenizer.model")
    for name, content in files.items():
        (directory / f"{name}.json").write_text(json.dumps(content))
    return directory


def test_spm_gguf_matches_sentencepiece(llama_spm: Path) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(llama_spm))
    tok = Tokenizer.from_gguf(_gguf_meta(llama_spm))
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.stop_ids) == (1, 2, True, {2})
    for text in SPM_TEXTS:
        ids = tok.encode(text, add_bos=False, special=False)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids), text
    assert any(sp.is_byte(i) for i in tok.encode("中文 😀"))  # byte fallback was exercised
    assert tok.encode("the") == [1, *sp.encode("the")]
    assert tok.encode("<s>the").count(1) == 1  # a BOS already there is not doubled
    assert tok.encode("the</s>", add_bos=False) == [*sp.encode("the"), 2]


@pytest.mark.parametrize("skip_special", [False, True])
def test_spm_stream_keeps_spaces(llama_spm: Path, skip_special: bool) -> None:
    tok = Tokenizer.from_gguf(_gguf_meta(llama_spm))
    ids = tok.encode("hello world</s> the  lazy</s> dog ✓😀 x")
    stream = tok.stream(skip_special=skip_special)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tok.decode(ids, skip_special=skip_special)


def test_stream_after_keeps_first_space(llama_spm: Path, smol: Tokenizer) -> None:
    for tok in (Tokenizer.from_gguf(_gguf_meta(llama_spm)), smol):
        ids = tok.encode("the quick brown fox", add_bos=False)
        stream = tok.stream(after=ids[1])
        text = "".join(stream.push(i) for i in ids[2:]) + stream.flush()
        assert text == tok.decode(ids)[len(tok.decode(ids[:2])) :] == " brown fox"


def test_spm_hf_dir_matches_sentencepiece(llama_spm: Path, tmp_path: Path) -> None:
    # a default-trained model too: nmt_nfkc normalization and extra-whitespace removal
    default = _train(tmp_path, "default")
    for model in (llama_spm, default):
        sp = spm.SentencePieceProcessor(model_file=str(model))
        tok = Tokenizer.from_hf_dir(_hf_dir(model))
        assert tok.add_bos and tok.bos_id == 1
        for text in SPM_TEXTS:
            ids = tok.encode(text, add_bos=False, special=False)
            assert ids == sp.encode(text), (model.name, text)
            assert tok.decode(ids) == sp.decode(ids), (model.name, text)


def test_spm_save_hf_matches_transformers(llama_spm: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer.from_gguf(_gguf_meta(llama_spm))
    tok.save_hf(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in SPM_TEXTS:
        assert hf.encode(text) == tok.encode(text) == Tokenizer.from_hf_dir(tmp_path).encode(text)


def test_hf_dir_configs(llama_spm: Path) -> None:
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    config = {"chat_template": templates, "add_bos_token": False, "eos_token": {"content": "</s>"}}
    directory = _hf_dir(llama_spm, tokenizer_config=config, generation_config={"eos_token_id": [2, 7]})  # fmt: skip
    tok = Tokenizer.from_hf_dir(directory)
    assert (tok.chat_template, tok.add_bos, tok.eos_id) == ("D", False, 2)
    assert {2, 7} <= tok.stop_ids


# --- pre-tokenizers and errors --------------------------------------------------------------


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        ("smollm", "ab 12345", ["ab", "Ġ", "1", "2", "3", "4", "5"]),
        ("gpt2", "ab 12345", ["ab", "Ġ12345"]),
        ("llama-bpe", "ab 12345 I'M", ["ab", "Ġ", "123", "45", "ĠI", "'M"]),
        ("qwen2", "ab 123", ["ab", "Ġ", "1", "2", "3"]),
        ("tekken", "HelloWorld 12", ["Hello", "World", "Ġ", "1", "2"]),
        ("default", "a+=12345", ["a", "+=", "123", "45"]),
    ],
)
def test_pre_tokenizers(pre: str, text: str, pieces: list[str]) -> None:
    split = _bpe_backend([], [], pre).pre_tokenizer.pre_tokenize_str(text)
    assert [p for p, _ in split] == pieces


def test_unknown_pre_warns_and_uses_gpt2() -> None:
    with pytest.warns(UserWarning, match="unknown pre-tokenizer 'xyz'"):
        backend = _bpe_backend([], [], "xyz")
    assert [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("ab 12")] == ["ab", "Ġ12"]


def test_bad_input_errors(tmp_path: Path) -> None:
    meta = {"tokenizer.ggml.model": "xyz", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(UnsupportedModel, match=r"tokenizer type 'xyz' is not supported \(supported: gpt2, llama\)"):  # fmt: skip
        Tokenizer.from_gguf(meta)
    with pytest.raises(UnsupportedModel):
        Tokenizer.from_gguf({})
    with pytest.raises(KvrunError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer.from_hf_dir(tmp_path)


def test_malformed_inputs_are_kvrun_errors(tmp_path: Path) -> None:
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(UnsupportedModel, match="no tokenizer.ggml.merges"):
        Tokenizer.from_gguf(meta)
    with pytest.raises(UnsupportedModel, match="cannot build the GGUF tokenizer"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.merges": ["x y"]})  # x, y not in vocab
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(KvrunError, match="tokenizer.json is not valid JSON"):
        Tokenizer.from_hf_dir(tmp_path)
