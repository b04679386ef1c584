"""Tiny random Llama / Mistral models for tests: an HF directory and the same weights as GGUF.

The GGUF is written here with `gguf.GGUFWriter` directly (llama.cpp tensor names, Q/K rows
permuted as llama.cpp's converter does), never through `kvrun.convert`, so loader tests
stay independent of the converter.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

VOCAB = 300
SPM_VOCAB = 400  # SentencePiece needs room for 256 byte pieces plus every character
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A tiny model reads 12345 tokens and writes 678 more, then stops.",
    "Llamas and mistrals share one decoder: attention, a gated MLP, and RMS norms.",
    "The cache keeps keys and values; compressed caches keep fewer of them.",
    "Hello world! How are you today? I am fine, thank you, and you?",
    "Rotary embeddings turn positions into angles; scaling stretches them.",
]
TEXT = "Hello world! The quick fox reads 2024 keys, and the llama keeps the values."

_BLOCK = {  # HF block tensor -> llama.cpp name
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


@dataclass
class Tiny:
    """One tiny model in both formats."""

    hf: torch.nn.Module  # transformers LlamaForCausalLM / MistralForCausalLM, fp32, eval
    hf_dir: Path
    gguf_path: Path
    tokenizer: object  # tokenizers.Tokenizer, or sentencepiece.SentencePieceProcessor (spm)

    def logits(self, ids: list[int]) -> torch.Tensor:
        """HF's logits (T, V) for one sequence."""
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0].float()


@functools.lru_cache(maxsize=2)
def _tokenizer_json(digits: bool) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if digits
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok.to_str()


def make_tokenizer(digits: bool = False):
    """A byte-level BPE tokenizer with VOCAB tokens (SmolLM-style digit split if asked)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json(digits))


@functools.lru_cache(maxsize=1)
def make_spm() -> bytes:
    """A SentencePiece BPE model proto (byte fallback, <unk> <s> </s> = 0 1 2), SPM_VOCAB pieces."""
    import io

    import sentencepiece

    buf = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4),
        model_writer=buf,
        vocab_size=SPM_VOCAB,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        minloglevel=2,
    )
    return buf.getvalue()


def save_spm(out: Path) -> None:
    """tokenizer.model + tokenizer_config.json (Llama 2 style: BOS added) into an HF dir."""
    (out / "tokenizer.model").write_bytes(make_spm())
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHAT_TEMPLATE}))


def save_tokenizer(tok, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with the chat template) into an HF dir."""
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[BOS_ID],
        "eos_token": SPECIALS[EOS_ID],
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def make_hf_model(
    arch: str = "llama",
    rope: str | None = None,
    tied: bool = False,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    sliding_window: int | None = None,
    seed: int = 0,
    vocab: int = VOCAB,
):
    """A random fp32 HF model: 2 layers, dim 64, head_dim 16, ffn 128, `vocab` tokens."""
    import transformers

    rope_params = {"rope_type": "default", "rope_theta": 10000.0}
    if rope == "linear":
        rope_params = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    elif rope == "llama3":
        # original context 64 puts head_dim-16 wavelengths in all three llama3 bands
        rope_params = {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        }
    kw = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters=rope_params,
        tie_word_embeddings=tied,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    if arch == "mistral":
        config = transformers.MistralConfig(sliding_window=sliding_window, **kw)
        cls = transformers.MistralForCausalLM
    else:
        config = transformers.LlamaConfig(**kw)
        cls = transformers.LlamaForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():  # weights large enough that a layout mistake changes the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp stores Q/K rows for interleaved-pair RoPE: within each head, HF's two
    # halves (rotate-half) become alternating rows.
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_bpe_tokenizer(w: gguf.GGUFWriter, tok, pre: str) -> None:
    vocab = json.loads(tok.to_str())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)


def _add_spm_tokenizer(w: gguf.GGUFWriter, sp) -> None:
    n = sp.get_piece_size()
    kinds = [
        2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
        for i in range(n)
    ]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types(kinds)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)


def write_gguf(model, tok, path: Path, pre: str = "gpt2") -> Path:
    """The HF model's weights and the tokenizer (a `tokenizers.Tokenizer`, or a
    SentencePieceProcessor) as an F32 llama.cpp GGUF."""
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("mistral" if c.model_type == "mistral" else "tiny-llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    rope_type = c.rope_parameters.get("rope_type", "default")
    if rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c.rope_parameters["factor"])
    elif rope_type == "llama3":
        # llama.cpp's converter stores the divisors unscaled / scaled as a tensor
        d = c.head_dim
        base = 1.0 / (c.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        scaled = model.model.rotary_emb.inv_freq.float()
        w.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))

    if hasattr(tok, "id_to_piece"):  # sentencepiece.SentencePieceProcessor
        _add_spm_tokenizer(w, tok)
    else:
        _add_bpe_tokenizer(w, tok, pre)
    w.add_chat_template(CHAT_TEMPLATE)

    for name, t in sd.items():
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            i, part = stem.removeprefix("model.layers.").split(".", 1)
            out = f"blk.{i}.{_BLOCK[part]}.{kind}"
            if part == "self_attn.q_proj":
                t = _permute(t, c.num_attention_heads)
            elif part == "self_attn.k_proj":
                t = _permute(t, c.num_key_value_heads)
        elif stem == "lm_head" and c.tie_word_embeddings:
            continue
        else:
            out = f"{_TOP[stem]}.{kind}"
        w.add_tensor(out, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def build(
    root: Path,
    arch: str = "llama",
    rope: str | None = None,
    tied: bool = False,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    sliding_window: int | None = None,
    sharded: bool = False,
    digits: bool = False,
    spm: bool = False,
    seed: int = 0,
) -> Tiny:
    """A tiny model saved under root: `root/hf` (safetensors dir) and `root/model.gguf`.

    digits: SmolLM-style BPE that splits digits one by one; spm: a SentencePiece
    tokenizer.model (Llama 2 style) instead of the byte-level BPE tokenizer.json.
    """
    vocab = SPM_VOCAB if spm else VOCAB
    model = make_hf_model(arch, rope, tied, n_heads, n_kv_heads, sliding_window, seed, vocab)
    hf_dir = root / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    shard = "40KB" if sharded else "1GB"
    model.save_pretrained(hf_dir, safe_serialization=True, max_shard_size=shard)
    if spm:
        import sentencepiece

        tok = sentencepiece.SentencePieceProcessor(model_proto=make_spm())
        save_spm(hf_dir)
    else:
        tok = make_tokenizer(digits)
        save_tokenizer(tok, hf_dir)
    path = write_gguf(model, tok, root / "model.gguf", pre="smollm" if digits else "gpt2")
    return Tiny(model, hf_dir, path, tok)
