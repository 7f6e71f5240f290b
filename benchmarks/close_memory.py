"""What `Ensemble.close()` gives back: resident memory of a fresh process before the bundled pair
loads, after a request, after close(), and after a second load, request and close (a leak would
grow it). Each reading runs in its own fresh process, twice: once with only `ensemble_llm`
imported before the load, and once with the libraries a load imports (llama_cpp, transformers'
tokenizers, llguidance) imported first, which separates code that stays mapped once imported
from memory close() should have freed.

    python benchmarks/close_memory.py --out benchmarks/results/close_memory
"""

from __future__ import annotations

import argparse
import json
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


def measure(baseline: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, baseline], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict) -> str:
    rows = ["| imported before the load | " + " | ".join(next(iter(results.values()))) + " | after close / before |"]
    rows.append("|---" * (len(next(iter(results.values()))) + 2) + "|")
    for baseline, readings in results.items():
        ratio = readings["after close (2)"] / readings["before load"]
        rows.append(f"| {baseline} | " + " | ".join(f"{v:.0f} MiB" for v in readings.values()) + f" | {ratio:.2f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = {"ensemble_llm only": measure("package"), "ensemble_llm and the libraries": measure("libraries")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    note = (
        "# Resident memory around Ensemble.close()\n\nThe bundled pair (default backends), one request of "
        "16 tokens per load, two load/close cycles, each row a fresh process. Command: "
        "`python benchmarks/close_memory.py --out benchmarks/results/close_memory`.\n\n"
    )
    (args.out / "results.md").write_text(note + table(results) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
