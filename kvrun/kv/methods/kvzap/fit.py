"""KVzap's fit (KVzap's train.py, on the CPU in minutes): KVzip's scores of sample texts, taken
from kvrun's own KVzip cache, against each layer's Q, K and V rows; a ridge regression per layer
(and optionally a small MLP) onto log(score); kept per model by kvrun/kv/calib.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ... import calib, check
from ...protocol import Pass
from ..kvzip.cache import KVzipCache
from .scorer import Scorer, features, fit_linear, fit_mlp, standardise

Prefill = Callable[[object, list[int]], object]  # (cache, ids): the model run over ids

FLOOR = 1e-6  # scores below it (never attended) are fitted as log(FLOOR)


class Collect(KVzipCache):
    """KVzip on a sample: records each layer's prefill features and, at the prefill's end, the
    reconstruction scores of every slot (nothing is evicted)."""

    def __init__(self, config, rope, device, dtype):
        super().__init__(check("kvzip"), config, rope, device, dtype)
        self.feats: list[list[torch.Tensor]] = [[] for _ in range(config.n_layers)]
        self.taken: list[torch.Tensor] = []

    def attend(self, layer, q, k, v, positions):
        if self.in_prefill:
            self.feats[layer].append(features(q, k, v))
        return super().attend(layer, q, k, v, positions)

    def planning_pass(self, when, ids, tokenizer) -> list[Pass]:
        self.lo = 1 if tokenizer is not None and ids and ids[0] == tokenizer.bos_id else 0
        return super().planning_pass(when, ids, tokenizer)

    def select(self, point: str) -> None:
        self.taken = [z.clone() for z in self.scores]
        self.scores = [None] * len(self.layers)


def collect(model, samples: list[list[int]], prefill: Prefill):
    """Per layer: features X (N, F) and log-scores Y (N, Hkv) of every sample's tokens (a
    leading BOS, never repeated by the pass, left out). prefill(kv, ids) runs the model over
    ids into the cache kv with its planning passes (a Session's prefill: the caller's, since
    the KV layer does not drive the model)."""
    L = model.config.n_layers
    X: list[list[torch.Tensor]] = [[] for _ in range(L)]
    Y: list[list[torch.Tensor]] = [[] for _ in range(L)]
    for ids in samples:
        kv = Collect(model.config, model.rope, model.device, model.dtype)
        prefill(kv, ids)
        for i in range(L):
            x = torch.cat(kv.feats[i])[kv.lo :]
            y = kv.taken[i][:, kv.lo :].T.clamp_min(FLOOR).log()
            X[i].append(x.cpu())
            Y[i].append(y.cpu())
    return [torch.cat(x) for x in X], [torch.cat(y) for y in Y]


def rank_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two 1-D tensors (ties broken by order)."""
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-12))


@dataclass(slots=True)
class Fit:
    tensors: dict[str, torch.Tensor]
    meta: dict
    train_tokens: int
    rho: dict[str, float]  # scorer kind -> mean rank correlation on held-out samples (or train)


def fit(
    model,
    prefill: Prefill,
    samples: list[list[int]],
    held_out: list[list[int]] | None = None,
    hidden: int = 0,
    epochs: int = 30,
    ridge: float = 1e-2,
) -> Fit:
    """Scorers for every layer: linear always, an MLP of `hidden` units when hidden > 0."""
    X, Y = collect(model, samples, prefill)
    tensors: dict[str, torch.Tensor] = {}
    for i, (x, y) in enumerate(zip(X, Y, strict=True)):
        mu, sd = standardise(x)
        z = (x - mu) / sd
        w, b = fit_linear(z, y, ridge)
        tensors |= {f"{i}.mu": mu, f"{i}.sd": sd, f"linear.{i}.w": w, f"linear.{i}.b": b}
        if hidden:
            mlp = fit_mlp(z, y, hidden, epochs, seed=i)
            tensors |= {f"mlp.{i}.{k}": v for k, v in mlp.items()}
    c = model.config
    meta = {
        "method": "kvzap",
        "n_layers": c.n_layers,
        "n_kv_heads": c.n_kv_heads,
        "features": "pre-RoPE q, k, v",
        "target": f"log(max(KVzip score, {FLOOR}))",
        "mlp": hidden,
        "tokens": int(len(X[0])),
        "samples": len(samples),
    }
    kinds = ["linear"] + (["mlp"] if hidden else [])
    Xh, Yh = collect(model, held_out, prefill) if held_out else (X, Y)
    rho = {k: correlation(tensors, k, Xh, Yh) for k in kinds}
    return Fit(tensors, meta, int(len(X[0])), rho)


def correlation(tensors, kind: str, X, Y) -> float:
    """Mean over layers and KV heads of the rank correlation between predicted and true log-scores."""
    out = []
    for i, (x, y) in enumerate(zip(X, Y, strict=True)):
        pred = Scorer.of(tensors, i, kind, "cpu", x.shape[1], y.shape[1])(x)  # (Hkv, N)
        out += [rank_correlation(pred[h], y[:, h]) for h in range(y.shape[1])]
    return sum(out) / len(out)


def save(fit_: Fit, config, model_file) -> str:
    """Keep the fit in the model cache; returns where."""
    where = calib.entry("kvzap", config, model_file)
    calib.save(where, fit_.tensors, fit_.meta)
    return str(where)
