"""The kernels inside the model: logits with the Triton kernels (interpreted on CPU, compiled
on CUDA) equal the torch reference path's, through the KIVI store and MiniKV's prefill."""

from __future__ import annotations

import pytest
import torch
from test_kv_methods import drive, new_kv, prompt, tiny

from kvrun.kv import check

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "spec", ["kivi2:group=16,residual=32", "minikv:residual=32", "kivi4:residual=64"]
)
def test_triton_path_equals_reference_path(monkeypatch, spec):
    m, ids = tiny(), prompt(90, seed=4)
    toks = [5, 9, 13, 2, 7, 11]
    out = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("KVRUN_KERNELS", mode)
        kv = new_kv(m, spec)
        out[mode] = drive(m, kv, ids, 45, n_decode=len(toks), tokens=toks)
        body = kv.layers[0].kivi.body_len
    assert body > 0  # the quantized body was attended, not only the dense tail
    torch.testing.assert_close(out["triton"], out["torch"], rtol=1e-4, atol=1e-4)


def test_full_cache_decode_through_the_split_k_kernel(monkeypatch):
    """The full cache's decode steps use the dense split-K kernel where Triton runs."""
    m, ids = tiny(), prompt(70, seed=5)
    toks = [3, 8, 1, 12]
    out = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("KVRUN_KERNELS", mode)
        out[mode] = drive(m, new_kv(m, "full"), ids, 35, n_decode=len(toks), tokens=toks)
    torch.testing.assert_close(out["triton"], out["torch"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec,graph", [("full", "static"), ("kivi2:residual=32", "off")])
def test_default_model_logits_through_the_kernels(monkeypatch, default_runtime, spec, graph):
    """The default model (30 layers, GQA 9/3, fp32): prefill and decode logits with the Triton
    kernels (interpreted here) equal the torch reference path's; `full` also takes the static
    decode step a CUDA graph captures."""
    from kvrun.run.session import Session

    rt = default_runtime
    ids = rt.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 10)[:100]
    out = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("KVRUN_KERNELS", mode)
        sess = Session(rt.model, rt.tokenizer, rt.new_kv(check(spec)), ubatch=100, graph=graph)
        logits = [sess.prefill(ids)]
        for tok in (11, 42):
            logits.append(sess.decode(tok))
        out[mode] = torch.stack(logits)
    torch.testing.assert_close(out["triton"], out["torch"], rtol=1e-3, atol=1e-3)
