"""`placement="ray"`: every member in a Ray actor, the ensemble logic in the caller.

`MemberActor` (one per member, in a Ray worker) holds the model, its KV states, the rows of
log-probs each forward produced and, for smc, the member's `ByteLM`. `RayMember` (in the caller)
implements the `TokenLM` protocol over it: tokenization, chat rendering and the vocabulary index
stay in the caller (a `TokenizerView` on the same tokenizer files), forwards and every
vocabulary-sized step run on the actor, and only small results cross the wire:

- a KV state is a handle (`RemoteState`) whose token ids the caller mirrors;
- a forward's log-prob rows stay on the actor (`RemoteRows` / `RemoteRow` handles); the methods
  ask them for what they need: the top-k (UniTE's union inputs), the values at given ids, the
  argmax, a sampled token (`members.rows`);
- in-line scoring returns one number per candidate token; smc's byte LM runs on the actor and
  returns 257-slot byte distributions per beam.

Calls are submitted without waiting (a Ray actor runs its calls in submission order) and the
caller only waits where it needs a value, so the forwards of different members run concurrently:
verifiers verify and SpecFuse members draft in parallel. Handles the caller drops are freed on
the actor with the next call. Payload bytes both ways are counted per member (`bytes_moved`).

Faults: a dead actor (killed, out of memory) fails the request with a `GenerationError` naming
the member; Ray restarts it (`max_restarts`) and the next request runs on the fresh actor. The
caller waits in short slices and checks the request's deadline between them, so a timeout holds.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import ConfigError, GenerationError
from .member import TokenizerView, current_guard

log = logging.getLogger("ensemble_llm.ray")

MAX_RESTARTS = 4  # a dead member's actor is restarted this many times (then its requests fail)
PLACEMENT_TIMEOUT_S = 60.0  # how long load() waits for the cluster to find room for the members
WAIT_SLICE_S = 0.05  # the caller checks the request's deadline this often while it waits
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "chat_template.jinja",
                   "chat_template.json")
RESOURCE_KEYS = ("num_cpus", "num_gpus", "memory", "resources", "torch_threads")


def _ray():
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - ray is a dependency of the ray extra and of the tests
        raise ConfigError("placement='ray' needs Ray: pip install 'ensemble-llm[ray]'") from exc
    return ray


def payload_bytes(obj: Any) -> int:
    """Bytes of a call's arguments or result as data (ids, floats, arrays), not Ray's framing."""
    if obj is None or isinstance(obj, bool):
        return 1
    if isinstance(obj, (int, float)):
        return 8
    if isinstance(obj, (bytes, str)):
        return len(obj)
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(payload_bytes(k) + payload_bytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        if obj and all(type(x) is int for x in obj):
            return 8 * len(obj)
        return sum(payload_bytes(x) for x in obj)
    return 8


# ---- the actor ---------------------------------------------------------------------------------
class MemberActor:
    """One member in a Ray worker: the model, its KV states and rows, by handle."""

    def __init__(self, spec: str, dtype: str, cache_dir: str | None, trust_remote_code: bool,
                 threads: int | None) -> None:
        from .loader import load_member

        if threads:
            torch.set_num_threads(threads)
        device = "cuda" if torch.cuda.is_available() else "cpu"  # Ray shows an actor only its own GPUs
        self.member = load_member(spec, device=device, dtype=dtype, cache_dir=cache_dir,
                                  trust_remote_code=trust_remote_code, progress=False)
        self.objs: dict[int, Any] = {}
        self.scratch: dict[int, list] = {}
        self.last_error = "none"

    def info(self) -> dict:
        m = self.member
        eos = m.model.generation_config.eos_token_id if m.model.generation_config else None
        return {"name": m.name, "vocab_size": m.vocab_size, "context_window": m.context_window,
                "eos_ids": eos if isinstance(eos, list) else [eos] if eos is not None else [],
                "n_params": m.n_params, "dtype": str(m.dtype), "device": str(m.device), "source": m.source,
                "threads": torch.get_num_threads()}

    def tokenizer_digest(self) -> str:
        """A digest of the member's tokenizer files (names and contents)."""
        h = hashlib.sha256()
        for name, data in sorted(self._tokenizer_files().items()):
            h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
        return h.hexdigest()[:16]

    def tokenizer_files(self) -> dict[str, bytes]:
        return self._tokenizer_files()

    def _tokenizer_files(self) -> dict[str, bytes]:
        folder = Path(self.member.source)
        return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.name in TOKENIZER_FILE_NAMES}

    def call(self, op: str, args: tuple, dead: list[int]) -> Any:
        try:
            return getattr(self, "op_" + op)(*args)
        except Exception as exc:
            self.last_error = f"{op}: {type(exc).__name__}: {exc}"
            raise
        finally:  # after the call: a handle the caller made and dropped before this call created it
            for h in dead:
                self.objs.pop(h, None)
                self.scratch.pop(h, None)

    def _row(self, r: int, i: int) -> torch.Tensor:
        try:
            return self.objs[r][i]
        except KeyError:
            raise GenerationError(f"{self.member.name}: row {r} is gone (the last failed call on this actor: "
                                  f"{self.last_error}; or the actor restarted)") from None

    def _state(self, h: int):
        try:
            return self.objs[h]
        except KeyError:
            raise GenerationError(f"{self.member.name}: KV state {h} is gone (the last failed call on this actor: "
                                  f"{self.last_error}; or the actor restarted)") from None

    # KV states: every forward keeps its log-prob rows under the handle the caller chose
    def op_prefill(self, h: int, r: int, ids: list[int]) -> None:
        st = self.objs[h] = self.member.prefill(ids)
        self.objs[r] = st.next_logprobs[None]

    def op_extend(self, h: int, r: int, ids: list[int], last_only: bool) -> None:
        self.objs[r] = self.member.extend(self._state(h), ids, last_only=last_only)

    def op_crop(self, h: int, n: int) -> None:
        self.member.crop(self._state(h), n)

    def op_ensure_next(self, h: int, r: int) -> None:
        self.objs[r] = self.member.ensure_next(self._state(h))[None]

    def op_scratch_enter(self, h: int) -> None:
        st = self._state(h)
        self.member.ensure_next(st)
        self.scratch.setdefault(h, []).append((len(st.ids), st.next_logprobs, st.next_logits))

    def op_scratch_exit(self, h: int) -> None:
        st = self._state(h)
        base, lp, lg = self.scratch[h].pop()
        self.member.crop(st, base)
        st.next_logprobs, st.next_logits = lp, lg

    def op_score_inline(self, h: int, cands: list[list[int]], raw: bool, keep: bool) -> list[np.ndarray]:
        out = self.member.score_inline(self._state(h), cands, raw_logits=raw, keep=keep)
        return [x.float().cpu().numpy() for x in out]

    def op_keep_candidate(self, h: int, index: int, r: int) -> None:
        st = self._state(h)
        self.member.keep_candidate(st, index)
        self.objs[r] = st.next_logprobs[None]

    def op_drop_candidates(self, h: int) -> None:
        self.member.drop_candidates(self._state(h))

    def op_score_prompt(self, ids: list[int], positions: list[int]) -> list[float]:
        return self.member.score_prompt(ids, positions)  # the member keeps the state for the next prefill

    def op_target_logprob(self, prompt_ids: list[int], target_ids: list[int]) -> float:
        return self.member.target_logprob(prompt_ids, target_ids)

    def op_kv_tensor(self, h: int) -> np.ndarray:
        return self.member.kv_tensor(self._state(h)).float().cpu().numpy()

    def op_forward_rows(self, prefix_kv, paths, tokens) -> tuple:
        dev, dt = self.member.device, self.member.dtype
        pre = torch.tensor(prefix_kv).to(dev, dt)
        cache: dict[int, torch.Tensor] = {}

        def t(x):  # the same array object -> the same tensor (tree attention shares path slices)
            if id(x) not in cache:
                cache[id(x)] = torch.tensor(x).to(dev, dt)
            return cache[id(x)]

        logits, kvs = self.member.forward_rows(pre, [[t(x) for x in p] for p in paths], tokens)
        return logits.cpu().numpy(), [k.float().cpu().numpy() for k in kvs]

    # rows: small answers only
    def op_top(self, r: int, i: int, n: int) -> tuple[list[float], list[int]]:
        row = self._row(r, i)
        vals, ids = torch.topk(row, min(n, row.shape[-1]))
        return vals.tolist(), ids.tolist()

    def op_take(self, r: int, i: int, ids: list[int]) -> list[float]:
        return self._row(r, i)[ids].tolist() if ids else []

    def op_query(self, r: int, i: int, ids: list[int]) -> tuple[int, list[float]]:
        row = self._row(r, i)
        return int(torch.argmax(row)), (row[ids].tolist() if ids else [])

    def op_pick(self, r: int, i: int, temperature: float, top_p: float, seed: int | None) -> int:
        from ..methods.sampling import pick_token

        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        return pick_token(self._row(r, i), temperature, top_p, gen)

    def op_mask(self, r: int, i: int, new: int, bits: np.ndarray, n: int, adds: list, k: int) -> tuple:
        row = self._row(r, i)
        allowed = torch.from_numpy(np.unpackbits(bits)[:n].astype(bool)).to(row.device)
        out = row.masked_fill(~allowed, float("-inf"))
        for heir, v in adds:
            out[heir] = torch.logaddexp(out[heir], torch.tensor(v, dtype=out.dtype))
        self.objs[new] = out[None]
        vals, ids = torch.topk(out, min(k, out.shape[-1]))
        return vals.tolist(), ids.tolist()

    def op_merge(self, r: int, i: int, merges: list) -> None:
        out = self._row(r, i)
        for heir, t in merges:
            out[heir] = torch.logaddexp(out[heir], out[t])
            out[t] = float("-inf")

    def op_fetch(self, r: int, i: int) -> np.ndarray:
        return self._row(r, i).float().cpu().numpy()

    # smc: the member's byte LM lives here; beams are handles
    def op_bytelm(self, L: int, beam_width: int, prune: float, temperature: float, keep_fresh: bool) -> None:
        from ..methods.bytelm import ByteLM

        self.objs[L] = ByteLM(self.member, beam_width, prune, temperature, keep_fresh=keep_fresh)

    def op_bytelm_start(self, L: int, b: int, ids: list[int]) -> int:
        beam = self.objs[b] = self._state(L).start(ids)
        return beam.tokens

    def op_bytelm_next(self, L: int, beams: list[int]) -> np.ndarray:
        return self._state(L).next_logprobs([self._state(b) for b in beams])

    def op_bytelm_advance(self, L: int, pairs: list[tuple[int, int, int]]) -> list[int]:
        lm, out = self._state(L), []
        for new, old, byte in pairs:
            beam = self.objs[new] = lm.advance(self._state(old), byte)
            out.append(beam.tokens)
        return out

    def op_bytelm_compact(self, L: int, beams: list[int]) -> int:
        lm = self._state(L)
        lm.compact([self.objs[b] for b in beams if b in self.objs])
        return lm.heals

    def op_counters(self) -> tuple[int, float, int]:
        m = self.member
        return m.n_forward, m.forward_time, m.n_prefill


