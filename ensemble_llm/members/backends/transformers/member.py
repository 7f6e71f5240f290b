"""The transformers backend: one loaded causal LM, its KV caches and its forwards.

A method never touches transformers directly: it calls the state API (`StateMember`, state.py) on
a `KVState`. This module supplies what that API runs on: the KV hooks (crop a cache, keep or drop
scored candidates), the forwards a step's calls need (`run_prompt`, `run_extend`, `run_score`,
`forward`; rowgroups.py batches them), the output layer, and smc's token trees.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from ...bytelm import ByteLM
from ...context import check_request, current_tally
from ...prefix import PrefixCache, configured_bytes, seed_cache
from ...protocol import KVAccount, PromptScore
from ...scheduler import outside_steps, run_call
from ...state import StateMember
from ...steps import Tree
from .headpad import pad_rows
from .rowgroups import RowGroupExecutor


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


class Member(StateMember):
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
        self.lock = threading.RLock()  # one forward at a time; a RowGroup is changed under it
        self.executor = RowGroupExecutor(self)  # runs this member's calls in the engine's steps

    def __repr__(self) -> str:
        return f"Member({self.name!r}, device={self.device}, dtype={self.dtype})"

    @cached_property
    def kv_per_token(self) -> int | None:
        """Bytes of KV cache per token of context (all layers, keys and values)."""
        from ...plan import kv_bytes_per_token

        return kv_bytes_per_token(self.model.config.to_dict(), self.dtype)

    @property
    def quantized(self) -> str | None:
        """How the loaded weights are quantized (the model config's quant_method), or None."""
        qc = getattr(self.model.config, "quantization_config", None)
        if qc is None:
            return None
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        return str(getattr(method, "value", method))

    def kv_account(self) -> KVAccount:
        """Its KV on its device, a batch's rows padded to the longest (rowgroups.py)."""
        return KVAccount(str(self.device), self.kv_per_token, padded=True)

    # ---- forwards ------------------------------------------------------------------------
    def forward(self, tallies: list | None = None, hidden: bool = False, **kw) -> torch.Tensor:
        """One forward pass; a batched step passes the `tallies` of its requests (their own
        guards ran before they joined it), any other forward runs under this thread's guard.
        `hidden`: the final hidden states instead of logits (the caller applies `head`)."""
        if tallies is None:
            check_request()
            with outside_steps():  # the other requests' steps do not wait for this one
                return self.forward([current_tally()], hidden, **kw)
        with self.lock:
            t0 = time.perf_counter()
            with torch.inference_mode():
                if hidden:
                    logits = self.model.get_decoder()(**kw).last_hidden_state
                else:
                    logits = self.model(**kw).logits.to(self.device)  # a no-op unless the head sits elsewhere
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.count_forward(tallies, time.perf_counter() - t0)
        return logits

    def own(self, state: KVState) -> None:
        """Take `state` out of its batching group (its cache becomes its own) before a forward or
        change that is not a batched step."""
        if state.group is not None:
            with self.lock:
                if state.group is not None:
                    state.group.release(state)

    def new_state(self) -> KVState:
        # Full (non-sliding) cache layers everywhere: sliding-window attention is still applied by the
        # model's masks, and a full layer can be rolled back to any length (a sliding layer cannot).
        return KVState(cache=DynamicCache())

    def run_extend(self, state: KVState, ids: Sequence[int], last_only: bool = False, tally=None) -> torch.Tensor:
        self.drop_candidates(state)
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        keep = {"logits_to_keep": 1} if last_only else {}
        tallies = None if tally is None else [tally]
        logits = self.forward(tallies, input_ids=x, cache=state.cache, use_cache=True, **keep)[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        state.ids.extend(int(i) for i in ids)
        state.next_logprobs, state.next_logits = logp[-1], logits[-1].float()
        return logp

    def byte_lm(
        self, beam_width: int, prune_threshold: float, temperature: float, keep_fresh: bool | str = False
    ) -> ByteLM:
        """This member as a byte-level LM (smc); a member in an actor gives one that runs there."""
        return ByteLM(self, beam_width, prune_threshold, temperature, keep_fresh=keep_fresh)

    def run_prompt(
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
        logits = self.forward(tallies, input_ids=x, cache=state.cache, use_cache=True, logits_to_keep=keep)[0]
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
                with self.lock, torch.inference_mode():
                    want = self.model(input_ids=x).logits.float()
                    got = self.head(self.model.get_decoder()(input_ids=x).last_hidden_state).float()
                self._head_ok = got.shape == want.shape and torch.allclose(got, want, atol=1e-4, rtol=1e-4)
            except Exception:  # noqa: BLE001 - an architecture without the usual decoder / head split
                self._head_ok = False
        return self._head_ok

    # ---- the state API's hooks (state.py) ---------------------------------------------------
    def _fresh(self, state: KVState) -> bool:
        return not state.ids and state.group is None

    def _cut(self, state: KVState, n: int) -> None:
        with self.lock:
            if state.group is not None:  # its later columns become holes: nothing is copied
                state.group.crop(state, n)
                return
        if n == 0:
            state.cache = DynamicCache()
        else:
            state.cache.crop(n - len(state.ids))

    def _keep_kv(self, state: KVState, index: int) -> None:
        """The kept candidate's KV slice moves next to the context, the others' is dropped."""
        p, starts, cands, _ = state.scored
        s, n = starts[index], len(cands[index])
        with self.lock:
            if state.group is not None:  # the other candidates' columns become holes
                state.group.keep(state, s, n, sum(len(c) for c in cands))
            else:
                for layer in state.cache.layers:
                    layer.keys = torch.cat([layer.keys[:, :, :p], layer.keys[:, :, p + s : p + s + n]], dim=-2)
                    layer.values = torch.cat([layer.values[:, :, :p], layer.values[:, :, p + s : p + s + n]], dim=-2)

    def _drop_kv(self, state: KVState) -> None:
        total = sum(len(c) for c in state.scored[2])
        with self.lock:
            if state.group is not None:
                state.group.keep(state, 0, 0, total)
            else:
                state.cache.crop(-total)

    def target_logprob(self, prompt_ids: Sequence[int], target_ids: Sequence[int]) -> float:
        """log p(target | prompt): the target's tokens scored in one forward, no cache."""
        tgt = list(target_ids)
        x = torch.tensor([list(prompt_ids) + tgt], dtype=torch.long, device=self.device)
        logits = self.forward(input_ids=x, logits_to_keep=len(tgt) + 1)[0, :-1]  # rows predicting tgt
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
        logits = self.forward(input_ids=x, attention_mask=mask, use_cache=False)
        logp = torch.log_softmax(logits.float(), dim=-1)
        return [logp[r, : len(s)] for r, s in enumerate(seqs)]

    # ---- many contexts at once (SMC): a prompt cache plus per-token KV slices ----------------
    def kv_tensor(self, state: KVState) -> torch.Tensor:
        """The cache of `state` as one tensor [layers, 2, kv_heads, tokens, head_dim] (keys, values),
        on the device of the first layer's cache."""
        self.own(state)
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
        logits = self.forward(
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

    def run_score(self, state: KVState, cands: list[list[int]], tally=None) -> torch.Tensor:
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
        return self.forward(
            None if tally is None else [tally],
            input_ids=torch.tensor([[t for c in cands for t in c]], device=self.device),
            attention_mask=self._layer_masks(mask, qpos, torch.cat([torch.arange(p, device=self.device), qpos])),
            position_ids=qpos[None],
            cache=state.cache,
            use_cache=True,
        )[0]
