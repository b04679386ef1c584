"""Compressed caches on disk (kvrun/run/kvc.py, `kvrun prefill`, `--kv-cache`).

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
from kvrun.cli.main import cli
from kvrun.errors import KvrunError
from kvrun.kv import build, check
from kvrun.run import kvc
from kvrun.run.session import Session

pytestmark = pytest.mark.usefixtures("one_thread")
DOC, QUESTION, STEPS = 150, 12, (7, 9, 11, 40)


class TinyRuntime:
    """What kvc needs of a Runtime: the model, its file, a way to make caches."""

    def __init__(self, model, path: Path):
        self.model, self.config, self.path = model, model.config, path

    def new_kv(self, spec):
        kw = {}
        if spec.select.critical:  # as Runtime.new_kv: CriticalKV is lent the output projection
            kw["out_proj"] = self.out_proj
        return build(spec, self.config, self.model.rope, "cpu", torch.float32, **kw)

    def out_proj(self, layer: int):
        return self.model.model.layers[layer].self_attn.o_proj


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


# memos a load leaves empty, made again on first use (SpindleKV's kept counts, a shelf's offsets,
# the output projection's weights CriticalKV reads from the model)
MEMOS = {"_counts", "_off", "_w"}


def same_graph(a, b, path="kv", seen=None):
    """Two caches hold the same: every attribute of every object they reach, tensors by dtype,
    shape and value; what the run supplies (config, RoPE, spec, kernels) is the same object."""
    from types import MappingProxyType

    from kvrun.kv.state import fields_of
    from kvrun.kv.stores.buffer import Buffer

    seen = set() if seen is None else seen
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, path
        assert a.shape == b.shape, path
        if a.dtype != torch.bool:  # bit for bit (a NaN equals itself)
            a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
        assert torch.equal(a, b), path
        return
    if isinstance(a, Buffer):
        assert isinstance(b, Buffer) and a.dim == b.dim, path
        return same_graph(a.data, b.data, path + ".data", seen)
    if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device)):
        assert type(a) is type(b) and a == b, (path, a, b)
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same_graph(x, y, f"{path}[{i}]", seen)
        return
    if isinstance(a, (dict, MappingProxyType)):
        assert type(a) is type(b) and list(a) == list(b), path
        for k in a:
            same_graph(a[k], b[k], f"{path}[{k!r}]", seen)
        return
    if isinstance(a, (set, frozenset)) or not type(a).__module__.startswith("kvrun.kv"):
        assert a == b or a is b, path  # the run's: config, RoPE, kernels, hooks
        return
    if type(a).__module__.endswith("kv.spec") or id(a) in seen:
        return
    seen.add(id(a))
    assert type(a) is type(b), path
    fa, fb = fields_of(a), fields_of(b)
    assert set(fa) == set(fb), path
    for k in fa:
        if k not in MEMOS:
            same_graph(fa[k], fb[k], f"{path}.{k}", seen)


def _round_trip(tmp_path, model, text, dtype=None):
    rt = _runtime(tmp_path, model)
    spec = check(text).with_dtype(dtype)
    s = Session(model, None, rt.new_kv(spec), ubatch=64)
    s.prefill(test_kv_methods.prompt(DOC, seed=3))
    path = kvc.save(tmp_path / "doc.kvc", s.kv, s.tokens, rt)
    kv, tokens, header = kvc.load(path, rt)
    assert tokens == s.tokens and kv.seen == s.kv.seen and kv.nbytes() == s.kv.nbytes()
    same_graph(s.kv, kv)  # nothing the cache holds is lost or changed by the file
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


@pytest.mark.parametrize("text", ["kvzip:scope=layer", "kvzip:scope=model"])
def test_padded_heads_and_layers_round_trip(tmp_path, text):
    """KVzip's heads (scope=layer) and layers too (scope=model) keeping different counts,
    padded at PAD: the file keeps each layer's own count and the padding's positions."""
    path, header = _round_trip(tmp_path, test_kv_methods.tiny(), text, None)
    assert header["spec"]["describe"]["scope"] == text.partition("=")[2]


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("text", ["full", "snapkv", "h2o"])
def test_a_dense_store_in_another_kv_type_round_trips(tmp_path, text, dtype):
    """--kv-dtype's stores: the file holds the rows as stored (f16 halves, q8_0 / q4_0
    blocks) and records the type; the cache goes on bit for bit."""
    path, header = _round_trip(tmp_path, test_kv_methods.tiny(), text, dtype)
    assert header["spec"]["dtype"] == dtype


@pytest.mark.parametrize(
    "text", ["minicache", "minicache:scope=layer", "minicache:retain=topk:0.3"]
)
def test_minicache_in_f16_round_trips_at_half_the_bytes(tmp_path, text):
    """MiniCache under --kv-dtype f16 (the CPU's default) keeps its pairs' E, norms and
    retained rows and its plain layers in f16: the file holds them so, about half f32's bytes;
    a file whose half is in another dtype than the run's is refused."""
    model = test_kv_methods.tiny()
    (tmp_path / "f32").mkdir()
    _, f32 = _round_trip(tmp_path / "f32", model, text, "f32")
    path, header = _round_trip(tmp_path, model, text, "f16")
    assert header["spec"]["dtype"] == "f16"
    assert 0.45 < header["kv_bytes"] / f32["kv_bytes"] < 0.6
    rt = _runtime(tmp_path, model)
    kv, _, _ = kvc.load(path, rt)
    assert all(h.e.data.dtype == torch.float16 for p in kv.pairs for h in (p.k, p.v))
    # the header says the model's dtype, the halves are f16: refused before the run sees them
    bad = rewrite(
        path, tmp_path / "bad.kvc", header=lambda h: _with(h, spec=_with(h["spec"], dtype=None))
    )
    with pytest.raises(kvc.DamagedKvcFile) as e:
        kvc.load(bad, rt)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["kivi2:residual=32", "snapkv+kivi4:residual=32", "minikv"])
