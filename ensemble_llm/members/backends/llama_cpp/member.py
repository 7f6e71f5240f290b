"""A member on llama.cpp: the `TokenLM` protocol over llama-cpp-python (runner.py), at the GGUF
file's own quantization.

Tokenization stays the transformers tokenizer read from the GGUF (`TokenizerView`), so the ids,
byte offsets, chat templates, byte vocabularies and llguidance grammars are exactly what the
methods see on transformers; at load, llama.cpp's own tokenization of a sample is checked against
it (`check_tokenizer`), and a mismatch is refused.

A state is one sequence of the member's context (`LlamaState.seq`): prefill and extend decode it,
crop is `seq_rm`, specfuse's candidates are forks of it (`seq_cp`: the new sequence shares the
state's cells, nothing is copied) and keeping one makes that fork the state; smc's tree nodes are
forks too (`LlamaByteLM`); a prompt that begins like a stored one starts from the stored prompt's
cells (prefix.py's entries hold them as bytes, outside the context: `LlamaRunner.save`/`restore`).

Every call of one step, whatever its kind and request, is one `llama_decode` (`LlamaExecutor`):
each call's tokens at its own positions in its own sequence, logits only where a call reads them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ....errors import ConfigError
from ...bytelm import Beam, ByteLM, Context, Hyp
from ...context import check_request, current_tally
from ...prefix import PrefixCache, configured_bytes
from ...protocol import IN_PROCESS, SHARES_CORES, KVAccount, PromptScore, prompt_score
from ...scheduler import outside_steps, run_call
from ...state import StateMember
from ...steps import BatchingConfig, Extend, Prefill, Score, StepCall, Tree
from ...view import TOKENIZER_SAMPLE
from .runner import LlamaRunner, Seq

_SERIAL = itertools.count(1)
PROMPT_PIECE = 32  # prompt tokens per decode, aligned (`prompt_pieces`); under llama.cpp's 64-row tiles


@dataclass(eq=False)
class LlamaState:
    """A sequence of the member's context over `ids`; `next_logprobs` is log p(. | ids) when known."""

    ids: list[int] = field(default_factory=list)
    seq: Seq | None = None
    next_logprobs: torch.Tensor | None = None  # [V] float32
    next_logits: torch.Tensor | None = None  # [V] the raw logits behind next_logprobs
    scored: Any = None  # candidates of a score_inline(keep=True) still held (see keep_candidate)
    forks: list[Seq] | None = None  # the candidates' sequences, until one is kept or they are dropped

    def __len__(self) -> int:
        return len(self.ids)


