"""The commands' shared options, each group built once into its typed object
(kvrun/options.py), and what every command does with them: check, load, read."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..errors import KvrunError
from ..kv import REGISTRY
from ..progress import err_console, progress_bar
from ..run.options import (
    KVGridOptions,
    KVOptions,
    ModelOptions,
    ParallelOptions,
    RayOptions,
    SamplingOptions,
)

if TYPE_CHECKING:  # the CLI imports torch only when a command runs a model
    from ..run.runtime import Runtime
    from ..run.session import Session


def _grouped(name: str, build: Callable[[dict], object], options: list):
    """A decorator adding click options whose values reach the command as one object, `name`:
    build(params) pops them from click's parameters and makes it."""

    def deco(f):
        @functools.wraps(f)
        def command(*args, **params):
            params[name] = build(params)
            return f(*args, **params)

        for opt in reversed(options):
            command = opt(command)
        return command

    return deco


def _model(params: dict) -> ModelOptions:
    """Sets --debug and OpenMP's spinning for this machine (kvrun/openmp.py, before torch
    loads), then the ModelOptions (--cuda-graph where the command has graph_option)."""
    from ..run import openmp

    openmp.tune()
    set_debug(click.get_current_context(), params.pop("debug"))
    return ModelOptions(
        name=params.pop("model"),
        dtype=params.pop("dtype"),
        wtype=params.pop("wtype"),
        device=params.pop("device"),
        ctx_size=params.pop("ctx_size"),
        ubatch=params.pop("ubatch"),
        cuda_graph=params.pop("cuda_graph", False),
        quiet=params.pop("quiet"),
    )


def model_options(f):
    """-m/--model, --dtype, --wtype, --device, -c, --ubatch, --debug, --quiet (and graph_option's
    --cuda-graph) as one ModelOptions, `model`; the command first sets OpenMP's spinning for this
    machine (kvrun/openmp.py), before torch loads."""
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
    return _grouped("model", _model, opts)(f)


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


def new_session(rt: Runtime, kv, model: ModelOptions, note: bool = True) -> Session:
    """model.session(rt, kv), noting why a requested graph is not used (unless note is False:
    the other slots of a --parallel batch)."""
    session = model.session(rt, kv)
    if session.graph_note and note:
        err_console.print(session.graph_note, style="yellow")
    return session


def parallel_options(f):
    """--parallel N and --kv-mem as one ParallelOptions, `parallel`: documents run N at once
    (kvrun.engine)."""
    kv_mem = click.option(
        "--kv-mem",
        default=None,
        metavar="SIZE",
        help="Admit a new sequence only while every active sequence's KV cache can still "
        "fit SIZE: bytes (512M, 4G) or a fraction of free memory (0.5). Default: no limit.",
    )
    build = lambda p: ParallelOptions(p.pop("parallel"), p.pop("kv_mem"))  # noqa: E731
    return _grouped("parallel", build, [parallel_option, kv_mem])(f)


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


def kv_options(multiple: bool = False):
    """--kv and --kv-budget as one KVOptions, `kv`; with multiple=True (a KVGridOptions) --kv
    may be given several times and --kv-budget is a comma list (grids)."""
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

    opts = [
        click.option(
            "--kv",
            "kv",
            default=("full",) if multiple else "full",
            multiple=multiple,
            show_default=True,
            metavar="METHOD",
            help=kv_help,
        ),
        click.option("--kv-budget", "kv_budget", default=None, metavar="B", help=budget_help),
        click.option(
            "--kv-dtype",
            "-ctk",
            "--cache-type-k",
            "kv_dtype",
            default=None,
            metavar="TYPE",
            help="K and V element type of the dense cache: f32, f16, bf16, q8_0, q4_0 "
            "(llama.cpp's blocks) or auto (f16 on the CPU, as llama.cpp; the model's dtype on "
            "CUDA). Selections keep their tokens in it; KIVI stores keep their own. "
            "[default: auto]",
        ),
        click.option(
            "-ctv",
            "--cache-type-v",
            "kv_dtype_v",
            default=None,
            metavar="TYPE",
            help="llama.cpp's spelling for V: kvrun keeps K and V in one type, so it must "
            "match --kv-dtype / -ctk where both are given.",
        ),
    ]
    cls = KVGridOptions if multiple else KVOptions
    return _grouped("kv", lambda p: cls(p.pop("kv"), p.pop("kv_budget"), _kv_dtype(p)), opts)