def test_kivi_scales_in_f16_round_trip(tmp_path, text):
    """KIVI under --kv-dtype f16 (the CPU's default) keeps its scales and zeros in f16: the file
    holds them so and goes on bit for bit; a header that says otherwise is refused."""
    model = test_kv_methods.tiny()
    (tmp_path / "f32").mkdir()
    _, f32 = _round_trip(tmp_path / "f32", model, text, "f32")
    path, header = _round_trip(tmp_path, model, text, "f16")
    assert header["spec"]["dtype"] == "f16" and header["kv_bytes"] < f32["kv_bytes"]
    kv, _, _ = kvc.load(path, _runtime(tmp_path, model))
    held = [st.kivi for st in kv.layers if st.kivi is not None]
    assert held and all(k.body()[1].dtype == k.body()[5].dtype == torch.float16 for k in held)
    assert all(k.tail_dtype == torch.float16 for k in held)  # the spec's fp16 tail
    bad = rewrite(
        path, tmp_path / "bad.kvc", header=lambda h: _with(h, spec=_with(h["spec"], dtype=None))
    )
    with pytest.raises(kvc.DamagedKvcFile) as e:
        kvc.load(bad, _runtime(tmp_path, model))
    assert "\n" not in str(e.value)


def test_kivi_float32_tail_of_an_older_file_loads(tmp_path):
    """A file written while KIVI's tail was float32 under f16 scales (before it followed the
    KV dtype) still loads: the tail keeps its dtype and the cache goes on bit for bit."""
    model = test_kv_methods.tiny()
    rt = _runtime(tmp_path, model)
    s = Session(model, None, rt.new_kv(check("kivi2:residual=32").with_dtype("f16")), ubatch=64)
    s.prefill(test_kv_methods.prompt(DOC, seed=3))
    held = [st.kivi for st in s.kv.layers if st.kivi is not None]
    for k in held:  # as the older kvrun held it
        for b in (k._tk, k._tv):
            b.buf = b.buf.float()
    assert held and all(k.tail_len and k.tail_dtype == torch.float32 for k in held)
    path = kvc.save(tmp_path / "old.kvc", s.kv, s.tokens, rt)
    kv, tokens, _ = kvc.load(path, rt)
    assert all(st.kivi.tail_dtype == torch.float32 for st in kv.layers if st.kivi is not None)
    assert kv.nbytes() == s.kv.nbytes()
    question = test_kv_methods.prompt(QUESTION, seed=5)
    want = _continue(model, s.kv, s.tokens, question, STEPS)
    assert torch.equal(_continue(model, kv, tokens, question, STEPS), want)
    # a tail of float32 keys and f16 values (no kvrun writes one) is refused in one line
    kv, tokens, _ = kvc.load(path, rt)
    for st in kv.layers:
        if st.kivi is not None:
            st.kivi._tv.buf = st.kivi._tv.buf.half()
    bad = kvc.save(tmp_path / "mixed.kvc", kv, tokens, rt)
    with pytest.raises(
        kvc.DamagedKvcFile, match="KIVI tail of float32 keys and float16 values"
    ) as e:
        kvc.load(bad, rt)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["snapkv+kivi2", "minikv"])
