"""kvrun perplexity: window placement, teacher-forced scoring, KL / top-1 against the full cache,
the CLI's JSON and errors (tiny model), and the full cache's perplexity against transformers."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from cli_checks import one_error_line
from click.testing import CliRunner

from kvrun.cli.main import KvrunGroup
from kvrun.cli.perplexity import perplexity
from kvrun.errors import ContextOverflow, KvrunError
from kvrun.kv import check
from kvrun.run.runtime import load_runtime
from kvrun.run.session import Session
from kvrun.tasks.perplexity import (
    check_context,
    check_file,
    evaluate,
    file_tokens,
    window_ids,
    window_starts,
)
from tiny_models import CORPUS, build

PROSE = (
    "The lighthouse keeper woke before dawn, as he had every morning for thirty years. "
    "He climbed the spiral stairs, counted the steps out of habit, and trimmed the wick "
    "while the sea below turned from black to grey. Ships no longer needed his light, "
    "for they carried their own maps and radios, but the town council had never voted to "
    "close the tower, and so he stayed. In the afternoons he repaired nets for the fishermen "
    "and listened to their stories about storms, prices at the market, and children who had "
    "moved to the city. His sister wrote to him twice a year. Her letters described the noise "
    "of trains, the price of bread, and the small garden she kept on a balcony above a bakery. "
    "He answered each letter with a drawing of the coast, because he had never been good with "
    "words. One winter a young engineer arrived with plans to automate the lamp. She measured "
    "the windows, photographed the gears, and asked him how often the mechanism failed. Almost "
    "never, he said, but when it does, it fails on the worst night of the year. She laughed and "
    "wrote that down. The new lamp was installed in spring. It turned on by itself at sunset and "
    "off at sunrise, and it sent a message to an office three hundred kilometres away whenever "
    "a bulb burned out. The keeper was offered a pension and a small flat in the town. He "
    "accepted the pension and refused the flat. He still climbs the stairs every morning, "
    "counts the steps, and looks at the water, because a habit kept for thirty years is not "
    "something a machine can take away. The fishermen still bring him their nets, and the "
    "engineer sends him a postcard every summer from a different coast, each with a drawing "
    "of a lighthouse she has automated since."
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build(tmp_path_factory.mktemp("ppl_tiny"))


@pytest.fixture(scope="module")
def tiny_rt(tiny):
    return load_runtime(str(tiny.gguf_path), "float32", "cpu", log=lambda m: None)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("ppl_text") / "doc.txt"
    path.write_text(" ".join(rng.choice(CORPUS) for _ in range(60)))
    return path


def session(rt, kv="full", budget=None, ubatch=512):
    return Session(rt.model, rt.tokenizer, rt.new_kv(check(kv, budget)), ubatch=ubatch)


# ----------------------------------------------------------------------- windows and lengths
@pytest.mark.parametrize(
    "n, span, k, want",
    [(100, 20, 1, [0]), (100, 20, 5, [0, 20, 40, 60, 80]), (105, 20, 3, [0, 42, 85])],
)
def test_window_starts(n, span, k, want):
    assert window_starts(n, span, k) == want


def test_windows_never_overlap_and_reach_the_end():
    rng = random.Random(1)
    for _ in range(500):
        span, k = rng.randint(1, 50), rng.randint(2, 12)
        n = k * span + rng.randint(0, 300)
        starts = window_starts(n, span, k)
        assert starts[0] == 0 and starts[-1] + span == n
        assert all(b - a >= span for a, b in zip(starts, starts[1:], strict=False))
    with pytest.raises(KvrunError):
        window_starts(99, 20, 5)


def test_length_errors_name_the_numbers():
    check_file(1280, 1024, 256, 1)
    with pytest.raises(KvrunError, match="has 1279 tokens .* need 1280"):
        check_file(1279, 1024, 256, 1)
    with pytest.raises(KvrunError, match="3 window.* need 3840"):
        check_file(3000, 1024, 256, 3)
    check_context(1024, 256, 1280, False)
    with pytest.raises(ContextOverflow, match="1280 tokens exceed the model's context of 1000"):
        check_context(1024, 256, 1000, False)
    with pytest.raises(ContextOverflow, match="-c/--ctx-size of 512"):
        check_context(1024, 256, 512, True)


def test_window_ids_put_bos_first():
    toks = list(range(10, 30))
    assert window_ids(toks, 5, 4, None) == [15, 16, 17, 18]
    assert window_ids(toks, 5, 4, 1) == [1, 16, 17, 18]


def test_file_tokens_read_specials_as_text_and_add_bos_as_the_model_does():
    class Tok:  # the two tokenizer facts file_tokens reads, and encode's arguments
        bos_id, add_bos = 1, True

        def encode(self, text, add_bos=None, special=True):
            assert add_bos is False and special is False
            return [7, 8, 9]

    assert file_tokens(Tok(), "x") == [1, 7, 8, 9]
    Tok.add_bos = False
    assert file_tokens(Tok(), "x") == [7, 8, 9]


# ----------------------------------------------------------------------- scoring (tiny model)
def test_teacher_forced_nll_equals_one_hf_forward(tiny, tiny_rt, text_file):
    """Prefill in chunks then decode token by token scores what one full forward scores."""
    tokens = file_tokens(tiny_rt.tokenizer, text_file.read_text())
    rep = evaluate(session(tiny_rt, ubatch=16), None, tokens, 48, 16, windows=2)
    for w in rep.windows:
        ids = window_ids(tokens, w.start, 64, None)
        logp = torch.log_softmax(tiny.logits(ids).double(), -1)  # (T, V)
        want = [-logp[t - 1, ids[t]].item() for t in range(48, 64)]
        assert w.token_nll == pytest.approx(want, abs=1e-4)
        assert w.kl == 0.0 and w.top1 == 1.0 and w.nll == w.nll_full
        assert w.kv_bytes == w.kv_bytes_full == 63 * tiny_rt.config.kv_bytes_per_token(4)
    assert rep.windows[1].start + 64 == len(tokens)


def test_full_against_a_second_full_cache_is_zero(tiny_rt, text_file):
    tokens = file_tokens(tiny_rt.tokenizer, text_file.read_text())
    rep = evaluate(session(tiny_rt), session(tiny_rt), tokens, 64, 16)
    s = rep.summary()
    assert s["kl"] == pytest.approx(0.0, abs=1e-12) and s["top1"] == 1.0
    assert s["nll"] == pytest.approx(s["nll_full"], abs=1e-9)


def test_compressing_method_differs_from_full(tiny_rt, text_file):
    tokens = file_tokens(tiny_rt.tokenizer, text_file.read_text())
    full = evaluate(session(tiny_rt), None, tokens, 64, 32, windows=2).summary()
    rep = evaluate(session(tiny_rt, "streaming", "8"), session(tiny_rt), tokens, 64, 32, 2)
    s = rep.summary()
    assert s["kl"] > 0.01 and s["top1"] < 1.0
    assert s["nll"] != pytest.approx(s["nll_full"])
    assert s["nll_full"] == pytest.approx(full["nll"], abs=1e-9)  # the reference is the full run
    assert s["kv_bytes"] < s["kv_bytes_full"] / 4
    assert set(s["spread"]) == {"nll", "ppl", "nll_full", "ppl_full", "kl", "top1"}
    assert s["spread"]["kl"]["min"] <= s["kl"] <= s["spread"]["kl"]["max"]
    assert s["ppl"] == pytest.approx(math.exp(s["nll"]))


# ----------------------------------------------------------------------- CLI
def invoke(*args, input=None):
    group = KvrunGroup(name="kvrun")
    group.add_command(perplexity)
    return CliRunner().invoke(group, ["perplexity", *args], input=input, catch_exceptions=False)


def test_cli_json_has_every_field(tiny, text_file):
    args = ["-m", str(tiny.gguf_path), "-f", str(text_file), "--context", "64"]
    r = invoke(*args, "--eval-tokens", "16", "--windows", "3", "--ubatch", "32",
               "--kv", "streaming", "--kv-budget", "8", "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["kv"] == {"method": "streaming", "sinks": 4, "budget": 8, "kv_dtype": "f16"}
    assert out["model"] == str(tiny.gguf_path)
    assert out["settings"] == {
        "file": str(text_file), "kv_budget": "8", "context": 64, "eval_tokens": 16,
        "windows": 3, "bos": False, "ctx_size": 2048, "ubatch": 32, "dtype": "float32",
        "wtype": "f32", "device": "cpu",
    }  # fmt: skip
    for key in ["nll", "ppl", "nll_full", "ppl_full", "kl", "top1", "kv_bytes", "kv_bytes_full",
                "kv_ratio", "file_tokens", "prefill_s", "decode_s", "peak_mem_bytes"]:  # fmt: skip
        assert key in out, key
    assert len(out["per_window"]) == 3 and out["kl"] > 0 and out["top1"] < 1
    for w in out["per_window"]:
        assert set(w) == {"window", "start", "nll", "ppl", "nll_full", "ppl_full", "kl", "top1",
                          "kv_bytes", "kv_bytes_full"}  # fmt: skip
    for k in ["nll", "ppl", "nll_full", "ppl_full", "kl", "top1"]:
        assert set(out["spread"][k]) == {"std", "min", "max"}
    assert [w["start"] for w in out["per_window"]][-1] + 80 == out["file_tokens"]
    assert "tok/s" in r.stderr


def test_cli_full_table_from_stdin(tiny, text_file):
    args = ["-m", str(tiny.gguf_path), "-f", "-", "--context", "32", "--eval-tokens", "8"]
    r = invoke(*args, input=text_file.read_text())
    assert r.exit_code == 0, r.output
    assert "mean" in r.stdout and "KL 0.00000 nats | top-1 100.00%" in r.stdout


@pytest.fixture
def no_load(monkeypatch):
    """Errors that must come before the weights load: loading fails the test."""

    def boom(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("kvrun.run.runtime.load_runtime", boom)


def test_cli_errors_before_loading(tiny, text_file, tmp_path, no_load):
    m = ["-m", str(tiny.gguf_path)]
    one_error_line(invoke(*m, "-f", str(tmp_path / "nope.txt")), "cannot read", "nope.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    one_error_line(invoke(*m, "-f", str(tmp_path / "empty.txt")), "empty")
    one_error_line(invoke(*m, "-f", str(tmp_path)), "cannot read")
    r = invoke(*m, "-f", str(text_file), "-c", "64", "--context", "64", "--eval-tokens", "8")
    one_error_line(r, "72 tokens exceed -c/--ctx-size of 64")
    one_error_line(invoke(*m, "-f", str(text_file), "--kv", "magic"), "unknown KV method")
    one_error_line(invoke(*m, "-f", str(text_file), "--kv-budget", "abc"), "not a number")
    r = invoke(*m, "-f", str(text_file), "--kv", "streaming", "--kv-budget", "2")
    one_error_line(r, "protected minimum")
    assert invoke(*m, "-f", str(text_file), "--windows", "0").exit_code == 2  # click usage
    assert invoke(*m).exit_code == 2  # -f is required


def test_cli_length_errors_after_loading(tiny, text_file):
    """Errors that need the model's tokenizer or context come right after the load."""
    m = ["-m", str(tiny.gguf_path)]
    r = invoke(*m, "-f", str(text_file), "--context", "64", "--windows", "40")
    n = len(file_tokens(tiny_tokenizer(tiny), text_file.read_text()))
    one_error_line(r, f"has {n} tokens", f"need {40 * (64 + 256)}")
    r = invoke(*m, "-f", str(text_file), "--context", "2000", "--eval-tokens", "100")
    one_error_line(r, "2100 tokens exceed the model's context of 2048")
    assert r.exit_code == 4


def tiny_tokenizer(tiny):
    from kvrun.models.file_headers import gguf_metadata, open_gguf
    from kvrun.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf_metadata(open_gguf(tiny.gguf_path)))


# ----------------------------------------------------------------------- default model vs HF
def test_full_cache_perplexity_equals_transformers(default_gguf, default_runtime):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    rt = default_runtime
    tokens = file_tokens(rt.tokenizer, PROSE)
    n, e = 256, 64
    rep = evaluate(Session(rt.model, rt.tokenizer, rt.new_kv(), ubatch=100), None, tokens, n, e)
    w = rep.windows[0]
    assert w.kl == 0.0 and w.top1 == 1.0  # full against itself
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name, dtype=torch.float32
    ).eval()
    ids = window_ids(tokens, 0, n + e, rt.tokenizer.bos_id if rt.tokenizer.add_bos else None)
    with torch.inference_mode():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)  # (T, V)
    want = [-logp[t - 1, ids[t]].item() for t in range(n, n + e)]
    ppl_hf = math.exp(sum(want) / e)
    assert w.ppl == pytest.approx(ppl_hf, rel=0.005)
    assert w.token_nll == pytest.approx(want, abs=1e-3)