# ---- handles in the caller ------------------------------------------------------------------
class _Handle:
    """An object on the actor; when the caller drops it, the actor frees it with the next call."""

    __slots__ = ("owner", "id", "__weakref__")

    def __init__(self, owner: "RayMember") -> None:
        self.owner, self.id = owner, next(owner._ids)

    def __del__(self) -> None:
        try:
            self.owner._dead.append(self.id)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class RemoteRows:
    """The log-prob rows [n, V] of one forward, held on the actor."""

    def __init__(self, owner: "RayMember", n: int) -> None:
        self.handle, self.n = _Handle(owner), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> "RemoteRow":
        if not -self.n <= i < self.n:
            raise IndexError(f"row {i} of {self.n}")
        return RemoteRow(self, i % self.n)


class RemoteRow:
    """One row of log-probs [V] on the actor. `members.rows` asks it for small answers."""

    __slots__ = ("rows", "i")

    def __init__(self, rows: RemoteRows, i: int) -> None:
        self.rows, self.i = rows, i

    @property
    def owner(self) -> "RayMember":
        return self.rows.handle.owner

    def __len__(self) -> int:
        return self.owner.vocab_size

    @property
    def shape(self) -> tuple[int]:
        return (self.owner.vocab_size,)

    def _ask(self, op: str, *args) -> "Pending":
        return self.owner._ask(op, self.rows.handle.id, self.i, *args)

    def top(self, n: int) -> "Pending":
        return self._ask("top", n)

    def take(self, ids: Sequence[int]) -> "Pending":
        return self._ask("take", [int(i) for i in ids])

    def query(self, ids: Sequence[int]) -> "Pending":
        return self._ask("query", [int(i) for i in ids])

    def pick(self, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
        seed = None
        if temperature > 0:  # the caller's generator draws the actor's seed: reproducible for a given seed
            seed = int(torch.randint(0, 2**62, (), generator=generator)) if generator is not None else \
                int(torch.randint(0, 2**62, ()))
        return self._ask("pick", float(temperature), float(top_p), seed).get()

    def masked(self, allowed: np.ndarray, adds: list[tuple[int, float]], k: int) -> tuple["RemoteRow", Pending]:
        """A grammar's mask (`Guide.mask_row`) applied on the actor: a new row there with the forbidden
        tokens at -inf and `adds` logaddexp'd in, and the top k of it. 1 bit per token goes up."""
        rows = RemoteRows(self.owner, 1)
        best = self._ask("mask", rows.handle.id, np.packbits(allowed), len(allowed),
                         [(int(h), float(v)) for h, v in adds], int(k))
        return rows[0], best

    def merge(self, merges: list[tuple[int, int]]) -> None:
        """out[heir] = logaddexp(out[heir], out[t]); out[t] = -inf for each pair, in order (no wait)."""
        if merges:
            self.owner._submit("merge", self.rows.handle.id, self.i, [(int(h), int(t)) for h, t in merges])

    def fetch(self) -> torch.Tensor:
        """The whole row (vocabulary-sized: only where a step needs every token, e.g. a grammar mask)."""
        return torch.tensor(self._ask("fetch").get())


class RemoteState:
    """A KV state on the actor; the caller mirrors its token ids and its latest row."""

    def __init__(self, owner: "RayMember") -> None:
        self.handle = _Handle(owner)
        self.ids: list[int] = []
        self.next_row: RemoteRow | None = None
        self.scored: list[list[int]] | None = None
        self.saved: list[tuple[int, RemoteRow | None]] = []

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def next_logprobs(self) -> RemoteRow | None:
        return self.next_row


class Pending:
    """A result the actor will send; `get()` waits for it (checking the request's deadline)."""

    __slots__ = ("owner", "ref")

    def __init__(self, owner: "RayMember", ref) -> None:
        self.owner, self.ref = owner, ref

    def get(self) -> Any:
        return self.owner._get(self.ref)


class _Rows:
    """A pending [distinct beams, 257] answer, expanded to one row per asked beam on `get()`."""

    __slots__ = ("pending", "index")

    def __init__(self, pending: Pending, index: list[int]) -> None:
        self.pending, self.index = pending, index

    def get(self) -> np.ndarray:
        return self.pending.get()[self.index]


class RemoteBeam:
    """A byte-LM beam on the actor (smc); `tokens` as in `Beam.tokens`."""

    __slots__ = ("handle", "lm", "_tokens", "__weakref__")

    def __init__(self, lm: "RemoteByteLM", tokens: int | None = None) -> None:
        self.handle, self.lm, self._tokens = _Handle(lm.member), lm, tokens

    @property
    def tokens(self) -> int:
        if self._tokens is None:
            self.lm._resolve()
        return self._tokens


class RemoteByteLM:
    """`ByteLM` with the member's byte LM on its actor: 257 log-probs per beam cross the wire."""

    def __init__(self, member: "RayMember", beam_width: int, prune_threshold: float, temperature: float,
                 keep_fresh: bool = False) -> None:
        self.member = member
        self.handle = _Handle(member)
        member._submit("bytelm", self.handle.id, int(beam_width), float(prune_threshold), float(temperature),
                       bool(keep_fresh))
        self._pending: list[tuple[list[RemoteBeam], Pending]] = []
        self._advances: list[tuple[RemoteBeam, RemoteBeam, int]] = []
        self.heals = 0

    def _flush(self) -> None:
        """Send the advances made since the last call as one call (their token counts come back)."""
        if self._advances:
            todo, self._advances = self._advances, []
            pairs = [(new.handle.id, old.handle.id, b) for new, old, b in todo]
            self._pending.append(([new for new, _, _ in todo],
                                  self.member._ask("bytelm_advance", self.handle.id, pairs)))

    def start(self, prompt_ids: Sequence[int]) -> RemoteBeam:
        self._flush()
        beam = RemoteBeam(self)
        beam._tokens = self.member._ask("bytelm_start", self.handle.id, beam.handle.id, list(prompt_ids)).get()
        return beam

    def _resolve(self) -> None:
        self._flush()
        pending, self._pending = self._pending, []
        for beams, p in pending:
            for b, t in zip(beams, p.get()):
                b._tokens = t

    def next_logprobs_async(self, beams: Sequence[RemoteBeam]) -> "_Rows":
        # particles share beams after resampling: each distinct beam's 257 log-probs cross once
        self._flush()
        uniq: dict[int, int] = {}
        index = [uniq.setdefault(b.handle.id, len(uniq)) for b in beams]
        return _Rows(self.member._ask("bytelm_next", self.handle.id, list(uniq)), index)

    def next_logprobs(self, beams: Sequence[RemoteBeam]) -> np.ndarray:
        return self.next_logprobs_async(beams).get()

    def advance(self, beam: RemoteBeam, b: int) -> RemoteBeam:
        new = RemoteBeam(self)
        # sent with the next call of this byte LM, all advances of a step in one; the new beam's
        # token count is read only when asked
        self._advances.append((new, beam, int(b)))
        return new

    def compact(self, beams: Sequence[RemoteBeam]) -> None:
        self._resolve()
        self.heals = self.member._ask("bytelm_compact", self.handle.id, [b.handle.id for b in beams]).get()


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
        self.actor_device = info["device"]
        self.device = torch.device("cpu")  # where the caller's own (small) tensors live
        self._ids = itertools.count(1)
        self._dead: collections.deque[int] = collections.deque()
        self.bytes_moved = 0
        self.round_trips = 0  # waits for an answer (calls that need none are queued without waiting)
        self._known = (0, 0.0, 0)  # the actor's counters when last read

    def __repr__(self) -> str:
        return f"RayMember({self.name!r}, actor device={self.actor_device}, dtype={self.dtype})"

    # ---- calls ---------------------------------------------------------------------------
    def _submit(self, op: str, *args, count: bool = True):
        dead = []
        while True:
            try:
                dead.append(self._dead.popleft())
            except IndexError:
                break
        if count:
            self.bytes_moved += payload_bytes(args) + 8 * len(dead)
        return self.actor.call.remote(op, args, dead)

    def _ask(self, op: str, *args) -> Pending:
        return Pending(self, self._submit(op, *args))

    def _forward(self, op: str, *args):
        """A call that runs a forward pass: the request's guard (deadline, cancellation) first."""
        check = current_guard()
        if check is not None:
            check()
        return self._submit(op, *args)

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
            self.bytes_moved += payload_bytes(out)
            self.round_trips += 1
        return out

    def _get(self, ref) -> Any:
        ray = _ray()
        try:
            return self._get_raw(ref, current_guard())
        except ray.exceptions.RayActorError as exc:
            raise GenerationError(
                f"member {self.name!r} (Ray actor) died during the request: {type(exc).__name__}; Ray restarts it "
                f"(max_restarts={MAX_RESTARTS}) and the next request runs on the new actor") from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            raise GenerationError(f"member {self.name!r} (Ray actor) failed: {cause}") from exc

    def counters(self) -> tuple[int, float, int, int, int]:
        """(forwards, forward seconds, prefills, bytes moved, round trips) so far, read from the actor
        once every call queued before has run; this read itself is not counted. The engine reads
        them first thing in every request, so this is also where a request waits for an actor Ray
        is restarting (within its deadline)."""
        self._known = self._ready("counters")
        n, t, p = self._known
        return n, t, p, self.bytes_moved, self.round_trips

    def _ready(self, op: str, *args) -> Any:
        """`op`'s answer once the actor is up: while Ray restarts it (after a crash) calls are
        refused with ActorUnavailableError; wait for it, checking the request's deadline."""
        ray = _ray()
        check = current_guard()
        while True:
            try:
                return self._get_raw(self._submit(op, *args, count=False), check, count=False)
            except ray.exceptions.ActorUnavailableError:
                if check is not None:
                    check()
                time.sleep(WAIT_SLICE_S * 4)
            except ray.exceptions.RayActorError as exc:
                raise GenerationError(f"member {self.name!r} (Ray actor) is dead and Ray will not restart it "
                                      f"({type(exc).__name__}: {exc}); make a new engine to place it again") from exc
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
        state, rows = RemoteState(self), RemoteRows(self, 1)
        self._forward("prefill", state.handle.id, rows.handle.id, ids)
        state.ids, state.next_row = ids, rows[0]
        return state

    def extend(self, state: RemoteState, ids: Sequence[int], last_only: bool = False) -> RemoteRows:
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("extend() needs at least one token id")
        state.scored = None
        rows = RemoteRows(self, 1 if last_only else len(ids))
        self._forward("extend", state.handle.id, rows.handle.id, ids, bool(last_only))
        state.ids.extend(ids)
        state.next_row = rows[-1]
        return rows

    def crop(self, state: RemoteState, n: int) -> None:
        if not 0 <= n <= len(state.ids):
            raise ValueError(f"crop({n}) out of range for a state of {len(state.ids)} tokens")
        if state.scored is None and n == len(state.ids):
            return
        state.scored = None
        self._submit("crop", state.handle.id, int(n))
        if n < len(state.ids):
            del state.ids[n:]
            state.next_row = None

    def ensure_next(self, state: RemoteState) -> RemoteRow:
        if state.next_row is None:
            rows = RemoteRows(self, 1)
            self._forward("ensure_next", state.handle.id, rows.handle.id)
            state.next_row = rows[0]
        return state.next_row

    @contextlib.contextmanager
    def scratch(self, state: RemoteState):
        base = len(state.ids)
        self.ensure_next(state)
        saved = state.next_row
        self._submit("scratch_enter", state.handle.id)
        try:
            yield state
        finally:
            self._submit("scratch_exit", state.handle.id)
            del state.ids[base:]
            state.next_row, state.scored = saved, None

    def score_inline(self, state: RemoteState, candidates: Sequence[Sequence[int]], raw_logits: bool = False,
                     keep: bool = False) -> list[torch.Tensor]:
        cands = [[int(t) for t in c] for c in candidates]
        if not cands or any(len(c) == 0 for c in cands):
            raise ValueError("score_inline needs non-empty candidates")
        self.ensure_next(state)
        out = Pending(self, self._forward("score_inline", state.handle.id, cands, bool(raw_logits), bool(keep))).get()
        state.scored = cands if keep else None
        return [torch.tensor(x) for x in out]

    def keep_candidate(self, state: RemoteState, index: int) -> None:
        if state.scored is None:
            raise ValueError("keep_candidate needs a score_inline(keep=True) first")
        rows = RemoteRows(self, 1)
        self._submit("keep_candidate", state.handle.id, int(index), rows.handle.id)
        state.ids.extend(state.scored[index])
        state.next_row, state.scored = rows[0], None

    def drop_candidates(self, state: RemoteState) -> None:
        if state.scored is not None:
            self._submit("drop_candidates", state.handle.id)
            state.scored = None

    def score_prompt(self, ids: Sequence[int], positions: Sequence[int]) -> list[float]:
        """`Member.score_prompt` on the actor: the prompt's state stays there for the next prefill."""
        return Pending(self, self._forward("score_prompt", [int(i) for i in ids],
                                           [int(p) for p in positions])).get()

    def target_logprob(self, prompt_ids: Sequence[int], target_ids: Sequence[int]) -> float:
        return Pending(self, self._forward("target_logprob", [int(i) for i in prompt_ids],
                                           [int(i) for i in target_ids])).get()

    def kv_tensor(self, state: RemoteState) -> torch.Tensor:
        """The state's whole KV cache, fetched (smc runs its byte LM on the actor instead)."""
        return torch.tensor(self._ask("kv_tensor", state.handle.id).get())

    def forward_rows(self, prefix_kv, paths, tokens):
        """`Member.forward_rows` with the KV slices shipped both ways (smc uses `byte_lm` instead)."""
        arrays: dict[int, np.ndarray] = {}

        def a(x):
            if id(x) not in arrays:
                arrays[id(x)] = x.float().cpu().numpy()
            return arrays[id(x)]

        logits, kvs = Pending(self, self._forward("forward_rows", a(prefix_kv), [[a(x) for x in p] for p in paths],
                                                  [int(t) for t in tokens])).get()
        return torch.tensor(logits), [torch.tensor(k) for k in kvs]

    def byte_lm(self, beam_width: int, prune_threshold: float, temperature: float,
                keep_fresh: bool = False) -> RemoteByteLM:
        return RemoteByteLM(self, beam_width, prune_threshold, temperature, keep_fresh)


# ---- placing members on a cluster -------------------------------------------------------------
_ACTORS: dict[tuple, RayMember] = {}
_ACTORS_LOCK = threading.Lock()


def connect(address: str | None):
    """Join the cluster at `address` ("auto", "ray://host:10001", "host:6379"), or the one this
    process already joined, or (None, nothing joined) start a local one."""
    ray = _ray()
    if ray.is_initialized():
        return ray
    try:
        ray.init(address=address, ignore_reinit_error=True, include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"cannot reach the Ray cluster at {address!r} ({exc}); start one with `ray start --head` "
                          "and pass its address (ray_address='auto' on a node of it, or 'ray://HEAD:10001'), or "
                          "leave ray_address=None for a local cluster.") from exc
    return ray


def check_member_resources(value, n: int) -> list[dict] | None:
    """member_resources: None (defaults), one dict for every member, or a list of one dict (or None) each."""
    if value is None:
        return None
    items = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(items) != n:
        raise ConfigError(f"member_resources lists {len(items)} entries for {n} members; give one per member "
                          "(or one dict for all).")
    out = []
    for i, item in enumerate(items):
        if item is None:
            out.append({})
            continue
        if not isinstance(item, dict):
            raise ConfigError(f"member_resources[{i}] must be a dict like {{'num_gpus': 1}}, got {item!r}")
        bad = sorted(set(item) - set(RESOURCE_KEYS))
        if bad:
            raise ConfigError(f"member_resources[{i}] has unknown keys {bad}; use {', '.join(RESOURCE_KEYS)}.")
        for k in ("num_cpus", "num_gpus", "memory"):
            v = item.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf):
                raise ConfigError(f"member_resources[{i}]['{k}'] must be a number >= 0, got {v!r}")
        res = item.get("resources")
        if res is not None and (not isinstance(res, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                for k, v in res.items())):
            raise ConfigError(f"member_resources[{i}]['resources'] must map custom resource names to amounts, "
                              f"got {res!r}")
        t = item.get("torch_threads")
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ConfigError(f"member_resources[{i}]['torch_threads'] must be an integer >= 1, got {t!r}")
        out.append(dict(item))
    return out


