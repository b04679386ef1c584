"""Qwen 3 and Gemma 3 tokenizers with the real files in ../shared/tokenizers.

kvrun's ids from GGUF equal llama.cpp's (golden ids in tests/data/tokenizer_golden.json, from
tests/data/make_tokenizer_golden.py: llama-cpp-python on GGUFs written by llama.cpp's own
convert_hf_to_gguf.py) and the folder's tokenizer.json (tokenizers); from the HF folder they
equal tokenizers'. Three GGUF vocabularies:

- qwen3: byte-level BPE, 'gpt2' with pre 'qwen2';
- gemma3: the folder as shipped (tokenizer.json only). llama.cpp's converter writes it as 'gpt2'
  with pre 'granite-embed-multi-311m' (its pre-tokenizer hash table gives that name), which
  llama.cpp reads as its GEMMA4 type: SentencePiece-style BPE on raw UTF-8;
- gemma3_spm: as Gemma 3 GGUFs on the hub are ('llama', scores, types, add_space_prefix
  false): the same folder plus a tokenizer.model made here from tokenizer.json (pieces, types,
  and minus each piece's first merge rank as its score), converted by llama.cpp's converter.

The fast tests build the GGUF vocabulary in memory with kvrun's conversion functions
(bpe_json_vocab, spm_json_vocab); the slow ones run llama.cpp's converter and check that it
writes the same keys, and run llama.cpp itself where bench/.venv-llamacpp exists.
"""

from __future__ import annotations

import json
import lzma
import os
from pathlib import Path

import pytest
from test_convert_tokenizers import TEXTS as BASE_TEXTS
from tokenizers import Tokenizer as HFTokenizer

import llamacpp_peer
from kvrun.errors import KvrunError
from kvrun.models.file_headers import gguf_metadata, open_gguf
from kvrun.models.tokenizer import Tokenizer, bpe_json_vocab, bpe_pre_name, spm_json_vocab

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("KVRUN_SHARED", ROOT.parent / "shared")) / "tokenizers"
GOLDEN = Path(__file__).resolve().parent / "data" / "tokenizer_golden.json"
QWEN_CHAT = (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n<|im_start|>assistant\n"
)
GEMMA_CHAT = (
    "<bos><start_of_turn>user\nBe brief.\n\n2+2?<end_of_turn>\n<start_of_turn>model\n4"
    "<end_of_turn>\n<start_of_turn>model\n"
)
TEXTS = [
    *BASE_TEXTS,
    QWEN_CHAT,
    GEMMA_CHAT,
    "<|endoftext|><|fim_prefix|>x<|fim_suffix|>y<|fim_middle|> <tool_call>{}</tool_call>",
    "<start_of_image><unused0><mask><pad><eos> [multimodal]",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * 0x1F;\n}\n",
    "\n\n\n   \t\t  \n \r\n\t \n",
    " " * 41
    + "forty-one spaces, then\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n",
    "中文字符和日本語のテキスト、한국어 텍스트도。",
    "😀👍🏽🇺🇸 ❤️‍🔥 🧑🏿‍💻 \U0001fae8",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you",
    "3.14159265358979 -0.5e10 1/3 ½ ² ³ ٣٤٥ ５６７ 1234567890123",
    "<table><tr><td>cell</td></tr></table> <b>bold</b>",
    "e\u0301 vs é, ﬁ ligature, Å Ω",
    '------======= ......!!!!!!?????? ```````""""',
    "",
    " ",
]
FAMILIES = {"qwen3": "qwen3", "gemma3": "gemma3", "gemma3_spm": "gemma3"}  # -> shared folder
# Where llama.cpp itself parts from tokenizers, kvrun's GGUF path follows llama.cpp: Qwen's
# tokenizer.json NFC-normalizes ('e' + U+0301 -> 'é'), llama.cpp does not; llama.cpp makes
# '</s>' a control token (an end-of-generation text: a plain entry in Qwen's vocabulary, a
# user-defined one in Gemma's, so read as text when specials are not parsed), and its
# converter makes added tokens that look special (<|fim_prefix|>, Gemma's <unused0>, <mask>)
# control tokens, read as text when specials are not parsed, where tokenizers always
# matches them (they are not 'special' in tokenizer.json).
LLAMACPP_DIFFERS = {
    ("qwen3", "special"): {TEXTS[7], TEXTS[21]},
    ("qwen3", "plain"): {TEXTS[11], TEXTS[21]},
    ("gemma3", "plain"): {TEXTS[7], TEXTS[12]},
    ("gemma3_spm", "plain"): {TEXTS[7], TEXTS[12]},
}


