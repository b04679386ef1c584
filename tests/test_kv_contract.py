"""The KV manager contract, checked for every method in the registry (kvrun/kv/methods/).

A method is tested here the moment it is registered: its declared options parse their own
defaults, a budget covering every token under its `lossless` options reproduces the full
cache, its default settings hold fewer bytes than the full cache and report them as JSON,
where it has a static decode form (CUDA graphs) the static step equals the eager one,
its stored bytes equal its spec's byte formula (with every store it stacks with), and three
sequences of different lengths decoded as one batch (kvrun.run.step: a store per
(sequence, layer)) give what three single runs give.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_kv_methods import drive, new_kv, prompt, tiny

from kvrun.errors import KvrunError
from kvrun.kv import REGISTRY, build, check
from kvrun.run.session import Session

pytestmark = pytest.mark.usefixtures("one_thread")

SELECT = [m for m in REGISTRY.values() if m.kind == "select"]
STORES = [m for m in REGISTRY.values() if m.kind == "store"]
N, UBATCH, DECODE = 80, 32, 6  # a prompt of three chunks, then decode steps
COVER = "4096"  # a budget above every length here: nothing needs to go


def _adaptive(m) -> bool:
    """Whether the method offers scope=adaptive (AdaKV's head-adaptive budgets)."""
    return any(o.name == "scope" and "adaptive" in o.choices for o in m.options)


# every selection at its defaults, and each that offers it at scope=adaptive (heads padded)
ADAPTIVE = [m for m in SELECT if _adaptive(m)]
CASES = [pytest.param(m, m.name, id=m.name) for m in REGISTRY.values()] + [
    pytest.param(m, f"{m.name}:scope=adaptive", id=f"{m.name}:scope=adaptive") for m in ADAPTIVE
]
# CriticalKV's refinement (critical=1, the model's W_o lent to the cache), per head and adaptive
CRITICAL = ["knorm:critical=1", "kvzip:critical=1", "snapkv:scope=adaptive,critical=1"]
CRITICAL += ["h2o:scope=adaptive,critical=1"]
CASES += [pytest.param(REGISTRY[t.partition(":")[0]], t, id=t) for t in CRITICAL]
SELECT_CASES = [c for c in CASES if c.values[0].kind == "select"]


def _with(name: str, opts: str) -> str:
    return f"{name}:{opts}" if opts else name


def _lossless(m) -> str:
    """The method's lossless form as --kv text (a store alone runs over `full`)."""
    return _with(m.name, m.lossless)


@pytest.mark.parametrize("m", REGISTRY.values(), ids=lambda m: m.name)
def test_declaration(m):
    """Options round-trip through their own parser; the axes and summary are filled in; a
    selection's protected tokens fit its default budget's floor."""
    assert m.summary and m.kind in ("select", "store")
    for o in m.options:
        assert o.parse(m.name, str(o.default)) == o.default, o.name
    spec = check(m.name)
    assert spec.name == m.name and spec.describe()["method"] == m.name
    assert spec.protected >= 0
    if m.kind == "select" and m.takes_budget:
        # an absolute budget below the protected floor is refused in one line
        if spec.protected > 1:
            with pytest.raises(KvrunError, match="protected minimum"):
                check(m.name, str(spec.protected - 1))
        check(m.name, str(max(spec.protected, 1)))
    elif m.kind == "select" and m.budget_refused:
        with pytest.raises(KvrunError):
            check(m.name, "0.5")


@pytest.mark.parametrize("m,text", CASES)
def test_budget_covering_everything_equals_full(m, text):
    """Under its lossless options, a budget that covers every token keeps every token and
    gives the full cache's logits (prefill in chunks, then decode steps)."""
    model = tiny()
    ids = prompt(N, seed=3)
    ref = drive(model, new_kv(model, "full"), ids, UBATCH, n_decode=DECODE)
    # a covering budget where the method runs at one by default; the others (MiniKV: the
    # prompt's heavy and recent fractions) cover everything through their lossless options
    budget = COVER if m.kind == "select" and m.default_budget else None
    lossless = text if text != m.name else _lossless(m)
    kv = new_kv(model, lossless, budget)
    toks = ref[N - 1 : -1].argmax(-1).tolist()  # the full cache's greedy tokens
    out = drive(model, kv, ids, UBATCH, n_decode=DECODE, tokens=toks)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    if hasattr(kv, "kept_counts"):
        # a layer with a sliding window (Gemma 3's local ones) holds at most the window (the
        # ring: what the next query sees and the slot its token takes); MiniKV, MiniCache and
        # DuoAttention bound their own to what the next query sees
        c = model.config
        own = getattr(kv, "local", None) or m.name in ("minicache", "duo") or None

        def held(i: int) -> int:
            if not c.window(i):
                return N + DECODE
            return c.window(i) - 1 if own is not None else min(N + DECODE, c.window(i))

        assert kv.kept_counts() == [held(i) for i in range(c.n_layers)]


@pytest.mark.parametrize("m,text", [c for c in CASES if c.values[0] in SELECT + STORES])
def test_default_settings_compress_and_report(m, text):
    """At its defaults (budget 0.2 where it takes one) a method holds fewer bytes than the
    full cache after a prompt and decode steps, and describes itself as JSON."""
    model = tiny()
    kv = new_kv(model, text)
    drive(model, kv, prompt(300, seed=4), 128, n_decode=DECODE)
    full = kv.nbytes_full()
    assert full == (300 + DECODE) * model.config.kv_bytes_per_token(4)
    if m.name == "full" and not model.config.any_window:
        assert kv.nbytes() == full
    else:
        assert 0 < kv.nbytes() < full, (kv.nbytes(), full)
    d = kv.describe()
    assert d["method"] == m.name
    json.dumps(d)


def _stacks() -> list[str]:
    """Every selection alone and with every store it stacks with (`full+kivi2` is `kivi2`)."""
    out = []
    for sel in SELECT:
        out.append(sel.name)
        for store in STORES:
            try:
                out.append(check(f"{sel.name}+{store.name}").name)
            except KvrunError:
                pass
    return out + [f"{m.name}:scope=adaptive" for m in ADAPTIVE] + CRITICAL


@pytest.mark.parametrize(
    "text", ["kivi2", "snapkv+kivi4", "minikv", "xkv+kivi2", "minicache+kivi4"]
)
def test_nbytes_equals_the_spec_formula_f16_scales(text):
    """The same under --kv-dtype f16 (the CPU's default): KIVI's scales and zeros and its tail
    in float16 (the formula's s = t = 2; the model's e = 4), as the spec's fp16 tail."""
    model = tiny()
    spec = check(f"{text}:residual=32").with_dtype("f16")
    kv = build(spec, model.config, model.rope, "cpu", torch.float32)
    held = [st.kivi for st in getattr(kv, "layers", ()) if st.kivi is not None]
    held += [p.kivi for p in getattr(kv, "pairs", ()) if p.kivi is not None]
    assert held and all(k.scale_dtype == k.tail_dtype == torch.float16 for k in held)

    def after(point):
        if point != "chunk":
            assert kv.nbytes() == spec.select.nbytes(kv), (point, kv.seen)

    drive(model, kv, prompt(150, seed=7), 64, n_decode=20, after=after)


@pytest.mark.parametrize("text", _stacks())
def test_nbytes_equals_the_spec_formula(text):
    """nbytes() (the stored tensors' sizes) equals the selection's declared byte formula
    (Method.nbytes, from counts only) after each prefill and decode step, over two turns;
    KIVI residual 32 so that the tail flushes during the run."""
    model = tiny()
    spec = check(text)
    if spec.kivi() is not None:  # a short residual: flushes happen within a few steps
        spec = check(text := f"{text}:residual=32")
    formula = spec.select.nbytes
    kv = new_kv(model, text)
    seen = []

    def after(point):
        if point != "chunk":  # between calls: at compression points (baselines.md 0.6)
            assert kv.nbytes() == formula(kv), (point, kv.seen)
            seen.append(kv.nbytes())

    drive(model, kv, prompt(150, seed=7), 64, n_decode=20, after=after)
    drive(model, kv, prompt(40, seed=8), 64, n_decode=20, after=after)
    assert seen[-1] > 0


def _static_specs() -> list[str]:
    """Every registered method (and each store under full) whose manager decodes statically."""
    model = tiny()
    out = []
    for m in REGISTRY.values():
        kv = new_kv(model, m.name)
        if kv.static_unsupported() is None:
            out.append(m.name)
    return out


@pytest.mark.parametrize("spec", _static_specs())
def test_static_step_equals_eager(spec):
    """The static decode step (what a CUDA graph captures, run here without capture) gives
    the eager step's logits for every token, across a later chat turn."""
    model = tiny()
    outs = {}
    for mode in ("off", "static"):
        s = Session(model, None, new_kv(model, spec), ubatch=UBATCH, graph=mode)
        logits = [s.prefill(prompt(N, seed=5))]
        for t in range(DECODE):
            logits.append(s.decode(t + 7))
        logits.append(s.prefill(prompt(20, seed=6)))
        for t in range(DECODE):
            logits.append(s.decode(t + 9))
        outs[mode] = torch.stack(logits)
    torch.testing.assert_close(outs["static"], outs["off"], rtol=1e-4, atol=1e-4)


def test_every_method_is_stackable_or_says_why():
    """Each selection either stacks with each store or refuses in one line naming both."""
    for sel in SELECT:
        for store in STORES:
            text = f"{sel.name}+{store.name}"
            try:
                spec = check(text)
            except KvrunError as e:
                assert sel.name in str(e) and store.name in str(e), str(e)
                continue
            assert type(spec.store) is store and type(spec.select) is sel
            assert spec.name == (store.name if sel.name == "full" else text)


@pytest.mark.parametrize("m,text", CASES)
def test_batch_of_three_equals_three_single_runs(m, text):
    """B = 3: three prompts of different lengths, each prefilled alone, then decode steps
    with the three tokens in one forward pass (Session.decode_batch). Logits, kept bytes and
    lengths equal three B = 1 runs (up to the float reordering of a 3-row product)."""
    model = tiny()
    prompts = [prompt(n, seed=10 + n) for n in (50, 71, 90)]
    budget = "0.5" if m.kind == "select" and m.takes_budget else None

    def session():
        return Session(model, None, new_kv(model, text, budget), ubatch=UBATCH)

    singles, batch = [], [session() for _ in prompts]
    for p in prompts:
        s = session()
        logits = [s.prefill(p)]
        for _ in range(DECODE):
            logits.append(s.decode(int(logits[-1].argmax())))
        singles.append((s, torch.stack(logits)))
    logits = [torch.stack([s.prefill(p) for s, p in zip(batch, prompts, strict=True)])]
    for _ in range(DECODE):
        logits.append(Session.decode_batch(batch, logits[-1].argmax(-1).tolist()))
    got = torch.stack(logits, dim=1)  # (3, 1 + DECODE, V)
    for b, (s, want) in enumerate(singles):
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)
        assert batch[b].tokens == s.tokens
        assert batch[b].kv.nbytes() == s.kv.nbytes()