def _bundle(res: dict, has_gpu: bool) -> dict:
    """A member's Ray bundle: its member_resources, else one GPU where the cluster has GPUs, else one CPU."""
    if "num_gpus" not in res and "num_cpus" not in res:
        res = {**res, **({"num_gpus": 1, "num_cpus": 1} if has_gpu else {"num_cpus": 1})}
    b = {"CPU": float(res.get("num_cpus", 0) or 0), "GPU": float(res.get("num_gpus", 0) or 0)}
    if res.get("memory"):
        b["memory"] = float(res["memory"])
    b.update({k: float(v) for k, v in (res.get("resources") or {}).items()})
    b = {k: v for k, v in b.items() if v > 0}
    return b or {"CPU": 0.01}  # a Ray bundle must ask for something


def place_members(specs: Sequence[str], names: Sequence[str], *, ray_address: str | None,
                  member_resources: list[dict] | None, dtype: Any, cache_dir, trust_remote_code: bool) -> list[RayMember]:
    """One actor per member (reused by later engines in this process for the same model and
    resources). Resources the cluster cannot give fail here, before any model loads. Each actor
    fetches (and converts) its model where it runs; the caller gets the tokenizer files from it."""
    ray = connect(ray_address)
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    total = ray.cluster_resources()
    has_gpu = total.get("GPU", 0) > 0
    res = member_resources or [{} for _ in specs]
    bundles = [_bundle(r, has_gpu) for r in res]
    keys = [(s, repr(sorted(r.items())), str(dtype), str(cache_dir), trust_remote_code) for s, r in zip(specs, res)]
    with _ACTORS_LOCK:
        todo = [i for i, k in enumerate(keys) if k not in _ACTORS or not _alive(_ACTORS[k])]
        if todo:
            need: dict[str, float] = {}
            for i in todo:
                for k, v in bundles[i].items():
                    need[k] = need.get(k, 0.0) + v
            short = {k: (v, total.get(k, 0.0)) for k, v in need.items() if v > total.get(k, 0.0) + 1e-9}
            if short:
                raise ConfigError(
                    "the Ray cluster cannot place these members: " + "; ".join(
                        f"{k} needs {v:g}, the cluster has {have:g}" for k, (v, have) in sorted(short.items()))
                    + f" (bundles {[bundles[i] for i in todo]}). Add nodes with those resources or lower "
                    "member_resources (e.g. {'num_cpus': 1, 'num_gpus': 0} on a CPU-only cluster).")
            pg = placement_group([bundles[i] for i in todo], strategy="PACK")
            ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                remove_placement_group(pg)
                raise ConfigError(
                    f"the Ray cluster did not find room for the members within {PLACEMENT_TIMEOUT_S:g} s "
                    f"(bundles {[bundles[i] for i in todo]}, available {ray.available_resources()}); other "
                    "jobs hold the resources, or lower member_resources.")
            cls = ray.remote(MemberActor)
            made = []
            for j, i in enumerate(todo):
                b = bundles[i]
                threads = res[i].get("torch_threads") or max(1, int(b.get("CPU", 1)))
                actor = cls.options(
                    num_cpus=b.get("CPU", 0), num_gpus=b.get("GPU", 0), memory=b.get("memory"),
                    resources={k: v for k, v in b.items() if k not in ("CPU", "GPU", "memory")} or None,
                    max_restarts=MAX_RESTARTS, max_task_retries=0, name=None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=j),
                ).remote(specs[i], str(dtype), None if cache_dir is None else str(cache_dir),
                         trust_remote_code, threads)
                made.append((i, actor, actor.info.remote()))
            placed = []
            try:
                for i, actor, info_ref in made:
                    try:
                        info = ray.get(info_ref)
                    except ray.exceptions.RayActorError as exc:
                        raise ConfigError(f"member {names[i]!r} could not load in its Ray actor: {exc}") from exc
                    member = RayMember(actor, info, actor_tokenizer(actor, cache_dir), spec=specs[i],
                                       resources=bundles[i])
                    member.placement_group = pg
                    placed.append((keys[i], member))
                    log.info("placed %s on a Ray actor (%s, %s)", names[i], info["device"], bundles[i])
            except BaseException:  # no half-placed ensemble: free the actors and their reservation
                for _, actor, _ in made:
                    with contextlib.suppress(Exception):
                        ray.kill(actor, no_restart=True)
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
                raise
            _ACTORS.update(placed)
        return [_ACTORS[k] for k in keys]


