"""kvrun bench and the shape presets: JSON fields, grid, reps, synthetic labels, bad input."""

from __future__ import annotations

import json
import sys

import click
import pytest
import torch
from cli_checks import one_error_line
from click.testing import CliRunner

from kvrun.cli.bench import bench
from kvrun.cli.main import KvrunGroup
from kvrun.errors import KvrunError
from kvrun.kv import check
from kvrun.models.presets import PRESETS, is_preset, preset_config
from kvrun.models.synthetic import SyntheticTokenizer, check_fits
from kvrun.run.runtime import load_runtime

ROW_FIELDS = {
    "model", "synthetic", "kv", "kv_method", "budget", "depth", "n_prompt", "n_gen", "reps",
    "test_pp", "test_tg", "prefill_tok_s", "prefill_tok_s_std", "prefill_tok_s_reps",
    "decode_tok_s", "decode_tok_s_std", "decode_tok_s_reps", "kv_bytes", "kv_bytes_full",
    "kv_ratio", "kv_bytes_read_per_token", "weight_bytes", "bandwidth_gb_s",
    "bandwidth_gb_s_std", "bandwidth_gb_s_reps", "peak_mem_bytes", "cuda_graph",
}  # fmt: skip
TOP_FIELDS = {
    "model", "model_path", "synthetic", "weight_bytes", "settings", "peak_mem_kind",
    "bandwidth_note", "machine", "rows",
}  # fmt: skip
SETTINGS = {
    "n_prompt",
    "n_gen",
    "depths",
    "reps",
    "methods",
    "budgets",
    "seed",
    "ubatch",
    "cuda_graph",
}


pytestmark = pytest.mark.usefixtures("one_thread")


@click.group(cls=KvrunGroup)
def group():
    pass


group.add_command(bench)


def run(*args):
    return CliRunner().invoke(group, ["bench", *args], catch_exceptions=False)


def run_json(*args) -> dict:
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tiny_models import build

    return build(tmp_path_factory.mktemp("tiny")).gguf_path


def test_synthetic_json_has_every_field_and_the_grid(monkeypatch):
    out = run_json(
        "-m", "tiny-synthetic", "-p", "16", "-n", "4", "-d", "0,24", "-r", "2",
        "--kv", "full", "--kv", "snapkv", "--kv", "kivi2", "--kv-budget", "0.25,0.5",
        "--seed", "7",
    )  # fmt: skip
    assert TOP_FIELDS <= out.keys() and SETTINGS <= out["settings"].keys()
    assert out["synthetic"] is True and "random weights" in out["model"]
    assert out["settings"]["seed"] == 7 and out["settings"]["warmup_reps"] == 1
    assert "approximation" in out["bandwidth_note"]
    rows = out["rows"]
    # full and kivi2 ignore budgets: (1 + 2 + 1) method-budget pairs x 2 depths
    got = [(r["kv"], r["budget"], r["depth"]) for r in rows]
    assert got == [
        ("full", None, 0), ("full", None, 24),
        ("snapkv", 0.25, 0), ("snapkv", 0.25, 24), ("snapkv", 0.5, 0), ("snapkv", 0.5, 24),
        ("kivi2", None, 0), ("kivi2", None, 24),
    ]  # fmt: skip
    for r in rows:
        assert set(r) == ROW_FIELDS, set(r) ^ ROW_FIELDS
        assert r["synthetic"] is True and "synthetic" in r["model"]
        assert r["reps"] == 2 and len(r["decode_tok_s_reps"]) == 2
        assert len(r["prefill_tok_s_reps"]) == 2
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["bandwidth_gb_s"] > 0
        assert 0 < r["kv_bytes"] and r["kv_bytes_full"] > 0 and r["peak_mem_bytes"] > 0
        at = f" @ d{r['depth']}" if r["depth"] else ""
        assert (r["test_pp"], r["test_tg"]) == (f"pp16{at}", f"tg4{at}")
    full = rows[1]
    # the full cache holds every token: depth + prompt + decoded, f16 K and V (--kv-dtype auto)
    c = PRESETS["tiny-synthetic"]
    assert full["kv_bytes"] == full["kv_bytes_full"] == (24 + 16 + 4) * c.kv_bytes_per_token(2)
    assert rows[3]["kv_bytes"] < rows[3]["kv_bytes_full"]  # snapkv 0.25 at depth 24


