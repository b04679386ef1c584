"""KVzap's cache: KVzip's selection (kvrun/kv/methods/kvzip/cache.py) with the reconstruction
pass replaced by the fitted scorers, applied to each prefill chunk's Q, K and V as the layer
attends; budget mode keeps the top-B per KV head, threshold mode every slot scoring above the
threshold plus the sinks and the window, heads padded to the layer's largest count."""

from __future__ import annotations

from pathlib import Path

import torch

from ....errors import KvrunError
from ... import calib
from ...protocol import Pass
from ...state import state
from ..kvzip.cache import KVzipCache
from .scorer import Scorer, features

COMMAND = "kvrun calibrate kvzap -m MODEL"


@state()  # the scorers are the calibration's, loaded as the cache is built
class KVzapCache(KVzipCache):
    """Surrogate scores per turn (self.scores, as KVzip's), then KVzip's or a threshold's selection."""

    def __init__(self, spec, config, rope, device, dtype, on_select=None):
        m = spec.select
        self.threshold_mode = m.mode == "threshold"
        self.kind = m.scorer
        self.scorers: list[Scorer] | None = None  # loaded at the first prefill (or use_model_file)
        self.model_file: Path | None = None
        super().__init__(spec, config, rope, device, dtype, on_select)
        try:  # by config (an in-memory model); Runtime.new_kv then names the model file
            self._load()
        except KvrunError:
            pass  # said at the first prefill

    def use_model_file(self, path: Path | None) -> None:
        """Find the calibration by the model file's identity (Runtime.new_kv); loaded now, so a
        missing one fails before any prefill."""
        self.model_file = path
        self.scorers = None
        self._load()

    def _load(self) -> list[Scorer]:
        if self.scorers is None:
            where = calib.entry("kvzap", self.config, self.model_file)
            tensors, meta = calib.load(where, "kvzap", COMMAND)
            if self.kind == "mlp" and not meta.get("mlp"):
                raise KvrunError(
                    f"the kvzap calibration {where.name} has no mlp scorer; make one with "
                    f"`{COMMAND} --hidden 64`"
                )
            L = self.config.n_layers
            if meta.get("n_layers") != L or meta.get("n_kv_heads") != self.config.n_kv_heads:
                raise KvrunError(
                    f"the kvzap calibration {where.name} is for another model shape; make a new "
                    f"one with `{COMMAND}`"
                )
            c = self.config
            F = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim  # the layer's q, k, v rows
            scorers = [
                Scorer.of(tensors, i, self.kind, self.device, F, c.n_kv_heads) for i in range(L)
            ]
            if any(s is None for s in scorers):
                raise KvrunError(
                    f"the kvzap calibration {where.name} holds scorers of another shape or lacks "
                    f"some; make a new one with `{COMMAND}`"
                )
            self.scorers = scorers
        return self.scorers

    def position_rows(self) -> int:
        if self.threshold_mode:
            return self.config.n_kv_heads  # padding is masked (in the method's formula)
        return super().position_rows()

    def reset(self) -> None:
        super().reset()
        self.start = 0  # the turn's first position (set at each prefill)

    def planning_pass(self, when, ids, tokenizer) -> list[Pass]:
        return []  # the scorers replace KVzip's reconstruction pass

    def begin_prefill(self, n_tokens: int, select: bool = True) -> None:
        super().begin_prefill(n_tokens, select)
        self.start = self.seen  # the turn's first position
        if select:
            self._load()
            Hkv = self.config.n_kv_heads
            self.scores = [torch.zeros(Hkv, n_tokens, device=self.device) for _ in self.layers]

    def attend(self, layer, q, k, v, positions):
        """A prefill chunk's slots are scored from the layer's Q, K and V (pre-RoPE) as it attends."""
        z = self.scores[layer] if self.in_prefill else None
        if z is not None:
            a = self.seen - self.start  # the chunk's first index in the turn
            z[:, a : a + k.shape[2]] = self.scorers[layer](features(q, k, v))
        return super().attend(layer, q, k, v, positions)

    def select(self, point: str) -> None:
        sinks, window = self.opt["sinks"], self.opt["window"]
        if not self.threshold_mode:
            for z in self.scores:  # the window's slots are kept whatever they score
                if z is not None and window:
                    z[:, -window:] = float("inf")
            return super().select(point)
        for i, st in enumerate(self.layers):
            d, z = st.dense, self.scores[i]
            if z is not None:
                keep = torch.ones(d.k.shape[1], d.length, dtype=torch.bool, device=z.device)
                base = d.length - self.turn  # the turn's slots are the newest
                keep[:, base:] = z > self.opt["threshold"]
                keep[:, base : base + max(0, sinks - self.start)] = True
                keep[:, max(base, d.length - window) :] = True
                self._keep_padded(d, keep)
            if d.pos is not None:
                self.report(i, point, torch.where(d.pos == 2**31 - 1, -1, d.pos))
        self.scores = [None] * len(self.layers)
        self.bound_windows()
        return None

    def kept_share(self) -> float:
        """Real (unpadded) slots held over those a full cache would hold, for reports and tests."""
        held = 0
        for st in self.layers:
            d = st.dense
            held += int((d.pos != 2**31 - 1).sum()) if d.pos is not None else d.length * d.n_kv
        return held / max(1, self.seen * self.config.n_kv_heads * self.config.n_layers)

    def describe(self) -> dict:
        d = super().describe()
        if self.threshold_mode:
            d.pop("budget", None)
            d["kept_share"] = round(self.kept_share(), 4)
        return d
