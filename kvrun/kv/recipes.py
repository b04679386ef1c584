"""Named KV recipes and the --kv grammar: NAME[:key=value,...][+NAME[:key=value,...]...].

Each name is a part on the three axes (methods/README.md): a selection part (which tokens,
how many per layer, when) and/or a store part (how they are stored). Options attach to
the part they follow: `snapkv:window=64+kivi2:group=16`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import KvrunError


@dataclass(frozen=True, slots=True)
class Option:
    name: str
    default: Any
    help: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple = ()
    odd: bool = False

    def parse(self, part: str, text: str) -> Any:
        """The value of `text` for this option, or a one-line error naming what is valid."""
        where = f"{part}:{self.name}"
        d = self.default
        try:
            if isinstance(d, bool):
                if text.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                v: Any = text.lower() in ("true", "1", "yes", "on")
            elif isinstance(d, int):
                v = int(text)
            elif isinstance(d, float):
                v = float(text)
            else:
                v = text
        except ValueError:
            kind = "true or false" if isinstance(d, bool) else type(d).__name__
            raise KvrunError(f"{where}={text} is not valid: expected {kind}") from None
        if self.choices and v not in self.choices:
            raise KvrunError(
                f"{where}={text} is not valid: choose one of {', '.join(map(str, self.choices))}"
            )
        if (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
            rng = f"{self.lo if self.lo is not None else '-inf'}..{self.hi if self.hi is not None else 'inf'}"
            raise KvrunError(f"{where}={text} is out of range ({rng})")
        if self.odd and v % 2 == 0:
            raise KvrunError(f"{where}={text} must be odd")
        return v


@dataclass(frozen=True, slots=True)
class Part:
    """One named part: a selection recipe or a store."""

    name: str
    kind: str  # "select" | "store"
    summary: str
    scorer: str = "none"  # none | window | cumulative | cumulative (prompt)
    selector: str = "all"  # all | sinks+recent | topk+recent | topk+window[ (per query head)]
    allocator: str = "uniform"  # uniform | pyramid | pyramid (MiniKV) | xkv | spindle
    store: str = "dense"  # dense | kivi | kivi 2-bit | merged | codebook
    when: str = "never"  # never | prefill-end... | every chunk and step | tail flush
    options: tuple[Option, ...] = ()

    def defaults(self) -> dict:
        return {o.name: o.default for o in self.options}


_SNAP = (
    Option("window", 32, "observation window: the last w prompt queries vote", lo=1),
    Option("kernel", 7, "pooling kernel over the votes", lo=1, odd=True),
    Option("pool", "max", "pooling", choices=("max", "avg")),
    Option("chunked", False, "also compress after every prefill chunk (bounded peak memory)"),
)
_KIVI = (
    Option("group", 32, "tokens (keys) / channels (values) sharing a scale and zero point", lo=1),
    Option("residual", 128, "newest tokens kept in full precision", lo=1),
)

_MINIKV = (
    Option("heavy", 0.25, "heavy-hitter fraction x of the prompt (a --kv-budget overrides)", lo=0.0, hi=1.0),
    Option("recent", 0.25, "recent-window fraction of the prompt (a --kv-budget overrides)", lo=0.0, hi=1.0),
    Option("alloc", "uniform", "heavy-hitter budgets per layer", choices=("uniform", "pyramid")),
    Option("depth", 7, "pyramid depth delta: the smallest layer gets x/delta", lo=1),
    Option("pyramid_dir", "down", "down = more budget in lower layers", choices=("down", "up")),
    Option("quant", "kivi2", "store: 2-bit KIVI or dense", choices=("kivi2", "none")),
    Option("group", 16, "KIVI group size", lo=1),
    Option("residual", 128, "KIVI fp residual flush length", lo=1),
    Option("colsum", "auto", "column sums: triton on CUDA, chunked on CPU; dense = reference",
           choices=("auto", "chunked", "dense", "triton")),
    Option("gqa_agg", "sum", "KV-head score from its query heads", choices=("sum", "max")),
    Option("score_norm", "none", "length = divide A[j] by (t - j)", choices=("none", "length")),
    Option("align", 0, "16 = round heavy hitters down so the kept count is a multiple of 16",
           choices=(0, 16)),
    Option("report", "exact", "paper = also report the paper's App. I size", choices=("exact", "paper")),
)  # fmt: skip
_XKV = (
    Option("window", 8, "observation-window queries, always kept", lo=1),
    Option("pool", "avg:7", "pooling of the scores: avg:K, max:K or none"),
    Option("min_tokens", -1, "per-layer floor on context tokens (-1 = the window)", lo=-1),
    Option("plan", "two-pass", "two-pass = scoring pass then evicting prefill; deferred = one prefill",
           choices=("two-pass", "deferred")),
    Option("profile", "", "JSON allocation profile: load it if it exists, else write it"),
    Option("profile_update", False, "always plan and fold the new fractions into the profile"),
    Option("target", 0.0, "target-retention mode: keep this attention mass (0 = budget mode)",
           lo=0.0, hi=1.0),
    Option("alloc", "topk", "topk = global top-N; loop = the literal greedy (reference)",
           choices=("topk", "loop")),
    Option("select", "head", "head = per KV head; layer = one set per layer", choices=("head", "layer")),
    Option("budget_scope", "total", "total = window tokens count toward the budget",
           choices=("total", "context")),
    Option("profile_units", "fractions", "what a profile stores", choices=("fractions", "tokens")),
)  # fmt: skip
_MINICACHE = (
    Option("start", -1, "first merged layer S (-1 = L//2): pairs (l-1, l), odd l >= S", lo=-1),
    Option("slerp_t", 0.6, "SLERP weight of the later layer", lo=0.0, hi=1.0),
    Option("gamma", 0.05, "retention threshold, a fraction of the distance range", lo=0.0, hi=1.0),
    Option("retain_rule", "distinct", "distinct = keep the most distinct; paper = as printed",
           choices=("distinct", "paper")),
    Option("retain", "range", "range (gamma rule) or topk:F (a fixed fraction F of the prompt)"),
    Option("granularity", "head", "norm/angle per (token, KV head) or per token",
           choices=("head", "token")),
    Option("decode_retain", False, "retain decode tokens above the prefill threshold"),
    Option("sin_eps", 1e-6, "SLERP to LERP fallback threshold", lo=0.0),
    Option("store", "fp16", "kivi4 = the paper's 4-bit store under the merge (= minicache+kivi4)",
           choices=("fp16", "kivi4")),
    Option("kivi_group", 32, "KIVI group with store=kivi4", lo=1),
    Option("kivi_residual", 128, "KIVI residual with store=kivi4", lo=1),
)  # fmt: skip
_SPINDLE = (
    Option("window", 32, "observation-window queries, always kept", lo=1),
    Option("beta", 0.05, "smallest layer ratio; alpha = (1 + beta)/2", lo=0.0, hi=1.0),
    Option("schedule", "linear", "per-layer ratios", choices=("linear", "flat")),
    Option("pool", "none", "pooling of the scores: none, avg:K or max:K"),
    Option("score_norm", "length", "length = divide by (t - a)", choices=("length", "none")),
    Option("gqa", "qhead", "qhead = per query head, union + mask; mean = per KV head",
           choices=("qhead", "mean")),
    Option("codebook", True, "off = store the kept pre-RoPE K and V densely"),
    Option("theta_k", 0.98, "cosine threshold for keys", lo=-1.0, hi=2.0),
    Option("theta_v", 0.95, "cosine threshold for values", lo=-1.0, hi=2.0),
    Option("codebook_scope", "layer", "one codebook per layer or per KV head", choices=("layer", "head")),
    Option("index", "auto", "index width", choices=("auto", "int16-strict", "int32")),
    Option("cb_block", 4096, "tile size of the similarity blocks", lo=1),
    Option("decode_codebook", True, "off = decode tokens stored densely"),
    Option("report", "exact", "paper = also report r1*r2*r3", choices=("exact", "paper")),
)  # fmt: skip

PARTS: dict[str, Part] = {
    p.name: p
    for p in [
        Part("full", "select", "every token, uncompressed"),
        Part(
            "streaming",
            "select",
            "StreamingLLM: attention sinks + recent window",
            selector="sinks+recent",
            when="every chunk and step",
            options=(Option("sinks", 4, "first tokens always kept", lo=0),),
        ),
        Part(
            "h2o",
            "select",
            "H2O: heavy hitters by cumulative attention + recent window",
            scorer="cumulative",
            selector="topk+recent",
            when="every chunk and step",
            options=(
                Option(
                    "recent", 0.5, "share of the budget for the most recent tokens", lo=0.0, hi=1.0
                ),
                Option("sinks", 0, "first tokens always kept", lo=0),
            ),
        ),
        Part(
            "snapkv",
            "select",
            "SnapKV: observation-window votes, max-pooled, top-k per KV head",
            scorer="window",
            selector="topk+window",
            when="prefill-end",
            options=_SNAP,
        ),
        Part(
            "pyramidkv",
            "select",
            "PyramidKV: SnapKV with linearly decreasing layer budgets",
            scorer="window",
            selector="topk+window",
            allocator="pyramid",
            when="prefill-end",
            options=_SNAP + (Option("beta", 20, "last layer gets 1/beta of the mean", lo=1),),
        ),
        Part(
            "minikv",
            "select",
            "MiniKV: H2O heavy hitters over the prompt + recent window, 2-bit KIVI (G 16, R 128)",
            scorer="cumulative (prompt)",
            selector="topk+recent",
            allocator="uniform",
            store="kivi 2-bit",
            when="prefill-end; then tail flushes",
            options=_MINIKV,
        ),
        Part(
            "minikv-pyramid",
            "select",
            "MiniKV with pyramid heavy-hitter budgets, more to lower layers (= minikv:alloc=pyramid)",
            scorer="cumulative (prompt)",
            selector="topk+recent",
            allocator="pyramid (MiniKV)",
            store="kivi 2-bit",
            when="prefill-end; then tail flushes",
            options=tuple(
                Option(o.name, "pyramid", o.help, choices=o.choices) if o.name == "alloc" else o
                for o in _MINIKV
            ),
        ),
        Part(
            "xkv",
            "select",
            "XKV: observation-window scores, per-layer budgets by global greedy allocation",
            scorer="window",
            selector="topk+window",
            allocator="xkv",
            when="prefill-end",
            options=_XKV,
        ),
        Part(
            "minicache",
            "select",
            "MiniCache: cross-layer SLERP merge of layer pairs from the middle up, norms per layer",
            store="merged",
            when="prefill-end; decode pairs merged",
            options=_MINICACHE,
        ),
        Part(
            "spindlekv",
            "select",
            "SpindleKV: linear per-layer eviction budgets + per-layer codebooks of K and V",
            scorer="window",
            selector="topk+window (per query head)",
            allocator="spindle",
            store="codebook",
            when="prefill-end; decode tokens coded",
            options=_SPINDLE,
        ),
        Part(
            "kivi2",
            "store",
            "KIVI 2-bit: keys per channel, values per token, fp tail",
            store="kivi",
            when="tail flush",
            options=(Option("bits", 2, "code width (16 = no quantization)", choices=(2, 4, 16)),)
            + _KIVI,
        ),
        Part(
            "kivi4",
            "store",
            "KIVI 4-bit: keys per channel, values per token, fp tail",
            store="kivi",
            when="tail flush",
            options=(Option("bits", 4, "code width (16 = no quantization)", choices=(2, 4, 16)),)
            + _KIVI,
        ),
    ]
}


@dataclass(frozen=True, slots=True)
class KVSpec:
    """A parsed --kv: one selection part and one store part, each with its options."""

    select: Part
    select_opts: dict = field(default_factory=dict)
    store: Part | None = None
    store_opts: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        names = [] if self.select.name == "full" and self.store else [self.select.name]
        return "+".join(names + ([self.store.name] if self.store else []))

    @property
    def is_full(self) -> bool:
        return self.select.name == "full" and self.store is None

    def kivi(self) -> dict | None:
        """The KIVI layout under this recipe {bits, group, residual}, or None for no KIVI store.

        A stacked store part wins; minikv brings 2-bit G16 R128 (quant=kivi2) and minicache
        4-bit under the merge (store=kivi4).
        """
        if self.store is not None:
            return {k: self.store_opts[k] for k in ("bits", "group", "residual")}
        o = self.select_opts
        if self.select.name.startswith("minikv") and o["quant"] == "kivi2":
            return {"bits": 2, "group": o["group"], "residual": o["residual"]}
        if self.select.name == "minicache" and o["store"] == "kivi4":
            return {"bits": 4, "group": o["kivi_group"], "residual": o["kivi_residual"]}
        return None

    def describe(self) -> dict:
        out = {"method": self.name, **self.select_opts}
        if self.store:
            out.update(self.store_opts)
        return out


def parse_kv(text: str) -> KVSpec:
    """Parse --kv; unknown names or options and incompatible stacks raise KvrunError."""
    select: tuple[Part, dict] | None = None
    store: tuple[Part, dict] | None = None
    for raw in text.split("+"):
        name, _, opts_text = raw.strip().partition(":")
        name = name.strip().lower()
        part = PARTS.get(name)
        if part is None:
            raise KvrunError(
                f"unknown KV method {name!r} (available: {', '.join(PARTS)}; see `kvrun kv list`)"
            )
        opts = part.defaults()
        known = {o.name: o for o in part.options}
        for item in filter(None, (s.strip() for s in opts_text.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip()
            if key not in known:
                valid = ", ".join(known) or "none"
                raise KvrunError(f"unknown option {key!r} for {name} (valid: {valid})")
            if not eq:
                raise KvrunError(f"option {name}:{key} needs a value ({key}=...)")
            opts[key] = known[key].parse(name, value.strip())
        slot = (part, opts)
        if part.kind == "select":
            if select is not None:
                raise KvrunError(
                    f"cannot stack two selection methods ({select[0].name} and {name}); "
                    "stack one selection (full, streaming, h2o, snapkv, pyramidkv, xkv, minicache) "
                    "with one store (kivi2/kivi4)"
                )
            select = slot
        else:
            if store is not None:
                raise KvrunError(f"cannot stack two stores ({store[0].name} and {name})")
            store = slot
    sel_part, sel_opts = select or (PARTS["full"], {})
    if store and sel_part.name in OWN_STORE:
        raise KvrunError(
            f"{sel_part.name} cannot be stacked with {store[0].name}: it has its own store "
            f"({OWN_STORE[sel_part.name]})"
        )
    if store and sel_part.when == "every chunk and step" and store[1]["bits"] != 16:
        raise KvrunError(
            f"{sel_part.name}+{store[0].name} is not supported: decode-time eviction cannot remove "
            "single tokens from a quantized body; use snapkv or pyramidkv with a KIVI store"
        )
    spec = KVSpec(sel_part, sel_opts, *(store or (None, {})))
    _check_options(spec)
    return spec


# selection parts that bring their own store; stacking a second one is refused
OWN_STORE = {
    "minikv": "2-bit KIVI; minikv:quant=none for dense, minikv:group=,residual= for its layout",
    "minikv-pyramid": "2-bit KIVI; minikv-pyramid:quant=none for dense",
    "spindlekv": "codebook; spindlekv:codebook=off for dense",
}


def _pool(where: str, text: str) -> None:
    kind, _, k = text.partition(":")
    if text == "none":
        return
    if kind not in ("avg", "max") or not k.isdigit() or int(k) < 1 or int(k) % 2 == 0:
        raise KvrunError(f"{where}={text} is not valid: use none, avg:K or max:K with K odd")


def _check_options(spec: KVSpec) -> None:
    """Cross-option rules: KIVI layouts, pooling, retention and budgets' partners."""
    kv = spec.kivi()
    if kv is not None and kv["bits"] != 16:
        where = spec.store.name if spec.store else spec.select.name
        per_word = 32 // kv["bits"]
        if kv["residual"] % kv["group"]:
            raise KvrunError(
                f"{where}: residual ({kv['residual']}) must be a multiple of group ({kv['group']})"
            )
        if kv["group"] % per_word:
            raise KvrunError(
                f"{where}: group ({kv['group']}) must be a multiple of {per_word} at {kv['bits']} bits"
            )
    o, name = spec.select_opts, spec.select.name
    if name in ("xkv", "spindlekv"):
        _pool(f"{name}:pool", o["pool"])
    if name == "minicache":
        r = o["retain"]
        if r != "range":
            kind, _, f = r.partition(":")
            try:
                ok = kind == "topk" and 0.0 <= float(f) <= 1.0
            except ValueError:
                ok = False
            if not ok:
                raise KvrunError(
                    f"minicache:retain={r} is not valid: use range or topk:F with F in 0..1"
                )


