"""`kvrun bench`'s settings: what to measure, parsed and checked before anything loads (no
torch here; kvrun.tasks.bench runs them)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import ContextOverflow, KvrunError
from ..kv import KVSpec
from ..kv.spec import Budget


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """What to measure; recorded as-is in the JSON."""

    n_prompt: int  # tokens prefilled and timed (pp), 0 = skip
    n_gen: int  # tokens decoded and timed (tg), 0 = skip
    depths: tuple[int, ...]  # tokens in the cache before the timed prompt
    reps: int  # measured reps per row, after one warm-up rep
    methods: tuple[str, ...]  # --kv texts, as given
    budgets: tuple[str | None, ...]  # --kv-budget values; None = the method's default
    seed: int = 0
    ubatch: int = 512
    ctx_size: int = 0  # 0 = the model's context
    cuda_graph: bool = False  # decode steps replay a CUDA graph where the method allows
    specs: tuple[KVSpec, ...] = ()  # `methods` validated (kvrun.kv.check), in the same order
    parallel: int = 1  # sequences decoded together (tg is then their aggregate tok/s)
    ignore_eos: bool = False  # greedy picks never a stop token (llama.cpp's --ignore-eos)

    def record(self) -> dict:
        """The settings as the JSON records them (the texts, not the parsed specs)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "specs"}


def parse_counts(text: str, flag: str) -> tuple[int, ...]:
    """Comma-separated non-negative token counts ('0,4096'), or a one-line error."""
    try:
        out = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise KvrunError(
            f"{flag} expects comma-separated token counts like 0,4096 (got {text!r})"
        ) from None
    if any(x < 0 for x in out):
        raise KvrunError(f"{flag} values must be >= 0 (got {text!r})")
    return out


def parse_budgets(text: str | None) -> tuple[str | None, ...]:
    """--kv-budget as a comma list ('0.25,1024'); None keeps each method's default."""
    if text is None:
        return (None,)
    out = tuple(b.strip() for b in str(text).split(","))
    for b in out:
        Budget.parse(b)
    return out


def check_settings(s: BenchSettings, context: int | None = None) -> None:
    """Reject bad settings in one line before any work; context None skips the length check."""
    for flag, v in (("-p/--n-prompt", s.n_prompt), ("-n/--n-gen", s.n_gen)):
        if v < 0:
            raise KvrunError(f"{flag} must be >= 0 (got {v})")
    if not s.depths:
        raise KvrunError("-d/--n-depth needs at least one depth")
    if s.n_prompt == 0 and s.n_gen == 0:
        raise KvrunError("nothing to measure: -p/--n-prompt and -n/--n-gen are both 0")
    if s.reps < 1:
        raise KvrunError(f"--reps must be >= 1 (got {s.reps})")
    if len(s.specs) != len(s.methods):
        raise ValueError("BenchSettings.specs must hold the validated spec of every method")
    cases(s)  # every budget against every method's rules
    if context is not None:
        d = max(s.depths)
        total = d + s.n_prompt + s.n_gen
        if total > context:
            raise ContextOverflow(
                f"depth {d} + prompt {s.n_prompt} + gen {s.n_gen} = {total} tokens exceed the "
                f"context of {context}; lower -d/-p/-n or raise -c/--ctx-size"
            )


def cases(s: BenchSettings) -> list[tuple[str, str | None, KVSpec, int]]:
    """(method text, budget, spec at that budget, depth) per row: budgets multiply only
    methods that select tokens."""
    out = []
    for kv, spec in zip(s.methods, s.specs, strict=True):
        for b in s.budgets if spec.takes_budget else (None,):
            out.extend((kv, b, spec.with_budget(b), d) for d in s.depths)
    return out


def row_labels(s: BenchSettings, depth: int) -> tuple[str | None, str | None]:
    """llama-bench's test labels: 'pp512 @ d4096', 'tg128' (depth 0 is not written)."""
    at = f" @ d{depth}" if depth else ""
    pp = f"pp{s.n_prompt}{at}" if s.n_prompt else None
    tg = f"tg{s.n_gen}{at}" if s.n_gen else None
    return pp, tg
