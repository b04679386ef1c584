"""XKV allocation profiles: per-layer budgets saved as fractions of the prompt (or token
counts), averaged over sample prompts of one task type, and the budgets they give a new
prompt (`kvrun profile` writes them; `--kv xkv:profile=FILE` reads them)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from ....errors import KvrunError
from ...spec import largest_remainder


@dataclass(slots=True)
class Profile:
    """Per-layer fractions of the prompt (or token counts), a mean over `count` prompts."""

    model: str
    n_layers: int
    window: int
    pool: str
    units: str  # "fractions" | "tokens"
    values: list[float]  # phi_i per layer
    count: int

    def to_json(self) -> dict:
        return {
            "method": "xkv",
            "model": self.model,
            "n_layers": self.n_layers,
            "window": self.window,
            "pool": self.pool,
            "units": self.units,
            self.units: self.values,
            "count": self.count,
        }


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file; anything wrong is a one-line KvrunError."""
    where = f"profile {path}"
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise KvrunError(f"cannot read {where}: {e.strerror}") from None
    except (ValueError, UnicodeDecodeError):
        raise KvrunError(
            f"{where} is not valid JSON; delete it or make a new one with `kvrun profile`"
        ) from None
    if not isinstance(obj, dict) or obj.get("method") != "xkv":
        raise KvrunError(f'{where} is not an XKV profile (no "method": "xkv")')
    units = obj.get("units", "fractions" if "fractions" in obj else "tokens")
    values, L, count = obj.get(units), obj.get("n_layers"), obj.get("count", 1)

    def number(x) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)

    ok = (
        units in ("fractions", "tokens")
        and isinstance(L, int)
        and L > 0
        and isinstance(values, list)
        and len(values) == L
        and all(number(x) and x >= 0 for x in values)
        and (units == "tokens" or all(x <= 1 for x in values))
        and isinstance(count, int)
        and count >= 1
        and isinstance(obj.get("window", 8), int)
        and isinstance(obj.get("pool", "avg:7"), str)
    )
    if not ok:
        raise KvrunError(
            f"{where} is malformed (need n_layers, {units}: one number >= 0 per "
            "layer, count); make a new one with `kvrun profile`"
        )
    return Profile(
        str(obj.get("model", "")),
        L,
        obj.get("window", 8),
        obj.get("pool", "avg:7"),
        units,
        [float(x) for x in values],
        count,
    )


def check_profile(
    prof: Profile, path, n_layers: int, model: str, window: int, pool: str, units: str | None = None
) -> None:
    """A profile made for another model, window or pooling (or units, when folding) is an error."""
    where = f"profile {path}"
    if prof.n_layers != n_layers:
        raise KvrunError(
            f"{where} has {prof.n_layers} layers but the model has {n_layers}; "
            "make a profile for this model with `kvrun profile`"
        )
    if prof.model and model and prof.model != model:
        raise KvrunError(
            f"{where} was made for model {prof.model!r}, not {model!r}; "
            "make one for this model with `kvrun profile`"
        )
    if (prof.window, prof.pool) != (window, pool):
        raise KvrunError(
            f"{where} was made with window={prof.window},pool={prof.pool}; run with "
            "those xkv options or make a new profile"
        )
    if units is not None and prof.units != units:
        raise KvrunError(
            f"{where} stores {prof.units}, not {units}; set xkv:profile_units="
            f"{prof.units} or write to a new file"
        )


def fold_profile(
    prof: Profile | None, values: list[float], *, model: str, window: int, pool: str, units: str
) -> Profile:
    """The running mean with one more prompt's values (a new profile when prof is None)."""
    if prof is None:
        return Profile(model, len(values), window, pool, units, list(values), 1)
    k = prof.count
    mean = [(old * k + new) / (k + 1) for old, new in zip(prof.values, values, strict=True)]
    return Profile(prof.model or model, prof.n_layers, window, pool, units, mean, k + 1)


def save_profile(path: str | Path, prof: Profile) -> None:
    """Write the profile as JSON, atomically (a crash never leaves half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(prof.to_json(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        raise KvrunError(f"cannot write profile {path}: {e.strerror}") from None


def profile_budgets(
    values: list[float], units: str, t: int, n_ctx: int, floor: int, C: int, target: bool
) -> list[int]:
    """Context tokens per layer for t tokens (C = t - ows). Target mode: floor(phi_i * t + 1/2) in
    [f, C]. Budget mode: f plus the largest-remainder split of N - L*f (ties to the lower layer),
    excess over C given to others in descending phi, so sum n_i = N. kvrun's decision: the split
    follows (phi_i * t - f)+, not phi_i, so the saved n_i come back at the same length."""
    L, f = len(values), min(floor, max(C, 0))
    if C <= 0:
        return [0] * L
    pred = [Fraction(v) * t if units == "fractions" else Fraction(v) for v in values]
    if target:
        return [min(C, max(f, math.floor(x + Fraction(1, 2)))) for x in pred]
    N = max(L * f, min(n_ctx, L * C))
    weights = [max(x - f, Fraction(0)) for x in pred]
    if sum(weights) == 0:
        weights = pred if sum(pred) > 0 else [Fraction(1)] * L
    total = sum(weights)
    extra = largest_remainder([(N - L * f) * w / total for w in weights], N - L * f)
    n = [f + e for e in extra]
    excess = sum(max(0, x - C) for x in n)
    n = [min(x, C) for x in n]
    for i in sorted(range(L), key=lambda i: (-values[i], i)):
        add = min(excess, C - n[i])
        n[i] += add
        excess -= add
    return n
