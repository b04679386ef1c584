"""Tasks built on generation: pass-key retrieval and the needle grid, long-document batches,
perplexity and the speed bench (kvrun needle / longdoc / perplexity / bench)."""
