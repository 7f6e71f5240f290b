"""Continuous batching across concurrent requests: one batched forward per member per step.

Every request runs its method in a thread of its own (the worker runs up to `max_batch` at once)
and the methods stay as they are: sequential code asking a member to `extend` a state. An
`extend` from a request thread, of one token or several (safe's verifications, forced tokens), is
not run at once: it waits in `SCHEDULER` for the step, and so does a prompt's prefill. A step runs
when every running request is waiting in one (iteration-level scheduling, as in Orca: a request
inside a forward of its own, such as the prompt scoring of per-request weights, is not waited
for, and one still doing Python work is waited for up to `GATHER_S`). A step runs every waiting
prompt (one left-padded forward per member, `run_prefills`; prompts that begin like a stored one
start from its KV and run only their rests, prefix.py) and, of the extends and smc's trees,
ONE forward: the largest member's group, the others waiting for later steps (at most `MAX_DEFER`)
so that the requests fall into phase (`StepScheduler._take`).

The states of one member that step together live as rows of one batched cache (`RowGroup`), so
a steady decode step copies nothing: each row's own tokens sit in its columns, right-aligned; a
step adds as many columns as its longest extend, and the new columns a row does not fill are
masked holes. A batched prefill's cache is already such a group. A crop inside a group masks
columns instead of copying; any other operation takes the row out of the group first (`release`:
its columns copied into a cache of its own). A finished request's row leaves the group's tensors
before the next step (`compact`). Each row sees only its own columns at its own
position ids, through a 4-D mask (sliding-window layers get a mask of their own), so a batched
step computes what the row's own forward would, up to float rounding. A step pays for holes only
up to a bound (`SPLIT_COLUMNS`): one-token calls beside longer ones (specfuse's scoring, safe's
verifications) run in a forward apart, and a forward whose calls leave many of the group's rows
idle runs over their rows only (gathered, their new columns written back; the others get holes).
The output layer runs only on the columns a call reads (`SPARSE_HEAD`).

specfuse's in-line scoring joins the steps too: its candidates are new columns of the row like an
extend's, each candidate a run that sees the row and itself only (`_Call.segments`); keeping one
candidate afterwards makes the others' columns holes (`RowGroup.keep`).

Members in Ray actors join the same steps: the scheduler runs in the caller, where the requests
are, and a step of a Ray member is one call to its actor (`RayMember.run_batch`), which runs these
same functions there on its own states; the answers stay on the actor as handles, so the step does
not wait for them (ray/member.py).

The prompt scoring of per-request weights (`score_prompt`: log-probs at the shown answers'
positions, from the prompt's own prefill) joins the prompt batches too: that forward returns the
final hidden states, and each scoring row gets the output layer at its own positions
(`Member.head`, checked once per member against the model's own logits). Through Ray, a scored
prompt is an item of the actor's prompt batch (`op_prefills`), and smc's byte LMs of several
requests are one actor call a step whose new contexts run in one tree forward there
(`bytelm.next_logprobs_many`); each request's forwards are counted on the actor for it alone.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

GATHER_S = 0.02  # how long waiting requests wait for one that is still computing before stepping without it
# steps a call may be passed over for a larger group of another member (StepScheduler._take): on
# the bundled pair, 8 clients x 16 requests, specfuse took 34.6 s at 3, 30.1 s at 10 and 28.8 s at
# 20 (its requests spend a whole segment on one member); unite and safe moved within noise
MAX_DEFER = 10
# a step's output layer only at the columns its calls read (RowGroup.step); False: at the step's
# longest read in every row, as `logits_to_keep` gives it (benchmarks/batching_throughput.py --whole-steps)
SPARSE_HEAD = True
# hole columns a step may compute before it is split: one-token calls beside longer ones run in a
# forward of their own, and a forward covers only its calls' rows when the group's other rows would
# pay this many (RowGroup.step)
SPLIT_COLUMNS = 16
SLACK = 64  # a group is rebuilt once its width passes twice its longest row plus this many columns


@dataclass
class Tally:
    """One request's forward passes, seconds in them and prefills, per member (its stats)."""

    counts: dict[int, list] = field(default_factory=dict)
    remote: dict[int, Any] = field(default_factory=dict)  # per member in a Ray actor: its own count (ray/member.py)
    reused: dict[int, int] = field(default_factory=dict)  # per member: prompt tokens taken from a stored prompt

    def add(self, member: Any, n: int = 1, seconds: float = 0.0, prefills: int = 0) -> None:
        c = self.counts.setdefault(id(member), [0, 0.0, 0])
        c[0] += n
        c[1] += seconds
        c[2] += prefills

    def of(self, member: Any) -> tuple[int, float, int]:
        n, t, p = self.counts.get(id(member), (0, 0.0, 0))
        return n, t, p