def test_kivi_stack_float32_staging_of_an_older_file_loads(tmp_path, text):
    """A KIVI stack stages its turn in the KV dtype (f16 here). A file written while it staged in
    the model's float32 holds that area empty between turns: it loads, and goes on bit for bit;
    a non-empty one of another dtype is still refused in one line."""
    model = test_kv_methods.tiny()
    rt = _runtime(tmp_path, model)
    s = Session(model, None, rt.new_kv(check(text, "0.5").with_dtype("f16")), ubatch=64)
    s.prefill(test_kv_methods.prompt(DOC, seed=3))
    staged = [st.dense for st in s.kv.layers]
    assert all(d._k.data.dtype == torch.float16 and d.length == 0 for d in staged)
    for d in staged:  # as the older kvrun held it
        for b in (d._k, d._v):
            b.buf = b.buf.float()
    path = kvc.save(tmp_path / "old.kvc", s.kv, s.tokens, rt)
    kv, tokens, _ = kvc.load(path, rt)
    assert all(st.dense._k.data.dtype == torch.float16 for st in kv.layers)
    question = test_kv_methods.prompt(QUESTION, seed=5)
    want = _continue(model, s.kv, s.tokens, question, STEPS)
    assert torch.equal(_continue(model, kv, tokens, question, STEPS), want)
    kv, tokens, _ = kvc.load(path, rt)
    d = kv.layers[0].dense
    d._k.buf = torch.zeros(1, d._k.buf.shape[1], 3, d._k.buf.shape[3])  # float32, 3 slots
    d._v.buf = d._k.buf.clone()
    d._k.n = d._v.n = 3
    bad = kvc.save(tmp_path / "full.kvc", kv, tokens, rt)
    with pytest.raises(kvc.DamagedKvcFile, match="not a 4-d float16") as e:
        kvc.load(bad, rt)
    assert "\n" not in str(e.value)


def test_minicache_refuses_block_kv_types():
    m = test_kv_methods.tiny()
    with pytest.raises(KvrunError, match="f32 or f16, not q8_0"):
        build(check("minicache").with_dtype("q8_0"), m.config, m.rope, "cpu", torch.float32)


@pytest.mark.parametrize("family", ["gemma3", "phi3", "qwen2"])
@pytest.mark.parametrize(
    "text", ["snapkv", "minikv", "spindlekv", "minicache", "xkv+kivi2", "kvzip:scope=model"]
)
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
    with pytest.raises(KvrunError, match="holds a --kv snapkv --kv-budget 0.2 cache, not --kv h2o"):
        kvc.load(path, rt, check("h2o"))
    with pytest.raises(KvrunError, match="options differ"):
        kvc.load(path, rt, check("snapkv:window=8"))
    kvc.load(path, rt, check("snapkv"))  # the same spec, given
    # the header rewritten as another format version
    from safetensors.torch import load_file, save_file

    header = kvc.read_header(path)
    header["version"] = 99
    save_file(load_file(str(path)), str(tmp_path / "v99.kvc"), {"kvrun_kvc": json.dumps(header)})
    with pytest.raises(KvrunError, match="format version 99; this kvrun reads version 3"):
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
        with pytest.raises(kvc.DamagedKvcFile, match=why) as e:
            kvc.load(bad, rt)
        assert "\n" not in str(e.value)
    with pytest.raises(KvrunError, match="no such .kvc file"):
        kvc.load(tmp_path / "missing.kvc", rt)


def rewrite(src: Path, dst: Path, header=None, state=None, tensors=None) -> Path:
    """dst: src with its header, state or tensors changed by the given functions (each takes
    the part and returns it), written the way kvc.save writes, as a stranger could."""
    import base64
    import zlib

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta, ts = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    head = json.loads(meta["kvrun_kvc"])
    st = json.loads(zlib.decompress(base64.b64decode(meta["kvrun_kvc_state"])))
    head = header(head) if header else head
    st = state(st) if state else st
    ts = tensors(ts) if tensors else ts
    packed = base64.b64encode(zlib.compress(json.dumps(st).encode())).decode()
    save_file(ts, str(dst), {"kvrun_kvc": json.dumps(head), "kvrun_kvc_state": packed})
    return dst


def _with(d: dict, **changes) -> dict:
    return {**d, **changes}


