"""DuoAttention's cache: per layer, its retrieval KV heads in one dense store that keeps every
token and its streaming KV heads in another that keeps the first `sinks` and the newest
`window` (trimmed after each prefill chunk and decode step). Each store attends for its own
query heads; the outputs are put back in head order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ....errors import KvrunError
from ... import calib
from ...protocol import KVManager
from ...state import Into, ListInto, state
from ...stores.dense import DenseSeg

COMMAND = "kvrun calibrate duo -m MODEL"


@state(ret=Into(), stream=Into())
@dataclass(slots=True, eq=False)
class DuoLayer:
    ret: DenseSeg  # the retrieval KV heads: every token
    stream: DenseSeg  # the streaming KV heads: sinks + window
    ret_heads: torch.Tensor  # (R,) KV head indices, ascending
    stream_heads: torch.Tensor  # (S,)
    ret_q: torch.Tensor  # (R * G,) their query heads
    stream_q: torch.Tensor  # (S * G,)


def retrieval_mask(scores: torch.Tensor, budget) -> torch.Tensor:
    """(L, Hkv) bool: the heads kept whole, the highest calibration scores first (ties to the
    lower layer, then head). budget: a share of the heads (< 1) or a count."""
    n = scores.numel()
    k = round(float(budget.value) * n) if budget.is_fraction else min(int(budget.value), n)
    order = torch.sort(scores.flatten(), descending=True, stable=True).indices[:k]
    mask = torch.zeros(n, dtype=torch.bool)
    mask[order] = True
    return mask.view_as(scores)


@state(layers=ListInto())
class DuoCache(KVManager):
    """Retrieval heads whole, streaming heads sinks + window, by the model's calibration."""

    def __init__(self, spec, config, rope, device, dtype, on_select=None):
        super().__init__(config, rope, device, dtype, on_select)
        self.spec, self.name, self.opt = spec, spec.name, spec.select_opts
        self.budget = spec.budget_or_default()
        self.kv_type = self.dense_kv_type(spec, dtype, device)  # --kv-dtype's rows, or None
        self.model_file: Path | None = None
        self.pattern: torch.Tensor | None = None  # (L, Hkv) bool, retrieval heads
        self.layers: list[DuoLayer] = []
        try:  # by config (an in-memory model); Runtime.new_kv then names the model file
            self._load()
            self.reset()
        except KvrunError:
            pass  # said at the first prefill

    def use_model_file(self, path: Path | None) -> None:
        """Find the calibration by the model file's identity (Runtime.new_kv); loaded now."""
        self.model_file, self.pattern = path, None
        self._load()
        self.reset()

    def _load(self) -> torch.Tensor:
        if self.pattern is None:
            where = calib.entry("duo", self.config, self.model_file)
            tensors, _ = calib.load(where, "duo", COMMAND)
            scores = tensors.get("scores")
            shape = (self.config.n_layers, self.config.n_kv_heads)
            if scores is None or tuple(scores.shape) != shape:
                raise KvrunError(
                    f"the duo calibration {where.name} is for another model shape; make a new "
                    f"one with `{COMMAND}`"
                )
            self.pattern = retrieval_mask(scores, self.budget)
        return self.pattern

    def reset(self) -> None:
        super().reset()
        self.layers = (
            [] if self.pattern is None else [self._layer(i) for i in range(len(self.pattern))]
        )

    def _layer(self, i: int) -> DuoLayer:
        c, dev = self.config, self.device
        G = c.n_heads // c.n_kv_heads
        rows = 1 if c.window(i) else 0  # a sliding window masks by position
        heads = torch.arange(c.n_kv_heads, device=dev)
        r, s = heads[self.pattern[i].to(dev)], heads[~self.pattern[i].to(dev)]
        q = lambda h: (h[:, None] * G + torch.arange(G, device=dev)).flatten()  # noqa: E731

        def seg(n: int) -> DenseSeg:
            return DenseSeg(n, c.head_dim, self.dtype, dev, rows, kv_type=self.kv_type)

        return DuoLayer(seg(len(r)), seg(len(s)), r, s, q(r), q(s))

    def begin_prefill(self, n_tokens: int, select: bool = True) -> None:
        super().begin_prefill(n_tokens, select)
        if not self.layers:
            self._load()
            self.reset()

    def prefill(self, layer, q, k, v, positions):
        return self._attend(layer, q, k, v, positions)

    def decode(self, layer, q, k, v, positions):
        return self._attend(layer, q, k, v, positions)

    def _attend(self, layer, q, k, v, positions) -> torch.Tensor:  # (1, Hq, T, D)
        st, T, window = self.layers[layer], k.shape[2], self.config.window(layer)
        out = torch.empty_like(q, dtype=self.dtype)
        for seg, heads, qh in (
            (st.ret, st.ret_heads, st.ret_q),
            (st.stream, st.stream_heads, st.stream_q),
        ):
            if len(heads):
                seg.append(k[:, heads], v[:, heads], positions)
                out[:, qh] = seg.attend(q[:, qh], positions, T, window).to(self.dtype)
        return out

    def _trim(self) -> None:
        """Streaming heads keep the first `sinks` and the newest `window` slots; under a sliding
        window (Gemma 3's local layers) both stores hold only what the next query sees."""
        a, w = self.opt["sinks"], self.opt["window"]
        for i, st in enumerate(self.layers):
            d = st.stream
            if d.length > a + w and len(st.stream_heads):
                idx = torch.cat([torch.arange(a), torch.arange(d.length - w, d.length)])
                d.keep(idx[None].to(self.device))
            if sw := self.config.window(i):
                for seg in (st.ret, st.stream):
                    if seg.length and int(seg.pos[0, 0]) <= self.seen - sw:  # slots: by position
                        seg.keep((seg.pos[0] > self.seen - sw).nonzero().T)

    def kept_counts(self) -> list[int]:
        """Slots held per layer (its retrieval heads', or its streaming heads' where more)."""
        return [max(st.ret.length, st.stream.length) for st in self.layers]

    def end_chunk(self, n_tokens: int) -> None:
        super().end_chunk(n_tokens)
        self._trim()

    def end_step(self) -> None:
        super().end_step()
        self._trim()

    def stores(self) -> list:
        return [s for st in self.layers for s in (st.ret, st.stream)]

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.stores())

    def describe(self) -> dict:
        d = self.spec.describe()
        b = self.budget
        d["budget"] = float(b.value) if b.is_fraction else int(b.value)
        if self.pattern is not None:
            d["retrieval_heads"] = int(self.pattern.sum())
            d["heads"] = int(self.pattern.numel())
        return d
