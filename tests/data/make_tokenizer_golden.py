"""Write tests/data/tokenizer_golden.json: llama.cpp's token ids for the tokenizer tests.

Each family's tiny HF folder (real tokenizer files) is converted to GGUF and tokenized by
llama-cpp-python in bench/.venv-llamacpp. Run it after changing the texts or the folders:

    python tests/data/make_tokenizer_golden.py

qwen3, gemma3, gemma3_spm (tests/test_tokenizer_families.py's texts): converted by llama.cpp's
own convert_hf_to_gguf.py (tests/llamacpp_peer.py fetches it). llama2, llama3_1
(tests/test_convert_tokenizers.py's texts): converted by kvrun's converter, the GGUF that test
reads (llama.cpp's converter gives a tokenizer.json-only Llama 2 folder the score -1000 for
every piece, so llama.cpp's ids from its own GGUF are not the folder's).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

import test_convert_tokenizers as llama_tests  # noqa: E402
import test_tokenizer_families as family_tests  # noqa: E402

import llamacpp_peer  # noqa: E402
from kvrun.convert import convert  # noqa: E402
from kvrun.models.file_headers import gguf_metadata, open_gguf  # noqa: E402

OUT = Path(__file__).resolve().parent / "tokenizer_golden.json"
_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
           "tokenizer.ggml.scores")  # fmt: skip


def folder(name: str, dest: Path) -> tuple[Path, list[str]]:
    """The family's tiny HF folder and the texts its test tokenizes."""
    if name in family_tests.FAMILIES:
        return family_tests.hf_folder(name, dest), family_tests.TEXTS
    return llama_tests.hf_folder(name, dest), llama_tests.TEXTS


def main() -> None:
    if not llamacpp_peer.PYTHON.exists():
        sys.exit(f"no llama-cpp-python at {llamacpp_peer.PYTHON}")
    families = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in [*family_tests.FAMILIES, *llama_tests.FOLDERS]:
            hf, texts = folder(name, Path(tmp) / name)
            out = Path(tmp) / f"{name}.gguf"
            if name in family_tests.FAMILIES:
                gguf = llamacpp_peer.convert(hf, out, "f32", "--vocab-only")
            else:
                gguf = convert(hf, out, outtype="f32")
            meta = gguf_metadata(open_gguf(gguf))
            keys = {k: v for k, v in meta.items() if k.startswith("tokenizer.ggml.")}
            families[name] = {
                "converter": "llama.cpp" if name in family_tests.FAMILIES else "kvrun",
                "gguf": {k: v for k, v in keys.items() if k not in _ARRAYS},
                "texts": texts,
                **llamacpp_peer.tokenize(gguf, texts),
            }
            print(name, meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"], len(texts))
    doc = {"llama.cpp": f"llama-cpp-python {llamacpp_peer.VERSION}", "families": families}
    text = json.dumps(doc, ensure_ascii=False, indent=1)
    text = re.sub(r"(?<=[\[,])\s+(?=-?\d)|(?<=\d)\s+(?=\])", "", text)  # ids: one line a list
    OUT.write_text(text + "\n", "utf-8")


if __name__ == "__main__":
    main()
