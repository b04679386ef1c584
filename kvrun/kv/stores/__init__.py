"""Generic stores any method can keep its tokens in: dense segments and KIVI 2/4-bit."""
