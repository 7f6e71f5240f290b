"""The member side of placement="ray": `MemberActor`, one per member in a Ray worker, holds the
model, its KV states, the rows of log-probs each forward produced and, for smc, the member's
`ByteLM`; the caller reaches them by handle (handles.py)."""

from __future__ import annotations

import collections
import hashlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, GenerationError
from ..members.bytelm import next_logprobs_many
from ..members.plan import free_bytes
from ..members.rows import mask_heal, merge_into, pick_token

log = logging.getLogger("ensemble_llm.ray")

MAX_RESTARTS = 4  # a dead member's actor is restarted this many times (then its requests fail)
PLACEMENT_TIMEOUT_S = 60.0  # how long load() waits for the cluster to find room for the members
WAIT_SLICE_S = 0.05  # the caller checks the request's deadline this often while it waits
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
RESOURCE_KEYS = ("num_cpus", "num_gpus", "memory", "resources", "torch_threads")
READY_KEPT = 32  # prompt states score_prompt keeps for the prefill that follows (one per request at once)


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
class _TagCount:
    """A request's count on the actor (`MemberActor.call`'s tags) in the form of a `Tally`."""

    __slots__ = ("objs", "tag")

    def __init__(self, objs: dict, tag: int) -> None:
        self.objs, self.tag = objs, tag

    def add(self, member: Any, n: int = 1, seconds: float = 0.0, prefills: int = 0) -> None:
        c = self.objs.setdefault(self.tag, [0, 0.0, 0])
        c[0], c[1], c[2] = c[0] + n, c[1] + seconds, c[2] + prefills