@dataclass(eq=False)
class _Call:
    member: Any
    state: Any
    token: int | list[int]  # the token(s) to append to the state (an extend)
    tally: Tally | None
    done: bool = False
    result: torch.Tensor | None = None
    error: BaseException | None = None
    since: float = field(default_factory=time.monotonic)
    tree: tuple | None = None  # a forward_rows call (smc): (prefix_kv, paths, tokens); then no state/token
    ids: list[int] | None = None  # a prompt's prefill into an empty state (then no token)
    last_only: bool = False  # an extend's log-probs of its last token only
    cands: list[list[int]] | None = None  # a score_inline call: candidates side by side (then no token)
    deferred: int = 0  # steps that passed this call over (`StepScheduler._take`)
    guard: Any = None  # the request's deadline and cancellation check, run while the call waits
    opts: tuple = ()  # a scoring call in a Ray actor: (raw_logits, keep), applied there
    positions: list[int] | None = None  # a prompt scored too (score_prompt): log p(ids[p] | ids[:p]) for each p

    @property
    def new(self) -> list[int]:
        """The tokens this call appends as new columns (a scoring call: every candidate's)."""
        if self.cands is not None:
            return [t for c in self.cands for t in c]
        return [int(self.token)] if isinstance(self.token, int) else [int(t) for t in self.token]

    @property
    def segments(self) -> list[list[int]]:
        """Runs of new tokens that see each other (causally); a candidate does not see the others."""
        return self.cands if self.cands is not None else [self.new]

    @property
    def kind(self) -> str:
        return "tree" if self.tree is not None else "prefill" if self.ids is not None else "step"


