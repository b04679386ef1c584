"""Long documents: reading, token-level truncation, prompt building, the batch loop with resume."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import ContextOverflow, KvrunError

TRUNCATE_MODES = ("middle", "left", "error")
RESULT_FIELDS = (
    "answer", "tokens", "prompt_tokens", "generated_tokens", "prefill_s", "decode_s",
    "prefill_tok_s", "decode_tok_s", "kv_bytes", "kv_bytes_full", "kv_ratio", "peak_mem_bytes",
    "stop_reason", "ttft_s", "truncated", "dropped_tokens", "document_tokens",
    "document_prefill_s", "document_kvc",
)  # fmt: skip
_NONE = type(None)
_SLOT = "<<kvrun:document>>"  # stands for the document while a chat template renders


@dataclass
class Doc:
    """One document to answer: a FILE argument or a JSONL line."""

    id: str | int | None
    text: str | None = None
    path: str | None = None
    question: str | None = None
    line: int | None = None  # 1-based line of the JSONL input
    error: str | None = None  # a problem found while reading the input
    # "questions": each asked of one compression of the document (longdoc_questions);
    # entries are checked when asked, so a bad one fails alone
    questions: list | None = None
    asked: list[int] | None = None  # the indexes of `questions` still to answer (todo sets it)

    def items(self) -> list[int | None]:
        """What the document gives a record for: each question index still to ask, or None."""
        if self.questions is None or self.error:
            return [None]
        return list(range(len(self.questions))) if self.asked is None else list(self.asked)


@dataclass(frozen=True)
class LongdocJob:
    """What every document of a run is asked, and how; `settings` go into every record."""

    templates: dict  # "question" | "summarize" -> template text with a {document} slot
    default_question: str | None
    summarize: bool
    chat: bool
    n_predict: int
    truncate: str  # one of TRUNCATE_MODES
    sampling: object  # kvrun.sampling.SamplingConfig
    seed: int
    kv: dict  # the KV manager's describe()
    settings: dict
    debug: bool = False
    # the document's turn is compressed before the question (the template's part after the
    # document) arrives as a turn of its own (kvpress's "question not in context")
    question_after: bool = False


def load_template(task: str, path: str | None = None) -> str:
    """prompts/longdoc_<task>.txt, or the user's template file; one final newline is dropped."""
    try:
        if path:
            text = Path(path).read_text("utf-8")
        else:
            text = resources.files("kvrun.prompts").joinpath(f"longdoc_{task}.txt").read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise KvrunError(f"cannot read template {path}: {getattr(e, 'strerror', e)}") from None
    if "{document}" not in text:
        raise KvrunError(f"template {path or task} has no {{document}} slot")
    return text[:-1] if text.endswith("\n") else text


def doc_key(doc_id) -> str:
    """The key that identifies an id across runs (1 and "1" stay distinct)."""
    return json.dumps(doc_id)


def docs_from_jsonl(lines: Iterable[str]) -> list[Doc]:
    """One Doc per non-blank line; a bad line becomes a Doc carrying its error."""
    return list(iter_docs(lines))


def iter_docs(lines: Iterable[str]) -> Iterator[Doc]:
    """docs_from_jsonl one line at a time (a batch streamed, never held whole)."""
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            yield Doc(None, line=n, error=f"line {n}: not valid JSON ({e})")
            continue
        doc_id = obj.get("id") if isinstance(obj, dict) else None
        if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
            yield Doc(None, line=n, error=f'line {n}: not an object with a string or integer "id"')
            continue
        doc = Doc(doc_id, obj.get("text"), obj.get("path"), obj.get("question"), n)
        bad = [k for k in ("text", "path", "question") if not isinstance(obj.get(k), (str, _NONE))]
        if bad or (doc.text is None) == (doc.path is None):
            doc.error = f'"{bad[0]}" must be a string' if bad else 'give one of "text" and "path"'
        elif "questions" in obj:
            doc.questions, doc.error = questions_field(obj)
        yield doc


def questions_field(obj: dict) -> tuple[list | None, str | None]:
    """A line's "questions" (a non-empty list; its entries are checked as they are asked) and
    the line's error, if any."""
    qs = obj["questions"]
    if obj.get("question") is not None:
        return None, 'give "question" or "questions", not both'
    if not isinstance(qs, list) or not qs:
        return None, '"questions" must be a non-empty list of strings'
    return qs, None


