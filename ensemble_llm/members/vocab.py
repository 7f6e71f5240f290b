"""Every token of a vocabulary as the exact bytes it stands for.

Two tokenizer families are mapped to real bytes:
- GPT-2 byte-level BPE (SmolLM2, Qwen): each character of the token string is one byte through
  GPT-2's `bytes_to_unicode` table (`Ġ` is a space, `Ċ` a newline);
- SentencePiece-style (Gemma, Llama-2): `▁` is a space and `<0xNN>` byte-fallback tokens are one byte.
Special and added tokens keep their text but are listed in `special_ids`, so byte-level code
can treat them as atomic (never spelled byte by byte).
"""

from __future__ import annotations

import json
import re
import threading
from functools import lru_cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode()."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def tokenizer_kind(tokenizer) -> str:
    """'byte_level' or 'sentencepiece', read from the fast tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "sentencepiece"
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    text = json.dumps(decoder)
    if '"ByteLevel"' in text:
        return "byte_level"
    return "sentencepiece"


def token_bytes(tokenizer, vocab_size: int | None = None) -> tuple[list[bytes], frozenset[int]]:
    """Bytes of every token id (ids past the tokenizer's vocabulary map to b"") and the special ids."""
    kind = tokenizer_kind(tokenizer)
    size = max(len(tokenizer), vocab_size or 0)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(tokenizer.all_special_ids)
    for tok_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            special.add(tok_id)
    decoder = _byte_decoder()
    out: list[bytes] = [b""] * size
    for i, piece in enumerate(pieces):
        if piece is None:
            continue
        if i in special:
            out[i] = piece.encode("utf-8")
        elif kind == "byte_level":
            try:
                out[i] = bytes(decoder[c] for c in piece)
            except KeyError:  # an added token stored as plain text
                out[i] = piece.encode("utf-8")
        else:
            m = _BYTE_FALLBACK.match(piece)
            out[i] = bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode("utf-8")
    return out, frozenset(special)



class Vocab:
    """What is derived from one member's vocabulary, built once on first use and owned by the
    member (methods ask for it; none attaches caches of its own to a member):
    the methods' token index (`index`, methods/align.py), the byte trie (`trie`, methods/bytelm.py)
    and llguidance's tokenizer view (`guidance_tokenizer`, constraints.py)."""

    def __init__(self, member: Any) -> None:
        self._member = member
        self._lock = threading.Lock()
        self._built: dict[str, Any] = {}

    def _get(self, name: str, build) -> Any:
        with self._lock:
            if name not in self._built:
                self._built[name] = build()
            return self._built[name]

    def index(self):
        from ..methods.align import VocabIndex

        return self._get("index", lambda: VocabIndex(self._member))

    def trie(self):
        from ..methods.bytelm import VocabTrie

        m = self._member
        return self._get("trie", lambda: VocabTrie(m.vocab_bytes, m.special_ids, m.eos_ids))

    def guidance_tokenizer(self):
        """llguidance's view of the tokenizer, one entry per model output row, built from the
        exact token bytes above (special tokens marked with llguidance's 0xFF prefix, so no text
        ever matches them) rather than from tokenizer.json: 0.9 s instead of 4.8 s for Gemma's
        262k vocabulary, and it works for any tokenizer, slow ones included."""
        def build():
            import llguidance

            m = self._member
            special = m.special_ids

            class Wrapped:
                eos_token_id = m.tokenizer.eos_token_id if m.tokenizer.eos_token_id is not None else min(m.eos_ids)
                bos_token_id = m.bos_id
                tokens = [b"\xff" + b if i in special else b for i, b in enumerate(m.vocab_bytes)]
                special_token_ids = sorted(special)

                def __call__(self, data):  # llguidance tokenizes text it forces with the member's own tokenizer
                    return m.encode(data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data)

            return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()), n_vocab=m.vocab_size,
                                          eos_token=sorted(m.eos_ids))

        return self._get("guidance", build)
