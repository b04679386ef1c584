"""--question-after: the document is prefilled and compressed before the question is seen, and
the question arrives as a turn of its own on the compressed cache that selects nothing
(kvrun/kv/protocol.py: begin_prefill(n, select=False)).

Checked here: what a method keeps of the document does not depend on the question, the
question's tokens are all kept, the batch engine gives what a single session gives, and
`kvrun needle` / `kvrun longdoc` run the mode and record it in their JSON."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from test_kv_methods import hooked, prompt, tiny

import tiny_models
from kvrun.cli.main import cli
from kvrun.run.engine import Engine, Request
from kvrun.run.runtime import load_runtime
from kvrun.run.sampling import SamplingConfig
from kvrun.run.session import Session

pytestmark = pytest.mark.usefixtures("one_thread")

DOC, QUESTIONS = prompt(120, seed=31), (prompt(9, seed=32), prompt(14, seed=33))
METHODS = ["snapkv", "pyramidkv", "h2o", "streaming", "tova", "knorm", "kvzip", "minikv", "xkv",
           "snapkv+kivi2", "spindlekv", "minicache"]  # fmt: skip


def ask(spec: str, question: list[int]):
    """The kept positions reported at the end of the document's prefill, the cache and the
    logits after the question turn."""
    m = tiny()
    kv, ev = hooked(m, spec, "0.3" if spec.split("+")[0] not in ("minicache",) else None)
    s = Session(m, None, kv, ubatch=32)
    with torch.inference_mode():
        logits = s.prefill(DOC, question=question)
    at_doc = [rows for layer, point, n, rows in ev if n == len(DOC)]
    return at_doc, ev, kv, logits


@pytest.mark.parametrize("spec", METHODS)
def test_the_document_is_compressed_before_the_question(spec):
    """Two questions: the same kept positions of the document; no selection in the question's
    turn; every question token is held and the turn's tokens count in `seen`."""
    (a, ev_a, kv_a, la), (b, ev_b, kv_b, lb) = (ask(spec, q) for q in QUESTIONS)
    assert a == b
    for ev, kv, q in ((ev_a, kv_a, QUESTIONS[0]), (ev_b, kv_b, QUESTIONS[1])):
        assert kv.seen == len(DOC) + len(q)
        assert all(n == len(DOC) for _, point, n, _ in ev if point == "prefill")
        if hasattr(kv, "kept_counts") and spec in ("snapkv", "pyramidkv", "knorm", "kvzip"):
            kept = [len(rows[0]) for rows in ([r for r in a if r] or [])]
            assert kv.kept_counts() == [k + len(q) for k in kept]
    assert not torch.equal(la, lb)


def test_the_question_in_the_prompt_is_selected_with_it():
    """Without --question-after the same tokens in one turn let SnapKV's window see the
    question: it keeps other document tokens (the mode changes what is measured)."""
    m = tiny()
    kept = []
    for question in (None, QUESTIONS[0]):
        kv, ev = hooked(m, "snapkv", "0.3")
        s = Session(m, None, kv, ubatch=32)
        ids = DOC if question else DOC + QUESTIONS[0]
        with torch.inference_mode():
            s.prefill(ids, question=question)
        kept.append([rows for *_, rows in ev])
    assert kept[0] != kept[1]


@pytest.fixture(scope="module")
def tiny_rt(tmp_path_factory):
    return load_runtime(
        str(tiny_models.build(tmp_path_factory.mktemp("qa")).gguf_path), "float32", "cpu",
        log=lambda m: None,
    )  # fmt: skip


@pytest.mark.parametrize("spec", ["snapkv", "kvzip"])
def test_engine_equals_a_session(tiny_rt, spec):
    """Requests with a question turn, batched, give the tokens of sequential sessions."""
    from kvrun.kv import check

    greedy = SamplingConfig(temp=0.0)
    tok = tiny_rt.tokenizer
    docs = [tok.encode(" ".join(tiny_models.CORPUS) * k) for k in (2, 3, 4)]
    question = tok.encode(" What is it?", add_bos=False)
    want = []
    for d in docs:
        s = Session(tiny_rt.model, tok, tiny_rt.new_kv(check(spec, "0.3")), ubatch=64)
        want.append(s.generate(d, 6, greedy, seed=0, question=question).tokens)
    sessions = [Session(tiny_rt.model, tok, tiny_rt.new_kv(check(spec, "0.3")), ubatch=64)
                for _ in range(2)]  # fmt: skip
    got = {}
    reqs = [Request(d, 6, greedy, 0, i, question=question) for i, d in enumerate(docs)]
    Engine(sessions).run(reqs, lambda r, res, err: got.__setitem__(r.tag, (res, err)))
    for i, w in enumerate(want):
        res, err = got[i]
        assert err is None and res.tokens == w
        assert res.stats.prompt_tokens == len(docs[i]) + len(question)


def test_needle_and_longdoc_record_the_mode(tmp_path, tiny_rt):
    """`kvrun needle --question-after` and `kvrun longdoc --question-after` run through the CLI;
    the JSON says which mode ran; the prompt tokens are those of the plain mode."""
    model = str(tiny_rt.path)
    base = ["needle", "-m", model, "--device", "cpu", "--dtype", "float32", "--lengths", "300",
            "--depths", "50", "-n", "3", "--kv", "snapkv", "--kv-budget", "0.3"]  # fmt: skip
    docs = {}
    for flag in ([], ["--question-after"]):
        out = tmp_path / f"n{len(flag)}.json"
        r = CliRunner().invoke(cli, base + flag + ["--json", str(out)], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        docs[bool(flag)] = json.loads(out.read_text())
    assert docs[True]["settings"]["question_after"] is True
    assert docs[False]["settings"]["question_after"] is False
    assert [t["question_after"] for t in docs[True]["trials"]] == [True]
    assert docs[True]["trials"][0]["prompt_tokens"] == docs[False]["trials"][0]["prompt_tokens"]

    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(tiny_models.CORPUS) * 4)
    out = tmp_path / "a.jsonl"
    args = ["longdoc", "-m", model, "--device", "cpu", "--dtype", "float32", "-n", "2", str(doc),
            "-q", "Who reads?", "--kv", "kvzip", "--question-after", "-o", str(out)]  # fmt: skip
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())
    assert rec["error"] is None and rec["settings"]["question_after"] is True
    assert rec["kv"]["method"] == "kvzip" and rec["kv_bytes"] < rec["kv_bytes_full"]