def jsonl_lines(path: str) -> Iterator[str]:
    """A JSONL file's lines, read as they are needed (undecodable bytes replaced)."""
    with open(path, "rb") as f:
        for raw in f:
            yield raw.decode("utf-8", errors="replace").rstrip("\r\n")


def count_docs(path: str) -> int:
    """Non-blank lines of a JSONL file, counted without holding it."""
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def read_document(doc: Doc) -> str:
    """The document's text, stripped; a missing file or an empty text is a KvrunError."""
    text = doc.text
    if text is None:
        try:
            text = Path(doc.path).read_text("utf-8", errors="replace")
        except OSError as e:
            raise KvrunError(f"cannot read {doc.path}: {e.strerror or e}") from None
    text = text.strip()
    if not text:
        raise KvrunError("the document is empty")
    return text


def prompt_frame(tokenizer, template: str, question: str | None, chat: bool):
    """Token ids before and after the document: template, question and chat turn around it."""
    head, tail = (s.replace("{question}", question or "") for s in template.split("{document}", 1))
    if chat:
        msg = [{"role": "user", "content": head + _SLOT + tail}]
        text = tokenizer.render_chat(msg, add_generation_prompt=True)
        if text.count(_SLOT) != 1:
            raise KvrunError("the chat template does not keep the document in place; use --raw")
        head, tail = text.split(_SLOT)
    before = tokenizer.encode(head, add_bos=False)
    if tokenizer.add_bos and tokenizer.bos_id is not None and before[:1] != [tokenizer.bos_id]:
        before.insert(0, tokenizer.bos_id)
    return before, tokenizer.encode(tail, add_bos=False)


def truncate_ids(ids: list[int], budget: int, mode: str) -> tuple[list[int], int]:
    """Fit ids into `budget` tokens: middle keeps the first and the last half of the budget (as
    LongBench does), left keeps the tail, error refuses. Returns (kept ids, tokens dropped)."""
    drop = len(ids) - budget
    if drop <= 0:
        return list(ids), 0
    if mode == "error":
        raise ContextOverflow(
            f"the document is {len(ids)} tokens but {budget} fit; "
            "use --truncate middle|left or a larger -c/--ctx-size"
        )
    if mode == "left":
        return list(ids[drop:]), drop
    head = budget // 2
    return list(ids[:head]) + list(ids[len(ids) - (budget - head) :]), drop


def build_prompt(tokenizer, template, question, text, chat, context, n_predict, truncate):
    """Prompt ids for one document, truncated on tokens to leave n_predict tokens of context;
    the template and question are never cut. Returns (ids, document tokens dropped)."""
    before, after = prompt_frame(tokenizer, template, question, chat)
    budget = context - len(before) - len(after) - n_predict
    if budget <= 0:
        raise ContextOverflow(
            f"the prompt without the document is {len(before) + len(after)} tokens; with "
            f"-n {n_predict} it leaves no room for the document in the context of {context}"
        )
    doc_ids = tokenizer.encode(text, add_bos=False, special=False)
    kept, dropped = truncate_ids(doc_ids, budget, truncate)
    return before + kept + after, dropped


def empty_record(
    doc: Doc, job: LongdocJob, question: str | None = None, index: int | None = None
) -> dict:
    """A record with every field present (results None); `task` follows the question;
    `index`: the question's place in the line's "questions" (None: a line without them)."""
    task = "question" if question or index is not None else "summarize" if job.summarize else None
    rec = {"id": doc.id, "line": doc.line, "task": task, "question": question}
    rec["question_index"] = index
    rec.update(dict.fromkeys(RESULT_FIELDS))
    rec.update(kv=job.kv, settings=job.settings, error=None)
    return rec


def prepare(session, doc: Doc, job: LongdocJob) -> tuple[dict, list[int], list[int] | None, int]:
    """The record to fill, the prompt ids, the question turn's ids (--question-after: the
    template's part after the document; else None) and the document tokens dropped; a
    KvrunError when the document cannot be asked (no question, unreadable, no room)."""
    question = doc.question or job.default_question
    if not question and not job.summarize:
        raise KvrunError('no question: the line has no "question" and no --question/--summarize')
    rec = empty_record(doc, job, question)
    text, template = read_document(doc), job.templates[rec["task"]]
    ids, dropped = build_prompt(
        session.tokenizer,
        template,
        question,
        text,
        job.chat,
        session.context,
        job.n_predict,
        job.truncate,
    )
    if not job.question_after:
        return rec, ids, None, dropped
    _, after = prompt_frame(session.tokenizer, template, question, job.chat)
    return rec, ids[: len(ids) - len(after)], ids[len(ids) - len(after) :], dropped


