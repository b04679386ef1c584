"""A multi-turn conversation whose history stays in the KV cache across turns."""

from __future__ import annotations

import os

from .session import Result, Session


class Conversation:
    """Renders each turn with the chat template and prefills only what the cache lacks."""

    def __init__(self, session: Session, system: str | None = None):
        self.session = session
        self.system = system
        self.messages: list[dict] = []
        self.cached_text = ""  # the rendered text whose tokens the cache holds (or will)
        self.document = ""  # the first user message's opening held in the cache (a .kvc)

    def continue_document(self, head: str, opening: str) -> None:
        """The cache holds a document's turn (kvrun.run.kvc): `head` is its rendered text, with
        `opening` (the document and a blank line, the document as a placeholder) where the
        first user message begins; that message completes it."""
        self.cached_text, self.document = head, opening

    def reset(self) -> None:
        self.session.reset()
        self.messages = []
        self.cached_text = ""
        self.document = ""

    def _history(self) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return sys_msg + self.messages

    def next_prompt_ids(self, user_text: str) -> list[int]:
        """Token ids that extend the cache with the user's turn and the assistant header."""
        tok = self.session.tokenizer
        opening = self.document if not self.messages else ""
        self.messages.append({"role": "user", "content": opening + user_text})
        full = tok.render_chat(self._history(), add_generation_prompt=True)
        if not self.cached_text:
            self.cached_text = full
            return tok.encode(full)
        # The cache holds `cached_text`; templates may re-render the past slightly
        # differently (whitespace), so extend from the longest common prefix.
        common = len(os.path.commonprefix([self.cached_text, full]))
        delta = full[common:]
        self.cached_text = full
        return tok.encode(delta, add_bos=False)

    def reply(self, user_text: str, **generate_kw) -> Result:
        """Run one turn; the reply joins the history (also when it was interrupted)."""
        before = (list(self.messages), self.cached_text)
        ids = self.next_prompt_ids(user_text)
        try:
            result = self.session.generate(ids, **generate_kw)
        except Exception:
            self.messages, self.cached_text = before  # nothing reached the cache
            raise
        self.messages.append({"role": "assistant", "content": result.text})
        self.cached_text += result.text
        return result
