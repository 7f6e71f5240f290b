"""Every token of a vocabulary as the exact bytes it stands for.

Two tokenizer families are mapped to real bytes:
- GPT-2 byte-level BPE (SmolLM2, Qwen): each character of the token string is one byte through
  GPT-2's `bytes_to_unicode` table (`Ġ` is a space, `Ċ` a newline);
- SentencePiece-style (Gemma, Llama-2): `▁` is a space and `<0xNN>` byte-fallback tokens are one byte.
Special and added tokens keep their text but are listed in `special_ids`, so byte-level code
can treat them as atomic (never spelled byte by byte).
"""

from __future__ import annotations

import bisect
import re
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import numpy as np
import torch

from .rows import take

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
    decoder = backend.decoder  # its own JSON only: the whole tokenizer's (Gemma-3: 33 MB) is slow to dump
    text = decoder.__getstate__().decode("utf-8") if decoder is not None else "{}"
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
    the methods' token index (`index`, `VocabIndex`), the byte trie (`trie`, `VocabTrie`)
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

    def index(self) -> "VocabIndex":
        return self._get("index", lambda: VocabIndex(self._member))

    def trie(self) -> "VocabTrie":
        m = self._member
        return self._get("trie", lambda: VocabTrie(m.vocab_bytes, m.special_ids, m.eos_ids))

    def guidance_tokenizer(self):
        """llguidance's view of the tokenizer, one entry per model output row, built from the
        exact token bytes above (special tokens marked with llguidance's 0xFF prefix, so no text
        ever matches them) rather than from tokenizer.json: several times faster for Gemma's 262k
        vocabulary, and it works for any tokenizer, slow ones included."""

        def build():
            import llguidance

            m = self._member
            special = m.special_ids

            class Wrapped:
                eos_token_id = m.eos_id
                bos_token_id = m.bos_id
                tokens = [b"\xff" + b if i in special else b for i, b in enumerate(m.vocab_bytes)]
                special_token_ids = sorted(special)

                def __call__(self, data):  # llguidance tokenizes text it forces with the member's own tokenizer
                    return m.encode(data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data)

            return llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(Wrapped()), n_vocab=m.vocab_size, eos_token=sorted(m.eos_ids)
            )

        return self._get("guidance", build)


EOS = None  # the union key of end-of-sequence (every member's EOS ids)
Key = bytes | None