def cpu_cores() -> int:
    """The cores this process may run on (llama.cpp's threads default to them)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def open_runner(
    path: str, n_ctx: int, device: torch.device, n_threads: int | None = None, cache_dir=None
) -> LlamaRunner:
    """The GGUF model and its context on llama.cpp: every layer on the GPU for a CUDA device, in the
    configuration this CPU and build survive (health.py: checked in a child process first)."""
    from .health import unhealthy_error, verdict

    v = verdict(Path(path), cache_dir)
    if not v.healthy:
        raise unhealthy_error(v, path)
    gpu_layers = -1 if device.type == "cuda" else 0
    return LlamaRunner(path, n_ctx, n_threads or cpu_cores(), gpu_layers, extra_bufts=bool(v.extra_bufts))


class LlamaMember(StateMember):
    """A GGUF model on llama.cpp with its transformers tokenizer (see the module)."""

    capabilities = IN_PROCESS | {SHARES_CORES}
    numerics, quantized = "llama.cpp", "gguf"

    def __init__(
        self,
        name: str,
        path: str,
        tokenizer,
        *,
        n_ctx: int,
        kv_per_token: int | None,
        device: torch.device,
        source: str = "",
        runner: LlamaRunner | None = None,
    ) -> None:
        """`runner`: the model and context, when the caller opened them already (`open_runner`)."""
        self.runner = runner or open_runner(path, n_ctx, device)
        self.cores = self.runner.n_threads  # what a decode uses when it runs alone
        self._sharing: list[int] = []  # member counts of the parallel regions this member is in (`sharing_cores`)
        self._sharing_lock = threading.Lock()
        # the file's EOS (what transformers' generation config reads from it), not every end-of-generation
        # token llama.cpp knows: the methods end where they end on transformers
        eos = self.runner.lib.llama_vocab_eos(self.runner.vocab)
        self._init_tokens(name, tokenizer, self.runner.n_vocab, [eos] if eos >= 0 else [], source)
        self.path, self.device, self.dtype = path, device, torch.float32  # logits come back as float32
        self.backend = "llama.cpp"
        self.context_window = self.runner.n_ctx_train
        self.n_params = int(self.runner.lib.llama_model_n_params(self.runner.model))
        self.kv_per_token = kv_per_token  # f16 keys and values, every layer
        # the KV budget counts this member's cells apart (its own context, never padded to other
        # rows), and no more than the context holds
        self.kv_device = f"llama.cpp:{name}#{next(_SERIAL)}"
        self.kv_capacity = self.runner.n_ctx * kv_per_token if kv_per_token else None
        self.n_forward = 0
        self.n_prefill = 0
        self.forward_time = 0.0
        self.prefixes = PrefixCache(configured_bytes())  # stored prompts: their cells saved as bytes
        self.lock = threading.RLock()  # one decode at a time; sequences change under it
        self.executor = LlamaExecutor(self)

    def __repr__(self) -> str:
        return f"LlamaMember({self.name!r}, {os.path.basename(self.path)}, n_ctx={self.runner.n_ctx})"

    @contextlib.contextmanager
    def sharing_cores(self, members: int):
        """While `members` members decode at once on these cores (methods/side.py), each decode of
        this one takes its share of the threads: two-thread decodes side by side would oversubscribe."""
        with self._sharing_lock:
            self._sharing.append(members)
        try:
            yield
        finally:
            with self._sharing_lock:
                self._sharing.remove(members)

    def kv_account(self) -> KVAccount:
        """Its cells in a context of its own (never padded to other rows), at most what the context holds."""
        return KVAccount(self.kv_device, self.kv_per_token, padded=False, capacity=self.kv_capacity)

    def decode_threads(self) -> int:
        """The threads of the next decode: every core, or its share while it decodes side by side."""
        with self._sharing_lock:
            return max(1, self.cores // max(self._sharing)) if self._sharing else self.cores

    def close(self) -> None:
        """Free the context and the model (the member is unusable after)."""
        with self.lock:
            self.prefixes.clear()
            self.runner.close()

    # ---- the state API's hooks (state.py) ---------------------------------------------------
    def new_state(self) -> LlamaState:
        return LlamaState()

    def _cut(self, state: LlamaState, n: int) -> None:
        with self.lock:
            if n == 0:
                state.seq = None  # its id goes back to the pool
            elif state.seq is not None:
                self.runner.seq_rm(state.seq.id, n, -1)

    def _keep_kv(self, state: LlamaState, index: int) -> None:
        """The state's sequence becomes candidate `index`'s fork (context + candidate)."""
        with self.lock:
            state.seq = state.forks[index]
            state.forks = None

    def _drop_kv(self, state: LlamaState) -> None:
        with self.lock:
            state.forks = None  # their ids go back to the pool

    # ---- whole prompts -----------------------------------------------------------------------
    def target_logprob(self, prompt_ids: Sequence[int], target_ids: Sequence[int]) -> float:
        """log p(target | prompt) in one decode of a sequence of its own."""
        prompt, tgt = [int(i) for i in prompt_ids], [int(i) for i in target_ids]
        ids = prompt + tgt
        check_request()
        with outside_steps(), self.lock:
            seq = self.runner.seqs.take()
            wants = [len(prompt) - 1 <= p < len(ids) - 1 for p in range(len(ids))]
            t0 = time.perf_counter()
            rows = self.executor.decode(ids, list(range(len(ids))), [seq.id] * len(ids), wants)
            self.count_forward([current_tally()], time.perf_counter() - t0)
        logp = torch.log_softmax(torch.from_numpy(rows), dim=-1)
        return float(logp.gather(1, torch.tensor(tgt)[:, None]).sum())

    def byte_lm(self, beam_width: int, prune_threshold: float, temperature: float, keep_fresh: bool | str = False):
        return LlamaByteLM(self, beam_width, prune_threshold, temperature, keep_fresh=keep_fresh)


def prompt_pieces(start: int, end: int) -> list[tuple[int, int]]:
    """The decodes that run a prompt's tokens start..end (start: a multiple of PROMPT_PIECE): every
    piece inside one aligned block of PROMPT_PIECE positions, and the last token alone. So a token
    is computed in the same decode shape whether the prompt's beginning was reused or not, and
    greedy repeats: llama.cpp's results depend on a decode's size (its kernels for a batch of rows)
    and, from 64 rows, on where the cells sit (its tiled attention); one token alone and blocks of
    fewer than 64 rows take its row-by-row attention, which skips the cells a sequence does not see."""
    bounds = list(range(start, end - 1, PROMPT_PIECE)) + [end - 1, end]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


class LlamaExecutor:
    """A llama.cpp member's executor (steps.Executor): every call of a step, of any kind and any
    request, in one `llama_decode` (see the module)."""

    apart = False

    def __init__(self, member: LlamaMember) -> None:
        self.member = member

    def group(self, call: StepCall) -> tuple:
        return (id(self.member),)

    def batchable(self, call: StepCall) -> bool:
        return True

    def run_alone(self, call: StepCall, config: BatchingConfig) -> Any:
        self.run([call], config)
        return call.result

    def recover(self, call: StepCall) -> None:
        """After a failed step: the call's sequence holds exactly its state's tokens, no forks."""
        state = call.state
        with self.member.lock:
            if state is not None:
                state.forks, state.scored = None, None
                if state.seq is not None:
                    self.member.runner.seq_rm(state.seq.id, len(state.ids), -1)

    def run(self, calls: Sequence[StepCall], config: BatchingConfig) -> None:
        """Every call's first piece in one decode, then the prompts' later pieces (`_prompt`) in
        as many more: piece k of every call that has one in decode k."""
        m = self.member
        with m.lock:
            plans = [self._plan(c) for c in calls]
            rows: list[list[np.ndarray]] = [[] for _ in plans]
            t0 = time.perf_counter()
            for k in range(max(len(p[0]) for p in plans)):
                part = [(i, p[0][k]) for i, p in enumerate(plans) if k < len(p[0])]
                cols = [[x for _, piece in part for x in piece[j]] for j in range(4)]
                out, at = self.decode(*cols), 0
                for i, piece in part:
                    n = sum(piece[3])
                    rows[i].append(out[at : at + n])
                    at += n
            m.count_forward([c.tally for c in calls], time.perf_counter() - t0)
            for p, got in zip(plans, rows):
                p[1](torch.from_numpy(got[0] if len(got) == 1 else np.concatenate(got)))

    def decode(self, tokens, positions, seqs, wants) -> np.ndarray:
        runner = self.member.runner
        runner.set_threads(self.member.decode_threads())
        return runner.decode(tokens, positions, seqs, wants)

    def _plan(self, call: StepCall) -> tuple:
        """([(tokens, positions, sequence ids, wants logits)] a piece per decode, finish(rows)) of one call."""
        if isinstance(call, Prefill):
            return self._prompt(call)
        if isinstance(call, Extend):
            return self._extend(call)
        if isinstance(call, Score):
            return self._score(call)
        if isinstance(call, Tree):
            return self._tree(call)
        raise TypeError(f"a llama.cpp member does not run {type(call).__name__} calls")

    def _seq(self, state: LlamaState) -> Seq:
        if state.seq is None:
            state.seq = self.member.runner.seqs.take()
        return state.seq

    def _extend(self, call: Extend) -> tuple:
        state, toks = call.state, call.tokens
        p0, sid = len(state.ids), self._seq(state).id
        wants = [not call.last_only or i == len(toks) - 1 for i in range(len(toks))]

        def finish(rows: torch.Tensor) -> None:
            state.ids.extend(toks)
            state.next_logits = rows[-1]
            logp = torch.log_softmax(rows, dim=-1)
            state.next_logprobs = logp[-1]
            call.result = logp

        return [(toks, list(range(p0, p0 + len(toks))), [sid] * len(toks), wants)], finish

    def _score(self, call: Score) -> tuple:
        """Each candidate in a fork of the state (sharing its cells), every candidate token's logits."""
        m, state = self.member, call.state
        p, sid = len(state.ids), self._seq(state).id
        forks = []
        tokens, positions, seqs = [], [], []
        for cand in call.cands:
            fork = m.runner.seqs.take()
            m.runner.seq_cp(sid, fork.id, -1, -1)
            forks.append(fork)
            tokens += cand
            positions += list(range(p, p + len(cand)))
            seqs += [fork.id] * len(cand)
        state.forks = forks

        def finish(rows: torch.Tensor) -> None:
            call.result = rows

        return [(tokens, positions, seqs, [True] * len(tokens))], finish

    def _prompt(self, call: Prefill) -> tuple:
        """A prompt from the longest stored beginning (its cells restored into the state's sequence), its
        rest decoded with logits at the rows before the positions it scores and at its last row,
        in canonical pieces (`prompt_pieces`)."""
        m, state, ids = self.member, call.state, call.ids
        n, entry = m.prefixes.match(ids, call.positions, align=PROMPT_PIECE)
        seq = self._seq(state)
        if entry is not None and not m.runner.restore(seq.id, entry.kv, n):
            n, entry = 0, None
        if entry is not None:
            if call.tally is not None:
                call.tally.reused[id(m)] = call.tally.reused.get(id(m), 0) + n
        run = [q for q in call.positions or () if q > n]
        reads = sorted({q - 1 for q in run} | {len(ids) - 1})
        wants = set(reads)

        def finish(rows: torch.Tensor) -> None:
            state.ids = list(ids)
            state.next_logits = rows[-1]
            state.next_logprobs = torch.log_softmax(rows[-1], dim=-1)
            scores = dict(entry.scores) if entry is not None else {}
            row_of = {q: i for i, q in enumerate(reads)}
            for q in run:
                row = rows[row_of[q - 1]]
                scores[q] = prompt_score(row, ids[q], float(torch.logsumexp(row, dim=-1)))
            self._store(state, scores)
            call.result = state.next_logprobs[None] if call.positions is None else [scores[q] for q in call.positions]

        pieces = [
            (ids[a:b], list(range(a, b)), [seq.id] * (b - a), [q in wants for q in range(a, b)])
            for a, b in prompt_pieces(n, len(ids))
        ]
        return pieces, finish

    def _store(self, state: LlamaState, scores: dict[int, PromptScore]) -> None:
        """Keep the prompt for later prompts that begin alike: its cells saved as bytes, outside the
        context. A stored prompt holds no cells, so a request run alone starts on an empty cache and
        its cells land where they landed the time before (`prompt_pieces`)."""
        m = self.member
        if not m.prefixes.keeps(len(state.ids)):
            return
        data = m.runner.save(state.seq.id)
        m.prefixes.put(state.ids, data, scores, size=len(data))

    def _tree(self, call: Tree) -> tuple:
        """smc's new contexts: each a fork of its parent's sequence plus its token."""
        prompt_len, items = call.tree
        runner, forks = self.member.runner, []
        tokens, positions, seqs = [], [], []
        for parent, token, depth in items:
            fork = runner.seqs.take()
            runner.seq_cp(parent.id, fork.id, -1, -1)
            forks.append(fork)
            tokens.append(int(token))
            positions.append(prompt_len + depth - 1)
            seqs.append(fork.id)

        def finish(rows: torch.Tensor) -> None:
            call.result = (rows, forks)

        return [(tokens, positions, seqs, [True] * len(tokens))], finish