class RowGroup:
    """States of one member as the rows of one batched cache [rows, heads, width, dim] per layer.
    `valid[r, c]`: row r's token sits in column c; `pos[r, c]`: its position id (-1 for holes)."""

    def __init__(self, member: Any, states: list, built: tuple | None = None) -> None:
        self.member = member
        if built is not None:  # (cache, valid, pos) of a batched prefill, already in this layout
            self.cache, self.valid, self.pos = built
            self.rows = [weakref.ref(s) for s in states]
            for r, s in enumerate(states):
                s.group, s.row, s.cache = self, r, None
            return
        lens = [len(s.ids) for s in states]
        width = max(lens)
        dev = member.device
        layers = []
        for li in range(len(states[0].cache.layers)):
            ks, vs = [], []
            for s, n in zip(states, lens):
                layer = s.cache.layers[li]
                ks.append(torch.nn.functional.pad(layer.keys, (0, 0, width - n, 0)))
                vs.append(torch.nn.functional.pad(layer.values, (0, 0, width - n, 0)))
            layers.append((torch.cat(ks), torch.cat(vs)))
        self.cache = cache_of(layers)
        self.valid = torch.zeros(len(states), width, dtype=torch.bool, device=dev)
        self.pos = torch.full((len(states), width), -1, dtype=torch.long, device=dev)
        for r, n in enumerate(lens):
            self.valid[r, width - n :] = True
            self.pos[r, width - n :] = torch.arange(n, device=dev)
        # weak: a finished request's states are freed at once (its row is dead until a rebuild)
        self.rows: list = [weakref.ref(s) for s in states]
        for r, s in enumerate(states):
            s.group, s.row, s.cache = self, r, None

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    def live(self) -> list:
        return [s for s in (r() for r in self.rows if r is not None) if s is not None]

    def worn(self, columns: int = 1) -> bool:
        """Too wide to take `columns` more (over twice the longest row plus SLACK: the bound
        kvbudget.py counts on): rebuild from the live rows."""
        longest = max((len(s.ids) for s in self.live()), default=0)
        return self.width + columns > 2 * longest + SLACK

    def compact(self) -> None:
        """Drop the dead rows (a finished request's, a released state's): the live rows are copied
        into new tensors, so a dead row's memory is freed before the next step (the bound kvbudget.py
        counts on covers the running requests only). Called under the member's lock."""
        keep = [r for r, ref in enumerate(self.rows) if ref is not None and ref() is not None]
        if len(keep) == len(self.rows):
            return
        states = [self.rows[r]() for r in keep]
        self.valid, self.pos, self.cache = self._gather(torch.tensor(keep, dtype=torch.long, device=self.valid.device))
        self.rows = [weakref.ref(s) for s in states]
        for r, s in enumerate(states):
            s.row = r

    def row_kv(self, state: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of row `state`'s KV, per layer (keys, values) [1, heads, its tokens, dim]."""
        r = state.row
        cols = self.valid[r].nonzero()[:, 0]
        data = []
        for layer in self.cache.layers:
            c = cols.to(layer.keys.device)
            data.append((layer.keys[r : r + 1, :, c], layer.values[r : r + 1, :, c]))
        return data

    def release(self, state: Any) -> None:
        """Take `state` out of the group: its columns become a cache of its own."""
        data = self.row_kv(state)
        state.cache = cache_of(data) if data and data[0][0].shape[2] else DynamicCache()
        self.rows[state.row] = None
        state.group, state.row = None, -1

    def keep(self, state: Any, s: int, n: int, total: int) -> None:
        """Of the `total` candidate columns a scoring step left at the end of row `state`, keep
        those from s to s + n (the chosen candidate's); the others become holes."""
        r = state.row
        cols = self.valid[r].nonzero()[:, 0][-total:]
        gone = torch.cat([cols[:s], cols[s + n :]])
        self.valid[r, gone] = False
        self.pos[r, gone] = -1

    def crop(self, state: Any, n: int) -> None:
        """Row `state` keeps its first n tokens: the later columns become holes."""
        r = state.row
        gone = self.pos[r] >= n
        self.valid[r, gone] = False
        self.pos[r, gone] = -1

    def step(self, calls: list[_Call]) -> None:
        """Each call's tokens appended to its row (right-aligned in the t new columns, t the most
        tokens of a call; the new columns a row does not fill are holes), in one forward, or in
        two when one-token calls beside longer ones would compute SPLIT_COLUMNS hole columns or
        more (a scoring call of 20 tokens beside one-token extends: every row would pay 20)."""
        for part in step_parts(calls):
            self._forward(part)

    def _forward(self, calls: list[_Call]) -> None:
        """One forward of the calls' tokens: over the rows of the calls only (their KV gathered,
        their new columns written back) when the group's other rows would compute SPLIT_COLUMNS
        hole columns or more, else over every row (the others' new columns are holes)."""
        m, b, w = self.member, len(self.rows), self.width
        t = max(len(c.new) for c in calls)
        subset = (b - len(calls)) * t >= SPLIT_COLUMNS
        rows = sorted(c.state.row for c in calls) if subset else list(range(b))
        at = {r: i for i, r in enumerate(rows)}  # a row's index in this forward
        tokens, fresh, qpos, seg = _new_columns(calls, at, t, m.device)
        idx = torch.tensor(rows, dtype=torch.long, device=m.device)
        old_valid, old_pos, cache = self._gather(idx) if subset else (self.valid, self.pos, self.cache)
        valid, pos = torch.cat([old_valid, fresh], dim=1), torch.cat([old_pos, qpos], dim=1)
        # query (r, i) sees row r's past columns and the new ones of its own run up to i; a hole sees only itself
        causal = torch.ones(t, t, dtype=torch.bool, device=m.device).tril()
        runs = (seg[:, :, None] == seg[:, None, :]) & fresh[:, None, :] & causal
        seen = torch.cat([old_valid[:, None, :].expand(len(rows), t, w), runs], dim=2)
        seen &= fresh[:, :, None]
        j = torch.arange(t, device=m.device)
        seen[:, j, w + j] = True  # (a fully masked query gives NaN)
        reads = [1 if c.last_only else len(c.new) for c in calls]  # each call's last columns whose logits it reads
        # the output layer only where a call reads (on its last columns): the other rows of the
        # forward and the columns a shorter call leaves empty get none; with Gemma-3's 262k-row
        # layer that is most of a mixed step's work
        sparse = SPARSE_HEAD and sum(reads) < len(rows) * max(reads) and m.head_splits()
        out = m._forward(
            tallies=[c.tally for c in calls],
            hidden=sparse,
            input_ids=tokens,
            attention_mask=batch_masks(m, seen, qpos, pos),
            position_ids=qpos.clamp(min=0),
            cache=cache,
            use_cache=True,
            **({} if sparse else {"logits_to_keep": max(reads)}),
        )
        if subset:  # the rows' new columns into the group's cache; the other rows get holes there
            self._write_back(cache, idx, fresh, qpos)
        else:
            self.valid, self.pos = valid, pos
        _answer(m, calls, [at[c.state.row] for c in calls], reads, out, sparse)

    def _gather(self, idx: torch.Tensor) -> tuple:
        """The rows `idx` alone: their valid columns, positions and a cache holding a copy of their KV."""
        cache = cache_of(
            [
                (x.keys.index_select(0, idx.to(x.keys.device)), x.values.index_select(0, idx.to(x.keys.device)))
                for x in self.cache.layers
            ]
        )
        return self.valid.index_select(0, idx), self.pos.index_select(0, idx), cache

    def _write_back(self, cache: Any, idx: torch.Tensor, fresh: torch.Tensor, qpos: torch.Tensor) -> None:
        """After a forward over the rows `idx` only: the group gets its new columns, those rows
        the KV the forward computed there, every other row holes."""
        w, t, b = self.width, fresh.shape[1], len(self.rows)
        for mine, sub in zip(self.cache.layers, cache.layers):
            for name in ("keys", "values"):
                full, new = getattr(mine, name), getattr(sub, name)[:, :, w:]
                grown = torch.cat([full, full.new_zeros(full.shape[0], full.shape[1], t, full.shape[3])], dim=2)
                grown[idx.to(grown.device), :, w:] = new
                setattr(mine, name, grown)
        f = torch.zeros(b, t, dtype=torch.bool, device=fresh.device)
        q = torch.full((b, t), -1, dtype=torch.long, device=fresh.device)
        f[idx], q[idx] = fresh, qpos
        self.valid, self.pos = torch.cat([self.valid, f], dim=1), torch.cat([self.pos, q], dim=1)


def cache_of(data: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A DynamicCache holding each layer's (keys, values) as they are. `DynamicCache(ddp_cache_data=...)`
    fills each layer through its `update`, whose torch.cat copies the tensors once more: a group's
    rebuild, a row's release or a gather of rows would copy their KV twice."""
    cache = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in data])
    for layer, (k, v) in zip(cache.layers, data):
        layer.keys, layer.values = k, v
    return cache


