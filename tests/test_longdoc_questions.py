"""kvrun longdoc with "questions": one compression of the document, each question answered on
a fork of it (kvrun/tasks/longdoc_questions.py). Checked: the answers equal --question-after
runs of each question alone, the lines and their indexes, resume, bad entries, --parallel,
and that a question on a held cache runs no selection point."""

from __future__ import annotations

import json

import pytest
import torch
from test_longdoc import GROUP, LONG, records, write_jsonl

import tiny_models
from kvrun.kv import check
from kvrun.run.engine import Engine, Request
from kvrun.run.runtime import load_runtime
from kvrun.run.sampling import SamplingConfig
from kvrun.run.session import Session
from kvrun.tasks import longdoc_questions as lq

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = {
    "a": "Doc a. " + " ".join(tiny_models.CORPUS) * 3,
    "b": "Doc b. " + tiny_models.TEXT * 5,
}
QUESTIONS = ["Who reads?", "What does the cache keep, and why?", "Which number?"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models.build(tmp_path_factory.mktemp("tinyq"))


def run(tiny, *args):
    base = ["longdoc", "-m", str(tiny.gguf_path), "--device", "cpu", "--dtype", "float32"]
    from click.testing import CliRunner

    return CliRunner().invoke(GROUP, base + ["-n", "4"] + list(args), catch_exceptions=False)


def multi_lines(questions=QUESTIONS):
    return [{"id": k, "text": t, "questions": questions} for k, t in DOCS.items()]


def by_key(recs):
    return {(r["id"], r["question_index"]): r for r in recs}


KV = {"full": [], "snapkv": ["--kv", "snapkv", "--kv-budget", "0.3"],
      "kvzip": ["--kv", "kvzip", "--kv-budget", "0.3"]}  # fmt: skip


@pytest.mark.parametrize("method", list(KV))
def test_questions_equal_question_after_runs_of_each(tiny, tmp_path, method):
    """Each answer of a "questions" line is the --question-after answer of that question alone
    (greedy): the same tokens, the same prompt, the same bytes held at the end."""
    src = write_jsonl(tmp_path / "q.jsonl", multi_lines())
    r = run(tiny, "--jsonl", str(src), *KV[method])
    assert r.exit_code == 0, r.stderr
    got = by_key(records(r.stdout))
    singles = [
        {"id": f"{k}/{i}", "text": t, "question": q}
        for k, t in DOCS.items()
        for i, q in enumerate(QUESTIONS)
    ]
    src1 = write_jsonl(tmp_path / "one.jsonl", singles)
    r = run(tiny, "--jsonl", str(src1), "--question-after", *KV[method])
    assert r.exit_code == 0, r.stderr
    want = {rec["id"]: rec for rec in records(r.stdout)}
    assert sorted(got) == sorted((k, i) for k in DOCS for i in range(len(QUESTIONS)))
    for (k, i), rec in got.items():
        one = want[f"{k}/{i}"]
        assert (
            rec["error"] is None and rec["question"] == QUESTIONS[i] and rec["task"] == "question"
        )
        assert rec["tokens"] == one["tokens"] and rec["answer"] == one["answer"]
        assert rec["document_tokens"] + rec["prompt_tokens"] == one["prompt_tokens"]
        assert rec["kv_bytes"] == one["kv_bytes"] and rec["kv_bytes_full"] == one["kv_bytes_full"]
        assert rec["document_prefill_s"] > 0 and one["document_prefill_s"] is None
        assert one["question_index"] is None
    if method != "full":
        assert all(rec["kv_bytes"] < rec["kv_bytes_full"] for rec in got.values())


def test_parallel_equals_sequential_and_documents_prefill_once(tiny, tmp_path, monkeypatch):
    """--parallel 3 over two "questions" lines and a plain line gives the sequential records;
    each document is prepared (and prefilled) once."""
    rows = multi_lines() + [{"id": "plain", "text": DOCS["a"], "question": "Who?"}]
    src = write_jsonl(tmp_path / "q.jsonl", rows)
    prepared = []
    real = lq.prepare_questions
    monkeypatch.setattr(
        lq, "prepare_questions", lambda s, d, j: prepared.append(d.id) or real(s, d, j)
    )
    out = {}
    for n in ("1", "3"):
        r = run(tiny, "--jsonl", str(src), "--kv", "kvzip", "--kv-budget", "0.3", "-np", n)
        assert r.exit_code == 0, r.stderr
        out[n] = by_key(records(r.stdout))
    assert prepared == ["a", "b", "a", "b"]
    assert sorted(out["1"], key=str) == sorted(out["3"], key=str) and len(out["1"]) == 7
    for key, rec in out["1"].items():
        assert out["3"][key]["tokens"] == rec["tokens"] and out["3"][key]["error"] is None
    assert "parallel 3:" in r.stderr


def test_resume_skips_answered_questions(tiny, tmp_path, monkeypatch):
    """A rerun with --resume answers only the (id, index) pairs not yet in OUT (an error line
    and a half-written line are redone); a document whose questions are all answered is not
    prefilled again; nothing is lost or duplicated."""
    src = write_jsonl(tmp_path / "q.jsonl", multi_lines())
    full = tmp_path / "full.jsonl"
    assert run(tiny, "--jsonl", str(src), "-o", str(full)).exit_code == 0
    lines = full.read_text().splitlines()
    keep = [ln for ln in lines if json.loads(ln)["id"] == "a"] + [
        ln for ln in lines if json.loads(ln)["id"] == "b" and json.loads(ln)["question_index"] == 0
    ]
    err = json.loads(keep[-1]) | {"question_index": 2, "error": "boom", "answer": None}
    dst = tmp_path / "out.jsonl"
    dst.write_text("\n".join(keep) + "\n" + json.dumps(err) + '\n{"id": "b", "quest')
    prepared = []
    real = lq.prepare_questions
    monkeypatch.setattr(
        lq, "prepare_questions", lambda s, d, j: prepared.append((d.id, d.asked)) or real(s, d, j)
    )
    r = run(tiny, "--jsonl", str(src), "-o", str(dst), "--resume")
    assert r.exit_code == 0, r.stderr
    assert prepared == [("b", [1, 2])]
    assert "resuming" in r.stderr and "1 error lines to retry" in r.stderr
    now = dst.read_text().splitlines()
    assert now[: len(keep)] == keep
    assert sorted(by_key(records("\n".join(now)))) == sorted(by_key(records("\n".join(lines))))
    assert len(now) == len(lines)
    redone = by_key(records("\n".join(now)))
    assert all(
        redone[k]["tokens"] == v["tokens"] for k, v in by_key(records(full.read_text())).items()
    )


def test_bad_entries_and_lines_are_one_line_each(tiny, tmp_path):
    """A non-string or empty entry fails alone (its index recorded) and its siblings are
    answered; a bad "questions" field, or "question" with it, fails the line; the run goes on
    and exits 1."""
    rows = [
        {"id": 1, "text": DOCS["a"], "questions": ["Who reads?", 7, "  ", "Why?"]},
        {"id": 2, "text": DOCS["b"], "questions": "Who?"},
        {"id": 3, "text": DOCS["b"], "questions": []},
        {"id": 4, "text": DOCS["b"], "questions": ["Who?"], "question": "Why?"},
        {"id": 5, "path": str(tmp_path / "missing.txt"), "questions": ["Who?", "Why?"]},
        {"id": 6, "text": DOCS["b"], "questions": [{"q": 1}]},
    ]
    src = write_jsonl(tmp_path / "q.jsonl", rows)
    r = run(tiny, "--jsonl", str(src))
    assert r.exit_code == 1
    recs = records(r.stdout)
    assert all("\n" not in (x["error"] or "") for x in recs)
    got = by_key(recs)
    assert got[(1, 0)]["error"] is None and got[(1, 3)]["error"] is None
    assert got[(1, 1)]["error"] == "questions[1] must be a non-empty string"
    assert got[(1, 1)]["question"] is None and got[(1, 2)]["error"].startswith("questions[2]")
    assert (
        "non-empty list" in got[(2, None)]["error"] and "non-empty list" in got[(3, None)]["error"]
    )
    assert "not both" in got[(4, None)]["error"]
    assert "cannot read" in got[(5, 0)]["error"] and "cannot read" in got[(5, 1)]["error"]
    assert got[(5, 1)]["question"] == "Why?" and got[(6, 0)]["error"].startswith("questions[0]")
    assert len(recs) == 10
    assert r.stderr.splitlines()[-1] == "error: 8 of 10 answers failed (their errors are above)"


def test_template_with_the_question_first_is_refused(tiny, tmp_path):
    (tmp_path / "t.txt").write_text("Question: {question}\n\n{document}\n\nAnswer:")
    src = write_jsonl(tmp_path / "q.jsonl", multi_lines()[:1])
    r = run(tiny, "--jsonl", str(src), "--template", str(tmp_path / "t.txt"), "--raw")
    assert r.exit_code == 1
    errs = [x["error"] for x in records(r.stdout)]
    assert len(errs) == 3 and all("{question} slot after {document}" in e for e in errs)


def test_the_document_leaves_room_for_the_longest_question(tiny, tmp_path):
    qs = ["Who?", "Which of the many keys and values does the cache keep after it reads?"]
    src = write_jsonl(tmp_path / "q.jsonl", [{"id": 1, "text": LONG, "questions": qs}])
    r = run(tiny, "--jsonl", str(src), "-c", "200")
    assert r.exit_code == 0, r.stderr
    a, b = records(r.stdout)
    assert a["document_tokens"] == b["document_tokens"] and a["truncated"] and b["truncated"]
    assert a["document_tokens"] + max(a["prompt_tokens"], b["prompt_tokens"]) + 4 == 200


@pytest.mark.parametrize("spec", ["snapkv", "kvzip", "knorm"])
def test_a_question_on_a_fork_runs_no_selection_point(tiny, spec):
    """Request(ids=[], question=q, start=fork): the question's turn reaches no selection
    point (the debug hook hears nothing after the document's prefill) and the tokens equal
    Session.generate(doc, question=q)."""
    rt = load_runtime(str(tiny.gguf_path), "float32", "cpu", log=lambda m: None)
    doc = rt.tokenizer.encode("Doc. " + tiny_models.TEXT * 4)
    q = rt.tokenizer.encode(" Question: what is kept?", add_bos=False)
    greedy = SamplingConfig(temp=0.0)
    heard = []
    kv = rt.new_kv(check(spec, "0.3"), on_select=lambda *e: heard.append(e[1]))
    want = Session(rt.model, rt.tokenizer, rt.new_kv(check(spec, "0.3")), ubatch=32)
    want = want.generate(doc, 5, greedy, seed=0, question=q).tokens
    base = Session(rt.model, rt.tokenizer, kv, ubatch=32)
    with torch.inference_mode():
        base.prefill(doc)
    n_doc = len(heard)
    assert n_doc > 0
    got = {}
    session = Session(rt.model, rt.tokenizer, rt.new_kv(check(spec, "0.3")), ubatch=32)
    req = Request([], 5, greedy, 0, "q", start=(kv.fork(), list(base.tokens)), question=q)
    Engine([session]).run([req], lambda r, res, err: got.__setitem__(r.tag, (res, err)))
    res, err = got["q"]
    assert err is None and res.tokens == want
    assert heard[n_doc:] == [] and res.stats.prompt_tokens == len(q)


def test_kv_cache_dir_keeps_documents_for_later_runs(tiny, tmp_path):
    """--kv-cache-dir: the first run saves each compressed document (one .kvc a document), a
    second run loads them and gives the same answers; --parallel loads them too; a damaged
    file fails its document's lines in one line each."""
    src = write_jsonl(tmp_path / "q.jsonl", multi_lines())
    store = tmp_path / "kvc"
    kv = ["--kv", "kvzip", "--kv-budget", "0.3", "--kv-cache-dir", str(store)]
    runs = []
    for extra in ([], [], ["-np", "2"]):
        r = run(tiny, "--jsonl", str(src), *kv, *extra)
        assert r.exit_code == 0, r.stderr
        runs.append(by_key(records(r.stdout)))
    assert len(list(store.glob("*.kvc"))) == 2 and not list(store.glob("*.tmp"))
    assert {x["document_kvc"] for x in runs[0].values()} == {"saved"}
    for later in runs[1:]:
        assert {x["document_kvc"] for x in later.values()} == {"loaded"}
        assert {k: x["tokens"] for k, x in later.items()} == {
            k: x["tokens"] for k, x in runs[0].items()
        }
    other = run(tiny, "--jsonl", str(src), "--kv", "snapkv", "--kv-cache-dir", str(store))
    assert {x["document_kvc"] for x in records(other.stdout)} == {"saved"}  # its own files
    for f in sorted(store.glob("*.kvc")):
        f.write_bytes(f.read_bytes()[:200])
    r = run(tiny, "--jsonl", str(src), *kv)
    assert r.exit_code == 1
    errs = [x["error"] for x in records(r.stdout)]
    assert len(errs) == 6 and all(e and ".kvc" in e and "\n" not in e for e in errs)
    assert all("damaged" in e or "not a readable" in e for e in errs)


@pytest.mark.parametrize("n", [1, 2])
def test_ray_worker_answers_questions_as_the_local_run(tiny, tmp_path, n):
    """The Ray path without Ray: worker_setup's handler gives each document's records (a
    list: one a question) and RayRunner writes them all, as the local run does."""
    from kvrun.run.options import KVOptions, ModelOptions, ParallelOptions
    from kvrun.tasks import longdoc as task
    from kvrun.tasks.longdoc_run import LongdocOptions, RayRunner, worker_setup

    model = ModelOptions(str(tiny.gguf_path), "float32", device="cpu")
    templates = {t: task.load_template(t) for t in ("question", "summarize")}
    opts = LongdocOptions(templates, None, False, None, None, 4, "middle",
                          SamplingConfig(temp=0.0), 0)  # fmt: skip
    handler, facts = worker_setup(model, KVOptions("snapkv", "0.3"), ParallelOptions(n), opts)
    lines = [json.dumps(x) for x in multi_lines() + [{"id": "p", "text": "Hi.", "question": 1}]]

    class Pool:  # kvrun.run.cluster.Pool's stream, in this process
        def stream(self, items, chunk):
            items = list(items)
            for (_, doc), recs in zip(items, handler([d for _, d in items], "here"), strict=True):
                yield doc, recs, None

    job = opts.job(facts["kv"], facts["settings"])
    got = []
    failed = RayRunner(Pool(), 8)(list(task.iter_docs(lines)), job, got.append, set(), None,
                                  lambda d, r: None)  # fmt: skip
    assert failed == 1 and len(got) == 7
    assert [r.get("node") for r in got].count("here") == 6
    src = write_jsonl(tmp_path / "q.jsonl", lines)
    local = by_key(
        records(run(tiny, "--jsonl", str(src), "--kv", "snapkv", "--kv-budget", "0.3").stdout)
    )
    keyed = by_key(got)
    assert sorted(keyed, key=str) == sorted(local, key=str)
    assert all(keyed[k]["tokens"] == local[k]["tokens"] for k in keyed)
    assert keyed[("p", None)]["error"] == '"question" must be a string'
