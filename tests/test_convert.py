"""kvrun.convert: GGUF -> HF and HF -> GGUF, checked against our loader and transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch

import tiny_models
from kvrun.convert import convert
from kvrun.errors import KvrunError, ModelNotFound
from kvrun.kv import FULL, build
from kvrun.models.file_headers import gguf_metadata, open_gguf
from kvrun.models.model import Transformer
from kvrun.models.tokenizer import Tokenizer
from kvrun.models.weights import load

DEFAULT_GGUF = Path.home() / ".cache/kvrun/models/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_TEXT = "Hello world! In 2024 I counted 12345 llamas; they ate 7.5 kg of hay."


@torch.inference_mode()
def _logits(path_or_weights, ids) -> torch.Tensor:
    """Our logits (T, V) for ids from a model file (or LoadedWeights), fp32, one full prefill."""
    w = path_or_weights
    w = load(w, torch.float32) if isinstance(w, (str, Path)) else w
    model = Transformer.from_weights(w.config, w.tensors, "cpu")
    kv = build(FULL, w.config, model.rope, torch.device("cpu"), torch.float32)
    return model(torch.tensor([ids]), torch.arange(len(ids)), kv)[0]


def _meta(path: Path) -> dict:
    return gguf_metadata(open_gguf(path))


# ------------------------------------------------------------------- default model
@pytest.fixture(scope="module")
def default_gguf() -> Path:
    if not DEFAULT_GGUF.exists():
        pytest.skip(f"default model not downloaded ({DEFAULT_GGUF} is absent)")
    return DEFAULT_GGUF


@pytest.fixture(scope="module")
def smol(default_gguf, tmp_path_factory):
    """The default model converted once to an HF dir, with our GGUF logits as reference."""
    hf_dir = convert(default_gguf, tmp_path_factory.mktemp("smol") / "hf")
    w = load(default_gguf, torch.float32)  # opening this GGUF alone takes seconds: once
    ids = w.tokenizer.encode(SMOL_TEXT)
    return {"hf": hf_dir, "tok": w.tokenizer, "meta": w.meta, "ids": ids, "ref": _logits(w, ids)}


def test_default_to_hf_files(smol):
    names = {p.name for p in smol["hf"].iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "generation_config.json" in names
    config = json.loads((smol["hf"] / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["architectures"] == ["LlamaForCausalLM"]
    tc = json.loads((smol["hf"] / "tokenizer_config.json").read_text())
    assert tc["gguf_pre"] == "smollm"
    assert tc["chat_template"] == smol["tok"].chat_template
    gen = json.loads((smol["hf"] / "generation_config.json").read_text())
    assert smol["tok"].eos_id in (gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]])  # fmt: skip
    from safetensors import safe_open

    with safe_open(str(smol["hf"] / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"


def test_default_hf_dir_gives_gguf_logits(smol):
    ours = _logits(smol["hf"], smol["ids"])
    torch.testing.assert_close(ours, smol["ref"], atol=1e-5, rtol=1e-5)


def test_default_hf_dir_loads_in_transformers(smol):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(smol["hf"])
    assert hf_tok(SMOL_TEXT)["input_ids"] == smol["ids"]  # digits: the smollm split survives
    chat = "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n"
    assert hf_tok(chat)["input_ids"] == smol["tok"].encode(chat)
    model = AutoModelForCausalLM.from_pretrained(smol["hf"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([smol["ids"]])).logits[0]
    torch.testing.assert_close(logits, smol["ref"], atol=1e-3, rtol=1e-3)


def test_default_round_trip_keeps_tokenizer(smol):
    back = load(convert(smol["hf"], smol["hf"].parent / "back.gguf", outtype="f16"), torch.float32)
    a, b = smol["meta"], back.meta
    for key in ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id"):
        assert a[f"tokenizer.ggml.{key}"] == b[f"tokenizer.ggml.{key}"], key
    assert a["tokenizer.ggml.add_bos_token"] == b["tokenizer.ggml.add_bos_token"]
    assert a["tokenizer.chat_template"] == b["tokenizer.chat_template"]
    tok = back.tokenizer
    assert tok.encode(SMOL_TEXT) == smol["ids"]
    messages = [{"role": "user", "content": "Hi there, 2 + 2?"}]
    assert tok.render_chat(messages) == smol["tok"].render_chat(messages)
    for key in ("block_count", "embedding_length", "attention.head_count_kv", "rope.freq_base"):
        assert a[f"llama.{key}"] == b[f"llama.{key}"], key
    # f16 of the dequantized Q4_1 weights: close to the original file's logits
    assert back.tensor_types["F16"] > 0
    torch.testing.assert_close(_logits(back, smol["ids"]), smol["ref"], atol=0.1, rtol=0.02)


# ---------------------------------------------------------------------- tiny models
CASES = {
    "llama-gqa": dict(),
    "llama-tied": dict(tied=True),
    "llama-rope-linear": dict(rope="linear"),
    "llama-rope-llama3": dict(rope="llama3"),
    "mistral-swa": dict(arch="mistral", sliding_window=8),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {n: tiny_models.build(tmp_path_factory.mktemp(n), **kw) for n, kw in CASES.items()}


@pytest.fixture(scope="module")
def ids():
    return tiny_models.make_tokenizer().encode(tiny_models.TEXT).ids


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_hf_to_gguf_f32_matches_hf(tiny, ids, tmp_path, case):
    t = tiny[case]
    out = convert(t.hf_dir, tmp_path / "m.gguf", outtype="f32")
    torch.testing.assert_close(_logits(out, ids), t.logits(ids), atol=1e-4, rtol=1e-4)
    meta = _meta(out)
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.pre"] == "gpt2"
    names = {x.name for x in open_gguf(out).tensors}
    assert ("output.weight" in names) == (not t.hf.config.tie_word_embeddings)
    assert ("rope_freqs.weight" in names) == (case == "llama-rope-llama3")


@pytest.mark.parametrize("case", ["llama-gqa", "llama-tied"])
def test_transformers_loads_our_gguf(tiny, ids, tmp_path, case):
    from transformers import AutoModelForCausalLM

    t = tiny[case]
    out = convert(t.hf_dir, tmp_path / "m.gguf", outtype="f32")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([ids])).logits[0]
    # an independent check of our Q/K permutation: transformers undoes llama.cpp's
    torch.testing.assert_close(logits, t.logits(ids), atol=1e-4, rtol=1e-4)


def test_tiny_q8_0_is_close(tiny, ids, tmp_path):
    t = tiny["llama-gqa"]
    out = convert(t.hf_dir, tmp_path / "m.gguf", outtype="q8_0")
    types = {x.name: x.tensor_type for x in open_gguf(out).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert _meta(out)["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    # each weight within about half a Q8_0 step (its 32-block's max / 127, stored as f16)
    ours = load(out, torch.float32).tensors
    hf = dict(t.hf.state_dict())
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
        w = hf[name].reshape(-1, 32)
        step = w.abs().amax(-1, keepdim=True) / 127
        ratio = float(((ours[name].reshape(-1, 32) - w).abs() / step).max())
        assert ratio < 0.6, (name, ratio)
    ref = t.logits(ids)
    err = (_logits(out, ids) - ref).abs().max() / ref.abs().max()
    assert err < 0.1, err


@pytest.mark.parametrize("outtype", ["auto", "f16", "bf16"])
def test_tiny_hf_to_gguf_other_types(tiny, ids, tmp_path, outtype):
    t = tiny["llama-gqa"]
    out = convert(t.hf_dir, tmp_path, outtype=outtype)  # a directory: the name is chosen
    assert out.parent == tmp_path and out.suffix == ".gguf"
    want = {"auto": "F32", "f16": "F16", "bf16": "BF16"}[outtype]
    assert {x.name: x.tensor_type.name for x in open_gguf(out).tensors}["output.weight"] == want
    ref = t.logits(ids)
    assert (_logits(out, ids) - ref).abs().max() / ref.abs().max() < 0.1


@pytest.mark.parametrize("case", ["llama-gqa", "llama-tied", "llama-rope-linear", "mistral-swa"])
def test_tiny_gguf_to_hf_matches_hf(tiny, ids, tmp_path, case):
    from transformers import AutoModelForCausalLM

    t = tiny[case]
    out = convert(t.gguf_path, tmp_path / "hf")
    torch.testing.assert_close(_logits(out, ids), t.logits(ids), atol=1e-4, rtol=1e-4)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == type(t.hf).__name__
    assert getattr(model.config, "sliding_window", None) == getattr(t.hf.config, "sliding_window", None)  # fmt: skip
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, t.logits(ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("outtype", ["f16", "bf16"])
def test_tiny_gguf_to_hf_half(tiny, ids, tmp_path, outtype):
    from safetensors import safe_open

    t = tiny["llama-gqa"]
    out = convert(t.gguf_path, tmp_path / "hf", outtype=outtype)
    name = {"f16": "float16", "bf16": "bfloat16"}[outtype]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == name
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == getattr(torch, name)
    ref = t.logits(ids)
    assert (_logits(out, ids) - ref).abs().max() / ref.abs().max() < 0.1


def test_gguf_with_rope_freqs_is_refused(tiny, tmp_path):
    with pytest.raises(KvrunError, match="rope_freqs"):
        convert(tiny["llama-rope-llama3"].gguf_path, tmp_path / "hf")


def test_digit_split_tokenizer_becomes_smollm(tmp_path):
    t = tiny_models.build(tmp_path, digits=True)
    out = convert(t.hf_dir, tmp_path / "m.gguf", outtype="f32")
    meta = _meta(out)
    assert meta["tokenizer.ggml.pre"] == "smollm"
    text = "Call 0800 123 4567 at 9pm, 2 times."
    assert Tokenizer.from_gguf(meta).encode(text) == t.tokenizer.encode(text).ids
    assert meta["tokenizer.chat_template"] == tiny_models.CHAT_TEMPLATE
    types = meta["tokenizer.ggml.token_type"]
    assert [types[i] for i in range(3)] == [gguf.TokenType.CONTROL] * 3
    assert set(types[3:]) == {gguf.TokenType.NORMAL}


def test_outtype_and_destination_errors(tiny, tmp_path):
    t = tiny["llama-gqa"]
    with pytest.raises(KvrunError, match="outtype"):
        convert(t.hf_dir, tmp_path / "x.gguf", outtype="q4_k")
    with pytest.raises(KvrunError, match="outtype"):
        convert(t.gguf_path, tmp_path / "hf", outtype="q8_0")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(KvrunError, match="not empty"):
        convert(t.gguf_path, busy)
    assert (busy / "keep.txt").exists()
    (busy / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    convert(t.gguf_path, busy, overwrite=True)
    assert (busy / "config.json").exists() and (busy / "keep.txt").read_text() == "mine"
    assert not (busy / "model-00001-of-00002.safetensors").exists()
    torch.testing.assert_close(_logits(busy, [5, 6, 7]), t.logits([5, 6, 7]), atol=1e-4, rtol=1e-4)
    (tmp_path / "m.gguf").write_bytes(b"")
    with pytest.raises(KvrunError, match="exists"):
        convert(t.hf_dir, tmp_path / "m.gguf", outtype="f32")
    with pytest.raises(ModelNotFound):
        convert(tmp_path / "nothing", tmp_path / "out")
    (tmp_path / "junk").mkdir()
    with pytest.raises(KvrunError, match="neither"):
        convert(tmp_path / "junk", tmp_path / "out")


@pytest.fixture(scope="module")
def tiny_spm(tmp_path_factory):
    return tiny_models.build(tmp_path_factory.mktemp("spm"), spm=True)


def test_sentencepiece_hf_to_gguf(tiny_spm, tmp_path):
    t = tiny_spm
    out = convert(t.hf_dir, tmp_path / "m.gguf", outtype="f32")
    w = load(out, torch.float32)
    meta = w.meta
    assert meta["tokenizer.ggml.model"] == "llama"
    types = meta["tokenizer.ggml.token_type"]
    assert types.count(gguf.TokenType.BYTE) == 256
    assert types[:3] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    assert len(meta["tokenizer.ggml.scores"]) == tiny_models.SPM_VOCAB
    text = "Hello world, llamas read 42 keys. Ünïcödé ✓"  # unseen characters: byte fallback
    assert w.tokenizer.encode(text) == [1, *t.tokenizer.encode(text)]
    assert meta["tokenizer.ggml.add_space_prefix"] is True
    ids = w.tokenizer.encode(tiny_models.TEXT)
    torch.testing.assert_close(_logits(w, ids), t.logits(ids), atol=1e-4, rtol=1e-4)

    # Llama 2 dirs carry a tokenizer.json next to tokenizer.model (<unk> <s> </s> in it too)
    both = tmp_path / "both"
    shutil.copytree(t.hf_dir, both)
    w.tokenizer.save_hf(both)
    meta2 = _meta(convert(both, tmp_path / "m2.gguf", outtype="f32"))
    for key in ("tokens", "token_type", "scores", "add_space_prefix"):
        assert meta2[f"tokenizer.ggml.{key}"] == meta[f"tokenizer.ggml.{key}"], key


def test_sentencepiece_gguf_to_hf(tiny_spm, tmp_path):
    from transformers import AutoTokenizer

    t = tiny_spm
    out = convert(t.gguf_path, tmp_path / "hf")
    text = "Hello world, llamas read 42 keys. Ünïcödé ✓"
    want = [1, *t.tokenizer.encode(text)]
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == want
    ids = want[:20]
    torch.testing.assert_close(_logits(out, ids), t.logits(ids), atol=1e-4, rtol=1e-4)
