"""Qwen 2.5, Qwen 3, Gemma 3 and Phi-3 on kvrun's forward pass against transformers: tiny random
models (tests/tiny_families.py) from the HF folder and from the GGUF that llama.cpp's own
converter wrote, logits at every prompt position, chunked prefill, decode steps and greedy
tokens."""

from __future__ import annotations

import pytest
import torch

import tiny_families
from kvrun.kv import FULL, build
from kvrun.models.model import Transformer
from kvrun.models.rope import inverse_frequencies
from kvrun.models.weights import load
from kvrun.run.session import Session

pytestmark = pytest.mark.slow  # llama.cpp's converter runs in a subprocess
ATOL = RTOL = 1e-4
PREFILL = 14  # prompt tokens before the token-by-token part (of 24; Gemma's window is 8)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """Each family built and converted once: name -> Family."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = tiny_families.save(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def loaded(family):
    """(family, fmt) -> (our model, LoadedWeights), loaded on first use."""
    cache = {}

    def get(name, fmt):
        if (name, fmt) not in cache:
            f = family(name)
            w = load(f.gguf_path if fmt == "gguf" else f.hf_dir, torch.float32)
            cache[name, fmt] = Transformer.from_weights(w.config, w.tensors, "cpu"), w
        return cache[name, fmt]

    return get


def _kv(model, w):
    return build(FULL, w.config, model.rope, torch.device("cpu"), torch.float32)


@torch.inference_mode()
def _prefill_all(model, w, ids, ubatch):
    kv = _kv(model, w)
    kv.begin_prefill(len(ids))
    out = []
    for s in range(0, len(ids), ubatch):
        chunk = ids[s : s + ubatch]
        out.append(model(torch.tensor([chunk]), torch.arange(s, s + len(chunk)), kv)[0])
        kv.end_chunk(len(chunk))
    kv.end_prefill()
    return torch.cat(out)