def _new_columns(calls: list[_Call], at: dict, t: int, dev: Any) -> tuple:
    """A forward's new columns, the calls' tokens right-aligned in its rows (`at`: a call's row
    there): tokens, which are fresh, their position ids (-1: a hole) and the run of the row's new
    tokens each belongs to (a specfuse candidate sees its own run only)."""
    n = len(at)
    tokens = torch.zeros(n, t, dtype=torch.long)  # built on the CPU, moved once (a GPU step: 4 copies)
    fresh = torch.zeros(n, t, dtype=torch.bool)
    qpos = torch.full((n, t), -1, dtype=torch.long)
    seg = torch.full((n, t), -1, dtype=torch.long)
    for c in calls:
        r, j, start = at[c.state.row], t - len(c.new), len(c.state.ids)
        tokens[r, j:] = torch.tensor(c.new, dtype=torch.long)
        fresh[r, j:] = True
        for k, run in enumerate(c.segments):
            qpos[r, j : j + len(run)] = torch.arange(start, start + len(run))
            seg[r, j : j + len(run)] = k
            j += len(run)
    return tokens.to(dev), fresh.to(dev), qpos.to(dev), seg.to(dev)


def _answer(m: Any, calls: list[_Call], rows: list[int], reads: list[int], out: torch.Tensor, sparse: bool) -> None:
    """Each call's result from a step's forward: its last `reads` columns' logits (with `sparse`,
    `out` holds final hidden states and only those columns get the output layer). An extend's
    state moves on; a scoring call's candidates' columns stay (RowGroup.keep)."""
    t = out.shape[1]
    if sparse:
        cols = [(r, t - k + i) for r, k in zip(rows, reads) for i in range(k)]
        where = torch.tensor(cols, dtype=torch.long, device=out.device)
        flat = m.head(out[where[:, 0], where[:, 1]])
        starts = [sum(reads[:i]) for i in range(len(calls))]
        got = [flat[s : s + k] for s, k in zip(starts, reads)]
    else:
        got = [out[r, t - k :] for r, k in zip(rows, reads)]
    for c, logits in zip(calls, got):
        if c.cands is not None:  # a view: Member.scored keeps only what it needs of it
            c.result = logits
            continue
        logits = logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        c.state.ids.extend(c.new)
        c.state.next_logprobs, c.state.next_logits = logp[-1], logits[-1]
        c.result = logp


