"""The command line through click's runner: the jobs on the default model and every error case."""

from __future__ import annotations

import json

import pytest
from cli_checks import one_error_line
from click.testing import CliRunner

from kvrun.cli.main import COMMANDS, cli

pytestmark = pytest.mark.slow  # kvrun processes


def run(*args, input=None, env=None):
    return CliRunner().invoke(cli, list(args), input=input, env=env, catch_exceptions=False)


def test_generate_json_has_every_field_and_is_deterministic(default_gguf):
    args = [
        "generate",
        "-m",
        str(default_gguf),
        "-p",
        "Name three colors.",
        "-n",
        "12",
        "--temp",
        "0",
        "--json",
    ]
    a = run(*args)
    assert a.exit_code == 0, a.output
    out = json.loads(a.stdout)
    for key in [
        "text",
        "tokens",
        "prompt_tokens",
        "generated_tokens",
        "prefill_tok_s",
        "decode_tok_s",
        "kv_bytes",
        "kv_bytes_full",
        "peak_mem_bytes",
        "model",
        "kv",
        "ttft_s",
        "load_s",
    ]:
        assert key in out, key
    assert 0 < out["ttft_s"] and out["load_s"] > 0
    assert out["generated_tokens"] == len(out["tokens"]) > 0
    assert out["kv"]["method"] == "full"
    assert out["kv_bytes"] == out["kv_bytes_full"] > 0
    # full cache in f16 (--kv-dtype auto on the CPU): 2 (K,V) * 30 layers * 3 kv heads * 64 dims * 2 bytes
    # a reply cut by -n leaves its last token unfed; one that ended at EOS fed them all
    unfed = 1 if out["stop_reason"] == "length" else 0
    held = out["prompt_tokens"] + out["generated_tokens"] - unfed
    assert out["kv_bytes"] == held * 2 * 30 * 3 * 64 * 2
    assert out["settings"]["seed"] >= 0
    b = run(*args)
    assert json.loads(b.stdout)["tokens"] == out["tokens"]