def tokenizer_files(sub: str) -> dict[str, bytes]:
    """tokenizer.json and tokenizer_config.json of a shared folder (the .xz ones unpacked)."""
    out = {}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = SHARED / sub / name
        if path.exists():
            out[name] = path.read_bytes()
        elif path.with_suffix(".json.xz").exists():
            out[name] = lzma.decompress(path.with_suffix(".json.xz").read_bytes())
        else:
            pytest.skip(f"no {path} (the shared tokenizers folder)")
    return out


def write_spm_model(tok_json: dict, path: Path) -> None:
    """A SentencePiece BPE tokenizer.model with tokenizer.json's pieces, the types a
    SentencePiece model gives them and spm_json_vocab's scores (Gemma's normalizer: identity,
    no dummy prefix, whitespace kept)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    piece_type = pb.ModelProto.SentencePiece
    _, scores, types = spm_json_vocab(tok_json, 0)
    pieces = {i: t for t, i in tok_json["model"]["vocab"].items()}
    added = {a["id"]: a for a in tok_json["added_tokens"]}
    pieces |= {i: a["content"] for i, a in added.items()}
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size, m.trainer_spec.byte_fallback = len(scores), True
    m.trainer_spec.pad_id, m.trainer_spec.eos_id, m.trainer_spec.bos_id = 0, 1, 2
    m.trainer_spec.unk_id = 3
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = m.normalizer_spec.remove_extra_whitespaces = False
    for i, (score, kind) in enumerate(zip(scores, types, strict=True)):
        if i in added and kind != 2:  # SentencePiece's own types for added pieces
            kind = piece_type.CONTROL if added[i]["special"] else piece_type.USER_DEFINED
        m.pieces.append(piece_type(piece=pieces[i], score=score, type=kind))
    path.write_bytes(m.SerializeToString())


def hf_folder(family: str, dest: Path) -> Path:
    """A tiny random-weight HF model of the family (2 layers, hidden 64, the tokenizer's
    vocabulary) with the real tokenizer files."""
    import torch
    import transformers

    files = tokenizer_files(FAMILIES[family])
    tok_json = json.loads(files["tokenizer.json"])
    ids = [*tok_json["model"]["vocab"].values(), *(a["id"] for a in tok_json["added_tokens"])]
    kw = dict(vocab_size=max(ids) + 1, hidden_size=64, intermediate_size=128, head_dim=16,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    if family == "qwen3":
        config = transformers.Qwen3Config(**kw, bos_token_id=151643, eos_token_id=151645)
        cls = transformers.Qwen3ForCausalLM
    else:
        config = transformers.Gemma3TextConfig(**kw, bos_token_id=2, eos_token_id=[1, 106])
        cls = transformers.Gemma3ForCausalLM
    torch.manual_seed(0)
    cls(config).save_pretrained(dest, safe_serialization=True)
    for name, data in files.items():
        (dest / name).write_bytes(data)
    if family == "gemma3_spm":
        write_spm_model(tok_json, dest / "tokenizer.model")
    return dest


def vocab_meta(family: str, tok_json: dict, golden: dict) -> dict:
    """The GGUF tokenizer metadata of the family built in memory by kvrun's conversion
    functions; the scalar keys (ids, flags, pre) as llama.cpp's converter wrote them."""
    meta = dict(golden["gguf"])
    n = len(tok_json["model"]["vocab"])
    if meta["tokenizer.ggml.model"] == "gpt2":
        tokens, types, merges = bpe_json_vocab(tok_json, n)
        meta["tokenizer.ggml.merges"] = merges
    else:
        tokens, scores, types = spm_json_vocab(tok_json, n)
        meta["tokenizer.ggml.scores"] = scores
    meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"] = tokens, types
    return meta


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text("utf-8"))