class MemberActor:
    """One member in a Ray worker: the model, its KV states and rows, by handle."""

    def __init__(
        self,
        spec: str,
        dtype: str,
        cache_dir: str | None,
        trust_remote_code: bool,
        threads: int | None,
        options: Any = None,
    ) -> None:
        from ..members.loader import load_member

        if threads:
            torch.set_num_threads(threads)
        device = "cuda" if torch.cuda.is_available() else "cpu"  # Ray shows an actor only its own GPUs
        # options: the member's MemberOptions (revision, device_map / max_memory over the actor's
        # own devices, quantization), applied here as a local engine applies them
        self.member = load_member(
            spec,
            device=device,
            dtype=dtype,
            cache_dir=cache_dir,
            trust_remote_code=trust_remote_code,
            progress=False,
            options=options,
        )
        self.objs: dict[int, Any] = {}
        self.scratch: dict[int, list] = {}
        self.ready: collections.OrderedDict[tuple, Any] = collections.OrderedDict()  # score_prompt's states
        self.last_error = "none"

    def info(self) -> dict:
        m = self.member
        return {
            "name": m.name,
            "backend": m.backend,
            "numerics": m.numerics,
            "vocab_size": m.vocab_size,
            "context_window": m.context_window,
            "eos_ids": sorted(m.eos_ids),
            "n_params": m.n_params,
            "dtype": str(m.dtype),
            "device": str(m.device),
            "source": m.source,
            "threads": torch.get_num_threads(),
            "kv_per_token": m.kv_per_token,
            "free_bytes": free_bytes(str(m.device)) or 0,  # where its KV lives, its weights loaded
            "placed": sorted({str(v) for v in (getattr(m, "device_map", None) or {}).values()}),  # a split member
            "quantized": m.quantized,
        }

    def tokenizer_digest(self) -> str:
        """A digest of the member's tokenizer files (names and contents)."""
        h = hashlib.sha256()
        for name, data in sorted(self._tokenizer_files().items()):
            h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
        return h.hexdigest()[:16]

    def tokenizer_files(self) -> dict[str, bytes]:
        return self._tokenizer_files()

    def _tokenizer_files(self) -> dict[str, bytes]:
        folder = Path(self.member.tokenizer_folder or self.member.source)  # llama.cpp: not its GGUF
        return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.name in TOKENIZER_FILE_NAMES}

    def call(self, op: str, args: tuple, dead: list[int], tags: tuple = ()) -> Any:
        """Run `op`; the forwards it runs count for each request in `tags` (handles of their
        counts: a batched step counts once for each request in it, as in the caller's `Tally`)."""
        m = self.member
        n0, t0, p0 = m.n_forward, m.forward_time, m.n_prefill
        try:
            return getattr(self, "op_" + op)(*args)
        except Exception as exc:
            self.last_error = f"{op}: {type(exc).__name__}: {exc}"
            raise
        finally:  # after the call: a handle the caller made and dropped before this call created it
            for h in tags:
                c = self.objs.setdefault(h, [0, 0.0, 0])
                c[0] += m.n_forward - n0
                c[1] += m.forward_time - t0
                c[2] += (m.n_prefill - p0) if op != "prefills" else 0  # a batch's prefills: op_prefills
            for h in dead:
                self.objs.pop(h, None)
                self.scratch.pop(h, None)

    def _row(self, r: int, i: int) -> torch.Tensor:
        try:
            return self.objs[r][i]
        except KeyError:
            raise GenerationError(
                f"{self.member.name}: row {r} is gone (the last failed call on this actor: "
                f"{self.last_error}; or the actor restarted)"
            ) from None

    def _state(self, h: int):
        try:
            return self.objs[h]
        except KeyError:
            raise GenerationError(
                f"{self.member.name}: KV state {h} is gone (the last failed call on this actor: "
                f"{self.last_error}; or the actor restarted)"
            ) from None

    # KV states: every forward keeps its log-prob rows under the handle the caller chose
    def _prefilled(self, ids: list[int]):
        """The state score_prompt left for these ids (its prompt runs once), or None."""
        return self.ready.pop(tuple(ids), None)

    def op_prefill(self, h: int, r: int, ids: list[int]) -> None:
        st = self._prefilled(ids)
        st = self.objs[h] = self.member.prefill(ids) if st is None else st
        self.objs[r] = st.next_logprobs[None]

    def op_prefills(self, items: list[tuple]) -> list:
        """Several requests' prompts in one forward (rowgroups.run_prefills): (state handle, rows
        handle, ids, the request's count handle, None) each, or for a prompt scored for its
        request's weights (score_prompt) (None, None, ids, count handle, positions): its scores
        come back and its state waits in `ready` for the prefill that follows. Each request's
        forwards and prefills count for it alone (a prompt scored before needs no forward)."""
        from ..members.scheduler import DEFAULT_CONFIG
        from ..members.steps import Prefill

        m, calls, scored, out, ready = self.member, [], {}, [None] * len(items), []
        for i, (h, _, ids, tag, positions) in enumerate(items):
            st = None if positions is not None else self._prefilled(ids)
            if st is None:
                st = m.new_state()
                m.count_prefill()
                count = None if tag is None else _TagCount(self.objs, tag)
                if count is not None:
                    count.add(m, 0, 0.0, 1)
                call = Prefill(m, st, count, ids=ids, positions=positions)
                if not m.executor.batchable(call):  # e.g. a scored prompt whose head does not split
                    out[i] = m.executor.run_alone(call, DEFAULT_CONFIG)
                else:
                    calls.append(call)
                    scored[id(call)] = i if positions is not None else None
            if positions is not None:
                ready.append((tuple(ids), st))
            else:
                self.objs[h] = st
        if calls:
            m.executor.run(calls, DEFAULT_CONFIG)
        for key, st in ready:  # once computed: for the prefill that follows
            self.ready[key] = st
            while len(self.ready) > READY_KEPT:
                self.ready.popitem(last=False)
        for c in calls:
            if scored[id(c)] is not None:
                out[scored[id(c)]] = c.result
        for h, r, _, _, positions in items:
            if positions is None:
                self.objs[r] = self.objs[h].next_logprobs[None]
        return out

    def op_step(self, items: list[tuple]) -> list:
        """One batched step of several requests' extends and in-line scorings (rowgroups.run_step):
        ("extend", state, rows, ids, last_only, tag) or ("score", state, candidates, raw_logits,
        keep, tag) each, a request's forwards counted under its tag (a step's calls may run in two
        forwards: each counts the one it took part in); the scorings' answers come back (None for
        an extend)."""
        from ..members.scheduler import DEFAULT_CONFIG
        from ..members.steps import Extend, Score

        m, calls = self.member, []
        for kind, h, x, y, z, tag in items:
            st = self._state(h)
            m.drop_candidates(st)
            count = None if tag is None else _TagCount(self.objs, tag)
            if kind == "extend":
                calls.append(Extend(m, st, count, tokens=[int(t) for t in y], last_only=z))
            else:
                m.ensure_next(st)
                calls.append(Score(m, st, count, cands=x))
        m.executor.run(calls, DEFAULT_CONFIG)
        out: list = []
        for (kind, _, x, y, z, _tag), c in zip(items, calls):
            if kind == "extend":
                self.objs[x] = c.result
                out.append(None)
            else:
                out.append([v.float().cpu().numpy() for v in m.scored(c.state, x, c.result, y, z)])
        return out

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
        out = self.member.score_prompt(ids, positions)
        # for the prefill that follows (requests interleave here)
        self.ready[tuple(ids)] = self.member.ready_slot(take=True)
        while len(self.ready) > READY_KEPT:
            self.ready.popitem(last=False)
        return out

    def op_forget_prompt(self, ids: list[int]) -> None:
        self.ready.pop(tuple(ids), None)

    def op_greedy_after(self, ids: list[int], continuation: list[int]) -> bool:
        """`Member.greedy_after` on the state score_prompt left here, which stays for the prefill."""
        from ..members.protocol import greedy_continues

        st = self._prefilled(ids)
        st = self.member.prefill(ids) if st is None else st
        try:
            return greedy_continues(self.member, st, continuation)
        finally:
            self.ready[tuple(ids)] = st

    def op_target_logprob(self, prompt_ids: list[int], target_ids: list[int]) -> float:
        return self.member.target_logprob(prompt_ids, target_ids)

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

        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        return pick_token(self._row(r, i), temperature, top_p, gen)

    def op_mask(self, r: int, i: int, new: int, bits: np.ndarray, n: int, adds: list, k: int) -> tuple:
        row = self._row(r, i)
        out = mask_heal(row, torch.from_numpy(np.unpackbits(bits)[:n].astype(bool)), adds)
        self.objs[new] = out[None]
        vals, ids = torch.topk(out, min(k, out.shape[-1]))
        return vals.tolist(), ids.tolist()

    def op_merge(self, r: int, i: int, merges: list) -> None:
        merge_into(self._row(r, i), merges)

    def op_fetch(self, r: int, i: int) -> np.ndarray:
        return self._row(r, i).float().cpu().numpy()

    # smc: the member's byte LM lives here; beams are handles
    def op_bytelm(self, L: int, beam_width: int, prune: float, temperature: float, keep_fresh: bool) -> None:

        self.objs[L] = self.member.byte_lm(beam_width, prune, temperature, keep_fresh=keep_fresh)

    def op_bytelm_start(self, L: int, b: int, ids: list[int]) -> int:
        beam = self.objs[b] = self._state(L).start(ids)
        return beam.tokens

    def op_bytelm_next(self, L: int, beams: list[int]) -> np.ndarray:
        return self._state(L).next_logprobs([self._state(b) for b in beams])

    def op_bytelm_next_many(self, items: list[tuple[int, list[int], int | None]]) -> list[np.ndarray]:
        """One step of several requests' byte LMs (the caller's step scheduler): (byte LM, beams,
        the request's count handle) each; their new contexts in one forward, which counts for
        the requests that needed one (a byte LM whose contexts are all known runs none)."""
        asks = [(self._state(L), [self._state(b) for b in beams]) for L, beams, _ in items]
        return next_logprobs_many(asks, [None if tag is None else _TagCount(self.objs, tag) for _, _, tag in items])

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

    def op_counters(self, tag: int | None = None) -> tuple[int, float, int]:
        """The forwards, seconds and prefills of one request (`tag`, see `call`), or all so far."""
        if tag is not None:
            n, t, p = self.objs.get(tag, (0, 0.0, 0))
            return n, t, p
        m = self.member
        return m.n_forward, m.forward_time, m.n_prefill
