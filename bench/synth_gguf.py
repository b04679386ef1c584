"""A Llama-3-8B-shaped GGUF file with random Q4_0 (or Q4_K_M) weights and the default model's
tokenizer.

    python bench/synth_gguf.py /tmp/llama3-8b-shape-q4_0.gguf            # 32 layers, ~4.2 GB
    python bench/synth_gguf.py /tmp/llama3-8b-shape-q4_k_m.gguf --mix q4_k_m   # ~4.6 GB
    python bench/synth_gguf.py /tmp/small.gguf --layers 2                 # a quick check

The body has Llama-3-8B's shapes (dim 4096, 32 layers, 32 query heads, 8 KV heads, head
dim 128, FFN 14336, rope theta 500000, RMS eps 1e-5, context 8192); the vocabulary is
SmolLM2's (49,152 tokens: every `tokenizer.*` key is copied from
SmolLM2-135M-Instruct.Q4_1.gguf), so the embedding and output matrices are smaller than
Llama-3's 128,256 rows. It exists so that kvrun and llama.cpp can be timed on the same file
at a size where the matmuls, not Python, dominate (bench/vs_llamacpp.py --synthetic-8b).

Every 2-D weight (token_embd, output, attn_q/k/v/output, ffn_gate/up/down) is GGML Q4_0:
its blocks (float16 scale + 16 bytes of nibbles, 18 bytes per 32 weights) are built
directly from random bytes, nothing is quantized. Scales are random in +-[0.002, 0.01]
(random sign, so the nibbles' -0.5 mean offset cancels over blocks), i.e. weights of
standard deviation ~0.03. Norm weights are float32 ones. The output means nothing.

--mix q4_k_m gives the tensor types llama.cpp's Q4_K_M quantization chooses for a Llama:
Q6_K for output.weight, and for attn_v and ffn_down of the layers its `use_more_bits` picks
(the first and last eighth, and every third between), Q4_K for every other weight. The K
blocks are random bytes too, with their float16 scales set so weights again have a standard
deviation of a few hundredths (Q6_K's int8 sub-block scales kept within +-32).

Tensors are generated and written one at a time (peak memory: about one embedding
matrix's blocks, ~0.2 GB, plus the tokenizer metadata).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QK4_0, Q4_0_BYTES = 32, 18  # weights per block, bytes per block (fp16 d + 16 nibble bytes)
SCALE_RANGE = (0.002, 0.01)

LLAMA3_8B = dict(
    dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
    rope_theta=500000.0, norm_eps=1e-5, context_length=8192,
)  # fmt: skip


def default_tokenizer_source() -> Path:
    """The default model file, where bench/vs_llamacpp.py looks for it ($KVRUN_MODELS)."""
    env = os.environ.get("KVRUN_MODELS")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "kvrun" / "models"
    return root / DEFAULT_MODEL_FILE


def q4_0_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_0 data for a (rows, cols) weight: uint8 of shape (rows, cols // 32 * 18)."""
    if cols % QK4_0:
        raise ValueError(f"Q4_0 needs a row length divisible by {QK4_0}, got {cols}")
    nb = cols // QK4_0
    blocks = np.empty((rows, nb, Q4_0_BYTES), dtype=np.uint8)
    lo, hi = SCALE_RANGE
    d = rng.uniform(lo, hi, size=(rows, nb)).astype(np.float16)
    d *= np.where(rng.integers(0, 2, size=(rows, nb), dtype=np.uint8) == 1, 1, -1).astype(
        np.float16
    )
    blocks[:, :, :2] = d.view(np.uint8).reshape(rows, nb, 2)  # little-endian ggml_half
    blocks[:, :, 2:] = rng.integers(0, 256, size=(rows, nb, 16), dtype=np.uint8)
    return blocks.reshape(rows, nb * Q4_0_BYTES)


QK_K = 256
BLOCK_BYTES = {"Q4_0": 18, "Q4_K": 144, "Q6_K": 210}
BLOCK_ELEMS = {"Q4_0": 32, "Q4_K": 256, "Q6_K": 256}
MIXES = ("q4_0", "q4_k_m")


