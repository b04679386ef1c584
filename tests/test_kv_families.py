"""The registry-wide KV contract (tests/test_kv_contract.py) on each family beside Llama: every
method and stack runs on Qwen 2.5's biased, Qwen 3's normed, Gemma 3's local/global and
Phi-3's partially rotated attention, with the same checks (a covering budget equals the full
cache, the defaults compress and report, stored bytes equal the formula, static steps equal
eager ones, a batch of three equals three single runs).

On Gemma 3's local layers the window (48 here) is shorter than the prompts (80-300 tokens):
every method keeps positions there to mask by, so what a layer's window hides stays hidden.
"""

from __future__ import annotations

import functools

import pytest
import test_kv_contract as contract
import test_kv_methods
from calib_helpers import ensure_calibrated

import tiny_families
from kvrun.kv import REGISTRY

pytestmark = pytest.mark.usefixtures("one_thread")
FAMILIES = ("qwen2", "qwen3", "gemma3", "phi3")


@functools.lru_cache(maxsize=8)
def _model(name: str, n_heads: int = 4):
    c = tiny_families.kv_config(name, n_heads)
    return test_kv_methods.random_transformer(c, 4321 + n_heads)


@pytest.fixture(params=FAMILIES)
def family(request, monkeypatch):
    """The contract's tiny model swapped for the family's."""
    monkeypatch.setattr(contract, "tiny", lambda n_heads=4: _model(request.param, n_heads))
    return request.param


@pytest.mark.parametrize("m,text", contract.CASES)
def test_budget_covering_everything_equals_full(family, m, text):
    contract.test_budget_covering_everything_equals_full(m, text)


@pytest.mark.parametrize(
    "m,text", [c for c in contract.CASES if c.values[0] in contract.SELECT + contract.STORES]
)
def test_default_settings_compress_and_report(family, m, text):
    contract.test_default_settings_compress_and_report(m, text)


@pytest.mark.parametrize("text", contract._stacks())
def test_nbytes_equals_the_spec_formula(family, text):
    contract.test_nbytes_equals_the_spec_formula(text)


@pytest.mark.parametrize("spec", contract._static_specs())
def test_static_step_equals_eager(family, spec):
    contract.test_static_step_equals_eager(spec)


@pytest.mark.parametrize("m,text", contract.CASES)
def test_batch_of_three_equals_three_single_runs(family, m, text):
    contract.test_batch_of_three_equals_three_single_runs(m, text)


@pytest.mark.parametrize("text", ["kivi2", "snapkv+kivi4"])
def test_kivi_stores_only_the_global_layers(text):
    """A KIVI body cannot mask a window: Gemma 3's local layers stay dense (masked by their
    positions) and only the global layers quantize; on a model whose every layer has a
    window, a KIVI store past it is one line."""
    from test_kv_methods import drive, new_kv, prompt

    from kvrun.errors import KvrunError

    model = _model("gemma3")
    kv = new_kv(model, f"{text}:residual=32")
    drive(model, kv, prompt(150, seed=3), 64, n_decode=4)
    local = model.config.local_layers
    assert [st.kivi is None for st in kv.layers] == [i in local for i in range(3)]
    assert kv.layers[2].kivi.length > 0 and all(kv.layers[i].dense.pos is not None for i in local)
    every = test_kv_methods.random_transformer(
        model.config.replace(local_layers=None, rope_local_theta=None), 5
    )
    with pytest.raises(KvrunError, match="sliding-window attention past 48 tokens"):
        drive(every, new_kv(every, f"{text}:residual=32"), prompt(150, seed=3), 64)


@pytest.mark.parametrize("m,text", contract.CASES)
def test_a_fork_goes_on_as_the_original_and_apart_from_it(family, m, text):
    contract.test_a_fork_goes_on_as_the_original_and_apart_from_it(m, text)


class _Windowed:
    """A reference KV manager written from the model's rule alone: every token kept (float64),
    a local layer's query seeing the keys within its window by position."""

    def __init__(self, model):
        self.model, self.c, self.seen = model, model.config, 0
        self.k = [None] * self.c.n_layers
        self.v = [None] * self.c.n_layers

    def attend(self, layer, q, k, v, positions):
        import math

        import torch

        rope = self.model.rope.at(layer)
        qr, kr = rope.apply(q, positions)[0].double(), rope.apply(k, positions)[0].double()
        for store, x in ((self.k, kr), (self.v, v[0].double())):
            store[layer] = x if store[layer] is None else torch.cat([store[layer], x], 1)
        K, V = self.k[layer], self.v[layer]  # (Hkv, n, D)
        g = qr.shape[0] // K.shape[0]
        s = torch.einsum("hqd,hkd->hqk", qr, K.repeat_interleave(g, 0)) / math.sqrt(K.shape[-1])
        diff = positions[:, None] - torch.arange(K.shape[1])[None, :]
        vis = diff >= 0
        if (w := self.c.window(layer)) is not None:
            vis &= diff < w
        p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1)
        return (p @ V.repeat_interleave(g, 0)).to(q.dtype)[None]

    def begin_prefill(self, n):
        pass

    def end_chunk(self, t):
        self.seen += t

    def end_prefill(self):
        pass

    def end_step(self):
        self.seen += 1


# every method bounds a window's layers (MiniCache's pairs and SpindleKV's coded layers too),
# two stacks too, and KVzip ranking the whole model (its layers keep different counts)
BOUNDED = list(REGISTRY) + ["snapkv+kivi2", "minicache+kivi4", "kvzip:scope=model"]


@pytest.mark.parametrize("dtype", [None, "f16"])
def test_local_layers_hold_at_most_the_window(dtype):
    """Gemma 3's local layers (window 48) hold at most the window under every method and its
    dtype, prefilled past it in chunks and decoded past it again (the ring); `full` gives the
    reference's logits (every token kept, masked by the window) while holding only that."""
    import torch
    from test_kv_methods import drive, prompt

    from kvrun.kv import build, check

    model = _model("gemma3")
    c = model.config
    local, ids = c.local_layers, prompt(150, seed=5)
    ref = drive(model, _Windowed(model), ids, 64, n_decode=20)
    toks = ref.argmax(-1)[len(ids) - 1 : -1].tolist()
    for name in BOUNDED:
        ensure_calibrated(model, spec := check(name).with_dtype(dtype))  # kvzap, duo
        kv = build(spec, c, model.rope, "cpu", torch.float32)
        out = drive(model, kv, ids, 64, n_decode=20, tokens=toks)
        held = kv.kept_counts()
        assert all(held[i] <= c.sliding_window for i in local), (name, held)
        if name == "full":
            tol = 1e-4 if dtype is None else 2e-2
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
