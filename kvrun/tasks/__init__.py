"""Tasks built on generation: pass-key retrieval (more in the experiments issue)."""