def test_a_crafted_state_builds_nothing_and_touches_nothing(tmp_path):
    """The file names no class or function: what the issue's crafted file did (an object
    reached from kvrun.kv's modules whose finalizer removed a file the .kvc named), fields
    added where the manager's methods are looked up, classes and kinds swapped, are each one
    line, before anything from the file reaches the run, and the victim file stays."""
    model = test_kv_methods.tiny()
    path, _ = _round_trip(tmp_path, model, "snapkv+kivi2")
    rt = _runtime(tmp_path, model)
    victim = tmp_path / "victim.txt"
    victim.write_text("still here")
    finalizer = {"$obj": "kvrun.kv.protocol:copy.weakref.finalize", "n": 9,
                 "state": {"path": str(victim)}}  # fmt: skip

    def layer0(st, **change):
        layers = [dict(st["layers"][0], **change)] + st["layers"][1:]
        return _with(st, layers=layers)

    cases = {
        "an object where a field holds a store": lambda st: layer0(st, dense=finalizer),
        "an undeclared field with an object": lambda st: layer0(st, hook=finalizer),
        "the manager's method shadowed": lambda st: _with(st, attend={"$fn": "os:remove"}),
        "a field removed": lambda st: {k: v for k, v in st.items() if k != "seen"},
        "a count of another kind": lambda st: _with(st, seen="150"),
        "a count out of range": lambda st: _with(st, seen=-1),
        "a list for a record": lambda st: layer0(st, dense=[1, 2]),
        "a tensor name of another tensor kind": lambda st: layer0(st, queries="tokens"),
    }
    for why, change in cases.items():
        bad = rewrite(path, tmp_path / "bad.kvc", state=change)
        with pytest.raises(kvc.DamagedKvcFile) as e:
            kvc.load(bad, rt)
        assert "\n" not in str(e.value) and str(bad) in str(e.value), why
    for klass in ("os:system", "builtins:eval", "kvrun.kv.cache:KVCache.__init__.__globals__"):
        bad = rewrite(
            path, tmp_path / "bad.kvc", header=lambda h, c=klass: _with(h, **{"class": c})
        )
        with pytest.raises(kvc.DamagedKvcFile, match="not this spec's cache"):
            kvc.load(bad, rt)
    assert victim.read_text() == "still here"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bad.kvc",
        "doc.kvc",
        "model.gguf",
        "victim.txt",
    ]


def test_tensors_retyped_reshaped_or_unnamed_are_one_line(tmp_path):
    model = test_kv_methods.tiny()
    path, _ = _round_trip(tmp_path, model, "minicache")
    rt = _runtime(tmp_path, model)

    def each(fn):
        return lambda ts: {k: (fn(v) if k != "tokens" else v) for k, v in ts.items()}

    cases = {
        "retyped": each(lambda t: t.to(torch.float64) if t.is_floating_point() else t.long()),
        "reshaped": each(lambda t: t.reshape(-1) if t.dim() > 1 else t[None]),
        "one more": lambda ts: _with(ts, extra=torch.zeros(3)),
        "tokens retyped": lambda ts: _with(ts, tokens=ts["tokens"].long()),
        "a token outside the vocabulary": lambda ts: _with(ts, tokens=ts["tokens"] + 10**6),
    }
    for why, change in cases.items():
        bad = rewrite(path, tmp_path / "bad.kvc", tensors=change)
        with pytest.raises(kvc.DamagedKvcFile) as e:
            kvc.load(bad, rt)
        assert "\n" not in str(e.value), why


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
    from kvrun.run.runtime import load_runtime

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
    from kvrun.models.config import SamplingConfig

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
    from kvrun.models.config import SamplingConfig
    from kvrun.run.chat import Conversation
    from kvrun.run.runtime import load_runtime

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


def test_every_mismatch_with_the_file_is_one_line_naming_both(tiny, tmp_path):
    """Another --kv, other options, another --kv-budget (with or without --kv): one line that
    names what the file holds and what was asked; the file's own budget, asked, loads."""
    doc = tmp_path / "doc.txt"
    doc.write_text(tiny_models.TEXT * 6)
    out, m = tmp_path / "doc.kvc", str(tiny.gguf_path)
    r = _run("prefill", "-m", m, "-f", str(doc), "--kv", "snapkv", "--kv-budget", "0.5",
             "-o", str(out))  # fmt: skip
    assert r.exit_code == 0, r.output
    held = "holds a --kv snapkv --kv-budget 0.5 cache"
    asked = {
        ("--kv", "h2o"): (held, "not --kv h2o"),
        ("--kv", "snapkv:window=8", "--kv-budget", "0.5"): ("options differ", "window=8"),
        ("--kv", "snapkv", "--kv-budget", "0.25"): (held, "not --kv-budget 0.25"),
        ("--kv-budget", "0.25"): (held, "not --kv-budget 0.25"),
        ("--kv-dtype", "q8_0"): ("holds an f16 cache", "not --kv-dtype q8_0"),
        ("--kv", "snapkv", "--kv-budget", "0.5", "-ctk", "f32"): ("f16", "--kv-dtype f32"),
    }
    for flags, needles in asked.items():
        r = _run("generate", "-m", m, "--kv-cache", str(out), *flags, "-p", "x", "-n", "1")
        one_error_line(r, str(out), *needles)
    for flags in (
        ("--kv-budget", "0.5"),
        ("--kv-budget", "1/2"),
        ("--kv", "snapkv", "--kv-budget", "0.5"),
    ):
        r = _run("generate", "-m", m, "--kv-cache", str(out), *flags, "-p", "x", "-n", "1")
        assert r.exit_code == 0, r.output
