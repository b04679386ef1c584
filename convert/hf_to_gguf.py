"""HF safetensors directory -> GGUF file, laid out as llama.cpp's own converter writes it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from kvrun.errors import KvrunError
from kvrun.models.config import ModelConfig
from kvrun.models.file_headers import GGUF_TOP, ROPE_TENSORS, block_parts, gguf_name_to_hf
from kvrun.models.rope import inverse_frequencies
from kvrun.models.tokenizer import bpe_json_vocab, bpe_pre_name, spm_json_vocab
from kvrun.models.weights import fuse, load_safetensors, permute_qk

Progress = Callable[[int, int], None]
Q = gguf.GGMLQuantizationType

OUTTYPES = {  # outtype -> (type of 2-D weights, general.file_type)
    "f32": (Q.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
# llama.cpp names, the inverse of the loader's maps (the RoPE tensors are written separately)
_TOP = {hf: name for name, hf in GGUF_TOP.items() if name not in ROPE_TENSORS}


def gguf_name(hf: str, arch: str = "llama") -> str:
    """The llama.cpp tensor name for a canonical (HF) tensor name of a family."""
    parts = {h: n for n, h in block_parts(arch).items()}
    stem, kind = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        block, part = stem.removeprefix("model.layers.").split(".", 1)
        name = f"blk.{block}.{parts[part]}.{kind}" if part in parts else None
    else:
        name = f"{_TOP[stem]}.{kind}" if stem in _TOP else None
    if name is None or gguf_name_to_hf(name, arch) != hf:
        raise KvrunError(f"tensor {hf} has no llama.cpp name in a {arch!r} model")
    return name


def _encode(w: torch.Tensor, qtype: Q) -> tuple[np.ndarray, Q | None]:
    """(data, raw_dtype) for GGUFWriter.add_tensor; 1-D tensors always stay F32."""
    a = w.float().numpy()
    if a.ndim == 1 or qtype == Q.F32:
        return a, None
    if qtype == Q.F16:
        return a.astype(np.float16), None
    if qtype == Q.Q8_0 and a.shape[-1] % 32:
        return a.astype(np.float16), None  # rows Q8_0 cannot block: F16, as llama.cpp does
    return gguf.quants.quantize(a, qtype), qtype


# ----------------------------------------------------------------------- tokenizer
def _bpe_pre(tok_json: dict, tok_cfg: dict) -> str:
    """llama.cpp's pre-tokenizer name: as recorded by gguf -> hf, else read off tokenizer.json."""
    if tok_cfg.get("gguf_pre"):
        return str(tok_cfg["gguf_pre"])
    return bpe_pre_name(tok_json) or "gpt2"


def _add_bpe(w: gguf.GGUFWriter, tok_json: dict, tok_cfg: dict, vocab_size: int) -> None:
    tokens, types, merges = bpe_json_vocab(tok_json, vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_bpe_pre(tok_json, tok_cfg))
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    w.add_token_merges(merges)


def _add_spm(
    w: gguf.GGUFWriter, src: Path, tok_json: dict | None, vocab_size: int, prefix=None
) -> None:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        kind = gguf.TokenType.NORMAL
        if sp.is_unknown(i):
            kind = gguf.TokenType.UNKNOWN
        elif sp.is_control(i):
            kind = gguf.TokenType.CONTROL
        elif sp.is_unused(i):
            kind = gguf.TokenType.UNUSED
        elif sp.is_byte(i):
            kind = gguf.TokenType.BYTE
        types.append(kind)
    n_sp = len(tokens)
    for a in (tok_json or {}).get("added_tokens", []):
        if a["id"] < n_sp and types[a["id"]] != gguf.TokenType.NORMAL:
            continue  # <unk>, <s>, </s>: SentencePiece's own type is the right one
        if a["id"] >= len(tokens):
            tokens += [f"[PAD{i}]" for i in range(len(tokens), a["id"] + 1)]
            scores += [-1000.0] * (a["id"] + 1 - len(scores))
            types += [gguf.TokenType.UNUSED] * (a["id"] + 1 - len(types))
        tokens[a["id"]] = a["content"]
        types[a["id"]] = gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    _write_llama_vocab(w, tokens, scores, types, tok_json, prefix=prefix)