@pytest.mark.parametrize("m,text", SELECT_CASES)
def test_stores_follow_the_store_protocol(m, text):
    """Every per-layer store a method's cache holds (alone and stacked on each store) has the
    Store protocol's parts (kvrun/kv/protocol.py), and its partials, merged by log-sum-exp,
    are finite attention outputs over what it holds. (FullKV and MiniCache's dense pairs
    hold no per-layer stores: KVCache.stores says why.)"""
    from kvrun.kv.attention import combine
    from kvrun.kv.protocol import Store

    model = tiny()
    texts = [text] + [f"{text}+{s.name}" for s in STORES]
    for text in texts:
        try:
            check(text)
        except KvrunError:
            continue  # a stack the method refuses (checked in test_every_method_is_stackable)
        kv = new_kv(model, text, None)
        drive(model, kv, prompt(N, seed=5), UBATCH, n_decode=2)
        c = model.config
        q = torch.randn(1, c.n_heads, 1, c.head_dim)
        stores = kv.stores()
        held = sum(s.nbytes() for s in stores)  # the rest: window queries, unpaired buffers
        assert (held > 0 or not stores) and held <= kv.nbytes(), text
        for store in stores:
            assert isinstance(store, Store), (text, type(store).__name__)
            if not store.length:  # a staging segment emptied into its stack's store
                continue
            with torch.inference_mode():  # as the model runs (scratch buffers are inference)
                parts = store.partials(q, torch.tensor([kv.seen]), 0, None)
            out = combine(parts, torch.float32)
            assert out.shape == q.shape and torch.isfinite(out).all(), text


