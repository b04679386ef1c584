"""The packed cache (kvrun/models/model_cache.py): a packed load maps the model an earlier load of
the same file built, and gives the same logits; a changed file, a damaged entry or the cache
turned off builds the model again."""

from __future__ import annotations

import os

import pytest
import torch

from kvrun.models import model_cache as packed_cache
from kvrun.quant.linear import PackedLinear
from kvrun.run.runtime import load_runtime


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("KVRUN_CACHE", str(root))
    monkeypatch.setenv("KVRUN_PACKED_CACHE", "on")
    return root / "packed"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import build

    return build(tmp_path_factory.mktemp("tiny"), tied=False)


def _load(path, wtype="q4"):
    said = []
    rt = load_runtime(str(path), "float32", "cpu", log=said.append, wtype=wtype)
    packed_cache.wait()  # the entry is written in the background
    return rt, said


def _run(rt) -> torch.Tensor:
    """Prefill logits (a chunk of 40 rows and one of 12) and three decode steps."""
    ids = torch.arange(52).remainder(rt.config.vocab_size - 3).add(3).view(1, -1)
    out = []
    with torch.inference_mode():
        kv = rt.new_kv()
        out.append(rt.model(ids[:, :40], torch.arange(40), kv))
        out.append(rt.model(ids[:, 40:], torch.arange(40, 52), kv))
        for i in range(3):
            out.append(rt.model(torch.tensor([[5 + i]]), torch.tensor([52 + i]), kv))
    return torch.cat([o.reshape(-1, o.shape[-1]) for o in out])


def _entries(cache) -> list:
    return sorted(cache.glob("*.safetensors")) if cache.exists() else []


@pytest.mark.parametrize("wtype", ["q4", "q8"])
def test_second_load_maps_the_first_loads_model(cache, tiny, wtype):
    built, said = _load(tiny.gguf_path, wtype)
    assert any("keeping the packed layout" in s for s in said)
    (entry,) = _entries(cache)
    mapped, said2 = _load(tiny.gguf_path, wtype)
    assert said2 == []  # nothing built, nothing written
    assert _entries(cache) == [entry]
    assert mapped.weights.wtype == built.weights.wtype == wtype
    assert torch.equal(_run(mapped), _run(built))
    # the same layers, paths and buffers
    a, b = built.model.state(), mapped.model.state()
    assert a[1] == b[1] and a[0].keys() == b[0].keys()
    assert all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    kinds = {type(m) for m in mapped.model.modules() if isinstance(m, PackedLinear)}
    assert kinds and mapped.model.model.layers[0].self_attn.q_proj is None  # stacked as built


def test_default_model_round_trip(cache, default_gguf):
    """The real file (Q4_1 layers kept exact beside their int4 planes, a Q8_0 table)."""
    built, _ = _load(default_gguf, "auto")
    mapped, said = _load(default_gguf, "auto")
    assert said == [] and len(_entries(cache)) == 1
    assert torch.equal(_run(mapped), _run(built))
    assert mapped.tokenizer.encode("hello world") == built.tokenizer.encode("hello world")


def test_large_tensors_move_into_pages_of_their_own(cache, tiny, monkeypatch):
    """KVRUN_PACKED_CACHE=pages: a mapped entry's large tensors are copied on a background
    thread and take the mapped ones' place at the next forward pass; the logits do not change. HUGE = 1: every packed
    buffer counts as large here (the tiny model's are < 2 MiB)."""
    monkeypatch.setattr(packed_cache, "HUGE", 1)
    monkeypatch.setenv("KVRUN_PACKED_CACHE", "pages")
    built, _ = _load(tiny.gguf_path)
    mapped, _ = _load(tiny.gguf_path)
    adopt = mapped.model.adopt
    assert adopt is not None and adopt.items
    before = [t.data_ptr() for t, _ in adopt.items]
    adopt.thread.join()
    assert torch.equal(_run(mapped), _run(built))
    assert mapped.model.adopt is None  # all taken by the first pass after the thread ended
    packed_cache.settle(mapped.model)  # nothing left: a no-op
    after = [t.data_ptr() for t, _ in adopt.items]
    assert all(a != b for a, b in zip(before, after, strict=True))
    assert torch.equal(_run(mapped), _run(built))

    monkeypatch.setenv("KVRUN_PACKED_CACHE", "on")  # the default: the mapping only
    shared, _ = _load(tiny.gguf_path)
    assert shared.model.adopt is None and torch.equal(_run(shared), _run(built))


