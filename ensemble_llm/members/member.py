"""One loaded causal LM and the token-level API the ensembling methods use.

A method never touches transformers directly. It asks a member to encode/decode text (with byte
end offsets of every token), to render chat messages into its own prompt, and to run forwards
on a KV cache it owns through a `KVState`: prefill/extend (log-probs for every new position),
crop (rollback), batched forwards, and in-line scoring of several candidates in one pass.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from .bytelm import ByteLM
from .context import Counted, check_request, current_request, current_tally
from .convert import cached_token_bytes
from .headpad import pad_rows
from .prefix import PrefixCache, configured_bytes, seed_cache
from .protocol import IN_PROCESS, KVAccount, PromptScore, greedy_continues
from .rowgroups import RowGroupExecutor
from .scheduler import outside_steps, run_call
from .steps import Extend, Prefill, Score, Tree
from .vocab import Vocab, token_bytes


@dataclass
class KVState:
    """A member's KV cache over `ids`; `next_logprobs` is log p(. | ids) when known."""

    ids: list[int] = field(default_factory=list)
    cache: Any = None
    next_logprobs: torch.Tensor | None = None  # [V] float32
    next_logits: torch.Tensor | None = None  # [V] the raw logits behind next_logprobs
    scored: Any = None  # candidates of a score_inline(keep=True) still in the cache (see keep_candidate)
    group: Any = None  # the rowgroups.RowGroup whose row `row` holds the cache (then `cache` is None)
    row: int = -1

    def __len__(self) -> int:
        return len(self.ids)


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
    backend = ""  # members/backends.py's name, set by each backend
    _ready_outside: Any = None  # score_prompt's state kept outside a request (`_ready_slot`)
    capabilities: frozenset[str] = IN_PROCESS  # protocol.py: what it gives beyond the state API

    def sharing_cores(self, members: int):
        """A member with SHARES_CORES splits its threads while `members` decode at once; others do nothing."""
        return contextlib.nullcontext()

    tokenizer_folder: str | None = None  # a folder whose tokenizer we cached (convert.load_cached_tokenizer)

    @property
    def numerics(self) -> str:
        """What computes this member's log-probs, where it is not transformers in this process
        (cached figures such as the calibrated weights are kept apart by it)."""
        return "llama.cpp" if self.backend == "llama.cpp" else ""

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

    def _ready_slot(self, state: Any = None, take: bool = False) -> Any:
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
        ready = self._ready_slot(take=True)
        return ready if ready is not None and ready.ids == [int(i) for i in ids] else None

    def forget_prompt(self, ids: Sequence[int]) -> None:
        """Drop the state `score_prompt` kept for `ids` (a request that will not prefill here)."""
        ready = self._ready_slot(take=True)
        if ready is not None and ready.ids != [int(i) for i in ids]:
            self._ready_slot(ready)

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
            self._ready_slot(state)

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


