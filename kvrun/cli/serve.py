"""kvrun serve: an OpenAI-compatible HTTP server on the continuous-batching engine."""

from __future__ import annotations

import dataclasses
import logging
import socket
from pathlib import Path

import click

from ..errors import KvrunError
from ..options import KVOptions, ModelOptions, ParallelOptions, size_bytes
from ..progress import err_console
from .common import graph_option, kv_options, model_options, new_session, parallel_options


@click.command()
@model_options
@graph_option
@kv_options()
@parallel_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--api-key",
    default=None,
    envvar="KVRUN_API_KEY",
    help="Require 'Authorization: Bearer KEY' on every endpoint but /health ($KVRUN_API_KEY).",
)
@click.option(
    "--queue",
    default=256,
    show_default=True,
    type=click.IntRange(0),
    help="Requests that may wait for a slot; beyond them a request gets 503 with Retry-After.",
)
@click.option(
    "--alias",
    default=None,
    help="The model id clients send and /v1/models shows (default: the -m name).",
)
@click.option(
    "--grace",
    default=5.0,
    show_default=True,
    type=click.FloatRange(0),
    help="Seconds streams in flight get after SIGTERM / Ctrl-C before they end with an error.",
)
@click.option(
    "--max-body",
    default=8,
    show_default=True,
    type=click.IntRange(1),
    help="Largest request body, in MiB (413 beyond).",
)
@click.option(
    "--read-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    help="Seconds a client has to send a request's headers (from connecting, or from its last "
    "response), and as long again for its body; slower clients are disconnected (408).",
)
@click.option(
    "--max-connections",
    default=512,
    show_default=True,
    type=click.IntRange(1),
    help="Open connections at most (kept under the open-files limit); beyond it the one idle "
    "the longest is closed, or, when all have requests in flight, a new request gets 503.",
)
@click.option(
    "--cache-mem",
    default="1G",
    show_default=True,
    metavar="SIZE",
    help="Bytes of ended requests' caches kept for prompts that start with them (512M, 2G; "
    '0: off); least recently used first out. A request opts out with "cache_prompt": false.',
)
@click.option(
    "--cache-dir",
    default=None,
    metavar="DIR",
    help="Also keep ended requests' caches as .kvc files in DIR (per model and KV spec), so a "
    "restarted server goes on from them; written off the request's path.",
)
@click.option(
    "--cache-disk",
    default="4G",
    show_default=True,
    metavar="SIZE",
    help="Bytes of .kvc files --cache-dir keeps; least recently used first out.",
)
@click.option("-v", "--verbose", is_flag=True, help="Log every request (uvicorn's access log).")
@click.pass_context
def serve(
    ctx,
    host,
    port,
    api_key,
    queue,
    alias,
    grace,
    max_body,
    read_timeout,
    max_connections,
    cache_mem,
    cache_dir,
    cache_disk,
    verbose,
    model: ModelOptions,
    kv: KVOptions,
    parallel: ParallelOptions,
):
    """Serve the model over OpenAI's HTTP API, with a KV method per request.

    \b
    Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
    GET /health (503 while the model loads), GET /metrics (Prometheus).
    Prompts are prefilled in chunks of --ubatch tokens between the decode steps of the other
    sequences; its default here is the rows the native CPU products take (128 or fewer), so
    a long prompt delays them by one short chunk at a time.
    A request may pick its cache with the extension fields "kv" and "kv_budget"
    (the --kv grammar); `usage` reports kv_bytes and kv_bytes_full.
    A request whose prompt starts with the tokens of an ended one (a chat's next turn) goes
    on from a copy of its kept cache (--cache-mem) and prefills only the rest; with a
    compressed method the result is then what `kvrun chat` gives for the same turns.

    \b
    kvrun serve -m smollm2 -np 8 --kv snapkv --kv-budget 0.25
    curl localhost:8080/v1/chat/completions -d '{"model": "smollm2",
      "messages": [{"role": "user", "content": "Hi"}], "kv": "kivi2"}'
    """
    spec = kv.spec()  # a bad --kv fails before the load
    cache_bytes = size_bytes(cache_mem, "--cache-mem")
    disk_bytes = size_bytes(cache_disk, "--cache-disk")
    if cache_dir is not None:
        try:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KvrunError(f"--cache-dir {cache_dir}: {e.strerror or e}") from None
    from ..model_store import DEFAULT_MODEL, resolve
    from ..presets import is_preset
    from ..runtime import load_runtime, pick_device
    from ..server.app import Server, Settings
    from ..server.app import serve as run
    from ..server.metrics import Metrics
    from ..server.prefix_cache import PrefixCache
    from ..server.worker import EngineThread

    kv_mem = parallel.kv_mem_bytes(pick_device(model.device))  # before the load
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        err_console.print(
            f"warning: binding {host} without --api-key: anyone who can reach it can use it",
            style="yellow",
        )
    name = alias or model.name or DEFAULT_MODEL
    # a missing file or unknown name fails here, in one line, before the port is taken
    model_path = model.name if is_preset(model.name) else str(resolve(model.name, True))

    def load():
        rt = load_runtime(
            model_path,
            model.dtype,
            model.device,
            pull_missing=True,
            log=lambda m: err_console.print(f"[dim]{m}[/]"),
            wtype=model.wtype,
        )
        settings.context = model.ctx_size or rt.config.context_length
        err_console.print(f"model {rt.config.name} ready in {rt.load_s:.1f}s", style="green")
        return rt

    # a prompt's prefill chunk delays every decoding sequence's next token: unless --ubatch is
    # given, chunks are as long as the fast products take (kvrun.quant.blocks.native_rows), so
    # that delay stays one short chunk (vLLM bounds a step's tokens the same way)
    own_ubatch = ctx.get_parameter_source("ubatch") is not click.core.ParameterSource.DEFAULT

    def make_session(rt, kv):
        ubatch = model.ubatch if own_ubatch else serve_ubatch(rt, model.ubatch)
        return new_session(rt, kv, dataclasses.replace(model, ubatch=ubatch), note=False)

    settings = Settings(
        names=list(dict.fromkeys([name, Path(name).stem, Path(name).name])),
        default_kv=kv.method,
        default_budget=kv.budget,
        default_dtype=kv.dtype,
        context=model.ctx_size or 0,
        api_key=api_key,
        queue=queue,
        max_body=max_body * 2**20,
        grace=grace,
        read_timeout=read_timeout,
        max_connections=_connection_limit(max_connections),
    )
    metrics = Metrics()
    cache = PrefixCache(cache_bytes)
    disk = None
    if cache_dir is not None:
        from ..server.disk_cache import DiskCache

        disk = DiskCache(cache_dir, disk_bytes)
    worker = EngineThread(load, parallel.n, kv_mem, make_session, metrics, spec, cache, disk)
    server = Server(settings, worker, metrics)
    err_console.print(
        f"kvrun serve: http://{host}:{port}/v1 (model {name}, --kv {spec.name}, -np {parallel.n}, "
        f"--cache-mem {cache_mem}"
        f"{f', --cache-dir {cache_dir}' if cache_dir else ''})"
    )
    try:
        sock = socket.create_server((host, port), family=_family(host))
    except OSError as e:
        raise KvrunError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    run(server, sock, log_level="info" if verbose else "warning")


