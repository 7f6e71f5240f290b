"""What splitting a batched step saves (members/rowgroups.py: `BatchingConfig.split_columns`, `sparse_head`),
measured side by side in one process against whole steps (one forward over every row of the
group, the output layer on each row at the step's longest read: the code before the change).

1. Steps: one member's group of 8 rows (prompts of 120-141 tokens), the median time of one step
   over 5 repeats for each mix of calls (one-token extends, specfuse scorings of two 10-token
   candidates, idle rows), split and whole.
2. Requests: per method, 16 chat requests (up to 32 tokens, greedy) from 8 client threads, the
   two modes alternating `--repeats` times on one engine: aggregate tokens/s of each run, the
   ratio of the medians, and the texts that differ between the modes (greedy: none expected).
   In one extra pass per mode, each member's batched forwards are counted with the columns they
   compute (rows x new columns), the rows given the output layer, and the columns the calls asked.

    python benchmarks/step_split.py --out benchmarks/results/step_split
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from serve_overhead import PROMPTS  # noqa: E402 (the same 8 chat prompts as the serve-overhead bench)

from ensemble_llm import Ensemble  # noqa: E402
from ensemble_llm.members import rowgroups  # noqa: E402
from ensemble_llm.members.rowgroups import run_step  # noqa: E402
from ensemble_llm.members.steps import BatchingConfig, Extend, Score  # noqa: E402

MODES = {
    "split": BatchingConfig(),
    "whole": BatchingConfig(sparse_head=False, split_columns=10**9),
}
DEFAULT = BatchingConfig()
# these benches time the transformers steps (members/rowgroups.py)
PAIR = [{"model": n, "backend": "transformers"} for n in ("smollm2-135m-instruct", "gemma-3-270m")]


def set_mode(engine, mode: str) -> BatchingConfig:
    """The mode's config, set as the engine's too (its scheduler's steps run under it)."""
    engine.scheduler.config = MODES[mode]
    return MODES[mode]


def step_table(engine, repeats: int = 5) -> list[dict]:
    cands = [list(range(200, 210)), list(range(300, 310))]
    mixes = {
        "8 rows x 1 token": lambda s, m: [Extend(m, x, tokens=[9]) for x in s],
        "4 rows x 1 token, 4 idle": lambda s, m: [Extend(m, x, tokens=[9]) for x in s[:4]],
        "1 scoring (20 tokens) + 7 x 1 token": lambda s, m: (
            [Score(m, s[0], cands=cands)] + [Extend(m, x, tokens=[9]) for x in s[1:]]
        ),
        "2 scorings + 6 x 1 token": lambda s, m: (
            [Score(m, x, cands=cands) for x in s[:2]] + [Extend(m, x, tokens=[9]) for x in s[2:]]
        ),
        "4 scorings, 4 idle": lambda s, m: [Score(m, x, cands=cands) for x in s[:4]],
        "8 scorings": lambda s, m: [Score(m, x, cands=cands) for x in s],
    }
    rows = []
    for m in engine.members:
        g = torch.Generator().manual_seed(0)

        def group(m=m, g=g):
            states = [m.prefill(torch.randint(100, 5000, (120 + 3 * i,), generator=g).tolist()) for i in range(8)]
            run_step(m, [Extend(m, s, tokens=[7]) for s in states], DEFAULT)
            return states

        for name, mix in mixes.items():
            ms = {}
            for mode in MODES:
                config = set_mode(engine, mode)
                ts = []
                for _ in range(repeats):
                    states = group()  # all 8 alive: the rows without a call are idle, not dead
                    calls = mix(states, m)
                    t0 = time.perf_counter()
                    run_step(m, calls, config)
                    ts.append(time.perf_counter() - t0)
                ms[mode] = round(statistics.median(ts) * 1e3, 1)
            rows.append({"member": m.name, "mix": name, **{f"{k}_ms": v for k, v in ms.items()}})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def run_requests(engine, clients: int = 8) -> tuple[float, list[str]]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        outs = list(pool.map(lambda p: engine.generate(p, max_new_tokens=32), PROMPTS * 2))
    return sum(o.usage.completion_tokens for o in outs) / (time.perf_counter() - t0), [o.text for o in outs]


def counted(engine) -> dict:
    """One pass of the requests with every member's batched forwards counted (see the module)."""
    stats, forward = {}, rowgroups.RowGroup._forward

    def wrapped(group, calls, config):
        m = group.member
        rec = stats.setdefault(m.name, {"forwards": 0, "columns": 0, "head_rows": 0, "asked": 0, "s": 0.0})
        inner, head = m.forward, m.head

        def f(*a, **kw):
            b, t = kw["input_ids"].shape
            rec["forwards"] += 1
            rec["columns"] += b * t
            rec["head_rows"] += 0 if kw.get("hidden") else b * kw.get("logits_to_keep", t)
            return inner(*a, **kw)

        def h(x):
            rec["head_rows"] += x.shape[0]
            return head(x)

        m.forward, m.head = f, h
        rec["asked"] += sum(len(c.new) for c in calls)
        t0 = time.perf_counter()
        try:
            forward(group, calls, config)
        finally:
            rec["s"] = round(rec["s"] + time.perf_counter() - t0, 2)
            del m.forward, m.head

    rowgroups.RowGroup._forward = wrapped
    try:
        run_requests(engine)
    finally:
        rowgroups.RowGroup._forward = forward
    return stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="specfuse,safe,unite")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out", default="step-split")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = Ensemble(PAIR, "unite").load()
    steps = step_table(engine)
    methods = []
    for method in args.methods.split(","):
        engine = Ensemble(PAIR, method, max_batch=8).load()
        engine.generate("Hello", max_new_tokens=8)
        runs, texts = {m: [] for m in MODES}, {}
        for rep in range(args.repeats):
            for mode in MODES if rep % 2 == 0 else list(MODES)[::-1]:
                set_mode(engine, mode)
                tps, txt = run_requests(engine)
                runs[mode].append(round(tps, 2))
                texts.setdefault(mode, txt)
        counts = {}
        for mode in MODES:
            set_mode(mode)
            counts[mode] = counted(engine)
        row = {
            "method": method,
            "tokens_per_s": runs,
            "ratio_of_medians": round(statistics.median(runs["split"]) / statistics.median(runs["whole"]), 3),
            "split_faster_in": sum(a > b for a, b in zip(runs["split"], runs["whole"])),
            "texts_differing": sum(a != b for a, b in zip(texts["split"], texts["whole"])),
            "forwards": counts,
        }
        print(json.dumps(row), flush=True)
        methods.append(row)
    set_mode("split")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "steps": steps, "methods": methods}, indent=1))
    (out / "results.md").write_text(_table(steps, methods, args) + "\n")


