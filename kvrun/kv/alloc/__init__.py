"""Allocators: how many tokens each layer keeps (the second axis of a recipe)."""