def execution_device(module) -> torch.device | None:
    """Where `module` computes: the device accelerate runs it on (its layers may be offloaded to
    the CPU or disk), else the device of its first parameter that is not on the meta device."""
    hook = getattr(module, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    if dev is not None:
        return torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return None


def layer_devices(model, default: torch.device) -> list[torch.device]:
    """The device of each decoder layer, in order (one KV-cache layer each)."""
    try:
        layers = model.get_decoder().layers
    except (AttributeError, TypeError):
        return []
    return [execution_device(layer) or default for layer in layers]


class Member(Counted, TokenizerView):
    """A causal LM + tokenizer on transformers, with forward-pass counters for stats. Its layers may sit on one
    device or be spread by accelerate (device_map, max_memory: GPUs, CPU, disk offload): inputs go
    to the device of the input embeddings (`device`), logits and KV slices come back there."""

    backend = "transformers"

    def __init__(self, name: str, model, tokenizer, *, source: str = "") -> None:
        self.model = model.eval()
        self.device = execution_device(model.get_input_embeddings()) or torch.device("cpu")
        self.dtype = next(model.parameters()).dtype
        self.layer_devices = layer_devices(model, self.device)
        self.device_map = dict(getattr(model, "hf_device_map", None) or {})  # accelerate's placement, if any
        cfg = model.config.get_text_config(decoder=True)
        self.context_window = int(getattr(cfg, "max_position_embeddings", None) or 2048)
        eos = model.generation_config.eos_token_id if model.generation_config else None
        self._init_tokens(
            name,
            tokenizer,
            model.get_output_embeddings().weight.shape[0],
            eos if isinstance(eos, list) else [eos] if eos is not None else [],
            source,
        )
        self.n_params = sum(p.numel() for p in model.parameters())
        self.n_forward = 0
        self.n_prefill = 0  # forwards that started a fresh cache from a prompt (counted in n_forward too)
        self.forward_time = 0.0
        self._head_ok: bool | None = None  # see head_splits
        # linear layers' products of a few rows planned where the CPU's library is slow at them, by shape
        self.row_plans = pad_rows(self.model) if self.device.type == "cpu" else {}
        self.prefixes = PrefixCache(configured_bytes())  # recent prompts' KV, for prompts that begin alike
        self._lock = threading.RLock()  # one forward at a time; a RowGroup is changed under it
        self.executor = RowGroupExecutor(self)  # runs this member's calls in the engine's steps

    def __repr__(self) -> str:
        return f"Member({self.name!r}, device={self.device}, dtype={self.dtype})"

    @cached_property
    def kv_per_token(self) -> int | None:
        """Bytes of KV cache per token of context (all layers, keys and values)."""
        from .plan import kv_bytes_per_token

        return kv_bytes_per_token(self.model.config.to_dict(), self.dtype)

    def kv_account(self) -> KVAccount:
        """Its KV on its device, a batch's rows padded to the longest (rowgroups.py)."""
        return KVAccount(str(self.device), self.kv_per_token, padded=True)

    # ---- forwards ------------------------------------------------------------------------
    def _forward(self, tallies: list | None = None, hidden: bool = False, **kw) -> torch.Tensor:
        """One forward pass; a batched step passes the `tallies` of its requests (their own
        guards ran before they joined it), any other forward runs under this thread's guard.
        `hidden`: the final hidden states instead of logits (the caller applies `head`)."""
        if tallies is None:
            check_request()
            with outside_steps():  # the other requests' steps do not wait for this one
                return self._forward([current_tally()], hidden, **kw)
        with self._lock:
            t0 = time.perf_counter()
            with torch.inference_mode():
                if hidden:
                    logits = self.model.get_decoder()(**kw).last_hidden_state
                else:
                    logits = self.model(**kw).logits.to(self.device)  # a no-op unless the head sits elsewhere
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dt = time.perf_counter() - t0
            self.n_forward += 1
            self.forward_time += dt
        for tally in tallies:
            if tally is not None:
                tally.add(self, 1, dt)
        return logits

    def _own(self, state: KVState) -> None:
        """Take `state` out of its batching group (its cache becomes its own) before a forward or
        change that is not a batched step."""
        if state.group is not None:
            with self._lock:
                if state.group is not None:
                    state.group.release(state)

    def new_state(self) -> KVState:
        # Full (non-sliding) cache layers everywhere: sliding-window attention is still applied by the
        # model's masks, and a full layer can be rolled back to any length (a sliding layer cannot).
        return KVState(cache=DynamicCache())

    def extend(self, state: KVState, ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append `ids` to the cache in one forward; log-probs [len(ids), V] (row i predicts the
        token after ids[i]), or only the last row [1, V] with `last_only` (prompts: with Gemma's
        262k vocabulary, every position's logits would cost 1 MB and a full lm_head product)."""
        if not ids:
            raise ValueError("extend() needs at least one token id")
        ids = [int(i) for i in ids]
        self.drop_candidates(state)
        if len(ids) > 1 and last_only and not state.ids and state.group is None:  # a prompt
            return run_call(Prefill(self, state, ids=ids))
        return run_call(Extend(self, state, tokens=ids, last_only=last_only))

    def _extend_own(self, state: KVState, ids: Sequence[int], last_only: bool = False, tally=None) -> torch.Tensor:
        self.drop_candidates(state)
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        keep = {"logits_to_keep": 1} if last_only else {}
        tallies = None if tally is None else [tally]
        logits = self._forward(tallies, input_ids=x, cache=state.cache, use_cache=True, **keep)[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        state.ids.extend(int(i) for i in ids)
        state.next_logprobs, state.next_logits = logp[-1], logits[-1].float()
        return logp

    def prefill(self, ids: Sequence[int]) -> KVState:
        """A new state holding `ids` (the prompt); its next_logprobs is ready. The state that
        `score_prompt` left for the same ids is handed over instead of running the prompt again."""
        ready = self._take_ready(ids)
        if ready is not None:
            return ready
        self._count_prefill()
        state = self.new_state()
        self.extend(state, ids, last_only=True)
        return state

    def byte_lm(
        self, beam_width: int, prune_threshold: float, temperature: float, keep_fresh: bool | str = False
    ) -> ByteLM:
        """This member as a byte-level LM (smc); a member in an actor gives one that runs there."""
        return ByteLM(self, beam_width, prune_threshold, temperature, keep_fresh=keep_fresh)

    def score_prompt(self, ids: Sequence[int], positions: Sequence[int]) -> list[PromptScore]:
        """log p(ids[p] | ids[:p]) and its gap to the row's best, for each position p >= 1, from the
        prompt's prefill forward (the logits of those rows and of the last one only). The prefilled
        state is kept for the next `prefill` of the same ids, so a request that scores its prompt
        runs it once."""
        if not ids:
            raise ValueError("score_prompt() needs at least one token id")
        self._ready_slot(take=True)
        self._count_prefill()
        state = self.new_state()
        ids, positions = [int(i) for i in ids], [int(p) for p in positions]
        scores = run_call(Prefill(self, state, ids=ids, positions=positions))  # with other requests' prompts
        self._ready_slot(state)
        return scores

    def _prompt_own(
        self, state: KVState, ids: list[int], positions: list[int] | None = None, tally=None, seeded=None
    ) -> Any:
        """A prompt into the empty `state` in a forward of its own, from the longest stored
        beginning (prefix.py; `seeded`: what `seed` already put there): the last row's log-probs
        [1, V], or with `positions`, score_prompt's answer (only the rows before the positions it
        runs and the last row get the output layer)."""
        n, entry = self.seed(state, ids, positions, tally or current_tally()) if seeded is None else seeded
        rest, run = ids[n:], [p for p in positions or () if p > n]
        x = torch.tensor([rest], dtype=torch.long, device=self.device)
        keep = torch.tensor([p - 1 - n for p in run] + [len(rest) - 1], dtype=torch.long, device=self.device)
        tallies = None if tally is None else [tally]
        logits = self._forward(tallies, input_ids=x, cache=state.cache, use_cache=True, logits_to_keep=keep)[0]
        return self.prompt_scores(state, ids, positions, logits, n, entry)

    def seed(self, state: KVState, ids: list[int], positions: list[int] | None = None, tally=None) -> tuple[int, Any]:
        """Start the empty `state` from the longest stored beginning of `ids` (prefix.py): (n, entry),
        n the tokens it holds now (0, None: none; the whole prompt runs), counted in the request's
        `tally` (its stats' prompt_tokens_reused)."""
        n, entry = self.prefixes.match(ids, positions)
        if entry is not None:
            state.cache, state.ids = seed_cache(entry, n), list(ids[:n])
            counts = getattr(tally, "reused", None)  # a Ray actor's count of a request keeps none
            if counts is not None:
                counts[id(self)] = counts.get(id(self), 0) + n
        return n, entry

    def prompt_scores(
        self, state: KVState, ids: list[int], positions, logits: torch.Tensor, n: int = 0, entry: Any = None
    ) -> Any:
        """A prompt's answer from the logits of the rows before the `positions` past n (the first
        n tokens came from `entry`, prefix.py) and of its last row, in that order: `state`, which
        holds the prompt's KV, gets its ids and next row, and the prompt is stored for reuse.
        Returns the last row's log-probs [1, V], or with `positions` their scores."""
        last = logits[-1:].float()
        del state.ids[n:]
        state.ids.extend(ids[n:])
        state.next_logits, state.next_logprobs = last[0], torch.log_softmax(last, dim=-1)[0]
        run = [p for p in positions or () if p > n]
        scores = dict(entry.scores) if entry is not None else {}
        if run:
            logp = torch.log_softmax(logits[:-1].float(), dim=-1)
            tgt = torch.tensor([ids[p] for p in run], device=logp.device)
            got = logp.gather(1, tgt[:, None])[:, 0]
            gaps = got - logp.max(dim=-1).values
            scores.update((p, PromptScore(a, b)) for p, a, b in zip(run, got.tolist(), gaps.tolist()))
        self.keep_prompt(state, scores)
        return state.next_logprobs[None] if positions is None else [scores[p] for p in positions]

    def keep_prompt(self, state: KVState, scores: dict[int, PromptScore]) -> None:
        """Store the prompt `state` holds (its KV copied) for later prompts that begin alike."""
        if self.prefixes.max_bytes <= 0:
            return
        if state.group is not None:
            kv = state.group.row_kv(state)
        elif any(getattr(layer, "keys", None) is None for layer in state.cache.layers):
            return  # a layer without its own KV (shared across layers): nothing to copy
        else:
            kv = [(layer.keys.clone(), layer.values.clone()) for layer in state.cache.layers]
        self.prefixes.put(state.ids, kv, scores)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer on final hidden states (the model's own: lm_head and, where the config
        has one, the logit soft-cap), for a batched prompt whose rows want logits at different
        positions (rowgroups.run_prefills)."""
        with torch.inference_mode():
            logits = self.model.get_output_embeddings()(hidden)
            cap = getattr(self.model.config, "final_logit_softcapping", None)
            if cap:
                logits = torch.tanh(logits / cap) * cap
        return logits.to(self.device)

    def head_splits(self) -> bool:
        """Whether `head(decoder(x))` gives the model's own logits (checked once, on 5 tokens): then
        prompts scored at different positions can share a forward; else each runs its own."""
        if self._head_ok is None:
            x = torch.tensor([[1, 2, 3, 4, 5]], device=self.device)
            try:
                with self._lock, torch.inference_mode():
                    want = self.model(input_ids=x).logits.float()
                    got = self.head(self.model.get_decoder()(input_ids=x).last_hidden_state).float()
                self._head_ok = got.shape == want.shape and torch.allclose(got, want, atol=1e-4, rtol=1e-4)
            except Exception:  # noqa: BLE001 - an architecture without the usual decoder / head split
                self._head_ok = False
        return self._head_ok

    @contextlib.contextmanager
    def scratch(self, state: KVState):
        """Tokens extended inside the block are a draft: on exit the cache is cropped back and
        `next_logprobs` / `next_logits` are exactly what they were before (no recompute)."""
        base = len(state.ids)
        self.ensure_next(state)
        saved = (state.next_logprobs, state.next_logits)
        try:
            yield state
        finally:
            self.crop(state, base)
            state.next_logprobs, state.next_logits = saved

    def crop(self, state: KVState, n: int) -> None:
        """Roll the cache back to its first `n` tokens. next_logprobs becomes unknown (None) unless
        nothing was removed; `ensure_next` recomputes it."""
        self.drop_candidates(state)
        if not 0 <= n <= len(state.ids):
            raise ValueError(f"crop({n}) out of range for a state of {len(state.ids)} tokens")
        k = len(state.ids) - n
        if k == 0:
            return
        with self._lock:
            if state.group is not None:  # its later columns become holes: nothing is copied
                state.group.crop(state, n)
                del state.ids[n:]
                state.next_logprobs = state.next_logits = None
                return
        if n == 0:
            state.cache = DynamicCache()
        else:
            state.cache.crop(-k)
        del state.ids[n:]
        state.next_logprobs = state.next_logits = None

    def ensure_next(self, state: KVState) -> torch.Tensor:
        """log p(. | state.ids), recomputing the last position after a crop."""
        if state.next_logprobs is None:
            last = state.ids[-1]
            self.crop(state, len(state.ids) - 1)
            self.extend(state, [last])
        return state.next_logprobs

    def target_logprob(self, prompt_ids: Sequence[int], target_ids: Sequence[int]) -> float:
        """log p(target | prompt): the target's tokens scored in one forward, no cache."""
        tgt = list(target_ids)
        x = torch.tensor([list(prompt_ids) + tgt], dtype=torch.long, device=self.device)
        logits = self._forward(input_ids=x, logits_to_keep=len(tgt) + 1)[0, :-1]  # rows predicting tgt
        logp = torch.log_softmax(logits.float(), dim=-1)
        return float(logp.gather(1, torch.tensor(tgt, device=logp.device)[:, None]).sum())

    @staticmethod
    def topk(logprobs: torch.Tensor, k: int) -> tuple[list[float], list[int]]:
        vals, idx = torch.topk(logprobs, k)
        return vals.tolist(), idx.tolist()

    def forward_batch(self, seqs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Log-probs [len_i, V] for each sequence, all in one padded forward (no cache)."""
        if not seqs or any(len(s) == 0 for s in seqs):
            raise ValueError("forward_batch needs non-empty sequences")
        width = max(len(s) for s in seqs)
        x = torch.zeros((len(seqs), width), dtype=torch.long, device=self.device)
        mask = torch.zeros((len(seqs), width), dtype=torch.long, device=self.device)
        for r, s in enumerate(seqs):
            x[r, : len(s)] = torch.tensor(list(s))
            mask[r, : len(s)] = 1
        logits = self._forward(input_ids=x, attention_mask=mask, use_cache=False)
        logp = torch.log_softmax(logits.float(), dim=-1)
        return [logp[r, : len(s)] for r, s in enumerate(seqs)]

    # ---- many contexts at once (SMC): a prompt cache plus per-token KV slices ----------------
    def kv_tensor(self, state: KVState) -> torch.Tensor:
        """The cache of `state` as one tensor [layers, 2, kv_heads, tokens, head_dim] (keys, values),
        on the device of the first layer's cache."""
        self._own(state)
        layers = state.cache.layers
        dev = layers[0].keys.device
        return torch.stack([torch.stack([layer.keys[0].to(dev), layer.values[0].to(dev)]) for layer in layers])

    def _cache_from(self, kv: torch.Tensor) -> DynamicCache:
        """A cache holding `kv` [layers, 2, heads, tokens, dim], each layer on its layer's device."""
        devs = self.layer_devices if len(self.layer_devices) == kv.shape[0] else [kv.device] * kv.shape[0]
        return DynamicCache(ddp_cache_data=[(kv[i, 0][None].to(d), kv[i, 1][None].to(d)) for i, d in enumerate(devs)])

    def forward_rows(
        self, prefix_kv: torch.Tensor, paths: Sequence[Sequence[torch.Tensor]], tokens: Sequence[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One forward of B single tokens, row r continuing prefix + paths[r] (a list of one-token
        KV slices [layers, 2, heads, 1, dim], as returned here, oldest first).

        Tree attention: the prefix and every distinct path slice (rows of a context tree share
        their ancestors) are laid out ONCE as one cached sequence, and the B new tokens are one
        query row each under a mask that lets token r see the prefix, its own path and itself,
        with its true position id. Copying the prefix into B padded rows instead made the cost
        grow with B x prompt length (memory copies, not attention, dominated long chat prompts).
        Sliding-window layers get a mask of their own, so they stay exact. Returns raw logits
        [B, V] and the new token's KV slice for every row. While other requests run, the call
        joins theirs in one forward (rowgroups.py: each tree keeps its own columns)."""
        if not tokens or len(paths) != len(tokens):
            raise ValueError("forward_rows needs one path per token and at least one token")
        return run_call(Tree(self, None, tree=(prefix_kv, paths, tokens)))

    def rows_many(self, calls: Sequence[tuple], tallies: list | None = None) -> list[tuple]:
        """`forward_rows` for several (prefix_kv, paths, tokens) trees in ONE forward: every tree's
        prefix and path slices laid out one after another, each row masked to its own tree."""
        parts: list[torch.Tensor] = []
        kpos: list[int] = []
        trees = []  # per call: (first column of its prefix, prefix length, slice id -> column)
        for prefix_kv, paths, _ in calls:
            n_prefix, base, col = prefix_kv.shape[3], sum(p.shape[3] for p in parts), {}
            parts.append(prefix_kv)
            kpos.extend(range(n_prefix))
            for path in paths:
                for depth, kv in enumerate(path):
                    if id(kv) not in col:
                        col[id(kv)] = base + n_prefix + len(col)
                        kpos.append(n_prefix + depth)
            parts.extend(sorted({id(kv): kv for path in paths for kv in path}.values(), key=lambda kv: col[id(kv)]))
            trees.append((base, n_prefix, col))
        n_ctx, b = len(kpos), sum(len(t) for _, _, t in calls)
        kv = torch.cat(parts, dim=3)  # [layers, 2, heads, columns, dim]
        cache = self._cache_from(kv)
        neg = torch.finfo(self.dtype).min
        mask = torch.full((b, n_ctx + b), neg, dtype=self.dtype, device=self.device)
        qpos, r = [], 0
        for (base, n_prefix, col), (_, paths, _) in zip(trees, calls):
            for path in paths:
                mask[r, base : base + n_prefix] = 0.0
                for node in path:
                    mask[r, col[id(node)]] = 0.0
                mask[r, n_ctx + r] = 0.0
                qpos.append(n_prefix + len(path))
                r += 1
        q = torch.tensor(qpos, device=self.device)
        logits = self._forward(
            tallies,
            input_ids=torch.tensor([[int(t) for _, _, toks in calls for t in toks]], device=self.device),
            attention_mask=self._layer_masks(mask, q, torch.cat([torch.tensor(kpos, device=self.device), q])),
            position_ids=q[None],
            cache=cache,
            use_cache=True,
        )[0].float()
        to = kv.device
        new = torch.stack(
            [torch.stack([c.keys[0, :, n_ctx:].to(to), c.values[0, :, n_ctx:].to(to)]) for c in cache.layers]
        )  # [layers, 2, heads, B, dim]
        out, r = [], 0
        for _, _, toks in calls:
            out.append((logits[r : r + len(toks)], [new[:, :, :, i : i + 1].clone() for i in range(r, r + len(toks))]))
            r += len(toks)
        return out

    def _layer_masks(self, mask: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> Any:
        """The 4-D additive mask for every layer from a [q, k] mask; a model with sliding-window
        layers gets a second mask for them (a query at position i sees keys j with i - j < window)."""
        cfg = self.model.config.get_text_config(decoder=True)
        window = getattr(cfg, "sliding_window", None)
        if window and "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            far = (qpos[:, None] - kpos[None, :]) >= window
            neg = torch.finfo(self.dtype).min
            return {"full_attention": mask[None, None], "sliding_attention": mask.masked_fill(far, neg)[None, None]}
        return mask[None, None]

    def score_inline(
        self, state: KVState, candidates: Sequence[Sequence[int]], raw_logits: bool = False, keep: bool = False
    ) -> list[torch.Tensor]:
        """Log-prob (or, with `raw_logits`, the raw logit) of every token of each candidate
        continuation of `state`, all candidates in ONE forward: they are concatenated after the
        cached context with a block attention mask (each sees the context and itself) and position
        ids restarting at the context length. The cache is left as it was; with `keep`, the
        candidates' KV stays until `keep_candidate` (one of them becomes the continuation: its KV
        is exactly a plain extension's, so no forward is needed) or `drop_candidates`."""
        if not candidates or any(len(c) == 0 for c in candidates):
            raise ValueError("score_inline needs non-empty candidates")
        self.drop_candidates(state)
        self.ensure_next(state)
        cands = [[int(t) for t in c] for c in candidates]
        logits = run_call(Score(self, state, cands=cands))  # with the other requests' steps of this member
        return self.scored(state, cands, logits, raw_logits, keep)

    def scored(
        self, state: KVState, cands: list[list[int]], logits: torch.Tensor, raw_logits: bool, keep: bool
    ) -> list[torch.Tensor]:
        """score_inline's answer from the scoring forward's `logits` [total, V] (the candidates'
        columns sit after the state's; `keep` leaves them for keep_candidate). Of `logits` only
        the row after each candidate is kept until then (keep_candidate's next distribution), and
        each token's log-prob is its logit less its row's logsumexp, with no log-softmax of the
        rows made (Gemma-3, two 10-token candidates: 2 MB kept per request instead of 21 MB)."""
        starts = [sum(len(c) for c in cands[:i]) for i in range(len(cands))]
        after = logits[[s + len(c) - 1 for s, c in zip(starts, cands)]].float()  # keep_candidate's next rows
        state.scored = (len(state.ids), starts, cands, after)
        if not keep:
            self.drop_candidates(state)
        first = state.next_logits if raw_logits else state.next_logprobs
        out = []
        for s, c in zip(starts, cands):
            rows = logits[s : s + len(c) - 1].float()
            got = rows.gather(1, torch.tensor(c[1:], dtype=torch.long, device=rows.device)[:, None])[:, 0]
            if not raw_logits:
                got = got - torch.logsumexp(rows, dim=-1)
            out.append(torch.cat([first[c[0]].reshape(1).float(), got]))
        return out

    def _score_own(self, state: KVState, cands: list[list[int]], tally=None) -> torch.Tensor:
        """The candidates after the state's own cache in one forward (block mask, positions
        restarting at the context length); their KV stays in the cache. Logits [total, V]."""
        p = len(state.ids)
        total = sum(len(c) for c in cands)
        pos = [q for c in cands for q in range(p, p + len(c))]
        neg = torch.finfo(self.dtype).min
        mask = torch.full((total, p + total), neg, dtype=self.dtype, device=self.device)
        mask[:, :p] = 0.0
        s = 0
        for c in cands:
            blk = torch.triu(torch.full((len(c), len(c)), neg, dtype=self.dtype, device=self.device), 1)
            mask[s : s + len(c), p + s : p + s + len(c)] = blk
            s += len(c)
        qpos = torch.tensor(pos, device=self.device)
        return self._forward(
            None if tally is None else [tally],
            input_ids=torch.tensor([[t for c in cands for t in c]], device=self.device),
            attention_mask=self._layer_masks(mask, qpos, torch.cat([torch.arange(p, device=self.device), qpos])),
            position_ids=qpos[None],
            cache=state.cache,
            use_cache=True,
        )[0]

    def keep_candidate(self, state: KVState, index: int) -> None:
        """After score_inline(keep=True): the cache becomes context + candidate `index` (its KV
        slice moved next to the context, the others dropped) and next_logprobs the distribution
        after it, all from the scoring forward."""
        p, starts, cands, after = state.scored
        s, n = starts[index], len(cands[index])
        with self._lock:
            if state.group is not None:  # the other candidates' columns become holes
                state.group.keep(state, s, n, sum(len(c) for c in cands))
            else:
                for layer in state.cache.layers:
                    layer.keys = torch.cat([layer.keys[:, :, :p], layer.keys[:, :, p + s : p + s + n]], dim=-2)
                    layer.values = torch.cat([layer.values[:, :, :p], layer.values[:, :, p + s : p + s + n]], dim=-2)
        state.ids.extend(cands[index])
        state.next_logits = after[index]
        state.next_logprobs = torch.log_softmax(state.next_logits, dim=-1)
        state.scored = None

    def drop_candidates(self, state: KVState) -> None:
        """Remove the KV of candidates kept by score_inline(keep=True) (no-op otherwise)."""
        if state.scored is not None:
            total = sum(len(c) for c in state.scored[2])
            with self._lock:
                if state.group is not None:
                    state.group.keep(state, 0, 0, total)
                else:
                    state.cache.crop(-total)
            state.scored = None
