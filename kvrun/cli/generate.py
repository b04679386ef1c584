"""kvrun generate: one prompt in, streamed text out, one stats line."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from ..errors import KvrunError
from ..progress import prefill_progress
from ..report import stats_line
from ..run.options import KVOptions, ModelOptions, SamplingOptions
from .common import (
    dump_json,
    graph_option,
    kv_cache_option,
    kv_options,
    load_with_progress,
    model_options,
    new_session,
    read_stdin,
    sampling_options,
    session_from_kvc,
)


def read_prompt(prompt: str | None, file: str | None) -> str:
    """-f FILE then -p TEXT (a document followed by an instruction), or stdin when neither."""
    parts = []
    if file == "-":
        parts.append(read_stdin())
    elif file:
        try:
            parts.append(Path(file).read_text(encoding="utf-8", errors="replace"))
        except OSError as e:
            raise KvrunError(f"cannot read prompt file {file}: {e.strerror}") from None
    if prompt:
        parts.append(prompt)
    if not parts:
        if sys.stdin is None or sys.stdin.isatty():
            raise KvrunError("no prompt: give -p TEXT, -f FILE, or pipe text on stdin")
        parts.append(read_stdin())
    text = "\n\n".join(p.rstrip("\n") if i < len(parts) - 1 else p for i, p in enumerate(parts))
    if not text.strip():
        raise KvrunError("the prompt is empty")
    return text


def read_grammar(json_schema: str | None, grammar: str | None):
    """The kvrun.run.grammar.Spec of --json-schema FILE or --grammar FILE (None: neither)."""
    if json_schema and grammar:
        raise KvrunError("give --json-schema or --grammar, not both")
    path = json_schema or grammar
    if not path:
        return None
    from ..run.grammar import MAX_GRAMMAR_CHARS, GrammarError, Spec  # torch: only when asked

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_GRAMMAR_CHARS + 1)
    except (OSError, UnicodeDecodeError) as e:
        raise KvrunError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{path} is over {MAX_GRAMMAR_CHARS} characters")
    if grammar:
        return Spec("grammar", text)
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise GrammarError(f"{path} is not JSON: {e}") from None
    return Spec.json_schema(schema)


@click.command()
@model_options
@graph_option
@kv_options()
@sampling_options
@click.option("-p", "--prompt", default=None, help="Prompt text (after the -f file when both).")
@click.option("-f", "--file", default=None, help="Read the prompt from a file ('-' = stdin).")
@click.option(
    "-n",
    "--n-predict",
    default=256,
    show_default=True,
    type=click.IntRange(min=-1),
    help="Tokens to generate (-1 = until end of text or context).",
)
@click.option(
    "--chat/--raw",
    "chat",
    default=None,
    help="Wrap the prompt in the model's chat template (default: --chat when it has one).",
)
@click.option("--system", default=None, help="System message (with --chat).")
@kv_cache_option(
    "the prompt is the question, a turn that selects nothing; --chat and --system come from "
    "the file too"
)
@click.option(
    "--ignore-eos",
    is_flag=True,
    help="Never stop at an end-of-generation token: they are not drawn (llama.cpp's flag), so "
    "exactly -n tokens come (speed runs).",
)
@click.option(
    "--json-schema",
    "json_schema",
    default=None,
    help="Constrain the reply to JSON valid against the JSON schema in this file.",
)
@click.option(
    "--grammar",
    default=None,
    help="Constrain the reply to a grammar in this file (GBNF as llama.cpp's, or Lark).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def generate(
    prompt,
    file,
    n_predict,
    chat,
    system,
    kv_cache,
    ignore_eos,
    json_schema,
    grammar,
    as_json,
    model: ModelOptions,
    kv: KVOptions,
    sampling: SamplingOptions,
):
    """Generate text from a prompt.

    \b
    kvrun generate -p "Write a haiku about the sea." -n 64
    kvrun generate -f report.txt -p "Summarize the report above." --temp 0
    cat notes.txt | kvrun generate --raw -n 128
    """
    config, seed = dataclasses.replace(sampling, ignore_eos=ignore_eos).resolve()
    text = read_prompt(prompt, file)
    constrain = read_grammar(json_schema, grammar)
    spec = kv.spec()
    rt = load_with_progress(model)
    session, ids, question, use_chat = _prompt(rt, text, chat, system, kv_cache, spec, kv, model)
    constraint = None
    if constrain is not None:
        from ..run.grammar import Grammars

        constraint = Grammars(rt.tokenizer, rt.config.vocab_size).compile(constrain)
    on_text = None if as_json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    n_prompt = len(ids) + len(question or [])
    with prefill_progress(n_prompt, model.ubatch) as progress:
        result = session.generate(
            ids, n_predict, config, seed=seed, on_text=on_text, progress=progress,
            question=question, constraint=constraint,
        )  # fmt: skip
    if as_json:
        settings = {"seed": seed, "n_predict": n_predict, "chat": use_chat}
        dump_json(_json(result, rt, session, settings, config))
    else:
        sys.stdout.write("\n")
        click.echo(stats_line(result.stats, rt.load_s), err=True)


def _prompt(rt, text: str, chat, system, kv_cache, spec, kv: KVOptions, model: ModelOptions):
    """(session, prompt ids, question ids or None, whether the chat template wraps it): a
    fresh cache and the text (in the chat template unless --raw), or a .kvc file's document
    and the text as its question turn."""
    tok = rt.tokenizer
    question = None
    if kv_cache is not None:  # the document is in the file; the prompt is its question
        from ..run import kvc

        session, header = session_from_kvc(rt, kv_cache, kv, model)
        use_chat = header["turns"].get("chat", False)
        ids, question = [], kvc.question_turn(tok, text, header["turns"])
        session.check_fits(len(question))
    else:
        use_chat = chat if chat is not None else tok.chat_template is not None
        if use_chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": text}
            ]
            ids = tok.encode(tok.render_chat(msgs, add_generation_prompt=True))
        else:
            ids = tok.encode(text)
        session = new_session(rt, rt.new_kv(spec), model)
        session.check_fits(len(ids))
    return session, ids, question, use_chat


def _json(result, rt, session, settings: dict, config) -> dict:
    """--json's object: the text, the tokens, the stats and the run's settings."""
    out = {"text": result.text, "tokens": result.tokens}
    out.update(result.stats.as_dict(), load_s=round(rt.load_s, 3))
    out.update(
        {
            "model": str(rt.path),
            "model_name": rt.config.name,
            "kv": session.kv.describe(),
            "settings": {
                **settings,
                "ctx_size": session.context,
                "ubatch": session.ubatch,
                "dtype": str(rt.model.dtype).removeprefix("torch."),
                "wtype": rt.weights.wtype,
                "device": str(rt.model.device),
                **dataclasses.asdict(config),
            },
        }
    )
    return out