def test_real_model_markdown_table_and_json(tiny_gguf):
    args = ["-m", str(tiny_gguf), "-p", "8", "-n", "3", "-d", "0,8", "-r", "1"]
    args += ["--kv", "full", "--kv", "streaming"]
    r = run(*args)
    assert r.exit_code == 0, r.output
    table = [ln for ln in r.stdout.splitlines() if ln.startswith("|")]
    assert table[0].split("|")[1:-1][3].strip() == "test"
    assert len(table) == 2 + 2 * 2 * 2  # header, rule, (pp + tg) x methods x depths
    assert all(ln.count("|") == 9 for ln in table)
    assert any("tg3 @ d8" in ln for ln in table) and any("pp8 |" in ln for ln in table)
    assert "synthetic" not in r.stdout and "1 reps after 1 warm-up" in r.stdout
    out = run_json(*args)
    assert out["synthetic"] is False and not any(row["synthetic"] for row in out["rows"])
    assert len(out["rows"]) == 4 and out["rows"][2]["budget"] == 0.2  # streaming's default


def test_markdown_marks_synthetic_rows():
    r = run("-m", "tiny-synthetic", "-p", "0", "-n", "2", "-r", "1")
    assert r.exit_code == 0, r.output
    table = [ln for ln in r.stdout.splitlines() if ln.startswith("| tiny")]
    assert len(table) == 1 and "tiny-synthetic (random weights)" in table[0] and "tg2" in table[0]
    assert "synthetic: random weights" in r.stdout


def test_prompt_only_and_decode_only_rows():
    pp_only = run_json("-m", "tiny-synthetic", "-p", "4", "-n", "0", "-r", "1")["rows"][0]
    assert pp_only["test_tg"] is None and pp_only["decode_tok_s"] is None
    assert pp_only["bandwidth_gb_s"] is None and pp_only["prefill_tok_s"] > 0
    tg_only = run_json("-m", "tiny-synthetic", "-p", "0", "-n", "2", "-r", "1")["rows"][0]
    assert tg_only["test_pp"] is None and tg_only["prefill_tok_s"] is None


@pytest.mark.parametrize(
    "args, needles",
    [
        (["-d", "x"], ["-d/--n-depth", "'x'"]),
        (["-d", "0,-4"], [">= 0"]),
        (["-p", "-1"], ["-p/--n-prompt"]),
        (["-n", "-2"], ["-n/--n-gen"]),
        (["-p", "0", "-n", "0"], ["nothing to measure"]),
        (["-r", "0"], ["--reps"]),
        (["-d", "0,2040", "-p", "8", "-n", "1"], ["2049 tokens", "context of 2048"]),
        (["-c", "64", "-p", "60", "-n", "8"], ["context of 64"]),
        (["--kv", "bogus"], ["unknown KV method 'bogus'"]),
        (["--kv", "full", "--kv", "h2o+kivi2"], ["not supported"]),
        (["--kv", "snapkv", "--kv-budget", "0.5,8"], ["protected minimum of 32"]),
        (["--kv-budget", "lots"], ["not a number"]),
    ],
)
def test_bad_input_is_one_line_before_loading(args, needles, monkeypatch):
    import kvrun.run.runtime

    def no_loading(*a, **k):
        raise AssertionError("the model must not be built for bad input")

    monkeypatch.setattr(kvrun.run.runtime, "preset_runtime", no_loading)
    one_error_line(run("-m", "tiny-synthetic", *args), *needles)


def test_unknown_preset_and_a_method_the_model_cannot_run(tiny_gguf):
    one_error_line(run("-m", "llama3-70b-synthetic"), "unknown shape preset", "llama3-8b-synthetic")
    # the tiny model's head_dim 16 is not a multiple of KIVI's group 32: caught before timing
    r = run("-m", str(tiny_gguf), "--kv", "full", "--kv", "kivi2", "-p", "4", "-n", "1")
    one_error_line(r, "group")
    assert "|" not in r.stdout


