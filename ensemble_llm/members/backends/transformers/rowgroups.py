"""The transformers executor: a member's calls of one step as rows of one batched KV cache.

The states of one member that step together live as rows of one batched cache (`RowGroup`), so
a steady decode step copies nothing: each row's own tokens sit in its columns, right-aligned; a
step adds as many columns as its longest extend, and the new columns a row does not fill are
masked holes. A batched prefill's cache is already such a group (`run_prefills`: one left-padded
forward per member; prompts that begin like a stored one start from its KV and run only their
rests, prefix.py). A crop inside a group masks columns instead of copying; any other operation
takes the row out of the group first (`release`: its columns copied into a cache of its own). A
finished request's row leaves the group's tensors before the next step (`compact`). Each row sees
only its own columns at its own position ids, through a 4-D mask (sliding-window layers get a
mask of their own), so a batched step computes what the row's own forward would, up to float
rounding. A step pays for holes only up to a bound (`BatchingConfig.split_columns`): one-token
calls beside longer ones (specfuse's scoring, safe's verifications) run in a forward apart, and a
forward whose calls leave many of the group's rows idle runs over their rows only (gathered, their
new columns written back; the others get holes). The output layer runs only on the columns a
call reads (`sparse_head`).

specfuse's in-line scoring joins the steps too: its candidates are new columns of the row like an
extend's, each candidate a run that sees the row and itself only (`steps.Score`); keeping one
candidate afterwards makes the others' columns holes (`RowGroup.keep`).

The prompt scoring of per-request weights (`score_prompt`) joins the prompt batches too: that
forward returns the final hidden states, and each scoring row gets the output layer at its own
positions (`Member.head`, checked once per member against the model's own logits). smc's trees
of several requests run in one tree-attention forward (`Member.rows_many`).

The step scheduler (scheduler.py) decides which calls step together; `RowGroupExecutor` runs them.
A Ray actor runs these same functions on its own states (ray/actor.py).
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from ...protocol import prompt_score
from ...steps import BatchingConfig, Extend, Prefill, Score, StepCall, Tree, segments


class RowGroupExecutor:
    """A transformers member's executor (steps.Executor): extends and scorings of one step in its
    row group, prompts in one left-padded forward, smc's trees in one tree forward."""

    apart = False

    def __init__(self, member: Any) -> None:
        self.member = member

    def group(self, call: StepCall) -> tuple:
        return (id(self.member), call.kind)

    def batchable(self, call: StepCall) -> bool:
        if isinstance(call, Prefill) and call.positions is not None:  # a scored prompt needs the head split
            return self.member.head_splits()
        # an extend into an empty state of several tokens (not a prompt) has no row to join
        return not (isinstance(call, Extend) and not call.state.ids and len(call.tokens) > 1)

    def run(self, calls: Sequence[StepCall], config: BatchingConfig) -> None:
        m, kind = self.member, calls[0].kind
        if kind == "step":
            run_step(m, list(calls), config)
        elif kind == "prefill":
            run_prefills(m, list(calls), config)
        else:  # smc's trees: one forward for all of them
            outs = m.rows_many([c.tree for c in calls], [c.tally for c in calls])
            for c, out in zip(calls, outs):
                c.result = out

    def run_alone(self, call: StepCall, config: BatchingConfig) -> Any:
        m = self.member
        if isinstance(call, Tree):
            return m.rows_many([call.tree], [call.tally])[0]
        m.own(call.state)
        if isinstance(call, Prefill):
            return m.run_prompt(call.state, call.ids, call.positions, tally=call.tally)
        if isinstance(call, Score):
            return m.run_score(call.state, call.cands, tally=call.tally)
        return m.run_extend(call.state, call.tokens, call.last_only, tally=call.tally)

    def recover(self, call: StepCall) -> None:
        """After a failed step: the call's state holds its own tokens again (a row's columns past
        them, written by the failed step, become holes) and no candidates."""
        state = call.state
        if state is None:
            return
        with self.member.lock:
            if state.group is not None:
                state.group.crop(state, len(state.ids))
            state.scored = None


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

    def worn(self, columns: int = 1, slack: int = 64) -> bool:
        """Too wide to take `columns` more (over twice the longest row plus `slack`: the bound
        kvbudget.py counts on): rebuild from the live rows."""
        longest = max((len(s.ids) for s in self.live()), default=0)
        return self.width + columns > 2 * longest + slack

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

    def step(self, calls: list[StepCall], config: BatchingConfig) -> None:
        """Each call's tokens appended to its row (right-aligned in the t new columns, t the most
        tokens of a call; the new columns a row does not fill are holes), in one forward, or in
        two when one-token calls beside longer ones would compute `split_columns` hole columns or
        more (a scoring call of 20 tokens beside one-token extends: every row would pay 20)."""
        for part in step_parts(calls, config.split_columns):
            self._forward(part, config)

    def _forward(self, calls: list[StepCall], config: BatchingConfig) -> None:
        """One forward of the calls' tokens: over the rows of the calls only (their KV gathered,
        their new columns written back) when the group's other rows would compute `split_columns`
        hole columns or more, else over every row (the others' new columns are holes)."""
        m, b, w = self.member, len(self.rows), self.width
        t = max(len(c.new) for c in calls)
        subset = (b - len(calls)) * t >= config.split_columns
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
        # each call's last columns whose logits it reads
        reads = [1 if getattr(c, "last_only", False) else len(c.new) for c in calls]
        # the output layer only where a call reads (on its last columns): the other rows of the
        # forward and the columns a shorter call leaves empty get none; with Gemma-3's 262k-row
        # layer that is most of a mixed step's work
        sparse = config.sparse_head and sum(reads) < len(rows) * max(reads) and m.head_splits()
        out = m.forward(
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


def _new_columns(calls: list[StepCall], at: dict, t: int, dev: Any) -> tuple:
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
        for k, run in enumerate(segments(c)):
            qpos[r, j : j + len(run)] = torch.arange(start, start + len(run))
            seg[r, j : j + len(run)] = k
            j += len(run)
    return tokens.to(dev), fresh.to(dev), qpos.to(dev), seg.to(dev)


def _answer(m: Any, calls: list[StepCall], rows: list[int], reads: list[int], out: torch.Tensor, sparse: bool) -> None:
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
        if isinstance(c, Score):  # a view: Member.scored keeps only what it needs of it
            c.result = logits
            continue
        logits = logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        c.state.ids.extend(c.new)
        c.state.next_logprobs, c.state.next_logits = logp[-1], logits[-1]
        c.result = logp


def step_parts(calls: list[StepCall], split_columns: int) -> list[list[StepCall]]:
    """The forwards a step's calls run in (RowGroup.step): one, or the one-token calls apart from
    the longer ones when they would compute `split_columns` hole columns or more beside them."""
    short = [c for c in calls if len(c.new) == 1]
    longer = [c for c in calls if len(c.new) > 1]
    t = max(len(c.new) for c in calls)
    return [short, longer] if short and longer and len(short) * (t - 1) >= split_columns else [calls]


def run_prefills(member: Any, calls: list[Prefill], config: BatchingConfig) -> None:
    """Several requests' prompts: those that begin like a stored prompt (prefix.py) start from its
    KV and run their rest as one step of a new group; the others run in one forward, left-padded
    (each row at its own positions; the model masks the pads, sliding windows included), their
    states the rows of a new group, ready for the steps. A lone prompt runs on its own cache. A
    prompt scored too (`positions`: score_prompt) gets the output layer at its own rows."""
    with member.lock:
        seeds = {id(c): member.seed(c.state, c.ids, c.positions, c.tally) for c in calls}
        fresh = [c for c in calls if not seeds[id(c)][0]]
        seeded = [c for c in calls if seeds[id(c)][0]]
        for part, run in ((fresh, _fresh_prompts), (seeded, _seeded_prompts)):
            if len(part) == 1:
                c = part[0]
                c.result = member.run_prompt(c.state, c.ids, c.positions, tally=c.tally, seeded=seeds[id(c)])
            elif part:
                run(member, part, seeds, config)


def _fresh_prompts(member: Any, calls: list[Prefill], seeds: dict, config: BatchingConfig) -> None:
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


def _seeded_prompts(member: Any, calls: list[Prefill], seeds: dict, config: BatchingConfig) -> None:
    """Prompts started from stored beginnings: their rests as one step of a new group of them."""
    steps = [
        Extend(member, c.state, c.tally, tokens=c.ids[len(c.state.ids) :], last_only=c.positions is None) for c in calls
    ]
    RowGroup(member, [c.state for c in calls]).step(steps, config)
    for c, s in zip(calls, steps):
        n, entry = seeds[id(c)]
        if c.positions is None:
            member.keep_prompt(c.state, {})
            c.result = s.result
            continue
        run = [p for p in c.positions if p > n]  # s.result: log-probs [len(rest), V]; row p-1-n predicts p
        scores = dict(entry.scores)
        for p in run:
            scores[p] = prompt_score(s.result[p - 1 - n], c.ids[p])
        member.keep_prompt(c.state, scores)
        c.result = [scores[p] for p in c.positions]


def _prefill_forward(member: Any, calls: list[Prefill], scoring: bool) -> tuple:
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
    out = member.forward(
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


def run_step(member: Any, calls: list[StepCall], config: BatchingConfig) -> None:
    """One member's step over its waiting calls: in their common group when they have one (and it
    is not worn), else in a new group of these states (a lone call runs on its own cache)."""
    with member.lock:
        alone = [c for c in calls if len(calls) == 1 or not c.state.ids]  # an empty state has no cache to join
        for c in alone:
            if c.state.group is not None:
                c.state.group.release(c.state)
            if isinstance(c, Score):
                c.result = member.run_score(c.state, c.cands, tally=c.tally)
            else:
                c.result = member.run_extend(c.state, c.new, last_only=c.last_only, tally=c.tally)
        calls = [c for c in calls if c not in alone]
        if not calls:
            return
        states = [c.state for c in calls]
        group = states[0].group
        if group is not None:
            group.compact()
        # the width the step adds
        columns = sum(max(len(c.new) for c in part) for part in step_parts(calls, config.split_columns))
        if group is None or any(s.group is not group for s in states) or group.worn(columns, config.slack):
            for s in states:
                if s.group is not None:
                    s.group.release(s)
                member.drop_candidates(s)
            group = RowGroup(member, states)
        group.step(calls, config)