# KVzap fits its scorers to KVzip's scores and selects as KVzip does (docs/methods/kvzap.md)
DERIVED = {"kvzip": ("kv/methods/kvzap", "cli/calibrate.py")}


@pytest.mark.parametrize("name", ["tova", "knorm", "kvzip", "keydiff", "expected_attention"])
def test_a_scoring_method_lives_in_its_own_files(name):
    """TOVA, KNorm, KVzip, KeyDiff and Expected Attention were added as one module each plus
    the registry line: their names appear nowhere else in kvrun/ (a method is one place to
    read)."""
    from pathlib import Path

    import kvrun

    root = Path(kvrun.__file__).parent
    own = [root / "kv" / "methods" / f"{name}.py", root / "kv" / "methods" / name]
    own += [root / p for p in DERIVED.get(name, ())]  # a method built on it, and its fit
    registry = root / "kv" / "methods" / "__init__.py"
    hits = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if name in p.read_text(encoding="utf-8").lower()
        and p != registry
        and not any(p == o or o in p.parents for o in own)
    ]
    assert not hits, hits


@pytest.mark.parametrize(
    "old,new",
    [
        ("tova:heads=kv", "tova:scope=head"),
        ("tova:heads=layer", "tova:scope=layer"),
        ("kvzip:heads=uniform", "kvzip:scope=head"),
        ("kvzip:heads=layer", "kvzip:scope=layer"),
        ("xkv:select=layer", "xkv:scope=layer"),
        ("minicache:granularity=token", "minicache:scope=layer"),
        ("minicache:granularity=head", "minicache:scope=head"),
    ],
)
def test_older_spellings_of_scope_are_accepted(old, new):
    """The per-head / per-layer choice is `scope` everywhere; the older option names (and
    values) still parse, to the same spec, for one release."""
    assert check(old) == check(new)
    assert "scope" in check(old).describe()


