"""Many questions per document ("questions" on a --jsonl line): the document is prefilled and
compressed once, as --question-after does it (its turn compressed at its end), and every
question, the template's part after the document, is a request of its own on a fork of
that cache (KVManager.fork, kvrun.engine's Request.start) whose turn selects nothing.

The batch runners live here: run_batch (documents in order on one session, a "questions"
line through the engine over that session) and run_parallel (kvrun.engine over several).
run_engine answers a batch on the engine over one or more sessions: a plain line is one
request, a "questions" line a prefill-only request for its document and, once that is
compressed, one request per question; questions of one document and of different documents
share the engine's batched decode steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ContextOverflow, KvrunError
from .longdoc import (
    Doc,
    LongdocJob,
    complete,
    empty_record,
    error_record,
    error_records,
    prepare,
    process,
    prompt_frame,
    read_document,
    todo,
    truncate_ids,
)


@dataclass
class Asked:
    """A "questions" line being answered: its document's ids, each question's turn, and,
    once the document's prefill has ended, the compressed cache the questions fork."""

    doc: Doc
    job: LongdocJob
    ids: list[int]  # the document's turn: the template's head and the document
    turns: dict  # question index -> the template's part after the document (token ids)
    dropped: int  # document tokens cut by --truncate
    base: object = None  # the compressed document (a KVManager no session holds)
    prefill_s: float = 0.0
    kvc: str | None = None  # "loaded" or "saved" with --kv-cache-dir
    left: deque = field(default_factory=deque)  # indexes not yet sent to the engine


def prepare_questions(session, doc: Doc, job: LongdocJob) -> tuple[Asked | None, dict]:
    """The document's turn and each asked question's turn, and the errors of entries that
    cannot be asked ({index: message}); Asked is None when none can. The document is cut to
    leave room for the longest question, so all of them see the same document. A KvrunError
    when the document cannot be read or does not fit, or the template puts the question
    before the document."""
    bad = {
        i: f"questions[{i}] must be a non-empty string"
        for i in doc.items()
        if not isinstance(doc.questions[i], str) or not doc.questions[i].strip()
    }
    good = [i for i in doc.items() if i not in bad]
    if not good:
        return None, bad
    text, template, tok = read_document(doc), job.templates["question"], session.tokenizer
    frames = {i: prompt_frame(tok, template, doc.questions[i], job.chat) for i in good}
    if len({tuple(before) for before, _ in frames.values()}) > 1:
        raise KvrunError(
            'the template asks the question before the document; "questions" need the '
            "{question} slot after {document}"
        )
    before = frames[good[0]][0]
    longest = max(len(after) for _, after in frames.values())
    budget = session.context - len(before) - longest - job.n_predict
    if budget <= 0:
        raise ContextOverflow(
            f"the prompt without the document is {len(before) + longest} tokens with the "
            f"longest question; with -n {job.n_predict} it leaves no room for the document in "
            f"the context of {session.context}"
        )
    doc_ids = tok.encode(text, add_bos=False, special=False)
    kept, dropped = truncate_ids(doc_ids, budget, job.truncate)
    turns = {i: after for i, (_, after) in frames.items()}
    return Asked(doc, job, before + kept, turns, dropped, left=deque(good)), bad


def question_record(asked: Asked, i: int, job: LongdocJob, result) -> dict:
    """The record of question i, from its Result; prompt and prefill figures are the
    question's turn, document_* the shared prefill of the document."""
    doc = asked.doc
    rec = complete(empty_record(doc, job, doc.questions[i], i), result, asked.dropped)
    rec.update(document_tokens=len(asked.ids), document_prefill_s=asked.prefill_s)
    rec["document_kvc"] = asked.kvc
    return rec


class KvcDir:
    """--kv-cache-dir: compressed documents kept as .kvc files (kvrun.kvc) named by the model,
    the KV spec and the document's turn, so a later run with the same ones loads the file
    instead of prefilling."""

    def __init__(self, path: str, rt, spec):
        from ..run import kvc

        self.path, self.rt, self.spec = Path(path), rt, spec
        self.key = json.dumps([kvc.model_identity(rt), kvc.spec_text(spec), spec.dtype])

    def file(self, ids: list[int]) -> Path:
        h = hashlib.sha256((self.key + json.dumps(ids)).encode()).hexdigest()[:40]
        return self.path / f"{h}.kvc"

    def load(self, ids: list[int]):
        """The kept cache of this document turn, or None; a damaged file is a KvrunError."""
        from ..run import kvc

        f = self.file(ids)
        if not f.exists():
            return None
        kv, tokens, _ = kvc.load(f, self.rt, self.spec)
        return kv if tokens == list(ids) else None

    def save(self, ids: list[int], kv) -> None:
        from ..run import kvc

        f = self.file(ids)
        tmp = f.with_name(f.name + ".tmp")
        try:
            kvc.save(tmp, kv, list(ids), self.rt)
            os.replace(tmp, f)  # a run killed mid-write leaves no half file under the name
        except OSError as e:
            raise KvrunError(f"cannot write {f}: {e.strerror or e}") from None


