"""`RayMember`: the caller-side member of placement="ray", the `TokenLM` protocol over a member's
actor (tokenization and chat rendering stay in the caller, forwards run on the actor)."""

from __future__ import annotations

import collections
import contextlib
import itertools
import time
from typing import Any, Sequence

import torch

from ..errors import GenerationError
from ..members.context import Tally, check_request, current_check, current_tally
from ..members.protocol import KVAccount
from ..members.scheduler import outside_steps, run_call
from ..members.steps import BatchingConfig, Extend, Prefill, Score, StepCall, Tree
from ..members.view import TokenizerView
from .actor import MAX_RESTARTS, WAIT_SLICE_S, _ray, payload_bytes
from .handles import Pending, RemoteByteLM, RemoteRow, RemoteRows, RemoteState, _Handle

_SERIAL = itertools.count(1)


class _Count:
    """One request's figures for one member: its forwards, seconds and prefills are counted on the
    actor under `handle` (freed there when the request's Tally goes), bytes and round trips here."""

    __slots__ = ("handle", "bytes", "trips")

    def __init__(self, owner: "RayMember") -> None:
        self.handle, self.bytes, self.trips = _Handle(owner), 0, 0


class _Part:
    """One request's answer in a batched call's list of answers (its bytes counted for it alone)."""

    __slots__ = ("owner", "ref", "i")

    def __init__(self, owner: "RayMember", ref, i: int) -> None:
        self.owner, self.ref, self.i = owner, ref, i

    def get(self) -> Any:
        out = self.owner.fetch(self.ref, count=False)[self.i]
        self.owner.count_moved(payload_bytes(out), 1)
        return out


class RayExecutor:
    """A Ray member's executor (steps.Executor): a step of its calls is one call to its actor
    (`RayMember.run_batch`); a call alone is sent as it is. Its forwards run apart from this
    process, so its steps never wait for another member's (`apart`)."""

    apart = True

    def __init__(self, member: "RayMember") -> None:
        self.member = member

    def group(self, call: StepCall) -> tuple:
        return (id(self.member), call.kind)

    def batchable(self, call: StepCall) -> bool:
        return not (isinstance(call, Extend) and not call.state.ids)

    def run(self, calls: Sequence[StepCall], config: BatchingConfig) -> None:
        self.member.run_batch(calls[0].kind, list(calls))

    def recover(self, call: StepCall) -> None:
        """Nothing to undo here: a failed actor call changed nothing the caller holds."""

    def run_alone(self, call: StepCall, config: BatchingConfig) -> Any:
        m = self.member
        if isinstance(call, Prefill):
            if call.positions is not None:
                return Pending(m, m.forward("score_prompt", call.ids, call.positions))
            rows = RemoteRows(m, 1)
            m.forward("prefill", call.state.handle.id, rows.handle.id, call.ids)
            return rows
        if isinstance(call, Extend):
            rows = RemoteRows(m, 1 if call.last_only else len(call.tokens))
            m.forward("extend", call.state.handle.id, rows.handle.id, call.tokens, call.last_only)
            return rows
        if isinstance(call, Score):
            return Pending(m, m.forward("score_inline", call.state.handle.id, call.cands, call.raw_logits, call.keep))
        if isinstance(call, Tree) and call.tree[0] == "bytelm":  # (_, byte LM handle, beam handles)
            return m.ask("bytelm_next", call.tree[1], call.tree[2])
        raise ValueError(f"a member in a Ray actor does not run {type(call).__name__} calls")


