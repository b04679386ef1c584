"""Running kvrun ruler: every (task, sample) x KV config on this process's model or on Ray workers
(kvrun.run.cluster), one JSON line per answer appended to --out as it comes (resumable), and the
per-task scores of every config."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import KvrunError
from ..kv import check
from ..run.options import KVGridOptions, ModelOptions, RayOptions
from . import needle as nd
from . import ruler as ru
from .trials import Trial, run_trials

# what a --resume'd file must share with this run for its lines to count
SAME = ("model", "length", "seed", "chat", "question_after")


@dataclass(frozen=True)
class RulerOptions:
    """What the command line asks, known before a model loads."""

    tasks: list[str]
    length: int
    samples: int
    seed: int
    chat: bool | None  # None: the chat template where the model has one
    question_after: bool
    parallel: int

    def generator(self, rt) -> ru.Generator:
        chat = self.chat if self.chat is not None else rt.tokenizer.chat_template is not None
        return ru.Generator(ru.prompt_form(rt.tokenizer, chat), self.length, self.seed)

    def check_context(self, context: int) -> None:
        if self.length > context:
            raise KvrunError(
                f"--length {self.length} is larger than the context of {context} tokens "
                "(the model's, or -c)"
            )


def configs_of(kv: KVGridOptions) -> list[nd.KvConfig]:
    """--kv x --kv-budget, validated (a bad method or budget costs no model load)."""
    return nd.kv_configs([(m, check(m).with_dtype(kv.dtype)) for m in kv.methods], kv.budgets)


def key(rec: dict) -> tuple:
    return rec["task"], rec["index"], rec["method"], rec["budget"]


def read_done(path: Path, resume: bool, settings: dict) -> list[dict]:
    """The records already in OUT (with --resume; OUT is rewritten without a half-written last
    line); without --resume OUT must be empty or absent."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise KvrunError(f"cannot read --out {path}: {e.strerror}") from None
    if not resume:
        if raw.strip():
            raise KvrunError(f"{path} already holds results; pass --resume to continue it")
        return []
    done, keep = [], []
    for line in raw.split(b"\n"):
        try:
            rec = json.loads(line)
            key(rec)
        except (ValueError, KeyError, TypeError):
            continue  # blank, or cut by an interrupt
        other = [k for k in SAME if rec.get(k) != settings[k]]
        if other:
            k = other[0]
            raise KvrunError(
                f"--resume: {path} was made with {k} {rec.get(k)!r}, this run has "
                f"{settings[k]!r}; give another --out"
            )
        done.append(rec)
        keep.append(line + b"\n")
    if b"".join(keep) != raw:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(b"".join(keep))
        os.replace(tmp, path)
    return done


def record(sample: ru.Sample, cfg: nd.KvConfig, r, settings: dict) -> dict:
    """One answer's JSON line: the run's settings, the sample, the reply, its score, stats."""
    return {
        **{k: settings[k] for k in SAME},
        "task": sample.task,
        "index": sample.index,
        "method": cfg.method,
        "budget": cfg.budget,
        "kvpress_ratio": ru.kvpress_ratio(cfg.budget, cfg.spec),
        "answers": sample.answers,
        "reply": r.text,
        "score": ru.score(sample.task, r.text, sample.answers),
        **r.stats.as_dict(),
    }


def trials(gen: ru.Generator, todo, configs, question_after: bool, on_start=None):
    """Trial per (task, index, config index) in `todo`, its sample built once for its configs."""
    last = None
    for task, index, c in todo:
        if last is None or (last.task, last.index) != (task, index):
            last = gen.sample(task, index)
        ctx, q = gen.form.ids(last.context, last.question, last.answer_prefix)
        ids, question = (ctx, q) if question_after else (ctx + q, None)
        if on_start:
            on_start(task, index, configs[c])
        label = f"ruler {task} sample {index} ({configs[c].label})"
        yield Trial((last, configs[c]), configs[c].spec, ids, question, last.n_predict, label)


def run_local(rt, opts: RulerOptions, configs, todo, settings, model: ModelOptions, on_start):
    """The records of `todo` on this process's model, in order."""
    gen = opts.generator(rt)
    ts = trials(gen, todo, configs, opts.question_after, on_start)
    context = model.ctx_size or rt.config.context_length
    for t, r in run_trials(rt, ts, opts.seed, model.ubatch, context, opts.parallel):
        yield record(*t.tag, r, settings)


def settings_of(rt, opts: RulerOptions) -> dict:
    chat = opts.chat if opts.chat is not None else rt.tokenizer.chat_template is not None
    return {"model": str(rt.path), "length": opts.length, "seed": opts.seed, "chat": chat,
            "question_after": opts.question_after}  # fmt: skip


def worker_setup(model: ModelOptions, kv: KVGridOptions, opts: RulerOptions):
    """On a Ray worker: the model; handler(items, node) -> each item's records, where an item
    is (task, index, config indices) and every record gets the worker's "node"."""
    from ..run.cluster import load_model

    configs = configs_of(kv)
    rt = load_model(model)
    context = model.ctx_size or rt.config.context_length
    opts.check_context(context)
    settings = settings_of(rt, opts)

    def handler(items: list, node: str) -> list[list[dict]]:
        out = []
        for _, (task, index, cs) in items:
            todo = [(task, index, c) for c in cs]
            recs = run_local(rt, opts, configs, todo, settings, model, None)
            out.append([{**rec, "node": node} for rec in recs])
        return out

    return handler, {"settings": settings, "context": context}


def start_ray(ray: RayOptions, model: ModelOptions, kv: KVGridOptions, opts: RulerOptions, echo):
    """Ray workers started and one ready: (pool, its facts: settings, context)."""
    from ..run import cluster

    return cluster.start(ray, worker_setup, model, {"kv": kv, "opts": opts}, echo)


def run_ray(pool, todo):
    """The records of `todo` from the workers, one sample (its configs) per call, in order."""
    groups: list[tuple[str, int, list[int]]] = []
    for task, index, c in todo:
        if groups and groups[-1][:2] == (task, index):
            groups[-1][2].append(c)
        else:
            groups.append((task, index, [c]))
    done: dict[int, list[dict]] = {}
    nxt = 0
    for (i, g), records, error in pool.stream(((i, (i, g)) for i, g in enumerate(groups)), 1):
        if error is not None:
            raise KvrunError(f"ruler {g[0]} sample {g[1]}: {error}")
        done[i] = records
        while nxt in done:
            yield from done.pop(nxt)
            nxt += 1


def summary(records: list[dict], configs, tasks: list[str]) -> list[dict]:
    """Per config: per-task scores (0..100), their average, samples, mean measured KV held."""
    out = []
    for cfg in configs:
        rs = [r for r in records if (r["method"], r["budget"]) == (cfg.method, cfg.budget)]
        scores = ru.task_scores(rs)
        have = [scores[t] for t in tasks if t in scores]
        kv = [r["kv_ratio"] for r in rs if "kv_ratio" in r]
        out.append({
            "method": cfg.method, "budget": cfg.budget,
            "kvpress_ratio": ru.kvpress_ratio(cfg.budget, cfg.spec),
            "tasks": {t: scores[t] for t in tasks if t in scores},
            "average": round(sum(have) / len(have), 2) if have else None,
            "samples": len(rs),
            "kv_ratio": round(sum(kv) / len(kv), 4) if kv else None,
        })  # fmt: skip
    return out
