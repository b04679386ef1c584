"""Compressed caches on disk (kvrun/kvc.py, `kvrun prefill`, `--kv-cache`).

Every registry method and stack round-trips: a document's turn prefilled and compressed, the
cache saved, loaded into a fresh manager, and a question turn (selecting nothing) plus decode
steps give the logits of the run that never left memory, bit for bit; the file is at most
1.05x the cache's measured bytes plus a header under 64 KiB. A file for another model,
another spec or another format version, and a damaged or cut file, is one line.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import test_kv_contract as contract
import test_kv_methods
import torch
from cli_checks import one_error_line
from click.testing import CliRunner

import tiny_families
import tiny_models
from kvrun import kvc
from kvrun.cli.main import cli
from kvrun.errors import KvrunError
from kvrun.generate import Session
from kvrun.kv import build, check

pytestmark = pytest.mark.usefixtures("one_thread")
DOC, QUESTION, STEPS = 150, 12, (7, 9, 11, 40)


class TinyRuntime:
    """What kvc needs of a Runtime: the model, its file, a way to make caches."""

    def __init__(self, model, path: Path):
        self.model, self.config, self.path = model, model.config, path

    def new_kv(self, spec):
        return build(spec, self.config, self.model.rope, "cpu", torch.float32)


def _runtime(tmp_path, model, name="model.gguf", content=b"tiny model file") -> TinyRuntime:
    path = tmp_path / name
    path.write_bytes(content)
    return TinyRuntime(model, path)


def _continue(model, kv, tokens, question, steps):
    """A question turn that selects nothing, then decode steps: their logits."""
    s = Session(model, None, kv, ubatch=64)
    s.tokens = list(tokens)
    out = [s.prefill([], question=question)]
    out += [s.decode(t) for t in steps]
    return torch.stack(out)


def _round_trip(tmp_path, model, text):
    rt = _runtime(tmp_path, model)
    spec = check(text)
    s = Session(model, None, rt.new_kv(spec), ubatch=64)
    s.prefill(test_kv_methods.prompt(DOC, seed=3))
    path = kvc.save(tmp_path / "doc.kvc", s.kv, s.tokens, rt)
    kv, tokens, header = kvc.load(path, rt)
    assert tokens == s.tokens and kv.seen == s.kv.seen and kv.nbytes() == s.kv.nbytes()
    question = test_kv_methods.prompt(QUESTION, seed=5)
    want = _continue(model, s.kv, s.tokens, question, STEPS)
    got = _continue(model, kv, tokens, question, STEPS)
    assert torch.equal(got, want), text
    assert kv.nbytes() == s.kv.nbytes()
    return path, header


def _sizes(path: Path) -> tuple[int, int]:
    """(header bytes, tensor bytes) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return n, path.stat().st_size - 8 - n


@pytest.mark.parametrize("text", contract._stacks() + ["kivi2", "kivi4"])
def test_every_method_and_stack_round_trips_bit_for_bit(tmp_path, text):
    path, header = _round_trip(tmp_path, test_kv_methods.tiny(), text)
    head, body = _sizes(path)
    assert head < 64 * 1024, head
    assert body <= 1.05 * header["kv_bytes"], (body, header["kv_bytes"])


@pytest.mark.parametrize("family", ["gemma3", "phi3", "qwen2"])
@pytest.mark.parametrize("text", ["snapkv", "minikv", "spindlekv", "minicache", "xkv+kivi2"])
def test_the_families_round_trip(tmp_path, family, text):
    """Gemma 3's two RoPEs and local layers, Phi-3's partial rotary, Qwen's biases."""
    c = tiny_families.kv_config(family)
    _round_trip(tmp_path, test_kv_methods.random_transformer(c, 11), text)


def test_another_model_another_spec_another_version_each_one_line(tmp_path):
    model = test_kv_methods.tiny()
    path, _ = _round_trip(tmp_path, model, "snapkv")
    other = _runtime(tmp_path, model, "other.gguf", b"another model's file")
    with pytest.raises(KvrunError, match="was written for model model.gguf"):
        kvc.load(path, other)
    rt = _runtime(tmp_path, model)
    with pytest.raises(KvrunError, match="holds a --kv snapkv cache, not --kv h2o"):
        kvc.load(path, rt, check("h2o"))
    with pytest.raises(KvrunError, match="options differ"):
        kvc.load(path, rt, check("snapkv:window=8"))
    kvc.load(path, rt, check("snapkv"))  # the same spec, given
    # the header rewritten as another format version
    from safetensors.torch import load_file, save_file

    header = kvc.read_header(path)
    header["version"] = 99
    save_file(load_file(str(path)), str(tmp_path / "v99.kvc"), {"kvrun_kvc": json.dumps(header)})
    with pytest.raises(KvrunError, match="format version 99; this kvrun reads version 1"):
        kvc.load(tmp_path / "v99.kvc", rt)


