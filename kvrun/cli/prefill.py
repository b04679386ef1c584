"""kvrun prefill: a document's turn prefilled and compressed once, kept as a .kvc file."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import KvrunError
from ..progress import prefill_progress
from ..report import human_bytes
from ..run.options import KVOptions, ModelOptions
from .common import dump_json, kv_options, load_with_progress, model_options, new_session
from .generate import read_prompt


@click.command()
@model_options
@kv_options()
@click.option("-f", "--file", default=None, help="The document ('-' = stdin).")
@click.option("-p", "--prompt", default=None, help="Document text (after the -f file when both).")
@click.option(
    "-o", "--output", required=True, type=click.Path(dir_okay=False), help="The .kvc file."
)
@click.option(
    "--chat/--raw",
    "chat",
    default=None,
    help="The document as the start of a user message in the model's chat template (default: "
    "--chat when it has one); the question a later run asks completes that message.",
)
@click.option("--system", default=None, help="System message (with --chat).")
@click.option("--overwrite", is_flag=True, help="Replace the output file if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def prefill(
    file, prompt, output, chat, system, overwrite, as_json, model: ModelOptions, kv: KVOptions
):
    """Prefill and compress a document once, and keep its KV cache in a .kvc file.

    Later runs start from the file and ask their questions on the compressed cache, as
    --question-after does (the question is a turn that selects nothing):

    \b
    kvrun prefill -f report.txt --kv snapkv --kv-budget 0.25 -o report.kvc
    kvrun generate --kv-cache report.kvc -p "Who signed the report?" --temp 0
    kvrun chat --kv-cache report.kvc

    The file holds what the cache holds (safetensors) and a header with the model's
    identity, the KV spec and the tokens; another model, spec or kvrun format is refused.
    """
    from ..run import kvc

    out = Path(output)
    if out.exists() and not overwrite:
        raise KvrunError(f"{out} exists (pass --overwrite to replace it)")
    text = read_prompt(prompt, file)
    spec = kv.spec()
    rt = load_with_progress(model)
    tok = rt.tokenizer
    use_chat = chat if chat is not None else tok.chat_template is not None
    ids, turns = kvc.document_turn(tok, text, use_chat, system)
    session = new_session(rt, rt.new_kv(spec), model)
    session.check_fits(len(ids))
    with prefill_progress(len(ids), model.ubatch) as progress:
        session.prefill(ids, progress)
    path = kvc.save(out, session.kv, session.tokens, rt, turns)
    held, full, size = session.kv.nbytes(), session.kv.nbytes_full(), path.stat().st_size
    if as_json:
        dump_json(
            {"path": str(path), "tokens": len(ids), "kv": session.kv.describe(),
             "kv_bytes": held, "kv_bytes_full": full, "file_bytes": size}
        )  # fmt: skip
        return
    click.echo(
        f"{path}: {len(ids)} tokens, --kv {spec.name}, KV {human_bytes(held)} held / "
        f"{human_bytes(full)} full, file {human_bytes(size)}",
        err=True,
    )
