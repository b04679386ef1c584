"""kvrun serve's prefix cache: the caches of ended requests, kept so that a request whose
prompt starts with one goes on from a fork of it (llama-server's cache_prompt).

An entry is a request's KV cache as its last token left it and the token ids it holds
(exactly what the server fed: the prompt ids and the generated ids it decoded), keyed by the
model and the KV spec. A request takes the longest entry of its key whose tokens are a proper
prefix of its prompt ids (at least one token is left to prefill: its logits give the first
token) and prefills only the rest on a fork, so requests never share a mutable cache. With a
compressed method the kept part was compressed when its turn ended and the rest is the next
turn, as `kvrun chat` goes on. Entries are evicted least recently used first once their
measured bytes (`kv.nbytes()`) pass the limit. Only the engine thread calls it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Entry:
    kv: Any  # KVManager: never fed again, only forked
    tokens: tuple[int, ...]  # every token the cache has seen, in order
    nbytes: int


class PrefixCache:
    """An LRU of kept caches bounded by `limit` bytes (0: keeps nothing)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.entries: OrderedDict[tuple, Entry] = OrderedDict()  # (key, tokens) -> Entry
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def _best(self, key: Hashable, ids: Sequence[int]) -> tuple | None:
        best = None
        for k, tokens in self.entries:
            n = len(tokens)
            if k == key and n < len(ids) and (best is None or n > len(best[1])):
                if tuple(ids[:n]) == tokens:
                    best = (k, tokens)
        return best

    def peek(self, key: Hashable, ids: Sequence[int]) -> int:
        """Tokens of the entry `lookup` would take (0: none), nothing forked or moved."""
        best = self._best(key, ids)
        return len(best[1]) if best else 0

    def lookup(self, key: Hashable, ids: Sequence[int]) -> tuple[Any, list[int]] | None:
        """A fork of the longest entry under `key` whose tokens are a proper prefix of ids,
        and its tokens; None when there is none."""
        best = self._best(key, ids)
        if best is None:
            return None
        self.entries.move_to_end(best)
        e = self.entries[best]
        return e.kv.fork(), list(e.tokens)

    def keep(self, key: Hashable, tokens: Sequence[int], kv) -> int:
        """Keep `kv` (which its request no longer feeds), holding `tokens`, under `key`;
        returns how many entries were evicted to make room. A cache over the limit alone is
        not kept; one with the same key and tokens replaces the older."""
        n = kv.nbytes()
        if not tokens or n > self.limit:
            return 0
        ident = (key, tuple(tokens))
        old = self.entries.pop(ident, None)
        if old is not None:
            self.bytes -= old.nbytes
        self.entries[ident] = Entry(kv, ident[1], n)
        self.bytes += n
        evicted = 0
        while self.bytes > self.limit:
            _, e = self.entries.popitem(last=False)
            self.bytes -= e.nbytes
            evicted += 1
        self.evictions += evicted
        return evicted

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
