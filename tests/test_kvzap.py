"""KVzap (docs/methods/kvzap.md): the fit recovers a known map; the scores the cache selects by
are the scorers applied to the layer's input (a dense reference from the hidden states); the
threshold mode's kept share follows the text; on the default model the fitted scorers' scores
rank-correlate with KVzip's on text the fit never saw."""

from __future__ import annotations

import pytest
import torch
from calib_helpers import ensure_calibrated
from test_kv_methods import drive, new_kv, prompt, tiny

from kvrun.kv import calib, check
from kvrun.kv.methods.kvzap import fit as kvzap_fit
from kvrun.kv.methods.kvzap.scorer import Scorer, features, fit_linear, standardise
from kvrun.run.session import Session

pytestmark = pytest.mark.usefixtures("one_thread")


def test_fit_recovers_a_known_linear_map():
    """Y = X W^T + b exactly: the ridge fit (nearly no penalty), through the standardisation,
    predicts Y from new X."""
    g = torch.Generator().manual_seed(0)
    X = 3 * torch.randn(2000, 24, generator=g) + 1.5
    W, b = torch.randn(3, 24, generator=g), torch.randn(3, generator=g)
    Y = X @ W.T + b
    mu, sd = standardise(X)
    w, b0 = fit_linear((X - mu) / sd, Y, ridge=1e-9)
    scorer = Scorer({"mu": mu, "sd": sd, "w": w, "b": b0})
    Xn = torch.randn(100, 24, generator=g)
    torch.testing.assert_close(scorer(Xn), (Xn @ W.T + b).T, rtol=1e-3, atol=1e-3)


class Spy:
    """Wraps a KVzap cache's select: the scores it selects by, per layer (Hkv, t)."""

    def __init__(self, kv):
        self.scores, inner = [], kv.select

        def select(point):
            self.scores = [z.clone() for z in kv.scores]
            inner(point)

        kv.select = select


def reference_scores(model, ids, kind):
    """The scorers applied to each layer's input hidden state (after its input norm) through
    the layer's own Q, K, V projections, in one dense forward of the model."""
    hidden, hooks = {}, []
    for i, block in enumerate(model.model.layers):
        hooks.append(
            block.input_layernorm.register_forward_hook(
                lambda m, a, out, i=i: hidden.__setitem__(i, out)
            )
        )
    with torch.inference_mode():
        drive(model, new_kv(model, "full"), ids, len(ids))
    for h in hooks:
        h.remove()
    c = model.config
    tensors, _ = calib.load(calib.entry("kvzap", c, None), "kvzap", "")
    out = []
    for i, block in enumerate(model.model.layers):
        a, h = block.self_attn, hidden[i]
        T = h.shape[1]
        q = a.q_proj(h).view(1, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = a.k_proj(h).view(1, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = a.v_proj(h).view(1, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        x = features(q, k, v)
        out.append(Scorer.of(tensors, i, kind, "cpu", x.shape[1], c.n_kv_heads)(x))
    return out


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_selection_scores_are_the_scorers_on_the_hidden_states(kind):
    """In chunks, the scores at the prefill's end equal the dense reference's, and each KV head
    keeps its top-B by them, sinks first (the kept positions the debug hook reports)."""
    model = tiny()
    ids = prompt(90, seed=11)
    kept = {}
    kv = new_kv(
        model, f"kvzap:scorer={kind}", "30", hook=lambda i, p, pos: kept.__setitem__(i, pos)
    )
    spy = Spy(kv)
    drive(model, kv, ids, 32)
    ref = reference_scores(model, ids, kind)
    for i, z in enumerate(ref):
        torch.testing.assert_close(spy.scores[i], z, rtol=1e-4, atol=1e-4)
        s = z.clone()
        s[:, :4] = float("inf")  # sinks
        want = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :30].sort(1).values
        assert torch.equal(kept[i].long(), want)


def test_threshold_keeps_a_share_that_follows_the_text():
    """mode=threshold keeps what scores above the threshold plus the window: a repetitive and a
    varied prompt of the same length keep different shares, each between the window's and all."""
    model = tiny()
    ensure_calibrated(model, check("kvzap"))
    probe = new_kv(model, "kvzap")
    spy = Spy(probe)
    drive(model, probe, prompt(120, seed=1), 64)
    t = float(torch.cat([z.flatten() for z in spy.scores]).median())
    shares = []
    for ids in (prompt(120, seed=1), [7, 8, 9] * 40):
        kv = new_kv(model, f"kvzap:mode=threshold,threshold={t:.4f},window=8")
        drive(model, kv, ids, 64, n_decode=2)
        shares.append(kv.kept_share())
    assert all(0.05 < s < 1 for s in shares), shares
    assert abs(shares[0] - shares[1]) > 0.02, shares


@pytest.mark.slow
def test_default_model_scorers_rank_like_kvzip(default_runtime):
    """Fitted on the text shipped with kvrun, the linear scorers rank the slots of a held-out
    text (docs/architecture.md's start) as KVzip does: Spearman rho (mean over layers and KV
    heads) well above 0 (0.55 with the whole shipped text and 1.4k held-out tokens)."""
    from importlib import resources
    from pathlib import Path

    rt = default_runtime
    tok = rt.tokenizer
    text = resources.files("kvrun.prompts").joinpath("calibration.txt").read_text()
    held = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()[:3000]
    cut = lambda t, n: [tok.bos_id] + tok.encode(t, add_bos=False)[:n]  # noqa: E731
    with torch.inference_mode():

        def prefill(kv, ids):
            return Session(rt.model, tok, kv, ubatch=512).prefill(ids)

        f = kvzap_fit.fit(rt.model, prefill, [cut(text, 700)], [cut(held, 300)])
    print(f"held-out rank correlation: {f.rho}")
    assert f.rho["linear"] > 0.3, f.rho


def test_a_calibration_of_another_shape_is_one_line(tmp_path, monkeypatch):
    """A kept calibration whose scorers lack a tensor or have another shape (a file edited,
    or made for another model) is refused in one line naming the fit command, never a
    traceback at the first prefill."""
    from kvrun.errors import KvrunError

    model = tiny()
    ensure_calibrated(model, check("kvzap"))
    where = calib.entry("kvzap", model.config, None)
    tensors, meta = calib.load(where, "kvzap", "")
    for edit in ("drop", "shape"):
        bad = dict(tensors)
        if edit == "drop":
            del bad["linear.0.w"]
        else:
            bad["linear.0.w"] = bad["linear.0.w"][:, :-1].contiguous()
        calib.save(where, bad, meta)
        with pytest.raises(KvrunError, match="another shape or lacks"):
            drive(model, new_kv(model, "kvzap", "0.5"), prompt(40, seed=3), 16, n_decode=1)
    calib.save(where, tensors, meta)  # as it was, for the other tests
