"""Options and output shared by the commands: model loading, sampling flags, the stats line."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from ..config import SamplingConfig
from ..errors import KvrunError
from ..kv import REGISTRY, KVSpec

if TYPE_CHECKING:  # the CLI imports torch only when a command runs a model
    from ..generate import Session, Stats
    from ..runtime import Runtime

err_console = Console(stderr=True, highlight=False)


def model_options(f):
    """-m/--model, --dtype, --wtype, --device, -c, --ubatch, --debug, --quiet; the command
    first sets OpenMP's spinning for this machine (kvrun/openmp.py), before torch loads."""

    body = f

    @functools.wraps(body)
    def command(*args, **kwargs):
        from .. import openmp

        openmp.tune()
        return body(*args, **kwargs)

    f = command
    opts = [
        click.option(
            "-m",
            "--model",
            default=None,
            metavar="NAME|PATH",
            help="Model name (in $KVRUN_MODELS) or path to a .gguf / HF directory. Default: smollm2.",
        ),
        click.option(
            "--dtype",
            default="auto",
            show_default=True,
            type=click.Choice(["auto", "float32", "float16", "bfloat16"]),
            help="Compute dtype (auto: float32 on CPU, bfloat16 on CUDA; a dense --wtype sets it).",
        ),
        click.option(
            "--wtype",
            default="auto",
            show_default=True,
            type=click.Choice(["auto", "f32", "f16", "bf16", "q8", "q4"]),
            help="Weights in memory. auto: a GGUF's 4/8-bit tensors stay packed where that "
            "decodes at least as fast as dense weights or dense would not fit in memory, else "
            "dense; q4/q8: pack every linear weight to at most 4/8 bits (any model); "
            "f32/f16/bf16: dense (the reference path).",
        ),
        click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N]."),
        click.option(
            "-c",
            "--ctx-size",
            "ctx_size",
            default=0,
            show_default=True,
            type=click.IntRange(min=0),
            help="Context size in tokens (0 = the model's).",
        ),
        click.option(
            "--ubatch",
            default=512,
            show_default=True,
            type=click.IntRange(min=1),
            help="Prefill chunk size in tokens.",
        ),
        click.option("--debug", is_flag=True, hidden=True),
        quiet_option,
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def graph_option(f):
    """--cuda-graph for the commands that decode (generate, chat, longdoc, bench)."""
    return click.option(
        "--cuda-graph/--no-cuda-graph",
        "cuda_graph",
        default=False,
        show_default=True,
        help="Replay each decode step as one CUDA graph (needs --device cuda; every method "
        "that only appends at decode steps; methods that evict at steps or keep their own "
        "stores, such as h2o or minicache, decode eagerly, with a note). With --parallel N a "
        "batch's step is captured per batch-size bucket (1, 2, 4, 8, 16, ...) and its sequences.",
    )(f)


def new_session(rt: Runtime, kv, kw: dict, note: bool = True) -> Session:
    """A Session with the command's --ubatch, -c and --cuda-graph; notes why a requested graph
    is not used (unless note is False: the other slots of a --parallel batch)."""
    from ..generate import Session

    graph = "on" if kw.get("cuda_graph") else "off"
    session = Session(
        rt.model, rt.tokenizer, kv, ubatch=kw["ubatch"], context=kw["ctx_size"], graph=graph
    )
    if session.graph_note and note:
        err_console.print(session.graph_note, style="yellow")
    return session


def parallel_options(f):
    """--parallel N and --kv-mem: documents run N at once (kvrun.engine)."""
    f = click.option(
        "--kv-mem",
        default=None,
        metavar="SIZE",
        help="Admit a new sequence only while every active sequence's KV cache can still "
        "fit SIZE: bytes (512M, 4G) or a fraction of free memory (0.5). Default: no limit.",
    )(f)
    return parallel_option(f)


def parallel_option(f):
    """--parallel N: sequences (documents, trials) decoded together (kvrun.engine)."""
    return click.option(
        "-np",
        "--parallel",
        default=1,
        show_default=True,
        type=click.IntRange(1, 256),
        help="Sequences decoded together (one weight read per step for all of them); a "
        "finished one frees its slot for the next at once.",
    )(f)


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_mem(text: str | None, device) -> int | None:
    """--kv-mem: None, bytes with an optional K/M/G/T suffix, or a fraction (0, 1] of the
    memory free now (CUDA: the device's; CPU: MemAvailable)."""
    if text is None:
        return None
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        value = -1.0
    if value <= 0 or (not unit and value != int(value) and value > 1):
        raise KvrunError(f"--kv-mem {text}: give bytes (512M, 4G, 1000000) or a fraction (0.5)")
    if unit or value > 1:
        return int(value * _UNITS[unit])
    return int(value * free_memory(device))


