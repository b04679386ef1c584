"""Tiny random models of the families beside Llama (Qwen 2.5, Qwen 3, Gemma 3, Phi-3), built with
`transformers`, saved as HF folders and written to GGUF by llama.cpp's own converter
(tests/llamacpp_peer.py), so kvrun's loaders are checked against files they did not write.

Each family turns on what sets it apart: Qwen 2.5 its q/k/v biases, tied embeddings and YaRN;
Qwen 3 its q/k norms; Gemma 3 its scaled embedding, GeGLU, sandwich norms (1 + w), q/k norms,
5 local layers to 1 global with two RoPE bases and a sliding window shorter than the test
texts, and soft-capped logits; Phi-3 its fused q/k/v and gate/up, LongRoPE, partial rotary
and GQA. llama.cpp's converter checks a byte-level BPE vocabulary against the ones it knows,
so the Qwen models carry Qwen 3's real tokenizer (../shared/tokenizers); Gemma 3 and Phi-3
carry a tiny SentencePiece model, as their repositories carry tokenizer.model.
"""

from __future__ import annotations

import functools
import json
import lzma
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import llamacpp_peer
import tiny_models

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("KVRUN_SHARED", ROOT.parent / "shared")) / "tokenizers"
FAMILIES = ("qwen2", "qwen3", "gemma3", "phi3")
QWEN_VOCAB = 151936  # the Qwen 2.5 / 3 embedding rows (the tokenizer has 151,669 tokens)
GEMMA_WINDOW = 8  # a local layer's window: shorter than the test texts


@dataclass
class Family:
    """One tiny model of a family in both formats."""

    name: str
    hf: torch.nn.Module
    hf_dir: Path
    gguf_path: Path

    def logits(self, ids: list[int]) -> torch.Tensor:
        """transformers' logits (T, V) for one sequence."""
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0].float()


def _config(name: str):
    import transformers

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    if name == "qwen2":
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
        return transformers.Qwen2Config(
            **common,
            num_hidden_layers=2,
            vocab_size=QWEN_VOCAB,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            rope_parameters={**yarn, "rope_theta": 1000000.0},
            bos_token_id=151643,
            eos_token_id=151645,
            architectures=["Qwen2ForCausalLM"],
        )
    if name == "qwen3":
        return transformers.Qwen3Config(
            **common,
            num_hidden_layers=2,
            head_dim=32,  # not hidden / heads, as in Qwen 3
            vocab_size=QWEN_VOCAB,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            bos_token_id=151643,
            eos_token_id=151645,
            architectures=["Qwen3ForCausalLM"],
        )
    if name == "gemma3":
        return transformers.Gemma3TextConfig(
            **common,
            num_hidden_layers=6,  # 5 local layers, then a global one (llama.cpp's pattern 6)
            head_dim=32,
            query_pre_attn_scalar=32,
            vocab_size=tiny_models.SPM_VOCAB,
            sliding_window=GEMMA_WINDOW,
            final_logit_softcapping=30.0,
            rms_norm_eps=1e-6,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            architectures=["Gemma3ForCausalLM"],
        )
    if name == "phi3":
        half = 0.75 * 16 / 2  # rotated pairs: partial rotary 0.75 of head_dim 16
        short = [1.0 + 0.05 * i for i in range(int(half))]
        long = [2.0 + 0.5 * i for i in range(int(half))]
        return transformers.Phi3Config(
            **{**common, "max_position_embeddings": 131072},
            num_hidden_layers=2,
            vocab_size=tiny_models.SPM_VOCAB,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": short,
                "long_factor": long,
                "original_max_position_embeddings": 4096,
                "partial_rotary_factor": 0.75,
            },
            original_max_position_embeddings=4096,
            sliding_window=None,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
            architectures=["Phi3ForCausalLM"],
        )
    raise ValueError(name)


