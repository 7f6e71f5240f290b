"""How much continuous batching can give on this machine, per method: where a request's time goes
at one client, and the best ratio of 8 clients over 1 that full batches could reach here.

1. One client: the requests (the 8 chat prompts of the serve bench, twice; greedy, up to 32
   tokens) one after another, every member forward timed (with the output layer a step runs after
   it) and put in a kind: `prompt` (a prompt's prefill, or its scoring for the per-request
   weights), `one` (one new column a row: a decode step, a draft token) or `multi` (several:
   safe's verification, specfuse's scoring, forced tokens). The rest of the wall time is `other`:
   the methods' own work (alignment, Hedge, sampling, Python).
2. Eight clients: the same requests from 8 threads on the same engine (max_batch 8): the same
   split, and how many calls a batched forward served on average.
3. What a full batch saves: per member and kind, a forward of 8 rows against a forward of 1
   (prompts of 130-151 random tokens; `one`: one token a row; `multi`: the mean new columns of
   that member's `multi` forwards at one client; `prompt`: 8 such prompts in one forward against
   one), median of 5. g = 8 x t(1 row) / t(8 rows): how many times cheaper a call gets in a full
   forward.
4. Ceiling: T1 / (sum over members and kinds of T1[member, kind] / g[member, kind] + other), the
   ratio if every forward served 8 calls and the methods' own work stayed what it was at one
   client (on 2 cores it does not run beside the forwards). A target above it cannot be met on
   this machine by scheduling; only cheaper forwards (fewer columns, a smaller output layer) or
   other hardware move it.

    python benchmarks/batching_ceiling.py --out benchmarks/results/batching_ceiling
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from serve_overhead import PROMPTS  # noqa: E402 (the same 8 chat prompts as the serve-overhead bench)

from ensemble_llm import Ensemble  # noqa: E402
from ensemble_llm.members import rowgroups  # noqa: E402
from ensemble_llm.members.member import Member  # noqa: E402
from ensemble_llm.members.rowgroups import run_prefills, run_step  # noqa: E402
from ensemble_llm.members.steps import BatchingConfig, Extend, Prefill  # noqa: E402

DEFAULT = BatchingConfig()
# these benches time the transformers steps (members/rowgroups.py)
PAIR = [{"model": n, "backend": "transformers"} for n in ("smollm2-135m-instruct", "gemma-3-270m")]
KINDS = ("prompt", "one", "multi")


class Timer:
    """Every real member forward (and a step's output layer after it) timed, by member and kind."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.time: dict[tuple, float] = {}
        self.forwards: dict[tuple, int] = {}
        self.columns: dict[tuple, int] = {}
        self.calls: dict[tuple, int] = {}

    def add(self, key: tuple, seconds: float, forwards: int = 0, columns: int = 0) -> None:
        with self.lock:
            self.time[key] = self.time.get(key, 0.0) + seconds
            self.forwards[key] = self.forwards.get(key, 0) + forwards
            self.columns[key] = self.columns.get(key, 0) + columns

    def install(self) -> None:
        forward, head, prompt_own, prefills, group_forward = (
            Member._forward,
            Member.head,
            Member.run_prompt,
            rowgroups.run_prefills,
            rowgroups.RowGroup._forward,
        )
        timer = self

        def kind_of(cols: int) -> str:
            if getattr(timer.local, "prompt", False):
                return "prompt"
            return "one" if cols == 1 else "multi"

        def timed_forward(m, tallies=None, hidden=False, **kw):
            if tallies is None:  # it calls itself again with the thread's tally
                return forward(m, tallies, hidden, **kw)
            key = (m.name, kind_of(kw["input_ids"].shape[1]))
            timer.local.last = key
            t0 = time.perf_counter()
            try:
                return forward(m, tallies, hidden, **kw)
            finally:
                timer.add(key, time.perf_counter() - t0, 1, kw["input_ids"].shape[1])

        def timed_head(m, x):
            t0 = time.perf_counter()
            try:
                return head(m, x)
            finally:
                timer.add(getattr(timer.local, "last", (m.name, "multi")), time.perf_counter() - t0)

        def as_prompt(fn):
            def wrapped(*a, **kw):
                timer.local.prompt = True
                try:
                    return fn(*a, **kw)
                finally:
                    timer.local.prompt = False

            return wrapped

        def counted_group(group, calls, config):
            cols = max(len(c.new) for c in calls)
            with timer.lock:
                key = (group.member.name, "one" if cols == 1 else "multi")
                timer.calls[key] = timer.calls.get(key, 0) + len(calls)
            return group_forward(group, calls, config)

        Member._forward, Member.head, Member.run_prompt = timed_forward, timed_head, as_prompt(prompt_own)
        rowgroups.run_prefills = as_prompt(prefills)
        rowgroups.RowGroup._forward = counted_group


def run(engine, clients: int, timer: Timer) -> dict:
    timer.reset()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        outs = list(pool.map(lambda p: engine.generate(p, max_new_tokens=32), PROMPTS * 2))
    wall = time.perf_counter() - t0
    parts = {f"{m}/{k}": round(t, 2) for (m, k), t in sorted(timer.time.items())}
    per_fwd = {
        f"{m}/{k}": round(timer.calls[(m, k)] / timer.forwards[(m, k)], 2)
        for (m, k) in timer.calls
        if timer.forwards.get((m, k))
    }
    cols = {
        f"{m}/{k}": round(timer.columns[(m, k)] / timer.forwards[(m, k)], 1)
        for (m, k) in timer.forwards
        if timer.forwards[(m, k)]
    }
    tokens = sum(o.usage.completion_tokens for o in outs)
    return {
        "clients": clients,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 2),
        "forward_s": parts,
        "other_s": round(wall - sum(timer.time.values()), 2),
        "calls_per_forward": per_fwd,
        "mean_new_columns": cols,
        "texts": [o.text for o in outs],
    }


