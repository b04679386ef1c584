"""DuoAttention's calibration, on the CPU in minutes: pass-key texts (a key hidden in the text,
asked for at the end) run once through the model with full attention; in every layer each KV
head's query heads also attend as a streaming head would (the first `sinks` and the newest
`window` keys), and the head scores the relative error that makes in its attention output over
the question-and-answer rows. The heads whose output suffers most are the retrieval heads.

DuoAttention instead trains a gate per head (full vs streaming attention mixed, an L1 penalty on
the gates) to keep the last hidden states on the answer; this measures the same harm one head
at a time, at the head's own output, with no training (docs/methods/duo.md)."""

from __future__ import annotations

import random

import torch

from ... import calib
from ...attention import sdpa
from ...protocol import KVManager

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is {key}."


def stream_error(q, k, v, sinks: int, window: int, rows: int, sliding: int | None) -> torch.Tensor:
    """(Hkv,) the relative squared error each KV head's query heads make over the last `rows`
    rows when they attend only to the first `sinks` and the newest `window` keys (q (1, Hq, T, D),
    k and v (1, Hkv, T, D) post-RoPE, one causal chunk)."""
    T, Hkv, Hq = k.shape[2], k.shape[1], q.shape[1]
    i = torch.arange(T, device=q.device)[:, None]
    j = torch.arange(T, device=q.device)[None, :]
    full = j <= i
    if sliding:
        full &= j > i - sliding
    stream = full & ((j < sinks) | (j > i - window - 1))  # as DuoCache holds: sinks + window + self
    o_full = sdpa(q, k, v, full)[0, :, -rows:].float()  # (Hq, rows, D)
    o_str = sdpa(q, k, v, stream)[0, :, -rows:].float()
    err = (o_full - o_str).pow(2).sum((1, 2)) / o_full.pow(2).sum((1, 2)).clamp_min(1e-12)
    return err.view(Hkv, Hq // Hkv).mean(1)


class Probe(KVManager):
    """A one-chunk prefill with full attention that adds each KV head's streaming error."""

    name = "duo-calibration"

    def __init__(self, config, rope, device, dtype, sinks: int, window: int, rows: int):
        super().__init__(config, rope, device, dtype)
        self.sinks, self.window, self.rows = sinks, window, rows
        self.err = torch.zeros(config.n_layers, config.n_kv_heads)

    def prefill(self, layer, q, k, v, positions):
        sw = self.config.window(layer)
        e = stream_error(q, k, v, self.sinks, self.window, self.rows, sw)
        self.err[layer] += e.cpu()
        T = k.shape[2]
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        mask = (j <= i) & ((j > i - sw) if sw else True)
        return sdpa(q, k, v, mask.to(q.device)).to(self.dtype)

    def nbytes(self) -> int:
        return 0


def passkey_texts(tokenizer, bodies: list[str], length: int, count: int, seed: int = 0):
    """`count` pass-key samples (ids, rows asked) of about `length` tokens: a random 5-digit key
    at depths spread over the text, the question and its answer at the end."""
    rng = random.Random(seed)
    ids = [t for b in bodies for t in tokenizer.encode(b, add_bos=False, special=False)]
    bos = tokenizer.encode("x")[:1]
    bos = bos if bos and bos[0] == tokenizer.bos_id else []
    out = []
    for n in range(count):
        key = rng.randrange(10000, 100000)
        needle = tokenizer.encode(NEEDLE.format(key=key), add_bos=False, special=False)
        ask = tokenizer.encode(QUESTION.format(key=key), add_bos=False, special=False)
        a = rng.randrange(0, max(1, len(ids) - length))
        hay = ids[a : a + max(16, length - len(needle) - len(ask))]
        at = int(len(hay) * (n + 0.5) / count)  # depths spread over the samples
        out.append((bos + hay[:at] + needle + hay[at:] + ask, len(ask)))
    return out


def calibrate(model, tokenizer, bodies, length: int, count: int, sinks: int, window: int):
    """(L, Hkv) mean streaming error of each KV head over the pass-key samples."""
    total = torch.zeros(model.config.n_layers, model.config.n_kv_heads)
    for ids, rows in passkey_texts(tokenizer, bodies, length, count):
        kv = Probe(model.config, model.rope, model.device, model.dtype, sinks, window, rows)
        kv.begin_prefill(len(ids))
        model(
            torch.tensor([ids], device=model.device),
            torch.arange(len(ids), device=model.device),
            kv,
        )
        kv.end_chunk(len(ids))
        kv.end_prefill()
        total += kv.err
    return total / count


def save(scores: torch.Tensor, config, model_file, meta: dict) -> str:
    where = calib.entry("duo", config, model_file)
    calib.save(where, {"scores": scores}, {"method": "duo", **meta})
    return str(where)