def _table(steps, methods, args) -> str:
    lines = [
        "# Split steps against whole steps (members/rowgroups.py), side by side in one process",
        "",
        f"`python benchmarks/step_split.py --methods {args.methods} --repeats {args.repeats}`; the bundled pair,"
        f" 2 CPU cores. Split: split_columns = {MODES['split'].split_columns}, sparse_head on."
        " Whole: one forward over every row, the output layer on every row at the step's longest read.",
        "",
        "One step of a group of 8 rows (median of 5):",
        "",
        "| member | calls | whole ms | split ms |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['member']} | {r['mix']} | {r['whole_ms']} | {r['split_ms']} |" for r in steps]
    lines += [
        "",
        f"16 chat requests from 8 clients, the modes alternating {args.repeats} times (tokens/s of each run):",
        "",
        "| method | split | whole | split over whole (medians) | split faster in | texts differing |",
        "|---|---|---|---|---|---|",
    ]
    for r in methods:
        t = r["tokens_per_s"]
        lines.append(
            f"| {r['method']} | {', '.join(map(str, t['split']))} | {', '.join(map(str, t['whole']))} | "
            f"{r['ratio_of_medians']}x | {r['split_faster_in']} of {len(t['split'])} | {r['texts_differing']} |"
        )
    lines += [
        "",
        "One counted pass per mode: batched forwards, the columns they computed (rows x new columns), the rows"
        " given the output layer, the columns the calls asked for, and seconds in those forwards:",
        "",
        "| method | member | whole: forwards, columns, head rows, asked, s | split: the same |",
        "|---|---|---|---|",
    ]
    for r in methods:
        for name in r["forwards"]["whole"]:
            w, s = r["forwards"]["whole"][name], r["forwards"]["split"].get(name, {})
            fmt = lambda x: ", ".join(str(x.get(k, "")) for k in ("forwards", "columns", "head_rows", "asked", "s"))  # noqa: E731
            lines.append(f"| {r['method']} | {name} | {fmt(w)} | {fmt(s)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
