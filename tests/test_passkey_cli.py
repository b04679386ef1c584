"""End to end on the default model, through the CLI: pass-key retrieval at ~2,000 tokens."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from passkey_helpers import passkey_prompt

from kvrun.cli.main import cli
from kvrun.tasks.passkey import answer_matches

pytestmark = pytest.mark.slow  # kvrun processes and the default model

KEY = 49595


@pytest.fixture(scope="module")
def passkey_file(default_runtime, tmp_path_factory):
    path = tmp_path_factory.mktemp("passkey") / "passkey.txt"
    path.write_text(passkey_prompt(default_runtime.tokenizer, 2000, 0.5, KEY, seed=2))
    return path


@pytest.mark.parametrize(
    "kv, budget",
    [("full", None), ("snapkv", "0.5"), ("kivi4", None), ("snapkv+kivi4", "0.5")],
)
def test_passkey_through_cli(default_gguf, passkey_file, kv, budget):
    args = [
        "generate",
        "-m",
        str(default_gguf),
        "--raw",
        "-f",
        str(passkey_file),
        "-n",
        "8",
        "--temp",
        "0",
        "--kv",
        kv,
        "--json",
    ]
    if budget:
        args += ["--kv-budget", budget]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] > 1900
    assert answer_matches(out["text"], KEY), out["text"]
    assert out["kv"]["method"] == kv
    ratio = out["kv_bytes"] / out["kv_bytes_full"]
    if kv == "full":
        assert ratio == 1.0
    elif kv == "snapkv":
        assert 0.49 < ratio < 0.52  # half the prompt kept, plus the generated tokens
    elif kv == "kivi4":
        # a 4-bit body with f16 scales and zeros (0.625 bytes an element against f16's 2: 0.31)
        # plus a < 128-token float32 tail (the model's dtype: <= 0.13 at ~1,950 tokens)
        assert 0.3 < ratio < 0.45
    else:
        assert ratio < 0.3  # half the prompt in that body, plus the tail
