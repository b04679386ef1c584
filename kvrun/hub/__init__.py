"""Where models come from: names resolved to files (model_store.py), Hugging Face repos and
short names (names.py), and pulls into the HF cache (pull.py)."""
