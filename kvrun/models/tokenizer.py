"""Tokenizers built from GGUF metadata or a Hugging Face folder, as llama.cpp builds them."""

from __future__ import annotations

import base64
import json
import warnings
from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from kvrun.errors import KvrunError, UnsupportedModel
from kvrun.models import chat_template
from kvrun.models.families import pre_tokenizer

# Token types shared by GGUF (tokenizer.ggml.token_type) and SentencePiece models.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Token texts that end generation whatever their id: llama.cpp's EOG texts, and the
# fill-in-the-middle pad / repo / file-separator markers it also stops on (llama-vocab.cpp).
EOG_TEXTS = frozenset(
    {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
     "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
     "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
     "<｜end▁of▁sentence｜>", "[e~[", "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>",
     "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>"}
)  # fmt: skip
# Texts llama.cpp makes control tokens whatever type the GGUF gives them (its EOG and FIM
# markers): Qwen's plain '</s>' is then read as one special token, never as text.
_LLAMACPP_CONTROL = EOG_TEXTS | {
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
    "<|code_prefix|>", "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
    "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>",
    "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
    "<|middle|>", "<PAD>", "[PAD]",
}  # fmt: skip

# Pre-tokenizer regexes of llama.cpp (llama-vocab.cpp), each applied to the pieces of the last.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral Nemo's own regex, which llama.cpp approximates with ASCII case classes.
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEXES = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
    "gpt2": [_GPT2],
    "digits": [r"\p{N}", _GPT2],
    "llama3": [_LLAMA3],
    "qwen2": [_LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")],
    "tekken": [_TEKKEN],
}
# tokenizer.ggml.pre -> (regex set, ignore_merges), named as llama.cpp names them; the
# names a kvrun family's GGUFs carry are in its file (kvrun/models/families/).
_PRE = {
    "": ("default", False), "default": ("default", False),
    **dict.fromkeys(["gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe"], ("gpt2", False)),
    "falcon3": ("llama3", True),
    **dict.fromkeys(["dbrx", "smaug-bpe"], ("llama3", False)),
    **dict.fromkeys(["starcoder", "refact", "codeshell", "command-r", "exaone"], ("digits", False)),
    **dict.fromkeys(["stablelm2", "megrez"], ("qwen2", False)),
}  # fmt: skip
_PRE_ADDS_BOS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "tekken"}  # llama.cpp defaults
# SentencePiece-style BPE kept as 'gpt2' (llama.cpp's GEMMA4 pre-type): '▁' for spaces, raw
# UTF-8 pieces with <0xXX> byte fallback. llama.cpp's converter writes Gemma 3's tokenizer.json
# this way, under the name its hash table gives that vocabulary.
_SPM_BPE_PRE = {"gemma4", "granite-embed-multi-311m"}


