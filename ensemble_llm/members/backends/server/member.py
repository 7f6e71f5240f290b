"""A member whose model runs in a llama.cpp server (`llama-server`) that this process does not own.

Tokenization stays here (`TokenizerView`, the model's own tokenizer, checked against the server's
`/tokenize` at connect), and every prompt goes to the server as token ids. A state is only its
ids: the server keeps their KV in its prompt cache, so each call sends the whole prefix and the
server computes only what it has not seen. Two kinds of request do everything:
- a continuation (`_ahead`): the next row after a prefix and the server's own next `LOOKAHEAD`
  tokens (greedy, or drawn at the method's temperature), each with its row, so a method that
  follows the member's own tokens reads them without another request;
- a forced run (`_forced`): given tokens written by a token-id grammar, each with its exact log-prob
  and the top log-probs before it (scoring a candidate, a prompt's answer, a verifier's rows).
Concurrent requests send concurrently, and the server's continuous batching batches them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ...context import current_tally
from ...protocol import KVAccount, PromptScore
from ...scheduler import outside_steps
from ...state import StateMember
from ...steps import BatchingConfig, Extend, Prefill, Score, StepCall
from .client import ServerClient
from .rows import ANY_SERVER, GREEDY, ServerRow, missing

LOOKAHEAD = 16  # tokens of the server's own continuation asked with each next row
NO_BYTES = "smc and scoring walk every token's probability at each byte, which a server does not send"


@dataclass(eq=False)
class ServerState:
    """The ids of one sequence; the server holds their KV (its prompt cache). Its next row is a
    `ServerRow` (what the server told of it), not a tensor."""

    ids: list = field(default_factory=list)
    next_logprobs: ServerRow | None = None
    next_logits: None = None  # a server sends log-probs only
    scored: tuple | None = None  # score_inline(keep=True)'s (context length, None, candidates, rows after each)

    def __len__(self) -> int:
        return len(self.ids)


class ServerExecutor:
    """A server member's executor (steps.Executor): each call is a request on the wire, sent at once;
    the server's continuous batching batches concurrent requests, so no call waits for a step here."""

    apart = True

    def __init__(self, member: ServerMember) -> None:
        self.member = member

    def group(self, call: StepCall) -> tuple:
        return (id(self.member), call.kind)

    def batchable(self, call: StepCall) -> bool:
        return False

    def run(self, calls: Sequence[StepCall], config: BatchingConfig) -> None:
        for call in calls:
            call.result = self.run_alone(call, config)

    def run_alone(self, call: StepCall, config: BatchingConfig) -> Any:
        m = self.member
        if isinstance(call, Prefill):
            return m.run_prompt(call.state, call.ids, call.positions)
        if isinstance(call, Extend):
            return m.run_extend(call.state, call.tokens, call.last_only)
        if isinstance(call, Score):
            return [m.run_candidate(call.state, c) for c in call.cands]
        raise missing(m, f"{type(call).__name__} calls are asked", ANY_SERVER)

    def recover(self, call: StepCall) -> None:
        return None  # a call changes its state only once its answer is in