def actor_tokenizer(actor, cache_dir=None):
    """The member's tokenizer, from the files its actor loaded (so the caller needs no model files:
    on a cluster the weights live only where the actors run). Kept in the cache folder by digest."""
    from .convert import load_cached_tokenizer
    from .fetch import cache_root

    ray = _ray()
    folder = cache_root(cache_dir) / "ray-tokenizers" / ray.get(actor.tokenizer_digest.remote())
    if not (folder / ".complete").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in ray.get(actor.tokenizer_files.remote()).items():
            tmp = folder / (name + ".partial")
            tmp.write_bytes(data)
            tmp.replace(folder / name)
        (folder / ".complete").write_text("")
    return load_cached_tokenizer(folder)


def _alive(member: RayMember) -> bool:
    ray = _ray()
    try:
        ray.get(member.actor.info.remote(), timeout=30)
        return True
    except Exception:  # noqa: BLE001 - dead for good (restarts used up) or unreachable: place it again
        return False


def clear_actors() -> None:
    """Kill every member actor this process placed (the next ray engine places them again)."""
    ray = _ray()
    from ray.util.placement_group import remove_placement_group

    with _ACTORS_LOCK:
        groups = {}
        for m in _ACTORS.values():
            with contextlib.suppress(Exception):
                ray.kill(m.actor, no_restart=True)
            if m.placement_group is not None:
                groups[m.placement_group.id] = m.placement_group
        for pg in groups.values():
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        _ACTORS.clear()