def test_preset_shapes():
    l3, m7, l2 = (PRESETS[n] for n in ("llama3-8b-synthetic", "mistral-7b-synthetic",
                                       "llama2-7b-synthetic"))  # fmt: skip
    assert abs(l3.n_params() - 8.03e9) < 0.01e9 and l3.rope_theta == 500000.0
    assert (l3.n_kv_heads, l3.ffn_dim, l3.vocab_size, l3.context_length) == (8, 14336, 128256, 8192)
    assert abs(m7.n_params() - 7.24e9) < 0.01e9 and m7.sliding_window is None
    assert m7.context_length == 32768 and m7.arch == "mistral"
    assert abs(l2.n_params() - 6.74e9) < 0.01e9 and l2.n_kv_heads == 32 and l2.ffn_dim == 11008
    assert is_preset("LLAMA3-8B-synthetic") and not is_preset("smollm2") and not is_preset(None)
    assert preset_config("tiny-synthetic").name == "tiny-synthetic (random weights)"


def test_preset_refuses_when_memory_is_short(monkeypatch):
    import kvrun.quant.hardware

    monkeypatch.setattr(kvrun.quant.hardware, "available_bytes", lambda dev: 8 * 2**30)
    cfg = preset_config("llama3-8b-synthetic")
    with pytest.raises(KvrunError, match=r"needs 29.9 GiB .* float32 .* --dtype bfloat16"):
        check_fits("llama3-8b-synthetic", cfg, torch.float32, torch.device("cpu"))
    # through the CLI: one line, nothing allocated
    r = run("-m", "llama3-8b-synthetic", "--device", "cpu", "--dtype", "bfloat16")
    one_error_line(r, "15.0 GiB", "bfloat16", "smaller preset")


def test_preset_runtime_is_built_in_the_dtype_and_runs():
    from kvrun.run.sampling import SamplingConfig
    from kvrun.run.session import Session

    rt = load_runtime("tiny-synthetic", "bfloat16", "cpu", log=lambda m: None)
    assert {p.dtype for p in rt.model.parameters()} == {torch.bfloat16}
    assert rt.weights.format == "synthetic" and rt.weights.meta["synthetic"] is True
    tok = rt.tokenizer
    assert isinstance(tok, SyntheticTokenizer) and tok.stop_ids == frozenset()
    with pytest.raises(KvrunError, match="no tokenizer"):
        tok.encode("hello")
    s = Session(rt.model, tok, rt.new_kv(check("snapkv", "0.5")))
    res = s.generate(list(range(40)), 3, SamplingConfig(temp=0), seed=0)
    assert len(res.tokens) == 3 and res.text.startswith("[")
    again = load_runtime("tiny-synthetic", "bfloat16", "cpu", log=lambda m: None)
    w0, w1 = (
        rt.model.model.layers[0].mlp.up_proj.weight,
        again.model.model.layers[0].mlp.up_proj.weight,
    )
    assert torch.equal(w0, w1)  # seeded: the same random weights every time


def test_parallel_rows_report_the_batch(tiny_gguf):
    """--parallel 3: the tg row is three sequences decoding together (aggregate tok/s), with
    the per-sequence KV bytes of a single run; the settings record N."""
    args = ["-m", str(tiny_gguf), "-p", "8", "-n", "3", "-d", "8", "-r", "1", "--kv", "snapkv"]
    one = run_json(*args)["rows"][0]
    out = run_json(*args, "--parallel", "3")
    row = out["rows"][0]
    assert out["settings"]["parallel"] == 3
    assert row["decode_tok_s"] > 0 and row["kv_bytes"] == one["kv_bytes"]
    assert row["kv_bytes_full"] == one["kv_bytes_full"]