def step_parts(calls: list[_Call]) -> list[list[_Call]]:
    """The forwards a step's calls run in (RowGroup.step): one, or the one-token calls apart from
    the longer ones when they would compute SPLIT_COLUMNS hole columns or more beside them."""
    short = [c for c in calls if len(c.new) == 1]
    longer = [c for c in calls if len(c.new) > 1]
    t = max(len(c.new) for c in calls)
    return [short, longer] if short and longer and len(short) * (t - 1) >= SPLIT_COLUMNS else [calls]


def run_prefills(member: Any, calls: list[_Call]) -> None:
    """Several requests' prompts: those that begin like a stored prompt (prefix.py) start from its
    KV and run their rest as one step of a new group; the others run in one forward, left-padded
    (each row at its own positions; the model masks the pads, sliding windows included), their
    states the rows of a new group, ready for the steps. A lone prompt runs on its own cache. A
    prompt scored too (`positions`: score_prompt) gets the output layer at its own rows."""
    with member._lock:
        seeds = {id(c): member.seed(c.state, c.ids, c.positions, c.tally) for c in calls}
        fresh = [c for c in calls if not seeds[id(c)][0]]
        seeded = [c for c in calls if seeds[id(c)][0]]
        for part, run in ((fresh, _fresh_prompts), (seeded, _seeded_prompts)):
            if len(part) == 1:
                c = part[0]
                c.result = member._prompt_own(c.state, c.ids, c.positions, tally=c.tally, seeded=seeds[id(c)])
            elif part:
                run(member, part, seeds)