def takes_budget(spec: KVSpec) -> bool:
    """Whether --kv-budget means anything to this recipe (grids run the others once)."""
    return spec.select.name not in ("full", "minicache")


def check_budget(spec: KVSpec, budget) -> None:
    """Reject a --kv-budget the recipe cannot take (below its protected minimum, or none at all)."""
    if budget is None:
        return
    if spec.select.name == "minicache":
        raise KvrunError(
            "minicache has no token budget (it merges layers, it keeps every token); drop "
            "--kv-budget, or stack a store (minicache+kivi4) for more compression"
        )
    if spec.select.name == "xkv" and spec.select_opts["target"] > 0:
        raise KvrunError(
            "xkv:target=R keeps a share of the attention mass and takes no --kv-budget; "
            "give one of them"
        )
    if takes_budget(spec):
        budget.check(protected_tokens(spec), spec.select.name)


def protected_tokens(spec: KVSpec) -> int:
    """P: tokens a selection always keeps (sinks + window), the floor of any budget."""
    s, o = spec.select, spec.select_opts
    if s.name == "streaming":
        return o["sinks"] + 1
    if s.name == "h2o":
        return o["sinks"] + 1
    if s.name == "xkv":  # window + floor (xkv.md, budget mode); the floor alone in context scope
        floor = o["window"] if o["min_tokens"] < 0 else o["min_tokens"]
        return floor + (o["window"] if o["budget_scope"] == "total" else 0)
    if s.scorer == "window":
        return o["window"]
    return 0
