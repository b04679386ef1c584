"""kvrun profile: XKV per-layer budgets planned on sample texts, saved as a reusable profile."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from ..errors import ContextOverflow, KvrunError
from ..kv import check
from ..kv.methods.xkv.profile import (
    Profile,
    check_profile,
    fold_profile,
    load_profile,
    save_profile,
)
from ..progress import progress_bar
from ..run.options import ModelOptions
from .common import dump_json, load_with_progress, model_options, read_text


@click.command()
@model_options
@click.option(
    "-f",
    "--file",
    "files",
    multiple=True,
    required=True,
    metavar="FILE",
    help="A sample text of the task type (raw text, no chat template). Repeat for several.",
)
@click.option(
    "-o",
    "--out",
    required=True,
    metavar="FILE",
    help="Profile JSON to write; an existing profile is extended (running mean).",
)
@click.option(
    "--kv",
    default="xkv",
    show_default=True,
    metavar="METHOD",
    help="xkv with its options (window, pool, min_tokens, plan, target, alloc, budget_scope, "
    "profile_units); a stacked store is ignored.",
)
@click.option(
    "--kv-budget",
    "kv_budget",
    default=None,
    metavar="B",
    help="Mean tokens kept per layer: a fraction of each sample (< 1) or a count. Default 0.2.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the profile JSON instead of the table."
)
def profile(files, out, kv, kv_budget, as_json, model: ModelOptions):
    """Plan XKV's per-layer KV budgets on sample texts and save them as a profile.

    Each sample runs XKV's planning (the scoring pass when it fits one --ubatch, else a
    deferred prefill); its budgets, as fractions of the sample, are folded into the running
    mean in OUT (an existing OUT is extended). Use the profile with
    `--kv xkv:profile=OUT`: generation then skips the scoring pass.

    \b
    kvrun profile -f sample1.txt -f sample2.txt -o legal.json
    kvrun profile -f q1.txt -o qa.json --kv xkv:window=16 --kv-budget 0.1
    kvrun generate -f contract.txt --kv xkv:profile=legal.json --kv-budget 0.2
    """
    spec, budget = _check_kv(kv, kv_budget)
    texts = [read_text(f) for f in files]
    o = spec.select_opts
    units = o["profile_units"]
    out_path = Path(out)
    if not out_path.absolute().parent.is_dir():
        raise KvrunError(f"cannot write -o {out}: its folder does not exist")
    old = load_profile(out_path) if out_path.exists() else None
    if old is not None:  # shape checks that need no model; n_layers and model come after loading
        check_profile(old, out, old.n_layers, "", o["window"], o["pool"], units)
    from ..kv import build  # torch, once the input is known to be good

    rt = load_with_progress(model)
    if old is not None:
        check_profile(old, out, rt.config.n_layers, rt.config.name, o["window"], o["pool"], units)
    # planning only: no profile of its own, no store
    plain = dataclasses.replace(
        spec, select=spec.select.replace(profile="", profile_update=False), store=None
    )
    kv_mgr = build(plain, rt.config, rt.model.rope, rt.model.device, rt.model.dtype)
    session = model.session(rt, kv_mgr)
    samples = []
    for f, text in zip(files, texts, strict=True):
        ids = rt.tokenizer.encode(text)
        try:
            session.check_fits(len(ids))
        except ContextOverflow as e:
            raise ContextOverflow(f"{f}: {e}") from None
        samples.append(ids)
    values, lengths = [], []
    prof = old
    with progress_bar("profiling", quiet=model.quiet) as bar:
        task = bar.add_task("profiling", total=len(samples))
        for ids in samples:
            a = _plan(session, kv_mgr, ids)
            v = [n / a.t if units == "fractions" else float(n) for n in a.n]
            prof = fold_profile(
                prof, v, model=rt.config.name, window=o["window"], pool=o["pool"], units=units
            )
            values.append(v)
            lengths.append(len(ids))
            bar.advance(task)
    save_profile(out_path, prof)
    if as_json:
        dump_json(prof.to_json())
    else:
        Console(highlight=False).print(_table(prof, values, lengths, o["window"]))
    click.echo(
        _summary(prof, out, len(samples), lengths, o["window"], budget, o["target"]), err=True
    )


def _check_kv(text: str, kv_budget: str | None):
    """The validated --kv (xkv only) and --kv-budget, checked before the model loads."""
    spec = check(text, kv_budget)  # also refuses xkv:target=R with a budget
    if spec.select.name != "xkv":
        raise KvrunError(
            f"kvrun profile plans XKV budgets: --kv must be xkv[:options], not {spec.name}"
        )
    if spec.select_opts["profile"]:
        raise KvrunError("give the profile file with -o FILE, not xkv:profile=")
    return spec, spec.budget


def _plan(session, kv, ids: list[int]):
    """XKV's allocation for one sample (session: a Session over kv, an XKV): the scoring
    pass alone when the sample fits one --ubatch (plan=two-pass), else a deferred prefill
    (allocation at its end)."""
    import torch

    with torch.inference_mode():
        session.reset()
        session.plan(ids, "before")
        if kv.allocation is None:
            session.prefill(ids)
        a = kv.allocation
        session.reset()
    return a


def _table(prof: Profile, values: list[list[float]], lengths: list[int], window: int) -> Table:
    """Per layer: budget at the samples' mean length (window included), the profile's value,
    min/max over this run's samples."""
    frac = prof.units == "fractions"
    mean_t = sum(lengths) / len(lengths)
    name = "fraction" if frac else "tokens"
    t = Table(title=f"XKV profile ({prof.count} samples in all)", title_justify="left")
    for col in ("layer", f"budget @ {mean_t:.0f} tok", f"{name} (mean)", "min", "max"):
        t.add_column(col, justify="right")
    fmt = "{:.4f}" if frac else "{:.1f}"
    for i, v in enumerate(prof.values):
        col = [s[i] for s in values]
        tokens = (v * mean_t if frac else v) + window
        t.add_row(
            str(i), f"{tokens:.0f}", fmt.format(v), fmt.format(min(col)), fmt.format(max(col))
        )
    return t


def _summary(
    prof: Profile, out, n_new: int, lengths: list[int], window: int, budget, target
) -> str:
    mean_t = sum(lengths) / len(lengths)
    frac = prof.units == "fractions"
    tok = [(v * mean_t if frac else v) + window for v in prof.values]
    lo, hi = min(range(len(tok)), key=tok.__getitem__), max(range(len(tok)), key=tok.__getitem__)
    how = f"target {target}" if target > 0 else f"budget {budget or '0.2'}"
    return (
        f"profile {out}: {n_new} sample(s) added, {prof.count} in all; {how}; at {mean_t:.0f} "
        f"tokens layers keep {tok[lo]:.0f} (layer {lo}) to {tok[hi]:.0f} (layer {hi}), "
        f"mean {sum(tok) / len(tok):.1f} tokens"
    )