def _bench_module(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _vs_llamacpp():
    return _bench_module("vs_llamacpp")


def test_long_context_rounds_take_medians_and_side_by_side_ratios():
    """bench/long_context.py --rounds: a row's rates are medians over its rounds, and its
    "vs full" the median of each round's ratio to that round's full (not of two medians); a
    failed round is left out, a row failed in every round stays failed."""
    _vs_llamacpp()  # puts bench/ on sys.path for long_context's own import of it
    lc = _bench_module("long_context")

    def run(row, rnd, decode, tool="kvrun"):
        return {"row": row, "tool": tool, "round": rnd, "kv_bytes": 10, "peak_rss_bytes": 100,
                "prefill_tok_s": 2 * decode, "decode_tok_s": decode}  # fmt: skip

    runs = [run("full", 0, 40.0), run("kivi2", 0, 60.0), run("llama.cpp f16", 0, 20.0, "llama.cpp"),
            run("full", 1, 30.0), run("kivi2", 1, 48.0), run("llama.cpp f16", 1, 25.0, "llama.cpp"),
            run("full", 2, 50.0), {"row": "kivi2", "tool": "kvrun", "round": 2, "failed": "x"},
            {"row": "tova", "tool": "kvrun", "round": 0, "failed": "exit 1: boom"}]  # fmt: skip
    got = {r["row"]: r for r in lc.summarise(runs)}
    assert list(got) == ["full", "kivi2", "llama.cpp f16", "tova"]
    assert got["full"]["decode_tok_s"] == 40.0 and got["full"]["decode_vs_full"] == 1.0
    k = got["kivi2"]
    assert k["decode_tok_s"] == 54.0 and k["prefill_tok_s"] == 108.0 and len(k["rounds"]) == 3
    assert k["decode_vs_full"] == pytest.approx(1.55)  # rounds: 1.5 and 1.6, not 54 / 40
    assert "decode_vs_full" not in got["llama.cpp f16"]
    assert got["tova"]["failed"] == "exit 1: boom"
    table = lc.table(list(got.values()))
    assert "| kivi2 | 0.0 MB | 0 MB | 108.0 | 54.0 | 1.55x |" in table
    assert "| tova | failed: exit 1: boom |" in table


def test_long_context_picks_llamacpp_caches(monkeypatch, capsys):
    """bench/long_context.py --llamacpp: only the named caches run (a 32k run leaves out the
    q8_0 cache, hours of prefill there); an unknown name is a one-line usage error."""
    _vs_llamacpp()
    lc = _bench_module("long_context")
    assert set(lc.LLAMACPP) == {"f16", "f16+fa", "q8_0+fa"}
    monkeypatch.setattr(sys, "argv", ["long_context.py", "--llamacpp", "f16,q4_0"])
    with pytest.raises(SystemExit) as e:
        lc.main()
    assert e.value.code == 2
    assert "--llamacpp: unknown cache 'q4_0'; choose from f16, f16+fa, q8_0+fa" in (
        capsys.readouterr().err
    )


def test_kv_kl_against_full_perturbs_only_the_seeded_draws(tiny_gguf, tmp_path):
    """bench/kv_kl.py: a draw without a seed is the reference's own run for `full` (KL 0, every
    top token agreed); a seeded one perturbs the prefill (KL > 0); the table has a row a method
    and a column an offset."""
    import argparse

    kl = _bench_module("kv_kl")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, and then it sleeps. " * 30)
    a = argparse.Namespace(
        model=str(tiny_gguf), wtype="auto", threads=1, eps=1e-2, text=str(text), offsets=[0, 7],
        prefix=48, steps=6, seeds=2, kv_dtype="auto", methods=["full", "snapkv@0.5"],
    )  # fmt: skip
    res = kl.measure(a)
    full, stack = res["methods"]["full"], res["methods"]["snapkv@0.5"]
    assert [(r["offset"], r["seed"]) for r in full] == [
        (o, s) for o in (0, 7) for s in (None, 0, 1)
    ]
    assert all(r["kl"] == 0 and r["top1"] == 1 for r in full if r["seed"] is None)
    assert all(r["kl"] > 0 for r in full if r["seed"] is not None)
    assert all(r["kl"] > 0 for r in stack) and stack[0]["kv_bytes"] < full[0]["kv_bytes"]
    lines = kl.summary(res)
    assert lines[0] == "| --kv | KL at 0 | KL at 7 | mean KL | top-1 | KV bytes |"
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| full", "| snapkv@0.5"]


def test_llamacpp_build_takes_only_the_cpus_own_extensions(monkeypatch):
    """bench/vs_llamacpp.py builds llama.cpp with each x86 option on only where the CPU lists
    its flag (a fixed set died with SIGILL on a CPU without AVX-VNNI), AMX always off."""
    v = _vs_llamacpp()
    zen4 = {"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni", "avx512_bf16"}
    monkeypatch.setattr(v, "cpu_flags", lambda: zen4)
    args = v.llamacpp_cmake().split()
    assert "-DGGML_AVX_VNNI=OFF" in args and "-DGGML_AVX512_VNNI=ON" in args
    assert "-DGGML_AVX512_VBMI=OFF" in args and "-DGGML_NATIVE=OFF" in args
    assert "-DGGML_AMX_INT8=OFF" in args
    monkeypatch.setattr(v, "cpu_flags", lambda: set())  # flags unknown: ggml detects them
    assert v.llamacpp_cmake().split()[0] == "-DGGML_NATIVE=ON"