def _kv_dtype(p: dict) -> str:
    """--kv-dtype / -ctk and -ctv as one type (auto where neither is given)."""
    k, v = p.pop("kv_dtype"), p.pop("kv_dtype_v")
    if k is not None and v is not None and k.strip().lower() != v.strip().lower():
        raise click.UsageError(
            f"-ctk {k} and -ctv {v} differ: kvrun keeps K and V in one type (give one)"
        )
    return k or v or "auto"


def ray_options(f):
    """--ray [ADDRESS], --workers, --cpus-per-worker, --retries as one RayOptions, `ray`: the
    batch on a Ray cluster."""
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
    fields = ("ray_address", "workers", "cpus_per_worker", "retries")
    return _grouped("ray", lambda p: RayOptions(*(p.pop(k) for k in fields)), opts)(f)


def chat_option(f):
    """--chat/--raw for commands that send many prompts (batch documents, RULER samples)."""
    return click.option(
        "--chat/--raw",
        "chat",
        default=None,
        help="Wrap prompts in the model's chat template (default: --chat when it has one).",
    )(f)


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
    """llama.cpp's sampling flags and defaults as one SamplingOptions, `sampling`;
    `@sampling_options(temp=0)` makes a command greedy."""
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
    fields = ("temp", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "seed")
    build = lambda p: SamplingOptions(*(p.pop(k) for k in fields))  # noqa: E731
    return _grouped("sampling", build, opts)(f)


def set_debug(ctx: click.Context, debug: bool) -> None:
    """--debug on a command: tracebacks instead of one-line errors (kvrun.cli.main)."""
    if debug:
        ctx.find_root().ensure_object(dict)["debug"] = True


def needs_text(model: str | None) -> None:
    """A command that reads or writes text refuses a synthetic preset before loading it."""
    from ..models.presets import is_preset

    if is_preset(model):
        raise KvrunError(
            f"{model} is a synthetic model (random weights, no tokenizer): it only runs "
            "`kvrun bench`; give a model file or name here"
        )


def load_with_progress(
    model: ModelOptions, pull_missing: bool = True, text: bool = True
) -> Runtime:
    """Load the model of the common options, with a progress bar on a terminal.

    Commands validate --kv themselves first (KVOptions.spec), before paying for the load; with
    text (every command but bench) a synthetic preset is refused before it is made.
    """
    from ..run.runtime import load_runtime, pick_device

    if text:
        needs_text(model.name)

    if model.cuda_graph and pick_device(model.device).type != "cuda":
        raise KvrunError("--cuda-graph needs a CUDA device (--device cuda)")  # before the load
    with progress_bar("loading", quiet=model.quiet) as bar:
        task = bar.add_task("loading model", total=None)
        rt = load_runtime(
            model.name,
            model.dtype,
            model.device,
            pull_missing=pull_missing,
            log=lambda m: err_console.print(f"[dim]{m}[/]"),
            progress=lambda done, total: bar.update(task, completed=done, total=total),
            wtype=model.wtype,
        )
    rt.model.use_context(model.ctx_size or rt.config.context_length)  # LongRoPE's factors
    return rt


def quiet_option(f):
    """--quiet: long commands print no progress lines when stderr is not a terminal."""
    return click.option(
        "--quiet",
        is_flag=True,
        help="No progress lines on stderr (printed every few seconds when stderr is not a "
        "terminal: logs, pipes).",
    )(f)


def debugging(ctx: click.Context) -> bool:
    """Whether --debug was given (to the group or the command)."""
    return bool((ctx.find_root().obj or {}).get("debug"))


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


def kv_cache_option(what: str):
    """--kv-cache FILE: start from a document's compressed cache (`kvrun prefill`); `what`
    says what the command's input then is."""
    return click.option(
        "--kv-cache",
        "kv_cache",
        default=None,
        type=click.Path(dir_okay=False),
        help=f"Start from a document's compressed cache (`kvrun prefill -o FILE`): {what}. "
        "--kv comes from the file.",
    )


def session_from_kvc(rt: Runtime, path: str, kv: KVOptions, model: ModelOptions):
    """(session, header) going on from a .kvc file; --kv other than the default, and
    --kv-budget with or without it, must be the file's (kvrun.kvc.load says so in one line)."""
    from ..run import kvc

    if kv.method == "full":  # the default: the file's method, at --kv-budget where one is given
        cache, held, header = kvc.load(path, rt, None, kv.budget, kv.dtype)
    else:
        cache, held, header = kvc.load(path, rt, kv.spec())
    session = new_session(rt, cache, model)
    session.tokens = held
    return session, header