class LlamaByteLM(ByteLM):
    """smc's byte LM on a llama.cpp member: a context node's "KV" is the sequence holding the prompt
    and its path (a fork of its parent's, sharing every cell). A node's sequence is kept while a
    hypothesis stands on it; the others go at `compact`, so a request holds about beam_width x
    particles sequences, however deep its trees grow."""

    def start(self, prompt_ids: Sequence[int]) -> Beam:
        state = self.member.prefill(prompt_ids)
        self.prompt_len = len(prompt_ids)
        root = Context(None, None, state.seq)
        self.prompt_state = state  # its sequence is the root's
        self._fill([root], state.next_logits[None])
        return Beam([Hyp(root, b"", 0.0, 0.0)])

    def _tree(self, todo: list[Context]) -> tuple:
        return self.prompt_len, [(c.parent.kv, c.token, c.depth) for c in todo]

    def _run_tree(self, todo: list[Context]) -> tuple:
        return run_call(Tree(self.member, None, tree=self._tree(todo)))

    def _todo(self, ctxs: list[Context]) -> list[Context]:
        todo, seen = [], set()
        for c in ctxs:
            if c.cs is None and id(c) not in seen:
                seen.add(id(c))
                todo.append(c)
        assert all(c.parent.kv is not None for c in todo)  # a parent's sequence is there to fork
        return todo

    def compact(self, beams: Sequence[Beam]) -> None:
        live = {id(h.ctx) for b in beams for h in b.hyps}
        for ref in self._filled:
            c = ref()
            if c is not None and id(c) not in live:
                c.kv = None  # no hypothesis stands here: its sequence goes back to the pool
        super().compact(beams)


def check_tokenizer(member: LlamaMember, samples: Sequence[str] = TOKENIZER_SAMPLE) -> None:
    """Refuse a member whose transformers tokenizer (read from the GGUF) and llama.cpp's own
    tokenizer disagree on a sample: the methods would feed llama.cpp ids it does not expect."""
    lib, vocab = member.runner.lib, member.runner.vocab
    for text in samples:
        data = text.encode("utf-8")
        buf = (lib.llama_token * (len(data) + 8))()
        n = lib.llama_tokenize(vocab, data, len(data), buf, len(buf), False, False)
        theirs = list(buf[: max(n, 0)])
        ours = member.encode(text)
        if n < 0 or theirs != ours:
            raise ConfigError(
                f"{member.name}: llama.cpp tokenizes {text[:30]!r}... as {theirs[:12]} but the tokenizer read "
                f"from the GGUF gives {ours[:12]}; give this member backend='transformers'."
            )