class VocabIndex:
    """bytes -> token id of one member (non-special tokens; the lowest id wins on duplicates)."""

    def __init__(self, member: Any) -> None:
        self.member = member
        self.by_bytes: dict[bytes, int] = {}
        special = member.special_ids
        dups: dict[bytes, list[int]] = {}
        for i, b in enumerate(member.vocab_bytes):
            if b and i not in special:
                if b in self.by_bytes:
                    dups.setdefault(b, [self.by_bytes[b]]).append(i)
                else:
                    self.by_bytes[b] = i
        # Several ids can spell the same bytes (Gemma's "." and its byte-fallback <0x2E>): keep the
        # one the tokenizer itself produces, the one the model actually puts its mass on.
        for b, ids in dups.items():
            try:
                canon = member.encode(b.decode("utf-8"))
            except UnicodeDecodeError:
                continue
            if len(canon) == 1 and canon[0] in ids:
                self.by_bytes[b] = canon[0]
        self.eos = sorted(member.eos_ids)
        self.max_len = max((len(b) for b in self.by_bytes), default=1)

    def key_of(self, tok: int) -> Key:
        return EOS if tok in self.member.eos_ids else self.member.vocab_bytes[tok]

    def first_subtoken(self, key: bytes) -> int | None:
        """The member's id for `key`, else the first token of its tokenization of `key`."""
        if key in self.by_bytes:
            return self.by_bytes[key]
        try:
            ids = self.member.encode(key.decode("utf-8"))
            if ids:
                return ids[0]
        except UnicodeDecodeError:
            pass
        n = self.longest_prefix(key)  # a byte fragment: its longest known prefix
        return self.by_bytes[key[:n]] if n else None

    def longest_prefix(self, key: bytes) -> int:
        """The length of the longest prefix of `key` that is one of the member's tokens (0: none)."""
        return next((n for n in range(min(len(key), self.max_len), 0, -1) if key[:n] in self.by_bytes), 0)

    def ids_for(self, key: bytes) -> list[int]:
        """Token ids that spell `key` for this member: its own token when it has one, else its
        tokenization, else (a byte fragment) a greedy longest-match over its tokens' bytes."""
        if key in self.by_bytes:
            return [self.by_bytes[key]]
        try:
            return self.member.encode(key.decode("utf-8"))
        except UnicodeDecodeError:
            pass
        ids, i = [], 0
        while i < len(key):
            for n in range(min(len(key) - i, self.max_len), 0, -1):
                if key[i : i + n] in self.by_bytes:
                    ids.append(self.by_bytes[key[i : i + n]])
                    i += n
                    break
            else:
                raise ValueError(f"{self.member.name} cannot spell the bytes {key!r}")
        return ids

    def logprob(self, row, key: Key) -> float:
        return self.logprobs(row, [key])[0]

    def key_ids(self, keys: Sequence[Key], exact: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
        """The token ids to read for each key (all EOS ids for EOS, none for a key the member cannot
        start, or with `exact` for one it has no token of), flat, with each key's span in the flat
        list (see `key_logprobs`)."""
        ids, spans = [], []
        for key in keys:
            if key is EOS:
                sel = self.eos
            else:
                tok = self.by_bytes.get(key) if exact else self.first_subtoken(key)
                sel = [tok] if tok is not None else []
            spans.append((len(ids), len(ids) + len(sel)))
            ids += sel
        return ids, spans

    @staticmethod
    def key_logprobs(keys: Sequence[Key], values: list[float], spans) -> list[float]:
        """log p(key) for each key from the row's `values` at `key_ids`' ids."""
        out = []
        for key, (a, b) in zip(keys, spans):
            if a == b:
                out.append(float("-inf"))
            elif key is EOS:  # every EOS id of the member: their total probability
                out.append(float(torch.logsumexp(torch.tensor(values[a:b]), 0)))
            else:
                out.append(values[a])
        return out

    def logprobs(self, row, keys: Sequence[Key]) -> list[float]:
        """log p(key) for each key from one row: its token's (or first sub-token's) log-prob, the
        EOS ids' total for EOS, -inf for a key the member cannot start; one question to the row."""
        ids, spans = self.key_ids(keys)
        return self.key_logprobs(keys, take(row, ids), spans)


def valid_utf8_prefix(data: bytes) -> int:
    """Length of the longest prefix of `data` that is complete, valid UTF-8."""
    try:
        data.decode("utf-8")
        return len(data)
    except UnicodeDecodeError as exc:
        return exc.start


def _upper(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string starting with `prefix` (None: no bound)."""
    p = prefix.rstrip(b"\xff")
    return p[:-1] + bytes([p[-1] + 1]) if p else None


@dataclass(frozen=True)
class Node:
    lo: int  # first sorted position under this prefix (tokens equal to the prefix come first)
    end: int  # lo + number of tokens whose bytes equal the prefix exactly
    hi: int
    starts: np.ndarray  # [257] sorted position where the child for byte b begins; starts[256] = hi


class VocabTrie:
    MAX_CACHED = 100_000  # trie nodes kept (built lazily, on the member, across requests)

    def __init__(self, vocab_bytes: Sequence[bytes], exclude: frozenset[int], eos_ids: frozenset[int]) -> None:
        items = sorted((b, i) for i, b in enumerate(vocab_bytes) if b and i not in exclude and i not in eos_ids)
        self.keys = [b for b, _ in items]
        self.ids = [i for _, i in items]
        self.order = torch.tensor(self.ids, dtype=torch.long)
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long)
        self._nodes: dict[bytes, Node | None] = {}
        self._single = {bytes([b]) for b in range(256)} <= set(self.keys)

    def node(self, prefix: bytes) -> Node | None:
        """The node for `prefix`, or None when no token starts with it."""
        if prefix in self._nodes:
            return self._nodes[prefix]
        if len(self._nodes) >= self.MAX_CACHED:  # a long-lived server: start the cache afresh (~2 KB a node)
            self._nodes.clear()
        keys = self.keys
        lo = bisect.bisect_left(keys, prefix)
        up = _upper(prefix)
        hi = len(keys) if up is None else bisect.bisect_left(keys, up, lo)
        if lo >= hi:
            self._nodes[prefix] = None
            return None
        end = lo
        while end < hi and keys[end] == prefix:
            end += 1
        starts = np.empty(257, dtype=np.int64)
        for b in range(256):
            starts[b] = bisect.bisect_left(keys, prefix + bytes([b]), end, hi)
        starts[256] = hi
        node = Node(lo, end, hi, starts)
        self._nodes[prefix] = node
        return node

    def split(self, data: bytes) -> list[int]:
        """Greedy longest-match tokenization of any byte string (positions in sorted order)."""
        out, i = [], 0
        while i < len(data):
            best = None
            for j in range(i + 1, len(data) + 1):
                node = self.node(data[i:j])
                if node is None:
                    break
                if node.end > node.lo:
                    best = (j, node.lo)
            if best is None:
                raise ValueError(f"no token spells byte {data[i]:#x}; this vocabulary cannot write it")
            out.append(best[1])
            i = best[0]
        return out
