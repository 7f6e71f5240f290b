"""Helpers shared by `unite` and `safe`: aligning members' next-token distributions by token
string (as real bytes), the union-top-k ensemble, sharpening, and keeping a member's KV cache on
its canonical tokenization of the shared text.

Token strings are compared as the bytes they stand for (`Member.vocab_bytes`), which normalises
SentencePiece `▁`, GPT-2 byte-level `Ġ`/`Ċ` and byte-fallback `<0xNN>` to one spelling. Every
member's EOS ids map to one key, `EOS`; other special tokens never take part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..members import KVState, Member
from ..members.rows import take_async, top_async
from ..members.vocab import EOS, Key, VocabIndex, valid_utf8_prefix  # noqa: F401  (the methods' names)


def vocab_index(member: Member) -> VocabIndex:
    return member.vocab.index()


def top_keys(member: Member, row, k: int) -> list[Key]:
    """The member's k most likely next tokens as keys (special tokens other than EOS skipped)."""
    return keys_of_top(member, top_async(row, 4 * k + 8).get()[1], k)


def keys_of_top(member: Member, ids: Sequence[int], k: int) -> list[Key]:
    idx = vocab_index(member)
    out: list[Key] = []
    for t in ids:
        key = idx.key_of(t)
        if key is not EOS and (t in member.special_ids or not key):
            continue
        if key not in out:
            out.append(key)
        if len(out) == k:
            break
    return out


@dataclass
class UnionDist:
    keys: list[Key]
    probs: torch.Tensor  # [U] ensemble distribution over keys (sums to 1 before sharpening)
    per_member: torch.Tensor  # [K, U] each member's softmax over the union

    def index(self, key: Key) -> int:
        return self.keys.index(key)


def union_distribution(
    members: Sequence[Member],
    rows: Sequence[torch.Tensor],
    weights: Sequence[float],
    k: int,
    onto_main: bool = False,
    turn_ends: Sequence[TurnEnd | None] = (),
    argmax_only: bool = False,
) -> UnionDist:
    """UniTE: union of every member's top-k keys; each member's logits on the union (a key it
    lacks gets its first sub-token's logit), softmax per member, weighted average.

    `onto_main`: a member's mass is read on the keys it has as tokens only, and every key's mass
    goes to the main member's (members[0]) first token of it, so the keys are the main member's
    tokens (`onto_main_tokens`).

    `turn_ends[i]` (a member whose reply ends with a newline and the next turn's header, in a plain
    chat transcript; None: its EOS ends it): where a newline is in the union, the part of member
    i's newline mass that starts the next turn moves to EOS (`end_turns`). With `argmax_only` (the
    caller picks the argmax) it is read only where moving all of that mass could change the
    argmax (`could_end`): elsewhere the pick is the same."""
    keys: list[Key] = []
    # every member's row is asked before any answer is read: remote members answer in parallel
    tops = [top_async(row, 4 * k + 8) for row in rows]
    for m, t in zip(members, tops):
        for key in keys_of_top(m, t.get()[1], k):
            if key not in keys:
                keys.append(key)
    ends = NEWLINE in keys and any(turn_ends)
    if ends and EOS not in keys:
        keys.append(EOS)
    asks = []
    for m, row in zip(members, rows):
        ids, spans = vocab_index(m).key_ids(keys, exact=onto_main)
        asks.append((take_async(row, ids), spans))
    logits = torch.tensor([VocabIndex.key_logprobs(keys, a.get(), spans) for a, spans in asks])
    per_member = torch.softmax(logits, dim=-1)
    w = torch.tensor(list(weights), dtype=per_member.dtype)
    dist = _weighted(members[0], keys, per_member, w, onto_main)
    if ends and (not argmax_only or could_end(keys, per_member, w, turn_ends, dist)):
        dist = _weighted(members[0], keys, end_turns(keys, per_member, turn_ends), w, onto_main)
    return dist


def _weighted(main: Member, keys: list[Key], per_member: torch.Tensor, w: torch.Tensor, onto_main: bool) -> UnionDist:
    if onto_main:
        keys, per_member = onto_main_tokens(main, keys, per_member)
    return UnionDist(keys, (w[:, None] * per_member).sum(0) / w.sum(), per_member)