def complete(rec: dict, result, dropped: int) -> dict:
    """The record filled in from a generation Result."""
    rec.update(answer=result.text, tokens=result.tokens, **result.stats.as_dict())
    rec.update(truncated=dropped > 0, dropped_tokens=dropped)
    return rec


def answer_document(session, doc: Doc, job: LongdocJob, on_text=None, progress=None) -> dict:
    """Answer one document on a fresh cache; its record, or a KvrunError."""
    import torch

    rec, ids, question, dropped = prepare(session, doc, job)
    session.reset()
    if session.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(session.device)
    result = session.generate(
        ids,
        job.n_predict,
        job.sampling,
        seed=job.seed,
        on_text=on_text,
        progress=progress,
        question=question,
    )
    return complete(rec, result, dropped)


def error_record(doc: Doc, job: LongdocJob, msg: str, index: int | None = None) -> dict:
    """A document's record (of its question `index`) carrying only its error, on one line."""
    if index is None:
        rec = empty_record(doc, job, doc.question or job.default_question)
    else:
        q = doc.questions[index]
        rec = empty_record(doc, job, q if isinstance(q, str) else None, index)
    return {**rec, "error": " ".join(msg.split())}


def error_records(doc: Doc, job: LongdocJob, msg: str) -> list[dict]:
    """error_record for each record the document still owes (doc.items)."""
    return [error_record(doc, job, msg, i) for i in doc.items()]


def process(session, doc: Doc, job: LongdocJob, on_text=None, progress=None) -> dict:
    """answer_document, with any failure turned into a record whose error is one line."""
    if doc.error:
        return {**empty_record(doc, job, doc.question), "error": doc.error}
    import torch  # loaded with the model by now; the CLI imports this module before that

    try:
        return answer_document(session, doc, job, on_text, progress)
    except KvrunError as e:
        msg = str(e)
    except (MemoryError, torch.cuda.OutOfMemoryError):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        msg = "out of memory; try a smaller -c/--ctx-size or --ubatch"
    except Exception as e:  # noqa: BLE001 - one bad document must not end the batch
        if job.debug:
            raise
        msg = f"{type(e).__name__}: {e}"
    session.reset()
    return error_record(doc, job, msg)


def record_key(doc_id, index: int | None = None) -> str:
    """The key of one record across runs: the id's (doc_key), with its question's index."""
    return doc_key(doc_id) if index is None else json.dumps([doc_id, index])


def prepare_results(path: Path, resume: bool) -> tuple[set[str], str | None]:
    """Keys already answered in OUT. With resume, OUT is rewritten (atomically) without its
    error lines and any half-written line, so appending continues it cleanly. Without resume
    OUT must be empty or absent. Returns (done keys, a note on what was dropped)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return set(), None
    except OSError as e:
        raise KvrunError(f"cannot read --out {path}: {e.strerror}") from None
    if not resume:
        if raw.strip():
            raise KvrunError(f"{path} already holds results; pass --resume to continue it")
        return set(), None
    keep, done, broken, retried = [], set(), 0, 0
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            key = None if rec["id"] is None else record_key(rec["id"], rec.get("question_index"))
        except (ValueError, KeyError, TypeError):
            broken += 1  # a crash mid-write leaves a partial last line
            continue
        if rec.get("error") is not None or key is None or key in done:
            retried += 1
            continue
        done.add(key)
        keep.append(line + b"\n")
    if b"".join(keep) != raw:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(keep))
        os.replace(tmp, path)
    note = f"resuming {path}: {len(done)} done"
    note += f", {retried} error lines to retry" * bool(retried)
    note += f", {broken} unreadable lines dropped" * bool(broken)
    return done, note


def todo(docs: list[Doc], done: set[str], finish):
    """The docs to answer, in order: records whose keys are in `done` are skipped
    (finish(doc, None) for each; a line with "questions" keeps the indexes still to ask in
    doc.asked); a repeated id gets an error."""
    seen = set()
    for doc in docs:
        key = doc_key(doc.id) if doc.id is not None else None
        if key is not None and key in seen and not doc.error:
            doc.error = f"duplicate id {doc.id!r}: an earlier document has it"
        elif key is not None and not doc.error:
            items = doc.items()
            left = [i for i in items if record_key(doc.id, i) not in done]
            for _ in range(len(items) - len(left)):
                finish(doc, None)
            if doc.questions is not None:
                doc.asked = left
            if not left:
                seen.add(key)
                continue
        seen.add(key)
        yield doc