class ServerMember(StateMember):
    """A model on a llama.cpp server, with its tokenizer here: the state API of `StateMember` over
    `ServerExecutor` (see the module)."""

    backend = "server"
    capabilities: frozenset[str] = frozenset()  # no whole rows, no raw logits, no byte walk
    numerics = ""  # set per server in __init__

    def __init__(self, name: str, client: ServerClient, tokenizer, info: dict, *, top_k: int, source: str) -> None:
        self.client, self.url = client, client.url
        # top entries asked with each row: the most a method has asked of a row so far, up to `top_k`
        # (greedy `single` reads none: the server's own token; specfuse the best; unite and safe
        # their top_k). With none, a row holds the server's token alone: a log-prob per token is
        # work for the server
        self.top_k, self.most_k = 0, int(top_k)
        self.lock, self.executor = threading.RLock(), ServerExecutor(self)
        self._init_tokens(name, tokenizer, info["n_vocab"], [], source)
        self.device, self.dtype = torch.device("cpu"), torch.float32  # what it sends back: float log-probs
        self.context_window = int(info["n_ctx"])
        self.n_params = int(info.get("n_params") or 0)
        self.kv_device = f"server:{self.url}"
        # the server's llama.cpp runs the member's own GGUF file (same name): its log-probs are llama.cpp's
        same = info.get("model_file") and info.get("model_file") == info.get("member_file")
        self.numerics = "llama.cpp" if same else f"server:{info.get('model_file') or self.url}"

    def __repr__(self) -> str:
        return f"ServerMember({self.name!r}, {self.url})"

    def close(self) -> None:
        self.client.close()

    # ---- requests ----------------------------------------------------------------------------
    def _completion(self, prompt: Sequence[int], n: int, extra: dict, k: int | None = None) -> list[dict]:
        """The server's `n` tokens after `prompt`, each with its log-prob and the top-k before it."""
        body = {
            "prompt": [int(t) for t in prompt],
            "n_predict": n,
            "n_probs": self.top_k if k is None else k,
            "return_tokens": True,
            "post_sampling_probs": False,  # log-probs of the raw logits, before any sampler
            "cache_prompt": True,
            "stream": False,
            **extra,
        }
        t0 = time.perf_counter()
        with outside_steps():  # the step scheduler does not wait for a request on the wire
            ans = self.client.post("/completion", body)
        self.count_forward([current_tally()], time.perf_counter() - t0)
        probs = ans.get("completion_probabilities")
        if probs or body["n_probs"]:
            return probs or []
        return [{"id": t, "logprob": None, "top_logprobs": []} for t in ans.get("tokens") or ()]

    def _chain(self, prompt: Sequence[int], entries: list[dict], mode, forced: int) -> list[ServerRow]:
        """Rows for the positions after `prompt` that `entries` describe, each linked to the next."""
        seq = tuple(int(t) for t in prompt) + tuple(int(e["id"]) for e in entries)
        rows: list[ServerRow] = []
        for j, e in enumerate(entries):
            top = [(int(t["id"]), float(t["logprob"])) for t in e["top_logprobs"]]
            row = ServerRow(self, seq, len(prompt) + j, top)
            if e["logprob"] is not None:  # whatever wrote it, its raw log-prob
                row.values.setdefault(int(e["id"]), float(e["logprob"]))
            if j < forced or mode is not None:
                row.follow(e["id"], e["logprob"], None if j < forced else mode)
            if rows:
                rows[-1].child = row
            rows.append(row)
        if forced and len(rows) > forced:  # after the last forced token the grammar only lets an end token
            rows[forced].token, rows[forced].mode = None, None
        return rows

    def _ahead(self, prompt: Sequence[int], mode=GREEDY, seed: int | None = None, k: int | None = None, n: int = 0):
        """The row after `prompt` (a ServerRow), with the server's next `n` (LOOKAHEAD) tokens drawn at `mode`."""
        t, p = mode
        extra: dict[str, Any] = {"temperature": 0.0}
        if t > 0:
            extra = {"temperature": t, "top_p": p, "samplers": ["temperature", "top_p"], "seed": seed}
        entries = self._completion(prompt, n or LOOKAHEAD, extra, k)
        if not entries:
            raise missing(self, "it answered a completion with no log-probs", "update the server.")
        return self._chain(prompt, entries, mode, 0)[0]

    def _forced(self, prompt: Sequence[int], tokens: Sequence[int]) -> list[ServerRow]:
        """Rows after prompt, prompt + tokens[:1], ... (up to the row before an end token, which
        ends the run): `tokens` written by a token-id grammar, each with its exact log-prob. An end
        token is scored apart (`_biased`): a grammar cannot write one."""
        toks = [int(t) for t in tokens]
        cut = next((i for i, t in enumerate(toks) if t in self.eos_ids), None)
        body, end = (toks, None) if cut is None else (toks[:cut], toks[cut])
        if body:
            grammar = "root ::= " + " ".join(f"<[{t}]>" for t in body)
            extra = {"temperature": 0.0, "grammar": grammar}
            entries = self._completion(prompt, len(body) + 1, extra, max(1, self.top_k))
            rows = self._chain(prompt, entries, None, len(body))
        else:
            rows = [self._biased(prompt, end)]
        if end is not None and len(rows) > len(body) and end not in rows[len(body)].values:
            last = rows[len(body)]
            last.values[end] = self._biased(last.prefix, end).values[end]
        return rows[: len(body) + 1]

    def _biased(self, prompt: Sequence[int], token: int) -> ServerRow:
        """The row after `prompt` with `token`'s exact log-prob: the token is written by a logit
        bias (the log-probs sent are the raw logits', before it)."""
        extra = {"temperature": 0.0, "logit_bias": [[int(token), 1000.0]]}
        entries = self._completion(prompt, 1, extra, max(1, self.top_k))
        row = self._chain(prompt, entries, None, 1)[0]
        if row.token != int(token):
            raise missing(self, f"its logit bias did not write token {token}", "update the server.")
        return row

    # ---- what rows ask -----------------------------------------------------------------------
    def value_at(self, row: ServerRow, token: int) -> float:
        return self._biased(row.prefix, token).values[int(token)]

    def widen(self, row: ServerRow, n: int) -> None:
        self.top_k = max(self.top_k, min(n, self.most_k))
        wide = self._ahead(row.prefix, k=n, n=1)
        row.values.update(wide.values)
        row.order = wide.order

    def draw(self, row: ServerRow, temperature: float, top_p: float, seed: int) -> None:
        got = self._ahead(row.prefix, (temperature, top_p), seed)
        row.follow(got.token, got.values.get(got.token), (temperature, top_p))
        row.child = got.child

    # ---- accounting --------------------------------------------------------------------------
    def prompt_reused(self) -> None:
        return None  # the server's prompt cache reuses prompts; its figure is not summed per request

    def kv_account(self) -> KVAccount:
        return KVAccount(self.kv_device, None, padded=False)  # its KV is the server's

    # ---- StateMember's hooks: the server keeps the KV, a state only its ids -------------------
    def new_state(self) -> ServerState:
        return ServerState()

    def _cut(self, state: ServerState, n: int) -> None:
        return None

    def _keep_kv(self, state: ServerState, index: int) -> None:
        return None

    def _drop_kv(self, state: ServerState) -> None:
        return None

    def _set_next(self, state: ServerState, row: ServerRow | None) -> None:
        state.next_logprobs = row  # None where the candidate's run ended at it: `ensure_next` asks

    def score_inline(
        self, state: ServerState, candidates: Sequence[Sequence[int]], raw_logits: bool = False, keep: bool = False
    ) -> list[torch.Tensor]:
        if raw_logits:
            raise missing(self, "raw logits are asked (SpecFuseConfig score='logit')", "use score='logprob'.")
        return super().score_inline(state, candidates, False, keep)

    def scored(self, state: ServerState, cands: list[list[int]], runs: list, raw_logits: bool, keep: bool) -> list:
        """score_inline's answer from the executor's (log-probs, row after) per candidate."""
        state.scored = (len(state.ids), None, cands, [after for _, after in runs]) if keep else None
        return [values for values, _ in runs]

    # ---- the executor's calls: a request or two on the wire each -------------------------------
    def run_prompt(self, state: ServerState, ids: list[int], positions: list[int] | None) -> Any:
        """A prompt into `state` with its next row (a prefill's answer), and with `positions` each
        position's PromptScore too (a forced run per run of consecutive positions)."""
        state.next_logprobs = self._ahead(ids)
        state.ids = list(ids)
        if positions is None:
            return [state.next_logprobs]
        scores = {}
        for run in _runs(sorted(set(positions))):
            rows = self._forced(ids[: run[0]], ids[run[0] : run[-1] + 1])
            for q, row in zip(run, rows):
                best = row.values[row.order[0]]
                scores[q] = PromptScore(row.values[ids[q]], row.values[ids[q]] - best)
        return [scores[q] for q in positions]

    def run_extend(self, state: ServerState, ids: list[int], last_only: bool) -> list[ServerRow]:
        """Rows after each of `ids` (the last only when `last_only`): along the server's own
        continuation while `ids` follow it, else in one request."""
        rows, row, i = [], state.next_logprobs, 0
        while row is not None and i < len(ids) and row.token == ids[i] and row.child is not None:
            row = row.child
            rows.append(row)
            i += 1
        if i < len(ids):
            prefix = state.ids + ids[:i]
            if last_only or i == len(ids) - 1:
                rows.append(self._ahead(prefix + ids[i:]))
            else:
                rows += self._forced(prefix + ids[i : i + 1], ids[i + 1 :])
        state.ids += ids
        state.next_logprobs = rows[-1]
        return rows[-1:] if last_only else rows

    def run_candidate(self, state: ServerState, cand: list[int]) -> tuple[torch.Tensor, ServerRow | None]:
        """One candidate's log-probs and the row after it: along the server's own continuation when
        it is that, else written by a grammar in one request."""
        rows = self._along(state.next_logprobs, cand) or self._forced(state.ids, cand)
        values = torch.tensor([r.take([t]).get()[0] for r, t in zip(rows, cand)], dtype=torch.float32)
        return values, rows[len(cand)] if len(rows) > len(cand) else None

    @staticmethod
    def _along(row: ServerRow, cand: list[int]) -> list[ServerRow] | None:
        """The rows of `cand` when it is the continuation already held from `row`, else None."""
        rows = [row]
        for t in cand:
            if rows[-1].token != t or rows[-1].child is None:
                return None
            rows.append(rows[-1].child)
        return rows

    def greedy_after(self, ids: Sequence[int], continuation: Sequence[int], tie: float = 1e-4) -> bool:
        """As `TokenizerView.greedy_after`, from the rows of the continuation written after `ids`."""
        cont = [int(t) for t in continuation]
        if not cont:
            raise ValueError("greedy_after() needs at least one token of continuation")
        state = self.prefill(ids)
        try:
            rows = self._along(state.next_logprobs, cont) or self._forced(state.ids, cont)
            return all(r.take([t]).get()[0] >= r.top(1).get()[0][0] - tie for r, t in zip(rows, cont))
        finally:
            self.ready_slot(state)

    def target_logprob(self, prompt_ids: Sequence[int], target_ids: Sequence[int]) -> float:
        tgt = [int(t) for t in target_ids]
        rows = self._forced(prompt_ids, tgt)
        return float(sum(r.values[t] for r, t in zip(rows, tgt)))

    def byte_lm(self, beam_width: int, prune_threshold: float, temperature: float, keep_fresh: bool | str = False):
        raise missing(self, NO_BYTES, ANY_SERVER)


def _runs(positions: list[int]) -> list[list[int]]:
    """Consecutive stretches of sorted positions ([3, 4, 5, 9] -> [[3, 4, 5], [9]])."""
    out: list[list[int]] = []
    for q in positions:
        if out and q == out[-1][-1] + 1:
            out[-1].append(q)
        else:
            out.append([q])
    return out
