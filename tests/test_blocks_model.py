"""A model whose tensors span GGUF's types, held in their own blocks (kvrun/quant/blocks.py).

The GGUF is written here: a 2-layer Llama with dim 256 and FFN 512 (K-types need rows of whole
256-element blocks), its tensors random but valid blocks of Q8_0 (embeddings), Q4_K / Q5_K /
Q6_K (Q, K, V: one stacked layer of three types), IQ4_XS (O), Q4_0 / Q5_1 (gate, up), TQ2_0
(down: a type with no native kernel, dequantized by `gguf`) and Q6_K (output). The reference is
the same file loaded dense (`--wtype f32`: every tensor dequantized by gguf), so the blocks'
exact path must give the same float32 products. Run with the native kernels and without them
(as on a machine with no compiler): no type is ever re-quantized into another.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvrun.quant import blocks as blocks_mod
from kvrun.quant import native
from kvrun.quant.blocks import BlockEmbedding, BlockLinear
from kvrun.quant.linear import PackedLinear
from tiny_models import CHAT_TEMPLATE, _add_bpe_tokenizer, make_tokenizer

DIM, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 300
TYPES = {
    "token_embd": Q.Q8_0, "attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K,
    "attn_output": Q.IQ4_XS, "ffn_gate": Q.Q4_0, "ffn_up": Q.Q5_1, "ffn_down": Q.TQ2_0,
    "output": Q.Q6_K,
}  # fmt: skip
SCALE_FIELDS = {  # byte offsets of each block's float16 scales
    Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ4_XS: [0], Q.Q4_0: [0],
    Q.Q5_1: [0, 2], Q.TQ2_0: [64],
}  # fmt: skip


def _blocks(t: Q, rows: int, cols: int, rng) -> np.ndarray:
    elems, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(rows, cols // elems, size), dtype=np.uint8)
    for off in SCALE_FIELDS[t]:
        d = rng.uniform(0.002, 0.01, size=(rows, cols // elems)).astype(np.float16)
        raw[..., off : off + 2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def write_mixed_gguf(path) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("mixed-types")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    _add_bpe_tokenizer(w, make_tokenizer(), "gpt2")
    w.add_chat_template(CHAT_TEMPLATE)
    hd = DIM // HEADS
    shapes = {"attn_q": (DIM, DIM), "attn_k": (KV_HEADS * hd, DIM), "attn_v": (KV_HEADS * hd, DIM),
              "attn_output": (DIM, DIM), "ffn_gate": (FFN, DIM), "ffn_up": (FFN, DIM),
              "ffn_down": (DIM, FFN)}  # fmt: skip

    def add(name, kind, rows, cols):
        t = TYPES[kind]
        w.add_tensor(name, _blocks(t, rows, cols, rng), raw_dtype=t)

    add("token_embd.weight", "token_embd", VOCAB, DIM)
    for i in range(LAYERS):
        norm = (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32)
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm[::-1].copy())
        for kind, (rows, cols) in shapes.items():
            add(f"blk.{i}.{kind}.weight", kind, rows, cols)
    w.add_tensor("output_norm.weight", np.ones(DIM, np.float32))
    add("output.weight", "output", VOCAB, DIM)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    write_mixed_gguf(path)
    return path


def _load(path, wtype: str):
    from kvrun.run.runtime import load_runtime

    return load_runtime(str(path), "float32", "cpu", log=lambda m: None, wtype=wtype)


@pytest.fixture(scope="module")
def dense(mixed_gguf):
    return _load(mixed_gguf, "f32")


@pytest.fixture(scope="module", params=["native", "no compiler"])
def held(request, mixed_gguf):
    if request.param == "native" and native.ops() is None:
        pytest.skip(f"native kernels unavailable: {native.note()}")
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "no compiler":
            mp.setattr(native, "ops", lambda: None)
        rt = _load(mixed_gguf, "auto")
    rt.path_name = request.param
    return rt


def test_every_tensor_keeps_its_type(held):
    m = held.model
    attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
    assert isinstance(attn.o_proj, BlockLinear) and attn.o_proj.types == ["IQ4_XS"]
    assert isinstance(mlp.down_proj, BlockLinear) and mlp.down_proj.types == ["TQ2_0"]
    assert isinstance(m.lm_head, BlockLinear) and m.lm_head.types == ["Q6_K"]
    if held.path_name == "native":  # Q, K and V stacked into one layer of three types
        assert isinstance(attn.qkv, BlockLinear) and attn.qkv.types == ["Q4_K", "Q5_K", "Q6_K"]
        assert isinstance(mlp.gate_up, BlockLinear) and mlp.gate_up.types == ["Q4_0", "Q5_1"]
        assert isinstance(m.model.embed_tokens, BlockEmbedding)
        assert attn.qkv.x8s == [True, True, True] and mlp.down_proj.x8s == [False]
    else:  # the int4 op holds Q4_0, Q4_K and Q8_0 exactly; the other types keep their blocks
        assert isinstance(attn.q_proj, PackedLinear) and attn.q_proj.source == "Q4_K"
        assert [attn.k_proj.types, attn.v_proj.types] == [["Q5_K"], ["Q6_K"]]
        assert isinstance(mlp.gate_proj, PackedLinear) and mlp.gate_proj.source == "Q4_0"
        assert isinstance(mlp.up_proj, BlockLinear) and mlp.up_proj.types == ["Q5_1"]
        assert isinstance(m.model.embed_tokens, PackedLinear)
        assert not any(mod.x8s[0] for mod in m.modules() if isinstance(mod, BlockLinear))
    for mod in m.modules():  # nothing re-quantized: every packed layer is exact
        if isinstance(mod, PackedLinear):
            assert mod.exact and mod.source in ("Q4_0", "Q4_K", "Q8_0")
    from kvrun.tasks.bench import weight_bytes
    from kvrun.tasks.info import inspect, weights_rows

    cfg, facts = inspect(held.path)
    if held.path_name == "native":  # `kvrun info` predicts what the loaded model holds
        rows = weights_rows(facts, "auto", True, cfg.tie_embeddings, native=True)
        assert rows["packed"]["bytes"] == weight_bytes(m)
        assert rows["packed"]["forms"]["TQ2_0 blocks, as in the file"] == LAYERS
        assert rows["packed"]["forms"]["IQ4_XS blocks, interleaved"] == LAYERS
        tensor_bytes = sum(t.n_bytes for t in gguf.GGUFReader(held.path).tensors)
        assert weight_bytes(m) <= 1.1 * tensor_bytes


def test_prefill_is_the_dense_models(held, dense, monkeypatch):
    """Beyond the fast products' rows a product dequantizes exactly: the same logits as the
    model whose every tensor was dequantized at load."""
    monkeypatch.setattr(blocks_mod, "native_rows", lambda: 8)
    from kvrun.quant import linear

    monkeypatch.setattr(linear, "int4_op_rows", lambda dtype: 8)
    ids = list(range(3, 43))
    pos = torch.arange(len(ids))
    with torch.inference_mode():
        want = dense.model(torch.tensor([ids]), pos, dense.new_kv())
        got = held.model(torch.tensor([ids]), pos, held.new_kv())
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_decode_steps_follow_the_dense_model(held, dense):
    """Decode steps through the fast products (8-bit activations natively, bfloat16 through
    the int4 op; types without a kernel exact) stay close to the dense model's logits."""
    from kvrun.run.session import Session

    ids = list(range(3, 30))
    outs = []
    for rt in (dense, held):
        s = Session(rt.model, rt.tokenizer, rt.new_kv())
        with torch.inference_mode():
            logits = [s.prefill(ids)]
            for t in (5, 9, 11, 40, 7):
                logits.append(s.decode(t))
        outs.append(torch.stack(logits).float())
    want, got = outs
    lp, lq = want.log_softmax(-1), got.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    assert kl.max() < 2e-2, kl


def test_without_a_compiler_kvrun_runs_and_says_so(default_gguf, tmp_path):
    """A machine with no C++ compiler: one line says so, the default model (Q4_1, Q8_0) runs
    through PyTorch's int4 op, and `kvrun info` tells the same."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, CXX=str(tmp_path / "no-such-g++"), KVRUN_NATIVE_DIR=str(tmp_path))
    env.pop("KVRUN_NATIVE", None)
    cmd = [sys.executable, "-m", "kvrun", "generate", "-m", str(default_gguf), "-p", "Hello",
           "-n", "4", "--temp", "0"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    said = " ".join(r.stderr.split())  # the log wraps long lines on a terminal's width
    assert said.count("no C++ compiler") == 1 and "install g++" in said, r.stderr
    assert r.stdout.strip()
    info = subprocess.run([sys.executable, "-m", "kvrun", "info", str(default_gguf)],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert info.returncode == 0 and "no C++ compiler" in " ".join(info.stdout.split()), info.stdout
