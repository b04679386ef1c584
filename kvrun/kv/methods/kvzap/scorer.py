"""KVzap's surrogate scorers: per layer, a linear map (or a one-hidden-layer GELU MLP, as
KVzap's `mlp`) from the layer's input to one log-score per KV head, and their fits.

The input is the layer's attention input as the cache receives it: the pre-RoPE Q, K and V
rows of each token, concatenated. They are the normed hidden state through the layer's own
projections (plus biases, Qwen), so a linear map of them is a linear map of the hidden state
(Llama-like models: Q's projection is square and invertible, so no hidden-state direction is
lost), and the model hands them to the cache anyway: the model stays unaware of the method."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def features(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(T, (Hq + 2 Hkv) * D) fp32 from q (1, Hq, T, D), k and v (1, Hkv, T, D), pre-RoPE."""
    T = q.shape[2]
    rows = [x[0].transpose(0, 1).reshape(T, -1) for x in (q, k, v)]
    return torch.cat(rows, dim=1).float()


class Scorer:
    """One layer's scorer: standardised features, then linear (w, b) or GELU MLP (w1, b1, w2, b2)."""

    def __init__(self, p: dict[str, torch.Tensor]):
        self.p = p

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (T, F) -> (Hkv, T) fp32
        p = self.p
        z = (x - p["mu"]) / p["sd"]
        if "w1" in p:
            z = F.gelu(z @ p["w1"].T + p["b1"])
            return (z @ p["w2"].T + p["b2"]).T
        return (z @ p["w"].T + p["b"]).T

    @staticmethod
    def of(tensors: dict[str, torch.Tensor], layer: int, kind: str, device, F: int, H: int):
        """Layer `layer`'s scorer of kind linear or mlp from a calibration's tensors, for F
        features and H KV heads; None where a tensor is missing or of another shape (a file
        edited or made for another model: the caller says so in one line)."""
        keys = ("w", "b") if kind == "linear" else ("w1", "b1", "w2", "b2")
        p = {k: tensors.get(f"{kind}.{layer}.{k}") for k in keys}
        p |= {k: tensors.get(f"{layer}.{k}") for k in ("mu", "sd")}
        if any(v is None or not v.is_floating_point() for v in p.values()):
            return None
        h = p["w1"].shape[0] if kind == "mlp" and p["w1"].dim() == 2 else 0
        want = {"mu": (F,), "sd": (F,), "w": (H, F), "b": (H,),
                "w1": (h, F), "b1": (h,), "w2": (H, h), "b2": (H,)}  # fmt: skip
        if any(tuple(v.shape) != want[k] for k, v in p.items()):
            return None
        return Scorer({k: v.to(device, torch.float32) for k, v in p.items()})


def standardise(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature mean and spread (a constant feature keeps spread 1)."""
    mu, sd = X.mean(0), X.std(0)
    return mu, torch.where(sd > 1e-6, sd, torch.ones_like(sd))


def fit_linear(Z: torch.Tensor, Y: torch.Tensor, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge regression of Y (N, H) on standardised Z (N, F), in closed form (float64): w (H, F), b (H,).
    The intercept is not penalised (Y's mean)."""
    Zd, Yd = Z.double(), Y.double()
    ym = Yd.mean(0)
    A = Zd.T @ Zd + ridge * Zd.shape[0] * torch.eye(Zd.shape[1], dtype=torch.float64)
    w = torch.linalg.solve(A, Zd.T @ (Yd - ym))  # (F, H)
    return w.T.float(), ym.float()


def fit_mlp(
    Z: torch.Tensor, Y: torch.Tensor, hidden: int, epochs: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A one-hidden-layer GELU MLP by AdamW on the mean squared error (KVzap's `mlp`, smaller)."""
    with torch.inference_mode(False), torch.enable_grad():
        return _train(Z.clone(), Y.clone(), hidden, epochs, seed)  # normal tensors (autograd)


def _train(Z, Y, hidden: int, epochs: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    Fdim, H = Z.shape[1], Y.shape[1]
    w1 = (torch.randn(hidden, Fdim, generator=g) / Fdim**0.5).requires_grad_()
    b1 = torch.zeros(hidden, requires_grad=True)
    w2 = (torch.randn(H, hidden, generator=g) / hidden**0.5).requires_grad_()
    b2 = Y.mean(0).clone().requires_grad_()
    params = [w1, b1, w2, b2]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=1e-2)
    steps = max(1, epochs * ((len(Z) + 255) // 256))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(epochs):
        for idx in torch.randperm(len(Z), generator=g).split(256):
            out = F.gelu(Z[idx] @ w1.T + b1) @ w2.T + b2
            loss = F.mse_loss(out, Y[idx])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
    return {"w1": w1.detach(), "b1": b1.detach(), "w2": w2.detach(), "b2": b2.detach()}