def _gemma_slow(names) -> list:
    """Gemma 3's 262k-token vocabularies take seconds a test: the slow tier (CI runs them)."""
    return [n if n == "qwen3" else pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.fixture(scope="module", params=_gemma_slow(FAMILIES))
def family(request, golden):
    """One family: its tokenizer.json, its tokenizer, and kvrun's GGUF tokenizer from memory."""
    name = request.param
    files = tokenizer_files(FAMILIES[name])
    tok_json = json.loads(files["tokenizer.json"])
    hf = HFTokenizer.from_str(files["tokenizer.json"].decode())
    meta = vocab_meta(name, tok_json, golden["families"][name])
    return {"name": name, "json": tok_json, "files": files, "hf": hf, "meta": meta,
            "gold": golden["families"][name], "kvrun": Tokenizer.from_gguf(meta)}  # fmt: skip


def _hf_ids(hf: HFTokenizer, texts: list[str], special: bool) -> list[list[int]]:
    hf.encode_special_tokens = not special
    try:
        return [hf.encode(t, add_special_tokens=False).ids for t in texts]
    finally:
        hf.encode_special_tokens = False


def _kvrun_ids(tok: Tokenizer, texts: list[str], special: bool) -> list[list[int]]:
    return [tok.encode(t, add_bos=False, special=special) for t in texts]


def test_golden_file_covers_these_texts(golden):
    assert golden["families"].keys() >= FAMILIES.keys()
    for name in FAMILIES:
        gold = golden["families"][name]
        assert gold["texts"] == TEXTS, f"{name}: rerun tests/data/make_tokenizer_golden.py"
        assert len(gold["special"]) == len(gold["plain"]) == len(TEXTS)
    kinds = {n: golden["families"][n]["gguf"]["tokenizer.ggml.model"] for n in FAMILIES}
    assert kinds == {"qwen3": "gpt2", "gemma3": "gpt2", "gemma3_spm": "llama"}
    assert golden["families"]["qwen3"]["gguf"]["tokenizer.ggml.pre"] == "qwen2"
    assert golden["families"]["gemma3"]["gguf"]["tokenizer.ggml.pre"] == "granite-embed-multi-311m"
    assert golden["families"]["gemma3_spm"]["gguf"]["tokenizer.ggml.add_space_prefix"] is False


@pytest.mark.parametrize("mode", ["special", "plain"])
def test_gguf_ids_equal_llama_cpp_golden(family, mode):
    got = _kvrun_ids(family["kvrun"], TEXTS, mode == "special")
    bad = [t for t, a, b in zip(TEXTS, got, family["gold"][mode], strict=True) if a != b]
    assert not bad, f"{family['name']} {mode}: {len(bad)}/{len(TEXTS)} differ, first {bad[0]!r}"


@pytest.mark.parametrize("mode", ["special", "plain"])
def test_gguf_ids_equal_tokenizers_but_where_llama_cpp_differs(family, mode):
    ours = _kvrun_ids(family["kvrun"], TEXTS, mode == "special")
    theirs = _hf_ids(family["hf"], TEXTS, mode == "special")
    differs = {t for t, a, b in zip(TEXTS, ours, theirs, strict=True) if a != b}
    assert differs == LLAMACPP_DIFFERS.get((family["name"], mode), set())
    for text in differs:  # ...and there llama.cpp differs from tokenizers just as kvrun does
        i = TEXTS.index(text)
        assert family["gold"][mode][i] == ours[i] != theirs[i], text


def test_gguf_specials_equal_llama_cpp(family):
    tok, gold = family["kvrun"], family["gold"]
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (gold["bos"], gold["eos"], gold["add_bos"])
    assert tok.stop_ids == set(gold["eog"])
    gemma = family["name"].startswith("gemma")
    prompt, marks = (GEMMA_CHAT, ("<start_of_turn>", "<end_of_turn>")) if gemma else (
        QWEN_CHAT, ("<|im_start|>", "<|im_end|>", "<think>", "</think>"))  # fmt: skip
    ids = tok.encode(prompt)  # as the chat path encodes a rendered prompt: specials parsed
    for mark in marks:
        [mark_id] = tok.encode(mark, add_bos=False)
        assert ids.count(mark_id) == prompt.count(mark) > 0, mark
    assert tok.decode(ids) == prompt
    assert ids[:2] == [2, 105] if gemma else ids[0] == 151644  # the template's <bos>, once
    assert marks[0] not in tok.decode(ids, skip_special=True)


def test_hf_dir_ids_equal_tokenizers(family, tmp_path):
    files = dict(family["files"])
    if family["name"] == "gemma3_spm":  # its tokenizer.model alone: kvrun's SentencePiece path
        write_spm_model(family["json"], tmp_path / "tokenizer.model")
        del files["tokenizer.json"]
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    tok = Tokenizer.from_hf_dir(tmp_path)
    for special in (True, False):
        want = _hf_ids(family["hf"], TEXTS, special)
        assert _kvrun_ids(tok, TEXTS, special) == want
    gemma = family["name"].startswith("gemma")
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == ((2, 106, True) if gemma else (None, 151645, False))  # fmt: skip
    assert tok.encode("Hi") == family["hf"].encode("Hi").ids  # BOS as the post-processor adds


def test_bpe_pre_name_reads_the_split_regex():
    names = {}
    for sub in ("qwen3", "gemma3", "llama3_1", "llama2"):
        names[sub] = bpe_pre_name(json.loads(tokenizer_files(sub)["tokenizer.json"]))
    assert names == {"qwen3": "qwen2", "llama3_1": "llama-bpe", "gemma3": None, "llama2": None}


# --- chat templates ---------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
     {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}],
]  # fmt: skip


@pytest.fixture(scope="module", params=_gemma_slow(["qwen3", "gemma3"]))
def chat_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"chat_{request.param}")
    for name, data in tokenizer_files(request.param).items():
        (folder / name).write_bytes(data)
    return folder


