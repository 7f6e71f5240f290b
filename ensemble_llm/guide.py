"""A method run's view of a grammar constraint (constraints.py): the `Guide`, the constraint's
matchers for that run, which the method consults when it picks a token, a union key or a byte,
and which follow whatever text the method commits or rolls back:

- token level (`mask_row`, `forced_tokens`): one llguidance matcher per member tokenizer; it
  masks a member's next-token row (single, the unite primary, the SAFE drafter, every SpecFuse
  drafter) and gives the tokens the grammar forces, which the method writes without sampling;
- byte level (`allows`, `byte_mask`, `forced_bytes`): one matcher over a 256-byte vocabulary (+
  end), which filters unite/SAFE union keys by the bytes they spell and gives SMC the allowed
  next bytes.

Every matcher *mirrors* a sequence the method hands it (a member's generated ids, the committed
bytes): it rolls back to the common prefix and consumes the rest, so rollback in SAFE, re-sync
in SpecFuse and particles in SMC need no bookkeeping of their own. Rejected input never enters
a matcher (llguidance's `try_consume_tokens`), so a matcher never falls into its error state.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from typing import Any, Sequence

import numpy as np
import torch

from .constraints import END, Constraint, _llguidance
from .errors import RequestError
from .members.rows import can_repick, masked_async, merge, top

HEAL_TOP = 32  # forbidden tokens (the likeliest of a row) whose mass goes to their valid prefix
CLOSE_MARGIN = 1  # tokens smc keeps in reserve beyond the closing's own (its token count is an estimate)
SEARCH_LIMIT = 4000  # matcher states the shortest-completion search may visit
BUDGET_TRIES = 4  # tokens a member may try at one step before the guide closes instead
_CLOSERS = b'"}]'  # bytes that end a string, an object, an array: the search takes the first allowed
_PREFERRED = b'"}]0n1ft[{a '  # then these (short values: 0, null, false, true, [], {}), then by byte


def member_tokenizer(member) -> Any:
    """The llguidance view of a member's tokenizer, built once per member (owned by its Vocab: it
    grows with the vocabulary, so it is not built again per request)."""
    return member.vocab.guidance_tokenizer()


class _Mirror:
    """An llguidance matcher kept equal to a sequence of tokens handed to it (see module doc)."""

    def __init__(self, matcher, width: int) -> None:
        self.m = matcher
        self.width = width  # rows of the mask (the vocabulary the ids index)
        self.seq: list[int] = []

    def sync(self, seq: Sequence[int]) -> bool:
        """Make the matcher's input equal `seq`; False (matcher left at the longest valid prefix)
        when `seq` is not allowed."""
        seq = list(seq)
        p, n = 0, min(len(seq), len(self.seq))
        while p < n and seq[p] == self.seq[p]:
            p += 1
        if p < len(self.seq):
            self.m.rollback(len(self.seq) - p)
            del self.seq[p:]
        rest = seq[p:]
        if not rest:
            return True
        took = self.m.try_consume_tokens(rest)
        self.seq.extend(rest[:took])
        return took == len(rest)

    def mask(self) -> np.ndarray:
        """Allowed next ids as a bool array of `width` entries."""
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        out = np.zeros(self.width, dtype=bool)
        n = min(self.width, len(bits))
        out[:n] = bits[:n]
        return out


def _timed(fn):
    """Adds the call's time to the guide's `seconds`; one call at a time per guide (SpecFuse drafts
    in threads when its members sit on different devices, and they share the byte matcher)."""

    def wrapper(self, *args, **kwargs):
        with self._lock:
            t0 = time.perf_counter()
            self._depth += 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:  # a timed call inside another is counted once
                    self.seconds += time.perf_counter() - t0

    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper


class Guide:
    """One method run's view of a constraint (see the module doc). `members` are the run's
    members; matchers are built on first use."""

    def __init__(self, constraint: Constraint, members: Sequence[Any]) -> None:
        self.constraint = constraint
        self.members = list(members)
        self._lock = threading.RLock()
        self._depth = 0
        self._bytes = _Mirror(constraint.byte_matcher(), END + 1)
        self._tokens: dict[int, _Mirror] = {}
        self.masked_rows = 0  # token rows masked (figures for stats)
        self.forced = 0  # tokens or bytes written without sampling
        self.seconds = 0.0  # time spent in the matchers (the constraint's own cost)
        self.healed = 0  # forbidden tokens whose mass went to their longest valid prefix
        self.merged = 0  # allowed tokens whose mass went to the token spelling them + forced bytes
        self.closed_early = False  # the budget was about to cut the match: its shortest completion was written
        self.short_by = 0  # tokens the shortest match lacked at the start (it could not fit the budget)
        self._completions: dict[bytes, bytes | None] = {}
        self._spelled: dict[tuple[int, bytes], int] = {}

    # ---- byte level (unite / SAFE union keys, SMC) ---------------------------------------------
    @_timed
    def allows(self, text: bytes, key: bytes | None) -> bool:
        """Whether the committed bytes `text` may continue with `key` (None: end the reply)."""
        if not self._bytes.sync(text):
            return False
        if key is None:
            return self._bytes.m.is_accepting()
        return self._bytes.m.validate_tokens(list(key)) == len(key)

    def key_mask(self, text: bytes, keys: Sequence[bytes | None]) -> torch.Tensor:
        """Which union keys (byte strings; None = end of reply) may follow `text`: bool[len(keys)]."""
        return torch.tensor([self.allows(text, k) for k in keys], dtype=torch.bool)

    @_timed
    def valid_prefix(self, text: bytes, data: bytes) -> int:
        """How many of the bytes `data` the grammar allows after `text`."""
        if not self._bytes.sync(text):
            return 0
        return self._bytes.m.validate_tokens(list(data))

    def key_logprobs(self, text: bytes, keys: Sequence[bytes | None], logp: torch.Tensor) -> torch.Tensor | None:
        """Union-key log-probs after `text` restricted to the grammar (None when no key is
        allowed), each forbidden key's mass moved to the allowed key that spells its longest valid
        prefix (see `mask_row`)."""
        ok = self.key_mask(text, keys)
        if not bool(ok.any()):
            return None
        out = logp.masked_fill(~ok, float("-inf"))
        where = {k: j for j, k in enumerate(keys) if k is not None and bool(ok[j])}
        for j, k in enumerate(keys):
            if bool(ok[j]) or k is None or not math.isfinite(float(logp[j])):
                continue
            n = self.valid_prefix(text, k)
            if 0 < n < len(k) and k[:n] in where:
                t = where[k[:n]]
                out[t] = torch.logaddexp(out[t], logp[j])
                self.healed += 1
        for k, j in sorted(where.items(), key=lambda kv: len(kv[0])):  # short keys first: chains merge onward
            heir = self._forced_heir(text, k, where)
            if heir is not None and math.isfinite(float(out[j])):
                out[heir] = torch.logaddexp(out[heir], out[j])
                out[j] = float("-inf")
                self.merged += 1
        return out

    def _forced_heir(self, text: bytes, key: bytes, candidates: dict[bytes, Any]) -> Any:
        """When the grammar forces bytes right after `key` (' ' then '"' before a JSON string),
        `key` and the longest candidate spelling `key` + a prefix of those bytes (' "') are one
        continuation: the candidate is returned so the two masses merge there. Writing the short
        one would split the text into tokens the models rarely saw (' ', '"') and derail them."""
        if not self._bytes.sync(text + key):
            return None
        forced = bytes(self._bytes.m.compute_ff_bytes())
        if not forced:
            return None
        best = None
        for n in range(len(forced), 0, -1):
            if key + forced[:n] in candidates:
                best = candidates[key + forced[:n]]
                break
        return best

    @_timed
    def byte_mask(self, text: bytes) -> np.ndarray:
        """Allowed next bytes after `text`: bool[257], slot 256 = end of reply."""
        if not self._bytes.sync(text):
            return np.zeros(END + 1, dtype=bool)
        return self._bytes.mask()

    @_timed
    def forced_bytes(self, text: bytes) -> bytes:
        """The bytes the grammar forces after `text` (b"" when it leaves a choice)."""
        if not self._bytes.sync(text):
            return b""
        return bytes(self._bytes.m.compute_ff_bytes())

    @_timed
    def accepting(self, text: bytes) -> bool:
        return self._bytes.sync(text) and self._bytes.m.is_accepting()

    @_timed
    def complete(self, text: bytes) -> bool:
        """Whether `text` is a full match after which the grammar allows nothing but the end."""
        return self._bytes.sync(text) and self._bytes.m.is_stopped()

    # ---- budget-aware closing -------------------------------------------------------------
    # When the budget left is just what the shortest completion of the grammar needs, the method
    # writes that completion (closes the string, fills the required fields minimally, closes
    # the object) instead of letting the budget cut the match. The budget counts the main
    # member's tokens, so a completion is measured in them (`reserve`); a token is only written
    # when the completion after it still fits (`fits`, `pick`), so closing always fits.
    @_timed
    def completion(self, text: bytes) -> bytes | None:
        """The shortest bytes that complete the grammar after `text` (b"" when it may end here;
        None when `text` is not allowed or the search gives up).

        llguidance 1.9 has no shortest-completion query (its matcher offers masks, forced bytes,
        consume/rollback and deep_copy), so this is a best-first search by length over copies
        of the byte matcher. Forced bytes are taken in one step; where closers (`"`, `}`, `]`)
        are allowed only they are tried, and inside a string (more than 12 bytes allowed) only
        the first (string content and digits never shorten a completion); elsewhere the three
        likeliest-short bytes (an enum's first letters, `0`, `n`ull) are tried, or one byte where
        more than 12 are allowed. So the result is a short completion, the shortest in the usual
        JSON cases (tested), not a proven minimum."""
        if text in self._completions:
            return self._completions[text]
        out = None
        if self._bytes.sync(text):
            heap = [(0, 0, b"", self._bytes.m.deep_copy())]
            n, order = 0, 1  # order: a unique tie-break, so matchers are never compared
            while heap and n < SEARCH_LIMIT:
                cost, _, suffix, m = heapq.heappop(heap)
                n += 1
                if m.is_accepting():
                    out = suffix
                    break
                ff = bytes(m.compute_ff_bytes())
                if ff:
                    m.consume_tokens(list(ff))
                    heapq.heappush(heap, (cost + len(ff), order, suffix + ff, m))
                    order += 1
                    continue
                bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
                allowed = np.flatnonzero(bits[:END]).tolist()
                closers = [b for b in _CLOSERS if b in allowed]
                if closers:  # inside a string (many bytes allowed) `"` ends it; elsewhere `]` may beat `"`
                    tries = closers[:1] if len(allowed) > 12 else closers
                else:
                    ranked = [b for b in _PREFERRED if b in allowed] + [b for b in allowed if b not in _PREFERRED]
                    tries = ranked[: 1 if len(allowed) > 12 else 3]
                for b in tries:
                    c = m.deep_copy()
                    if c.consume_token(b):
                        heapq.heappush(heap, (cost + 1, order, suffix + bytes([b]), c))
                        order += 1
        if len(self._completions) > 256:
            self._completions.clear()
        self._completions[text] = out
        return out

    def spell(self, i: int, data: bytes) -> list[int]:
        """Member i's tokens for `data`: its tokenization when that spells exactly these bytes,
        else a greedy longest match over its tokens' bytes."""
        member = self.members[i]
        vb = member.vocab_bytes
        try:
            ids = member.encode(data.decode("utf-8"))
            if b"".join(vb[t] for t in ids) == data:
                return ids
        except UnicodeDecodeError:
            pass
        index = member.vocab.index().by_bytes
        ids, p = [], 0
        while p < len(data):
            for n in range(min(len(data) - p, 32), 0, -1):
                t = index.get(data[p : p + n])
                if t is not None:
                    ids.append(t)
                    p += n
                    break
            else:
                return ids + [0] * (len(data) - p)  # unspellable bytes: counted one token each
        return ids

    @_timed
    def reserve(self, i: int, text: bytes) -> int | None:
        """Member i's tokens the shortest completion after `text` needs, plus `CLOSE_MARGIN`; 0
        when `text` may end here; None when no completion is known (nothing is reserved)."""
        tail = self.completion(text)
        if tail is None:
            return None
        if not tail:
            return 0
        key = (i, tail)
        if key not in self._spelled:
            if len(self._spelled) > 256:
                self._spelled.clear()
            self._spelled[key] = len(self.spell(i, tail))
        return self._spelled[key] + CLOSE_MARGIN

    def fits(self, i: int, text: bytes, left: int) -> bool:
        """Whether the shortest completion after `text` fits in `left` of member i's tokens."""
        need = self.reserve(i, text)
        return need is None or need - CLOSE_MARGIN <= left

    def closing(self, i: int, text: bytes, left: int) -> bytes | None:
        """With `left` of member i's tokens left after `text`: the bytes of the shortest
        completion when `left` is no more than it needs, for the method to write now (and end,
        finish_reason "length"); None while there is room for one more token (which `pick` /
        `fits` only lets through when the completion after it still fits: the last free token can
        be the value a field needs, e.g. `3` in `{"input": 3}`)."""
        need = self.reserve(i, text)
        if not need or need - CLOSE_MARGIN < left:  # room for one more token: `pick` checks it leaves room
            return None
        self.closed_early = True
        return self.completion(text)

    def closing_tokens(self, i: int, ids: Sequence[int], left: int) -> list[int] | None:
        """`closing` for a member writing tokens: its tokens for the completion (see `spell`)."""
        tail = self.closing(i, self.text_of(i, ids), left)
        return None if tail is None else self.spell(i, tail)

    def text_of(self, i: int, ids: Sequence[int]) -> bytes:
        vb = self.members[i].vocab_bytes
        return b"".join(vb[t] for t in ids)

    @_timed
    def pick(self, i: int, ids: Sequence[int], row: torch.Tensor, left: int, pick) -> int | None:
        """Member i's next token from its (masked) `row` with `left` tokens of budget left: `pick`
        (row -> id) chooses, and a token after which the shortest completion would no longer fit
        is masked and the choice made again, up to `BUDGET_TRIES` times. None: no tried token
        fits (the method writes the closing instead). EOS always fits."""
        member = self.members[i]
        text = self.text_of(i, ids)
        for _ in range(BUDGET_TRIES):
            tok = pick(row)
            if tok in member.eos_ids or self.fits(i, text + member.vocab_bytes[tok], left - 1):
                return tok
            if not can_repick(row):  # a row held by a Ray actor: no second pick, the closing is written
                return None
            row = row.clone()
            row[tok] = float("-inf")
            if not bool(torch.isfinite(row).any()):
                break
        return None

    def check_budget(self, i: int, budget: int) -> None:
        """At the start of a run: a `whole` constraint (a JSON document, a forced tool call) whose
        shortest match needs more of member i's tokens than `budget` is a RequestError saying how
        many (a cut document would only fail to parse)."""
        need = self.reserve(i, b"")
        if need is not None and need - CLOSE_MARGIN > budget:
            self.short_by = need - CLOSE_MARGIN - budget
            if self.constraint.whole:
                json_reply = self.constraint.kind in ("json_schema", "json_object")
                what = f"the structured output ({self.constraint.kind})" if json_reply else "the forced tool call"
                useful = (
                    "a useful document needs room for its values"
                    if json_reply
                    else "a useful call needs room for its arguments"
                )
                raise RequestError(
                    f"{what} needs at least {need - CLOSE_MARGIN} tokens (its shortest form: "
                    f"{self.constraint.head}{self.completion(b'').decode('utf-8', 'replace')}), "
                    f"but the budget (max_tokens / max_new_tokens) is {budget}; raise it to "
                    f"{need - CLOSE_MARGIN} or more ({useful})."
                )

    # ---- token level (member rows) --------------------------------------------------------
    def _mirror(self, i: int) -> _Mirror:
        if i not in self._tokens:
            member = self.members[i]
            llg = _llguidance()
            self._tokens[i] = _Mirror(
                llg.LLMatcher(member_tokenizer(member), self.constraint.grammar, log_level=0), member.vocab_size
            )
        return self._tokens[i]

    @_timed
    def token_mask(self, i: int, ids: Sequence[int]) -> np.ndarray:
        """Allowed next tokens of member i after its generated `ids`: bool[vocab]."""
        return self._token_mask(i, ids)

    def _token_mask(self, i: int, ids: Sequence[int]) -> np.ndarray:
        mirror = self._mirror(i)
        if not mirror.sync(ids):
            return np.zeros(mirror.width, dtype=bool)
        return mirror.mask()

    @_timed
    def mask_row(self, i: int, ids: Sequence[int], row: torch.Tensor) -> torch.Tensor:
        """Member i's next-token log-probs after `ids` with every token the grammar forbids at
        -inf (a copy). With no allowed token left, the member's EOS ids stay allowed.

        Prefix mass: a forbidden token can start right and only run past the grammar: after
        `{"input": 3` a model that means "end the number" puts its mass on `}},` (forbidden: the
        call ends with `}}` then a newline), and masking alone would hand the choice to `0` and
        write 300. Each of the row's `HEAL_TOP` likeliest forbidden tokens therefore lends its
        probability to the allowed token that spells its longest valid prefix (`}}`), when there
        is one: the token-level estimate of the model's probability of those bytes coming next."""
        self.masked_rows += 1
        member = self.members[i]
        width = row.shape[-1]
        allowed_np = np.asarray(self._token_mask(i, ids)[:width], dtype=bool)
        if not allowed_np.any():
            allowed_np = np.zeros(width, dtype=bool)
            allowed_np[list(member.eos_ids)] = True
        allowed = torch.from_numpy(allowed_np)
        vb, index, special = member.vocab_bytes, member.vocab.index().by_bytes, member.special_ids
        text = None
        values, tokens = top(row, HEAL_TOP)
        adds = []
        for v, t in zip(values, tokens):
            if allowed[t] or t in special or not math.isfinite(v) or not vb[t]:
                continue
            if text is None:
                text = b"".join(vb[x] for x in ids)
            d = vb[t]
            n = self._bytes.m.validate_tokens(list(d)) if self._bytes.sync(text) else 0
            heir = index.get(d[:n]) if 0 < n < len(d) else None
            if heir is not None and heir < len(allowed) and allowed[heir]:
                adds.append((heir, v))
                self.healed += 1
        out, best = masked_async(row, allowed_np, adds, HEAL_TOP)  # on its actor for a Ray member
        values, tokens = best.get()
        # an allowed token after which the grammar forces more bytes lends its mass to the allowed
        # token spelling both (see `_forced_heir`)
        if text is None:
            text = b"".join(vb[x] for x in ids)
        merges = []
        for v, t in zip(values, tokens):
            if not math.isfinite(v) or t in special or not vb[t]:
                continue
            heir = self._forced_heir(text, vb[t], index)
            if heir is not None and heir != t and heir < len(allowed) and allowed[heir]:
                merges.append((heir, t))
                self.merged += 1
        merge(out, merges)
        return out

    def take_forced(self, i: int, ids: Sequence[int], limit: int) -> list[int]:
        """The row policy's first step: the tokens of member i the grammar forces after `ids` (at
        most `limit`), counted as forced; the method writes them without sampling."""
        forced = self.forced_tokens(i, ids)[:limit]
        self.forced += len(forced)
        return forced

    def choose(self, i: int, ids: Sequence[int], row, left: int, pick) -> int | None:
        """The row policy's next steps: mask and heal member i's `row` (`mask_row`), then pick a
        token after which the shortest completion fits in `left` tokens (`pick`; None: none does)."""
        return self.pick(i, ids, self.mask_row(i, ids, row), left, pick)

    @_timed
    def forced_tokens(self, i: int, ids: Sequence[int]) -> list[int]:
        """Tokens of member i the grammar forces after `ids` (its tokenization of the forced bytes)."""
        mirror = self._mirror(i)
        if not mirror.sync(ids):
            return []
        return list(mirror.m.compute_ff_tokens())

    @_timed
    def token_done(self, i: int, ids: Sequence[int]) -> bool:
        """Whether member i's `ids` complete the grammar, which then allows nothing but the end."""
        mirror = self._mirror(i)
        return mirror.sync(ids) and mirror.m.is_stopped()

    @_timed
    def token_allows(self, i: int, ids: Sequence[int], more: Sequence[int]) -> int:
        """How many of `more` member i may write after `ids`."""
        mirror = self._mirror(i)
        if not mirror.sync(ids):
            return 0
        return mirror.m.validate_tokens(list(more))

    def stats(self) -> dict[str, Any]:
        out = {
            "constraint": self.constraint.kind,
            "masked_rows": self.masked_rows,
            "forced": self.forced,
            "healed": self.healed,
            "merged": self.merged,
            "constraint_time_s": round(self.seconds, 4),
        }
        if self.closed_early:
            out["closed_early"] = True
        if self.short_by:
            out["closing_short_by"] = self.short_by  # the budget could not hold even the shortest match
        return out