class RayMember(TokenizerView):
    """A member whose model runs in a Ray actor (see the module docstring)."""

    remote = True

    def __init__(self, actor, info: dict, tokenizer, *, spec: str, resources: dict) -> None:
        self.actor, self.spec, self.resources = actor, spec, resources
        self.placement_group = None  # the Ray placement group its bundle belongs to
        self._init_tokens(info["name"], tokenizer, info["vocab_size"], info["eos_ids"], info["source"])
        self.context_window = int(info["context_window"])
        self.n_params = int(info["n_params"])
        self.dtype = info["dtype"]  # the actor's torch dtype, as a string
        self.backend = info.get("backend", "transformers")  # what runs the model on the actor
        self.numerics = info.get("numerics", "")
        self.quantized = info.get("quantized")
        self.actor_device = info["device"]
        self.kv_per_token = info.get("kv_per_token")  # KV bytes per token of context, on the actor
        self.free_bytes = int(info.get("free_bytes") or 0)  # free where its KV lives, once loaded
        # the KV budget counts this member's caches apart from every other device (its actor's own)
        self.kv_device = f"ray:{info['name']}#{next(_SERIAL)}"
        self.device = torch.device("cpu")  # where the caller's own (small) tensors live
        self.handle_ids = itertools.count(1)
        self.dead_handles: collections.deque[int] = collections.deque()
        self.bytes_moved = 0
        self.round_trips = 0  # waits for an answer (calls that need none are queued without waiting)
        self._known = (0, 0.0, 0)  # the actor's counters when last read
        self.executor = RayExecutor(self)  # its calls in the engine's steps: one actor call a step

    def __repr__(self) -> str:
        return f"RayMember({self.name!r}, actor device={self.actor_device}, dtype={self.dtype})"

    def kv_account(self) -> KVAccount:
        """Its caches on its actor, counted apart, against what was free there once it loaded."""
        return KVAccount(self.kv_device, self.kv_per_token, True, None, (str(self.actor_device), self.free_bytes))

    def prompt_reused(self) -> None:
        return None  # its actor's stored prompts are not counted per request

    # ---- calls ---------------------------------------------------------------------------
    def _request(self) -> _Count | None:
        """The calling request's figures for this member (None outside a request)."""
        return self._of(current_tally())

    def _of(self, tally: Tally | None) -> _Count | None:
        """A request's figures for this member, by its Tally."""
        if tally is None:
            return None
        c = tally.remote.get(id(self))
        if c is None:
            c = tally.remote[id(self)] = _Count(self)
        return c

    def count_moved(self, nbytes: int, trips: int) -> None:
        """Bytes and round trips, for the member and for the calling request."""
        self.bytes_moved += nbytes
        self.round_trips += trips
        c = self._request()
        if c is not None:
            c.bytes += nbytes
            c.trips += trips

    def submit(self, op: str, *args, count: bool = True, tags: tuple | None = None):
        """Queue `op` on the actor; the forwards it runs count for the requests in `tags` (by
        default the calling one: smc's byte LM, for one, runs forwards inside its calls)."""
        if tags is None:
            c = self._request()
            tags = () if c is None else (c.handle.id,)
        dead = []
        while True:
            try:
                dead.append(self.dead_handles.popleft())
            except IndexError:
                break
        if count:
            self.count_moved(payload_bytes(args) + 8 * len(dead), 0)
        return self.actor.call.remote(op, args, dead, tags)

    def ask(self, op: str, *args) -> Pending:
        return Pending(self, self.submit(op, *args))

    def forward(self, op: str, *args):
        """A call that runs a forward pass: the request's guard (deadline, cancellation) first; the
        actor counts its forwards for the request."""
        check_request()
        return self.submit(op, *args)

    def _get_raw(self, ref, check, count: bool = True) -> Any:
        ray = _ray()
        while True:
            try:
                out = ray.get(ref, timeout=WAIT_SLICE_S)
                break
            except ray.exceptions.GetTimeoutError:
                if check is not None:
                    check()  # raises past the request's deadline or when its caller went away
        if count:
            self.count_moved(payload_bytes(out), 1)
        return out

    def fetch(self, ref, count: bool = True) -> Any:
        ray = _ray()
        try:
            return self._get_raw(ref, current_check(), count)
        except ray.exceptions.RayActorError as exc:
            raise GenerationError(
                f"member {self.name!r} (Ray actor) died during the request: {type(exc).__name__}; Ray restarts it "
                f"(max_restarts={MAX_RESTARTS}) and the next request runs on the new actor"
            ) from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            raise GenerationError(f"member {self.name!r} (Ray actor) failed: {cause}") from exc

    def counters(self) -> tuple[int, float, int, int, int]:
        """(forwards, forward seconds, prefills, bytes moved, round trips) so far, read from the actor
        once every call queued before has run; this read itself is not counted. The engine reads
        them first thing in every request, so this is also where a request waits for an actor Ray
        is restarting (within its deadline)."""
        c = self._request()
        if c is not None:  # the calling request's own figures (other requests run beside it)
            n, t, p = self._ready("counters", c.handle.id)
            return n, t, p, c.bytes, c.trips
        self._known = self._ready("counters")
        n, t, p = self._known
        return n, t, p, self.bytes_moved, self.round_trips

    def _ready(self, op: str, *args) -> Any:
        """`op`'s answer once the actor is up: while Ray restarts it (after a crash) calls are
        refused with ActorUnavailableError; wait for it, checking the request's deadline."""
        ray = _ray()
        check = current_check()
        while True:
            try:
                return self._get_raw(self.submit(op, *args, count=False), check, count=False)
            except ray.exceptions.ActorUnavailableError:
                if check is not None:
                    check()
                time.sleep(WAIT_SLICE_S * 4)
            except ray.exceptions.RayActorError as exc:
                raise GenerationError(
                    f"member {self.name!r} (Ray actor) is dead and Ray will not restart it "
                    f"({type(exc).__name__}: {exc}); make a new engine to place it again"
                ) from exc
            except ray.exceptions.RayTaskError as exc:
                raise GenerationError(f"member {self.name!r} (Ray actor) failed: {exc.as_instanceof_cause()}") from exc

    @property
    def n_forward(self) -> int:
        return self.counters()[0]

    @property
    def forward_time(self) -> float:
        return self.counters()[1]

    @property
    def n_prefill(self) -> int:
        return self.counters()[2]

    # ---- the TokenLM protocol ------------------------------------------------------------
    def prefill(self, ids: Sequence[int]) -> RemoteState:
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("extend() needs at least one token id")
        state = RemoteState(self)
        rows = run_call(Prefill(self, state, ids=ids))  # with the other requests' prompts, one call (run_batch)
        state.ids, state.next_row = ids, rows[0]
        return state

    def extend(self, state: RemoteState, ids: Sequence[int], last_only: bool = False) -> RemoteRows:
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("extend() needs at least one token id")
        state.scored = None
        rows = run_call(Extend(self, state, tokens=ids, last_only=bool(last_only)))  # with the others' extends
        state.ids.extend(ids)
        state.next_row = rows[-1]
        return rows

    def crop(self, state: RemoteState, n: int) -> None:
        if not 0 <= n <= len(state.ids):
            raise ValueError(f"crop({n}) out of range for a state of {len(state.ids)} tokens")
        if state.scored is None and n == len(state.ids):
            return
        state.scored = None
        self.submit("crop", state.handle.id, int(n))
        if n < len(state.ids):
            del state.ids[n:]
            state.next_row = None

    def ensure_next(self, state: RemoteState) -> RemoteRow:
        if state.next_row is None:
            rows = RemoteRows(self, 1)
            self.forward("ensure_next", state.handle.id, rows.handle.id)
            state.next_row = rows[0]
        return state.next_row

    @contextlib.contextmanager
    def scratch(self, state: RemoteState):
        base = len(state.ids)
        self.ensure_next(state)
        saved = state.next_row
        self.submit("scratch_enter", state.handle.id)
        try:
            yield state
        finally:
            self.submit("scratch_exit", state.handle.id)
            del state.ids[base:]
            state.next_row, state.scored = saved, None

    def score_inline(
        self, state: RemoteState, candidates: Sequence[Sequence[int]], raw_logits: bool = False, keep: bool = False
    ) -> list[torch.Tensor]:
        cands = [[int(t) for t in c] for c in candidates]
        if not cands or any(len(c) == 0 for c in cands):
            raise ValueError("score_inline needs non-empty candidates")
        self.ensure_next(state)
        call = Score(self, state, cands=cands, raw_logits=bool(raw_logits), keep=bool(keep))
        part = run_call(call)  # with the others' steps
        out = part.get()
        state.scored = cands if keep else None
        return [torch.tensor(x) for x in out]

    def keep_candidate(self, state: RemoteState, index: int) -> None:
        if state.scored is None:
            raise ValueError("keep_candidate needs a score_inline(keep=True) first")
        rows = RemoteRows(self, 1)
        self.submit("keep_candidate", state.handle.id, int(index), rows.handle.id)
        state.ids.extend(state.scored[index])
        state.next_row, state.scored = rows[0], None

    def drop_candidates(self, state: RemoteState) -> None:
        if state.scored is not None:
            self.submit("drop_candidates", state.handle.id)
            state.scored = None

    def score_prompt(self, ids: Sequence[int], positions: Sequence[int]) -> list[float]:
        """`Member.score_prompt` on the actor: the prompt's state stays there for the next prefill.
        While other requests run, it joins their prompts' step (one forward on the actor)."""
        ids, positions = [int(i) for i in ids], [int(p) for p in positions]
        if not ids:
            raise ValueError("score_prompt() needs at least one token id")
        part = run_call(Prefill(self, None, ids=ids, positions=positions))  # with the others' prompts
        with outside_steps():  # the other requests' steps do not wait for its answer
            return part.get()

    def forget_prompt(self, ids: Sequence[int]) -> None:
        """Drop the state `score_prompt` left on the actor for `ids` (sent, not waited for)."""
        self.submit("forget_prompt", [int(i) for i in ids], count=False)

    def greedy_after(self, ids: Sequence[int], continuation: Sequence[int]) -> bool:
        """`Member.greedy_after` on the actor, on the state score_prompt left there."""
        if not continuation:
            raise ValueError("greedy_after() needs at least one token of continuation")
        with outside_steps():
            return Pending(
                self, self.forward("greedy_after", [int(i) for i in ids], [int(t) for t in continuation])
            ).get()

    def target_logprob(self, prompt_ids: Sequence[int], target_ids: Sequence[int]) -> float:
        with outside_steps():
            return Pending(
                self, self.forward("target_logprob", [int(i) for i in prompt_ids], [int(i) for i in target_ids])
            ).get()

    # ---- batched steps (members/scheduler.py): one call to the actor per step -------------
    def run_batch(self, kind: str, calls: list) -> None:
        """Send one step of several requests' calls to the actor, which runs them batched there
        (`op_prefills`, `op_step`). The rows stay on the actor as handles, so this does not wait:
        each call's result is its rows (a scoring call: its part of the answer, fetched by its
        request). Their forwards count for each request in the step."""
        counts = [self._of(c.tally) for c in calls]
        if kind == "prefill":  # prompts, and prompts scored for their request's weights (score_prompt)
            items = []
            for c, n in zip(calls, counts):
                tag = None if n is None else n.handle.id
                if c.positions is not None:
                    items.append((None, None, list(c.ids), tag, list(c.positions)))
                    continue
                c.result = RemoteRows(self, 1)
                items.append((c.state.handle.id, c.result.handle.id, list(c.ids), tag, None))
            ref = self.submit("prefills", items, count=False, tags=())  # counted per request there
            for i, c in enumerate(calls):
                if c.positions is not None:
                    c.result = _Part(self, ref, i)
        elif kind == "step":  # each request's forwards counted there (a step may run in two forwards)
            items = []
            for c, n in zip(calls, counts):
                tag = None if n is None else n.handle.id
                if not isinstance(c, Score):
                    c.result = RemoteRows(self, 1 if c.last_only else len(c.new))
                    items.append(("extend", c.state.handle.id, c.result.handle.id, c.new, c.last_only, tag))
                else:
                    items.append(("score", c.state.handle.id, c.cands, c.raw_logits, c.keep, tag))
            ref = self.submit("step", items, count=False, tags=())
            for i, c in enumerate(calls):
                if isinstance(c, Score):
                    c.result = _Part(self, ref, i)
        elif kind == "tree" and all(c.tree[0] == "bytelm" for c in calls):  # smc: requests' byte LMs
            # each request's forwards are counted on the actor, for those whose contexts needed one
            items = [(c.tree[1], c.tree[2], None if n is None else n.handle.id) for c, n in zip(calls, counts)]
            ref = self.submit("bytelm_next_many", items, count=False, tags=())
            for i, c in enumerate(calls):
                c.result = _Part(self, ref, i)
        else:
            raise ValueError(f"a member in a Ray actor does not batch {kind!r} calls")
        for n, item in zip(counts, items):  # each request's items count for it
            nbytes = payload_bytes(item)
            self.bytes_moved += nbytes
            if n is not None:
                n.bytes += nbytes

    def byte_lm(
        self, beam_width: int, prune_threshold: float, temperature: float, keep_fresh: bool | str = False
    ) -> RemoteByteLM:
        return RemoteByteLM(self, beam_width, prune_threshold, temperature, keep_fresh)