FMTS = ["gguf", "safetensors"]
TEXTS = [
    "Hello world! The quick fox reads 2024 keys, and the llama keeps 12345 values.",
    "  two  spaces\tand\ttabs\n\nnew lines   ",
    "def f(x):\n    return x**2  # 你好世界 🦙",
    "<|im_start|>user\nhi<|im_end|>\n<start_of_turn>model",
]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("name", tiny_families.FAMILIES)
def test_config_reads_the_family(loaded, family, name, fmt):
    _, w = loaded(name, fmt)
    c, hf = w.config, family(name).hf.config
    assert c.arch == name
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == (
        hf.num_hidden_layers,
        hf.hidden_size,
        hf.num_attention_heads,
        hf.num_key_value_heads,
        head_dim,
        hf.intermediate_size,
    )
    assert c.tie_embeddings == hf.tie_word_embeddings
    if name == "gemma3":
        local = tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention")
        assert c.local_layers == local == (0, 1, 2, 3, 4)
        assert c.sliding_window == hf.sliding_window
        assert c.final_softcap == 30.0 and c.rope_local_theta == 10000.0
    if name == "phi3":
        assert c.rotary_dim == 12 and c.rope_scaling.kind == "longrope"
    if name == "qwen2":
        assert c.qkv_bias and c.rope_scaling.kind == "yarn"


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("name", tiny_families.FAMILIES)
def test_prefill_logits_equal_transformers(loaded, family, name, fmt):
    model, w = loaded(name, fmt)
    ids = tiny_families.text_ids(name)
    ref = family(name).logits(ids)
    torch.testing.assert_close(_prefill_all(model, w, ids, len(ids)), ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(_prefill_all(model, w, ids, 5), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("name", tiny_families.FAMILIES)
def test_decode_steps_equal_transformers(loaded, family, name, fmt):
    model, w = loaded(name, fmt)
    ids = tiny_families.text_ids(name)
    ref = family(name).logits(ids)
    s = Session(model, w.tokenizer, _kv(model, w), ubatch=7)
    torch.testing.assert_close(s.prefill(ids[:PREFILL]), ref[PREFILL - 1], atol=ATOL, rtol=RTOL)
    for i in range(PREFILL, len(ids)):
        torch.testing.assert_close(s.decode(ids[i]), ref[i], atol=ATOL, rtol=RTOL, msg=f"pos {i}")


@pytest.mark.parametrize("name", tiny_families.FAMILIES)
def test_greedy_tokens_equal_transformers_generate(loaded, family, name):
    f = family(name)
    prompt = tiny_families.text_ids(name)[:10]
    with torch.no_grad():
        hf_out = f.hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=0
        )[0, len(prompt) :].tolist()
    for fmt in FMTS:
        model, w = loaded(name, fmt)
        s = Session(model, w.tokenizer, _kv(model, w))
        logits, ours = s.prefill(prompt), []
        for _ in range(12):
            ours.append(int(logits.argmax()))
            logits = s.decode(ours[-1])
        assert ours[: len(hf_out)] == hf_out, fmt


def test_longrope_long_factors_and_yarn_equal_transformers(family):
    """The frequencies themselves against transformers' RoPE initialisers: YaRN (Qwen 2.5) and
    LongRoPE's long factors (Phi-3), which the short test texts do not reach."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for name in ("qwen2", "phi3"):
        hf = family(name).hf.config
        w = load(family(name).hf_dir, torch.float32)
        kind = hf.rope_parameters["rope_type"]
        long = name == "phi3"
        seq = 10**6 if long else None
        ref, factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=seq)
        ours = inverse_frequencies(w.config, long=long)
        rd = ref.numel()
        torch.testing.assert_close(ours[:rd], ref.float(), atol=0, rtol=1e-6)
        assert w.config.rope_scaling.magnitude() == pytest.approx(factor, rel=1e-6)


@pytest.mark.parametrize("name", tiny_families.FAMILIES)
def test_convert_both_ways(family, tmp_path, name):
    """`kvrun convert` HF -> GGUF gives the file llama.cpp's converter wrote, tensor for tensor
    (kvrun reads both alike), and GGUF (llama.cpp's) -> HF gives a folder transformers loads
    with the model's own logits."""
    import transformers

    from kvrun.convert import convert

    f = family(name)
    ids = tiny_families.text_ids(name)
    ref = f.logits(ids)
    ours = convert(f.hf_dir, tmp_path / f"{name}.gguf", outtype="f32")
    a, b = load(ours, torch.float32), load(f.gguf_path, torch.float32)
    assert a.config == b.config.replace(name=a.config.name)
    assert a.tensors.keys() == b.tensors.keys()
    for k in a.tensors:
        torch.testing.assert_close(a.tensors[k], b.tensors[k], atol=0, rtol=0, msg=k)
    model = Transformer.from_weights(a.config, a.tensors, "cpu")
    torch.testing.assert_close(_prefill_all(model, a, ids, 8), ref, atol=ATOL, rtol=RTOL)
    for text in TEXTS:  # the two files' vocabularies tokenize alike
        for special in (False, True):
            want = b.tokenizer.encode(text, add_bos=False, special=special)
            assert a.tokenizer.encode(text, add_bos=False, special=special) == want, text
    assert a.meta.get("tokenizer.ggml.pre") == b.meta.get("tokenizer.ggml.pre")

    hf_dir = convert(f.gguf_path, tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        got = back(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", tiny_families.FAMILIES)
def test_quantized_file_runs_on_its_blocks(family, tmp_path, name, monkeypatch):
    """A Q8_0 file of each family (llama.cpp's converter) held in its blocks (`--wtype auto`,
    the native kernels where built): prefill beyond the fast products' rows equals the file
    dequantized at load (`--wtype f32`), and decode steps through the fast products (8-bit
    activations) stay close to it."""
    import llamacpp_peer
    from kvrun.quant import blocks as blocks_mod
    from kvrun.quant.blocks import BlockLinear

    path = llamacpp_peer.convert(family(name).hf_dir, tmp_path / f"{name}.q8_0.gguf", "q8_0")
    models = {}
    for wtype in ("f32", "auto"):
        w = load(path, torch.float32, wtype=wtype)
        models[wtype] = Transformer.from_weights(w.config, w.tensors, "cpu"), w
    held = models["auto"][0]
    assert any(isinstance(m, BlockLinear) for m in held.modules())
    ids = tiny_families.text_ids(name)
    outs = []
    for wtype in ("f32", "auto"):
        model, w = models[wtype]
        s = Session(model, w.tokenizer, _kv(model, w), ubatch=7)
        logits = [s.prefill(ids[:PREFILL])]
        logits += [s.decode(t) for t in ids[PREFILL:]]
        outs.append(torch.stack(logits))
    lp, lq = outs[0].log_softmax(-1), outs[1].log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    assert kl.max() < 2e-2, kl
    # the decode loop of kvrun/models/fused_decode.py takes Qwen's biases and Q/K norms and Phi-3;
    # Gemma 3's blocks go through the modules. Both ways give the same steps.
    from kvrun.models import fused_decode

    assert (fused_decode.bind(held) is not None) == (name != "gemma3")
    s = Session(held, models["auto"][1].tokenizer, _kv(held, models["auto"][1]), ubatch=7)
    fused = [s.prefill(ids[:PREFILL])] + [s.decode(t) for t in ids[PREFILL:]]
    held.use_fused_decode = False
    s = Session(held, models["auto"][1].tokenizer, _kv(held, models["auto"][1]), ubatch=7)
    modules = [s.prefill(ids[:PREFILL])] + [s.decode(t) for t in ids[PREFILL:]]
    held.use_fused_decode = True
    torch.testing.assert_close(torch.stack(fused), torch.stack(modules), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(blocks_mod, "native_rows", lambda: 4)
    want = _prefill_all(*models["f32"], ids, len(ids))
    got = _prefill_all(*models["auto"], ids, len(ids))
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_longrope_takes_the_long_factors_past_the_original_context(loaded):
    """Phi-3's LongRoPE: the short factors up to the original context (4096 here), the long
    ones for a run allowed more (-c), as llama.cpp picks them."""
    model, w = loaded("phi3", "safetensors")
    short = model.rope.inv_freq.clone()
    model.use_context(8192)
    torch.testing.assert_close(model.rope.inv_freq, inverse_frequencies(w.config, long=True))
    assert not torch.equal(model.rope.inv_freq, short)
    model.use_context(4096)
    torch.testing.assert_close(model.rope.inv_freq, short, atol=0, rtol=0)


def test_a_model_split_in_parts_loads_whole(family, tmp_path):
    """A GGUF split by llama.cpp's converter (`--split-max-tensors`, the parts `kvrun pull`
    fetches) loads from its first part as the whole file does; a missing part is one line."""
    import llamacpp_peer
    from kvrun.errors import ModelNotFound

    (tmp_path / "split").mkdir()
    llamacpp_peer.convert(
        family("phi3").hf_dir, tmp_path / "split" / "m.gguf", "f32", "--split-max-tensors", "6"
    )
    parts = sorted((tmp_path / "split").iterdir())
    assert [p.name for p in parts] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    a, b = load(parts[0], torch.float32), load(family("phi3").gguf_path, torch.float32)
    assert a.config == b.config and a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    parts[2].unlink()
    with pytest.raises(ModelNotFound, match="m-00003-of-00003.gguf is missing"):
        load(parts[0], torch.float32)


def test_gemma3_multimodal_checkpoint_runs_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration folder (the gemma-3-4b-it layout): kvrun loads its
    language model (`language_model.*`, `text_config`), leaves the vision tower, and gives
    transformers' logits for text. (transformers' multimodal class applies no final soft
    cap, as real Gemma 3 configs set none: the tiny text config here sets none either.)"""
    import transformers

    import tiny_models

    tc = tiny_families._config("gemma3").to_dict()
    tc["final_logit_softcapping"] = None
    vc = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    cfg = transformers.Gemma3Config(
        text_config=tc, vision_config=vc.to_dict(), mm_tokens_per_image=4,
        image_token_index=399, boi_token_index=397, eoi_token_index=398,
    )  # fmt: skip
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "language_model" in n:
                p.copy_((0.2 if n.endswith("norm.weight") else 0.15) * torch.randn_like(p))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tiny_models.save_spm(tmp_path)
    w = load(tmp_path, torch.float32)
    assert w.config.arch == "gemma3" and not any("vision" in k for k in w.tensors)
    model = Transformer.from_weights(w.config, w.tensors, "cpu")
    ids = tiny_families.text_ids("gemma3")
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_prefill_all(model, w, ids, 6), ref, atol=ATOL, rtol=RTOL)
