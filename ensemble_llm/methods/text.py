"""Turning a growing list of token ids into text deltas without splitting a UTF-8 character."""

from __future__ import annotations

from ..members import Member


class IncrementalDecoder:
    """Decodes token ids as they come; holds back text while the last bytes are an incomplete
    UTF-8 sequence (decoded as U+FFFD), so every delta is final."""

    def __init__(self, member: Member) -> None:
        self.member = member
        self.ids: list[int] = []
        self.emitted = 0  # characters already returned

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.member.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[self.emitted :]
        self.emitted = len(text)
        return delta

    def flush(self) -> str:
        """The rest; a character left incomplete by the token budget (decoded as U+FFFD) is dropped."""
        text = self.member.decode(self.ids).rstrip("\ufffd")
        delta = text[self.emitted :]
        self.emitted = len(text)
        return delta