def make_hf(name: str, seed: int = 0):
    """The transformers model of a family (fp32, eval, eager attention), random weights."""
    import transformers

    config = _config(name)
    config._attn_implementation = "eager"
    cls = {
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
    }[name]
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():  # weights large enough that a layout mistake changes the logits
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                # Gemma's norms scale by (1 + w): around 0 there, around 1 elsewhere
                base = 0.0 if name == "gemma3" else 1.0
                p.copy_(base + 0.2 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)
    return model


def _save_tokenizer(name: str, out: Path) -> None:
    if name.startswith("qwen"):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            src = SHARED / "qwen3" / f"{f}.xz"
            if not src.is_file():  # a checkout away from the workplace's shared folder
                pytest.skip(f"no {src} (the shared tokenizers folder; KVRUN_SHARED names another)")
            (out / f).write_bytes(lzma.decompress(src.read_bytes()))
    else:
        tiny_models.save_spm(out)


def save(name: str, out: Path, seed: int = 0) -> Family:
    """The family's tiny model as an HF folder in out/hf and a GGUF (f32) by llama.cpp."""
    model = make_hf(name, seed)
    hf_dir = out / "hf"
    model.save_pretrained(hf_dir, safe_serialization=True)
    _save_tokenizer(name, hf_dir)
    if not name.startswith("qwen"):  # the converter reads the class of a SentencePiece model
        cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
        cfg["tokenizer_class"] = "GemmaTokenizer" if name == "gemma3" else "LlamaTokenizer"
        (hf_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    gguf_path = llamacpp_peer.convert(hf_dir, out / f"{name}.gguf", "f32")
    return Family(name, model, hf_dir, gguf_path)


def kv_config(name: str, n_heads: int = 4):
    """The KV tests' tiny model (3 layers, 2 KV heads, head_dim 32, 256 tokens: see
    tests/test_kv_methods.py) with a family's features on: Qwen 2.5's biases and YaRN, Qwen
    3's q/k norms, Gemma 3's norms, GeGLU, scales, soft cap, head_dim 256 with one KV head
    and two local layers (a window of 48, shorter than the KV tests' prompts) beside a
    global one, Phi-3's MHA with partial rotary and LongRoPE."""
    from kvrun.models.config import ModelConfig, RopeScaling

    base = dict(
        n_layers=3, dim=64, n_heads=n_heads, n_kv_heads=2, head_dim=32, ffn_dim=128,
        vocab_size=256, context_length=4096,
    )  # fmt: skip
    if name == "qwen2":
        yarn = RopeScaling("yarn", 4.0, original_context=64)
        return ModelConfig(arch="qwen2", **base, qkv_bias=True, rope_scaling=yarn)
    if name == "qwen3":
        return ModelConfig(arch="qwen3", **base, qk_norm=True, rope_theta=1e6)
    if name == "gemma3":  # Gemma 3 1B's attention: head_dim 256, one KV head
        return ModelConfig(
            arch="gemma3", **{**base, "head_dim": 256, "n_kv_heads": 1}, qk_norm=True, sandwich_norms=True, act="gelu_tanh",
            embed_scale=8.0, attn_scale=24**-0.5, final_softcap=30.0, sliding_window=48,
            local_layers=(0, 1), rope_theta=1e6, rope_local_theta=1e4,
            rope_scaling=RopeScaling("linear", 8.0),
        )  # fmt: skip
    if name == "phi3":
        short = tuple(1.0 + 0.1 * i for i in range(8))
        rope = RopeScaling(
            "longrope", 32.0, original_context=4096, short_factor=short, long_factor=short
        )
        mha = {**base, "n_heads": 2}
        return ModelConfig(arch="phi3", **mha, rotary_dim=16, rope_scaling=rope)
    raise ValueError(name)


@functools.cache
def text_ids(name: str) -> list[int]:
    """A test sequence of 24 ids inside the family's vocabulary (longer than Gemma's window)."""
    g = torch.Generator().manual_seed(7)
    top = 30000 if name.startswith("qwen") else tiny_models.SPM_VOCAB
    return torch.randint(3, top, (24,), generator=g).tolist()