def _write_llama_vocab(
    w: gguf.GGUFWriter,
    tokens,
    scores,
    types,
    tok_json: dict | None,
    prefix_key: bool = True,
    prefix: bool | None = None,
) -> None:
    """llama.cpp's SentencePiece vocabulary ('llama'): pieces, scores, types, dummy prefix
    (without prefix_key, add_space_prefix is written only when false: llama.cpp's default is
    true and its converter writes no such key for a tokenizer.json folder)."""
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types([int(t) for t in types])
    if prefix is not None:  # the family says (Gemma 3: none, as llama.cpp's converter writes)
        prepend = prefix
    elif tok_json is None:
        prepend = True  # SentencePiece's default (add_dummy_prefix)
    else:  # HF writes the dummy prefix as a Prepend normalizer or a Metaspace pre-tokenizer
        spec = json.dumps([tok_json.get("normalizer"), tok_json.get("pre_tokenizer")])
        prepend = '"Prepend"' in spec or '"prepend_scheme": "always"' in spec
    if prefix_key or not prepend:
        w.add_add_space_prefix(prepend)


def _is_spm_bpe(tok_json: dict) -> bool:
    """A SentencePiece BPE kept as tokenizer.json (Llama 2, Mistral): pieces with '▁' for
    spaces and byte fallback, unlike byte-level BPE (GPT-2, Llama 3)."""
    model = tok_json["model"]
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def _add_spm_json(w: gguf.GGUFWriter, tok_json: dict, vocab_size: int) -> None:
    """A SentencePiece BPE folder without tokenizer.model (Llama 2 / Mistral style, Gemma 3),
    written as the 'llama' vocabulary llama.cpp's converter writes for it; the scores rank
    the merges (kvrun.models.tokenizer.spm_json_vocab), where llama.cpp's writes -1000 for all."""
    tokens, scores, types = spm_json_vocab(tok_json, vocab_size)
    _write_llama_vocab(w, tokens, scores, types, tok_json, prefix_key=False)


def _add_tokenizer(
    w: gguf.GGUFWriter, src: Path, tok, vocab_size: int, prefix: bool | None = None
) -> None:
    tj_path, tc_path = src / "tokenizer.json", src / "tokenizer_config.json"
    tok_json = json.loads(tj_path.read_text()) if tj_path.exists() else None
    tok_cfg = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    spm = (src / "tokenizer.model").exists()
    if spm:
        _add_spm(w, src, tok_json, vocab_size, prefix)
    elif tok_json is not None and _is_spm_bpe(tok_json):
        _add_spm_json(w, tok_json, vocab_size)
        spm = True
    elif tok_json is not None and tok_json["model"].get("type") == "BPE":
        _add_bpe(w, tok_json, tok_cfg, vocab_size)
    else:
        raise KvrunError(f"{src} has no tokenizer.json (BPE) or tokenizer.model (SentencePiece)")
    if tok.bos_id is not None:
        w.add_bos_token_id(int(tok.bos_id))
    if tok.eos_id is not None:
        w.add_eos_token_id(int(tok.eos_id))
    unk = (tok_json or {}).get("model", {}).get("unk_token") if spm else None
    if unk is not None and unk in (tok_json or {}).get("model", {}).get("vocab", {}):
        w.add_unk_token_id(int(tok_json["model"]["vocab"][unk]))  # as llama.cpp writes it
    w.add_add_bos_token(bool(tok.add_bos))
    w.add_add_eos_token(bool(tok.add_eos))
    w.add_add_sep_token(bool(tok_cfg.get("add_sep_token", False)))
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)