def test_damaged_cut_and_foreign_files_are_one_line(tmp_path):
    model = test_kv_methods.tiny()
    path, _ = _round_trip(tmp_path, model, "h2o")
    rt = _runtime(tmp_path, model)
    data = path.read_bytes()
    cut = tmp_path / "cut.kvc"
    cut.write_bytes(data[: len(data) // 2])
    noise = tmp_path / "noise.kvc"
    noise.write_bytes(b"\x00" * 64)
    header = tmp_path / "header.kvc"
    header.write_bytes(data[:8] + b"{#" + data[10:])  # the JSON broken
    from safetensors.torch import save_file

    plain = tmp_path / "plain.kvc"
    save_file({"x": torch.zeros(2)}, str(plain))
    for bad, why in ((cut, "not a readable"), (noise, "not a readable"), (header, "not a readable"),
                     (plain, "not a kvrun .kvc file")):  # fmt: skip
        with pytest.raises(kvc.Damaged, match=why) as e:
            kvc.load(bad, rt)
        assert "\n" not in str(e.value)
    with pytest.raises(KvrunError, match="no such .kvc file"):
        kvc.load(tmp_path / "missing.kvc", rt)


# --------------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models.build(tmp_path_factory.mktemp("kvc"))


def _run(*args, input=None):
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


def test_prefill_then_generate_equals_the_run_that_never_left_memory(tiny, tmp_path):
    """`kvrun prefill` + `kvrun generate --kv-cache` gives the tokens of one in-memory run
    of the same document and question (--question-after semantics: the question selects
    nothing), and the file's spec is taken unless --kv says another."""
    from kvrun.runtime import load_runtime

    doc = tmp_path / "doc.txt"
    doc.write_text(tiny_models.TEXT * 6)
    out = tmp_path / "doc.kvc"
    m = str(tiny.gguf_path)
    r = _run("prefill", "-m", m, "-f", str(doc), "--kv", "snapkv", "--kv-budget", "0.5",
             "-o", str(out), "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    facts = json.loads(r.stdout)
    assert facts["kv_bytes"] < facts["kv_bytes_full"] and out.exists()
    r = _run("generate", "-m", m, "--kv-cache", str(out), "-p", "And then?", "-n", "8",
             "--temp", "0", "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    rt = load_runtime(m, "float32", "cpu", log=lambda s: None)
    ids, turns = kvc.document_turn(rt.tokenizer, tiny_models.TEXT * 6, True, None)
    q = kvc.question_turn(rt.tokenizer, "And then?", turns)
    s = Session(rt.model, rt.tokenizer, rt.new_kv(check("snapkv", "0.5")))
    from kvrun.config import SamplingConfig

    want = s.generate(ids, 8, SamplingConfig(temp=0.0), seed=0, question=q)
    assert got["tokens"] == want.tokens
    assert got["kv"]["method"] == "snapkv"
    r = _run("generate", "-m", m, "--kv-cache", str(out), "--kv", "h2o", "-p", "x")
    one_error_line(r, "--kv snapkv", "--kv h2o")
    r = _run("prefill", "-m", m, "-f", str(doc), "-o", str(out))
    one_error_line(r, "exists", "--overwrite")


def test_chat_goes_on_from_a_document(tiny, tmp_path):
    """`kvrun chat --kv-cache`: the first message completes the user's turn that holds the
    document; the reply equals a conversation whose first message carried the document."""
    from kvrun.chat import Conversation
    from kvrun.config import SamplingConfig
    from kvrun.runtime import load_runtime

    doc = tmp_path / "doc.txt"
    doc.write_text(tiny_models.TEXT * 4)
    out = tmp_path / "doc.kvc"
    m = str(tiny.gguf_path)
    assert _run("prefill", "-m", m, "-f", str(doc), "-o", str(out)).exit_code == 0
    r = _run("chat", "-m", m, "--kv-cache", str(out), "-n", "6", "--temp", "0", input="Why?\n")
    assert r.exit_code == 0, r.output
    rt = load_runtime(m, "float32", "cpu", log=lambda s: None)
    conv = Conversation(Session(rt.model, rt.tokenizer, rt.new_kv(check("full"))))
    want = conv.reply(tiny_models.TEXT * 4 + "\n\nWhy?", n_predict=6,
                      sampling=SamplingConfig(temp=0.0), seed=0)  # fmt: skip
    assert r.stdout.strip() == want.text.strip()
    raw = tmp_path / "raw.kvc"
    assert _run("prefill", "-m", m, "-f", str(doc), "--raw", "-o", str(raw)).exit_code == 0
    one_error_line(_run("chat", "-m", m, "--kv-cache", str(raw)), "--raw", "--chat")
