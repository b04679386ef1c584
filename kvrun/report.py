"""What runs print: sizes in binary units and the stats line every run ends with."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .run.session import Stats


def human_bytes(n: float) -> str:
    """Bytes in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def stats_line(s: Stats, load_s: float | None = None) -> str:
    """The one line every run ends with (load time first when given, as llama.cpp does)."""
    ratio = s.kv_bytes / s.kv_bytes_full if s.kv_bytes_full else 1.0
    load = f"load {load_s:.2f} s | " if load_s is not None else ""
    first = f", first token {s.ttft_s:.2f} s" if s.ttft_s else ""
    return (
        f"{load}prompt {s.prompt_tokens} tok, {s.prefill_tok_s:.1f} tok/s{first} | "
        f"gen {s.generated_tokens} tok, {s.decode_tok_s:.1f} tok/s | "
        f"KV {human_bytes(s.kv_bytes)} held / {human_bytes(s.kv_bytes_full)} full ({ratio:.1%}) | "
        f"peak mem {human_bytes(s.peak_mem_bytes)}"
    )
