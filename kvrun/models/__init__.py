"""The model: its config, one decoder switched by config fields, RoPE, weights and the file
formats they come in, tokenizers, chat templates, presets, synthetic shapes, the fused decode
step and the packed-model cache. Nothing here imports kvrun.run, kvrun.hub or the CLI."""
