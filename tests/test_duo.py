"""DuoAttention (docs/methods/duo.md): the cache equals a dense reference that masks each KV
head by the stored pattern (retrieval: causal; streaming: the first sinks and the newest window
before each call, plus the call's own tokens); streaming heads hold only sinks + window; the
calibration ranks a head planted to retrieve far back as a retrieval head."""

from __future__ import annotations

import pytest
import torch
from test_kv_methods import drive, new_kv, prompt, tiny

from kvrun.kv import calib, check
from kvrun.kv.attention import sdpa
from kvrun.kv.methods.duo.cache import retrieval_mask
from kvrun.kv.methods.duo.calibrate import stream_error
from kvrun.kv.protocol import KVManager

pytestmark = pytest.mark.usefixtures("one_thread")
SINKS, WINDOW = 4, 12


class Reference(KVManager):
    """Every token kept; each query head masked as its KV head's kind says."""

    def __init__(self, model, pattern):
        c = model.config
        super().__init__(c, model.rope, "cpu", torch.float32)
        self.pattern = pattern
        self.k = [None] * c.n_layers
        self.v = [None] * c.n_layers

    def prefill(self, layer, q, k, v, positions):
        k0, v0 = self.k[layer], self.v[layer]
        self.k[layer] = k if k0 is None else torch.cat([k0, k], 2)
        self.v[layer] = v if v0 is None else torch.cat([v0, v], 2)
        s, n = int(positions[0]), self.k[layer].shape[2]  # the call's first position
        i = positions[:, None]
        j = torch.arange(n)[None, :]
        causal = j <= i
        stream = causal & ((j < SINKS) | (j >= s - WINDOW))
        G = q.shape[1] // k.shape[1]
        per_kv = torch.where(self.pattern[layer][:, None, None], causal, stream)  # (Hkv, T, n)
        return sdpa(q, self.k[layer], self.v[layer], per_kv.repeat_interleave(G, 0)[None])

    decode = prefill


def _pattern(model, seed):
    """A stored calibration with random scores, and the retrieval heads it gives at 0.5."""
    c = model.config
    scores = torch.rand(c.n_layers, c.n_kv_heads, generator=torch.Generator().manual_seed(seed))
    calib.save(calib.entry("duo", c, None), {"scores": scores}, {"method": "duo"})
    return retrieval_mask(scores, check("duo", "0.5").budget)


@pytest.mark.parametrize("ubatch", [16, 100])
def test_duo_equals_the_dense_reference(ubatch):
    """Chunked prefill, then decode steps, then a second turn: the same logits; streaming heads
    hold sinks + window, retrieval heads every token."""
    model = tiny()
    pattern = _pattern(model, 3)
    assert 0 < int(pattern.sum()) < pattern.numel()
    spec = f"duo:sinks={SINKS},window={WINDOW}"
    kv, ref = new_kv(model, spec, "0.5"), Reference(model, pattern)
    ids = prompt(60, seed=2)
    got = drive(model, kv, ids, ubatch, n_decode=5)
    want = drive(model, ref, ids, ubatch, n_decode=5, tokens=got[59:-1].argmax(-1).tolist())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    more = prompt(20, seed=9)
    torch.testing.assert_close(drive(model, kv, more, ubatch), drive(model, ref, more, ubatch))
    for i, st in enumerate(kv.layers):
        assert torch.equal(st.ret_heads, torch.nonzero(pattern[i]).flatten())
        assert st.ret.length == kv.seen and st.stream.length == SINKS + WINDOW
    assert kv.nbytes() == kv.spec.select.nbytes(kv)


def test_bytes_count_what_each_store_holds():
    """Fewer retrieval heads, fewer bytes: the spec's formula is what is held, and a share 1
    budget (every head whole) holds what the full cache does."""
    model = tiny()
    _pattern(model, 4)
    held = []
    for budget in ("0.25", "0.75", str(model.config.n_layers * model.config.n_kv_heads)):
        kv = new_kv(model, "duo:sinks=4,window=16", budget)
        drive(model, kv, prompt(200, seed=5), 64, n_decode=3)
        assert kv.nbytes() == kv.spec.select.nbytes(kv)
        held.append(kv.nbytes())
    assert held[0] < held[1] < held[2] == kv.nbytes_full()


def test_calibration_ranks_a_planted_retrieval_head_first():
    """Synthetic attention inputs: KV head 0's queries look for one key far behind the window;
    the other heads' queries look at their newest keys. Made streaming, head 0's output changes
    most, so it ranks as the retrieval head."""
    g = torch.Generator().manual_seed(0)
    T, D, Hkv, G = 200, 16, 3, 2
    k = torch.randn(1, Hkv, T, D, generator=g)
    v = torch.randn(1, Hkv, T, D, generator=g)
    q = torch.zeros(1, Hkv * G, T, D)
    far = 30  # beyond the window for the last rows, after the sinks
    q[0, 0:G] = 8 * k[0, 0, far]  # head 0 (query heads 0, 1) retrieves position 30
    for h in range(1, Hkv):  # the others: each row its own newest key
        q[0, h * G : (h + 1) * G] = 8 * k[0, h]
    err = stream_error(q, k, v, sinks=4, window=16, rows=20, sliding=None)
    assert int(err.argmax()) == 0 and float(err[0]) > 10 * float(err[1:].max()), err
    pattern = retrieval_mask(err[None], check("duo", "1").budget)
    assert pattern[0].tolist() == [True, False, False]
