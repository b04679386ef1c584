"""Running kvrun perplexity on a loaded model: the sessions (the method's and the full-cache
reference's), the windows under a progress bar, and the run's settings. The CLI
(kvrun.cli.perplexity) reads the file before and prints the report after."""

from __future__ import annotations

from ..progress import progress_bar
from ..run.options import ModelOptions
from .perplexity import Report, evaluate


def run_windows(rt, spec, model: ModelOptions, tokens: list[int], context: int,
                eval_tokens: int, windows: int, parallel: int) -> tuple[Report, dict, dict, bool]:  # fmt: skip
    """Score `windows` windows of `tokens` through the method `spec` (with `parallel` windows
    per decode step). Returns (report, the method's cache described, the settings the output
    repeats (less "file" and "kv_budget"), whether a full-cache reference ran beside it)."""

    def pair():
        """A session through the method, and one through the full cache in the model's dtype
        (None where the method is that cache: --kv full --kv-dtype of the model's)."""
        kv = rt.new_kv(spec)
        exact = spec.is_full and kv.kv_type is None
        return model.session(rt, kv), None if exact else model.session(rt, rt.new_kv())

    method, ref = pair()
    more = [pair() for _ in range(min(parallel, windows) - 1)]
    tok = rt.tokenizer
    bos = tok.bos_id if tok.add_bos else None
    with progress_bar("perplexity", quiet=model.quiet) as bar:
        task = bar.add_task(f"window 1/{windows}", total=windows * (context + eval_tokens))

        def on_window(w):
            bar.update(task, description=f"window {min(w.index + 2, windows)}/{windows}")

        report = evaluate(
            method,
            ref,
            tokens,
            context,
            eval_tokens,
            windows,
            bos_id=bos,
            step=lambda n: bar.advance(task, n),
            on_window=on_window,
            more=more,
        )
    settings = {
        "context": context,
        "eval_tokens": eval_tokens,
        "windows": windows,
        "bos": bos is not None,
        "ctx_size": method.context,
        "ubatch": method.ubatch,
        "dtype": str(rt.model.dtype).removeprefix("torch."),
        "wtype": rt.weights.wtype,
        "device": str(rt.model.device),
    }
    return report, method.kv.describe(), settings, ref is not None
