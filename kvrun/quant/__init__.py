"""How model weights sit in memory and how products read them: one package, one part each.

Formats
- `formats`: torch-free facts: the --wtype names, which form each GGUF type is held in, and
  the bytes a model's weights take under a --wtype (what `kvrun info` shows without loading).
- `blocks`: GGUF blocks kept in their own type (`Blocks`, `BlockLinear`): the file's numbers,
  never re-quantized; the default on CPU.
- `packed`: group-wise 4/8-bit codes with scales and zeros (`Packed`), made exactly from Q4_0,
  Q4_1, Q4_K and Q8_0 blocks or by quantizing floats (--wtype q4/q8, HF folders, CUDA).

Products
- `native`: builds and loads the native CPU kernels (kernels/cpu/: products over GGUF blocks
  with 8-bit activations as llama.cpp, AVX2 / AVX-512 VNNI / AVX-VNNI / portable).
- `linear`: the layer over `Packed` weights (`PackedLinear`): dequantize + F.linear, or
  PyTorch's int4 op (the path without a C++ compiler, and CUDA's).
- `int4mm`: PyTorch's int4 ops' weight layouts (CPU and CUDA) and q8 as two 4-bit planes.

Choosing
- `choice`: what --wtype auto means here and which path packed products take (probed).
- `hardware`: facts the choice depends on (free memory, whether bf16 GEMMs are faster).
- `probes`: timing probes' answers kept per machine, so later processes do not time again.

On disk
- `model_cache`: built models (packed planes, interleaved blocks) kept under the kvrun cache
  and memory-mapped by later loads. It caches models, not KV caches.
"""