def k_blocks(rng: np.random.Generator, kind: str, rows: int, cols: int) -> np.ndarray:
    """Random Q4_K or Q6_K data for a (rows, cols) weight (uint8 rows of whole blocks)."""
    nb, size = cols // QK_K, BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    if kind == "Q4_K":  # w = d sc q - dmin m: dmin ~ 7.5 d centres the codes (0..15)
        d = rng.uniform(1e-4, 3e-4, size=(rows, nb)).astype(np.float16)
        dmin = (d.astype(np.float32) * rng.uniform(7.0, 8.0, size=(rows, nb))).astype(np.float16)
        raw[..., 0:2] = d[..., None].view(np.uint8)
        raw[..., 2:4] = dmin[..., None].view(np.uint8)
    else:  # Q6_K: w = d sc (q - 32), int8 sub-block scales at bytes 192..207
        raw[..., 192:208] = (
            rng.integers(-32, 33, size=(rows, nb, 16)).astype(np.int8).view(np.uint8)
        )
        d = rng.uniform(1e-4, 3e-4, size=(rows, nb)).astype(np.float16)
        raw[..., 208:210] = d[..., None].view(np.uint8)
    return raw.reshape(rows, nb * size)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits (Q4_K_M)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, layers: int, mix: str) -> str:
    """The GGML type a 2-D weight gets in the mix."""
    if mix == "q4_0":
        return "Q4_0"
    if name == "output.weight":
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(name.split(".")[1])
        return "Q6_K" if use_more_bits(layer, layers) else "Q4_K"
    return "Q4_K"