def median_time(fn, repeats: int = 5) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def gains(engine, columns: dict[str, float]) -> dict:
    """g per member and kind (see the module): 8 x t(1 row) / t(8 rows)."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    for m in engine.members:
        prompts = [torch.randint(100, 5000, (130 + 3 * i,), generator=gen).tolist() for i in range(8)]
        m.prefixes.max_bytes, saved = 0, m.prefixes.max_bytes  # no stored prompt: each prompt runs whole
        m.prefixes.clear()
        try:
            out.update(member_gains(m, prompts, max(2, round(columns.get(f"{m.name}/multi", 2)))))
        finally:
            m.prefixes.max_bytes = saved
    return out


def member_gains(m, prompts: list[list[int]], multi: int) -> dict:
    def alone(toks):
        s = m.prefill(prompts[0])
        t0 = time.perf_counter()
        m.extend(s, toks)
        return time.perf_counter() - t0

    def together(toks):
        states = [m.prefill(p) for p in prompts]
        run_step(m, [Extend(m, s, tokens=[7]) for s in states], DEFAULT)  # one group of 8 rows
        t0 = time.perf_counter()
        run_step(m, [Extend(m, s, tokens=toks) for s in states], DEFAULT)
        return time.perf_counter() - t0

    one = median_time(lambda: m.prefill(prompts[0]))
    eight = median_time(lambda: run_prefills(m, [Prefill(m, m.new_state(), ids=p) for p in prompts], DEFAULT))
    out = {f"{m.name}/prompt": round(8 * one / eight, 2)}
    for kind, n in (("one", 1), ("multi", multi)):
        toks = list(range(300, 300 + n))
        t1 = statistics.median(alone(toks) for _ in range(5))
        t8 = statistics.median(together(toks) for _ in range(5))
        out[f"{m.name}/{kind}"] = round(8 * t1 / t8, 2)
        out[f"{m.name}/{kind}_columns"] = n
    return out


def ceiling(one: dict, g: dict) -> float:
    t1 = one["wall_s"]
    full = one["other_s"] + sum(t / g[key] for key, t in one["forward_s"].items())
    return round(t1 / full, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="single,unite,safe,specfuse")
    ap.add_argument("--out", default="batching-ceiling")
    args = ap.parse_args()
    timer = Timer()
    timer.install()
    rows = []
    t_start = time.perf_counter()
    for method in args.methods.split(","):
        engine = Ensemble(PAIR[:1] if method == "single" else PAIR, method, max_batch=8).load()
        engine.generate("Hello", max_new_tokens=8)  # warm up
        one, eight = run(engine, 1, timer), run(engine, 8, timer)
        g = gains(engine, one["mean_new_columns"])
        row = {
            "method": method,
            "one_client": {k: v for k, v in one.items() if k != "texts"},
            "eight_clients": {k: v for k, v in eight.items() if k != "texts"},
            "gain_full_batch": g,
            "measured_ratio": round(eight["tokens_per_s"] / one["tokens_per_s"], 2),
            "ceiling_ratio": ceiling(one, g),
            "texts_differing": sum(a != b for a, b in zip(one["texts"], eight["texts"])),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        del engine
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    lines = [
        "# Continuous batching: where the time goes, and the ceiling of 8 clients over 1 on this machine",
        "",
        f"Members: {', '.join(p['model'] for p in PAIR)} on transformers (single: the first). 16 chat requests,"
        " greedy, up to 32 tokens, in process, "
        f"2 CPU cores. `python benchmarks/batching_ceiling.py --methods {args.methods}` "
        f"({round((time.perf_counter() - t_start) / 60, 1)} min).",
        "",
        "Seconds by member and kind of forward (prompt / one new column / several), and the methods' own work"
        " (other); g: how many times cheaper a call gets in a forward of 8 rows than alone; ceiling: 8 clients"
        " over 1 if every forward served 8 calls (see the script's docstring).",
        "",
        "| method | clients | tokens/s | forwards s | other s | calls per forward | g (full batch) "
        "| 8 over 1 measured | ceiling | texts differing |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def short(key: str) -> str:  # "gemma-3-270m/one" -> "gemma/one"
        return key.split("-")[0] + "/" + key.split("/")[1]

    for r in rows:
        g = ", ".join(f"{short(k)} {v}" for k, v in r["gain_full_batch"].items() if not k.endswith("_columns"))
        for side, label in (("one_client", 1), ("eight_clients", 8)):
            s = r[side]
            parts = ", ".join(f"{short(k)} {v}" for k, v in s["forward_s"].items())
            calls = ", ".join(f"{short(k)} {v}" for k, v in s["calls_per_forward"].items()) or "-"
            tail = f"| {g} | {r['measured_ratio']}x | {r['ceiling_ratio']}x | {r['texts_differing']} |"
            lines.append(
                f"| {r['method']} | {label} | {s['tokens_per_s']} | {parts} | {s['other_s']} | {calls} "
                + (tail if label == 8 else "| | | | |")
            )
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
