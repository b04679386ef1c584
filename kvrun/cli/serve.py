"""kvrun serve: an OpenAI-compatible HTTP server on the continuous-batching engine."""

from __future__ import annotations

import click

from ..run.options import KVOptions, ModelOptions, ParallelOptions
from ..tasks.serve import ServeOptions, run_server
from .common import graph_option, kv_options, model_options, parallel_options


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
    opts = ServeOptions(host, port, api_key, queue, alias, grace, max_body, read_timeout,
                        max_connections, cache_mem, verbose, cache_dir, cache_disk)  # fmt: skip
    # a prompt's prefill chunk delays every decoding sequence's next token: unless --ubatch is
    # given, chunks are as long as the fast products take (kvrun.tasks.serve.serve_ubatch)
    own_ubatch = ctx.get_parameter_source("ubatch") is not click.core.ParameterSource.DEFAULT
    run_server(opts, model, kv, parallel, own_ubatch)
