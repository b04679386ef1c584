"""Damaged model files give one line that names the problem (the tensor cut short and the
bytes missing, the file that is not JSON, the field of the wrong type) and a non-zero exit,
never numpy's or serde's text alone (the cut GGUF cases are in
test_cli.py::test_truncated_gguf). The cases below are what tests/test_fuzz_files.py found,
kept as named regressions."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct

import pytest
from cli_checks import one_error_line
from click.testing import CliRunner
from fuzz_mutations import walk_gguf, write_gguf

import tiny_models
from kvrun.cli.main import cli


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models.build(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def hf(tiny):
    return tiny.hf_dir


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


# ---------------------------------------------------------------------------------- GGUF


def gguf_with(tiny, tmp_path, kvs=None, tensors=None):
    """The tiny GGUF with its metadata and tensor table edited: kvs maps a key to its new
    (type, raw value bytes), (None, None) to drop it; tensors(rows by name) edits the table
    in place."""
    lay = walk_gguf(tiny.gguf_path.read_bytes())
    rows = lay.tensors
    edits = kvs or {}
    entries = [(k, *edits[k]) if k in edits else (k, t, v) for k, t, v in lay.kvs]
    entries = [e for e in entries if e[1] is not None]
    entries += [(k, *e) for k, e in edits.items() if e and k not in {x[0] for x in lay.kvs}]
    if tensors:
        tensors({r.name: r for r in rows})
    path = tmp_path / "edited.gguf"
    path.write_bytes(write_gguf(dataclasses.replace(lay, kvs=entries, tensors=rows)))
    return path


def test_gguf_array_count_past_the_file_is_refused_before_allocating(tiny, tmp_path):
    tokens = dict((k, v) for k, _, v in walk_gguf(tiny.gguf_path.read_bytes()).kvs)
    raw = tokens["tokenizer.ggml.tokens"]
    huge = struct.pack("<IQ", 8, 2**63) + raw[12:]  # 2^63 strings declared, 300 there
    path = gguf_with(tiny, tmp_path, {"tokenizer.ggml.tokens": (9, huge)})
    one_error_line(generate(path), "damaged GGUF", "declares 9,223,372,036,854,775,808 items",
                   "more than the")  # fmt: skip


@pytest.mark.parametrize("align", [0, 3])
def test_gguf_alignment_must_be_a_power_of_two(tiny, tmp_path, align):
    path = gguf_with(tiny, tmp_path, {"general.alignment": (4, struct.pack("<I", align))})
    one_error_line(generate(path), "damaged GGUF", f"general.alignment {align} is not a power")


def test_gguf_tensors_that_overlap_or_have_five_dims(tiny, tmp_path):
    def overlap(rows):
        rows["blk.0.ffn_up.weight"].offset = rows["blk.0.ffn_gate.weight"].offset

    one_error_line(generate(gguf_with(tiny, tmp_path, tensors=overlap)), "damaged GGUF",
                   "blk.0.ffn_gate.weight and blk.0.ffn_up.weight overlap")  # fmt: skip

    def five(rows):
        rows["output_norm.weight"].dims += [1, 1, 1, 1]

    one_error_line(generate(gguf_with(tiny, tmp_path, tensors=five)), "damaged GGUF",
                   "output_norm.weight has 5 dimensions (GGUF allows 4)")  # fmt: skip


def test_gguf_tensor_in_another_shape_than_its_config_says(tiny, tmp_path):
    def transpose(rows):
        rows["blk.1.ffn_up.weight"].dims.reverse()

    path = gguf_with(tiny, tmp_path, tensors=transpose)
    one_error_line(generate(path), "tensor blk.1.ffn_up.weight has shape [64, 128]",
                   "its config says [128, 64]")  # fmt: skip


@pytest.mark.parametrize(
    ("value", "needle"),
    [((8, struct.pack("<Q", 1) + b"x"), "llama.block_count is 'x', not a whole number"),
     ((4, struct.pack("<I", 0)), "llama.block_count is 0, not a whole number"),
     (None, "llama.block_count is missing")],
)  # fmt: skip
def test_gguf_metadata_of_the_wrong_type_names_the_key(tiny, tmp_path, value, needle):
    path = gguf_with(tiny, tmp_path, {"llama.block_count": value or (None, None)})
    one_error_line(generate(path), str(path), needle)


# ------------------------------------------------------------------------------ HF folder


def edited(hf, tmp_path, name: str, edit):
    """A copy of the HF folder whose JSON file `name` went through edit(dict)."""
    d = tmp_path / "model"
    shutil.copytree(hf, d)
    obj = json.loads((d / name).read_text())
    edit(obj)
    (d / name).write_text(json.dumps(obj))
    return d


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [("hidden_size", "x", "config.json: hidden_size is 'x', not a whole number"),
     ("num_hidden_layers", 2**31, "num_hidden_layers is 2147483648, not a whole number"),
     ("rms_norm_eps", [1], "rms_norm_eps is [1], not a number"),
     ("rope_parameters", "x", "rope_parameters is 'x', not an object"),
     ("num_key_value_heads", 3, "4 query heads do not share 3 KV heads evenly"),
     ("intermediate_size", 100, "has shape [64, 128]; its config says [64, 100]"),
     ("model_type", None, "model_type is missing")],
)  # fmt: skip
def test_config_json_field_of_the_wrong_type_names_it(hf, tmp_path, field, value, needle):
    d = edited(hf, tmp_path, "config.json", lambda c: c.update({field: value}))
    one_error_line(generate(d), needle)


@pytest.mark.parametrize(
    ("key", "value"),
    [("padding", {"strategy": {"Fixed": 10**6}, "pad_id": 0, "pad_token": "x", "pad_type_id": 0,
                  "direction": "Right", "pad_to_multiple_of": None}),
     ("truncation", {"max_length": 1, "strategy": "LongestFirst", "stride": 0,
                     "direction": "Right"})],
)  # fmt: skip
def test_tokenizer_json_padding_and_truncation_are_not_kvrun_s(hf, tmp_path, key, value):
    """A file that pads every prompt (to 10^9 ids, it allocated them all) or cuts it short:
    kvrun encodes a prompt whole."""
    from kvrun.models.tokenizer import Tokenizer

    text = "Hello world! The quick fox."
    want = Tokenizer.from_hf_dir(hf).encode(text)
    d = edited(hf, tmp_path, "tokenizer.json", lambda t: t.update({key: value}))
    assert Tokenizer.from_hf_dir(d).encode(text) == want and len(want) > 1


@pytest.mark.parametrize(
    ("edit", "needle"),
    [(lambda t: t.update(post_processor={"type": "TemplateProcessing", "single": [
          {"SpecialToken": {"id": "<bogus>", "type_id": 0}}], "pair": [], "special_tokens": {}}),
      "post-processor's template names the special token '<bogus>'"),
     (lambda t: t.update(normalizer={"type": "Precompiled", "precompiled_charsmap": "AAAA"}),
      "Cannot parse precompiled_charsmap"),
     (lambda t: t["added_tokens"].append({"id": 10**6, "content": "zz", "special": True,
          "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}),
      "the tokenizer gives ids up to 300, past the 300 rows of the embedding table")],
)  # fmt: skip
def test_tokenizer_json_the_library_would_panic_on(hf, tmp_path, edit, needle):
    """What the tokenizers library asserts on (a panic, past Python's `except Exception`)
    or what would index past the embedding table, in one line."""
    one_error_line(generate(edited(hf, tmp_path, "tokenizer.json", edit)), needle)


@pytest.mark.parametrize(
    ("name", "edit", "needle"),
    [("tokenizer_config.json", lambda c: c.update(bos_token=5),
      "tokenizer_config.json: bos_token is the value 5, not a token's text"),
     ("tokenizer_config.json", lambda c: c.update(chat_template={"default": "x"}),
      "chat_template is an object, not a template"),
     ("generation_config.json", lambda c: c.update(eos_token_id="x"),
      "generation_config.json: eos_token_id holds a string, not a token id"),
     ("generation_config.json", lambda c: c.update(eos_token_id=-1),
      "eos_token_id -1 is not a token id")],
)  # fmt: skip
def test_tokenizer_configs_of_the_wrong_type_name_the_field(hf, tmp_path, name, edit, needle):
    one_error_line(generate(edited(hf, tmp_path, name, edit)), needle)


# -------------------------------------------------------------------- packed-model cache


def test_a_packed_cache_entry_edited_or_hostile_is_built_again(tiny, tmp_path, monkeypatch):
    """A header edited by hand fails its digest; one signed again whose layout would set an
    attribute the stacking never empties fails the explicit list. Either way the entry is
    deleted and the model built again, as a fresh build gives it."""
    import torch

    from kvrun.models import model_cache
    from kvrun.run.runtime import load_runtime

    monkeypatch.setenv("KVRUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVRUN_PACKED_CACHE", "on")

    def load():
        said = []
        rt = load_runtime(str(tiny.gguf_path), "float32", "cpu", log=said.append, wtype="q4")
        model_cache.wait()
        with torch.inference_mode():
            logits = rt.model(torch.tensor([[5, 6, 7]]), torch.arange(3), rt.new_kv())
        return logits, said

    ref, _ = load()
    (entry,) = (tmp_path / "cache" / "packed").glob("*.safetensors")
    raw = entry.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["kvrun"])
    for sign, needle in ((False, "does not match its digest"), (True, "no stacked slot")):
        meta["layout"]["empty"].append("model.layers.0.self_attn.forward")
        header["__metadata__"] = {"kvrun": json.dumps(meta)}
        if sign:
            header["__metadata__"]["digest"] = model_cache._digest(header)
        text = json.dumps(header).encode()
        text += b" " * (-(8 + len(text)) % 64)
        entry.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
        logits, said = load()
        assert said[0].startswith("packed cache entry damaged") and needle in said[0], said
        assert torch.equal(logits, ref)
        meta["layout"]["empty"].pop()
