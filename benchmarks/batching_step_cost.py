"""What one batched decode step costs: our step (`members/batching.run_step`: rows of one cache,
4-D masks, position ids, holes) against transformers' own batched decode of equal-length rows
(`DynamicCache`, no mask), at 1 and 8 rows, for each bundled member. It says whether the gap to
the throughput targets is our scheduling or the forward itself: with 8 rows costing c times one
row, 8 clients can gain at most 8 / c in tokens/s. Our step at 8 rows, and an extend of 12 tokens
of one request (a SAFE verification, a SpecFuse segment scored), are also timed with the output
layer unpadded (`members/headpad.py` undone), to show what the padding saves. Median of 10 steps
after 2 warm-up steps, contexts of about 100 tokens. Writes results.json and results.md.

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

from ensemble_llm.members.batching import _Call, run_step  # noqa: E402
from ensemble_llm.members.headpad import pad_rows  # noqa: E402
from ensemble_llm.members.loader import load_member  # noqa: E402

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
        calls = [_Call(m, s, int(torch.randint(10, 1000, ())), None) for s in states]
        t = time.perf_counter()
        run_step(m, calls)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    ap.add_argument("--out", default="benchmarks/results/batching_step_cost")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows_out = []
    for name in args.models.split(","):
        m = load_member(name, device="cpu", progress=False)
        r = {"member": name}
        for rows in (1, 8):
            r[f"plain_{rows}_ms"] = round(1000 * plain(m, rows), 1)
            r[f"ours_{rows}_ms"] = round(1000 * ours(m, rows), 1)
        r["head_pad_from"] = m.head_pad
        r["verify_12_ms"] = round(1000 * verify(m), 1)
        pad_rows(m.model, None)
        r["ours_8_unpadded_ms"] = round(1000 * ours(m, 8), 1)
        r["verify_12_unpadded_ms"] = round(1000 * verify(m), 1)
        pad_rows(m.model, m.head_pad)
        r["plain_8_over_1"] = round(r["plain_8_ms"] / r["plain_1_ms"], 2)
        r["ours_8_over_1"] = round(r["ours_8_ms"] / r["ours_1_ms"], 2)
        r["ceiling_tokens_per_s_8_over_1"] = round(8 / r["ours_8_over_1"], 2)
        print(json.dumps(r), flush=True)
        rows_out.append(r)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows_out}, indent=1))
    lines = [
        f"# One decode step at 1 and 8 rows (context about {CONTEXT} tokens, 2 CPU cores, torch {torch.__version__})",
        "",
        "`python benchmarks/batching_step_cost.py`. plain: transformers' batched decode of equal rows, no mask;"
        " ours: `batching.run_step` (rows of different lengths, 4-D mask); verify 12: an extend of 12 tokens of one"
        " request; unpadded: the output layer's padding (members/headpad.py, padded from the row count given) undone."
        " Median ms of 10 steps.",
        "",
        "| member | pads from | plain 1 row | ours 1 row | plain 8 rows | ours 8 rows (unpadded) | plain 8/1 "
        "| ours 8/1 "
        "| tokens/s ceiling 8/1 | verify 12 (unpadded) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows_out:
        lines.append(
            f"| {r['member']} | {r['head_pad_from']} | {r['plain_1_ms']} | {r['ours_1_ms']} | {r['plain_8_ms']} "
            f"| {r['ours_8_ms']} ({r['ours_8_unpadded_ms']}) | {r['plain_8_over_1']} | {r['ours_8_over_1']} "
            f"| {r['ceiling_tokens_per_s_8_over_1']} | {r['verify_12_ms']} ({r['verify_12_unpadded_ms']}) |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