def test_hf_folder_quantized_at_load_is_kept_too(cache, tiny):
    built, said = _load(tiny.hf_dir, "q4")
    assert any("keeping the packed layout" in s for s in said)
    mapped, said = _load(tiny.hf_dir, "q4")
    assert said == []
    assert torch.equal(_run(mapped), _run(built))
    dense, _ = _load(tiny.hf_dir, "f32")  # dense loads are not kept
    assert len(_entries(cache)) == 1 and dense.weights.wtype == "f32"


def test_a_changed_file_is_built_again_and_replaces_its_entry(cache, tiny, tmp_path):
    import shutil

    path = tmp_path / "copy.gguf"
    shutil.copy(tiny.gguf_path, path)
    _load(path)
    (first,) = _entries(cache)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: maybe changed
    rt, said = _load(path)
    assert any("keeping the packed layout" in s for s in said)
    (second,) = _entries(cache)  # the stale entry of the same file is gone
    assert second != first
    other, said = _load(tiny.gguf_path)  # another file: an entry of its own
    assert len(_entries(cache)) == 2


def _damage_cut(entry):
    data = entry.read_bytes()
    entry.write_bytes(data[: len(data) // 2])


def _damage_header(entry):
    data = bytearray(entry.read_bytes())
    data[8:20] = b"not json ..."
    entry.write_bytes(bytes(data))


def _damage_tensors(entry):
    """A valid safetensors file whose tensors do not make the model (one is missing)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(entry), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("__pad")}  # noqa: SIM118
    tensors.pop("model.norm.weight")
    save_file(tensors, str(entry), metadata=meta)


def _damage_format(entry):
    packed_cache._write(entry, {"x": torch.zeros(3)}, {"format": 0, "layout": {}})


@pytest.mark.parametrize("damage", [_damage_cut, _damage_header, _damage_tensors, _damage_format])
def test_a_damaged_entry_is_built_again_never_used(cache, tiny, damage):
    built, _ = _load(tiny.gguf_path)
    (entry,) = _entries(cache)
    damage(entry)
    rt, said = _load(tiny.gguf_path)
    assert (
        said[0].startswith("packed cache entry damaged") and "building the model again" in said[0]
    )
    assert any("keeping the packed layout" in s for s in said[1:])
    assert torch.equal(_run(rt), _run(built))
    mapped, said = _load(tiny.gguf_path)  # the entry written again reads back
    assert said == [] and torch.equal(_run(mapped), _run(built))


def test_entries_are_safetensors_with_aligned_tensors(cache, tiny):
    from safetensors import safe_open

    built, _ = _load(tiny.gguf_path)
    (entry,) = _entries(cache)
    tensors, _ = built.model.state()
    with safe_open(str(entry), "pt") as f:
        names = [k for k in f.keys() if not k.startswith("__pad")]  # noqa: SIM118
        assert sorted(names) == sorted(tensors)
        for k in names:
            assert torch.equal(f.get_tensor(k), tensors[k])
    with open(entry, "rb") as f:
        got, meta, _, _ = packed_cache._read(f)
    assert meta["format"] == packed_cache.FORMAT
    assert all(t.data_ptr() % packed_cache.ALIGN == 0 for t in got.values() if t.numel())


def test_off_or_a_full_disk_keeps_nothing(cache, tiny, monkeypatch):
    monkeypatch.setenv("KVRUN_PACKED_CACHE", "off")
    _, said = _load(tiny.gguf_path)
    assert said == [] and _entries(cache) == []
    monkeypatch.setenv("KVRUN_PACKED_CACHE", "on")
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 10**12, 2**29))
    _, said = _load(tiny.gguf_path)
    assert said and said[-1].startswith("packed layout not kept") and _entries(cache) == []
