"""kvrun longdoc: truncation, prompt building, the JSONL batch with resume, and bad input."""

from __future__ import annotations

import json

import pytest
import torch
from cli_checks import one_error_line
from click.testing import CliRunner

import tiny_models
from kvrun.cli.longdoc import longdoc
from kvrun.cli.main import KvrunGroup
from kvrun.errors import ContextOverflow
from kvrun.run.runtime import load_runtime
from kvrun.tasks import longdoc as task

GROUP = KvrunGroup("kvrun")
GROUP.add_command(longdoc)
LONG = " ".join(tiny_models.CORPUS) * 20  # well over 1,000 tiny-model tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    return tiny_models.build(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_tok(tiny):
    return load_runtime(str(tiny.gguf_path), "float32", "cpu", log=lambda m: None).tokenizer


def run(*args, model=None, input=None):
    base = ["longdoc", "--device", "cpu", "--dtype", "float32", "-n", "2"]
    base += ["-m", str(model)] if model else []
    return CliRunner().invoke(GROUP, base + list(args), input=input, catch_exceptions=False)


def records(text: str) -> list[dict]:
    return [json.loads(ln) for ln in text.splitlines()]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_truncate_ids_keeps_exactly_head_and_tail():
    ids = list(range(100))
    assert task.truncate_ids(ids, 11, "middle") == (list(range(5)) + list(range(94, 100)), 89)
    assert task.truncate_ids(ids, 10, "left") == (list(range(90, 100)), 90)
    assert task.truncate_ids(ids, 100, "middle") == (ids, 0)
    assert task.truncate_ids(ids, 1, "middle") == ([99], 99)
    with pytest.raises(ContextOverflow, match="100 tokens but 10 fit"):
        task.truncate_ids(ids, 10, "error")


@pytest.mark.parametrize("chat", [True, False])
def test_prompt_keeps_template_and_question_and_cuts_the_document(tiny_tok, chat):
    template = task.load_template("question")
    before, after = task.prompt_frame(tiny_tok, template, "Who reads?", chat)
    doc = tiny_tok.encode(LONG, add_bos=False, special=False)
    ctx, n = 300, 16
    budget = ctx - len(before) - len(after) - n
    ids, dropped = task.build_prompt(tiny_tok, template, "Who reads?", LONG, chat, ctx, n, "middle")
    head = budget // 2
    assert ids == before + doc[:head] + doc[len(doc) - (budget - head) :] + after
    assert dropped == len(doc) - budget and len(ids) == ctx - n
    ids, _ = task.build_prompt(tiny_tok, template, "Who reads?", LONG, chat, ctx, n, "left")
    assert ids == before + doc[-budget:] + after
    assert tiny_tok.decode(after).rstrip().endswith("Answer:" if not chat else "assistant")
    assert "Question: Who reads?" in tiny_tok.decode(after)
    with pytest.raises(ContextOverflow, match="no room"):
        task.build_prompt(
            tiny_tok, template, "Who reads?", LONG, chat, len(before) + len(after), 0, "left"
        )


def test_truncation_modes_through_the_batch(tiny, tmp_path):
    src = write_jsonl(
        tmp_path / "in.jsonl", [{"id": "long", "text": LONG}, {"id": "short", "text": "Hi."}]
    )
    out = {}
    for mode in task.TRUNCATE_MODES:
        r = run(
            "--jsonl", str(src), "-q", "Why?", "-c", "256", "--truncate", mode, model=tiny.gguf_path
        )
        out[mode] = {rec["id"]: rec for rec in records(r.stdout)}
        assert r.exit_code == (1 if mode == "error" else 0), r.stderr
    for mode in ("middle", "left"):
        rec = out[mode]["long"]
        assert rec["truncated"] and rec["dropped_tokens"] > 1000 and rec["error"] is None
        assert rec["prompt_tokens"] == 256 - 2 and rec["settings"]["truncate"] == mode
        assert (
            out[mode]["short"]["truncated"] is False and out[mode]["short"]["dropped_tokens"] == 0
        )
    assert out["middle"]["long"]["dropped_tokens"] == out["left"]["long"]["dropped_tokens"]
    assert "fit" in out["error"]["long"]["error"] and out["error"]["long"]["answer"] is None
    assert out["error"]["short"]["error"] is None


def test_file_mode_prints_headers_and_stats(tiny, tmp_path):
    (tmp_path / "a.txt").write_text(tiny_models.TEXT)
    (tmp_path / "b.txt").write_text(LONG)
    r = run(
        str(tmp_path / "a.txt"),
        str(tmp_path / "b.txt"),
        "--summarize",
        "-c",
        "256",
        model=tiny.gguf_path,
    )
    assert r.exit_code == 0, r.stderr
    assert r.stdout.count("==> ") == 2 and f"==> {tmp_path / 'b.txt'} <==" in r.stdout
    assert r.stderr.count("prompt ") == 2 and "truncated (middle)" in r.stderr
    assert '"n_predict": 2' in r.stderr  # the settings line


def test_resume_after_interrupt_loses_and_duplicates_nothing(tiny, tmp_path, monkeypatch):
    src = write_jsonl(
        tmp_path / "in.jsonl",
        [{"id": i, "text": f"Doc {i}. {tiny_models.TEXT}"} for i in range(1, 6)],
    )
    dst = tmp_path / "out.jsonl"
    real, calls = task.answer_document, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(task, "answer_document", flaky)
    r = run("--jsonl", str(src), "--out", str(dst), "-q", "Which doc?", model=tiny.gguf_path)
    assert r.exit_code == 130 and "--resume" in r.stderr
    first = dst.read_text().splitlines()
    assert [json.loads(ln)["id"] for ln in first] == [1, 2]
    monkeypatch.setattr(task, "answer_document", real)
    r = run(
        "--jsonl", str(src), "--out", str(dst), "-q", "Which doc?", "--resume", model=tiny.gguf_path
    )
    assert r.exit_code == 0, r.stderr
    lines = dst.read_text().splitlines()
    assert lines[:2] == first
    assert sorted(json.loads(ln)["id"] for ln in lines) == [1, 2, 3, 4, 5]
    assert all(json.loads(ln)["error"] is None for ln in lines)