def free_memory(device) -> int:
    """Bytes free for new allocations: the CUDA device's, or the system's MemAvailable."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise KvrunError("--kv-mem as a fraction needs /proc/meminfo; give bytes (4G) instead")


def kv_options(multiple: bool = False):
    """--kv and --kv-budget; with multiple=True both may be given several times (grids)."""
    kv_help = (
        f"KV cache method: {', '.join(REGISTRY)}; stack with + (snapkv+kivi2, minicache+kivi4), "
        "options with : (snapkv:window=64). See `kvrun kv list`."
    )
    budget_help = (
        "Tokens kept per layer: a fraction of the tokens seen (< 1) or a count (>= 1). "
        "Default 0.2 for selecting methods (MiniKV: 25% heavy + 25% recent; MiniCache: none)."
    )
    if multiple:
        kv_help += " Repeat for several methods."
        budget_help += " Comma-separated for several budgets."

    def deco(f):
        f = click.option("--kv-budget", "kv_budget", default=None, metavar="B", help=budget_help)(f)
        return click.option(
            "--kv",
            "kv",
            default=("full",) if multiple else "full",
            multiple=multiple,
            show_default=True,
            metavar="METHOD",
            help=kv_help,
        )(f)

    return deco


def ray_options(f):
    """--ray [ADDRESS], --workers, --cpus-per-worker, --retries: the batch on a Ray cluster."""
    opts = [
        click.option(
            "--ray",
            "ray_address",
            is_flag=False,
            flag_value="auto",
            default=None,
            metavar="[ADDRESS]",
            help="Run on a Ray cluster: auto (alone: --ray) joins the running one (`ray start "
            "--head`, RAY_ADDRESS), an address joins that one, local starts one for this run. "
            "Needs pip install 'kvrun[ray]'.",
        ),
        click.option(
            "--workers",
            default=None,
            type=click.IntRange(min=1),
            help="Ray workers, each with its own model (default: one per GPU, or one per "
            "--cpus-per-worker CPUs).",
        ),
        click.option(
            "--cpus-per-worker",
            default=None,
            type=click.IntRange(min=1),
            help="CPUs (torch threads) per Ray worker (default 2, or the CPUs shared out among "
            "--workers).",
        ),
        click.option(
            "--retries",
            default=2,
            show_default=True,
            type=click.IntRange(min=0),
            help="Times a document whose worker died is sent again (one that fails by itself "
            "is not).",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def question_after_option(f):
    """--question-after: the document is compressed before the question is seen."""
    return click.option(
        "--question-after",
        is_flag=True,
        help="Prefill and compress the document first; the question (the prompt's part after "
        "the document) then arrives as a turn of its own on the compressed cache, as a reused "
        "document meets new questions (kvpress's 'question not in context').",
    )(f)


def sampling_options(f=None, *, temp: float = 0.8):
    """llama.cpp's sampling flags and defaults; `@sampling_options(temp=0)` makes a command greedy."""
    if f is None:
        return lambda g: sampling_options(g, temp=temp)
    opts = [
        click.option(
            "--temp",
            default=temp,
            show_default=True,
            type=click.FloatRange(min=0),
            help="Temperature; 0 = greedy.",
        ),
        click.option(
            "--top-k", default=40, show_default=True, type=click.IntRange(min=0), help="0 = off."
        ),
        click.option(
            "--top-p", default=0.95, show_default=True, type=click.FloatRange(0, 1), help="1 = off."
        ),
        click.option(
            "--min-p", default=0.05, show_default=True, type=click.FloatRange(0, 1), help="0 = off."
        ),
        click.option(
            "--repeat-penalty",
            default=1.0,
            show_default=True,
            type=click.FloatRange(min=0),
            help="1 = off.",
        ),
        click.option(
            "--repeat-last-n",
            default=64,
            show_default=True,
            type=click.IntRange(min=-1),
            help="Tokens the penalty looks back over (0 = off, -1 = whole context).",
        ),
        click.option("-s", "--seed", default=-1, show_default=True, type=int, help="-1 = random."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def sampling_from(kw: dict) -> tuple[SamplingConfig, int]:
    """SamplingConfig and a concrete seed (a random one is drawn and reported for -1)."""
    cfg = SamplingConfig(
        kw["temp"], kw["top_k"], kw["top_p"], kw["min_p"], kw["repeat_penalty"], kw["repeat_last_n"]
    )
    seed = kw["seed"]
    if seed < 0:
        import random

        seed = random.SystemRandom().randrange(2**31)
    return cfg, seed


def set_debug(ctx: click.Context, debug: bool) -> None:
    if debug:
        ctx.find_root().ensure_object(dict)["debug"] = True


def progress_bar(description: str, bytes_mode: bool = False):
    """A transient progress bar on stderr when it is a terminal; else plain progress lines
    every few seconds (LineProgress), none with --quiet."""
    if not sys.stderr.isatty():
        return LineProgress(bytes_mode)
    cols = [TextColumn("{task.description}"), BarColumn()]
    cols += [DownloadColumn()] if bytes_mode else [TextColumn("{task.completed}/{task.total}")]
    cols.append(TimeRemainingColumn())
    return Progress(*cols, console=err_console, transient=True)


QUIET = {"on": False}  # --quiet: no progress lines off a terminal


def quiet_option(f):
    """--quiet: long commands print no progress lines when stderr is not a terminal."""
    return click.option(
        "--quiet",
        is_flag=True,
        expose_value=False,
        callback=lambda ctx, param, v: QUIET.update(on=bool(v)),
        help="No progress lines on stderr (printed every few seconds when stderr is not a "
        "terminal: logs, pipes).",
    )(f)


class LineProgress:
    """progress_bar off a terminal, as llama.cpp logs: for each visible task one plain line
    on stderr every EVERY seconds (what, how far, rate, time so far), and one when a task that
    ran that long ends. The subset of rich's Progress the commands use."""

    EVERY = 5.0

    def __init__(self, bytes_mode: bool = False):
        self.bytes_mode, self.tasks = bytes_mode, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def add_task(self, description: str, total=None, visible: bool = True, **_) -> int:
        now = time.monotonic()
        i = len(self.tasks)
        self.tasks[i] = {"description": description, "total": total, "completed": 0,
                         "visible": visible, "t0": now, "shown": now, "ended": False}  # fmt: skip
        return i

    def update(self, task: int, completed=None, total=None, description=None, visible=None,
               advance=None, **_) -> None:  # fmt: skip
        t = self.tasks[task]
        for key, v in (("completed", completed), ("total", total), ("visible", visible)):
            if v is not None:
                t[key] = v
        if description is not None:
            t["description"] = description
        if advance:
            t["completed"] += advance
        self._report(t)

    def advance(self, task: int, advance: float = 1) -> None:
        self.update(task, advance=advance)

    def _report(self, t: dict) -> None:
        if QUIET["on"] or not t["visible"]:
            return
        now = time.monotonic()
        done = t["total"] is not None and t["completed"] >= t["total"]
        if done and (t["ended"] or now - t["t0"] < self.EVERY):
            return
        if not done and now - t["shown"] < self.EVERY:
            return
        t["shown"], t["ended"] = now, done
        print(self.line(t, now), file=sys.stderr, flush=True)

    def line(self, t: dict, now: float) -> str:
        elapsed = max(now - t["t0"], 1e-9)
        n, total = t["completed"], t["total"]
        fmt = human_bytes if self.bytes_mode else (lambda x: f"{x:g}")
        where = f"{fmt(n)}/{fmt(total)} ({n / total:.0%})" if total else fmt(n)
        rate = f"{human_bytes(n / elapsed)}/s" if self.bytes_mode else f"{n / elapsed:.2f}/s"
        state = "done in" if total and n >= total else "elapsed"
        return f"{t['description']}: {where}, {rate}, {state} {elapsed:.0f} s"


def check_kv(kw: dict) -> KVSpec:
    """--kv and --kv-budget validated into the spec every later step receives (before the
    model is loaded: a bad method or budget costs no load)."""
    from ..kv import check

    return check(kw["kv"], kw.get("kv_budget"))


def needs_text(model: str | None) -> None:
    """A command that reads or writes text refuses a synthetic preset before loading it."""
    from ..presets import is_preset

    if is_preset(model):
        raise KvrunError(
            f"{model} is a synthetic model (random weights, no tokenizer): it only runs "
            "`kvrun bench`; give a model file or name here"
        )


def load_on_worker(load: dict) -> Runtime:
    """The command's model on a Ray worker (kvrun.cluster), resolved on the worker's node,
    quietly; a model the node lacks says where it must be."""
    from ..model_store import models_dir
    from ..runtime import load_runtime

    try:
        return load_runtime(load["model"], load["dtype"], load["device"], pull_missing=False,
                            log=lambda m: None, wtype=load["wtype"])  # fmt: skip
    except KvrunError as e:
        raise KvrunError(
            f"{e} (each worker loads the model on its own node: give a path on storage every "
            f"node sees, or a name in that node's models folder, here {models_dir()})"
        ) from None


def load_with_progress(kw: dict, pull_missing: bool = True, text: bool = True) -> Runtime:
    """Load the model named by the common options, with a progress bar on a terminal.

    Commands validate --kv themselves first (check_kv), before paying for the load; with
    text (every command but bench) a synthetic preset is refused before it is made.
    """
    from ..runtime import load_runtime, pick_device

    if text:
        needs_text(kw["model"])

    if kw.get("cuda_graph") and pick_device(kw["device"]).type != "cuda":
        raise KvrunError("--cuda-graph needs a CUDA device (--device cuda)")  # before the load
    with progress_bar("loading") as bar:
        task = bar.add_task("loading model", total=None)
        rt = load_runtime(
            kw["model"],
            kw["dtype"],
            kw["device"],
            pull_missing=pull_missing,
            log=lambda m: err_console.print(f"[dim]{m}[/]"),
            progress=lambda done, total: bar.update(task, completed=done, total=total),
            wtype=kw.get("wtype", "auto"),
        )
    return rt


def prefill_progress(total_tokens: int, ubatch: int):
    """A context manager yielding a progress callback for long prefills (None for short ones)."""
    if total_tokens <= 2 * ubatch or not sys.stderr.isatty():
        return _NullProgress()
    return _PrefillProgress(total_tokens)


class _NullProgress:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class _PrefillProgress:
    def __init__(self, total: int):
        self.bar = progress_bar("prefill")
        self.total = total

    def __enter__(self):
        self.bar.__enter__()
        task = self.bar.add_task("prefill", total=self.total)
        return functools.partial(self._update, task)

    def _update(self, task, done, total):
        self.bar.update(task, completed=done, total=total)

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def stats_line(s: Stats, load_s: float | None = None) -> str:
    """The one line every run ends with (load time first when given, as llama.cpp does)."""
    ratio = s.kv_bytes / s.kv_bytes_full if s.kv_bytes_full else 1.0
    load = f"load {load_s:.2f} s | " if load_s is not None else ""
    first = f", first token {s.ttft_s:.2f} s" if s.ttft_s else ""
    return (
        f"{load}prompt {s.prompt_tokens} tok, {s.prefill_tok_s:.1f} tok/s{first} | "
        f"gen {s.generated_tokens} tok, {s.decode_tok_s:.1f} tok/s | "
        f"KV {human_bytes(s.kv_bytes)} held / {human_bytes(s.kv_bytes_full)} full ({ratio:.1%}) | "
        f"peak mem {human_bytes(s.peak_mem_bytes)}"
    )


def dump_json(obj: dict) -> None:
    click.echo(json.dumps(obj, ensure_ascii=False))


def read_stdin() -> str:
    """stdin as UTF-8 text; bytes that are not UTF-8 become U+FFFD, as in a file prompt."""
    buf = getattr(sys.stdin, "buffer", None)
    if buf is None:  # a text-only stream (tests)
        return sys.stdin.read()
    return buf.read().decode("utf-8", errors="replace")


def read_text(file: str) -> str:
    """The text of FILE ('-' = stdin); a one-line error when it is missing, unreadable or empty."""
    if file == "-":
        text = read_stdin()
    else:
        try:
            text = Path(file).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise KvrunError(f"cannot read {file}: {e.strerror or e}") from None
    if not text.strip():
        raise KvrunError(f"{file} is empty")
    return text
