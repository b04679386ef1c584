"""kvrun needle: grid expansion, prompt building, scoring and JSON on the tiny model; pass keys
found by the default model through the command; every bad input as one error line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_cli import one_error_line

from kvrun.cli.main import KvrunGroup
from kvrun.cli.needle import needle
from kvrun.errors import KvrunError
from kvrun.kv import check
from kvrun.run.runtime import load_runtime
from kvrun.tasks import needle as nd
from kvrun.tasks.passkey import (
    INTRO,
    NEEDLE,
    QUESTION,
    answer_found,
    answer_matches,
    filler_units,
    fit_prompt,
    split_units,
)
from tiny_models import build

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build(tmp_path_factory.mktemp("tiny_needle"), digits=True)


@pytest.fixture(scope="module")
def tiny_tok(tiny):
    return load_runtime(str(tiny.gguf_path), "float32", "cpu", log=lambda m: None).tokenizer


@pytest.fixture(scope="module")
def haystack(tmp_path_factory):
    path = tmp_path_factory.mktemp("hay") / "hay.txt"
    path.write_text(" ".join(f"Line {i} of the old story." for i in range(12)) + "\n")
    return path


def invoke(*args):
    """The command under a KvrunGroup, so errors become one line and an exit code."""
    group = KvrunGroup("kvrun")
    group.add_command(needle)
    return CliRunner().invoke(group, ["needle", *map(str, args)], catch_exceptions=False)


def run_json(tmp_path, model, *args, name="out.json"):
    out = tmp_path / name
    r = invoke("-m", model, "--json", out, *args)
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text()), r


# --- pure logic ---------------------------------------------------------------------------------
def test_parse_lengths_depths():
    assert nd.parse_lengths("2k, 1k,1500,1.5k,2K") == [1000, 1500, 2000]
    assert nd.parse_depths("100,0,25%,50.5") == [0.0, 25.0, 50.5, 100.0]
    for bad in ["", "x", "1q", "0", "-1k"]:
        with pytest.raises(KvrunError, match="--lengths"):
            nd.parse_lengths(bad)
    for bad in ["120", "x", "-5", ""]:
        with pytest.raises(KvrunError, match="--depths"):
            nd.parse_depths(bad)
    assert nd.pick_lengths(None, 8192, 12) == [1000, 2000, 4000, 8000]
    assert nd.pick_lengths(None, 2048, 12) == [1000, 2000]
    with pytest.raises(KvrunError, match="context of 2048"):
        nd.pick_lengths("2k,4k", 2048, 12)


def test_kv_configs_every_method_times_budget():
    methods = ("full", "snapkv", "snapkv+kivi2", "kivi2", "full")
    cfgs = nd.kv_configs([(m, check(m)) for m in methods], "0.1,0.25")
    assert [c.label for c in cfgs] == [
        "full", "snapkv @ 0.1", "snapkv @ 0.25", "snapkv+kivi2 @ 0.1", "snapkv+kivi2 @ 0.25",
        "kivi2",
    ]  # fmt: skip
    assert nd.kv_configs([("h2o", check("h2o"))], None) == [nd.KvConfig("h2o", None, check("h2o"))]
    assert [str(c.spec.budget) for c in cfgs[1:3]] == ["0.1", "0.25"]  # each at its budget
    cells = nd.grid([100, 200], [0, 50, 100], 3)
    assert len(cells) == 18 and cells[0] == nd.Cell(100, 0, 0) and cells[-1] == nd.Cell(200, 100, 2)


def test_answer_matching():
    assert answer_matches(" 12345.\nThe pass key is", 12345)
    assert not answer_matches(" 1234 5", 12345) and not answer_matches("none", 12345)
    assert answer_found(" The secret ingredient is Saffron!", "saffron")
    assert answer_found("it is new\n york", "New York")
    assert not answer_found("saff ron", "saffron")


def test_seeded_keys_are_reproducible():
    cell = nd.Cell(1000, 50.0, 2)
    assert nd.trial_key(7, cell) == nd.trial_key(7, cell)
    keys = {nd.trial_key(s, c) for s in (0, 1) for c in nd.grid([1000, 2000], [0, 50], 3)}
    assert len(keys) == 24 and all(10000 <= k <= 99999 for k in keys)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_sits_at_its_depth(tiny_tok, depth):
    needle_s = NEEDLE.format(key=31337).strip()
    p = fit_prompt(tiny_tok.encode, filler_units(), 600, depth, needle_s, INTRO, QUESTION)
    assert p.text.startswith(INTRO) and p.text.endswith(QUESTION)
    assert p.text.count("31337") == 2  # one needle sentence
    assert p.ids == tiny_tok.encode(p.text)
    # longest that fits: one more sentence would not
    assert 600 - 30 < len(p.ids) <= 600
    body = p.text[len(INTRO) : -len(QUESTION)]
    before, _, after = body.partition(needle_s)
    frac = len(before) / (len(before) + len(after))
    assert abs(frac - depth) < 0.02, (frac, depth)
    assert abs(p.needle_depth - frac) < 0.01
    assert before == "" or before.endswith(". ")  # at a sentence boundary


def test_haystack_cut_and_repeated(tiny_tok, haystack):
    units = split_units(haystack.read_text())
    assert len(units) == 12 and "".join(units) == haystack.read_text()
    long = fit_prompt(tiny_tok.encode, units, 800, 0.5, "The code is tulip.", "Q:", "\nA:")
    assert long.units > 12 and long.text.count("Line 0 of") >= 2  # repeated
    short = fit_prompt(tiny_tok.encode, units, 60, 0.5, "The code is tulip.", "Q:", "\nA:")
    assert short.units < 12 and "Line 11 " not in short.text  # cut
    assert short.text.count("The code is tulip.") == 1


# --- through the command on the tiny model ------------------------------------------------------
def test_grid_json_fields_and_cardinality(tmp_path, tiny):
    doc, r = run_json(
        tmp_path, tiny.gguf_path, "--lengths", "300,450", "--depths", "0,50,100", "--trials", "2",
        "--kv", "full", "--kv", "snapkv", "--kv-budget", "0.5,0.25", "-n", "3", "--seed", "5",
    )  # fmt: skip
    trials = doc["trials"]
    assert doc["complete"] is True and len(trials) == 2 * 3 * 2 * 3
    s = doc["settings"]
    assert (s["seed"], s["lengths"], s["depths"], s["trials"], s["n_predict"]) == (
        5, [300, 450], [0.0, 50.0, 100.0], 2, 3,
    )  # fmt: skip
    assert s["dtype"] == "float32" and s["device"] == "cpu" and s["model"].endswith("model.gguf")
    assert s["kv"] == [{"method": "full", "budget": None}] + [
        {"method": "snapkv", "budget": b} for b in ("0.5", "0.25")
    ]
    for t in trials:
        for k in ["method", "budget", "length", "prompt_tokens", "depth", "key", "answer", "reply"]:
            assert k in t, k
        for k in ["correct", "kv_bytes", "kv_bytes_full", "prefill_tok_s", "decode_tok_s"]:
            assert k in t, k
        assert t["prompt_tokens"] <= t["length"] and t["answer"] == str(t["key"])
        assert t["correct"] == answer_matches(t["reply"], t["key"])
        assert (t["kv_ratio"] == 1.0) == (t["method"] == "full")
    # every config answers the same prompt: one key per cell
    per_cell = {}
    for t in trials:
        per_cell.setdefault((t["length"], t["depth"], t["trial"]), set()).add(t["key"])
    assert len(per_cell) == 12 and all(len(v) == 1 for v in per_cell.values())
    assert [(x["method"], x["budget"], x["trials"]) for x in doc["summary"]] == [
        ("full", None, 12), ("snapkv", "0.5", 12), ("snapkv", "0.25", 12),
    ]  # fmt: skip
    half = [x["kv_ratio"] for x in doc["summary"]]
    assert half[0] == 1.0 and half[1] > half[2]
    for label in ["full", "snapkv @ 0.5", "snapkv @ 0.25", "summary", "held/full", "2 trials"]:
        assert label in r.stdout


def test_seed_reproduces_the_run(tmp_path, tiny):
    args = ["--lengths", "300", "--depths", "0,100", "--trials", "2", "-n", "4"]
    a, _ = run_json(tmp_path, tiny.gguf_path, *args, name="a.json")
    b, _ = run_json(tmp_path, tiny.gguf_path, *args, name="b.json")
    c, _ = run_json(tmp_path, tiny.gguf_path, *args, "--seed", "1", name="c.json")
    keys = [[(t["key"], t["reply"]) for t in d["trials"]] for d in (a, b, c)]
    assert keys[0] == keys[1] and [k for k, _ in keys[0]] != [k for k, _ in keys[2]]


def test_niah_with_a_haystack_file(tmp_path, tiny, haystack):
    doc, _ = run_json(
        tmp_path, tiny.gguf_path, "--mode", "niah", "--haystack", haystack,
        "--needle", "The secret ingredient is saffron.", "--question", "What is the secret?",
        "--answer", "Saffron", "--lengths", "200,400", "--depths", "0,50", "-n", "2",
    )  # fmt: skip
    s = doc["settings"]
    assert s["mode"] == "niah" and s["haystack"] == str(haystack) and s["answer"] == "Saffron"
    assert len(doc["trials"]) == 4
    for t in doc["trials"]:
        assert "key" not in t and t["answer"] == "Saffron" and t["prompt_tokens"] <= t["length"]
        assert t["correct"] == answer_found(t["reply"], "saffron")


def test_chat_and_json_to_stdout(tiny):
    r = invoke("-m", tiny.gguf_path, "--chat", "--lengths", "300", "--depths", "50", "-n", "2",
               "--json", "-")  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["settings"]["chat"] is True and doc["trials"][0]["prompt_tokens"] <= 300
    assert "summary" in r.stderr  # tables moved to stderr


def test_interrupt_keeps_finished_trials(tmp_path, tiny, monkeypatch):
    calls = []

    import kvrun.run.session

    class Stops(kvrun.run.session.Session):
        def generate(self, *a, **k):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return super().generate(*a, **k)

    monkeypatch.setattr(kvrun.run.session, "Session", Stops)
    out = tmp_path / "part.json"
    r = invoke("-m", tiny.gguf_path, "--lengths", "300", "--depths", "0,50,100", "-n", "2",
               "--json", out)  # fmt: skip
    assert r.exit_code == 130
    assert "interrupted: 2 of 3 trials done" in r.stderr
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and len(doc["trials"]) == 2
    assert doc["summary"][0]["trials"] == 2


NIAH = ["--mode", "niah", "--needle", "n", "--question", "q", "--answer", "a"]
# (arguments, what the error line names, whether the model must load to know)
BAD = [
    (["--lengths", "4k"], ["4k", "context of 2048"], True),
    (["--lengths", "10"], ["too short"], True),
    (["--kv", "full", "--kv", "snapkv+kivi2"], ["head_dim 16"], True),
    (["--json", "/no/such/dir/x.json"], ["cannot write --json /no/such/dir/x.json"], True),
    (["-c", "1000", "--lengths", "2k"], ["context of 1000"], False),
    (["--kv", "full", "--kv", "foo"], ["unknown KV method 'foo'"], False),
    (["--kv", "snapkv", "--kv-budget", "0.1,abc"], ["--kv-budget 'abc'"], False),
    (["--kv", "snapkv", "--kv-budget", "5"], ["protected minimum"], False),
    (["--depths", "0,120"], ["--depths", "120"], False),
    (["--depths", "x"], ["--depths", "'x'"], False),
    (["--lengths", "1q"], ["--lengths", "'1q'"], False),
    (NIAH + ["--haystack", "/no/such.txt"], ["cannot read haystack file /no/such.txt"], False),
    (["--mode", "niah", "--haystack", "HAY", "--question", "q"], ["--needle, --answer"], False),
    (["--needle", "n"], ["only apply to --mode niah"], False),
]


@pytest.mark.parametrize("args, needles, loads", BAD)
def test_bad_input_one_line(tiny, haystack, monkeypatch, args, needles, loads):
    if not loads:  # rejected before the model loads
        monkeypatch.setattr("kvrun.cli.needle.load_with_progress", lambda kw: 1 / 0)
    args = [str(haystack) if a == "HAY" else a for a in args]
    one_error_line(invoke("-m", tiny.gguf_path, *args), *needles)


def test_plot(tmp_path, tiny):
    args = ["-m", tiny.gguf_path, "--lengths", "300", "--depths", "0", "-n", "1"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return one_error_line(invoke(*args, "--plot", tmp_path / "x.png"), "pip install matplotlib")
    r = invoke(*args, "--kv", "full", "--kv", "snapkv", "--plot", tmp_path / "x.png")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"


# --- the default model ---------------------------------------------------------------------------
def test_default_model_finds_pass_keys_at_1k(tmp_path, default_gguf):
    doc, r = run_json(
        tmp_path, default_gguf, "--lengths", "1k", "--depths", "0,50", "-n", "7", "--device", "cpu"
    )
    trials = doc["trials"]
    assert len(trials) == 2 and all(900 < t["prompt_tokens"] <= 1000 for t in trials)
    assert all(t["correct"] for t in trials), [t["reply"] for t in trials]
    assert doc["summary"][0]["accuracy"] == 1.0 and "100.0%" in r.stdout