def _connection_limit(wanted: int) -> int:
    """--max-connections, lowered to leave FD_SPARE descriptors of the open-files limit for the
    model's files, the engine and the listening socket: past the limit accept() fails, and
    then no one, /health included, gets in."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no such limit here (Windows)
        return wanted
    if soft == resource.RLIM_INFINITY or soft - FD_SPARE >= wanted:
        return wanted
    most = max(soft - FD_SPARE, 1)
    err_console.print(
        f"--max-connections {wanted} lowered to {most}: the open-files limit is {soft} (ulimit -n)",
        style="yellow",
    )
    return most


FD_SPARE = 64


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# a prefill chunk's rows in a server step: the native products take longer chunks (prefill), but
# every decoding sequence waits for the chunk, so a step's prefill stays this short
SERVE_CHUNK_ROWS = 128


def serve_ubatch(rt, ubatch: int) -> int:
    """The prefill chunk of a server's sessions when --ubatch is not given: at most the rows the
    native products take where the model runs on them (and SERVE_CHUNK_ROWS), else --ubatch's
    default."""
    from ..quant.blocks import BlockLinear, native_rows

    native = any(type(m) is BlockLinear and m._native_ok for m in rt.model.modules())
    return min(ubatch, native_rows(), SERVE_CHUNK_ROWS) if native else ubatch
