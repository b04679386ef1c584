"""kvrun's kernels: native C++ CPU kernels in cpu/ (built on first use, kvrun/quant/native.py)
and Triton kernels for CUDA here, each next to a torch reference of the same signature.

Every Triton family module (dense_decode, kivi_decode, kivi_pack, colsum, codebook_decode,
merged_decode) exposes `<name>_ref`
(torch, any device), `<name>_triton` (Triton) and a dispatcher `<name>` that picks Triton
for CUDA tensors when triton imports, else the reference. KVRUN_KERNELS=torch forces the
reference, =triton forces Triton (on CPU tensors it then runs in the Triton interpreter).
Importing this package never needs triton: without it every dispatcher uses the reference.
"""

if __name__ == "kernels":  # run from the checkout's root: Hugging Face's package, not this one
    import os

    from kvrun.top_level import hand_over

    hand_over(__name__, os.path.dirname(__file__))
else:
    from .dispatch import HAVE_TRITON, jit, next_pow2, triton, use_triton

    __all__ = ["HAVE_TRITON", "jit", "next_pow2", "triton", "use_triton"]
