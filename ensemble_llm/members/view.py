"""The tokenizer side every member shares (`TokenizerView`), whatever runs its model.

Text <-> token ids with each token's byte end, byte spellings, prompt ids, the `Vocab` and the
prompt state `score_prompt` keeps for the prefill that follows (`ready_slot`).
"""

from __future__ import annotations

import contextlib
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

from .context import current_request
from .convert import cached_token_bytes
from .protocol import IN_PROCESS, greedy_continues
from .vocab import Vocab, token_bytes

# texts on which a tokenizer read here must agree with the backend's own (llama.cpp, a server)
TOKENIZER_SAMPLE = (
    "The capital of France is Paris.\nQ: What is 12 + 7?\nA: 19\n",
    "  Déjà vu — naïve café, 東京 and 😀 emoji; tabs\tand  spaces.",
    "def f(x):\n    return {'a': [1, 2.5, None]}  # code",
)


class TokenizerView:
    """The tokenizer side of a member: text <-> token ids, byte spellings, chat rendering and the
    `Vocab` (token index, byte trie, llguidance tokenizer). `Member` adds a model in this process;
    `RayMember` (ensemble_llm/ray/) adds a model in a Ray actor, tokenization staying with the caller."""

    remote = False  # True for a member whose model runs in a Ray actor (its forwards run apart)
    backend = ""  # members/backends/'s name, set by each backend
    _ready_outside: Any = None  # score_prompt's state kept outside a request (`ready_slot`)
    capabilities: frozenset[str] = IN_PROCESS  # protocol.py: what it gives beyond the state API

    def sharing_cores(self, members: int):
        """A member with SHARES_CORES splits its threads while `members` decode at once; others do nothing."""
        return contextlib.nullcontext()

    tokenizer_folder: str | None = None  # a folder whose tokenizer we cached (convert.load_cached_tokenizer)

    # what computes its log-probs where it is not transformers in this process (cached figures such as
    # the calibrated weights are kept apart by it)
    numerics = ""
    quantized: str | None = None  # how its weights are quantized ("gguf": the file's own), None: not

    def _init_tokens(self, name: str, tokenizer, vocab_size: int, eos_ids, source: str) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.source = source
        self.vocab_size = int(vocab_size)
        eos_ids = set(eos_ids)
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        # the one EOS id a method writes (SpecFuse's candidates, llguidance's tokenizer view)
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(self.eos_ids, default=None)
        self.bos_id = tokenizer.bos_token_id
        probe = tokenizer("a").input_ids
        self.adds_bos = bool(self.bos_id is not None and probe and probe[0] == self.bos_id)
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.vocab = Vocab(self)  # token index, byte trie, llguidance tokenizer: built on first use

    def ready_slot(self, state: Any = None, take: bool = False) -> Any:
        """score_prompt's prefilled state for the prefill that follows, kept by the request (or,
        outside one, by the member): set it (`state`), or take it (`take`)."""
        ctx = current_request()
        ready = ctx.ready if ctx is not None else None
        if take:
            if ready is not None:
                return ready.pop(id(self), None)
            out, self._ready_outside = self._ready_outside, None
            return out
        if ready is not None:
            ready[id(self)] = state
        else:
            self._ready_outside = state
        return None

    def _take_ready(self, ids: Sequence[int]) -> Any:
        """score_prompt's state for a prefill of `ids`, or None (a state kept for other ids is dropped)."""
        ready = self.ready_slot(take=True)
        return ready if ready is not None and ready.ids == [int(i) for i in ids] else None

    def forget_prompt(self, ids: Sequence[int]) -> None:
        """Drop the state `score_prompt` kept for `ids` (a request that will not prefill here)."""
        ready = self.ready_slot(take=True)
        if ready is not None and ready.ids != [int(i) for i in ids]:
            self.ready_slot(ready)

    def greedy_after(self, ids: Sequence[int], continuation: Sequence[int]) -> bool:
        """Whether this member's greedy continuation of the prompt `ids` begins with `continuation`
        (the shot exam's copy test), read from the state `score_prompt` kept for `ids` (else a
        prefill of its own), which stays kept for the prefill that follows. It runs a forward only
        where the first token is the greedy one (`greedy_continues`)."""
        if not continuation:
            raise ValueError("greedy_after() needs at least one token of continuation")
        state = self.prefill(ids)
        try:
            return greedy_continues(self, state, continuation)
        finally:
            self.ready_slot(state)

    # ---- text <-> tokens ---------------------------------------------------------------
    @cached_property
    def _vocab(self) -> tuple[list[bytes], frozenset[int]]:
        saved = cached_token_bytes(Path(self.tokenizer_folder)) if self.tokenizer_folder else None
        if saved is None:
            return token_bytes(self.tokenizer, self.vocab_size)
        pieces, special = saved
        return pieces + [b""] * max(0, self.vocab_size - len(pieces)), special

    @property
    def vocab_bytes(self) -> list[bytes]:
        """Bytes of every token id (index = id)."""
        return self._vocab[0]

    @property
    def special_ids(self) -> frozenset[int]:
        return self._vocab[1]

    def encode(self, text: str) -> list[int]:
        """Canonical tokenization of `text`, no special tokens added."""
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids and, for each token, the byte offset (in text.encode('utf-8')) where it ends."""
        ids = self.encode(text)
        vb = self.vocab_bytes
        ends, pos = [], 0
        for i in ids:
            pos += len(vb[i])
            ends.append(pos)
        if pos != len(text.encode("utf-8")):
            # a normalizer changed the text (e.g. a dummy prefix): fall back to char offsets
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ends = [len(text[:e].encode("utf-8")) for _, e in enc.offset_mapping]
        return ids, ends

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def prompt_ids(self, text: str) -> list[int]:
        """Token ids of a prompt: BOS added when this tokenizer uses one and the text lacks it."""
        bos_tok = self.tokenizer.bos_token
        if self.adds_bos and bos_tok and text.startswith(bos_tok):
            text = text[len(bos_tok) :]
        ids = self.encode(text)
        return ([self.bos_id] + ids) if self.adds_bos else ids
