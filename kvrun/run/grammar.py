"""Structured outputs: token masks from llguidance, applied to the logits before sampling.

llguidance was chosen over xgrammar and outlines-core (bench/README.md, "Grammar masks"): it
reads a `tokenizers` JSON directly, which is what kvrun's Tokenizer holds for every family
(GGUF BPE and SentencePiece included); it builds each mask lazily from a token trie (about
0.2 ms a token on this CPU for the default model's 49k vocabulary, no per-schema
precompilation); it takes JSON schemas, Lark and llama.cpp's GBNF; and its wheel has no
dependencies (xgrammar 0.2.8 needs tvm-ffi; outlines-core builds a full index per schema).

A `Grammars` (one per loaded model: building the token trie takes about a second) compiles
a spec into a `Constraint`, the per-request state: `mask` a logits row, `accept` the drawn
token, `finished` once the grammar can take nothing more. Each sequence of a batch holds its
own Constraint; masks act on logits only, so every --kv method works with them.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import KvrunError

MAX_GRAMMAR_CHARS = 256 * 1024  # a schema or grammar text from a stranger: bounded
# compact JSON: a small model given free whitespace may fill max_tokens with newlines (and
# llguidance 1.9's masks disagree with its parser on a separator's forced space for
# SentencePiece vocabularies, so separators have none)
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(KvrunError):
    """A JSON schema or grammar that does not compile (one line, for the CLI and a 400)."""


@dataclass(frozen=True, slots=True)
class Spec:
    """What to constrain a reply to. kind: "json_schema" (text: the schema as JSON),
    "grammar" (Lark or GBNF text) or "lark" (Lark only, as kvrun builds for tool calls)."""

    kind: str
    text: str

    @staticmethod
    def json_schema(schema: Any) -> Spec:
        """A spec for a JSON schema (a dict, or True/{} for any JSON object)."""
        if schema is True or schema == {}:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be a JSON object")
        return Spec("json_schema", json.dumps(schema))

    @staticmethod
    def json_object() -> Spec:
        """Any JSON object (response_format json_object)."""
        return Spec("json_schema", '{"type": "object"}')


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


class Grammars:
    """Compiles specs for one tokenizer and a logits width of n_vocab (the model's)."""

    def __init__(self, tokenizer, n_vocab: int):
        self.tokenizer, self.n_vocab = tokenizer, n_vocab
        self._ll = None
        self._lock = threading.Lock()  # the server compiles from worker threads

    def ll_tokenizer(self):
        """llguidance's tokenizer (built once: about a second for a 50k vocabulary)."""
        with self._lock:
            if self._ll is None:
                import llguidance

                tok = self.tokenizer
                try:
                    self._ll = llguidance.LLTokenizer(
                        tok._tok.to_str(),
                        n_vocab=max(self.n_vocab, tok.vocab_size),
                        eos_token=sorted(tok.stop_ids) or None,
                    )
                except Exception as e:  # noqa: BLE001 - a vocabulary llguidance cannot read
                    raise GrammarError(
                        f"structured outputs are not available for this tokenizer: {_one_line(e)}"
                    ) from None
            return self._ll

    def grammar_text(self, spec: Spec) -> str:
        """llguidance's grammar for spec; GrammarError for text it cannot convert."""
        import llguidance

        if len(spec.text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the {spec.kind} is over {MAX_GRAMMAR_CHARS} characters")
        try:
            if spec.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    spec.text, defaults=JSON_OPTIONS
                )
            if spec.kind == "lark":
                return llguidance.LLMatcher.grammar_from_lark(spec.text)
            if spec.kind == "grammar":  # Lark, or GBNF converted to Lark
                return llguidance.grammar_from("grammar", spec.text)
        except Exception as e:  # noqa: BLE001 - the converters raise plain exceptions
            raise GrammarError(f"invalid {spec.kind}: {_one_line(e)}") from None
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")

    def compile(self, spec: Spec) -> Constraint:
        """A fresh Constraint for spec; GrammarError for a schema or grammar that does not
        compile. May take up to a second for a large grammar (the server runs it off the
        event loop)."""
        import llguidance

        text = self.grammar_text(spec)
        m = llguidance.LLMatcher(self.ll_tokenizer(), text, log_level=0)
        if m.is_error():
            raise GrammarError(f"invalid {spec.kind}: {_one_line(m.get_error())}")
        return Constraint(m, self.n_vocab)


class Constraint:
    """One sequence's grammar state. mask(row) before sampling, accept(token) after."""

    def __init__(self, matcher, n_vocab: int):
        self.m = matcher
        # llguidance's bitmask, 32 tokens a word (bit j of word w: token 32 w + j). Unpacked
        # with numpy, one thread: a torch op per token would wake the intra-op thread pool,
        # which costs tens of ms on a busy CPU (bench/README.md, "Grammar masks")
        self.bits = np.zeros((n_vocab + 31) // 32, dtype=np.uint32)  # (W,)

    def allowed(self, n: int) -> np.ndarray:
        """(n,) bool: the tokens the grammar takes next."""
        b = self.bits
        self.m.unsafe_compute_mask_ptr(b.ctypes.data, b.nbytes)
        return np.unpackbits(b.view(np.uint8), bitorder="little")[:n].view(bool)  # (n,)

    def mask(self, row: torch.Tensor) -> torch.Tensor:  # (V,) float32 on the CPU
        """row with every token the grammar refuses at -inf (a new tensor)."""
        keep = self.allowed(row.shape[-1])
        return torch.from_numpy(np.where(keep, row.numpy(), np.float32("-inf")))

    def accept(self, token: int) -> None:
        """Advance past a drawn token (one the mask allowed)."""
        if not self.m.consume_token(token):
            raise KvrunError(f"the grammar refused token {token}: {_one_line(self.m.get_error())}")

    @property
    def accepting(self) -> bool:
        """Whether the text so far is complete (an end-of-text token may come)."""
        return self.m.is_accepting()

    @property
    def finished(self) -> bool:
        """Whether the grammar takes no more tokens: the reply ends here."""
        return self.m.is_stopped()


def prepare_row(row: torch.Tensor, constraint, ignore_eos: bool, stop_ids) -> torch.Tensor:
    """The logits to sample from: the grammar's mask, and with ignore_eos the stop tokens
    banned, except where the grammar allows nothing else (its text is complete)."""
    from .sampling import ban

    if constraint is not None:
        row = constraint.mask(row)
        if ignore_eos and not constraint.accepting:
            row = ban(row, stop_ids)
        return row
    return ban(row, stop_ids) if ignore_eos else row