def test_partial_line_and_error_lines_are_redone_on_resume(tiny, tmp_path):
    src = write_jsonl(
        tmp_path / "in.jsonl", [{"id": f"d{i}", "text": tiny_models.TEXT} for i in range(3)]
    )
    dst = tmp_path / "out.jsonl"
    ok = json.dumps({"id": "d0", "answer": "kept", "error": None})
    dst.write_text(ok + "\n" + json.dumps({"id": "d1", "error": "boom"}) + '\n{"id": "d2", "ans')
    r = run("--jsonl", str(src), "-o", str(dst), "--summarize", "--resume", model=tiny.gguf_path)
    assert r.exit_code == 0, r.stderr
    assert "1 error lines to retry" in r.stderr and "1 unreadable lines dropped" in r.stderr
    lines = dst.read_text().splitlines()
    assert lines[0] == ok and [json.loads(ln)["id"] for ln in lines] == ["d0", "d1", "d2"]
    assert dst.read_text().endswith("\n")


def test_failing_documents_get_error_lines_and_the_batch_goes_on(tiny, tmp_path):
    src = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"id": 1, "text": tiny_models.TEXT},
            {"id": 2, "path": str(tmp_path / "missing.txt")},
            '{"id": 3, "text": ',
            {"id": 1, "text": "again"},
            {"id": 5, "text": "   "},
            {"id": 6, "text": tiny_models.TEXT, "question": "Who keeps values?"},
            {"id": 7, "path": str(tmp_path / "in.jsonl"), "question": 7},
            "null",
        ],
    )
    r = run("--jsonl", str(src), "--summarize", model=tiny.gguf_path)
    assert r.exit_code == 1
    assert r.stderr.splitlines()[-1] == "error: 6 of 8 documents failed (their errors are above)"
    recs = records(r.stdout)
    assert [x["id"] for x in recs] == [1, 2, None, 1, 5, 6, 7, None]
    errors = [x["error"] for x in recs]
    assert errors[0] is None and errors[5] is None
    assert "cannot read" in errors[1] and "line 3: not valid JSON" in errors[2]
    assert "duplicate id" in errors[3] and "empty" in errors[4] and "must be a string" in errors[6]
    assert errors[7].startswith("line 8: not an object")
    assert recs[0]["task"] == "summarize" and recs[5]["task"] == "question"
    assert all("\n" not in e for e in errors if e)


def test_stdin_jsonl_to_stdout(tiny):
    texts = [tiny_models.CORPUS[0], "A line\u2028separator and \u00e9 stay in one JSON line."]
    rows = "".join(
        json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n" for i, t in enumerate(texts)
    )
    r = run("--jsonl", "-", "-q", "What?", "-s", "7", model=tiny.gguf_path, input=rows)
    assert r.exit_code == 0, r.stderr
    recs = records(r.stdout)
    assert [x["id"] for x in recs] == [0, 1]
    for rec in recs:
        assert rec["generated_tokens"] == len(rec["tokens"]) and rec["kv"] == {
            "method": "full",
            "kv_dtype": "f16",
        }
        assert rec["kv_bytes"] == rec["kv_bytes_full"] > 0 and rec["kv_ratio"] == 1.0
        assert rec["settings"]["seed"] == 7 and rec["settings"]["temp"] == 0.0


@pytest.mark.parametrize(
    "args, needle",
    [
        ([], "no documents"),
        (["a.txt"], "--question"),
        (["--jsonl", "/nonexistent/in.jsonl", "-q", "x"], "cannot read --jsonl"),
        (["--jsonl", "in.jsonl", "-q", "x", "--resume"], "--resume needs --out"),
        (["a.txt", "--jsonl", "in.jsonl", "-q", "x"], "not both"),
        (["a.txt", "-q", "x", "--summarize"], "not both"),
        (["missing.txt", "-q", "x"], "cannot read missing.txt"),
        (["--jsonl", "empty.jsonl", "-q", "x"], "holds no documents"),
        (["--jsonl", "in.jsonl", "-q", "x", "-o", "done.jsonl"], "--resume"),
        (["a.txt", "-q", "x", "--template", "a.txt"], "no {document} slot"),
        (["a.txt", "-q", "x", "-o", "no/such/dir/out.jsonl"], "folder does not exist"),
    ],
)
def test_bad_input_is_one_line(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("text")
    (tmp_path / "in.jsonl").write_text('{"id": 1, "text": "x"}\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "done.jsonl").write_text('{"id": 1, "error": null}\n')
    one_error_line(run(*args, model="/nonexistent/never-loaded.gguf"), needle)


def test_default_model_answers_from_the_document(default_gguf, tmp_path):
    doc = tmp_path / "memo.txt"
    doc.write_text(
        "Memo. The quarterly review moved from Monday to Thursday. It will be held in room 12 "
        "on the third floor, and lunch is provided. Bring the sales figures."
    )
    r = run(str(doc), "-q", "Which room is the review in?", "-n", "16", model=default_gguf)
    assert r.exit_code == 0, r.stderr
    assert "12" in r.stdout
