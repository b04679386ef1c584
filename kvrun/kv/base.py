"""The KV manager contract between the model and a KV cache (the model knows no compression).

The model calls, for one sequence:

    kv.begin_prefill(n)                       # a prompt (or a new chat turn) of n tokens
    for each chunk of at most --ubatch tokens:
        out = kv.attend(layer, q, k, v, pos)  # every layer, in order
        kv.end_chunk()
    kv.end_prefill()
    for each generated token:
        out = kv.attend(layer, q, k, v, pos)  # every layer, one token
        kv.end_step()

`q, k, v` arrive before RoPE: a manager applies RoPE itself (with `self.rope`), so stores
that keep pre-RoPE keys (SpindleKV) can rotate at their own stored positions. Every
method's cache implements this contract through one driver, KVCache (kvrun/kv/cache.py),
which applies RoPE once and routes steps to the method's prefill / decode paths and
compression hooks; kvrun/kv/batch.py runs B sequences, each with its own cache.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..rope import Rope


class KVManager:
    """Base class: holds the sequence bookkeeping; subclasses store, compress and attend."""

    name = "base"

    def __init__(self, config: ModelConfig, rope: Rope, device: torch.device, dtype: torch.dtype):
        self.config = config
        self.rope = rope
        self.device = device
        self.dtype = dtype
        self.seen = 0  # tokens seen so far in this sequence (all turns)
        self.in_prefill = False

    # --- sequence points -------------------------------------------------------------
    def reset(self) -> None:
        """Forget the sequence; the next call starts at position 0."""
        self.seen = 0
        self.in_prefill = False

    def begin_prefill(self, n_tokens: int) -> None:
        """A prefill of `n_tokens` (a prompt or a later chat turn) is about to start."""
        self.in_prefill = True

    def end_chunk(self, n_tokens: int) -> None:
        """All layers have attended over the last prefill chunk of `n_tokens`."""
        self.seen += n_tokens

    def end_prefill(self) -> None:
        """The prefill is complete: prefill-time methods select here."""
        self.in_prefill = False

    def end_step(self) -> None:
        """All layers have attended over one decode token."""
        self.seen += 1

    # --- planning hook ------------------------------------------------------------------
    def scoring_pass(self, n_tokens: int) -> KVManager | None:
        """A manager for a planning pass over the next prompt of n_tokens before its real
        prefill, or None (the default: no method but XKV's plan=two-pass asks for one).
        Session.plan runs the prompt through it; it keeps no KV across layers and hands its
        plan to this manager at its end_prefill."""
        return None

    # --- the model's one call ----------------------------------------------------------
    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # (B, Hq, T, D) pre-RoPE
        k: torch.Tensor,  # (B, Hkv, T, D) pre-RoPE
        v: torch.Tensor,  # (B, Hkv, T, D)
        positions: torch.Tensor,  # (T,) int64
    ) -> torch.Tensor:  # (B, Hq, T, D)
        """Store the new k, v as the method says and attend over everything the layer keeps."""
        raise NotImplementedError

    # --- static decode (CUDA graphs, kvrun/graph.py) ------------------------------------
    # A manager with a static form decodes one token with no host sync and fixed shapes once
    # `make_static(capacity)` was called: `attend` then takes positions only as a tensor.
    static = False

    def static_unsupported(self) -> str | None:
        """Why decode steps cannot be static (captured in a graph), or None when they can."""
        return f"the {self.name} cache has no static decode form"

    def make_static(self, capacity: int) -> None:
        """Decode statically from now on, with room for positions below `capacity`."""
        raise NotImplementedError

    @property
    def capacity(self) -> int:
        """Positions below this fit a static step without growing anything."""
        return 0

    def static_buffers(self) -> tuple:
        """What a captured step depends on (addresses, lengths): it is recaptured on change."""
        raise NotImplementedError

    def static_step_ok(self) -> bool:
        """Whether the next decode step can be the static one (else it runs eagerly)."""
        return True

    def after_static_step(self) -> None:
        """Python-side bookkeeping of a static step (its tensors were written in the graph)."""

    # --- accounting ---------------------------------------------------------------------
    def nbytes(self) -> int:
        """Exact bytes held: every stored tensor (values, scales, positions, indices...)."""
        raise NotImplementedError

    def nbytes_full(self) -> int:
        """Bytes an uncompressed cache in the same dtype would hold for the tokens seen."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return self.seen * self.config.kv_bytes_per_token(elem)

    def describe(self) -> dict:
        """The method and its settings, as --json reports them."""
        return {"method": self.name}