def could_end(
    keys: list[Key], per_member: torch.Tensor, w: torch.Tensor, turn_ends: Sequence[TurnEnd | None], dist: UnionDist
) -> bool:
    """Whether moving the turn-ending members' whole newline mass (at most M of the ensemble's)
    from the newline's key to EOS could change `dist`'s argmax: EOS could pass the top key, or
    the newline, on top, could fall to another key or to EOS."""
    nl = keys.index(NEWLINE)
    moving = sum(float(w[i] * per_member[i, nl]) for i, e in enumerate(turn_ends) if e is not None) / float(w.sum())
    p = dist.probs.tolist()
    eos = dist.keys.index(EOS)
    into = next((j for j, key in enumerate(dist.keys) if key is not EOS and NEWLINE.startswith(key)), None)
    if into is None:
        return True
    top = max(range(len(p)), key=p.__getitem__)
    if top == eos:
        return False
    if top != into:
        return p[eos] + moving >= p[top]
    rest = max((x for j, x in enumerate(p) if j not in (into, eos)), default=0.0)
    return p[into] - moving <= max(rest, p[eos] + moving)


def end_turns(keys: list[Key], per_member: torch.Tensor, turn_ends: Sequence[TurnEnd | None]) -> torch.Tensor:
    """Each member with a turn end: of its mass on the newline, the part that its next turn's
    header would follow (`TurnEnd.probability`) moves to EOS. A plain transcript ends a reply with
    a newline and "User:"; read as text, that newline is a vote to end, and without the move it
    is written as text and the reply starts over (the other members never end on it)."""
    out = per_member.clone()
    nl, eos = keys.index(NEWLINE), keys.index(EOS)
    for i, end in enumerate(turn_ends):
        if end is not None and float(out[i, nl]) > 0:
            moved = out[i, nl] * end.probability()
            out[i, nl] -= moved
            out[i, eos] += moved
    return out


def onto_main_tokens(main: Member, keys: list[Key], per_member: torch.Tensor) -> tuple[list[Key], torch.Tensor]:
    """Each key's column summed into the column of the main member's first token of it (EOS stays
    EOS; a key the main member cannot start stays as it is).

    Why: with UniTE's rule a key a member lacks takes its first sub-token's logit, so that
    sub-token's mass counts twice, once for itself and once for the longer key. Where the main
    member writes a word in two tokens (SmolLM2: " ton" + "nes") and the other member has the word's
    stem as one token (Gemma: " tonne", " tonnes"), the stem " tonne" then gets the main member's
    " ton" mass as well as the other member's, beats both members' own choice, and the answer ends
    there ("tonne" where both members alone write "tonnes"). Here every member's mass counts once,
    on the token the main member would start that text with, and the next step decides the rest."""
    idx = vocab_index(main)
    target = [key if key is EOS else main_prefix(idx, key) for key in keys]
    out: list[Key] = list(dict.fromkeys(target))
    merged = torch.zeros(per_member.shape[0], len(out), dtype=per_member.dtype)
    for j, t in enumerate(target):
        merged[:, out.index(t)] += per_member[:, j]
    return out, merged


def main_prefix(idx: VocabIndex, key: bytes) -> bytes:
    """The main member's first token of `key` as bytes that start `key`: its tokenization's first
    token where that spells a prefix of the key (a tokenizer that adds a leading space or
    normalises text does not), else the longest prefix of the key it has as a token, else the key;
    carried on to the end of the character it stops in (a byte-level tokenizer's first token of
    "こんにちは" may be half of "こ", and a half character would leave the rest to the main member
    alone)."""
    tok = idx.first_subtoken(key)
    own = None if tok is None else idx.key_of(tok)
    n = len(own) if own is not EOS and own and key.startswith(own) else idx.longest_prefix(key) or len(key)
    while n < len(key) and key[n] & 0xC0 == 0x80:  # a UTF-8 continuation byte: the character goes on
        n += 1
    return key[:n]


def sharpen(
    dist: UnionDist, drafter_keys: Sequence[Key], mode: str | None, lam: float, weights: Sequence[float]
) -> torch.Tensor:
    """SAFE's probability sharpening, applied by the caller only when max(probs) < 0.5.

    heuristic: each drafter top-k key t with p(t) > lam gains the (pre-sharpening) mass of every
    other union key that starts with it; a bare space never gains; no renormalisation.
    geometric: weighted geometric mean of the members' union distributions, renormalised."""
    p = dist.probs
    if mode is None:
        return p
    if mode == "geometric":
        w = torch.tensor(list(weights), dtype=p.dtype)
        logp = (w[:, None] * torch.log(dist.per_member.clamp_min(1e-30))).sum(0) / w.sum()
        return torch.softmax(logp, dim=-1)
    out = p.clone()
    for t in drafter_keys:
        if t is EOS or t == b" " or t not in dist.keys:
            continue
        i = dist.index(t)
        if p[i] <= lam:
            continue
        for j, other in enumerate(dist.keys):
            if j != i and other is not EOS and other.startswith(t):
                out[i] += p[j]
    return out


