"""Calibrations for the tests' in-memory models (kvrun/kv/calib.py keys them by config): a
calibrated method (kvzap, duo) built by a test finds one, fitted here the first time (fast)."""

from __future__ import annotations

import torch

from kvrun.kv import calib


def ensure_calibrated(model, spec) -> None:
    """Fit and keep `spec`'s calibration of `model` where the cache looks for it, if missing."""
    name = getattr(spec.select, "calibration", None)
    if not name or calib.entry(name, model.config, None).exists():
        return
    c = model.config
    if name == "kvzap":
        from kvrun.kv.methods.kvzap import fit

        g = torch.Generator().manual_seed(5)
        samples = [torch.randint(0, 256, (96,), generator=g).tolist() for _ in range(2)]
        with torch.inference_mode():
            from kvrun.run.session import Session

            def prefill(kv, ids):
                return Session(model, None, kv, ubatch=64).prefill(ids)

            f = fit.fit(model, prefill, samples, hidden=8, epochs=2)
        fit.save(f, c, None)
    else:  # duo: a fixed pattern is all the contract needs (the calibration has its own tests)
        scores = torch.rand(c.n_layers, c.n_kv_heads, generator=torch.Generator().manual_seed(6))
        calib.save(calib.entry(name, c, None), {"scores": scores}, {"method": "duo"})
