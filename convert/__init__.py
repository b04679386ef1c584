"""GGUF <-> HF safetensors conversion (`kvrun convert`)."""

if __name__ == "convert":  # run from the checkout's root: a package of that name, not this one
    import os

    from kvrun.top_level import hand_over

    hand_over(__name__, os.path.dirname(__file__))
else:
    from .either_way import convert
    from .gguf_to_hf import gguf_to_hf
    from .hf_to_gguf import hf_to_gguf

    __all__ = ["convert", "gguf_to_hf", "hf_to_gguf"]