def _bpe_backend(tokens: list[str], merges: Sequence[str], pre: str) -> _Backend:
    """Byte-level BPE (tokenizer.ggml.model 'gpt2') with llama.cpp's split for `pre`."""
    known = _PRE.get(pre) or pre_tokenizer(pre)
    if known is None:
        warnings.warn(f"unknown pre-tokenizer {pre!r}; using the GPT-2 split", stacklevel=3)
    regexes, ignore_merges = known or ("gpt2", False)
    # "a b" splits at the first space after index 0, as llama.cpp reads merges
    pairs = [
        tuple(m.split(" ", 1)) if m[:1] != " " else (m[: (cut := m.find(" ", 1))], m[cut + 1 :])
        for m in merges
    ]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = _Backend(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), "isolated") for r in _REGEXES[regexes]]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_bpe_backend(tokens: list[str], merges: Sequence[str]) -> _Backend:
    """'gpt2' vocabulary with a GEMMA4 pre-type: spaces become '▁', text splits into newline
    runs and the rest, ranked merges run on raw UTF-8 and unknown pieces fall back to bytes."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    # llama.cpp keeps a merge whose parts are not tokens (the converter rewrites user-defined
    # '▁▁' as '  '); such a merge only matters on a literal '▁' run, and tokenizers refuses it.
    pairs = [(a, b) for a, b in pairs if a in vocab and b in vocab and a + b in vocab]
    tok = _Backend(models.BPE(vocab, pairs, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), "isolated")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok


def _spm_backend(
    tokens: list[str],
    scores: Sequence[float],
    types: Sequence[int],
    unk: str | None,
    normalizer: Mapping[str, Any],
) -> _Backend:
    """SentencePiece BPE (tokenizer.ggml.model 'llama'): the best-scored pair merges first.
    normalizer: add_dummy_prefix, and from a tokenizer.model also precompiled_charsmap and
    remove_extra_whitespaces (which GGUF does not carry and llama.cpp ignores)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []  # every way to build a normal piece from two pieces, best score first
    for i, (piece, score, kind) in enumerate(zip(tokens, scores, types, strict=True)):
        for k in range(1, len(piece)) if kind == NORMAL else ():
            if piece[:k] in vocab and piece[k:] in vocab:
                ranked.append((-score, i, vocab[piece[:k]], piece[:k], piece[k:]))
    merges = [(r[3], r[4]) for r in sorted(ranked)]
    tok = _Backend(models.BPE(vocab, merges, unk_token=unk, byte_fallback=True, fuse_unk=True))
    prefix = bool(normalizer.get("add_dummy_prefix", True))
    steps = []
    if normalizer.get("precompiled_charsmap"):
        steps.append(normalizers.Precompiled(normalizer["precompiled_charsmap"]))
    if normalizer.get("remove_extra_whitespaces"):
        steps.append(normalizers.Replace(Regex(r"\A +| +\z"), ""))
        steps.append(normalizers.Replace(Regex(" {2,}"), " "))
    steps += [normalizers.Prepend("▁")] * prefix + [normalizers.Replace(" ", "▁")]
    tok.normalizer = normalizers.Sequence(steps)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] * prefix)
    return tok


def _add_special(
    tok: _Backend, tokens: list[str], types: Sequence[int], normalized: bool = False
) -> None:
    """Control and unknown tokens become special added tokens, user-defined ones plain ones.
    normalized: user-defined pieces match the normalized text, as SentencePiece matches its
    own (Gemma's '▁▁' runs); GGUF ones match the raw text, as llama.cpp matches them."""
    kinds = dict(zip(tokens, types, strict=True))
    special = [t for t, k in kinds.items() if k in (CONTROL, UNKNOWN)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    user = [AddedToken(t, normalized=normalized) for t, k in kinds.items() if k == USER_DEFINED]
    tok.add_tokens(user)


def _pb_fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field, value) pairs of one protobuf message: enough to read a SentencePiece model."""

    def varint(i: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            value, shift, i = value | (buf[i] & 0x7F) << shift, shift + 7, i + 1
            if buf[i - 1] < 0x80:
                return value, i

    i = 0
    while i < len(buf):
        key, i = varint(i)
        if key & 7 == 0:
            value, i = varint(i)
        elif key & 7 in (1, 2, 5):
            size, i = varint(i) if key & 7 == 2 else ({1: 8, 5: 4}[key & 7], i)
            value, i = buf[i : i + size], i + size
        else:
            raise KvrunError("tokenizer.model is not a SentencePiece model")
        yield key >> 3, value


def _read_spm(path: Path) -> tuple[_Backend, dict[str, int]]:
    """A tokenizer.model: pieces via sentencepiece; types and normalizer from its proto."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    types, spec = [], {3: 1, 4: 1}  # defaults of add_dummy_prefix, remove_extra_whitespaces
    for field, value in _pb_fields(sp.serialized_model_proto()):
        if field == 1:  # a piece, whose type (field 3) defaults to NORMAL
            types.append(dict(_pb_fields(value)).get(3, NORMAL))
        elif field == 3:  # normalizer_spec
            spec.update(_pb_fields(value))
    names = {2: "precompiled_charsmap", 3: "add_dummy_prefix", 4: "remove_extra_whitespaces"}
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    scores = [sp.get_score(i) for i in range(len(tokens))]
    unk = tokens[sp.unk_id()] if sp.unk_id() >= 0 else None
    tok = _spm_backend(tokens, scores, types, unk, {names[k]: spec[k] for k in names if k in spec})
    _add_special(tok, tokens, types, normalized=True)
    return tok, {k: v for k, v in (("bos", sp.bos_id()), ("eos", sp.eos_id())) if v >= 0}


