"""kvrun calibrate: fit a KV method's per-model calibration (KVzap's scorers, DuoAttention's
head pattern) and keep it in the model cache, where `--kv kvzap` / `--kv duo` find it."""

from __future__ import annotations

from importlib import resources

import click

from ..errors import KvrunError
from ..run.options import ModelOptions
from .common import dump_json, load_with_progress, model_options, read_text


def _shipped() -> str:
    """The calibration text shipped with kvrun (prompts/calibration.txt): prose, code, lists,
    numbers, a table, French and German, so one fit sees several kinds of text."""
    return resources.files("kvrun.prompts").joinpath("calibration.txt").read_text()


def _samples(tokenizer, texts: list[str], length: int) -> list[list[int]]:
    """Each text's tokens cut into pieces of `length` (BOS first where the model has one)."""
    out = []
    bos = tokenizer.encode("x")[:1]  # the BOS the model adds to a prompt, if any
    bos = bos if bos and bos[0] == tokenizer.bos_id else []
    for text in texts:
        ids = tokenizer.encode(text, add_bos=False, special=False)
        for a in range(0, len(ids), length):
            piece = ids[a : a + length]
            if len(piece) >= min(length, 64):
                out.append(bos + piece)
    return out


@click.command()
@model_options
@click.argument("method", type=click.Choice(["kvzap", "duo"]))
@click.option(
    "--text",
    "texts",
    multiple=True,
    metavar="FILE",
    help="Text to calibrate on (repeat for several); default: the text shipped with kvrun.",
)
@click.option(
    "--held-out",
    "held_out",
    default=None,
    metavar="FILE",
    help="kvzap: text the fit does not see, to report the scorers' rank correlation with KVzip.",
)
@click.option("--length", default=512, show_default=True, help="Tokens per sample.")
@click.option(
    "--hidden",
    default=0,
    show_default=True,
    help="kvzap: also fit a one-hidden-layer MLP of this width (kvzap:scorer=mlp); 0: linear only.",
)
@click.option("--json", "as_json", is_flag=True, help="Print what was kept as JSON.")
def calibrate(method, texts, held_out, length, hidden, as_json, model: ModelOptions):
    """Fit METHOD's calibration of a model once and keep it in the model cache.

    \b
    kvzap: a scorer per layer predicting KVzip's scores (log) from the layer's Q, K, V,
           fitted on KVzip's scores of the text (ridge regression; --hidden: an MLP too).
    duo:   each KV head's output error when made a streaming head, on pass-key texts;
           the least harmed become streaming heads (--kv-budget: the share kept whole).

    \b
    kvrun calibrate kvzap
    kvrun calibrate kvzap --text my_docs.txt --hidden 64
    kvrun generate -f doc.txt --kv kvzap --kv-budget 0.3
    kvrun calibrate duo
    kvrun generate -f doc.txt --kv duo --kv-budget 0.5
    """
    if length < 16:
        raise KvrunError(f"--length {length}: give at least 16 tokens per sample")
    if hidden < 0:
        raise KvrunError(f"--hidden {hidden}: give 0 (linear only) or a width")
    bodies = [read_text(f) for f in texts] or [_shipped()]
    other = read_text(held_out) if held_out else None
    rt = load_with_progress(model)
    import torch

    with torch.inference_mode():
        if method == "kvzap":
            report = _kvzap(rt, bodies, other, length, hidden, model.ubatch)
        else:
            report = _duo(rt, bodies, length)
    if as_json:
        dump_json(report)
    else:
        click.echo(report["line"], err=True)


def _kvzap(rt, bodies, other, length, hidden, ubatch) -> dict:
    from ..kv.methods.kvzap import fit as kvzap_fit
    from ..run.session import Session

    samples = _samples(rt.tokenizer, bodies, length)
    held = _samples(rt.tokenizer, [other], length) if other else None

    def prefill(kv, ids):
        return Session(rt.model, rt.tokenizer, kv, ubatch=ubatch).prefill(ids)

    f = kvzap_fit.fit(rt.model, prefill, samples, held, hidden=hidden)
    where = kvzap_fit.save(f, rt.config, rt.path)
    on = "held-out" if held else "training"
    rho = ", ".join(f"{k} {v:.3f}" for k, v in f.rho.items())
    line = (
        f"kvzap calibration kept in {where}: {len(samples)} samples, {f.train_tokens} tokens; "
        f"rank correlation with KVzip's scores on the {on} text: {rho}"
    )
    return {"method": "kvzap", "path": where, "tokens": f.train_tokens, "rho": f.rho, "line": line}


def _duo(rt, bodies, length) -> dict:
    from ..kv import check
    from ..kv.methods.duo import calibrate as duo_cal

    o = check("duo").select_opts  # the streaming heads' defaults
    n = 8  # samples: depths spread over the text
    scores = duo_cal.calibrate(rt.model, rt.tokenizer, bodies, length, n, o["sinks"], o["window"])
    meta = {"sinks": o["sinks"], "window": o["window"], "samples": n, "length": length}
    where = duo_cal.save(scores, rt.config, rt.path, meta)
    flat = scores.flatten().sort(descending=True).values
    half = float(flat[len(flat) // 2])
    line = (
        f"duo calibration kept in {where}: {n} pass-key samples of {length} tokens; streaming "
        f"error per KV head from {float(flat[-1]):.3g} to {float(flat[0]):.3g} (median {half:.3g})"
    )
    return {"method": "duo", "path": where, "scores": scores.tolist(), "line": line}