def tensor_plan(layers: int, vocab: int, shape: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape (rows, cols) or (n,)) of every tensor, in file order."""
    dim, hd, ffn = shape["dim"], shape["head_dim"], shape["ffn_dim"]
    q, kv = shape["n_heads"] * hd, shape["n_kv_heads"] * hd
    yield "token_embd.weight", (vocab, dim)
    for i in range(layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (dim,)
        yield b + "attn_q.weight", (q, dim)
        yield b + "attn_k.weight", (kv, dim)
        yield b + "attn_v.weight", (kv, dim)
        yield b + "attn_output.weight", (dim, q)
        yield b + "ffn_norm.weight", (dim,)
        yield b + "ffn_gate.weight", (ffn, dim)
        yield b + "ffn_up.weight", (ffn, dim)
        yield b + "ffn_down.weight", (dim, ffn)
    yield "output_norm.weight", (dim,)
    yield "output.weight", (vocab, dim)


def _copy_tokenizer(writer, source: Path) -> int:
    """Copy every tokenizer.* key from source into writer (strings as raw bytes); the vocab
    size."""
    import gguf

    reader = gguf.GGUFReader(str(source), "r")
    vocab = None
    string, array = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = f.types[0]
        if main == array:
            sub = f.types[-1]
            if sub == string:
                val = [bytes(f.parts[i]) for i in f.data]
            else:
                val = [f.parts[i].tolist()[0] for i in f.data]
            writer.add_key_value(key, val, array, sub_type=sub)
            if key == "tokenizer.ggml.tokens":
                vocab = len(val)
        elif main == string:
            writer.add_key_value(key, bytes(f.parts[f.data[0]]), string)
        else:
            writer.add_key_value(key, f.parts[f.data[0]].tolist()[0], main)
    if vocab is None:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    del reader
    return vocab


def write_synthetic(
    path: str | os.PathLike,
    layers: int = 32,
    *,
    tokenizer_from: str | os.PathLike | None = None,
    seed: int = 0,
    log=None,
    mix: str = "q4_0",
    **shape_overrides,
) -> dict:
    """Write the Llama-3-8B-shaped Q4_0 GGUF file (see the module docstring) to path.

    layers: block count (32 for the full body; 2 for a quick check). shape_overrides:
    any key of LLAMA3_8B. tokenizer_from: the GGUF whose tokenizer.* keys are copied
    (default: the default model file). Writes to path + '.part' and renames at the end.
    Returns {'path', 'bytes', 'seconds', 'layers', 'vocab', 'n_params'}.
    """
    import gguf

    shape = {**LLAMA3_8B, **shape_overrides}
    if set(shape) != set(LLAMA3_8B):
        raise TypeError(f"unknown shape keys: {sorted(set(shape) - set(LLAMA3_8B))}")
    source = Path(tokenizer_from) if tokenizer_from else default_tokenizer_source()
    if not source.is_file():
        raise FileNotFoundError(
            f"no tokenizer source at {source} (the default model; try `kvrun pull smollm2`)"
        )
    path = Path(path)
    part = path.with_name(path.name + ".part")
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)

    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r} (use {', '.join(MIXES)})")
    w = gguf.GGUFWriter(str(part), "llama")
    w.add_name(f"llama3-8b-shape synthetic {mix.upper()} ({layers} layers, random weights)")
    w.add_block_count(layers)
    w.add_context_length(shape["context_length"])
    w.add_embedding_length(shape["dim"])
    w.add_feed_forward_length(shape["ffn_dim"])
    w.add_head_count(shape["n_heads"])
    w.add_head_count_kv(shape["n_kv_heads"])
    w.add_rope_freq_base(shape["rope_theta"])
    w.add_layer_norm_rms_eps(shape["norm_eps"])
    w.add_rope_dimension_count(shape["head_dim"])
    w.add_key_length(shape["head_dim"])
    w.add_value_length(shape["head_dim"])
    w.add_file_type(
        gguf.LlamaFileType.MOSTLY_Q4_0 if mix == "q4_0" else gguf.LlamaFileType.MOSTLY_Q4_K_M
    )
    vocab = _copy_tokenizer(w, source)
    w.add_vocab_size(vocab)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    plan = list(tensor_plan(layers, vocab, shape))
    n_params = 0
    for name, shp in plan:
        n_params += int(np.prod(shp))
        if len(shp) == 1:
            w.add_tensor_info(name, shp, np.dtype(np.float32), shp[0] * 4)
        else:
            rows, cols = shp
            kind = tensor_type(name, layers, mix)
            row_bytes = cols // BLOCK_ELEMS[kind] * BLOCK_BYTES[kind]
            byte_shape = (rows, row_bytes)  # gguf turns it into (rows, cols)
            w.add_tensor_info(
                name,
                byte_shape,
                np.dtype(np.uint8),
                rows * row_bytes,
                raw_dtype=gguf.GGMLQuantizationType[kind],
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (name, shp) in enumerate(plan):
        if len(shp) == 1:
            data = np.ones(shp, dtype=np.float32)
        elif tensor_type(name, layers, mix) == "Q4_0":
            data = q4_0_blocks(rng, *shp)
        else:
            data = k_blocks(rng, tensor_type(name, layers, mix), *shp)
        w.write_tensor_data(data)
        del data
        if log and (name.endswith("ffn_down.weight") or i == len(plan) - 1):
            log(f"  {i + 1}/{len(plan)} tensors, {time.perf_counter() - t0:.1f} s")
    w.close()
    os.replace(part, path)
    return {
        "path": str(path),
        "bytes": path.stat().st_size,
        "seconds": time.perf_counter() - t0,
        "layers": layers,
        "vocab": vocab,
        "n_params": n_params,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("path", help="output GGUF file")
    ap.add_argument("--layers", type=int, default=32, help="block count (default: %(default)s)")
    ap.add_argument(
        "--tokenizer-from",
        default=str(default_tokenizer_source()),
        help="GGUF file whose tokenizer.* keys are copied (default: %(default)s)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--mix", choices=MIXES, default="q4_0", help="tensor types (default: %(default)s)"
    )
    ap.add_argument("--force", action="store_true", help="overwrite an existing file")
    args = ap.parse_args(argv)
    if Path(args.path).exists() and not args.force:
        sys.exit(f"{args.path} exists (pass --force to overwrite)")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    info = write_synthetic(
        args.path,
        args.layers,
        tokenizer_from=args.tokenizer_from,
        seed=args.seed,
        log=log,
        mix=args.mix,
    )
    print(
        f"wrote {info['path']}: {info['layers']} layers, vocab {info['vocab']}, "
        f"{info['n_params'] / 1e9:.2f} B params, {info['bytes'] / 1e9:.2f} GB "
        f"in {info['seconds']:.1f} s"
    )


if __name__ == "__main__":
    main()