def _rust_panic(e: BaseException) -> bool:
    """Whether `e` is a panic of the tokenizers library (pyo3's PanicException, which is not
    an Exception): a file it cannot read, where it asserts instead of returning an error."""
    return type(e).__name__ == "PanicException"


def _unpanicked(run: Any) -> Any:
    """run(), a tokenizers call, with a panic of the library (a damaged vocabulary it only
    trips over on some text) as one KvrunError line instead of a traceback."""
    try:
        return run()
    except BaseException as e:
        if not _rust_panic(e):
            raise
        why = " ".join(str(e).split())[:200]
        raise KvrunError(
            f"the tokenizer fails on this text ({why}); its files are damaged"
        ) from None


_PROBE = " Hello, world!  12 345\n\tx"  # spaces, digits, punctuation: what most paths take


def _nested(node: Any, key: str) -> Iterator[dict]:
    """A tokenizer.json component and, for a Sequence, the components it holds under `key`."""
    if isinstance(node, dict):
        yield node
        for child in node.get(key) or () if node.get("type") == "Sequence" else ():
            yield from _nested(child, key)


def _check_prefix(model: dict, path: Path) -> None:
    """BPE with a continuing-subword prefix: the library cuts the prefix off every merge's
    second part, and panics where that part does not start with it."""
    prefix = model.get("continuing_subword_prefix") or ""
    for m in model.get("merges") or ():
        second = m.split(" ", 1)[-1] if isinstance(m, str) else m[-1] if m else ""
        if isinstance(second, str) and not second.startswith(prefix):
            raise KvrunError(
                f"{path}: the merge {m!r:.60} does not start its second part with the "
                f"continuing_subword_prefix {prefix!r:.20}"
            )


def _read_tokenizer_json(path: Path) -> _Backend:
    """A tokenizer.json, checked where the tokenizers library would panic on a damaged one (a
    charsmap it cannot parse, a template naming a token it lacks), without its padding and
    truncation: a prompt is encoded whole (a file may pad every prompt to 10^9 ids)."""
    text = path.read_text("utf-8")
    if '"Precompiled"' in text:  # Python's constructor raises where the file reader panics
        for node in _nested(json.loads(text).get("normalizer"), "normalizers"):
            if node.get("type") == "Precompiled":
                normalizers.Precompiled(base64.b64decode(node.get("precompiled_charsmap") or ""))
    if '"continuing_subword_prefix": "' in text.replace('":"', '": "'):
        _check_prefix(json.loads(text).get("model") or {}, path)
    backend = _Backend.from_str(text)
    backend.no_padding()
    backend.no_truncation()
    if backend.post_processor is not None:
        state = json.loads(backend.post_processor.__getstate__())
        for node in _nested(state, "processors"):
            specials = node.get("special_tokens") or {}
            for piece in [*node.get("single", ()), *node.get("pair", ())]:
                name = piece.get("SpecialToken", {}).get("id")
                entry = specials.get(name, {})
                if name is not None and len(entry.get("ids", ())) != len(entry.get("tokens", [0])):
                    raise KvrunError(
                        f"{path}: the post-processor's template names the special token "
                        f"{name!r}, which it does not define"
                    )
    return backend


