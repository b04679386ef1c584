"""C++ sources of kvrun's native CPU kernels (quantized products over GGUF blocks), compiled on
first use by kvrun.quant.native; no Python here."""