def _fresh_prompts(member: Any, calls: list[_Call], seeds: dict) -> None:
    """Prompts with no stored beginning: one left-padded forward, their states a new group."""
    scoring = any(c.positions is not None for c in calls)  # rows that want logits at their own positions
    out, cache, valid, pos = _prefill_forward(member, calls, scoring)
    logits = member.head(out[:, -1]) if scoring else out[:, -1]
    RowGroup(member, [c.state for c in calls], (cache, valid, torch.where(valid, pos, -1)))
    width = valid.shape[1]
    for r, c in enumerate(calls):
        rows = logits[r : r + 1]
        if c.positions is not None:  # the rows before its positions (left-padded by width - len)
            at = [width - len(c.ids) + p - 1 for p in c.positions]
            rows = torch.cat([member.head(out[r, torch.tensor(at, device=out.device)]), rows])
        c.result = member.prompt_scores(c.state, c.ids, c.positions, rows)


def _seeded_prompts(member: Any, calls: list[_Call], seeds: dict) -> None:
    """Prompts started from stored beginnings: their rests as one step of a new group of them."""
    steps = [_Call(member, c.state, c.ids[len(c.state.ids) :], c.tally, last_only=c.positions is None) for c in calls]
    RowGroup(member, [c.state for c in calls]).step(steps)
    for c, s in zip(calls, steps):
        n, entry = seeds[id(c)]
        if c.positions is None:
            member.keep_prompt(c.state, {})
            c.result = s.result
            continue
        run = [p for p in c.positions if p > n]  # s.result: log-probs [len(rest), V]; row p-1-n predicts p
        scores = dict(entry.scores)
        for p in run:
            scores[p] = float(s.result[p - 1 - n, c.ids[p]])
        member.keep_prompt(c.state, scores)
        c.result = [scores[p] for p in c.positions]


def _prefill_forward(member: Any, calls: list[_Call], scoring: bool) -> tuple:
    """The prompts' left-padded forward into a new cache (its pads' KV zeroed): the last
    position's logits [rows, 1, V], or with `scoring` (a scored prompt among them) every
    position's final hidden state [rows, width, H]; and the cache, the valid columns and their
    positions."""
    dev, width = member.device, max(len(c.ids) for c in calls)
    tokens = torch.zeros(len(calls), width, dtype=torch.long)
    valid = torch.zeros(len(calls), width, dtype=torch.bool)
    for r, c in enumerate(calls):
        tokens[r, width - len(c.ids) :] = torch.tensor(c.ids, dtype=torch.long)
        valid[r, width - len(c.ids) :] = True
    tokens, valid = tokens.to(dev), valid.to(dev)
    pos = valid.long().cumsum(-1) - 1
    cache = DynamicCache()
    out = member._forward(
        tallies=[c.tally for c in calls],
        hidden=scoring,
        input_ids=tokens,
        attention_mask=valid.long(),
        position_ids=pos.clamp(min=0),
        cache=cache,
        use_cache=True,
        **({} if scoring else {"logits_to_keep": 1}),
    )
    with torch.inference_mode():  # the pads' keys and values are never read: zero, not whatever a pad computed
        for layer in cache.layers:
            hole = ~valid.to(layer.keys.device)[:, None, :, None]
            layer.keys.masked_fill_(hole, 0)
            layer.values.masked_fill_(hole, 0)
    return out, cache, valid, pos


