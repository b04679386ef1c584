"""Write a GGUF of a real family's shapes with random weights, for speed runs beside llama.cpp.

    python bench/family_shapes.py qwen3-0.6b /tmp/qwen3-0.6b-shape.q8_0.gguf
    python bench/family_shapes.py gemma3-1b /tmp/gemma3-1b-shape.q8_0.gguf
    python bench/vs_llamacpp.py --model /tmp/qwen3-0.6b-shape.q8_0.gguf --tests pp512,tg128 --skip-8b

The model is built by `transformers` from the family's published shapes (random weights: the
speed of a product does not depend on its values), saved with the family's real tokenizer
(../shared/tokenizers) and written by llama.cpp's own convert_hf_to_gguf.py (fetched as the
tests fetch it, tests/llamacpp_peer.py), so both tools read the same file.
"""

from __future__ import annotations

import argparse
import lzma
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "tokenizers"

SHAPES = {  # the published configs' shapes (HF config.json of each model)
    "qwen3-0.6b": dict(
        cls="Qwen3",
        tokenizer="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        architectures=["Qwen3ForCausalLM"],
    ),
    "gemma3-1b": dict(
        cls="Gemma3",
        tokenizer="gemma3",
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        vocab_size=262208,  # the tokenizer has 262,145 entries (the 4B config's rows)
        sliding_window=512,
        max_position_embeddings=32768,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        architectures=["Gemma3ForCausalLM"],
    ),
}


def build(name: str, out: Path, outtype: str) -> Path:
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "tests"))
    import llamacpp_peer

    shape = dict(SHAPES[name])
    cls, tok = shape.pop("cls"), shape.pop("tokenizer")
    config_cls = transformers.Gemma3TextConfig if cls == "Gemma3" else transformers.Qwen3Config
    model_cls = getattr(transformers, f"{cls}ForCausalLM")
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = model_cls(config_cls(**shape)).to(torch.bfloat16)
    with tempfile.TemporaryDirectory(prefix="kvrun-shape-") as tmp:
        folder = Path(tmp)
        model.save_pretrained(folder, safe_serialization=True)
        del model
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (folder / f).write_bytes(lzma.decompress((SHARED / tok / f"{f}.xz").read_bytes()))
        out.parent.mkdir(parents=True, exist_ok=True)
        return llamacpp_peer.convert(folder, out, outtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--outtype", default="q8_0", help="llama.cpp converter's --outtype")
    a = ap.parse_args()
    print(build(a.shape, a.out, a.outtype))


if __name__ == "__main__":
    main()