def _gguf_backend(
    meta: Mapping[str, Any], kind: str, tokens: list[str], types: list[int]
) -> tuple[_Backend, int | None, int | None, bool]:
    """The backend of a GGUF vocabulary, with llama.cpp's default (bos, eos, add_bos)."""
    if kind == "gpt2":
        if "tokenizer.ggml.merges" not in meta:
            raise UnsupportedModel("the GGUF BPE tokenizer has no tokenizer.ggml.merges")
        pre = str(meta.get("tokenizer.ggml.pre") or "")
        if pre in _SPM_BPE_PRE:
            backend = _spm_bpe_backend(tokens, meta["tokenizer.ggml.merges"])
        else:
            backend = _bpe_backend(tokens, meta["tokenizer.ggml.merges"], pre)
        bos, eos, add_bos = None, None, pre in _PRE_ADDS_BOS
    elif kind == "llama":
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
        unk = tokens[unk] if 0 <= unk < len(tokens) else None
        prefix = {"add_dummy_prefix": meta.get("tokenizer.ggml.add_space_prefix", True)}
        backend = _spm_backend(tokens, scores, types, unk, prefix)
        bos, eos, add_bos = 1, 2, True  # llama.cpp's SentencePiece defaults
    else:
        supported = "supported: gpt2, llama"
        raise UnsupportedModel(f"tokenizer type {kind!r} is not supported ({supported})")
    _add_special(backend, tokens, types)
    return backend, bos, eos, add_bos


# --- llama.cpp's conversion rules, for convert/hf_to_gguf.py ----------------------------------

_HF_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"  # llama.cpp spells it out case by case
_LLAMACPP_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_PRE_OF_REGEX = {_REGEXES["llama3"][0]: "llama-bpe", _REGEXES["qwen2"][0]: "qwen2",
                 _REGEXES["tekken"][0]: "tekken", _GPT2: "gpt2"}  # fmt: skip


def bpe_pre_name(tok_json: Mapping[str, Any]) -> str | None:
    """llama.cpp's tokenizer.ggml.pre for a byte-level BPE tokenizer.json ('qwen2',
    'llama-bpe', 'tekken', 'smollm', 'gpt2'), read off its pre-tokenizer; None if unknown."""

    def flat(node: Any) -> list[dict]:
        if not node:
            return []
        return (
            [s for c in node.get("pretokenizers", []) for s in flat(c)]
            if node.get("type") == "Sequence"
            else [node]
        )

    steps = flat(tok_json.get("pre_tokenizer"))
    regexes = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    if any(s.get("type") == "Digits" and s.get("individual_digits") for s in steps):
        return "smollm" if not regexes else None
    if len(regexes) == 1 and regexes[0]:
        return _PRE_OF_REGEX.get(regexes[0].replace(_HF_CONTRACTIONS, _LLAMACPP_CONTRACTIONS))
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    return "gpt2" if not regexes and byte_level and byte_level[0].get("use_regex", True) else None


def looks_special(text: str) -> bool:
    """llama.cpp's converter's test for added tokens that are control tokens though the
    tokenizer does not mark them special (<|...|>, <unused..>, Gemma's <mask>, <pad>)."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<｜") and text.endswith("｜>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


def gguf_added_token(text: str, special: bool) -> tuple[str, int]:
    """(text, type) of a tokenizer.json added token as llama.cpp's converter writes it:
    CONTROL when special or looking special, else USER_DEFINED with '▁' written as ' ' (so
    Gemma's space runs match raw text, as llama.cpp matches user-defined tokens)."""
    if special or looks_special(text):
        return text, CONTROL
    return text.replace("▁", " "), USER_DEFINED


def bpe_json_vocab(
    tok_json: Mapping[str, Any], vocab_size: int
) -> tuple[list[str], list[int], list[str]]:
    """(tokens, types, merges) of the 'gpt2' GGUF vocabulary for a byte-level BPE
    tokenizer.json (Qwen 2/3, Llama 3), as llama.cpp's converter writes it."""
    model = tok_json["model"]
    by_id = {i: (t, NORMAL) for t, i in model["vocab"].items()}
    for a in tok_json.get("added_tokens", []):
        by_id[a["id"]] = gguf_added_token(a["content"], bool(a.get("special")))
    n = max(vocab_size, max(by_id) + 1)
    tokens, types = zip(*(by_id.get(i, (f"[PAD{i}]", UNUSED)) for i in range(n)), strict=True)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return list(tokens), list(types), merges


def spm_json_vocab(
    tok_json: Mapping[str, Any], vocab_size: int
) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) of the 'llama' GGUF vocabulary for a SentencePiece BPE kept as
    tokenizer.json (Llama 2, Mistral, Gemma 3), as llama.cpp's converter types it: added
    added tokens as gguf_added_token says, bytes BYTE, the unknown piece UNKNOWN. Scores: minus the rank of the merge that first makes a piece, so best-score-first merging
    (llama.cpp's and kvrun's) gives the folder's own tokens; added tokens -1000."""
    model = tok_json["model"]
    merges = model.get("merges", [])
    rank: dict[str, int] = {}
    for r, m in enumerate(merges):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        rank.setdefault(a + b, r)
    by_id = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tok_json.get("added_tokens", [])}
    n = max(vocab_size, max(by_id) + 1, max(added, default=-1) + 1)
    unk = model.get("unk_token")
    rows: list[tuple[str, float, int]] = []  # (token, score, type)
    for i in range(n):
        piece, a = by_id.get(i), added.get(i)
        if a is not None:
            text, kind = gguf_added_token(a["content"], bool(a.get("special")))
            rows.append((text, -1000.0, UNKNOWN if text == unk else kind))
        elif piece is None:
            rows.append((f"[PAD{i}]", -1000.0, UNUSED))
        else:
            kind = UNKNOWN if piece == unk else NORMAL
            kind = BYTE if len(piece) == 6 and piece[:3] == "<0x" and piece[5] == ">" else kind
            score = -float(rank.get(piece, len(merges) + i)) if kind == NORMAL else 0.0
            rows.append((piece, score, kind))
    tokens, scores, types = map(list, zip(*rows, strict=True))
    return tokens, scores, types