# ------------------------------------------------------------------------- weights
def _add_hparams(w: gguf.GGUFWriter, c: ModelConfig, name: str, file_type: int) -> None:
    w.add_name(name)
    w.add_file_type(int(file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(c.n_layers)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.dim)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.rotary_dim or c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    if c.sliding_window:
        w.add_sliding_window(c.sliding_window)
    if c.local_layers is not None and c.sliding_window:
        w.add_rope_freq_base_swa(c.rope_local_theta)
        if c.local_layers != tuple(i for i in range(c.n_layers) if i % 6 < 5):
            w.add_sliding_window_pattern([bool(c.window(i)) for i in range(c.n_layers)])
    if c.final_softcap is not None:
        w.add_final_logit_softcapping(c.final_softcap)
    s = c.rope_scaling
    if s is not None and s.kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(s.factor)
    elif s is not None and s.kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.factor)
        w.add_rope_scaling_orig_ctx_len(s.original_context)
        w.add_rope_scaling_yarn_beta_fast(s.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(s.beta_slow)
        if s.attention_factor is not None:
            w.add_rope_scaling_yarn_attn_factor(s.attention_factor)
    elif s is not None and s.kind == "longrope":  # the factors are tensors (`_add_rope`)
        w.add_rope_scaling_orig_ctx_len(s.original_context)
        w.add_rope_scaling_attn_factors(s.magnitude())


def _add_rope(w: gguf.GGUFWriter, c: ModelConfig) -> None:
    """RoPE scaling that llama.cpp keeps as tensors: Llama 3's divisors, LongRoPE's factors."""
    s = c.rope_scaling
    if s is not None and s.kind == "llama3":
        # llama.cpp keeps llama3 scaling as per-pair divisors of the base frequencies
        base = inverse_frequencies(c.replace(rope_scaling=None))
        w.add_tensor("rope_freqs.weight", (base / inverse_frequencies(c)).numpy())
    elif s is not None and s.kind == "longrope":
        for kind, f in (("long", s.long_factor), ("short", s.short_factor)):
            w.add_tensor(f"rope_factors_{kind}.weight", np.array(f, dtype=np.float32))


def hf_to_gguf(
    src: Path,
    dst: Path,
    outtype: str = "auto",
    progress: Progress | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert an HF directory of a family kvrun runs to one GGUF file at dst."""
    src, dst = Path(src), Path(dst)
    if outtype != "auto" and outtype not in OUTTYPES:
        raise KvrunError(
            f"unsupported outtype {outtype!r} for safetensors -> GGUF (choose: auto, {', '.join(OUTTYPES)})"
        )
    try:  # read in the source precision: an 8B model in f32 would need 32 GB
        declared = json.loads((src / "config.json").read_text())
        declared = declared.get("torch_dtype") or declared.get("dtype")
    except (OSError, ValueError):
        declared = None
    halves = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    lw = load_safetensors(src, halves.get(str(declared), torch.float32))
    if outtype == "auto":  # keep the source precision, as llama.cpp's converter does
        kinds = set(lw.tensor_types)
        outtype = "bf16" if "bfloat16" in kinds else "f16" if "float16" in kinds else "f32"
    if dst.is_dir():
        dst = dst / f"{src.resolve().name}.{outtype}.gguf"
    if dst.exists() and not overwrite:
        raise KvrunError(f"{dst} exists (pass --overwrite to replace it)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    c = lw.config
    qtype, file_type = OUTTYPES[outtype]

    fam = c.family
    arch = fam.gguf_writes or c.arch  # llama.cpp files Mistral as "llama"
    w = gguf.GGUFWriter(str(dst), arch)
    _add_hparams(w, c, c.name or src.resolve().name, file_type)
    w.add_type("model")
    n_params = sum(t.numel() for k, t in lw.tensors.items() if "rotary_emb" not in k)
    w.add_size_label(gguf.size_label(n_params, 0, 0, 0))  # "8.0B", as llama.cpp labels it
    _add_tokenizer(w, src, lw.tokenizer, c.vocab_size, fam.spm_space_prefix)
    _add_rope(w, c)
    fuse(lw.tensors, c)  # the family's fused weights (Phi-3's), as its files keep them
    names = list(lw.tensors)
    for i, hf in enumerate(names):
        t = lw.tensors.pop(hf)  # free as we go: the writer keeps only encoded data
        if "rotary_emb" in hf:  # old checkpoints store RoPE tables; llama.cpp recomputes them
            continue
        if fam.permuted_qk and hf.endswith("q_proj.weight"):
            t = permute_qk(t, c.n_heads)
        elif fam.permuted_qk and hf.endswith("k_proj.weight"):
            t = permute_qk(t, c.n_kv_heads)
        data, raw = _encode(t, qtype)
        w.add_tensor(gguf_name(hf, c.arch), data, raw_dtype=raw)
        if progress:
            progress(i + 1, len(names))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    except BaseException:
        w.close()
        dst.unlink(missing_ok=True)  # never leave a truncated GGUF behind
        raise
    w.close()
    return dst
