"""bench/gpu.sh smoke: its CPU dry run (the plan fits a short GPU slot and needs no model file)
and the summary it writes from real result files (made here on the CPU)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the GPU smoke script's processes

ROOT = Path(__file__).resolve().parent.parent


def _smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "bench" / "gpu_smoke.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_smoke"] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_passes():
    r = subprocess.run(["bash", "bench/gpu.sh", "smoke", "--dry-run"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "dry run passed" in r.stdout and "FAIL" not in r.stdout
    assert "what travels" in r.stdout and "output files <= 8" in r.stdout


def test_smoke_flags_are_checked():
    r = subprocess.run(["bash", "bench/gpu.sh", "smoke", "--bogus"], cwd=ROOT,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and "unknown flag '--bogus'" in r.stderr


def test_plan_fits_the_slot_and_names_no_model_file():
    smoke = _smoke()
    steps = smoke.plan()
    assert sum(s.timeout for s in steps) <= smoke.BUDGET_S <= 8 * 60
    assert len(set(smoke.FILES) | {s.out for s in steps}) <= 8
    bench = [s for s in steps if s.argv[1:3] == ["-m", "kvrun"]]
    assert {smoke._opt(s.argv, "--wtype") for s in bench} == {"bf16", "q4"}
    assert any("--parallel" in s.argv and "--cuda-graph" in s.argv for s in bench)
    assert all(smoke._opt(s.argv[3:], "-m") == smoke.MODEL for s in bench)
    # a flag the command does not take is caught by the help check
    assert smoke._flags(["-q", "-rs", "-n", "8", "--kv-budget=0.2", "-np", "-5"]) == [
        "-q", "-r", "-n", "--kv-budget", "-np"]  # fmt: skip


def test_summary_from_real_result_files(tmp_path):
    """Result files as the GPU run writes them, made on the CPU: kvrun bench's JSON (tiny
    synthetic model) and bench/kernel_speed.py's JSON; the summary tabulates both."""
    smoke = _smoke()
    bench = subprocess.run([sys.executable, "-m", "kvrun", "bench", "-m", "tiny-synthetic",
                            "-p", "0", "-n", "4", "-d", "0,16", "-r", "1", "--kv", "full",
                            "--kv", "snapkv", "--kv-budget", "0.25", "--json"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    kern = subprocess.run([sys.executable, "bench/kernel_speed.py", "--contexts", "256", "--bits", "2",
                           "--reps", "1", "--warmup", "0", "--hq", "4", "--hkv", "2",
                           "--head-dim", "32", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert kern.returncode == 0, kern.stderr
    (tmp_path / "env.txt").write_text("NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB\n")
    (tmp_path / "tests.txt").write_text("....\n267 passed, 40 skipped in 95.1s\n")
    (tmp_path / "check.txt").write_text("all kernels agree with their references\n")
    (tmp_path / "kernels.json").write_text(kern.stdout)
    line = {"step": "bench_bf16", "wtype": "bf16", "parallel": 8, "rc": 0, "seconds": 1.0,
            "result": json.loads(bench.stdout)}  # fmt: skip
    failed = {"step": "bench_q4", "wtype": "q4", "parallel": 1, "rc": "timeout", "seconds": 40,
              "result": None}  # fmt: skip
    (tmp_path / "bench.jsonl").write_text(json.dumps(line) + "\n" + json.dumps(failed) + "\n")
    md = smoke.summary(tmp_path)
    assert "267 passed, 40 skipped" in md and "all kernels agree" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| bf16 |")]
    assert len(rows) == 4  # 2 methods x 2 depths
    assert "bench_q4: rc timeout, no result" in md
    assert "| dense | 256 |" in md and "| kivi2 | 256 |" in md