class Tokenizer:
    """Text <-> token ids, special tokens, end-of-generation ids and the chat template."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_id: int | None,
        eos_id: int | None,
        stop_ids: set[int],
        add_bos: bool,
        add_eos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._tok = backend
        self.bos_id, self.eos_id = bos_id, eos_id
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        by_text = {backend.token_to_id(t) for t in EOG_TEXTS}
        self.stop_ids = frozenset(i for i in {*stop_ids, eos_id, *by_text} if i is not None)
        self.add_bos, self.add_eos = add_bos, add_eos
        self.chat_template = chat_template or None

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata: {name: field.contents()} of a gguf.GGUFReader."""
        kind, tokens = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.tokens")
        if kind is None or tokens is None:
            raise UnsupportedModel("the GGUF file has no tokenizer (tokenizer.ggml.* missing)")
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise KvrunError("the GGUF's tokenizer.ggml.tokens is not a list of strings")
        template = meta.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise KvrunError("the GGUF's tokenizer.chat_template is not a string")
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # llama.cpp's names
        try:
            types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
            types = [
                CONTROL if t in _LLAMACPP_CONTROL else k for t, k in zip(tokens, types, strict=True)
            ]
            backend, bos, eos, add_bos = _gguf_backend(meta, kind, tokens, types)
            backend.encode(_PROBE)  # a vocabulary the library trips over fails here
        except KvrunError:
            raise
        except BaseException as e:  # a malformed vocabulary or merge list; a library panic
            if not isinstance(e, Exception) and not _rust_panic(e):
                raise
            why = " ".join(str(e).split())[:200]
            raise UnsupportedModel(f"cannot build the GGUF tokenizer: {why}") from None

        def special(name: str, default: int | None = None) -> int | None:
            value = meta.get(f"tokenizer.ggml.{name}_token_id")
            if not isinstance(value, int) or isinstance(value, bool):
                return default  # absent, or not an id (a damaged file)
            return value if 0 <= value < len(tokens) else default

        return cls(
            backend,
            bos_id=special("bos", bos),
            eos_id=special("eos", eos),
            stop_ids={special("eot"), special("eom")} - {None},
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
            or str(meta.get("tokenizer.ggml.pre")) in _SPM_BPE_PRE,  # llama.cpp forces BOS there
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=template,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face folder: tokenizer.json, else tokenizer.model, plus configs."""
        path = Path(path)
        config, generation = (
            _json_file(path / n) for n in ("tokenizer_config.json", "generation_config.json")
        )
        has_json = (path / "tokenizer.json").is_file()
        if not has_json and not (path / "tokenizer.model").is_file():
            raise KvrunError(f"no tokenizer.json or tokenizer.model in {path}")
        try:
            if has_json:
                backend, ids = _read_tokenizer_json(path / "tokenizer.json"), {}
            else:
                backend, ids = _read_spm(path / "tokenizer.model")
            backend.encode(_PROBE)  # a vocabulary the library trips over fails here, named
        except KvrunError:
            raise
        except BaseException as e:  # a malformed tokenizer.json or tokenizer.model
            if not isinstance(e, Exception) and not _rust_panic(e):
                raise
            why = " ".join(str(e).split())[:200]  # a library's message may quote the file
            if not has_json:
                raise KvrunError(
                    f"{path / 'tokenizer.model'} is not a SentencePiece model ({why})"
                ) from None
            _json_file(path / "tokenizer.json")  # not JSON at all: says so
            raise KvrunError(
                f"{path / 'tokenizer.json'} is not a tokenizer the tokenizers library reads ({why})"
            ) from None
        for name in ("bos", "eos"):
            text = config.get(f"{name}_token")
            text = text.get("content") if isinstance(text, dict) else text
            if text is not None and not isinstance(text, str):
                raise KvrunError(
                    f"{path / 'tokenizer_config.json'}: {name}_token is {_kind(text)}, not a "
                    "token's text"
                )
            if text is not None and backend.token_to_id(text) is not None:
                ids[name] = backend.token_to_id(text)
        where = f"{path / 'generation_config.json'}: eos_token_id"
        gen_eos = _ids_field(generation.get("eos_token_id"), where)
        bos, eos = ids.get("bos"), ids.get("eos", gen_eos[0] if gen_eos else None)
        # Without add_bos_token, see whether the post-processor adds BOS (Llama 3's does).
        default_bos = bos in backend.encode("").ids[:1] if has_json else True
        template = _hf_template(config.get("chat_template"), path / "tokenizer_config.json")
        if template is None and (path / "chat_template.jinja").is_file():
            try:
                template = (path / "chat_template.jinja").read_text("utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise KvrunError(f"cannot read {path / 'chat_template.jinja'} ({e})") from None
        return cls(
            backend,
            bos_id=bos,
            eos_id=eos,
            stop_ids=set(gen_eos),
            add_bos=bool(config.get("add_bos_token", default_bos)) and bos is not None,
            add_eos=bool(config.get("add_eos_token", False)) and eos is not None,
            chat_template=template,
        )

    @cached_property
    def _plain(self) -> _Backend:
        """A twin that reads control-token texts as ordinary text, for encode(special=False)."""
        twin = _Backend.from_str(self._tok.to_str())
        twin.encode_special_tokens = True
        return twin

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of `text`. special: control-token texts map to their ids (llama.cpp's
        parse_special). add_bos None follows the model (BOS, and EOS if the model adds one);
        False adds neither. A BOS already at the start is never doubled."""
        backend = self._tok if special else self._plain
        ids = _unpanicked(lambda: backend.encode(text, add_special_tokens=False).ids)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = ids if ids[:1] == [self.bos_id] else [self.bos_id, *ids]
        if self.add_eos and add_bos is not False and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`; skip_special drops control tokens such as <|im_end|>."""
        ids = [int(i) for i in ids]
        return _unpanicked(lambda: self._tok.decode(ids, skip_special_tokens=skip_special))

    def id_limit(self) -> int:
        """One past the largest id this tokenizer gives (a tokenizer.json's may leave gaps)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def token_text(self, token_id: int | None) -> str:
        """The vocabulary entry of one id ('' for None), e.g. '<|im_start|>'."""
        return "" if token_id is None else self._tok.id_to_token(int(token_id)) or ""

    def stream(self, skip_special: bool = False, after: int | None = None) -> StreamDecoder:
        """An incremental decoder whose pieces concatenate to decode(all ids pushed). after: the
        id just before the first pushed one (say the prompt's last), so that the first piece
        keeps the SentencePiece leading space that decode() strips at the start of a text."""
        return StreamDecoder(self, skip_special, after)

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for `messages`: the model's template, else the ChatML fallback."""
        template = self.chat_template or chat_template.fallback_template()
        bos, eos = self.token_text(self.bos_id), self.token_text(self.eos_id)
        return chat_template.render(template, messages, add_generation_prompt, bos, eos, **extra)

    def save_hf(self, out_dir: str | Path, model_max_length: int | None = None) -> None:
        """Write tokenizer.json and tokenizer_config.json that transformers loads to equal ids."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        backend = _Backend.from_str(self._tok.to_str())
        # transformers adds BOS/EOS through the post-processor: bake in what encode() adds.
        bos = [self.token_text(self.bos_id)] if self.add_bos and self.bos_id is not None else []
        eos = [self.token_text(self.eos_id)] if self.add_eos and self.eos_id is not None else []
        backend.post_processor = processors.TemplateProcessing(
            single=[*bos, "$A", *eos],
            pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
            special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys(bos + eos)],
        )
        backend.save(str(out / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.token_text(self.bos_id) or None,
            "eos_token": self.token_text(self.eos_id) or None,
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
            "model_max_length": model_max_length,
        }
        config = {k: v for k, v in config.items() if v is not None}
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        (out / "tokenizer_config.json").write_text(text, "utf-8")


class StreamDecoder:
    """Turns ids into text one at a time, holding back incomplete UTF-8 sequences."""

    def __init__(
        self, tokenizer: Tokenizer, skip_special: bool = False, after: int | None = None
    ) -> None:
        self._decode = lambda ids: tokenizer.decode(ids, skip_special)
        self._ids: list[int] = [] if after is None else [int(after)]
        self._start = 0  # decode window start: SentencePiece strips the window's first space
        self._read = len(self._ids)  # ids before this are already returned (or context)

    def _emit(self, final: bool) -> str:
        text = self._decode(self._ids[self._start :])
        if not final and text.endswith("\ufffd"):  # a multi-byte character is still open
            return ""
        new = text[len(self._decode(self._ids[self._start : self._read])) :]
        if new:  # a window never starts on text-less ids, whose strip would eat a real space
            self._start = self._read
        self._read = len(self._ids)
        return new

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (maybe '')."""
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character becomes U+FFFD)."""
        return self._emit(final=True) if self._read < len(self._ids) else ""


def _json_file(path: Path) -> dict:
    """A JSON config next to the tokenizer ({} when absent), or a one-line error."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text("utf-8"))
    except (ValueError, OSError) as e:
        raise KvrunError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise KvrunError(f"{path} holds {_kind(value)}, not a JSON object")
    return value


def _kind(value: Any) -> str:
    """A JSON value's type in words, for errors ('a list', 'the number 1.5')."""
    if isinstance(value, (bool, int, float)) or value is None:
        return f"the value {json.dumps(value)[:20]}"
    return {str: "a string", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__
    )


def _ids_field(value: Any, where: str) -> list[int]:
    """A config's token id or list of ids (generation_config.json's eos_token_id), checked:
    ints a tokenizer can hold (u32), else a one-line error naming the field. Ids past the
    vocabulary may still be the model's (its embedding rows): the loader checks those."""
    items = value if isinstance(value, list) else [] if value is None else [value]
    for v in items:
        if not isinstance(v, int) or isinstance(v, bool):
            raise KvrunError(f"{where} holds {_kind(v)}, not a token id")
        if not 0 <= v < 1 << 32:
            raise KvrunError(f"{where} {v} is not a token id")
    return items


def _hf_template(value: Any, where: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} (the
    one named 'default', else the first); anything else is a one-line error."""
    if value is None or isinstance(value, str):
        return value
    named = {}
    if isinstance(value, list):
        for t in value:
            if not (isinstance(t, dict) and isinstance(t.get("template"), str)):
                named = None
                break
            named[t.get("name")] = t["template"]
    if named is None or not isinstance(value, list):
        raise KvrunError(
            f"{where}: chat_template is {_kind(value)}, not a template or a list of "
            "{name, template}"
        )
    return named.get("default", next(iter(named.values()), None))