@dataclass
class CanonicalView:
    """A member whose KV cache holds prompt + its canonical tokenization of the generated text."""

    member: Member
    prompt_len: int
    state: KVState
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # byte boundary -> log p(next)
    next_tok: dict[int, int] = field(default_factory=dict)  # byte boundary -> its own next token
    tokens: dict[int, int] = field(default_factory=dict)  # byte boundary -> the state's tokens up to it
    synced: list[int] = field(default_factory=list)  # the state's ids after the last sync

    @classmethod
    def start(cls, member: Member, prompt_ids: list[int]) -> "CanonicalView":
        return cls(member, len(prompt_ids), member.prefill(prompt_ids))

    def sync(self, text: str, from_byte: int = 0) -> None:
        """Re-tokenize `text` (the whole generated text), keep the cached common prefix, and run
        the rest in ONE forward; afterwards `rows` has log p(next) at every boundary >= from_byte."""
        m, p = self.member, self.prompt_len
        ids, ends = m.encode_with_offsets(text) if text else ([], [])
        full = self.state.ids[:p] + ids
        lcp = p
        while lcp < min(len(full), len(self.state.ids)) and full[lcp] == self.state.ids[lcp]:
            lcp += 1
        # re-feed the token that ends at (or spans) from_byte, to get the row after it
        if from_byte == 0:
            first = p - 1
        else:
            first = p + next((i for i, e in enumerate(ends) if e >= from_byte), len(ends) - 1)
        keep = min(lcp, first)
        m.crop(self.state, keep)
        logp = m.extend(self.state, full[keep:])
        self.rows, self.next_tok, self.tokens, self.synced = {}, {}, {}, list(full)
        for a in range(keep, len(full)):
            end = 0 if a == p - 1 else ends[a - p]
            if a >= p - 1:
                self.rows[end], self.tokens[end] = logp[a - keep], a + 1
        for i, tok in enumerate(ids):
            self.next_tok[0 if i == 0 else ends[i - 1]] = tok


NEWLINE = b"\n"


@dataclass
class TurnEnd:
    """Where a member's view reads its reply's end as a newline and the next turn's `header`
    ("User:", in a plain transcript): `probability` at byte `at` is p(header | text, newline)."""

    view: CanonicalView
    header: list[int]  # the header's tokens after the newline
    newline: int  # the member's newline token
    at: int = 0  # the byte the union is built at (the methods set it)

    @classmethod
    def of(cls, view: CanonicalView, turn: str) -> "TurnEnd | None":
        """From the text that starts the next turn ("\\nUser:"); None where the member's tokens of
        it do not begin with its own newline token."""
        m = view.member
        ids = m.encode(turn)
        newline = vocab_index(m).by_bytes.get(NEWLINE)
        ok = turn.startswith("\n") and newline is not None and len(ids) > 1 and ids[0] == newline
        return cls(view, ids[1:], newline) if ok else None

    def probability(self) -> float:
        """One forward of the newline and the header (less its last token) on the view's state
        cropped to byte `at` (its rows already read stay as they are; its next sync picks up from
        where the state ends)."""
        v, n = self.view, self.view.tokens[self.at]
        have = len(v.state.ids)
        if have < n:  # an earlier probe of this text cropped it shorter
            v.member.extend(v.state, v.synced[have:n], last_only=True)
        v.member.crop(v.state, n)
        ids = [self.newline] + self.header
        rows = v.member.extend(v.state, ids[:-1])
        return math.exp(sum(take_async(row, [t]).get()[0] for row, t in zip(rows, ids[1:])))


def turn_ends(views: Sequence[CanonicalView], main: int, turns: Sequence[str]) -> list[TurnEnd | None]:
    """Per member in `start_members`' order (the main member first, whose own state is ahead of
    the text in a draft: None), the views' `TurnEnd`s from the request's `turn_ends` (engine order;
    "" where a member's EOS ends its reply)."""
    others = [i for i in range(len(views) + 1) if i != main]
    return [None] + [TurnEnd.of(v, turns[i]) if turns and turns[i] else None for v, i in zip(views, others)]


def start_members(
    members: Sequence[Member], main: int, weights: Sequence[float] | None, prompt_ids: Sequence[list[int]]
) -> tuple[list[Member], list[float], KVState, list["CanonicalView"]]:
    """Prefill every member for a request: the main member (drafter / primary) first, on its own
    token history; the others as canonical views. Returns the members and weights in that order."""
    order = [main] + [i for i in range(len(members)) if i != main]
    w = list(weights or [1.0] * len(members))
    views = [CanonicalView.start(members[i], prompt_ids[i]) for i in order[1:]]
    return [members[i] for i in order], [w[i] for i in order], members[main].prefill(prompt_ids[main]), views