@pytest.mark.parametrize("extra", [{}, {"enable_thinking": False}])
def test_chat_template_equals_transformers(chat_folder, extra):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(chat_folder)
    ours = Tokenizer.from_hf_dir(chat_folder)
    config = json.loads((chat_folder / "tokenizer_config.json").read_text("utf-8"))
    from_gguf = Tokenizer.from_gguf({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens":
        ["<bos>", "<eos>"], "tokenizer.ggml.merges": [], "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1, "tokenizer.chat_template": config["chat_template"]})  # fmt: skip
    for conv in CONVERSATIONS:
        for gen in (True, False):
            want = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, **extra)
            assert ours.render_chat(conv, add_generation_prompt=gen, **extra) == want
            got = from_gguf.render_chat(conv, add_generation_prompt=gen, **extra)
            assert got == want.replace(hf.bos_token or "\0", "<bos>")
    last = ours.render_chat(CONVERSATIONS[2], add_generation_prompt=False)
    assert "<think>\nadd them\n</think>" in last  # the template's own output, not stripped


def test_qwen3_thinking_tags_and_prompt(tmp_path):
    for name, data in tokenizer_files("qwen3").items():
        (tmp_path / name).write_bytes(data)
    tok = Tokenizer.from_hf_dir(tmp_path)
    prompt = tok.render_chat(CONVERSATIONS[1])
    assert "<think>" not in prompt  # Qwen 3 drops reasoning of earlier turns itself
    assert prompt.endswith("<|im_start|>assistant\n")
    no_think = tok.render_chat(CONVERSATIONS[0], enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tok.encode(no_think)
    think = [tok._tok.token_to_id(t) for t in ("<think>", "</think>")]
    assert all(ids.count(i) == 1 for i in think)  # <think> is one token in the prompt


def test_gemma3_template_folds_system_and_refuses_bad_roles(tmp_path):
    for name, data in tokenizer_files("gemma3").items():
        (tmp_path / name).write_bytes(data)
    tok = Tokenizer.from_hf_dir(tmp_path)
    prompt = tok.render_chat(CONVERSATIONS[1])
    assert prompt.startswith("<bos><start_of_turn>user\nBe brief.\n\n2+2?<end_of_turn>\n")
    assert "<start_of_turn>model\n" in prompt and "assistant" not in prompt
    assert tok.encode(prompt)[:2] == [2, 105]  # the template's <bos>, not a second one
    with pytest.raises(KvrunError, match="chat template error: Conversation roles must alternate"):
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# --- llama.cpp's converter and llama.cpp itself (subprocesses) ---------------------------------


@pytest.fixture(scope="module")
def converted(family, tmp_path_factory):
    """llama.cpp's convert_hf_to_gguf.py on the family's tiny HF folder (vocabulary only)."""
    root = tmp_path_factory.mktemp(f"conv_{family['name']}")
    hf = hf_folder(family["name"], root / "hf")
    return llamacpp_peer.convert(hf, root / "vocab.gguf", "f32", "--vocab-only")


@pytest.mark.slow  # a subprocess
def test_llama_cpp_converter_writes_what_kvrun_builds(family, converted):
    theirs = {k: v for k, v in gguf_metadata(open_gguf(converted)).items() if k.startswith("tokenizer.ggml")}  # fmt: skip
    ours = family["meta"]
    assert set(theirs) == set(ours)
    for key in theirs:
        if key == "tokenizer.ggml.token_type" and family["name"] == "gemma3_spm":
            # <unk>: llama.cpp's tokenizer.model path retypes it CONTROL (tokenizer_config
            # marks it special), its tokenizer.json path keeps UNKNOWN; both read it alike
            diff = [
                i for i, (a, b) in enumerate(zip(theirs[key], ours[key], strict=True)) if a != b
            ]
            assert diff == [3] and (theirs[key][3], ours[key][3]) == (3, 2)
            continue
        assert theirs[key] == ours[key], key
    tok = Tokenizer.from_gguf(gguf_metadata(open_gguf(converted)))
    assert _kvrun_ids(tok, TEXTS, True) == family["gold"]["special"]


@pytest.mark.slow  # a subprocess
@pytest.mark.skipif(
    not llamacpp_peer.PYTHON.exists(), reason=f"no llama-cpp-python at {llamacpp_peer.PYTHON}"
)
def test_llama_cpp_live_equals_golden(family, converted):
    live = llamacpp_peer.tokenize(converted, TEXTS)
    gold = family["gold"]
    assert {k: live[k] for k in ("add_bos", "bos", "eos", "eog")} == {k: gold[k] for k in ("add_bos", "bos", "eos", "eog")}  # fmt: skip
    assert live["special"] == gold["special"] and live["plain"] == gold["plain"]