def batch_masks(member: Any, seen: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> Any:
    """The 4-D additive masks [rows, 1, queries, width]: query j of row r sees the columns in
    `seen[r, j]`; a model with sliding-window layers gets a second mask for them (keys within the
    window of the query's own position `qpos[r, j]`; `kpos`: the columns' positions)."""
    neg = torch.finfo(member.dtype).min
    full = torch.zeros(seen.shape, dtype=member.dtype, device=seen.device).masked_fill(~seen, neg)
    cfg = member.model.config.get_text_config(decoder=True)
    window = getattr(cfg, "sliding_window", None)
    if window and "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        far = (qpos[:, :, None] - kpos[:, None, :]) >= window
        return {"full_attention": full[:, None], "sliding_attention": full.masked_fill(far, neg)[:, None]}
    return full[:, None]


def run_step(member: Any, calls: list[_Call]) -> None:
    """One member's step over its waiting calls: in their common group when they have one (and it
    is not worn), else in a new group of these states (a lone call runs on its own cache)."""
    with member._lock:
        alone = [c for c in calls if len(calls) == 1 or not c.state.ids]  # an empty state has no cache to join
        for c in alone:
            if c.state.group is not None:
                c.state.group.release(c.state)
            if c.cands is not None:
                c.result = member._score_own(c.state, c.cands, tally=c.tally)
            else:
                c.result = member._extend_own(c.state, c.new, last_only=c.last_only, tally=c.tally)
        calls = [c for c in calls if c not in alone]
        if not calls:
            return
        states = [c.state for c in calls]
        group = states[0].group
        if group is not None:
            group.compact()
        columns = sum(max(len(c.new) for c in part) for part in step_parts(calls))  # the width the step adds
        if group is None or any(s.group is not group for s in states) or group.worn(columns):
            for s in states:
                if s.group is not None:
                    s.group.release(s)
                member.drop_candidates(s)
            group = RowGroup(member, states)
        group.step(calls)


class StepScheduler:
    """Gathers the extends, prompts and smc trees of concurrent request threads into steps (see the module)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._local = threading.local()
        self._active = 0  # threads running a request or a part of one (registered by `request`)
        self._requests = 0  # of those, the requests themselves (not their parts)
        self._busy = 0  # of those, threads inside a forward of their own (a prefill, a scoring): not waited for
        self._pending: list[_Call] = []
        self._stepping = False
        self._stepped = 0.0  # when the last step ended: everyone gets a gather period after it

    @contextlib.contextmanager
    def request(self, part: bool = False):
        """The calling thread runs one request: its extends and prompts may be batched. A request
        that hands parts of its work to threads of its own (specfuse's parallel drafts) waits for
        them in `own_forward`, and each part runs in `request(part=True)`: the steps wait for it
        as for a request, but a lone request with its parts does not batch (`batching`)."""
        with self._cond:
            self._active += 1
            self._requests += not part
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = False
            with self._cond:
                self._active -= 1
                self._requests -= not part
                self._cond.notify_all()  # the others may all be waiting now

    @contextlib.contextmanager
    def own_forward(self):
        """The calling thread runs a forward outside the steps: while it does, the steps do not wait for it."""
        if not getattr(self._local, "on", False):
            yield
            return
        with self._cond:
            self._busy += 1
            self._cond.notify_all()  # the others may all be waiting now
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1

    def joined(self) -> bool:
        """Whether the calling thread runs a request (or a part of one, see `request`) in the steps."""
        return getattr(self._local, "on", False)

    def batching(self) -> bool:
        """Whether an extend from this thread should wait for a step: it runs a request (or a
        part of one), and another request runs too."""
        return getattr(self._local, "on", False) and self._requests > 1

    def extend(self, member: Any, state: Any, ids: list[int], tally: Tally | None, last_only: bool = False, guard=None):
        """`ids` appended to `state` in the next step, with the other requests' extends of this
        member (log-probs [len(ids), V], or [1, V] with `last_only`)."""
        return self._wait(_Call(member, state, [int(i) for i in ids], tally, last_only=last_only, guard=guard))

    def score(
        self, member: Any, state: Any, cands: list[list[int]], tally: Tally | None, guard=None, opts: tuple = ()
    ) -> Any:
        """specfuse's in-line scoring in the next step, with the other requests' extends of this
        member: the candidates side by side after the row, each seeing the row and itself only.
        Raw logits [total, V]; the candidates' columns stay until keep_candidate / drop_candidates."""
        return self._wait(_Call(member, state, -1, tally, cands=cands, guard=guard, opts=opts))

    def prefill(self, member: Any, state: Any, ids: list[int], tally: Tally | None, guard=None, positions=None) -> Any:
        """A prompt into the empty `state`, run with the other requests' prompts in one forward
        (log-probs of the last position, [1, V]; with `positions`, score_prompt's answer)."""
        return self._wait(_Call(member, state, -1, tally, ids=[int(i) for i in ids], guard=guard, positions=positions))

    def rows(self, member: Any, tree: tuple, tally: Tally | None, guard=None) -> tuple:
        """A `forward_rows` call, run with the other requests' trees in one forward."""
        return self._wait(_Call(member, None, -1, tally, tree=tree, guard=guard))

    def _wait(self, call: _Call) -> Any:
        check = call.guard
        with self._cond:
            self._pending.append(call)
            self._cond.notify_all()
            while not call.done:
                if check is not None and call in self._pending:  # not taken by a step yet: a request
                    try:  # cancelled or past its deadline while passed over leaves the queue at once
                        check()
                    except BaseException:
                        self._pending.remove(call)
                        self._cond.notify_all()
                        raise
                # every running request waits in a step (or this call has waited a gather period:
                # a request still prefilling or scoring is not waited for longer): this thread steps
                late = time.monotonic() - max(call.since, self._stepped) >= GATHER_S
                if not self._stepping and (len(self._pending) >= self._active - self._busy or late):
                    self._step()
                else:
                    self._cond.wait(GATHER_S)
        if call.error is not None:
            raise call.error
        return call.result

    def _take(self) -> list[_Call]:
        """The calls the next step runs: the prompts, and of the extends and trees only the largest
        group (one member's), with any call passed over MAX_DEFER times. Running every group each
        step would keep requests out of phase for good: in unite, half the requests waiting on one
        member and half on the other make two half-full forwards per step, forever. Passing the
        smaller group over once lets its requests fall in behind the others (the requests that just
        stepped move on to that member), and from then on each forward has every row. specfuse and
        safe spend several steps on one member (a draft, a segment): their smaller group may wait
        up to MAX_DEFER steps for the others to come over. A member in a Ray actor computes apart
        from the others (and a step of it does not wait for its answers): its group always runs."""
        groups: dict[tuple, list[_Call]] = {}
        for c in self._pending:
            groups.setdefault((id(c.member), c.kind), []).append(c)
        best = max(groups.values(), key=lambda g: (len(g), -min(c.since for c in g)))
        take = [
            c
            for g in groups.values()
            if g is best
            or g[0].kind == "prefill"
            or getattr(g[0].member, "remote", False)  # its own actor: no other group waits for it
            or any(c.deferred >= MAX_DEFER for c in g)
            for c in g
        ]
        taken = {id(c) for c in take}
        self._pending = [c for c in self._pending if id(c) not in taken]
        for c in self._pending:
            c.deferred += 1
        return take

    def _step(self) -> None:
        """Run the calls `_take` chooses (called with the lock held; released during the forwards)."""
        calls, self._stepping = self._take(), True
        self._cond.release()
        try:
            by_member: dict[tuple, list[_Call]] = {}
            for c in calls:
                by_member.setdefault((id(c.member), c.kind), []).append(c)
            for group in by_member.values():
                try:
                    if getattr(group[0].member, "remote", False):  # one call to its actor (ray/member.py)
                        group[0].member.run_batch(group[0].kind, group)
                    elif group[0].kind == "step":
                        run_step(group[0].member, group)
                    elif group[0].kind == "prefill":
                        run_prefills(group[0].member, group)
                    else:  # smc's trees: one forward for all of them
                        outs = group[0].member.rows_many([c.tree for c in group], [c.tally for c in group])
                        for c, out in zip(group, outs):
                            c.result = out
                except BaseException as exc:  # noqa: BLE001 - each waiting request raises it in its own thread
                    for c in group:
                        c.error = exc
        finally:
            self._cond.acquire()
            for c in calls:
                c.done = True
            self._stepping, self._stepped = False, time.monotonic()
            self._cond.notify_all()


SCHEDULER = StepScheduler()
