"""Does anything of an engine outlive it? `single` on Gemma-3 (llama.cpp), decode speed in a fresh
process, against the same in a process where a SmolLM2 engine, or the pair running specfuse,
answered and was closed first. The rows alternate, each run a fresh process; the figure is each
row's median (tokens per second of a 128-token greedy reply, best of 3 replies per process) and
the median over the rounds of each row's ratio to the fresh process run beside it.

    python benchmarks/second_engine.py --rounds 5 --out benchmarks/results/second_engine
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

PROBE = """
import gc, json, sys, time
from ensemble_llm import Ensemble

def speed(name):
    with Ensemble([name], method="single", progress=False) as engine:
        engine.generate("Hi", max_new_tokens=4)
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            res = engine.generate("Once upon a time, in a small village by the sea,", max_new_tokens=128, raw=True)
            best = max(best, res.usage.completion_tokens / (time.perf_counter() - t0))
    return best

if sys.argv[1] == "after":
    speed("smollm2-135m-instruct")
    gc.collect()
if sys.argv[1] == "after-pair":  # specfuse: its members draft side by side, each on its share of the cores
    with Ensemble(["smollm2-135m-instruct", "gemma-3-270m"], progress=False) as pair:
        pair.generate("Write a long story about a dog and a cat.", max_new_tokens=64)
    gc.collect()
print(json.dumps({"tok_s": speed("gemma-3-270m")}))
"""
ROWS = {
    "fresh process": "fresh",
    "after a SmolLM2 engine, closed": "after",
    "after a specfuse pair engine, closed": "after-pair",
}


def measure(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/second_engine"))
    args = ap.parse_args()
    runs: dict[str, list[float]] = {label: [] for label in ROWS}
    for r in range(args.rounds):
        for label, mode in ROWS.items():  # in turn, so drifts of the machine hit both rows alike
            runs[label].append(round(measure(mode), 2))
            print(f"round {r + 1}: {label}: {runs[label][-1]} tok/s", flush=True)
    medians = {label: statistics.median(v) for label, v in runs.items()}
    fresh = runs["fresh process"]
    # each round's ratio to the fresh process run beside it, then their median: the machine's speed
    # drifts between processes more than any difference sought here
    ratios = {
        label: round(statistics.median(a / f for a, f in zip(v, fresh)), 3)
        for label, v in runs.items()
        if label != "fresh process"
    }
    result = {"runs": runs, "median_tok_s": medians, "median_paired_ratio_to_fresh": ratios}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "results.md").write_text(report(result, args.rounds))
    print(json.dumps(result, indent=1))


def report(res: dict, rounds: int) -> str:
    lines = [
        f"`python benchmarks/second_engine.py --rounds {rounds}`: `single` on Gemma-3 (llama.cpp), tokens/s of a "
        "128-token greedy reply (best of 3 per process), each run a fresh process, the rows in turn.",
        "",
        "| process | median tok/s | over the fresh process beside it (median of the rounds) | every run |",
        "|---|---|---|---|",
    ]
    for label, runs in res["runs"].items():
        ratio = res["median_paired_ratio_to_fresh"].get(label, 1.0)
        lines.append(
            f"| {label} | {res['median_tok_s'][label]:.1f} | {ratio:.3f} | {', '.join(f'{r:.1f}' for r in runs)} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
