"""What `Ensemble.close()` gives back: resident memory of a fresh process before the bundled pair
loads, after a request, after close(), and after a second load, request and close (a leak would
grow it). Each row is several fresh processes (the figure moves between runs of the same code):
one with only `ensemble_llm` imported before the load; one with the libraries a load imports
(llama_cpp, transformers' tokenizers, llguidance) imported first, which separates code that stays
mapped once imported from memory close() should have freed; and one with glibc held to a single
malloc arena (MALLOC_ARENA_MAX=1), which shows what the threads' own arenas keep.

    python benchmarks/close_memory.py --out benchmarks/results/close_memory
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROBE = """
import gc, json, sys
import ensemble_llm
from ensemble_llm import Ensemble

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

if sys.argv[1] == "libraries":
    import llama_cpp, llguidance, transformers  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401
gc.collect()
readings = {"before load": rss_mib()}
for cycle in (1, 2):
    engine = Ensemble(["smollm2-135m-instruct", "gemma-3-270m"])
    engine.generate("What is the capital of France?", max_new_tokens=16)
    readings[f"loaded, after a request ({cycle})"] = rss_mib()
    engine.close()
    del engine
    gc.collect()
    readings[f"after close ({cycle})"] = rss_mib()
print(json.dumps(readings))
"""


ROWS = {  # label: (what the probe imports first, extra environment)
    "ensemble_llm only": ("package", {}),
    "ensemble_llm and the libraries": ("libraries", {}),
    "ensemble_llm only, one malloc arena (MALLOC_ARENA_MAX=1)": ("package", {"MALLOC_ARENA_MAX": "1"}),
}


def measure(baseline: str, env: dict) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, baseline], capture_output=True, text=True, check=True, env={**os.environ, **env}
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratio(readings: dict) -> float:
    return readings["after close (2)"] / readings["before load"]


def table(results: dict) -> str:
    """Each row: the median run's readings, then every run's ratio after the second close."""
    first = next(iter(results.values()))[0]
    rows = ["| imported before the load | " + " | ".join(first) + " | after close / before, median | each run |"]
    rows.append("|---" * (len(first) + 3) + "|")
    for label, runs in results.items():
        ratios = [ratio(r) for r in runs]
        median = sorted(runs, key=ratio)[len(runs) // 2]
        each = ", ".join(f"{x:.2f}" for x in ratios)
        cells = " | ".join(f"{v:.0f} MiB" for v in median.values())
        rows.append(f"| {label} | {cells} | {statistics.median(ratios):.2f} | {each} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per row")
    args = parser.parse_args()
    results = {label: [measure(b, env) for _ in range(args.runs)] for label, (b, env) in ROWS.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    note = (
        "# Resident memory around Ensemble.close()\n\nThe bundled pair (default backends), one request of "
        f"16 tokens per load, two load/close cycles, {args.runs} fresh processes per row. Command: "
        "`python benchmarks/close_memory.py --out benchmarks/results/close_memory`.\n\n"
    )
    (args.out / "results.md").write_text(note + table(results) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