class _Intake:
    """The engine's requests: questions whose document is compressed first (each on a fork
    made as it is sent), then the next line's request; None while documents still prefill."""

    def __init__(self, lines):
        self.lines, self.ready = lines, deque()

    def poll(self):
        from ..run.engine import Request

        while True:
            while self.ready:
                asked = self.ready[0]
                if not asked.left:
                    self.ready.popleft()
                    asked.base = None  # every question holds its own fork now
                    continue
                i, job = asked.left.popleft(), asked.job
                start = (asked.base.fork(), list(asked.ids))
                q = asked.turns[i]
                return Request([], job.n_predict, job.sampling, job.seed, (asked, i), start=start, question=q)  # fmt: skip
            req = next(self.lines, self)
            if req is not None:  # None: a document became ready (loaded from --kv-cache-dir)
                return None if req is self else req


def run_engine(
    sessions, docs, job: LongdocJob, write, done, finish, kv_mem=None, new_kv=None, kvc_dir=None
) -> tuple[int, object]:
    """Answer docs on an engine over `sessions`, skipping records in `done` (None: docs came
    through longdoc.todo already). write(record), then finish(doc, record), as each record
    is done, which is not input order. new_kv() -> a fresh cache for a document's prefill
    (None: a reset fork of the first session's); kvc_dir: a KvcDir. Returns (records failed, engine stats)."""
    from ..run.engine import Engine, Request

    if new_kv is None:
        blank = sessions[0].kv.fork()
        blank.reset()
        new_kv = blank.fork
    failed = 0

    def put(doc: Doc, rec: dict) -> None:
        nonlocal failed
        write(rec)
        failed += rec["error"] is not None
        finish(doc, rec)

    def lines():
        for doc in todo(docs, done, finish) if done is not None else docs:
            if doc.error:
                put(doc, process(None, doc, job))
            elif doc.questions is not None:
                yield from document(doc)
            else:
                try:
                    rec, ids, question, dropped = prepare(sessions[0], doc, job)
                except KvrunError as e:
                    put(doc, error_record(doc, job, str(e)))
                    continue
                tag = (doc, rec, dropped)
                yield Request(ids, job.n_predict, job.sampling, job.seed, tag, question=question)

    def document(doc: Doc):
        try:
            asked, bad = prepare_questions(sessions[0], doc, job)
            t = time.perf_counter()
            kept = kvc_dir.load(asked.ids) if kvc_dir and asked else None
        except KvrunError as e:
            for rec in error_records(doc, job, str(e)):
                put(doc, rec)
            return
        for i, msg in bad.items():
            put(doc, error_record(doc, job, msg, i))
        if kept is not None:
            asked.base, asked.prefill_s, asked.kvc = kept, time.perf_counter() - t, "loaded"
            intake.ready.append(asked)
            yield None
        elif asked is not None:
            box = []
            fresh = lambda: box.append(new_kv()) or box[0]  # noqa: E731
            yield Request(asked.ids, 0, job.sampling, job.seed, (asked, box), new_kv=fresh)

    intake = _Intake(lines())

    def ended(req, result, error) -> None:
        tag = req.tag
        if isinstance(tag[0], Doc):  # a plain line
            doc, rec, dropped = tag
            return put(
                doc, error_record(doc, job, error) if error else complete(rec, result, dropped)
            )
        asked, what = tag
        doc = asked.doc
        if isinstance(what, list):  # the document's prefill: its cache, forked for no one else
            if error is not None:
                for i in asked.left:
                    put(doc, error_record(doc, job, error, i))
                return None
            asked.base, asked.prefill_s = what[0].fork(), result.stats.prefill_s
            if kvc_dir is not None:
                try:
                    kvc_dir.save(asked.ids, asked.base)
                    asked.kvc = "saved"
                except KvrunError as e:
                    for i in asked.left:
                        put(doc, error_record(doc, job, str(e), i))
                    return None
            intake.ready.append(asked)
            return None
        if error is not None:
            return put(doc, error_record(doc, job, error, what))
        return put(doc, question_record(asked, what, job, result))

    engine = Engine(sessions, kv_mem)
    stats = engine.run(intake, ended)
    return failed, stats


def run_batch(
    session, docs: list[Doc], job: LongdocJob, write, done: set[str], start, finish, new_kv=None,
    kvc_dir=None,
) -> int:  # fmt: skip
    """Answer docs in order on one session (a fresh cache each), skipping records in `done`;
    a repeated id gets an error record. start(doc) -> (on_text, progress) runs before each
    answer; write(record), then finish(doc, record or None when skipped), after. A line with
    "questions" runs on the engine over this one session (run_engine), one record a
    question. Returns the number of records that failed."""
    failed = 0
    for doc in todo(docs, done, finish):
        if doc.questions is not None and not doc.error:
            kv = session.kv  # the engine leaves a fork of the document in the session
            try:
                args = (write, None, finish, None, new_kv, kvc_dir)
                failed += run_engine([session], [doc], job, *args)[0]
            finally:
                session.kv = kv
                session.reset()
            continue
        rec = process(session, doc, job, *start(doc))
        write(rec)
        failed += rec["error"] is not None
        finish(doc, rec)
    return failed


def run_parallel(
    sessions, docs: list[Doc], job: LongdocJob, write, done: set[str], finish, kv_mem=None,
    new_kv=None, kvc_dir=None,
) -> tuple[int, object]:  # fmt: skip
    """run_batch on len(sessions) documents at once (kvrun.engine: continuous batching), the
    questions of "questions" lines among them (run_engine). Records are
    written as they finish, which is not input order; a document that fails gets its error
    record and the others go on. Returns (records failed, engine stats)."""
    return run_engine(sessions, docs, job, write, done, finish, kv_mem, new_kv, kvc_dir)
