"""Expected Attention (Devoto et al., 2025, "Expected Attention: KV Cache Compression by
Estimating Attention from Future Queries Distribution"; kvpress ExpectedAttentionPress): the
newest queries' pre-RoPE mean and covariance, rotated to the next positions, give each key the
attention future queries are expected to pay it, times its value's norm; at the end of the
prefill, query-agnostic (spec: docs/methods/expected_attention.md)."""

from __future__ import annotations

from ..spec import Method, Option, adaptive


class ExpectedAttention(Method):
    name = "expected_attention"
    summary = "Expected Attention: future queries' expected attention x value norm, at prefill end"
    axes = ("expected attention", "top-k + sinks", "uniform", "dense")
    runs_at = "prefill-end"
    window = Option(128, "the newest queries whose statistics stand for the future ones", lo=2)
    future = Option(512, "future positions the rotation is averaged over", lo=1)
    sinks = Option(4, "first tokens always kept (their queries left out of the statistics)", lo=0)
    covariance = Option(True, "add the queries' covariance term (else the mean alone)")
    vnorm = Option(True, "weight each key by its value's L2 norm")
    epsilon = Option(0.0, "added to the expected attention before the value norm", lo=0.0)
    scope, alpha, critical = adaptive()
    points = frozenset({"prefill"})

    @property
    def queries(self) -> int:
        return self.window

    def score(self, ctx):
        """(E[softmax] + epsilon) * ||v||, E from exp(mu.k / sqrt(D) + k^T Sigma k / (2 D)) per
        query head, softmax over the layer's non-sink slots, mean over the group."""
        import torch

        from ..stores.dense import PAD

        k, v = ctx.keys.float(), ctx.values.float()  # (Hkv, T, D)
        Hkv, T, D = k.shape
        mu, cov = self.statistics(ctx)  # (Hq, D), (Hq, D, D), at the next positions
        kg = k.repeat_interleave(mu.shape[0] // Hkv, dim=0)  # (Hq, T, D): each query head's keys
        logits = torch.einsum("htd,hd->ht", kg, mu) / D**0.5
        if self.covariance:
            logits += torch.einsum("htd,hde,hte->ht", kg, cov, kg) / (2 * D)
        # the sinks are kept whatever they score and left out of the softmax (as kvpress);
        # padding (scope=adaptive) is no key at all
        pos = ctx.positions
        at = torch.arange(T, device=k.device)[None] if pos is None else pos.long()
        out = (at < self.sinks) | (at == PAD)  # (1 or Hkv, T)
        out = out.repeat_interleave(mu.shape[0] // len(out), dim=0)
        p = torch.softmax(logits.masked_fill(out, float("-inf")), dim=-1)
        p = p.nan_to_num(0.0).view(Hkv, -1, T).mean(1)  # the group's mean
        return (p + self.epsilon) * v.norm(dim=-1) if self.vnorm else p

    def statistics(self, ctx):
        """Mean (Hq, D) and covariance (Hq, D, D) of the saved queries before RoPE (the sinks'
        left out), each rotated by the mean RoPE matrix of positions n .. n + future - 1: the
        queries to come, as kvpress's apply_avg_rope. The saved queries are post-RoPE
        (rotated at their positions n - w .. n - 1): rotating back needs only the layer's
        frequencies (and YaRN's magnitude, divided out)."""
        import torch

        q = ctx.queries.float()  # (Hq, w, D)
        Hq, w, D = q.shape
        rope = ctx.rope
        inv = rope.inv_freq.float().to(q.device)  # (D/2,)
        m = torch.ones_like(inv) if rope.magnitude is None else rope.magnitude.float()
        mag = torch.cat([m, m]).to(q.device)  # (D,) YaRN's factor on cos and sin, else 1
        pos = torch.arange(ctx.n - w, ctx.n, device=q.device, dtype=torch.float32)
        if int((pos >= self.sinks).sum()) >= 2:  # the sinks' queries are outliers (kvpress)
            q, pos = q[:, pos >= self.sinks], pos[pos >= self.sinks]
        ang = pos[:, None] * inv[None]  # (w, D/2)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        # R(p)^-1 x = x cos - rotate_half(x) sin, rotate_half(x) = (-x2, x1)
        half = torch.cat([-q[..., D // 2 :], q[..., : D // 2]], dim=-1)
        pre = (q * cos - half * sin) / mag
        mu = pre.mean(1)  # (Hq, D)
        c = pre - mu[:, None]
        cov = torch.einsum("hwi,hwj->hij", c, c) / pre.shape[1]
        fut = torch.arange(ctx.n, ctx.n + self.future, device=q.device, dtype=torch.float32)
        fa = fut[:, None] * inv[None]  # (F, D/2)
        cbar = torch.cat([fa.cos().mean(0)] * 2) * mag
        sbar = torch.cat([fa.sin().mean(0)] * 2) * mag
        eye = torch.eye(D // 2, device=q.device)
        zero = torch.zeros_like(eye)
        P = torch.cat([torch.cat([zero, -eye], 1), torch.cat([eye, zero], 1)], 0)  # rotate_half
        R = torch.diag(cbar) + sbar[:, None] * P  # the mean of R(p) over the future positions
        return mu @ R.T, R @ cov @ R.T
