"""Text deltas that never split a UTF-8 character (floor 3).

`Utf8Releaser` is the one releaser of the methods that decide bytes (unite, safe, specfuse, smc):
it holds back everything from the first byte that is not yet complete, valid UTF-8, so a delta is
final and the reply never ends in U+FFFD. `IncrementalDecoder` serves `single`, which decides one
member's token ids: its text is that tokenizer's own `decode` (special tokens skipped, a
SentencePiece leading space dropped), which the token bytes alone do not give.
"""

from __future__ import annotations

from ..members import TokenLM
from ..members.vocab import valid_utf8_prefix


class IncrementalDecoder:
    """Decodes token ids as they come; holds back text while the last bytes are an incomplete
    UTF-8 sequence (decoded as U+FFFD), so every delta is final."""

    def __init__(self, member: TokenLM) -> None:
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


class Utf8Releaser:
    """Releases the committed bytes as text, holding back an incomplete UTF-8 tail (and invalid
    bytes, until later bytes or the end show what they are)."""

    def __init__(self) -> None:
        self.sent = 0

    def take(self, data: bytes, final: bool = False) -> str:
        """New complete text of `data`. Invalid bytes inside the text become U+FFFD (at the end
        (final), once later bytes show they never complete a character); bytes that do not decode
        at the very end (a character cut by the budget, a stray byte token) are dropped, so the
        reply never ends in U+FFFD."""
        cut = valid_utf8_prefix(data)
        if final and cut < len(data):
            cut = len(data)
            tail = data[self.sent :].decode("utf-8", errors="replace")
            out = tail.rstrip("\ufffd") if not data.endswith("\ufffd".encode()) else tail
            self.sent = cut
            return out
        out = data[self.sent : cut].decode("utf-8", errors="replace")
        self.sent = max(self.sent, cut)
        return out
