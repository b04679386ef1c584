"""kvrun ruler: RULER's tasks made from a seed (deterministic, answers in the context, the length
met in tokens, each task's format), RULER's scorer on hand-made replies, the command on the tiny
model (JSONL, --resume, every bad input as one error line) and on the default model."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from click.testing import CliRunner
from test_cli import one_error_line

from kvrun.cli.main import KvrunGroup
from kvrun.cli.ruler import ruler
from kvrun.errors import KvrunError
from kvrun.kv import check
from kvrun.run.runtime import load_runtime
from kvrun.tasks import ruler as ru
from kvrun.tasks.ruler_tasks import NOISE, TASKS, essay_words
from tiny_models import build

pytestmark = pytest.mark.usefixtures("one_thread")
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build(tmp_path_factory.mktemp("tiny_ruler"), digits=True)


@pytest.fixture(scope="module")
def tok(tiny):
    return load_runtime(str(tiny.gguf_path), "float32", "cpu", log=lambda m: None).tokenizer


def gen(tok, length=2000, seed=7, chat=False):
    return ru.Generator(ru.prompt_form(tok, chat), length, seed)


def test_task_table_is_rulers():
    """The eleven offline tasks with synthetic.yaml's settings and constants.py's token counts."""
    assert list(TASKS) == [
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
        "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
    ]  # fmt: skip
    a = {k: t.args for k, t in TASKS.items()}
    assert [a[f"niah_single_{i}"]["haystack"] for i in (1, 2, 3)] == ["noise", "essay", "essay"]
    assert a["niah_single_3"]["v"] == "uuids" and a["niah_multikey_3"]["k"] == "uuids"
    assert a["niah_multikey_1"]["nk"] == 4 and a["niah_multikey_2"]["haystack"] == "needle"
    assert a["niah_multivalue"]["nv"] == 4 and a["niah_multiquery"]["nq"] == 4
    assert a["vt"] == {"chains": 1, "hops": 4}
    assert a["cwe"] == {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10} and a["fwe"] == {"alpha": 2.0}
    n = {k: t.n_predict for k, t in TASKS.items()}
    assert n["niah_single_1"] == 128 and (n["vt"], n["cwe"], n["fwe"]) == (30, 120, 50)


@pytest.mark.parametrize("task", list(TASKS))
def test_sample_is_deterministic_holds_its_answers_and_fits(tok, task):
    """One seed, one sample (a second generator agrees); another seed another; every answer
    is in the context; prompt + answer tokens reach the length within a haystack unit."""
    s = gen(tok).sample(task, 3)
    assert s == gen(tok).sample(task, 3)
    assert s != gen(tok, seed=8).sample(task, 3)
    assert s != gen(tok).sample(task, 4)
    assert s.answers and all(a in s.context for a in s.answers)
    assert len(set(s.answers)) == len(s.answers)
    form = ru.prompt_form(tok, False)
    ctx, q = form.ids(s.context, s.question, s.answer_prefix)
    assert s.prompt_tokens == len(ctx) + len(q)
    # one haystack unit short at most: a line of noise or needles, else a few words
    lined = task == "vt" or TASKS[task].args.get("haystack") in ("noise", "needle")
    body = s.context.split("\n")[1:-1]
    slack = max(len(tok.encode(ln, add_bos=False)) for ln in body) + 5 if lined else 40
    assert 2000 - slack <= s.prompt_tokens + s.n_predict <= 2000


def test_niah_formats(tok):
    g = gen(tok)
    s = g.sample("niah_single_1", 0)
    lines = s.context.split("\n")
    needles = [ln for ln in lines if ln.startswith("One of the special magic numbers for ")]
    assert len(needles) == 1 and set(lines[1:-1]) == {NOISE, needles[0]}
    key, value = re.fullmatch(
        r"One of the special magic numbers for (\S+) is: (\d{7})\.", needles[0]
    ).groups()
    assert re.fullmatch(r"[a-z]+-[a-z]+", key) and s.answers == [value]
    assert s.context.startswith("A special magic number is hidden within the following text.")
    assert (
        s.question == f"What is the special magic number for {key} mentioned in the provided text?"
    )
    assert (
        s.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    )

    s = g.sample("niah_single_3", 0)
    assert re.fullmatch(UUID, s.answers[0]) and "magic uuid" in s.question
    words = set(essay_words())
    assert len(set(s.context.split()) & words) > 50  # the GPL text as the essay

    s = g.sample("niah_multikey_3", 0)
    body = s.context.split("\n")[1:-1]
    assert all(
        re.fullmatch(f"One of the special magic uuids for {UUID} is: {UUID}\\.", ln) for ln in body
    )
    asked = re.search(f"for ({UUID}) mentioned", s.question).group(1)
    assert sum(asked in ln for ln in body) == 1  # the distractors hold other keys

    s = g.sample("niah_multivalue", 0)
    assert len(s.answers) == 4 and s.question.startswith(
        "What are all the special magic numbers for"
    )
    key = re.search(r"numbers for (\S+) mentioned", s.question).group(1)
    assert s.context.count(f"numbers for {key} is: ") == 4

    s = g.sample("niah_multiquery", 0)
    keys = re.search(r"numbers for (.+) mentioned", s.question).group(1)
    assert re.fullmatch(r"\S+, \S+, \S+, and \S+", keys) and len(s.answers) == 4
    assert s.answer_prefix.endswith("mentioned in the provided text are")


def test_vt_format(tok):
    s = gen(tok).sample("vt", 0)
    assert s.context.count("Memorize and track the chain(s)") == 2  # the one-shot example first
    example, task = s.context.rsplit("\nMemorize and track", 1)
    value = re.search(r"assigned the value (\d{5}) in", s.question).group(1)
    chain = re.findall(r"^VAR ([A-Z]{5}) = (\S+(?: [A-Z]{5})?) ?$", task, flags=re.M)
    assert [c[0] for c in chain] == s.answers and chain[0][1] == value
    assert all(b == f"VAR {a[0]}" for a, b in zip(chain, [c[1] for c in chain[1:]], strict=False))
    assert re.findall(r"^VAR ([A-Z]{3}) = ", example, flags=re.M)  # 3-letter names, solved
    assert s.answer_prefix.startswith(" Answer: According to the chain(s) of variable assignment")
    assert f"5 variables are assigned the value {value}, they are: " in s.answer_prefix


def test_cwe_format(tok):
    for length, (cw, ucw) in [(2000, (6, 1)), (8192, (30, 3))]:  # RULER: 30/3 from 4096 up
        s = gen(tok, length).sample("cwe", 0)
        listed = s.context.rsplit("Memorize the ones that appear most often.\n", 1)[1]
        entries = re.findall(r"(\d+)\. (\S+)", listed)
        assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
        counts = Counter(w for _, w in entries)
        assert {counts[w] for w in s.answers} == {cw} and len(s.answers) == 10
        assert set(counts.values()) == {cw, ucw}
        assert s.context.count("Question: What are the 10 most common words") == 1  # the example


def test_fwe_format(tok):
    s = gen(tok).sample("fwe", 0)
    coded = s.context.split("coded words. ", 1)[1].split()
    counts = Counter(coded).most_common()
    assert counts[0][0] == "..." and [w for w, _ in counts[1:4]] == s.answers
    assert counts[1][1] > counts[2][1] > counts[3][1]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in s.answers)


def test_chat_form_wraps_the_prompt(tok):
    """With the chat template the context turn starts with its head and the question ends
    with the generation prompt and the answer prefix (kvpress's split)."""
    form = ru.prompt_form(tok, True)
    assert form.head or form.tail
    s = gen(tok, chat=True).sample("niah_single_1", 0)
    plain = gen(tok).sample("niah_single_1", 0)
    assert s.prompt_tokens <= 2000 - 128 and s.answers == plain.answers


def test_scorer_on_hand_made_replies():
    assert ru.match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(
        2 / 3
    )
    assert ru.match_all("  HAPPY-Otter\x00 is it", ["happy-otter"]) == 1.0
    assert ru.match_all("1234567", ["123456", "7654321"]) == 0.5  # a substring counts, as in RULER
    assert ru.match_all("", ["1"]) == 0.0
    assert ru.match_part("it was Paris, France", ["London", "paris"]) == 1.0
    assert ru.match_part("no idea", ["London", "Paris"]) == 0.0
    assert ru.score("qa_1", "paris", ["Paris", "Lyon"]) == 1.0
    assert ru.score("niah_multivalue", "paris", ["Paris", "Lyon"]) == 0.5
    recs = [{"task": "vt", "score": s} for s in (1.0, 0.5, 0.0)] + [
        {"task": "cwe", "score": 0.123456}
    ]
    assert ru.task_scores(recs) == {"vt": 50.0, "cwe": 12.35}


def test_kvpress_ratio():
    assert ru.kvpress_ratio(None, check("full")) == 0.0
    assert ru.kvpress_ratio("0.25", check("snapkv", "0.25")) == 0.75
    assert ru.kvpress_ratio(None, check("snapkv")) == pytest.approx(0.8)  # the default 0.2
    assert ru.kvpress_ratio("64", check("snapkv", "64")) is None  # a count: no fixed fraction
    assert ru.kvpress_ratio(None, check("kivi2")) is None


def test_parse_tasks_and_length():
    assert ru.parse_tasks(None) == list(TASKS)
    assert ru.parse_tasks("vt, niah_single_1") == ["niah_single_1", "vt"]
    assert ru.parse_length("4k") == 4096 and ru.parse_length("3000") == 3000
    for bad, words in [("qa_1", "SQuAD"), ("niah", "no such task"), (",", "at least one")]:
        with pytest.raises(KvrunError, match=words):
            ru.parse_tasks(bad)
    for bad in ("0", "-1k", "4m", ""):
        with pytest.raises(KvrunError, match="--length"):
            ru.parse_length(bad)


def invoke(*args):
    group = KvrunGroup("kvrun")
    group.add_command(ruler)
    return CliRunner().invoke(group, ["ruler", *map(str, args)], catch_exceptions=False)


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_cli_runs_every_config_on_the_same_samples(tmp_path, tiny):
    out, doc = tmp_path / "r.jsonl", tmp_path / "r.json"
    r = invoke("-m", tiny.gguf_path, "--tasks", "niah_single_1,fwe", "--length", 700,
               "--samples", 2, "--kv", "full", "--kv", "snapkv", "--kv-budget", "0.5",
               "-o", out, "--json", doc, "--quiet")  # fmt: skip
    assert r.exit_code == 0, r.output
    recs = lines(out)
    assert [(x["task"], x["index"], x["method"]) for x in recs] == [
        (t, i, m) for t in ("niah_single_1", "fwe") for i in (0, 1) for m in ("full", "snapkv")
    ]
    for a, b in zip(recs[::2], recs[1::2], strict=True):  # one prompt for both methods
        assert (a["answers"], a["prompt_tokens"]) == (b["answers"], b["prompt_tokens"])
        assert b["kvpress_ratio"] == 0.5 and b["kv_bytes"] < a["kv_bytes"]
    for x in recs:
        assert x["score"] == ru.score(x["task"], x["reply"], x["answers"])
        assert x["length"] == 700 and x["prompt_tokens"] <= 700 - TASKS[x["task"]].n_predict
    scores = json.loads(doc.read_text())["scores"]
    full = [x for x in recs if x["method"] == "full"]
    assert scores[0]["tasks"] == ru.task_scores(full) and scores[0]["samples"] == 4
    assert "kvpress ratio" in r.output and "fwe" in r.output


def test_resume_goes_on_and_refuses_other_settings(tmp_path, tiny):
    out = tmp_path / "r.jsonl"
    base = ("-m", tiny.gguf_path, "--tasks", "niah_single_1", "--length", 600, "-o", out, "--quiet")
    assert invoke(*base, "--samples", 1).exit_code == 0
    first = out.read_text()
    one_error_line(invoke(*base, "--samples", 2), "already holds results", "--resume")
    out.write_text(first + '{"task": "niah_si')  # a line cut by an interrupt
    r = invoke(*base, "--samples", 2, "--resume")
    assert r.exit_code == 0, r.output
    assert out.read_text().startswith(first)
    assert [x["index"] for x in lines(out)] == [0, 1]
    again = invoke(*base, "--samples", 2, "--resume")  # nothing left to do
    assert again.exit_code == 0 and len(lines(out)) == 2
    one_error_line(invoke(*base[:5], 700, *base[6:], "--resume"), "--resume", "length")


@pytest.mark.parametrize(
    "args, words",
    [
        (["--tasks", "qa_2"], ["SQuAD"]),
        (["--tasks", "bogus"], ["no such task"]),
        (["--length", "abc"], ["--length"]),
        (["--length", "4k"], ["larger than the context", "2048"]),
        (["-c", "512", "--length", "1k"], ["larger than the context", "512"]),
        (["--kv", "snapkv", "--kv-budget", "1.5"], ["budget"]),
        (["--kv", "snapkv", "--kv-budget", "-0.5"], ["budget"]),
        (["--kv", "nosuch"], ["nosuch"]),
        (["--length", "100"], ["too short"]),
        (["--resume"], ["--resume needs --out"]),
        (["-o", "/no/such/dir/r.jsonl"], ["folder does not exist"]),
    ],
)
def test_bad_input_is_one_error_line(tiny, args, words):
    """The last --tasks given wins, so each case may name its own."""
    one_error_line(
        invoke("-m", tiny.gguf_path, "--tasks", "niah_single_1", *args, "--quiet"), *words
    )


def test_default_model_finds_needles_sequential_and_parallel_alike(default_gguf, tmp_path):
    """The default model finds niah_single_1's number at 512 tokens; --parallel 2 and
    --question-after give the same records as one by one."""
    base = ("--tasks", "niah_single_1", "--length", 512, "--samples", 2, "--kv", "full",
            "--kv", "snapkv", "--kv-budget", "0.5", "--question-after", "--quiet")  # fmt: skip
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert invoke(*base, "-o", one).exit_code == 0
    assert invoke(*base, "-o", two, "--parallel", 2).exit_code == 0
    a, b = lines(one), lines(two)
    assert [x["reply"] for x in a] == [x["reply"] for x in b]
    assert all(x["question_after"] for x in a)
    assert [x["score"] for x in a if x["method"] == "full"] == [1.0, 1.0]
