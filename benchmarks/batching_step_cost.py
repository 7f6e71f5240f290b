"""What one batched decode step costs: our step (`members/rowgroups.run_step`: rows of one cache,
4-D masks, position ids, holes) against transformers' own batched decode of equal-length rows
(`DynamicCache`, no mask), at 1 and 8 rows, for each bundled member. It says whether the gap to
the throughput targets is our scheduling or the forward itself: with 8 rows costing c times one
row, 8 clients can gain at most 8 / c in tokens/s. Our step at 1, 2, 4 and 8 rows, and an extend
of 12 tokens of one request (a SAFE verification, a SpecFuse segment scored), are also timed with
the linear layers as they are (`members/headpad.py`'s plans undone), to show what the plans save.
Median of 10 steps after 2 warm-up steps (with and without the plans: alternating, 3 rounds, the
median), contexts of about 100 tokens. Writes results.json and results.md.

    python benchmarks/batching_step_cost.py --out benchmarks/results/batching_step_cost
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from ensemble_llm.members.headpad import describe, pad_rows  # noqa: E402
from ensemble_llm.members.loader import load_member  # noqa: E402
from ensemble_llm.members.options import MemberOptions  # noqa: E402
from ensemble_llm.members.rowgroups import run_step  # noqa: E402
from ensemble_llm.members.steps import BatchingConfig, Extend  # noqa: E402

CONTEXT, STEPS, WARM = 100, 12, 2


def plain(m, rows: int) -> float:
    """transformers' batched decode: equal-length rows, no mask (the cheapest a step can be)."""
    cache = DynamicCache()
    with torch.inference_mode():
        m.model(input_ids=torch.randint(10, 1000, (rows, CONTEXT)), past_key_values=cache, use_cache=True)
        times = []
        for _ in range(STEPS):
            t = time.perf_counter()
            out = m.model(input_ids=torch.randint(10, 1000, (rows, 1)), past_key_values=cache, use_cache=True)
            torch.log_softmax(out.logits[:, -1].float(), -1)
            times.append(time.perf_counter() - t)
    return statistics.median(times[WARM:])


def ours(m, rows: int) -> float:
    """Our step over rows of different lengths (left holes in the shared cache)."""
    states = [m.prefill(torch.randint(10, 1000, (CONTEXT - 3 * i,)).tolist()) for i in range(rows)]
    times = []
    for _ in range(STEPS):
        calls = [Extend(m, s, tokens=[int(torch.randint(10, 1000, ()))]) for s in states]
        t = time.perf_counter()
        run_step(m, calls, BatchingConfig())
        times.append(time.perf_counter() - t)
    return statistics.median(times[WARM:])


def verify(m, tokens: int = 12) -> float:
    """An extend of `tokens` tokens of one request, rolled back after each (logits at every one)."""
    state = m.prefill(torch.randint(10, 1000, (CONTEXT,)).tolist())
    times = []
    for _ in range(STEPS):
        ids = torch.randint(10, 1000, (tokens,)).tolist()
        with m.scratch(state):
            t = time.perf_counter()
            m.extend(state, ids)
            times.append(time.perf_counter() - t)
    return statistics.median(times[WARM:])


def both(m, fn, arg: int, rounds: int = 3) -> tuple[float, float]:
    """fn(m, arg)'s median ms with the linear layers' plans and without them, the two alternating
    `rounds` times (this machine's speed drifts within a run)."""
    plans, times = m.row_plans, ([], [])
    try:
        for _ in range(rounds):
            for i, p in enumerate((plans, None)):
                pad_rows(m.model, p)
                times[i].append(fn(m, arg))
    finally:
        pad_rows(m.model, plans)
    return tuple(round(1000 * statistics.median(t), 1) for t in times)


STEPS_AT = (1, 2, 4, 8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    ap.add_argument("--out", default="benchmarks/results/batching_step_cost")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows_out = []
    for name in args.models.split(","):
        m = load_member(name, device="cpu", progress=False, options=MemberOptions(backend="transformers"))
        head = tuple(m.model.get_output_embeddings().weight.shape)
        r = {"member": name, "plans": {str(k): describe(v) for k, v in m.row_plans.items()}}
        r["head_plan"] = describe(m.row_plans.get(head))
        inner = {tuple(x.weight.shape) for x in m.model.modules() if isinstance(x, torch.nn.Linear)} - {head}
        r["inner_planned"] = f"{sum(k in inner for k in m.row_plans)} of {len(inner)}"
        for rows in (1, 8):
            r[f"plain_{rows}_ms"] = round(1000 * plain(m, rows), 1)
        jobs = [(f"ours_{n}", ours, n) for n in STEPS_AT] + [("verify_12", verify, 12)]
        for key, fn, arg in jobs:
            r[f"{key}_ms"], r[f"{key}_unplanned_ms"] = both(m, fn, arg)
        r["plain_8_over_1"] = round(r["plain_8_ms"] / r["plain_1_ms"], 2)
        r["ours_8_over_1"] = round(r["ours_8_ms"] / r["ours_1_ms"], 2)
        r["ceiling_tokens_per_s_8_over_1"] = round(8 / r["ours_8_over_1"], 2)
        print(json.dumps(r), flush=True)
        rows_out.append(r)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows_out}, indent=1))
    lines = [
        f"# One decode step at 1 to 8 rows (context about {CONTEXT} tokens, 2 CPU cores, torch {torch.__version__})",
        "",
        "`python benchmarks/batching_step_cost.py`. plain: transformers' batched decode of equal rows, no mask;"
        " ours: `rowgroups.run_step` (rows of different lengths, 4-D mask); verify 12: an extend of 12 tokens of one"
        " request; in brackets: the linear layers' plans (members/headpad.py, timed at load) undone."
        " Median ms of 10 steps; with and without the plans alternating, 3 rounds, the median of the 3.",
        "",
        "| member | output layer plan | inner shapes planned | ours 1 row | ours 2 rows | ours 4 rows | ours 8 rows "
        "| plain 1 row, 8 rows | ours 8/1 | tokens/s ceiling 8/1 | verify 12 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows_out:
        steps = " | ".join(f"{r[f'ours_{n}_ms']} ({r[f'ours_{n}_unplanned_ms']})" for n in STEPS_AT)
        lines.append(
            f"| {r['member']} | {r['head_plan']} | {r['inner_planned']} | {steps} "
            f"| {r['plain_1_ms']}, {r['plain_8_ms']} "
            f"| {r['ours_8_over_1']} | {r['ceiling_tokens_per_s_8_over_1']} "
            f"| {r['verify_12_ms']} ({r['verify_12_unplanned_ms']}) |"
        )
    lines += ["", "Plans by layer shape (out, in):", ""]
    lines += [f"- {r['member']} {k}: {v}" for r in rows_out for k, v in r["plans"].items()]
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
