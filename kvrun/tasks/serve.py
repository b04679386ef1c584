"""Running kvrun serve: the model loaded behind the engine's thread and the HTTP server on its
port (kvrun.server). The CLI (kvrun.cli.serve) reads the options into a ServeOptions."""

from __future__ import annotations

import dataclasses
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

from ..errors import KvrunError
from ..progress import err_console
from ..run.options import KVOptions, ModelOptions, ParallelOptions, size_bytes


@dataclass(frozen=True)
class ServeOptions:
    """The server's own options (kvrun serve --help says what each does)."""

    host: str
    port: int
    api_key: str | None
    queue: int
    alias: str | None
    grace: float
    max_body: int  # MiB
    read_timeout: float
    max_connections: int
    cache_mem: str
    verbose: bool
    cache_dir: str | None = None  # --cache-dir: the prefix cache's entries also as .kvc files
    cache_disk: str = "4G"


def run_server(
    opts: ServeOptions,
    model: ModelOptions,
    kv: KVOptions,
    parallel: ParallelOptions,
    own_ubatch: bool,
) -> None:
    """Check the options, start loading the model on the engine's thread and serve until
    SIGTERM / Ctrl-C. own_ubatch: --ubatch was given (else serve_ubatch picks the chunk)."""
    spec = kv.spec()  # a bad --kv fails before the load
    cache_bytes = size_bytes(opts.cache_mem, "--cache-mem")
    disk_bytes = size_bytes(opts.cache_disk, "--cache-disk")
    if opts.cache_dir is not None:
        try:
            Path(opts.cache_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KvrunError(f"--cache-dir {opts.cache_dir}: {e.strerror or e}") from None
    from ..hub.model_store import DEFAULT_MODEL, resolve
    from ..models.presets import is_preset
    from ..run.runtime import load_runtime, pick_device
    from ..server.app import Server, Settings
    from ..server.app import serve as run
    from ..server.metrics import Metrics
    from ..server.prefix_cache import PrefixCache
    from ..server.worker import EngineThread

    host, port = opts.host, opts.port
    kv_mem = parallel.kv_mem_bytes(pick_device(model.device))  # before the load
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if host not in ("127.0.0.1", "localhost", "::1") and not opts.api_key:
        err_console.print(
            f"warning: binding {host} without --api-key: anyone who can reach it can use it",
            style="yellow",
        )
    name = opts.alias or model.name or DEFAULT_MODEL
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
    def make_session(rt, kv):
        ubatch = model.ubatch if own_ubatch else serve_ubatch(rt, model.ubatch)
        return dataclasses.replace(model, ubatch=ubatch).session(rt, kv)

    settings = Settings(
        names=list(dict.fromkeys([name, Path(name).stem, Path(name).name])),
        default_kv=kv.method,
        default_budget=kv.budget,
        default_dtype=kv.dtype,
        context=model.ctx_size or 0,
        api_key=opts.api_key,
        queue=opts.queue,
        max_body=opts.max_body * 2**20,
        grace=opts.grace,
        read_timeout=opts.read_timeout,
        max_connections=_connection_limit(opts.max_connections),
    )
    metrics = Metrics()
    cache = PrefixCache(cache_bytes)
    disk = None
    if opts.cache_dir is not None:
        from ..server.disk_cache import DiskCache

        disk = DiskCache(opts.cache_dir, disk_bytes)
    worker = EngineThread(load, parallel.n, kv_mem, make_session, metrics, spec, cache, disk)
    server = Server(settings, worker, metrics)
    on_disk = f", --cache-dir {opts.cache_dir}" if opts.cache_dir else ""
    err_console.print(
        f"kvrun serve: http://{host}:{port}/v1 (model {name}, --kv {spec.name}, -np {parallel.n}, "
        f"--cache-mem {opts.cache_mem}{on_disk})"
    )
    try:
        sock = socket.create_server((host, port), family=_family(host))
    except OSError as e:
        raise KvrunError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    run(server, sock, log_level="info" if opts.verbose else "warning")


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
