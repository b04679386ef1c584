"""Running a needle grid: its trials on this process's model or on Ray workers (kvrun.cluster),
with a progress bar, and the --json document they fill, rewritten after each trial. The CLI
(kvrun.cli.needle) checks the options before and prints the tables after."""

from __future__ import annotations

from ..errors import KvrunError
from ..kv import check
from ..progress import err_console, progress_bar
from ..run.options import KVGridOptions, ModelOptions, RayOptions
from . import needle as nd


class NeedleRun:
    """One grid of trials (lengths x depths x trials, every KV config), run here on `rt` or
    on the Ray workers of `pool` (start_ray: the pool and its ready worker's facts), and its
    --json document (`doc`, written to json_path unless it is None or "-")."""

    def __init__(self, grid: nd.GridOptions, configs, depths, trials, model: ModelOptions,
                 haystack, json_path, rt=None, ray=None):  # fmt: skip
        self.grid, self.configs, self.model = grid, configs, model
        self.rt, self.json_path = rt, json_path
        self.pool, facts = ray if ray is not None else (None, None)
        if self.pool is not None:
            self.context, self.lengths, about = facts["context"], facts["lengths"], facts["model"]
        else:
            self.context, self.lengths, self.task = grid.setup(rt, configs, model.ctx_size)
            about = nd.model_facts(rt)
        self.depths, self.trials = depths, trials
        self.cells = nd.grid(self.lengths, depths, trials)
        self.total = len(self.cells) * len(configs)
        self.doc = {
            "task": "needle",
            "settings": self._settings(about, haystack),
            "complete": False,
            "summary": [],
            "trials": [],
        }

    def _settings(self, about: dict, haystack) -> dict:
        g = self.grid
        niah = {"needle": g.needle, "question": g.question, "answer": g.answer}
        return nd.settings_from(
            about,
            mode=g.mode,
            seed=g.seed,
            lengths=self.lengths,
            depths=self.depths,
            trials=self.trials,
            n_predict=g.n_predict,
            decoding="greedy",
            chat=g.chat,
            question_after=g.question_after,
            kv=[{"method": c.method, "budget": c.budget} for c in self.configs],
            ctx_size=self.context,
            ubatch=self.model.ubatch,
            haystack=haystack,
            **(niah if g.mode == "niah" else {}),
        )

    @property
    def records(self) -> list[dict]:
        """The trials done so far, in grid order."""
        return self.doc["trials"]

    def save(self, complete: bool) -> None:
        """Summarize the trials so far and rewrite the --json file."""
        self.doc["complete"] = complete
        self.doc["summary"] = nd.summarize(self.records, self.configs)
        if self.json_path and self.json_path != "-":
            nd.write_json(self.json_path, self.doc)

    def run(self) -> bool:
        """Every trial under a progress bar, the document saved after each; returns whether
        Ctrl-C interrupted it (the trials done are kept, and saved as not complete)."""
        self.save(False)  # an unwritable --json fails now, before any trial
        interrupted = False
        try:
            with progress_bar("needle", quiet=self.model.quiet) as bar:
                task_id = bar.add_task("needle", total=self.total)
                for rec in self._source(bar, task_id):
                    self.records.append(rec)
                    self.save(False)
                    bar.advance(task_id)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            if self.pool is not None:
                self.pool.close()
                err_console.print(self.pool.summary(len(self.records), "trials"), highlight=False)
        self.save(not interrupted)
        return interrupted

    def _source(self, bar, task_id):
        if self.pool is not None:
            return ray_grid(self.pool, self.cells, bar, task_id)

        def on_start(cell, cfg):
            where = f"{nd.fmt_length(cell.length)} @ {nd.fmt_depth(cell.depth)}"
            bar.update(task_id, description=f"{cfg.label}  {where}")

        g, m = self.grid, self.model
        return nd.run_grid(self.rt, self.task, self.configs, self.cells, g.n_predict,
                           m.ubatch, self.context, on_start, g.parallel)  # fmt: skip


def worker_setup(model: ModelOptions, kv: KVGridOptions, grid: nd.GridOptions):
    """On a Ray worker (kvrun.cluster): the model and the grid's task. Returns (handler,
    facts): handler(cells, node) -> each cell's records, every config, in grid order."""
    from ..run.cluster import load_model

    configs = nd.kv_configs([(m, check(m).with_dtype(kv.dtype)) for m in kv.methods], kv.budgets)
    rt = load_model(model)
    context, length_list, task = grid.setup(rt, configs, model.ctx_size)
    n, ubatch, parallel = grid.n_predict, model.ubatch, grid.parallel

    def handler(items: list, node: str) -> list[list[dict]]:  # items: (index, cell)
        return [
            list(nd.run_grid(rt, task, configs, [c], n, ubatch, context, None, parallel))
            for _, c in items
        ]

    facts = {"context": context, "lengths": length_list, "model": nd.model_facts(rt)}
    return handler, facts


def start_ray(ray: RayOptions, model: ModelOptions, kv: KVGridOptions, grid: nd.GridOptions):
    """Ray workers for the grid, started and one of them ready: (pool, its facts)."""
    from ..run import cluster

    echo = lambda m: err_console.print(m, highlight=False)  # noqa: E731
    return cluster.start(ray, worker_setup, model, {"kv": kv, "grid": grid}, echo)


def ray_grid(pool, cells, bar, task_id):
    """The grid's records from the workers, one cell (every config) per call, yielded in grid
    order as soon as every earlier cell is in."""
    done: dict[int, list[dict]] = {}
    nxt = 0
    for (i, _), records, error in pool.stream(((i, (i, c)) for i, c in enumerate(cells)), 1):
        if error is not None:
            c = cells[i]
            raise KvrunError(f"needle trial {c.length} tokens at {c.depth:g}%: {error}")
        done[i] = records
        bar.update(task_id, description=f"needle  workers {pool.alive}/{pool.lay.workers}")
        while nxt in done:
            yield from done.pop(nxt)
            nxt += 1