def test_a_method_is_a_class_whose_options_are_fields():
    """A configured method reads its options as attributes, fixed once parsed; the class
    holds the declarations; derived values follow the options."""
    spec = check("snapkv:window=64,kernel=5")
    sel = spec.select
    assert (sel.window, sel.kernel, sel.pool) == (64, 5, "max")
    assert type(sel).window.default == 32 and [o.name for o in type(sel).options][:2] == [
        "window",
        "kernel",
    ]
    assert sel.protected == 64 and sel.queries == 64 and sel.points == {"prefill"}
    assert check("snapkv:chunked=true").select.points == {"prefill", "chunk"}
    with pytest.raises(AttributeError):
        sel.window = 8
    assert sel.replace(window=8).window == 8 and sel.window == 64
    with pytest.raises(TypeError, match="no option"):
        type(sel)(windw=8)
    assert check("h2o:sinks=3").select.protected == 4  # sinks + the newest token
    assert check("h2o", "100").select.kept_recent(100) == 50


@pytest.mark.parametrize("m,text", CASES)
def test_a_fork_goes_on_as_the_original_and_apart_from_it(m, text):
    """kv.fork() after a compressed prompt: the fork and the original, each fed the same
    next turn and decode steps, give the same logits bit for bit and hold the same bytes,
    and feeding the fork changes nothing the original holds (a kept prefix, one compressed
    document asked many questions)."""
    model = tiny()
    kv = new_kv(model, text)
    drive(model, kv, prompt(150, seed=3), 64, n_decode=3)
    held, seen = kv.nbytes(), kv.seen
    fork = kv.fork()
    assert fork.rope is kv.rope and fork.config is kv.config
    b = drive(model, fork, prompt(20, seed=4), 64, n_decode=DECODE)
    assert (kv.nbytes(), kv.seen) == (held, seen)  # the original untouched by the fork's turn
    a = drive(model, kv, prompt(20, seed=4), 64, n_decode=DECODE)
    assert torch.equal(a, b)
    assert kv.nbytes() == fork.nbytes() and kv.seen == fork.seen


@pytest.mark.parametrize("m", ADAPTIVE, ids=lambda m: m.name)
def test_adaptive_scope_is_refused_on_a_store_and_holds_uneven_heads(m):
    """scope=adaptive (docs/methods/adaptive.md) refuses every store in one line naming both
    (a KIVI body cannot mask padding); alone, its heads hold different counts of tokens
    somewhere in the tiny model, and a layer's tokens are Hkv * B_l at the prefill end."""
    text = f"{m.name}:scope=adaptive"
    for store in STORES:
        with pytest.raises(KvrunError, match=f"{m.name}.*{store.name}"):
            check(f"{text}+{store.name}")
    model = tiny()
    c = model.config
    counts = {}

    def hook(layer, point, positions):  # the last report: the prefill's end (h2o: last chunk)
        counts[layer] = [int((r >= 0).sum()) for r in positions]

    kv = new_kv(model, text, "0.6", hook)  # above snapkv's window of 32: something to choose
    drive(model, kv, prompt(120, seed=9), 32)
    spec = check(text, "0.6")
    Bl = spec.select.budgets(spec.budget.tokens(120, spec.protected), 120, c.n_layers)
    assert sorted(counts) == list(range(c.n_layers))
    assert all(sum(counts[i]) == c.n_kv_heads * Bl[i] for i in counts), (Bl, counts)
    assert any(len(set(r)) > 1 for r in counts.values()), counts