def test_generate_streams_text_and_stats_line(default_gguf, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The meeting is on Tuesday at 10am in room 4.")
    r = run(
        "generate",
        "-m",
        str(default_gguf),
        "-f",
        str(doc),
        "-p",
        "When is the meeting?",
        "-n",
        "16",
        "--temp",
        "0",
    )
    assert r.exit_code == 0, r.output
    assert r.stdout.strip()
    stats = r.stderr.strip().splitlines()[-1]
    for part in ["prompt", "tok/s", "KV", "held", "full", "peak mem"]:
        assert part in stats, stats


def test_generate_reads_stdin_raw(default_gguf):
    r = run(
        "generate",
        "-m",
        str(default_gguf),
        "--raw",
        "-n",
        "4",
        "--temp",
        "0",
        "--json",
        input="Once upon a time",
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["settings"]["chat"] is False and out["generated_tokens"] == 4


def test_chat_multi_turn_through_stdin(default_gguf):
    r = run(
        "chat",
        "-m",
        str(default_gguf),
        "--temp",
        "0",
        "-n",
        "8",
        input="Hello!\n/stats\nWhat is 2+2?\n/reset\nHi\n/exit\n",
    )
    assert r.exit_code == 0, r.output
    assert r.stdout.count("\n") >= 3
    assert "conversation reset" in r.stderr
    assert "cache holds" in r.stderr


def test_info_json(default_gguf):
    r = run("info", str(default_gguf), "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["architecture"] == "llama" and info["layers"] == 30
    assert info["heads"] == 9 and info["kv_heads"] == 3 and info["head_dim"] == 64
    assert info["kv_bytes_per_token_f16"] == 2 * 30 * 3 * 64 * 2
    assert info["tensor_types"]["Q4_1"] > 0 and info["tied_embeddings"] is True
    assert run("info", "smollm2").exit_code == 0


def test_models_and_pull_when_present(default_gguf):
    r = run("models", "--json")
    assert r.exit_code == 0
    listing = json.loads(r.stdout)
    assert any(p["name"] == "smollm2" and p["downloaded"] for p in listing["pullable"])
    r = run("pull", "smollm2")
    assert r.exit_code == 0 and "already" in r.stderr


# ------------------------------------------------------------------------- errors
def test_missing_path():
    one_error_line(run("generate", "-m", "/no/such/model.gguf", "-p", "hi"), "no such file")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("this is not a model")
    one_error_line(run("generate", "-m", str(bad), "-p", "hi"), "not a GGUF file")


def test_truncated_gguf(default_gguf, tmp_path):
    """A cut download names the tensor cut short and the bytes missing; a cut inside the
    tensor table (or before the data) still says the file is damaged, in one line."""
    import gguf

    data_start = gguf.GGUFReader(str(default_gguf)).tensors[0].data_offset
    cut = tmp_path / "cut.gguf"
    raw = default_gguf.read_bytes()
    cut.write_bytes(raw[:20_000_000])
    needles = ["damaged GGUF", "token_embd.weight is cut short", "bytes are missing"]
    one_error_line(run("generate", "-m", str(cut), "-p", "hi"), *needles)
    one_error_line(run("info", str(cut)), *needles)
    cut.write_bytes(raw[:data_start])  # the header whole, no tensor data
    one_error_line(run("info", str(cut)), "damaged GGUF", "past the end of the file")
    cut.write_bytes(raw[:1000])  # inside the metadata
    one_error_line(run("info", str(cut)), "damaged GGUF", "runs past the end", "download it again")
    cut.write_bytes(raw[:10])  # inside the fixed header
    one_error_line(run("info", str(cut)), "damaged GGUF", "header is cut short")


def test_unsupported_architecture(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    one_error_line(run("generate", "-m", str(path), "-p", "hi"), "'gpt2'", "not supported")


def test_unknown_model_name(tmp_path):
    r = run("generate", "-m", "nosuchmodel", "-p", "hi", env={"KVRUN_MODELS": str(tmp_path)})
    one_error_line(r, "nosuchmodel", str(tmp_path))


def test_a_short_name_not_pulled_offline_is_one_line(tmp_path):
    """A short name (kvrun/hub/names.py) absent from the HF cache: a run command pulls it, and
    offline that is one line (HF_HUB_OFFLINE: never a download from a test)."""
    env = {"KVRUN_MODELS": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    r = run("generate", "-m", "llama3-8b", "-p", "hi", env=env)
    one_error_line(r, "llama3-8b", "HF_HUB_OFFLINE")


def test_default_model_missing_says_how_to_pull(tmp_path):
    r = run("info", env={"KVRUN_MODELS": str(tmp_path)})
    one_error_line(r, "kvrun pull smollm2")


def test_prompt_longer_than_context(default_gguf):
    r = run("generate", "-m", str(default_gguf), "-c", "16", "-p", "word " * 40)
    one_error_line(r, "context is 16")
    assert r.exit_code == 4


def test_unknown_kv_method(default_gguf):
    one_error_line(
        run("generate", "-m", str(default_gguf), "--kv", "magic", "-p", "hi"),
        "unknown KV method",
        "full",
    )


def test_missing_prompt_file(default_gguf):
    one_error_line(run("generate", "-m", str(default_gguf), "-f", "/no/such.txt"), "cannot read")


@pytest.mark.parametrize("name", ["nonexistent"])
def test_pull_unknown(name):
    one_error_line(run("pull", name), "smollm2")


@pytest.mark.parametrize(
    "kv, budget, needles",
    [
        ("magic", None, ["unknown KV method", "snapkv", "kivi2"]),
        ("snapkv:foo=1", None, ["unknown option 'foo'", "window"]),
        ("snapkv:kernel=4", None, ["must be odd"]),
        ("snapkv:window=0", None, ["out of range"]),
        ("snapkv:chunked=maybe", None, ["true or false"]),
        ("kivi2:bits=3", None, ["2, 4, 16"]),
        ("kivi2:group=20", None, ["multiple of group"]),
        ("h2o+kivi2", None, ["not supported", "snapkv"]),
        ("snapkv+h2o", None, ["cannot stack two selection"]),
        ("kivi2+kivi4", None, ["cannot stack two stores"]),
        ("snapkv", "0", ["must be > 0"]),
        ("snapkv", "-0.5", ["must be > 0"]),
        ("snapkv", "lots", ["not a number"]),
        ("snapkv", "8", ["protected minimum of 32"]),
        ("streaming:sinks=4", "3", ["protected minimum of 5"]),
        ("knorm:scope=adaptive+kivi2", None, ["cannot be stacked", "knorm:scope=head+kivi2"]),
        ("keydiff:scope=layer", None, ["choose one of head, adaptive"]),
        ("expected_attention:alpha=1.5", None, ["out of range"]),
    ],
)
def test_bad_kv_options_fail_before_loading(kv, budget, needles):
    args = ["generate", "--kv", kv, "-p", "hi"] + (["--kv-budget", budget] if budget else [])
    one_error_line(run(*args), *needles)


def test_kv_list_names_every_method():
    r = run("kv", "list", "--json")
    assert r.exit_code == 0
    names = {m["name"] for m in json.loads(r.stdout)}
    assert names == {"full", "streaming", "h2o", "snapkv", "pyramidkv", "kivi2", "kivi4",
                     "minikv", "minikv-pyramid", "xkv", "minicache", "spindlekv", "tova",
                     "knorm", "kvzip", "keydiff", "expected_attention", "kvzap", "duo"}  # fmt: skip
    assert "window" in run("kv", "list").stdout


@pytest.mark.parametrize(
    "kv",
    [["--kv", "streaming", "--kv-budget", "64"], ["--kv", "snapkv+kivi2", "--kv-budget", "0.5"]],
)
def test_chat_on_a_compressed_cache(default_gguf, kv):
    r = run(
        "chat",
        "-m",
        str(default_gguf),
        "--temp",
        "0",
        "-n",
        "24",
        *kv,
        input="Tell me about the moon.\nAnd the sun?\n/stats\n",
    )
    assert r.exit_code == 0, r.output
    assert "cache holds" in r.stderr and "KV" in r.stderr


@pytest.mark.parametrize(
    "args",
    [["--help"], ["kv", "list"], ["models"], ["info"], ["info", "--wtype", "q4"],
     ["generate", "--kv", "bogus", "-p", "hi"], ["chat", "--kv", "bogus"],
     ["longdoc", "missing.txt", "-q", "x"], ["needle", "--kv", "bogus"],
     ["perplexity", "-f", "missing.txt"], ["bench", "--kv", "bogus"], ["bench", "-p", "-1"],
     ["profile", "-f", "missing.txt", "-o", "p.json"], ["convert", "missing.gguf", "out"]],
)  # fmt: skip
def test_commands_that_run_no_model_do_not_import_torch(args, default_gguf, tmp_path, monkeypatch):
    """Commands that need no model (`info` reads metadata only) and option errors load
    neither torch nor the modules of other commands: checked in a child process's
    sys.modules, not by timing. `info` reads the matmul path from the probe record that a
    run leaves (recorded here, as a run on this machine would)."""
    import subprocess
    import sys

    from kvrun.quant import probes

    monkeypatch.setenv("KVRUN_CACHE", str(tmp_path))
    probes.record(probes.matmul("cpu", "float32"), "int4pack")
    code = (
        "import sys\nfrom kvrun.cli.main import cli\ntry:\n"
        f"    cli({args!r}, prog_name='kvrun')\nfinally:\n"
        "    cmds = sorted(m for m in sys.modules if m.startswith('kvrun.cli.'))\n"
        "    print('\\nTORCH', 'torch' in sys.modules, *cmds)"
    )
    own = {f"kvrun.cli.{COMMANDS[args[0]][0]}"} if args[0] in COMMANDS else set()
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    torch, *cli_modules = r.stdout.strip().splitlines()[-1].split()[1:]
    assert torch == "False", r.stdout + r.stderr
    assert set(cli_modules) <= {"kvrun.cli.main", "kvrun.cli.common", *own}, cli_modules
